// The CUDA boundary of gkv: every cudaError_t is translated into a Status here and nowhere
// else. Compiled against the CUDA runtime when the toolkit was found at build time; otherwise
// every call reports NotSupported. Whether a usable GPU exists is decided at run time.
// Thread-safety: all functions are thread-safe.
#pragma once

#include <cstddef>
#include <memory>
#include <string>

#include "gkv/status.h"

namespace gkv {

enum class MemoryKind : uint8_t { kHost = 0, kDevice = 1 };
std::string_view MemoryKindName(MemoryKind kind);

struct CudaProbe {
  bool compiled_in = false;  // built with the CUDA runtime
  bool usable = false;       // at least one device answered
  bool fake = false;         // FakeDeviceMode(): the device is host memory
  int device_count = 0;
  std::string reason;  // why not usable, in one line (empty when usable)
};

// Probes once per process and caches the answer.
const CudaProbe& ProbeCuda();

// Fake-device mode: GKV_FAKE_DEVICE in the environment (read once per process). A stand-in
// for a GPU on machines without one, so that CI runs every device branch of the server, the
// client and the transport: ProbeCuda reports one usable device; "device" memory is host
// memory that this file remembers (IsDevicePointer answers from that registry); copies are
// memcpy; CheckMemoryKind fails when a pointer passed as device memory is not such memory, or
// one passed as host memory is; a synchronous copy on a UCX progress thread fails (a real one
// would stall every request behind the GPU's queue). Two flavours:
//   GKV_FAKE_DEVICE=1    UCX cannot move device memory: every staging path runs;
//   GKV_FAKE_DEVICE=ucx  UCX moves it (the transport hands UCX host memory): the direct
//                        paths a CUDA-capable UCX takes run.
// For tests only.
enum class FakeDevice : uint8_t { kOff, kStaged, kMovedByUcx };
FakeDevice FakeDeviceKind();
bool FakeDeviceMode();  // FakeDeviceKind() != kOff
// Fake-device mode: the copies to, from or within "device" memory made so far in this process
// (tests count how a call stages).
uint64_t FakeDeviceCopies();
// The CUDA device of the calling thread's current context; -1 when the thread has none (it
// never chose a device), without a usable GPU, or in fake-device mode. Creates no context.
int CudaCurrentDevice();
// Makes `device` current on the calling thread and creates (retains) its primary context, so
// that UCX's CUDA transports find one on a thread that progresses a worker. No-op for -1.
Status CudaBindThread(int device);

// The calling thread progresses a UCX worker (UcxTransport's loop marks itself).
void MarkProgressThread();
bool OnProgressThread();
// Marks or unmarks the calling thread (a caller driving a worker for a while); returns what it
// was before, to restore.
bool SetOnProgressThread(bool on);
// OK unless in fake-device mode and [ptr, ptr + size) is not memory of kind `claimed`
// (Internal, with what it was).
Status CheckMemoryKind(const void* ptr, size_t size, MemoryKind claimed);

// Device memory: cudaMalloc/cudaFree on `device`.
Result<void*> CudaMallocDevice(int device, size_t size);
void CudaFreeDevice(int device, void* ptr);
// Pinned host memory: cudaHostAlloc (portable) / cudaFreeHost.
Result<void*> CudaMallocPinnedHost(size_t size);
void CudaFreePinnedHost(void* ptr);
// True if `ptr` is device (or managed) memory according to the CUDA runtime; false for host
// memory, and always false without a usable GPU.
bool IsDevicePointer(const void* ptr);

// The CUDA device that `ptr` (device or managed memory) belongs to, from its pointer
// attributes; -1 for host memory or without a usable GPU (0 for fake-device memory).
int CudaPointerDevice(const void* ptr);
// Waits until the work queued on `stream` (a cudaStream_t) is done; with a null stream, the
// work queued before now on the legacy default stream of `device_ptr`'s device and on every
// blocking stream there (an event recorded on the legacy stream, then waited for). The thread's
// current device is given back. OK without a usable GPU and in fake-device mode.
Status CudaSyncStream(void* stream, const void* device_ptr = nullptr);

// cudaMemcpy (default stream, synchronous) between any two memories; for occasional copies
// outside the cache (staging in the transport and the client).
Status CudaCopySync(void* dst, const void* src, size_t size);

// Copies between any two memories on one CUDA stream owned by this object
// (cudaMemcpyAsync + cudaStreamSynchronize). Thread-safe: calls are serialized on the stream.
class DeviceCopier {
 public:
  // NotSupported without CUDA, Unavailable without a usable device.
  static Result<std::unique_ptr<DeviceCopier>> Create(int device);
  ~DeviceCopier();
  DeviceCopier(const DeviceCopier&) = delete;
  DeviceCopier& operator=(const DeviceCopier&) = delete;

  // Blocks until the copy is done. `dst` and `src` may each be host or device memory.
  Status Copy(void* dst, const void* src, size_t size);
  int device() const { return device_; }

 private:
  DeviceCopier(int device, void* stream) : device_(device), stream_(stream) {}
  int device_;
  void* stream_;  // cudaStream_t, kept opaque so this header has no CUDA types
};

}  // namespace gkv
