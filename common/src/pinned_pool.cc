#include "gkv/pinned_pool.h"

#include <new>

#include "gkv/cuda.h"

namespace gkv {

std::shared_ptr<PinnedBufferPool> PinnedBufferPool::Create(Options options) {
  return std::shared_ptr<PinnedBufferPool>(new PinnedBufferPool(options));
}

PinnedBufferPool::~PinnedBufferPool() {
  for (auto& [capacity, block] : free_) Free(block);
  for (const Block& block : to_free_) Free(block);
}

void PinnedBufferPool::FreeDeferred() {
  std::vector<Block> blocks;
  {
    std::lock_guard<std::mutex> lock(mu_);
    blocks.swap(to_free_);
  }
  for (const Block& block : blocks) Free(block);
}

void PinnedBufferPool::Warm(uint64_t size) {
  uint64_t capacity = options_.min_buffer;
  while (capacity < size) capacity <<= 1;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stats_.cached_bytes + capacity > options_.max_cached_bytes) return;
    auto it = free_.lower_bound(capacity);
    if (it != free_.end() && it->first <= 4 * capacity) return;  // one fits already
  }
  (void)Acquire(size);  // dropped at once: it goes into the cache
}

void PinnedBufferPool::Free(const Block& block) {
  if (block.pinned) {
    CudaFreePinnedHost(block.data);
  } else {
    ::operator delete[](block.data, std::align_val_t{64});
  }
}

bool PinnedBufferPool::TakeCached(uint64_t* capacity, Block* block) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = free_.lower_bound(*capacity);
  // A cached buffer much larger than needed stays for a request of its own size.
  if (it == free_.end() || it->first > 4 * *capacity) return false;
  *capacity = it->first;
  *block = it->second;
  free_.erase(it);
  stats_.cached_bytes -= *capacity;
  ++stats_.reuses;
  return true;
}

std::shared_ptr<std::byte[]> PinnedBufferPool::Wrap(uint64_t capacity, Block block) {
  // The deleter gives the buffer back (or frees it, once the pool is gone).
  std::weak_ptr<PinnedBufferPool> owner = weak_from_this();
  return std::shared_ptr<std::byte[]>(block.data, [owner, capacity, block](std::byte*) {
    if (auto pool = owner.lock()) {
      pool->Return(capacity, block);
    } else {
      Free(block);
    }
  });
}

std::shared_ptr<std::byte[]> PinnedBufferPool::TryAcquireCached(uint64_t size) {
  uint64_t capacity = options_.min_buffer;
  while (capacity < size) capacity <<= 1;
  Block block{nullptr, false};
  if (!TakeCached(&capacity, &block)) return nullptr;
  return Wrap(capacity, block);
}

Result<std::shared_ptr<std::byte[]>> PinnedBufferPool::Acquire(uint64_t size) {
  FreeDeferred();
  uint64_t capacity = options_.min_buffer;
  while (capacity < size) capacity <<= 1;
  if (capacity > options_.max_cached_bytes) {  // too large to keep: ordinary memory
    auto* p = static_cast<std::byte*>(::operator new[](size, std::align_val_t{64}, std::nothrow));
    if (!p) return Status::NoSpace("no memory for a staging buffer of " + std::to_string(size));
    return std::shared_ptr<std::byte[]>(
        p, [](std::byte* q) { ::operator delete[](q, std::align_val_t{64}); });
  }
  Block block{nullptr, false};
  if (!TakeCached(&capacity, &block)) {
    auto pinned = CudaMallocPinnedHost(capacity);
    if (pinned.ok()) {
      block = {static_cast<std::byte*>(*pinned), true};
    } else {
      auto* p =
          static_cast<std::byte*>(::operator new[](capacity, std::align_val_t{64}, std::nothrow));
      if (!p) return Status::NoSpace("no memory for a staging buffer of " + std::to_string(size));
      block = {p, false};
    }
    std::lock_guard<std::mutex> lock(mu_);
    ++stats_.allocations;
    if (block.pinned) ++stats_.pinned_allocations;
  }
  return Wrap(capacity, block);
}

void PinnedBufferPool::Return(uint64_t capacity, Block block) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stats_.cached_bytes + capacity <= options_.max_cached_bytes) {
      free_.emplace(capacity, block);
      stats_.cached_bytes += capacity;
      return;
    }
    // cudaFreeHost is synchronous: never on a thread that progresses a UCX worker.
    if (block.pinned && OnProgressThread()) {
      to_free_.push_back(block);
      return;
    }
  }
  Free(block);
}

PinnedBufferPool::Stats PinnedBufferPool::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

}  // namespace gkv
