// MemoryArena: one contiguous region of memory, allocated once at start, sub-allocated by a
// RangeAllocator. The GPU tier is one arena per configured device (cudaMalloc); the host tier is
// one arena of pinned memory (cudaHostAlloc) when the CUDA runtime works, page-aligned ordinary
// memory (mmap) otherwise. The region is freed only when the arena is destroyed; the cache
// destroys arenas last, after every entry (and every pin) is gone.
// Thread-safety: not thread-safe; the cache serializes Allocate/Free of an arena (or of a
// Slice) under the lock of the placement partition that owns it.
// base() and pointers derived from it may be read and written from any thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "gkv/cuda.h"
#include "gkv/status.h"
#include "gkv/storage/range_allocator.h"

namespace gkv {

class MemoryArena {
 public:
  enum class HostMode { kAuto, kPinned, kPageable };

  // Host memory. kAuto pins when the CUDA runtime is usable and falls back to pageable memory
  // otherwise (pinned() false, backing_note() says why); kPinned fails when it can't pin.
  // Pageable memory is pre-faulted (MAP_POPULATE), so the pool is committed at start rather
  // than page by page under load (where a shortage would show as the OOM killer).
  static Result<std::unique_ptr<MemoryArena>> CreateHost(uint64_t capacity,
                                                         HostMode mode = HostMode::kAuto);
  // Device memory on `device` (cudaMalloc). Unavailable/NotSupported without a usable GPU.
  static Result<std::unique_ptr<MemoryArena>> CreateDevice(int device, uint64_t capacity);
  // `size` bytes of `parent`'s region from `offset`, with an allocator of their own: the cache
  // gives each placement partition one slice of every arena. The slice frees nothing when it is
  // destroyed (the parent owns the memory) and must not outlive the parent; it reports the
  // parent's kind, device, pinning and note. REQUIRES: offset + size <= parent.capacity().
  static std::unique_ptr<MemoryArena> Slice(const MemoryArena& parent, uint64_t offset,
                                            uint64_t size);

  ~MemoryArena();
  MemoryArena(const MemoryArena&) = delete;
  MemoryArena& operator=(const MemoryArena&) = delete;

  // Returns a pointer into the region, or nullptr when no free block fits.
  std::byte* Allocate(uint64_t size);
  // REQUIRES: `p` came from Allocate on this arena and is not freed yet.
  void Free(std::byte* p);
  uint64_t BlockSize(const std::byte* p) const { return allocator_.BlockSize(p - base_); }

  MemoryKind kind() const { return kind_; }
  int device() const { return device_; }
  bool pinned() const { return backing_ == Backing::kCudaPinned; }
  // Why a host arena is not pinned (empty when it is, or for device arenas).
  const std::string& backing_note() const { return note_; }
  std::byte* base() const { return base_; }
  bool Contains(const void* p) const {
    auto* b = static_cast<const std::byte*>(p);
    return b >= base_ && b < base_ + allocator_.capacity();
  }
  const RangeAllocator& allocator() const { return allocator_; }
  uint64_t capacity() const { return allocator_.capacity(); }
  uint64_t used() const { return allocator_.used(); }

 private:
  enum class Backing { kMmap, kCudaPinned, kCudaDevice };
  MemoryArena(MemoryKind kind, Backing backing, int device, std::byte* base, uint64_t size)
      : kind_(kind),
        backing_(backing),
        device_(device),
        base_(base),
        mapped_size_(size),
        allocator_(size) {}

  MemoryKind kind_;
  Backing backing_;
  int device_;
  std::byte* base_;
  uint64_t mapped_size_;
  RangeAllocator allocator_;
  std::string note_;
  bool owns_memory_ = true;  // false for a Slice
};

}  // namespace gkv
