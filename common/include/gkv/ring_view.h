// RingView: one ring of a cluster whose members may change (gkv/membership.h), over a node
// table whose indices are stable: a process numbers each node it ever learns of once, in the
// order it learns of it, and never reuses or renumbers an index (a static cluster: the cluster
// file's order, and the ring covers every node). A new ring is a new RingView; a view never
// changes once built.
// Thread-safety: immutable; share it through std::shared_ptr<const RingView>.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string_view>
#include <vector>

#include "gkv/cluster.h"
#include "gkv/hash.h"

namespace gkv {

class RingView {
 public:
  // `members[i]` is node table index `slots[i]`; the ring is over `members` (in the order
  // given: sorted by id under etcd). `table_size`: how many indices the node table has.
  RingView(uint64_t epoch, const std::vector<NodeInfo>& members, std::vector<int> slots,
           size_t table_size)
      : epoch_(epoch),
        slots_(std::move(slots)),
        position_of_(table_size, -1),
        hash_(members.empty() ? std::vector<NodeInfo>{NodeInfo{}} : members),
        empty_(members.empty()) {
    for (size_t p = 0; p < slots_.size(); ++p) position_of_[slots_[p]] = static_cast<int>(p);
  }

  uint64_t epoch() const { return epoch_; }
  bool empty() const { return empty_; }
  size_t size() const { return slots_.size(); }
  // Node table index of ring position `p`, and back (-1: not a member of this ring).
  int slot(size_t p) const { return slots_[p]; }
  int position(int index) const {
    return index >= 0 && static_cast<size_t>(index) < position_of_.size() ? position_of_[index]
                                                                          : -1;
  }
  bool contains(int index) const { return position(index) >= 0; }
  size_t table_size() const { return position_of_.size(); }

  // The owner of `key` (a node table index); -1 when the ring is empty.
  int Owner(std::string_view key) const { return OwnerForHash(HashKey(key)); }
  int OwnerForHash(uint64_t hash) const { return empty_ ? -1 : slots_[hash_.NodeForHash(hash)]; }
  // Up to `count` distinct owners clockwise from the key, the primary first.
  std::vector<int> Owners(std::string_view key, int count) const {
    std::vector<int> out;
    Owners(key, count, &out);
    return out;
  }
  // The same into `*out` (any vector of int, cleared first), which allocates nothing once it
  // has the capacity.
  template <class Vector>
  void Owners(std::string_view key, int count, Vector* out) const {
    out->clear();
    if (empty_) return;
    static thread_local std::vector<int> positions;
    hash_.NodesFor(key, count, &positions);
    for (int p : positions) out->push_back(slots_[p]);
  }
  // Share of the key space of each node table index (0 for non-members).
  std::vector<double> SharesByIndex() const {
    std::vector<double> out(position_of_.size(), 0.0);
    if (empty_) return out;
    std::vector<double> by_position = hash_.Shares();
    for (size_t p = 0; p < slots_.size(); ++p) out[slots_[p]] = by_position[p];
    return out;
  }

 private:
  uint64_t epoch_;
  std::vector<int> slots_;
  std::vector<int> position_of_;
  HashRing hash_;
  bool empty_;
};

using RingPtr = std::shared_ptr<const RingView>;

}  // namespace gkv
