#include "gkv/storage/range_allocator.h"

#include <cassert>

namespace gkv {
namespace {

// Inserts key -> value into `m` through a node kept in `spares` when there is one (no
// allocation), else a new one.
template <class Map>
void InsertReusing(Map& m, std::vector<typename Map::node_type>& spares, typename Map::key_type key,
                   typename Map::mapped_type value) {
  if (spares.empty()) {
    m.emplace(key, value);
    return;
  }
  auto node = std::move(spares.back());
  spares.pop_back();
  node.key() = key;
  node.mapped() = value;
  m.insert(std::move(node));
}

// Keeps an extracted node (if any) for reuse, up to `most` of them; the rest are freed.
template <class Node>
void Keep(std::vector<Node>& spares, Node node, size_t most) {
  if (node && spares.size() < most) spares.push_back(std::move(node));
}

}  // namespace

RangeAllocator::RangeAllocator(uint64_t capacity, uint64_t alignment)
    : capacity_(capacity & ~(alignment - 1)), alignment_(alignment) {
  assert((alignment & (alignment - 1)) == 0);
  spare_offset_nodes_.reserve(kSpareNodes);
  spare_size_nodes_.reserve(kSpareNodes);
  spare_allocated_nodes_.reserve(kSpareNodes);
  if (capacity_ > 0) InsertFree(0, capacity_);
}

uint64_t RangeAllocator::RoundUp(uint64_t size) const {
  if (size == 0) size = 1;
  return (size + alignment_ - 1) & ~(alignment_ - 1);
}

std::optional<uint64_t> RangeAllocator::Allocate(uint64_t size) {
  if (size > capacity_) return std::nullopt;
  const uint64_t need = RoundUp(size);
  auto it = free_by_size_.lower_bound({need, 0});
  if (it == free_by_size_.end()) return std::nullopt;
  const auto [block_size, offset] = *it;
  EraseFree(offset, block_size);
  if (block_size > need) InsertFree(offset + need, block_size - need);
  InsertReusing(allocated_, spare_allocated_nodes_, offset, need);
  used_ += need;
  return offset;
}

void RangeAllocator::Free(uint64_t offset) {
  auto a = allocated_.find(offset);
  assert(a != allocated_.end());
  if (a == allocated_.end()) return;
  uint64_t start = offset;
  uint64_t size = a->second;
  used_ -= size;
  Keep(spare_allocated_nodes_, allocated_.extract(a), kSpareNodes);

  auto next = free_by_offset_.find(start + size);
  if (next != free_by_offset_.end()) {
    uint64_t next_size = next->second;
    EraseFree(next->first, next_size);
    size += next_size;
  }
  auto after = free_by_offset_.lower_bound(start);
  if (after != free_by_offset_.begin()) {
    auto prev = std::prev(after);
    if (prev->first + prev->second == start) {
      uint64_t prev_start = prev->first, prev_size = prev->second;
      EraseFree(prev_start, prev_size);
      start = prev_start;
      size += prev_size;
    }
  }
  InsertFree(start, size);
}

uint64_t RangeAllocator::BlockSize(uint64_t offset) const {
  auto a = allocated_.find(offset);
  return a == allocated_.end() ? 0 : a->second;
}

uint64_t RangeAllocator::largest_free_block() const {
  return free_by_size_.empty() ? 0 : free_by_size_.rbegin()->first;
}

void RangeAllocator::InsertFree(uint64_t offset, uint64_t size) {
  InsertReusing(free_by_offset_, spare_offset_nodes_, offset, size);
  if (spare_size_nodes_.empty()) {
    free_by_size_.emplace(size, offset);
  } else {
    auto node = std::move(spare_size_nodes_.back());
    spare_size_nodes_.pop_back();
    node.value() = {size, offset};
    free_by_size_.insert(std::move(node));
  }
}

void RangeAllocator::EraseFree(uint64_t offset, uint64_t size) {
  Keep(spare_offset_nodes_, free_by_offset_.extract(offset), kSpareNodes);
  Keep(spare_size_nodes_, free_by_size_.extract(std::pair<uint64_t, uint64_t>{size, offset}),
       kSpareNodes);
}

}  // namespace gkv
