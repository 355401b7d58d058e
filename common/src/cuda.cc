#include "gkv/cuda.h"

#include <mutex>

#include "gkv/log.h"

#ifdef GKV_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace gkv {

std::string_view MemoryKindName(MemoryKind kind) {
  return kind == MemoryKind::kDevice ? "device" : "host";
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

const CudaProbe& ProbeCuda() {
  static const CudaProbe probe = [] {
    CudaProbe p;
    p.compiled_in = true;
    int count = 0;
    cudaError_t err = cudaGetDeviceCount(&count);
    if (err != cudaSuccess) {
      p.reason = std::string("CUDA runtime reports ") + cudaGetErrorName(err) + ": " +
                 cudaGetErrorString(err);
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
  if (!ProbeCuda().usable) return Status::Unavailable(ProbeCuda().reason);
  GKV_RETURN_IF_ERROR(FromCuda(cudaSetDevice(device), "cudaSetDevice"));
  void* p = nullptr;
  GKV_RETURN_IF_ERROR(FromCuda(cudaMalloc(&p, size), "cudaMalloc"));
  return p;
}

void CudaFreeDevice(int device, void* ptr) {
  if (!ptr) return;
  cudaSetDevice(device);
  cudaError_t err = cudaFree(ptr);
  if (err != cudaSuccess) GKV_LOG_WARN("cudaFree failed: {}", cudaGetErrorString(err));
}

Result<void*> CudaMallocPinnedHost(size_t size) {
  if (!ProbeCuda().usable) return Status::Unavailable(ProbeCuda().reason);
  void* p = nullptr;
  GKV_RETURN_IF_ERROR(FromCuda(cudaHostAlloc(&p, size, cudaHostAllocPortable), "cudaHostAlloc"));
  return p;
}

void CudaFreePinnedHost(void* ptr) {
  if (!ptr) return;
  cudaError_t err = cudaFreeHost(ptr);
  if (err != cudaSuccess) GKV_LOG_WARN("cudaFreeHost failed: {}", cudaGetErrorString(err));
}

bool IsDevicePointer(const void* ptr) {
  if (!ProbeCuda().usable || ptr == nullptr) return false;
  cudaPointerAttributes attr{};
  if (cudaPointerGetAttributes(&attr, ptr) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky-free error for plain host pointers
    return false;
  }
  return attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged;
}

Status CudaCopySync(void* dst, const void* src, size_t size) {
  if (!ProbeCuda().usable) return Status::Unavailable(ProbeCuda().reason);
  if (size == 0) return Status::OK();
  return FromCuda(cudaMemcpy(dst, src, size, cudaMemcpyDefault), "cudaMemcpy");
}

Result<std::unique_ptr<DeviceCopier>> DeviceCopier::Create(int device) {
  if (!ProbeCuda().usable) return Status::Unavailable(ProbeCuda().reason);
  GKV_RETURN_IF_ERROR(FromCuda(cudaSetDevice(device), "cudaSetDevice"));
  cudaStream_t stream;
  GKV_RETURN_IF_ERROR(
      FromCuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate"));
  return std::unique_ptr<DeviceCopier>(new DeviceCopier(device, stream));
}

DeviceCopier::~DeviceCopier() {
  cudaSetDevice(device_);
  cudaStreamDestroy(static_cast<cudaStream_t>(stream_));
}

Status DeviceCopier::Copy(void* dst, const void* src, size_t size) {
  if (size == 0) return Status::OK();
  auto stream = static_cast<cudaStream_t>(stream_);
  // cudaSetDevice is per thread; every calling thread needs the right current device.
  GKV_RETURN_IF_ERROR(FromCuda(cudaSetDevice(device_), "cudaSetDevice"));
  GKV_RETURN_IF_ERROR(
      FromCuda(cudaMemcpyAsync(dst, src, size, cudaMemcpyDefault, stream), "cudaMemcpyAsync"));
  return FromCuda(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
}

#else  // !GKV_HAVE_CUDA

const CudaProbe& ProbeCuda() {
  static const CudaProbe probe = [] {
    CudaProbe p;
    p.reason = "gkv was built without the CUDA toolkit";
    return p;
  }();
  return probe;
}

Result<void*> CudaMallocDevice(int, size_t) { return Status::NotSupported(ProbeCuda().reason); }
void CudaFreeDevice(int, void*) {}
Result<void*> CudaMallocPinnedHost(size_t) { return Status::NotSupported(ProbeCuda().reason); }
void CudaFreePinnedHost(void*) {}
bool IsDevicePointer(const void*) { return false; }
Status CudaCopySync(void*, const void*, size_t) { return Status::NotSupported(ProbeCuda().reason); }
Result<std::unique_ptr<DeviceCopier>> DeviceCopier::Create(int) {
  return Status::NotSupported(ProbeCuda().reason);
}
DeviceCopier::~DeviceCopier() = default;
Status DeviceCopier::Copy(void*, const void*, size_t) {
  return Status::NotSupported(ProbeCuda().reason);
}

#endif

}  // namespace gkv
