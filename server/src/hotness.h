// HotnessRule: when adaptive replication copies a key, and when it withdraws the copies
// (docs/ARCHITECTURE.md, "Hot keys", has the rule and why it is stable). Pure arithmetic, no
// state of its own: the server feeds it decayed read counts and its peers' reported loads.
//
// Counts are those of HotKeySketch (and a node-wide counter decayed the same way): halved once a
// second, so a steady R reads/s reads as about 2R. Comparing two such counts compares rates.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

namespace gkv {

struct HotnessRule {
  enum class Mode {
    kOff,       // no copies
    kRelative,  // the default: hot relative to the node's and the cluster's load
    kAbsolute,  // hot above a fixed read rate (--replicate-hot R)
  };
  Mode mode = Mode::kRelative;

  // kAbsolute: a key read more than hot_reads_per_s is hot; it cools under cool_reads_per_s
  // (0: a quarter of the hot rate).
  double hot_reads_per_s = 0;
  double cool_reads_per_s = 0;

  // kRelative: a key is hot when its node is overloaded (its read rate is above its ring share of
  // the cluster's read rate by more than load_slack) and the key alone is at least hot_share of
  // its node's reads; it cools when its reads (all copies together) fall under a quarter of that
  // share. Below min_key_reads_per_s a key is never hot, so an idle cluster makes no copies.
  double hot_share = 0.02;
  double load_slack = 0.10;
  double min_key_reads_per_s = 20;

  // At most this many replications start per second on one node, whatever the load: a sudden
  // shift of the hot set costs bounded copy traffic.
  int max_copy_starts_per_s = 64;

  // Decayed counts (about 2x the rate). `node_count`: every row this node served.
  bool IsHot(double key_count, double node_count, bool node_overloaded) const {
    switch (mode) {
      case Mode::kOff:
        return false;
      case Mode::kAbsolute:
        return key_count >= 2 * hot_reads_per_s;
      case Mode::kRelative:
        return node_overloaded && key_count >= HotFloor(node_count);
    }
    return false;
  }

  // `total_count`: the key's reads on every node holding it (the primary's count scaled by the
  // number of holders, since clients spread a hinted key evenly over them). The node's load is
  // deliberately not part of this test: copies are what evened the load, so dropping them
  // because the load is even would bring the imbalance straight back (flapping).
  bool IsCold(double total_count, double node_count) const {
    switch (mode) {
      case Mode::kOff:
        return true;
      case Mode::kAbsolute:
        return total_count < 2 * (cool_reads_per_s > 0 ? cool_reads_per_s : hot_reads_per_s / 4);
      case Mode::kRelative:
        return total_count < HotFloor(node_count) / 4;
    }
    return true;
  }

  // A node is overloaded when its read rate exceeds (1 + load_slack) times its ring share of the
  // cluster's rate. `rates` and `shares` list the nodes that reported recently (this node
  // included); a node alone (no reports) is never overloaded.
  bool Overloaded(double own_rate, double own_share, const std::vector<double>& rates,
                  const std::vector<double>& shares) const {
    return Excess(own_rate, own_share, rates, shares) > 0 && own_rate >= min_key_reads_per_s;
  }

  // Reads/s above (1 + load_slack) times the node's share of the cluster's rate (0 when none):
  // how much load copies should move elsewhere. Keys are copied, hottest first as they cross
  // the bar, until their expected relief covers it, so a node a little over its share copies a
  // key or two rather than every key above hot_share.
  double Excess(double own_rate, double own_share, const std::vector<double>& rates,
                const std::vector<double>& shares) const {
    double total_rate = 0, total_share = 0;
    for (double r : rates) total_rate += r;
    for (double s : shares) total_share += s;
    if (rates.size() < 2 || total_share <= 0 || total_rate <= 0) return 0;
    const double expected = total_rate * own_share / total_share;
    return std::max(0.0, own_rate - (1 + load_slack) * expected);
  }

 private:
  double HotFloor(double node_count) const {
    return std::max(hot_share * node_count, 2 * min_key_reads_per_s);
  }
};

}  // namespace gkv
