#include "gkv/cuda.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>

#include "gkv/log.h"

#ifdef GKV_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace gkv {

std::string_view MemoryKindName(MemoryKind kind) {
  return kind == MemoryKind::kDevice ? "device" : "host";
}

FakeDevice FakeDeviceKind() {
  static const FakeDevice kind = [] {
    const char* v = std::getenv("GKV_FAKE_DEVICE");
    if (v == nullptr) return FakeDevice::kOff;
    if (std::strcmp(v, "1") == 0) return FakeDevice::kStaged;
    if (std::strcmp(v, "ucx") == 0) return FakeDevice::kMovedByUcx;
    return FakeDevice::kOff;
  }();
  return kind;
}

bool FakeDeviceMode() { return FakeDeviceKind() != FakeDevice::kOff; }

namespace {
thread_local bool progress_thread = false;
}  // namespace

void MarkProgressThread() { progress_thread = true; }
bool OnProgressThread() { return progress_thread; }
bool SetOnProgressThread(bool on) {
  const bool was = progress_thread;
  progress_thread = on;
  return was;
}

namespace {

// Fake-device memory: start -> size of every live "device" allocation.
struct FakeRegistry {
  std::mutex mu;
  std::map<const std::byte*, size_t> blocks;

  static FakeRegistry& Get() {
    static FakeRegistry* r = new FakeRegistry();  // never destroyed: used at exit
    return *r;
  }
  // The block holding `p`, if any: its start and size.
  bool Find(const void* p, const std::byte** start, size_t* size) {
    auto b = static_cast<const std::byte*>(p);
    std::lock_guard<std::mutex> lock(mu);
    auto it = blocks.upper_bound(b);
    if (it == blocks.begin()) return false;
    --it;
    if (b >= it->first + it->second) return false;
    *start = it->first;
    *size = it->second;
    return true;
  }
};

Result<void*> FakeMallocDevice(size_t size) {
  // Poisoned, so a read of bytes never written is visible as 0xdb.
  void* p = std::aligned_alloc(256, (std::max<size_t>(size, 1) + 255) / 256 * 256);
  if (!p) return Status::NoSpace("fake device: out of host memory");
  std::memset(p, 0xdb, size);
  FakeRegistry& r = FakeRegistry::Get();
  std::lock_guard<std::mutex> lock(r.mu);
  r.blocks[static_cast<const std::byte*>(p)] = std::max<size_t>(size, 1);
  return p;
}

void FakeFreeDevice(void* p) {
  if (!p) return;
  FakeRegistry& r = FakeRegistry::Get();
  {
    std::lock_guard<std::mutex> lock(r.mu);
    if (r.blocks.erase(static_cast<const std::byte*>(p)) == 0) {
      GKV_LOG_ERROR("fake device: freeing {} which is not device memory", p);
      return;
    }
  }
  std::free(p);
}

std::atomic<uint64_t> g_fake_copies{0};  // FakeDeviceCopies()

Status FakeCopy(void* dst, const void* src, size_t size) {
  if (OnProgressThread()) {
    GKV_LOG_ERROR("fake device: a synchronous device copy on a UCX progress thread");
    return Status::Internal("fake device: synchronous device copy on a UCX progress thread");
  }
  // A range that starts in a device allocation must end in it, as cudaMemcpy requires.
  for (const void* p : {static_cast<const void*>(dst), src}) {
    const std::byte* start;
    size_t block;
    if (size && FakeRegistry::Get().Find(p, &start, &block) &&
        static_cast<const std::byte*>(p) + size > start + block) {
      return Status::InvalidArgument("fake device: a device range runs past its allocation");
    }
  }
  if (size) std::memcpy(dst, src, size);
  g_fake_copies.fetch_add(1, std::memory_order_relaxed);
  return Status::OK();
}

bool FakeIsDevice(const void* p) {
  const std::byte* start;
  size_t size;
  return p != nullptr && FakeRegistry::Get().Find(p, &start, &size);
}

}  // namespace

uint64_t FakeDeviceCopies() { return g_fake_copies.load(std::memory_order_relaxed); }

