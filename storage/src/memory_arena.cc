#include "gkv/storage/memory_arena.h"

#include <sys/mman.h>

#include <cerrno>
#include <cstring>

namespace gkv {

Result<std::unique_ptr<MemoryArena>> MemoryArena::CreateHost(uint64_t capacity, HostMode mode) {
  if (capacity == 0) return Status::InvalidArgument("host pool capacity is zero");
  std::string note;
  if (mode != HostMode::kPageable && ProbeCuda().usable) {
    auto pinned = CudaMallocPinnedHost(capacity);
    if (pinned.ok()) {
      return std::unique_ptr<MemoryArena>(new MemoryArena(
          MemoryKind::kHost, Backing::kCudaPinned, -1, static_cast<std::byte*>(*pinned), capacity));
    }
    if (mode == HostMode::kPinned) return pinned.status().WithContext("pinning the host pool");
    note = "cudaHostAlloc failed: " + pinned.status().ToString();
  } else if (mode == HostMode::kPinned) {
    return Status::Unavailable("cannot pin the host pool: " + ProbeCuda().reason);
  } else {
    note = mode == HostMode::kPageable ? "pageable memory requested" : ProbeCuda().reason;
  }
  // Page-aligned, and pre-faulted (MAP_POPULATE) so the pool is really reserved now; populating
  // is best effort (the kernel does not report a shortfall), so a shortage can still appear
  // later, but not as a pool that was never committed.
  void* p = mmap(nullptr, capacity, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
  if (p == MAP_FAILED) {
    return Status::NoSpace(std::string("mmap of the host pool failed: ") + std::strerror(errno));
  }
  auto arena = std::unique_ptr<MemoryArena>(
      new MemoryArena(MemoryKind::kHost, Backing::kMmap, -1, static_cast<std::byte*>(p), capacity));
  arena->note_ = std::move(note);
  return arena;
}

Result<std::unique_ptr<MemoryArena>> MemoryArena::CreateDevice(int device, uint64_t capacity) {
  if (capacity == 0) return Status::InvalidArgument("GPU arena capacity is zero");
  GKV_ASSIGN_OR_RETURN(void* p, CudaMallocDevice(device, capacity));
  return std::unique_ptr<MemoryArena>(new MemoryArena(
      MemoryKind::kDevice, Backing::kCudaDevice, device, static_cast<std::byte*>(p), capacity));
}

std::unique_ptr<MemoryArena> MemoryArena::Slice(const MemoryArena& parent, uint64_t offset,
                                                uint64_t size) {
  auto slice = std::unique_ptr<MemoryArena>(
      new MemoryArena(parent.kind_, parent.backing_, parent.device_, parent.base_ + offset, size));
  slice->note_ = parent.note_;
  slice->owns_memory_ = false;
  return slice;
}

MemoryArena::~MemoryArena() {
  if (!owns_memory_) return;
  switch (backing_) {
    case Backing::kMmap:
      munmap(base_, mapped_size_);
      break;
    case Backing::kCudaPinned:
      CudaFreePinnedHost(base_);
      break;
    case Backing::kCudaDevice:
      CudaFreeDevice(device_, base_);
      break;
  }
}

std::byte* MemoryArena::Allocate(uint64_t size) {
  auto off = allocator_.Allocate(size);
  return off ? base_ + *off : nullptr;
}

void MemoryArena::Free(std::byte* p) { allocator_.Free(static_cast<uint64_t>(p - base_)); }

}  // namespace gkv
