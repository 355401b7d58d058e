// Key hashing. One function for the whole project so that the client's ring, the server's index
// shards and the tools agree. xxHash3 64-bit, seed 0: stable across versions and machines.
#pragma once

#include <cstdint>
#include <string_view>

namespace gkv {

uint64_t HashKey(std::string_view key);
// For virtual-node positions and other derived hashes.
uint64_t HashBytes(const void* data, size_t size, uint64_t seed);

}  // namespace gkv
