// Hybrid-clock versions: at least the wall clock in microseconds times 1024, above every version
// the clock handed out or observed before. Nodes version writes with one (TieredCache), and a
// client replicating its writes (replicas > 1) versions them with its own, so every replica of a
// write gets the same version. Versions of different machines compare in the order the writes
// happened to within the clocks' skew.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>

namespace gkv {

// The wall clock as a version floor: microseconds since the epoch times 1024 (room for 1024
// versions per microsecond; 2^64 lasts past the year 2500).
inline uint64_t WallClockVersion() {
  const auto us = std::chrono::duration_cast<std::chrono::microseconds>(
                      std::chrono::system_clock::now().time_since_epoch())
                      .count();
  return static_cast<uint64_t>(us) << 10;
}

// Thread-safe (lock-free).
class HybridClock {
 public:
  // Takes `count` (>= 1) consecutive versions; returns the first.
  uint64_t Take(uint64_t count = 1) {
    const uint64_t floor = WallClockVersion();
    uint64_t cur = next_.load(std::memory_order_relaxed);
    for (;;) {
      const uint64_t v = cur > floor ? cur : floor;
      if (next_.compare_exchange_weak(cur, v + count, std::memory_order_relaxed)) return v;
    }
  }
  // Versions taken from now on are above `v` (one seen in a reply, or installed).
  void Observe(uint64_t v) {
    uint64_t cur = next_.load(std::memory_order_relaxed);
    while (cur <= v && !next_.compare_exchange_weak(cur, v + 1, std::memory_order_relaxed)) {
    }
  }

 private:
  std::atomic<uint64_t> next_{1};
};

}  // namespace gkv
