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

// Thread-safe (lock-free). A clock with a `tag` hands out versions whose low kTagBits bits are
// the tag, one per tick of 1024: two writers with different tags never hand out the same
// version, so two different writes of one key cannot tie (a client picks a random tag; two
// clients share one with probability 2^-10 per pair, and then tie only within one tick).
class HybridClock {
 public:
  static constexpr int kTagBits = 10;
  static constexpr uint64_t kStep = uint64_t{1} << kTagBits;  // versions between two ticks
  static constexpr uint64_t kTagMask = kStep - 1;

  explicit HybridClock(uint64_t tag = 0) : tag_(tag & kTagMask) {}

  // Takes `count` (>= 1) versions; returns the first, the i-th is first + i * kStep.
  uint64_t Take(uint64_t count = 1) {
    const uint64_t floor = WallClockVersion() & ~kTagMask;
    uint64_t cur = next_.load(std::memory_order_relaxed);
    for (;;) {
      const uint64_t tick = cur > floor ? cur : floor;
      if (next_.compare_exchange_weak(cur, tick + count * kStep, std::memory_order_relaxed)) {
        return tick | tag_;
      }
    }
  }
  // Versions taken from now on are above `v` (one seen in a reply, or installed).
  void Observe(uint64_t v) {
    const uint64_t above = (v & ~kTagMask) + kStep;
    uint64_t cur = next_.load(std::memory_order_relaxed);
    while (cur < above && !next_.compare_exchange_weak(cur, above, std::memory_order_relaxed)) {
    }
  }

 private:
  const uint64_t tag_;
  std::atomic<uint64_t> next_{0};
};

}  // namespace gkv
