// Adaptive replication against three real nodes: hot keys get copies that serve reads, a write
// never leaves an older copy readable, and copies go when the key cools.
#include <gtest/gtest.h>

#include <atomic>
#include <regex>
#include <thread>

#include "cluster_harness.h"
#include "gkv/random.h"

namespace gkv {
namespace {

using testing::Cluster;
using testing::NodeSpec;
using Clock = std::chrono::steady_clock;

// A counter of the node's "replication" object in its stats JSON.
uint64_t Field(const std::string& json, const std::string& name) {
  const auto at = json.find("\"replication\":{");
  if (at == std::string::npos) return 0;
  const std::string part = json.substr(at);
  std::smatch m;
  std::regex re("\"" + name + "\":(\\d+)");
  return std::regex_search(part, m, re) ? std::stoull(m[1]) : 0;
}

uint64_t Sum(Client& c, const std::string& name) {
  uint64_t total = 0;
  for (int n = 0; n < 3; ++n) total += Field(*c.NodeStats(n), name);
  return total;
}

std::string ValueOf(uint64_t seq) {
  std::string v(64, static_cast<char>('a' + seq % 26));
  std::memcpy(v.data(), &seq, 8);
  return v;
}

TEST(ReplicationTest, HotKeysAreCopiedServeReadsAndCoolDown) {
  NodeSpec spec;
  spec.extra_args = {"--replicate-hot", "100", "--hot-replicas", "2"};
  Cluster cluster(3, spec);
  auto client = cluster.NewClient(std::chrono::seconds(2));
  ASSERT_TRUE(client);
  ASSERT_TRUE(client->Put("hot", "x-hot-value", 11).ok());
  for (int i = 0; i < 3000; ++i) {
    auto r = client->Get("hot");
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    ASSERT_EQ(r->view(), "x-hot-value");
  }
  EXPECT_EQ(Sum(*client, "created"), 2u) << "the hot key should have two copies";
  EXPECT_GT(Sum(*client, "reads_served"), 300u) << "reads should spread to the copies";
  // Cooling: with no reads the estimate halves every second until it passes under the cool
  // threshold (a quarter of the hot one), then the copies are withdrawn.
  for (int i = 0; i < 150 && Sum(*client, "dropped") < 2; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_EQ(Sum(*client, "dropped"), 2u);
  EXPECT_EQ(client->Get("hot")->view(), "x-hot-value");
  EXPECT_NE(cluster.ReadLog(client->NodeFor("hot")).find("replicating hot key 'hot'"),
            std::string::npos);
}

// Several readers on their own clients and one writer; no read may return a version older than
// one acknowledged to the writer before that read began.
TEST(ReplicationTest, NoReadIsOlderThanAnAcknowledgedWrite) {
  NodeSpec spec;
  spec.extra_args = {"--replicate-hot", "50", "--hot-replicas", "2"};
  Cluster cluster(3, spec);
  auto writer = cluster.NewClient(std::chrono::seconds(2));
  ASSERT_TRUE(writer);
  const int kKeys = 4;
  std::vector<std::atomic<uint64_t>> acked(kKeys);
  for (int k = 0; k < kKeys; ++k) {
    std::string v = ValueOf(1);
    ASSERT_TRUE(writer->Put("k" + std::to_string(k), v.data(), v.size()).ok());
    acked[k] = 1;
  }
  std::atomic<bool> stop{false};
  std::atomic<uint64_t> reads{0}, stale{0}, errors{0};
  std::vector<std::thread> readers;
  for (int t = 0; t < 3; ++t) {
    readers.emplace_back([&, t] {
      auto c = cluster.NewClient(std::chrono::seconds(2));
      Random rng(testing::TestSeed() + t);
      while (!stop) {
        const int k = static_cast<int>(rng.Uniform(0, kKeys - 1));
        const uint64_t floor = acked[k].load();
        auto r = c->Get("k" + std::to_string(k));
        if (!r.ok()) {
          errors++;
          continue;
        }
        uint64_t seq;
        std::memcpy(&seq, r->data(), 8);
        if (seq < floor) stale++;
        reads++;
      }
    });
  }
  const auto end = Clock::now() + std::chrono::seconds(4);
  uint64_t seq = 1;
  while (Clock::now() < end) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    ++seq;
    // k0 and k1 are written every 40 ms; k2 and k3 about once a second, so they stay copied
    // long enough for the copies to serve many reads between invalidations.
    const int k = seq % 25 == 0 ? 2 + static_cast<int>((seq / 25) % 2) : static_cast<int>(seq % 2);
    std::string v = ValueOf(seq);
    ASSERT_TRUE(writer->Put("k" + std::to_string(k), v.data(), v.size()).ok());
    acked[k] = seq;  // acknowledged: every read that starts from now on must see >= seq
  }
  stop = true;
  for (auto& th : readers) th.join();
  const uint64_t served = Sum(*writer, "reads_served");
  std::cout << "replication consistency: " << reads.load() << " reads, " << served
            << " served by copies, " << seq - 1 << " writes, " << stale.load() << " stale, "
            << errors.load() << " errors\n";
  EXPECT_EQ(stale.load(), 0u);
  EXPECT_EQ(errors.load(), 0u);
  EXPECT_GT(served, 0u) << "the copies never served a read: the test did not exercise them";
}

}  // namespace
}  // namespace gkv