Status CheckMemoryKind(const void* ptr, size_t size, MemoryKind claimed) {
  if (!FakeDeviceMode() || ptr == nullptr || size == 0) return Status::OK();
  const std::byte* start;
  size_t block;
  const bool device = FakeRegistry::Get().Find(ptr, &start, &block);
  if (claimed == MemoryKind::kHost) {
    if (!device) return Status::OK();
    return Status::Internal("fake device: device memory passed as host memory");
  }
  if (!device) return Status::Internal("fake device: host memory passed as device memory");
  if (static_cast<const std::byte*>(ptr) + size > start + block) {
    return Status::Internal("fake device: a device range runs past its allocation");
  }
  return Status::OK();
}

#ifdef GKV_HAVE_CUDA
namespace {

Status FromCuda(cudaError_t err, std::string_view what) {
  if (err == cudaSuccess) return Status::OK();
  std::string m(what);
  m += ": ";
  m += cudaGetErrorName(err);
  m += " (";
  m += cudaGetErrorString(err);
  m += ")";
  if (err == cudaErrorMemoryAllocation) return Status::NoSpace(m);
  if (err == cudaErrorNoDevice || err == cudaErrorInsufficientDriver) return Status::Unavailable(m);
  return Status::IOError(m);
}

}  // namespace

namespace {
CudaProbe FakeProbe() {
  CudaProbe p;
  p.usable = true;
  p.fake = true;
  p.device_count = 1;
  return p;
}
}  // namespace

const CudaProbe& ProbeCuda() {
  static const CudaProbe probe = [] {
    if (FakeDeviceMode()) return FakeProbe();
    CudaProbe p;
    p.compiled_in = true;
    int count = 0;
    cudaError_t err = cudaGetDeviceCount(&count);
    if (err != cudaSuccess) {
      p.reason = std::string("CUDA runtime reports ") + cudaGetErrorName(err) + ": " +
                 cudaGetErrorString(err);
      // The runtime says "insufficient driver" with no driver at all too: tell the two apart
      // (a CUDA 12 driver under gkv's CUDA 13 runtime is the case a user can act on).
      int driver = 0, runtime = 0;
      if (err == cudaErrorInsufficientDriver && cudaDriverGetVersion(&driver) == cudaSuccess &&
          cudaRuntimeGetVersion(&runtime) == cudaSuccess) {
        const auto version = [](int v) {
          return std::to_string(v / 1000) + "." + std::to_string(v % 1000 / 10);
        };
        if (driver == 0) {
          p.reason =
              "no NVIDIA driver on this machine (libcuda.so.1 not found): the GPU paths "
              "are off";
        } else {
          p.reason = "the NVIDIA driver supports CUDA " + version(driver) +
                     ", older than the CUDA " + version(runtime) +
                     " runtime gkv was built with (it needs a driver for CUDA " +
                     std::to_string(runtime / 1000) +
                     ".0 or newer): update the driver, or build gkv against the CUDA toolkit "
                     "the driver supports (python/README.md)";
        }
      }
      return p;
    }
    if (count == 0) {
      p.reason = "CUDA runtime found no device";
      return p;
    }
    p.usable = true;
    p.device_count = count;
    return p;
  }();
  return probe;
}

Result<void*> CudaMallocDevice(int device, size_t size) {
  if (FakeDeviceMode()) return FakeMallocDevice(size);
  if (!ProbeCuda().usable) return Status::Unavailable(ProbeCuda().reason);
  GKV_RETURN_IF_ERROR(FromCuda(cudaSetDevice(device), "cudaSetDevice"));
  void* p = nullptr;
  GKV_RETURN_IF_ERROR(FromCuda(cudaMalloc(&p, size), "cudaMalloc"));
  return p;
}

void CudaFreeDevice(int device, void* ptr) {
  if (!ptr) return;
  if (FakeDeviceMode()) return FakeFreeDevice(ptr);
  cudaSetDevice(device);
  cudaError_t err = cudaFree(ptr);
  if (err != cudaSuccess) GKV_LOG_WARN("cudaFree failed: {}", cudaGetErrorString(err));
}

Result<void*> CudaMallocPinnedHost(size_t size) {
  if (FakeDeviceMode()) {
    void* h = std::malloc(std::max<size_t>(size, 1));
    if (!h) return Status::NoSpace("fake device: out of host memory");
    return h;
  }
  if (!ProbeCuda().usable) return Status::Unavailable(ProbeCuda().reason);
  void* p = nullptr;
  GKV_RETURN_IF_ERROR(FromCuda(cudaHostAlloc(&p, size, cudaHostAllocPortable), "cudaHostAlloc"));
  return p;
}

