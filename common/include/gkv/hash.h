// Key hashing. One function for the whole project so that the client's ring, the server's index
// shards and the tools agree. xxHash3 64-bit, seed 0: stable across versions and machines.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string_view>

namespace gkv {

uint64_t HashKey(std::string_view key);
// For derived hashes (not ring positions: see RingPointPosition).
uint64_t HashBytes(const void* data, size_t size, uint64_t seed);

// The ring position of virtual point `v` of a node whose id hashes to `id_hash` (HashKey(id)):
// splitmix64's output mix of id_hash + (v + 1) * 2^64/phi, i.e. the v-th output of a splitmix64
// stream seeded with the id's hash. Every point passes through a full 64-bit avalanche, so ids
// that differ in a bit or two and consecutive v land on unrelated positions. (Placement version
// 1 used XXH3 of the id seeded with v; for short ids XXH3 mixes the seed in linearly, and with
// ids n0..n15 the points of n11..n15 fell on n0..n9's: four nodes owned 0% of the keys.)
// Part of the placement (HashRing::kPlacementVersion): changing it moves keys.
uint64_t RingPointPosition(uint64_t id_hash, uint64_t v);

// The hash of in-memory tables keyed by std::string: transparent, so that a lookup by
// std::string_view makes no std::string (a key longer than the small-string buffer would cost an
// allocation on every lookup). Use with std::equal_to<>.
struct StringKeyHash {
  using is_transparent = void;
  size_t operator()(std::string_view key) const noexcept {
    return std::hash<std::string_view>{}(key);
  }
};

}  // namespace gkv
