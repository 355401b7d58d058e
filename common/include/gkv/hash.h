// Key hashing. One function for the whole project so that the client's ring, the server's index
// shards and the tools agree. xxHash3 64-bit, seed 0: stable across versions and machines.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string_view>

namespace gkv {

uint64_t HashKey(std::string_view key);
// For virtual-node positions and other derived hashes.
uint64_t HashBytes(const void* data, size_t size, uint64_t seed);

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