void CudaFreePinnedHost(void* ptr) {
  if (!ptr) return;
  if (FakeDeviceMode()) return std::free(ptr);
  cudaError_t err = cudaFreeHost(ptr);
  if (err != cudaSuccess) GKV_LOG_WARN("cudaFreeHost failed: {}", cudaGetErrorString(err));
}

bool IsDevicePointer(const void* ptr) {
  if (FakeDeviceMode()) return FakeIsDevice(ptr);
  if (!ProbeCuda().usable || ptr == nullptr) return false;
  cudaPointerAttributes attr{};
  if (cudaPointerGetAttributes(&attr, ptr) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky-free error for plain host pointers
    return false;
  }
  return attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged;
}

namespace {
// Makes `device` current on this thread for its scope and gives the thread its own device back
// afterwards: the client copies on its caller's threads, whose current device is theirs. A
// thread that had no context keeps the one made for `device` (nothing to go back to, and
// choosing device 0 again would make a context there).
class ScopedCudaDevice {
 public:
  explicit ScopedCudaDevice(int device) : device_(device), previous_(CudaCurrentDevice()) {
    if (previous_ != device_) status_ = FromCuda(cudaSetDevice(device_), "cudaSetDevice");
  }
  ~ScopedCudaDevice() {
    if (previous_ >= 0 && previous_ != device_) cudaSetDevice(previous_);
  }
  const Status& status() const { return status_; }

 private:
  const int device_;
  const int previous_;
  Status status_;
};
}  // namespace

int CudaPointerDevice(const void* ptr) {
  if (FakeDeviceMode()) return FakeIsDevice(ptr) ? 0 : -1;
  if (!ProbeCuda().usable || ptr == nullptr) return -1;
  cudaPointerAttributes attr{};
  if (cudaPointerGetAttributes(&attr, ptr) != cudaSuccess) {
    cudaGetLastError();
    return -1;
  }
  return attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged ? attr.device : -1;
}

Status CudaSyncStream(void* stream, const void* device_ptr) {
  if (FakeDeviceMode() || !ProbeCuda().usable) return Status::OK();
  if (stream) {
    return FromCuda(cudaStreamSynchronize(static_cast<cudaStream_t>(stream)),
                    "cudaStreamSynchronize");
  }
  // The legacy default stream of the buffer's device. Synchronizing that stream would not wait
  // for the blocking streams; an event recorded on it (an action queued there) does.
  const int device = CudaPointerDevice(device_ptr);
  ScopedCudaDevice on(device >= 0 ? device : 0);
  GKV_RETURN_IF_ERROR(on.status());
  cudaEvent_t event;
  GKV_RETURN_IF_ERROR(
      FromCuda(cudaEventCreateWithFlags(&event, cudaEventDisableTiming), "cudaEventCreate"));
  Status s = FromCuda(cudaEventRecord(event, cudaStreamLegacy), "cudaEventRecord");
  if (s.ok()) s = FromCuda(cudaEventSynchronize(event), "cudaEventSynchronize");
  cudaEventDestroy(event);
  return s;
}

int CudaCurrentDevice() {
  if (FakeDeviceMode() || !ProbeCuda().usable) return -1;
  // Only a thread that has a context says which device it works on: cudaGetDevice answers 0
  // for one that never chose, and binding that would put a context on GPU 0 for every process
  // (the CLI, host-only nodes, a rank that sets its device later). The driver's
  // cuCtxGetCurrent tells, reached through the runtime so gkv links no libcuda.
  using CtxGetCurrent = int (*)(void**);
  static const CtxGetCurrent get_current = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuCtxGetCurrent", &fn, 12000, cudaEnableDefault,
                                         &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      cudaGetLastError();
      return CtxGetCurrent{nullptr};
    }
    return reinterpret_cast<CtxGetCurrent>(fn);
  }();
  void* ctx = nullptr;
  if (get_current == nullptr || get_current(&ctx) != 0 || ctx == nullptr) return -1;
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) {
    cudaGetLastError();
    return -1;
  }
  return device;
}

Status CudaBindThread(int device) {
  if (device < 0 || FakeDeviceMode() || !ProbeCuda().usable) return Status::OK();
  GKV_RETURN_IF_ERROR(FromCuda(cudaSetDevice(device), "cudaSetDevice"));
  // cudaFree(nullptr) is the documented way to create the context without allocating.
  return FromCuda(cudaFree(nullptr), "cudaFree(nullptr) to create the context");
}

