// RangeAllocator: sub-allocates offsets inside one fixed region (a GPU arena or a host pool).
//
// Design: best fit over an address-ordered free list with immediate coalescing.
//  - Free blocks are indexed twice: by (size, offset) to find the smallest block that fits in
//    O(log n), and by offset to merge a freed block with both neighbours in O(log n).
//  - Every size is rounded up to `alignment` (default 256 B, which also satisfies CUDA's
//    alignment rules for any dtype), so internal fragmentation is below one alignment unit
//    per object.
//  - External fragmentation: no two free blocks are ever adjacent (coalescing invariant), and best
//    fit keeps large blocks whole for as long as possible. Free space can still be split into
//    holes smaller than a request; the cache treats a failed allocation like a full tier and
//    evicts LRU entries until a hole big enough appears (their neighbours merge as they go).
//    largest_free_block() and free_block_count() expose the state for benchmarks and stats.
// Invariants: used() + free bytes == capacity(); free blocks never overlap nor touch.
// Memory: the index nodes that Allocate and Free erase are kept (a few of each kind) and reused
// by the next insertions, so steady allocate/free traffic makes no heap allocation.
// Thread-safety: not thread-safe; the owner serializes calls.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <unordered_map>
#include <utility>
#include <vector>

#include "gkv/sanitizers.h"

namespace gkv {

class RangeAllocator {
 public:
  // REQUIRES: alignment is a power of two.
  explicit RangeAllocator(uint64_t capacity, uint64_t alignment = 256);

  // Returns the offset of a block of at least `size` bytes (0 counts as one unit), or nullopt
  // when no free block is large enough.
  std::optional<uint64_t> Allocate(uint64_t size);
  // REQUIRES: `offset` was returned by Allocate and not freed since.
  void Free(uint64_t offset);
  // Bytes reserved for `offset` (its rounded size). REQUIRES: offset is allocated.
  uint64_t BlockSize(uint64_t offset) const;

  uint64_t capacity() const { return capacity_; }
  uint64_t used() const { return used_; }
  uint64_t alignment() const { return alignment_; }
  uint64_t RoundUp(uint64_t size) const;
  uint64_t largest_free_block() const;
  size_t free_block_count() const { return free_by_offset_.size(); }
  size_t allocation_count() const { return allocated_.size(); }

 private:
  void InsertFree(uint64_t offset, uint64_t size);
  void EraseFree(uint64_t offset, uint64_t size);

  uint64_t capacity_;
  uint64_t alignment_;
  uint64_t used_ = 0;
  std::map<uint64_t, uint64_t> free_by_offset_;           // offset -> size
  std::set<std::pair<uint64_t, uint64_t>> free_by_size_;  // (size, offset)
  std::unordered_map<uint64_t, uint64_t> allocated_;      // offset -> size
  // Erased nodes kept for reuse (at most kSpareNodes of each; none under AddressSanitizer).
  static constexpr size_t kSpareNodes = kAddressSanitizer ? 0 : 8;
  std::vector<decltype(free_by_offset_)::node_type> spare_offset_nodes_;
  std::vector<decltype(free_by_size_)::node_type> spare_size_nodes_;
  std::vector<decltype(allocated_)::node_type> spare_allocated_nodes_;
};

}  // namespace gkv
