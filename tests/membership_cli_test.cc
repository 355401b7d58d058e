// `gkv ring` and `gkv drain` with membership in etcd: the tool reads and writes etcd only.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <array>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <string>
#include <thread>

#include "etcd_harness.h"
#include "gkv/membership.h"

namespace gkv {
namespace {

struct CmdResult {
  int code;
  std::string out;  // stdout and stderr
};

CmdResult Gkv(const std::string& cluster_file, const std::string& args) {
  const std::string cmd =
      std::string(GKV_CLI_BIN) + " --cluster " + cluster_file + " " + args + " 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  std::string out;
  std::array<char, 4096> buf;
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), p)) > 0) out.append(buf.data(), n);
  const int status = pclose(p);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out};
}

MemberRecord Record(const std::string& id, uint16_t port, double weight) {
  MemberRecord r;
  r.node = {id, "127.0.0.1", port, weight};
  return r;
}

class EtcdCliTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(etcd_.Start());
    config_.endpoints = {etcd_.endpoint()};
    cluster_file_ = dir_.Sub("cluster.yaml");
    std::ofstream(cluster_file_) << "membership: etcd\netcd: {endpoints: [" << etcd_.endpoint()
                                 << "], lease_ttl_s: 5}\n";
  }
  testing::TempDir dir_;
  testing::EtcdProcess etcd_;
  EtcdConfig config_;
  std::string cluster_file_;
};

TEST_F(EtcdCliTest, RingShowsMembersSharesAndStates) {
  auto n0 = MemberRegistration::Register(config_, Record("n0", 7000, 1));
  auto n1 = MemberRegistration::Register(config_, Record("n1", 7001, 3));
  MemberRecord leaving = Record("n2", 7002, 1);
  auto n2 = MemberRegistration::Register(config_, leaving);
  ASSERT_TRUE(n0.ok() && n1.ok() && n2.ok());
  leaving.draining = true;
  ASSERT_TRUE((*n2)->Update(leaving).ok());
  ASSERT_TRUE((*n2)->SetHandoffRunning(true).ok());

  auto ring = Gkv(cluster_file_, "ring");
  EXPECT_EQ(ring.code, 0) << ring.out;
  auto view = ReadMembership(config_);
  ASSERT_TRUE(view.ok());
  EXPECT_NE(ring.out.find("epoch " + std::to_string(view->epoch) + ", revision " +
                          std::to_string(view->revision) + ", 3 members, 2 in the ring"),
            std::string::npos)
      << ring.out;
  EXPECT_NE(ring.out.find("127.0.0.1:7000"), std::string::npos) << ring.out;
  // n0 about a quarter, n1 (weight 3) about three quarters: placement version 2 gives these.
  EXPECT_NE(ring.out.find("1.00   24.44%  serving"), std::string::npos) << ring.out;
  EXPECT_NE(ring.out.find("3.00   75.56%  serving"), std::string::npos) << ring.out;
  EXPECT_NE(ring.out.find("largest 1.008 (n1), smallest 0.977 (n0)"), std::string::npos)
      << ring.out;
  EXPECT_NE(ring.out.find("0.00%  draining, handoff running"), std::string::npos) << ring.out;
}

// Issue 37: the ids README uses balance, and the tool says how far from even the ring is.
TEST(StaticCliTest, RingOfSixteenShortIdsIsBalancedAndSaysSo) {
  testing::TempDir dir;
  const std::string file = dir.Sub("cluster.yaml");
  {
    std::ofstream f(file);
    f << "nodes:\n";
    for (int i = 0; i < 16; ++i) {
      f << "  - {id: n" << i << ", address: 127.0.0.1:" << 7000 + i << "}\n";
    }
  }
  auto ring = Gkv(file, "ring");
  ASSERT_EQ(ring.code, 0) << ring.out;
  int rows = 0;
  for (size_t at = ring.out.find("127.0.0.1:"); at != std::string::npos;
       at = ring.out.find("127.0.0.1:", at + 1)) {
    const size_t pct = ring.out.find('%', at);
    ASSERT_NE(pct, std::string::npos) << ring.out;
    const size_t start = ring.out.rfind(' ', pct) + 1;
    const double share = std::stod(ring.out.substr(start, pct - start));
    EXPECT_GT(share, 6.25 * 0.85) << ring.out;
    EXPECT_LT(share, 6.25 * 1.15) << ring.out;
    ++rows;
  }
  EXPECT_EQ(rows, 16) << ring.out;
  const size_t balance = ring.out.find("share / weight share: largest ");
  ASSERT_NE(balance, std::string::npos) << ring.out;
  const double largest = std::stod(ring.out.substr(balance + 30));
  EXPECT_GT(largest, 1.0);
  EXPECT_LT(largest, 1.15) << ring.out;
  const size_t smallest = ring.out.find("smallest ", balance);
  ASSERT_NE(smallest, std::string::npos) << ring.out;
  const double low = std::stod(ring.out.substr(smallest + 9));
  EXPECT_LT(low, 1.0);
  EXPECT_GT(low, 0.85) << ring.out;
  EXPECT_NE(ring.out.find("placement version 2"), std::string::npos) << ring.out;
}

