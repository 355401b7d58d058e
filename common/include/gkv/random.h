// The one seedable source of randomness for tests and benchmarks, so any failure can be
// replayed: every test prints its seed, and GKV_SEED overrides it.
// Not thread-safe: give each thread its own Random (seed + thread index).
#pragma once

#include <cstdint>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

namespace gkv {

class Random {
 public:
  explicit Random(uint64_t seed) : engine_(seed) {}

  // GKV_SEED from the environment when set, otherwise `fallback`.
  static uint64_t SeedFromEnv(uint64_t fallback) {
    const char* s = std::getenv("GKV_SEED");
    return s ? std::strtoull(s, nullptr, 10) : fallback;
  }

  uint64_t Next() { return engine_(); }
  // Uniform in [lo, hi].
  uint64_t Uniform(uint64_t lo, uint64_t hi) {
    return std::uniform_int_distribution<uint64_t>(lo, hi)(engine_);
  }
  double UniformReal() { return std::uniform_real_distribution<double>(0.0, 1.0)(engine_); }
  void Fill(void* data, size_t size) {
    auto* p = static_cast<unsigned char*>(data);
    size_t i = 0;
    for (; i + 8 <= size; i += 8) {
      uint64_t v = engine_();
      __builtin_memcpy(p + i, &v, 8);
    }
    if (i < size) {
      uint64_t v = engine_();
      __builtin_memcpy(p + i, &v, size - i);
    }
  }
  std::vector<unsigned char> Bytes(size_t size) {
    std::vector<unsigned char> v(size);
    Fill(v.data(), size);
    return v;
  }
  std::mt19937_64& engine() { return engine_; }

 private:
  std::mt19937_64 engine_;
};

}  // namespace gkv
