#include "gkv/hash.h"

#include <xxhash.h>

namespace gkv {

uint64_t HashKey(std::string_view key) { return XXH3_64bits(key.data(), key.size()); }

uint64_t HashBytes(const void* data, size_t size, uint64_t seed) {
  return XXH3_64bits_withSeed(data, size, seed);
}

uint64_t RingPointPosition(uint64_t id_hash, uint64_t v) {
  // splitmix64 (Steele, Lea and Flood, "Fast splittable pseudorandom number generators", 2014;
  // the mix is Stafford's variant 13 of MurmurHash3's finaliser): a bijection of the 64-bit
  // state whose every output bit depends on every input bit.
  uint64_t z = id_hash + (v + 1) * 0x9E3779B97F4A7C15ULL;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

}  // namespace gkv