// A member of another placement version is shown, and shown out of the ring.
TEST_F(EtcdCliTest, RingShowsAMemberOfAnotherPlacementOutsideTheRing) {
  MemberRecord old = Record("old", 7009, 1);
  old.placement = 1;
  auto o = MemberRegistration::Register(config_, old);
  ASSERT_TRUE(o.ok()) << o.status().ToString();
  auto ring = Gkv(cluster_file_, "ring");
  EXPECT_EQ(ring.code, 0) << ring.out;
  EXPECT_NE(ring.out.find("1 members, 0 in the ring"), std::string::npos) << ring.out;
  EXPECT_NE(ring.out.find("placement version 1 (this build: 2): not in the ring"),
            std::string::npos)
      << ring.out;
}

TEST_F(EtcdCliTest, DrainAsksTheNodeToLeave) {
  auto n0 = MemberRegistration::Register(config_, Record("n0", 7000, 1));
  auto n1 = MemberRegistration::Register(config_, Record("n1", 7001, 1));
  ASSERT_TRUE(n0.ok() && n1.ok());
  auto drain = Gkv(cluster_file_, "drain n1");
  EXPECT_EQ(drain.code, 0) << drain.out;
  EXPECT_NE(drain.out.find("asked n1 (127.0.0.1:7001) to drain"), std::string::npos) << drain.out;
  auto view = ReadMembership(config_);
  ASSERT_TRUE(view.ok());
  EXPECT_EQ(view->drain_requested.count("n1"), 1u);
  ASSERT_EQ(view->RingNodes().size(), 1u);
  EXPECT_EQ(view->RingNodes()[0].id, "n0");

  auto again = Gkv(cluster_file_, "drain n1");
  EXPECT_EQ(again.code, 0) << again.out;
  EXPECT_NE(again.out.find("already"), std::string::npos) << again.out;
  auto ring = Gkv(cluster_file_, "ring");
  EXPECT_NE(ring.out.find("drain requested"), std::string::npos) << ring.out;

  auto missing = Gkv(cluster_file_, "drain n9");
  EXPECT_EQ(missing.code, 1) << missing.out;
  EXPECT_NE(missing.out.find("no member 'n9'"), std::string::npos) << missing.out;
}

// Issue 38 item 6: a drain request lives on the node's lease (it cannot outlive the node and
// drain the next process of its id), and `gkv undrain` withdraws one not yet begun.
TEST_F(EtcdCliTest, ADrainRequestGoesWithItsNodeAndUndrainWithdrawsIt) {
  auto n0 = MemberRegistration::Register(config_, Record("n0", 7000, 1));
  ASSERT_TRUE(n0.ok()) << n0.status().ToString();
  {
    // A node asked to drain that stops without deregistering (a crash): the request goes
    // with its lease.
    auto n1 = MemberRegistration::Register(config_, Record("n1", 7001, 1));
    ASSERT_TRUE(n1.ok()) << n1.status().ToString();
    ASSERT_EQ(Gkv(cluster_file_, "drain n1").code, 0);
    ASSERT_EQ(ReadMembership(config_)->drain_requested.count("n1"), 1u);
  }  // the keepalive stops here, as at a crash: the lease expires within its TTL (5 s)
  auto view = ReadMembership(config_);
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (view.ok() && view->Find("n1") && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    view = ReadMembership(config_);
  }
  ASSERT_TRUE(view.ok());
  ASSERT_EQ(view->Find("n1"), nullptr) << "n1's lease never expired";
  EXPECT_EQ(view->drain_requested.count("n1"), 0u);

  ASSERT_EQ(Gkv(cluster_file_, "drain n0").code, 0);
  auto undrain = Gkv(cluster_file_, "undrain n0");
  EXPECT_EQ(undrain.code, 0) << undrain.out;
  EXPECT_NE(undrain.out.find("withdrew the drain request of n0"), std::string::npos) << undrain.out;
  view = ReadMembership(config_);
  ASSERT_TRUE(view.ok());
  EXPECT_EQ(view->drain_requested.count("n0"), 0u);
  EXPECT_EQ(view->RingNodes().size(), 1u);
  auto none = Gkv(cluster_file_, "undrain n0");
  EXPECT_EQ(none.code, 1) << none.out;
  EXPECT_NE(none.out.find("no drain of 'n0' is requested"), std::string::npos) << none.out;
  // One already handing off is not stopped halfway.
  MemberRecord draining = Record("n0", 7000, 1);
  draining.draining = true;
  ASSERT_TRUE((*n0)->Update(draining).ok());
  auto late = Gkv(cluster_file_, "undrain n0");
  EXPECT_EQ(late.code, 4) << late.out;
  EXPECT_NE(late.out.find("handing its keys off already"), std::string::npos) << late.out;
}

TEST_F(EtcdCliTest, DeadEtcdIsReportedQuickly) {
  etcd_.Stop();
  for (const char* args : {"ring", "drain n0"}) {
    const auto t0 = std::chrono::steady_clock::now();
    auto r = Gkv(cluster_file_, args);
    EXPECT_EQ(r.code, 3) << args << ": " << r.out;
    EXPECT_NE(r.out.find("unavailable"), std::string::npos) << r.out;
    EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(3)) << args;
  }
}

TEST(EtcdCliStaticTest, DrainNeedsEtcdMembership) {
  testing::TempDir dir;
  const std::string file = dir.Sub("cluster.yaml");
  std::ofstream(file) << "nodes: [{id: a, address: '127.0.0.1:1'}]\n";
  auto r = Gkv(file, "drain a");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("membership: etcd"), std::string::npos) << r.out;
}

}  // namespace
}  // namespace gkv
