// PinnedBufferPool: reusable pinned host buffers for staging device bytes (a device buffer this
// UCX cannot send from or receive into goes through one). cudaHostAlloc costs milliseconds and
// pageable memory makes every device copy a two-step, synchronous one, so buffers are kept and
// handed out again: Acquire returns one of at least the size asked for (sizes rounded up to a
// power of two of at least min_buffer, so that later requests of similar sizes fit), and a
// buffer goes back to the pool when its last reference is dropped; the pool keeps at most
// max_cached_bytes of them and frees the rest. When pinning fails (no usable GPU) buffers are
// ordinary memory, which still works. Thread-safe; buffers may outlive the pool.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "gkv/status.h"

namespace gkv {

class PinnedBufferPool : public std::enable_shared_from_this<PinnedBufferPool> {
 public:
  struct Options {
    uint64_t min_buffer = uint64_t{1} << 20;
    uint64_t max_cached_bytes = uint64_t{256} << 20;
  };
  struct Stats {
    uint64_t allocations = 0;         // buffers made (pinned or not)
    uint64_t pinned_allocations = 0;  // of which pinned
    uint64_t reuses = 0;              // Acquires answered from the pool
    uint64_t cached_bytes = 0;        // held for reuse now
  };

  static std::shared_ptr<PinnedBufferPool> Create(Options options);
  ~PinnedBufferPool();
  PinnedBufferPool(const PinnedBufferPool&) = delete;
  PinnedBufferPool& operator=(const PinnedBufferPool&) = delete;

  // A buffer of at least `size` bytes (size 0 gets the smallest). NoSpace when no memory is left.
  // One larger than max_cached_bytes is ordinary memory, freed when dropped (pinning and
  // unpinning it on every call would cost more than it saves). May allocate (cudaHostAlloc:
  // milliseconds, synchronous): not on a UCX progress thread.
  Result<std::shared_ptr<std::byte[]>> Acquire(uint64_t size);
  // Puts a buffer of at least `size` bytes in the cache for a later TryAcquireCached, when one
  // would be kept (room under max_cached_bytes) and none is cached yet. Not on a progress thread.
  void Warm(uint64_t size);
  // A cached buffer of at least `size` bytes, or null when none is: never allocates, so any
  // thread may call it. (Acquire and drop a buffer to put one in the cache for later.)
  std::shared_ptr<std::byte[]> TryAcquireCached(uint64_t size);
  Stats stats() const;

 private:
  struct Block {
    std::byte* data;
    bool pinned;
  };
  explicit PinnedBufferPool(Options options) : options_(options) {}
  // Takes a cached block of at least *capacity bytes (within 4x); sets *capacity to its size.
  bool TakeCached(uint64_t* capacity, Block* block);
  std::shared_ptr<std::byte[]> Wrap(uint64_t capacity, Block block);
  void Return(uint64_t capacity, Block block);
  static void Free(const Block& block);

  const Options options_;
  mutable std::mutex mu_;
  std::multimap<uint64_t, Block> free_;  // by capacity; guarded by mu_
  // Pinned blocks dropped on a UCX progress thread with no room in the cache: freed by the next
  // Acquire or Warm (cudaFreeHost is synchronous), or by the destructor. Guarded by mu_.
  std::vector<Block> to_free_;
  void FreeDeferred();
  Stats stats_;  // guarded by mu_
};

}  // namespace gkv
