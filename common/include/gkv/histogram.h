// Latency histogram (gkv-bench, server statistics): log-linear buckets, 32 per power of two, so
// a recorded value is reported within ~3% of itself; nanoseconds from 1 ns to centuries.
// Not thread-safe: one per thread (merge them), or guard it.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>

namespace gkv {

class Histogram {
 public:
  static constexpr int kSubBits = 5;
  static constexpr int kSub = 1 << kSubBits;
  static constexpr int kBuckets = 64 * kSub;

  void Record(uint64_t ns) {
    counts_[Index(ns)]++;
    count_++;
    max_ = std::max(max_, ns);
    sum_ += ns;
  }
  void Merge(const Histogram& o) {
    for (int i = 0; i < kBuckets; ++i) counts_[i] += o.counts_[i];
    count_ += o.count_;
    max_ = std::max(max_, o.max_);
    sum_ += o.sum_;
  }
  void Reset() { *this = Histogram(); }
  // Number of recorded values <= `ns` (bucket resolution: a bucket counts when its upper edge
  // is <= ns). For Prometheus cumulative buckets.
  uint64_t CountAtOrBelow(uint64_t ns) const {
    uint64_t n = 0;
    for (int i = 0; i < kBuckets && UpperEdge(i) <= ns; ++i) n += counts_[i];
    return n;
  }
  uint64_t sum() const { return sum_; }
  uint64_t count() const { return count_; }
  uint64_t max() const { return max_; }
  double mean() const { return count_ ? double(sum_) / count_ : 0; }
  // The value at quantile q (0..1): the upper edge of the bucket holding it, capped at max.
  uint64_t Percentile(double q) const {
    if (count_ == 0) return 0;
    uint64_t rank = static_cast<uint64_t>(q * (count_ - 1)) + 1;
    uint64_t seen = 0;
    for (int i = 0; i < kBuckets; ++i) {
      seen += counts_[i];
      if (seen >= rank) return std::min(UpperEdge(i), max_);
    }
    return max_;
  }

 private:
  static int Index(uint64_t v) {
    if (v < kSub) return static_cast<int>(v);
    int msb = 63 - __builtin_clzll(v);
    int shift = msb - kSubBits;
    return ((shift + 1) << kSubBits) + static_cast<int>((v >> shift) & (kSub - 1));
  }
  static uint64_t UpperEdge(int i) {
    if (i < kSub) return i;
    int shift = (i >> kSubBits) - 1;
    uint64_t mant = (i & (kSub - 1)) | kSub;
    return ((mant + 1) << shift) - 1;
  }
  std::array<uint64_t, kBuckets> counts_{};
  uint64_t count_ = 0, max_ = 0, sum_ = 0;
};

}  // namespace gkv
