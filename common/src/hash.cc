#include "gkv/hash.h"

#include <xxhash.h>

namespace gkv {

uint64_t HashKey(std::string_view key) { return XXH3_64bits(key.data(), key.size()); }

uint64_t HashBytes(const void* data, size_t size, uint64_t seed) {
  return XXH3_64bits_withSeed(data, size, seed);
}

}  // namespace gkv
