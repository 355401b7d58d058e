// HotKeySketch: a decaying count-min sketch of read rates, cheap enough for every read.
//
// Add() increments one counter per row (relaxed atomics, no lock) and returns the estimate (the
// minimum over rows, which over-counts only through collisions, never under-counts). Decay()
// halves every counter; called once a second, a key read at a steady R reads/s converges to an
// estimate of about 2R. Thread-safety: all methods may run concurrently; Decay racing an Add
// only blurs one count, which an estimate tolerates.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>

namespace gkv {

class HotKeySketch {
 public:
  static constexpr int kRows = 4;
  static constexpr int kWidth = 4096;

  uint32_t Add(uint64_t hash) {
    uint32_t est = UINT32_MAX;
    for (int r = 0; r < kRows; ++r) {
      auto& c = counters_[r * kWidth + Slot(hash, r)];
      est = std::min(est, c.fetch_add(1, std::memory_order_relaxed) + 1);
    }
    return est;
  }
  uint32_t Estimate(uint64_t hash) const {
    uint32_t est = UINT32_MAX;
    for (int r = 0; r < kRows; ++r) {
      est = std::min(est, counters_[r * kWidth + Slot(hash, r)].load(std::memory_order_relaxed));
    }
    return est;
  }
  void Decay() {
    for (auto& c : counters_)
      c.store(c.load(std::memory_order_relaxed) / 2, std::memory_order_relaxed);
  }

 private:
  static uint32_t Slot(uint64_t hash, int row) {
    // Independent-enough slots from one 64-bit hash: a different odd multiplier per row.
    static constexpr uint64_t kMul[kRows] = {0x9E3779B97F4A7C15ULL, 0xC2B2AE3D27D4EB4FULL,
                                             0x165667B19E3779F9ULL, 0xD6E8FEB86659FD93ULL};
    return static_cast<uint32_t>(((hash ^ (hash >> 29)) * kMul[row]) >> 52) % kWidth;
  }
  std::array<std::atomic<uint32_t>, kRows * kWidth> counters_{};
};

}  // namespace gkv