Status CudaCopySync(void* dst, const void* src, size_t size) {
  if (size == 0) return Status::OK();
  if (FakeDeviceMode()) return FakeCopy(dst, src, size);
  if (!ProbeCuda().usable) return Status::Unavailable(ProbeCuda().reason);
  return FromCuda(cudaMemcpy(dst, src, size, cudaMemcpyDefault), "cudaMemcpy");
}

Result<std::unique_ptr<DeviceCopier>> DeviceCopier::Create(int device) {
  if (FakeDeviceMode()) return std::unique_ptr<DeviceCopier>(new DeviceCopier(device, nullptr));
  if (!ProbeCuda().usable) return Status::Unavailable(ProbeCuda().reason);
  ScopedCudaDevice on(device);
  GKV_RETURN_IF_ERROR(on.status());
  cudaStream_t stream;
  GKV_RETURN_IF_ERROR(
      FromCuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate"));
  return std::unique_ptr<DeviceCopier>(new DeviceCopier(device, stream));
}

DeviceCopier::~DeviceCopier() {
  if (stream_ == nullptr) return;  // fake device
  ScopedCudaDevice on(device_);
  cudaStreamDestroy(static_cast<cudaStream_t>(stream_));
}

Status DeviceCopier::Copy(void* dst, const void* src, size_t size) {
  if (size == 0) return Status::OK();
  if (stream_ == nullptr) return FakeCopy(dst, src, size);  // fake device
  auto stream = static_cast<cudaStream_t>(stream_);
  // The stream's device current for the copy, and the caller's own given back after it.
  ScopedCudaDevice on(device_);
  GKV_RETURN_IF_ERROR(on.status());
  GKV_RETURN_IF_ERROR(
      FromCuda(cudaMemcpyAsync(dst, src, size, cudaMemcpyDefault, stream), "cudaMemcpyAsync"));
  return FromCuda(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
}

#else  // !GKV_HAVE_CUDA

const CudaProbe& ProbeCuda() {
  static const CudaProbe probe = [] {
    CudaProbe p;
    if (FakeDeviceMode()) {
      p.usable = true;
      p.fake = true;
      p.device_count = 1;
      return p;
    }
    p.reason = "gkv was built without the CUDA toolkit";
    return p;
  }();
  return probe;
}

Result<void*> CudaMallocDevice(int, size_t size) {
  if (FakeDeviceMode()) return FakeMallocDevice(size);
  return Status::NotSupported(ProbeCuda().reason);
}
void CudaFreeDevice(int, void* ptr) {
  if (FakeDeviceMode()) FakeFreeDevice(ptr);
}
Result<void*> CudaMallocPinnedHost(size_t size) {
  if (FakeDeviceMode()) {
    void* h = std::malloc(std::max<size_t>(size, 1));
    if (!h) return Status::NoSpace("fake device: out of host memory");
    return h;
  }
  return Status::NotSupported(ProbeCuda().reason);
}
void CudaFreePinnedHost(void* ptr) {
  if (FakeDeviceMode()) std::free(ptr);
}
bool IsDevicePointer(const void* ptr) { return FakeDeviceMode() && FakeIsDevice(ptr); }
int CudaPointerDevice(const void* ptr) { return IsDevicePointer(ptr) ? 0 : -1; }
Status CudaSyncStream(void*, const void*) { return Status::OK(); }
int CudaCurrentDevice() { return -1; }
Status CudaBindThread(int) { return Status::OK(); }
Status CudaCopySync(void* dst, const void* src, size_t size) {
  if (FakeDeviceMode()) return FakeCopy(dst, src, size);
  return Status::NotSupported(ProbeCuda().reason);
}
Result<std::unique_ptr<DeviceCopier>> DeviceCopier::Create(int device) {
  if (FakeDeviceMode()) return std::unique_ptr<DeviceCopier>(new DeviceCopier(device, nullptr));
  return Status::NotSupported(ProbeCuda().reason);
}
DeviceCopier::~DeviceCopier() = default;
Status DeviceCopier::Copy(void* dst, const void* src, size_t size) {
  if (FakeDeviceMode()) return FakeCopy(dst, src, size);
  return Status::NotSupported(ProbeCuda().reason);
}

#endif

}  // namespace gkv
