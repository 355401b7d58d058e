// Membership in etcd (gkv/membership.h) against a real etcd per test (tests/etcd_harness.h),
// and the `membership: etcd` form of the cluster file.
#include "gkv/membership.h"

#include <gtest/gtest.h>
#include <httplib.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "etcd_harness.h"

namespace gkv {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using testing::EtcdProcess;

MemberRecord Record(const std::string& id, uint16_t port, double weight = 1.0) {
  MemberRecord r;
  r.node.id = id;
  r.node.host = "127.0.0.1";
  r.node.port = port;
  r.node.weight = weight;
  r.gpu_bytes = 1 << 20;
  r.host_bytes = 2 << 20;
  r.disk_bytes = 3 << 20;
  return r;
}

std::vector<std::string> Ids(const std::vector<NodeInfo>& nodes) {
  std::vector<std::string> ids;
  for (const auto& n : nodes) ids.push_back(n.id);
  return ids;
}

std::vector<std::string> MemberIds(const MembershipView& view) {
  std::vector<std::string> ids;
  for (const auto& m : view.members) ids.push_back(m.node.id);
  return ids;
}

// Polls `done` every 20 ms until it holds or `timeout` passes.
bool WaitUntil(const std::function<bool()>& done, std::chrono::milliseconds timeout = 5s) {
  const auto deadline = Clock::now() + timeout;
  while (!done()) {
    if (Clock::now() > deadline) return false;
    std::this_thread::sleep_for(20ms);
  }
  return true;
}

double SecondsSince(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// Every view a watcher called back with. Declare it before the watcher, so it outlives it.
class ViewLog {
 public:
  MembershipWatcher::Callback callback() {
    return [this](const MembershipView& view) {
      std::lock_guard<std::mutex> lock(mu_);
      views_.push_back(view);
      cv_.notify_all();
    };
  }
  // The first view (from index `from` on) that satisfies `match`, waiting up to `timeout`.
  std::optional<MembershipView> WaitFor(const std::function<bool(const MembershipView&)>& match,
                                        std::chrono::milliseconds timeout = 5s, size_t from = 0) {
    std::unique_lock<std::mutex> lock(mu_);
    std::optional<MembershipView> found;
    cv_.wait_for(lock, timeout, [&] {
      for (size_t i = from; i < views_.size(); ++i) {
        if (match(views_[i])) {
          found = views_[i];
          return true;
        }
      }
      return false;
    });
    return found;
  }
  size_t size() {
    std::lock_guard<std::mutex> lock(mu_);
    return views_.size();
  }
  std::vector<MembershipView> views() {
    std::lock_guard<std::mutex> lock(mu_);
    return views_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<MembershipView> views_;
};

bool Has(const MembershipView& view, const std::string& id) { return view.Find(id) != nullptr; }

class MembershipTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(etcd_.Start());
    config_.endpoints = {etcd_.endpoint()};
    config_.lease_ttl_s = 1;
  }

  std::unique_ptr<MemberRegistration> MustRegister(const MemberRecord& record) {
    auto r = MemberRegistration::Register(config_, record);
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    return r.ok() ? std::move(*r) : nullptr;
  }
  std::unique_ptr<MembershipWatcher> MustWatch(ViewLog& log) {
    auto w = MembershipWatcher::Start(config_, log.callback());
    EXPECT_TRUE(w.ok()) << w.status().ToString();
    return w.ok() ? std::move(*w) : nullptr;
  }
  MembershipView MustRead() {
    auto v = ReadMembership(config_);
    EXPECT_TRUE(v.ok()) << v.status().ToString();
    return v.ok() ? *v : MembershipView{};
  }

  EtcdProcess etcd_;
  EtcdConfig config_;
};

// ---- records, views and the cluster file (no etcd) -------------------------------------------

TEST(MemberRecordTest, RoundTripsEveryField) {
  MemberRecord r = Record("n7", 7007, 2.5);
  r.draining = true;
  auto back = DecodeMemberRecord(EncodeMemberRecord(r));
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(back->node.id, "n7");
  EXPECT_EQ(back->node.address(), "127.0.0.1:7007");
  EXPECT_EQ(back->node.weight, 2.5);
  EXPECT_EQ(back->gpu_bytes, r.gpu_bytes);
  EXPECT_EQ(back->host_bytes, r.host_bytes);
  EXPECT_EQ(back->disk_bytes, r.disk_bytes);
  EXPECT_TRUE(back->draining);

  MemberRecord v6 = Record("v6", 9000);
  v6.node.host = "::1";
  EXPECT_NE(EncodeMemberRecord(v6).find("\"[::1]:9000\""), std::string::npos);
  auto v6_back = DecodeMemberRecord(EncodeMemberRecord(v6));
  ASSERT_TRUE(v6_back.ok()) << v6_back.status().ToString();
  EXPECT_EQ(v6_back->node.host, "::1");
  EXPECT_EQ(v6_back->node.port, 9000);
}

TEST(MemberRecordTest, DefaultsAndRefusals) {
  auto minimal = DecodeMemberRecord(R"({"id":"a","address":"h:1"})");
  ASSERT_TRUE(minimal.ok()) << minimal.status().ToString();
  EXPECT_EQ(minimal->node.weight, 1.0);
  EXPECT_EQ(minimal->gpu_bytes, 0u);
  EXPECT_FALSE(minimal->draining);
  for (const char* bad :
       {"", "[]", "{", R"({"address":"h:1"})", R"({"id":"a"})", R"({"id":"a","address":"h"})",
        R"({"id":"a/b","address":"h:1"})", R"({"id":"a","address":"h:1","weight":0})",
        R"({"id":"a","address":"h:1","weight":"x"})",
        R"({"id":"a","address":"h:1","gpu_bytes":-1})",
        R"({"id":"a","address":"h:1","draining":1})", R"({"id":1,"address":"h:1"})"}) {
    EXPECT_FALSE(DecodeMemberRecord(bad).ok()) << bad;
  }
}

// Records carry the placement version; one without it was written by placement version 1.
TEST(MemberRecordTest, PlacementVersionRoundTripsAndDefaultsToOne) {
  MemberRecord r = Record("n7", 7007);
  EXPECT_EQ(r.placement, HashRing::kPlacementVersion);
  auto back = DecodeMemberRecord(EncodeMemberRecord(r));
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(back->placement, HashRing::kPlacementVersion);
  auto old = DecodeMemberRecord(R"({"id":"a","address":"h:1"})");
  ASSERT_TRUE(old.ok()) << old.status().ToString();
  EXPECT_EQ(old->placement, 1u);
  for (const char* bad : {R"({"id":"a","address":"h:1","placement":0})",
                          R"({"id":"a","address":"h:1","placement":-2})",
                          R"({"id":"a","address":"h:1","placement":"2"})",
                          R"({"id":"a","address":"h:1","placement":4294967296})",
                          R"({"id":"a","address":"h:1","weight":1001})",
                          R"({"id":"a","address":"h:1","weight":1e308})"}) {
    EXPECT_FALSE(DecodeMemberRecord(bad).ok()) << bad;
  }
}

// A member that places keys differently is never part of the ring: two placements would
// split the key space.
TEST(MembershipViewTest, RingLeavesOutMembersOfAnotherPlacement) {
  MembershipView view;
  view.members = {Record("a", 1), Record("b", 2), Record("c", 3)};
  view.members[1].placement = 1;
  EXPECT_EQ(Ids(view.RingNodes()), (std::vector<std::string>{"a", "c"}));
  EXPECT_NE(view.Find("b"), nullptr);
}

TEST(MembershipViewTest, RingLeavesOutDrainingAndDrainRequested) {
  MembershipView view;
  view.members = {Record("a", 1), Record("b", 2), Record("c", 3), Record("d", 4)};
  view.members[1].draining = true;
  view.drain_requested = {"c"};
  EXPECT_EQ(Ids(view.RingNodes()), (std::vector<std::string>{"a", "d"}));
  ASSERT_NE(view.Find("c"), nullptr);
  EXPECT_EQ(view.Find("c")->node.port, 3);
  EXPECT_EQ(view.Find("e"), nullptr);
  EXPECT_EQ(view.Find(""), nullptr);
}

TEST(ClusterFileTest, ParsesEtcdMembership) {
  auto c = ParseClusterYaml(R"(
membership: etcd
etcd: {endpoints: [http://127.0.0.1:2379, http://10.0.0.2:2379], cluster: prod.eu-1, lease_ttl_s: 9}
secret: s3
)");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->membership, ClusterConfig::Membership::kEtcd);
  EXPECT_EQ(c->etcd.endpoints,
            (std::vector<std::string>{"http://127.0.0.1:2379", "http://10.0.0.2:2379"}));
  EXPECT_EQ(c->etcd.cluster, "prod.eu-1");
  EXPECT_EQ(c->etcd.prefix(), "/gkv/prod.eu-1/");
  EXPECT_EQ(c->etcd.lease_ttl_s, 9);
  EXPECT_TRUE(c->nodes.empty());
  EXPECT_EQ(c->secret, "s3");

  auto defaults = ParseClusterYaml("membership: etcd\netcd:\n  endpoints: [http://h:1]\n");
  ASSERT_TRUE(defaults.ok()) << defaults.status().ToString();
  EXPECT_EQ(defaults->etcd.cluster, "gkv");
  EXPECT_EQ(defaults->etcd.lease_ttl_s, 5);

  auto auth = ParseClusterYaml(
      "membership: etcd\netcd: {endpoints: [http://h:1], username: gkv, password: pw}\n");
  ASSERT_TRUE(auth.ok()) << auth.status().ToString();
  EXPECT_EQ(auth->etcd.username, "gkv");
  EXPECT_EQ(auth->etcd.password, "pw");

  // A nodes: list is ignored (not even checked) in etcd mode.
  auto with_nodes = ParseClusterYaml(
      "membership: etcd\netcd: {endpoints: [http://h:1]}\nnodes: [{id: a, address: bad}]\n");
  ASSERT_TRUE(with_nodes.ok()) << with_nodes.status().ToString();
  EXPECT_TRUE(with_nodes->nodes.empty());
}

TEST(ClusterFileTest, StaticFilesAreUnchanged) {
  for (const char* text : {"nodes: [{id: a, address: 'h:1'}]",
                           "membership: static\nnodes: [{id: a, address: 'h:1'}]"}) {
    auto c = ParseClusterYaml(text);
    ASSERT_TRUE(c.ok()) << c.status().ToString();
    EXPECT_EQ(c->membership, ClusterConfig::Membership::kStatic);
    ASSERT_EQ(c->nodes.size(), 1u);
    EXPECT_TRUE(c->etcd.endpoints.empty());
  }
  EXPECT_FALSE(ParseClusterYaml("membership: static").ok());  // still needs nodes
}

TEST(ClusterFileTest, RefusesBadEtcdSections) {
  for (const char* bad : {
           "membership: etcd",                                      // no etcd:
           "membership: etcd\netcd: {}",                            // no endpoints
           "membership: etcd\netcd: {endpoints: []}",               // empty
           "membership: etcd\netcd: {endpoints: http://h:1}",       // not a list
           "membership: etcd\netcd: {endpoints: [h:1]}",            // no scheme
           "membership: etcd\netcd: {endpoints: [https://h:1]}",    // not http
           "membership: etcd\netcd: {endpoints: [http://h]}",       // no port
           "membership: etcd\netcd: {endpoints: [http://h:0]}",     // bad port
           "membership: etcd\netcd: {endpoints: [http://h:1/v3]}",  // a path
           "membership: etcd\netcd: {endpoints: [http://h:1], cluster: 'a/b'}",
           "membership: etcd\netcd: {endpoints: [http://h:1], cluster: ''}",
           "membership: etcd\netcd: {endpoints: [http://h:1], lease_ttl_s: 0}",
           "membership: etcd\netcd: {endpoints: [http://h:1], lease_ttl_s: 3601}",
           "membership: etcd\netcd: {endpoints: [http://h:1], lease_ttl_s: x}",
           "membership: etcd\netcd: {endpoints: [http://h:1], lease_ttl: 5}",  // unknown field
           "membership: etcd\netcd: {endpoints: [http://h:1], username: u}",   // no password
           "membership: etcd\netcd: {endpoints: [http://h:1], password: p}",   // no user
           "membership: etcd\netcd: {endpoints: [http://h:1], username: u, password_env: "
           "GKV_TEST_UNSET_VARIABLE}",
           "membership: gossip\nnodes: [{id: a, address: 'h:1'}]",
           "etcd: {endpoints: [http://h:1]}\nnodes: [{id: a, address: 'h:1'}]",  // no membership
       }) {
    EXPECT_FALSE(ParseClusterYaml(bad).ok()) << bad;
  }
}

// ---- against etcd ----------------------------------------------------------------------------

TEST_F(MembershipTest, RegistrationShowsInWatcherAndRead) {
  ViewLog log;
  auto watcher = MustWatch(log);
  ASSERT_NE(watcher, nullptr);
  EXPECT_TRUE(watcher->Current().members.empty());
  const uint64_t first_epoch = watcher->Current().epoch;
  EXPECT_GT(first_epoch, 0u);

  auto reg = MustRegister(Record("n1", 7001, 2.0));
  ASSERT_NE(reg, nullptr);
  EXPECT_NE(reg->lease_id(), 0);
  auto seen = log.WaitFor([](const MembershipView& v) { return Has(v, "n1"); });
  ASSERT_TRUE(seen) << "the watcher never saw n1";
  EXPECT_GT(seen->epoch, first_epoch);
  EXPECT_EQ(seen->epoch, seen->revision);
  EXPECT_EQ(seen->Find("n1")->node.address(), "127.0.0.1:7001");
  EXPECT_EQ(seen->Find("n1")->node.weight, 2.0);
  EXPECT_EQ(seen->Find("n1")->disk_bytes, 3u << 20);
  EXPECT_TRUE(WaitUntil([&] { return watcher->connected(); }));

  MembershipView read = MustRead();
  EXPECT_EQ(MemberIds(read), (std::vector<std::string>{"n1"}));
  EXPECT_EQ(Ids(read.RingNodes()), (std::vector<std::string>{"n1"}));
  EXPECT_GE(read.revision, seen->revision);
}

TEST_F(MembershipTest, WatchersThatSawTheSameChangeAgreeOnItsEpoch) {
  ViewLog log_a, log_b;
  auto a = MustWatch(log_a);
  auto b = MustWatch(log_b);
  ASSERT_TRUE(a && b);
  auto reg = MustRegister(Record("n1", 7001));
  ASSERT_NE(reg, nullptr);
  auto seen_a = log_a.WaitFor([](const MembershipView& v) { return Has(v, "n1"); });
  auto seen_b = log_b.WaitFor([](const MembershipView& v) { return Has(v, "n1"); });
  ASSERT_TRUE(seen_a && seen_b);
  EXPECT_EQ(seen_a->epoch, seen_b->epoch);
}

TEST_F(MembershipTest, SecondRegistrationOfAnIdIsRefused) {
  auto first = MustRegister(Record("n1", 7001));
  ASSERT_NE(first, nullptr);
  auto second = MemberRegistration::Register(config_, Record("n1", 7999));
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), StatusCode::kInvalidArgument) << second.status().ToString();
  EXPECT_NE(second.status().message().find("127.0.0.1:7001"), std::string::npos)
      << second.status().ToString();
  // The first one's record is untouched.
  MembershipView read = MustRead();
  ASSERT_NE(read.Find("n1"), nullptr);
  EXPECT_EQ(read.Find("n1")->node.port, 7001);
  // Another id is fine.
  EXPECT_NE(MustRegister(Record("n2", 7002)), nullptr);
}

// Issue 37: a node does not join a ring whose placement version differs from its own, and
// says why; watchers leave such a member out of their ring.
TEST_F(MembershipTest, RegistrationIsRefusedBesideAMemberOfAnotherPlacement) {
  MemberRecord old = Record("old", 7001);
  old.placement = 1;  // as an older build's record reads
  auto first = MustRegister(old);
  ASSERT_NE(first, nullptr);
  auto second = MemberRegistration::Register(config_, Record("n2", 7002));
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), StatusCode::kNotSupported) << second.status().ToString();
  EXPECT_NE(second.status().message().find("placement version 1"), std::string::npos)
      << second.status().ToString();
  // Its handoff mark says nothing about this ring's keys: left out with it.
  ASSERT_TRUE(first->SetHandoffRunning(true).ok());
  MembershipView read = MustRead();
  EXPECT_EQ(MemberIds(read), (std::vector<std::string>{"old"}));
  EXPECT_TRUE(read.RingNodes().empty());
  EXPECT_TRUE(read.handoffs_running.empty());
  // Once it is gone, the node joins.
  ASSERT_TRUE(first->Deregister().ok());
  EXPECT_NE(MustRegister(Record("n2", 7002)), nullptr);
}

TEST_F(MembershipTest, RecordExpiresWithTheLeaseOnceNobodyKeepsIt) {
  ViewLog log;
  auto watcher = MustWatch(log);
  ASSERT_NE(watcher, nullptr);
  auto reg = MustRegister(Record("n1", 7001));
  ASSERT_NE(reg, nullptr);
  auto joined = log.WaitFor([](const MembershipView& v) { return Has(v, "n1"); });
  ASSERT_TRUE(joined);
  // Outlives several TTLs while kept alive.
  std::this_thread::sleep_for(2500ms);
  EXPECT_TRUE(Has(MustRead(), "n1")) << "the keepalive did not keep the lease";

  const size_t before = log.size();
  const auto t0 = Clock::now();
  reg.reset();  // a crash, as far as etcd can tell: no deregistration
  auto left = log.WaitFor([](const MembershipView& v) { return !Has(v, "n1"); }, 5s, before);
  ASSERT_TRUE(left) << "n1 did not expire";
  EXPECT_LT(SecondsSince(t0), 3.5);
  EXPECT_GT(left->epoch, joined->epoch);
  EXPECT_FALSE(Has(MustRead(), "n1"));
  // The id is free again.
  EXPECT_NE(MustRegister(Record("n1", 7001)), nullptr);
}

TEST_F(MembershipTest, DeregisterRemovesEverythingAtOnce) {
  ViewLog log;
  auto watcher = MustWatch(log);
  ASSERT_NE(watcher, nullptr);
  auto reg = MustRegister(Record("n1", 7001));
  ASSERT_NE(reg, nullptr);
  ASSERT_TRUE(reg->SetHandoffRunning(true).ok());
  ASSERT_TRUE(RequestDrain(config_, "n1").ok());
  ASSERT_TRUE(log.WaitFor([](const MembershipView& v) {
    return Has(v, "n1") && v.drain_requested.count("n1") && v.handoffs_running.count("n1");
  }));
  const size_t before = log.size();
  const auto t0 = Clock::now();
  ASSERT_TRUE(reg->Deregister().ok());
  auto gone = log.WaitFor([](const MembershipView& v) { return !Has(v, "n1"); }, 2s, before);
  ASSERT_TRUE(gone);
  EXPECT_LT(SecondsSince(t0), 0.9);  // well under the TTL: no expiry involved
  EXPECT_TRUE(gone->drain_requested.empty());
  EXPECT_TRUE(gone->handoffs_running.empty());
  // One transaction: no intermediate view with only part of it gone.
  EXPECT_EQ(log.size(), before + 1);
  MembershipView read = MustRead();
  EXPECT_TRUE(read.members.empty());
  EXPECT_TRUE(read.drain_requested.empty());
  EXPECT_TRUE(read.handoffs_running.empty());
  EXPECT_EQ(reg->Update(Record("n1", 7001)).code(), StatusCode::kAborted);
  EXPECT_TRUE(reg->Deregister().ok());  // again: nothing to do
}

TEST_F(MembershipTest, RequestDrainTakesTheNodeOutOfTheRing) {
  auto n1 = MustRegister(Record("n1", 7001));
  auto n2 = MustRegister(Record("n2", 7002));
  ASSERT_TRUE(n1 && n2);
  ViewLog log;
  auto watcher = MustWatch(log);
  ASSERT_NE(watcher, nullptr);
  const uint64_t epoch = watcher->Current().epoch;
  EXPECT_EQ(Ids(watcher->Current().RingNodes()), (std::vector<std::string>{"n1", "n2"}));

  ASSERT_TRUE(RequestDrain(config_, "n2").ok());
  auto drained = log.WaitFor([](const MembershipView& v) { return v.drain_requested.count("n2"); });
  ASSERT_TRUE(drained);
  EXPECT_EQ(Ids(drained->RingNodes()), (std::vector<std::string>{"n1"}));
  EXPECT_TRUE(Has(*drained, "n2"));  // still a member until it leaves
  EXPECT_GT(drained->epoch, epoch);
  EXPECT_EQ(MustRead().drain_requested, (std::set<std::string>{"n2"}));

  Status missing = RequestDrain(config_, "n9");
  EXPECT_EQ(missing.code(), StatusCode::kNotFound) << missing.ToString();
  EXPECT_EQ(MustRead().drain_requested.count("n9"), 0u);
}

TEST_F(MembershipTest, UpdateAndHandoffKeyCallBackOnlyOnRealChanges) {
  MemberRecord record = Record("n1", 7001);
  auto reg = MustRegister(record);
  ASSERT_NE(reg, nullptr);
  ViewLog log;
  auto watcher = MustWatch(log);
  ASSERT_NE(watcher, nullptr);
  const uint64_t epoch = watcher->Current().epoch;

  // The same record again: a write in etcd, but no change.
  ASSERT_TRUE(reg->Update(record).ok());
  record.gpu_bytes = 42;
  ASSERT_TRUE(reg->Update(record).ok());
  auto bytes = log.WaitFor([](const MembershipView& v) {
    const MemberRecord* m = v.Find("n1");
    return m && m->gpu_bytes == 42;
  });
  ASSERT_TRUE(bytes);
  EXPECT_EQ(log.size(), 1u);  // the identical rewrite called back nothing
  EXPECT_EQ(bytes->epoch, epoch) << "the ring did not change";

  ASSERT_TRUE(reg->SetHandoffRunning(true).ok());
  auto running =
      log.WaitFor([](const MembershipView& v) { return v.handoffs_running.count("n1"); });
  ASSERT_TRUE(running);
  EXPECT_EQ(running->epoch, epoch);

  record.draining = true;
  ASSERT_TRUE(reg->Update(record).ok());
  auto draining = log.WaitFor([](const MembershipView& v) {
    const MemberRecord* m = v.Find("n1");
    return m && m->draining;
  });
  ASSERT_TRUE(draining);
  EXPECT_TRUE(draining->RingNodes().empty());
  EXPECT_GT(draining->epoch, epoch);
  EXPECT_TRUE(draining->handoffs_running.count("n1"));

  ASSERT_TRUE(reg->SetHandoffRunning(false).ok());
  ASSERT_TRUE(log.WaitFor([](const MembershipView& v) { return v.handoffs_running.empty(); }));
  EXPECT_TRUE(MustRead().handoffs_running.empty());
  EXPECT_NE(reg->Update(Record("other", 1)).code(), StatusCode::kOk);
}

std::string Base64(std::string_view in) {
  static const char* kChars = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string out;
  uint32_t acc = 0;
  int bits = 0;
  for (unsigned char c : in) {
    acc = (acc << 8) | c;
    bits += 8;
    while (bits >= 6) out.push_back(kChars[(acc >> (bits -= 6)) & 63]);
  }
  if (bits > 0) out.push_back(kChars[(acc << (6 - bits)) & 63]);
  while (out.size() % 4) out.push_back('=');
  return out;
}

// Issue 38 item 5: a client opened mid-handoff learns the ring before the change from the
// scan's mark; a value that is not such a list is a plain scan mark.
TEST_F(MembershipTest, AScanMarkNamesTheRingBeforeItsChange) {
  auto reg = MustRegister(Record("n1", 7001));
  ASSERT_NE(reg, nullptr);
  ASSERT_TRUE(reg->SetHandoffRunning(true, false, {"n0", "n1"}).ok());
  MembershipView v = MustRead();
  EXPECT_EQ(v.previous_members["n1"], (std::vector<std::string>{"n0", "n1"}));
  EXPECT_EQ(v.catching_up.count("n1"), 0u);
  ASSERT_TRUE(reg->SetHandoffRunning(true, /*catch_up_only=*/true, {"n0"}).ok());
  v = MustRead();
  EXPECT_EQ(v.catching_up.count("n1"), 1u);
  EXPECT_EQ(v.previous_members.count("n1"), 0u);
  httplib::Client http(etcd_.endpoint());
  for (const char* bad : {"{", "{\"previous\": [1, 2]}", "{\"previous\": [\"a/b\"]}", "[]",
                          "{\"previous\": \"n0\"}"}) {
    const std::string body = "{\"key\":\"" + Base64(config_.prefix() + "handoff/n9") +
                             "\",\"value\":\"" + Base64(bad) + "\"}";
    auto res = http.Post("/v3/kv/put", body, "application/json");
    ASSERT_TRUE(res && res->status == 200) << (res ? res->body : "no reply");
    v = MustRead();
    EXPECT_EQ(v.handoffs_running.count("n9"), 1u) << bad;
    EXPECT_EQ(v.previous_members.count("n9"), 0u) << bad;
  }
}

// Issue 38 item 5: etcd started with its own user/password authentication. A node and a
// watcher with the cluster file's credentials work; without them, or with a wrong password,
// every call is refused at once with what to set, and nothing is registered.
TEST_F(MembershipTest, AnEtcdWithAuthenticationTakesTheClusterFilesCredentials) {
  httplib::Client http(etcd_.endpoint());
  for (const auto& [path, body] : std::vector<std::pair<std::string, std::string>>{
           {"/v3/auth/user/add", R"({"name":"root","password":"root-pw"})"},
           {"/v3/auth/user/grant", R"({"user":"root","role":"root"})"},
           {"/v3/auth/enable", "{}"}}) {
    auto res = http.Post(path, body, "application/json");
    ASSERT_TRUE(res && res->status == 200) << path << ": " << (res ? res->body : "no reply");
  }
  EtcdConfig none = config_;
  auto refused = MemberRegistration::Register(none, Record("n1", 7001));
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kPermissionDenied) << refused.status().ToString();
  EXPECT_NE(refused.status().ToString().find("etcd.username"), std::string::npos)
      << refused.status().ToString();
  EtcdConfig wrong = config_;
  wrong.username = "root";
  wrong.password = "guess";
  auto denied = ReadMembership(wrong);
  ASSERT_FALSE(denied.ok());
  EXPECT_EQ(denied.status().code(), StatusCode::kPermissionDenied) << denied.status().ToString();
  EXPECT_EQ(denied.status().ToString().find("guess"), std::string::npos) << "the password shown";

  config_.username = "root";
  config_.password = "root-pw";
  ViewLog log;
  auto watcher = MustWatch(log);
  ASSERT_NE(watcher, nullptr);
  auto reg = MustRegister(Record("n1", 7001));
  ASSERT_NE(reg, nullptr);
  EXPECT_TRUE(log.WaitFor([](const MembershipView& v) { return Has(v, "n1"); }))
      << "the watcher never saw n1";
  EXPECT_TRUE(Has(MustRead(), "n1"));
  ASSERT_TRUE(reg->SetHandoffRunning(true).ok());
  EXPECT_EQ(MustRead().handoffs_running.count("n1"), 1u);
  // The keepalive runs with the token too: the record outlives a few TTLs, and a change of
  // etcd's auth store (a user added), after which etcd refuses every older token ("revision of
  // auth store is old"), has the registration authenticate again, on the same lease.
  const int64_t lease = reg->lease_id();
  auto token = http.Post("/v3/auth/authenticate", R"({"name":"root","password":"root-pw"})",
                         "application/json");
  ASSERT_TRUE(token && token->status == 200) << (token ? token->body : "no reply");
  const size_t at = token->body.find("\"token\":\"");
  ASSERT_NE(at, std::string::npos) << token->body;
  const std::string value = token->body.substr(at + 9, token->body.find('"', at + 9) - at - 9);
  auto added = http.Post("/v3/auth/user/add", {{"Authorization", value}},
                         R"({"name":"reader","password":"reader-pw"})", "application/json");
  ASSERT_TRUE(added && added->status == 200) << (added ? added->body : "no reply");
  Status cleared = reg->SetHandoffRunning(false);  // a write with the token from before
  EXPECT_TRUE(cleared.ok()) << cleared.ToString();
  EXPECT_EQ(MustRead().handoffs_running.count("n1"), 0u);
  std::this_thread::sleep_for(3s);
  EXPECT_TRUE(Has(MustRead(), "n1"));
  EXPECT_EQ(reg->lease_id(), lease) << "registered again instead of renewing its token";
  ASSERT_TRUE(reg->Deregister().ok());
  EXPECT_FALSE(Has(MustRead(), "n1"));
}

TEST_F(MembershipTest, RegistersAgainWhenTheLeaseIsGone) {
  auto reg = MustRegister(Record("n1", 7001));
  ASSERT_NE(reg, nullptr);
  ASSERT_TRUE(reg->SetHandoffRunning(true).ok());
  const int64_t old_lease = reg->lease_id();
  // Revoke it behind the registration's back (as etcd does to a lease it could not refresh).
  httplib::Client http(etcd_.endpoint());
  auto res = http.Post("/v3/lease/revoke", "{\"ID\":\"" + std::to_string(old_lease) + "\"}",
                       "application/json");
  ASSERT_TRUE(res && res->status == 200) << (res ? res->body : "no reply");
  EXPECT_FALSE(Has(MustRead(), "n1"));
  ASSERT_TRUE(WaitUntil([&] {
    MembershipView v = MustRead();
    // The new lease is published just after the record is written: wait for both.
    return Has(v, "n1") && v.handoffs_running.count("n1") && reg->lease_id() != old_lease;
  })) << "not registered again on a new lease";
}

TEST_F(MembershipTest, WatcherKeepsItsViewWhileEtcdIsDownAndResumesAfter) {
  auto n1 = MustRegister(Record("n1", 7001));
  ASSERT_NE(n1, nullptr);
  ViewLog log;
  auto watcher = MustWatch(log);
  ASSERT_NE(watcher, nullptr);
  ASSERT_TRUE(WaitUntil([&] { return watcher->connected(); }));
  const MembershipView before = watcher->Current();

  etcd_.Kill();
  EXPECT_TRUE(WaitUntil([&] { return !watcher->connected(); }, 2s));
  std::this_thread::sleep_for(1500ms);  // > the TTL: nothing may expire in the watcher's view
  EXPECT_EQ(MemberIds(watcher->Current()), (std::vector<std::string>{"n1"}));
  EXPECT_EQ(watcher->Current().epoch, before.epoch);
  EXPECT_EQ(log.size(), 0u);

  ASSERT_TRUE(etcd_.Restart());
  // A member that comes and goes before the watcher is back: only a watch that resumes from the
  // revision it had seen (not a fresh read) can report it.
  {
    auto n3 = MustRegister(Record("n3", 7003));
    ASSERT_NE(n3, nullptr);
    ASSERT_TRUE(n3->Deregister().ok());
  }
  auto n2 = MustRegister(Record("n2", 7002));
  ASSERT_NE(n2, nullptr);
  auto with_n2 = log.WaitFor([](const MembershipView& v) { return Has(v, "n2"); });
  ASSERT_TRUE(with_n2) << "the watcher did not come back";
  EXPECT_TRUE(Has(*with_n2, "n1"));
  EXPECT_FALSE(Has(*with_n2, "n3"));
  EXPECT_TRUE(log.WaitFor([](const MembershipView& v) { return Has(v, "n3"); }, 0ms))
      << "n3's registration was missed";
  EXPECT_TRUE(WaitUntil([&] { return watcher->connected(); }));
}

TEST_F(MembershipTest, WatcherReadsAgainAfterCompaction) {
  testing::TcpProxy link(etcd_.client_port());
  EtcdConfig via_link = config_;
  via_link.endpoints = {link.endpoint()};
  auto n3 = MustRegister(Record("n3", 7003));
  ASSERT_NE(n3, nullptr);
  ViewLog log;
  auto started = MembershipWatcher::Start(via_link, log.callback());
  ASSERT_TRUE(started.ok()) << started.status().ToString();
  auto watcher = std::move(*started);
  ASSERT_TRUE(WaitUntil([&] { return watcher->connected(); }));

  link.Cut();  // etcd stays up; the watcher cannot see it
  ASSERT_TRUE(WaitUntil([&] { return !watcher->connected(); }, 2s));
  auto n1 = MustRegister(Record("n1", 7001));
  ASSERT_NE(n1, nullptr);
  ASSERT_TRUE(n3->Deregister().ok());
  const MembershipView now = MustRead();
  httplib::Client http(etcd_.endpoint());
  auto res =
      http.Post("/v3/kv/compaction", "{\"revision\":\"" + std::to_string(now.revision) + "\"}",
                "application/json");
  ASSERT_TRUE(res && res->status == 200) << (res ? res->body : "no reply");
  EXPECT_EQ(log.size(), 0u);

  // Back, the watcher finds the revision it needs compacted, reads the prefix again and shows
  // the outcome (the history in between is gone) as one change.
  link.Restore();
  auto seen = log.WaitFor([](const MembershipView& v) { return Has(v, "n1"); });
  ASSERT_TRUE(seen) << "the watcher did not recover from the compaction";
  EXPECT_FALSE(Has(*seen, "n3"));
  EXPECT_EQ(seen->revision, now.revision);
  EXPECT_EQ(seen->epoch, now.revision);
  EXPECT_EQ(log.size(), 1u);
  // And it watches on from there.
  auto n2 = MustRegister(Record("n2", 7002));
  ASSERT_TRUE(log.WaitFor([](const MembershipView& v) { return Has(v, "n2"); }));
}

// Issue 38 item 12: etcd comes back with its revision below the one the watcher saw (rebuilt
// from nothing here; from an older snapshot alike). A watch from the last revision seen would
// show nothing until etcd caught up with it; the watcher notices when its watch is
// established, reads the prefix again and watches on from there, its epochs still growing.
TEST_F(MembershipTest, WatcherReadsAgainWhenEtcdsRevisionWentBack) {
  for (int i = 0; i < 10; ++i) {  // revisions the rebuilt etcd will not reach in this test
    auto r = MustRegister(Record("early" + std::to_string(i), 7100 + i));
    ASSERT_NE(r, nullptr);
    ASSERT_TRUE(r->Deregister().ok());
  }
  ViewLog log;
  auto watcher = MustWatch(log);
  ASSERT_NE(watcher, nullptr);
  ASSERT_TRUE(WaitUntil([&] { return watcher->connected(); }));
  const MembershipView before = watcher->Current();
  ASSERT_TRUE(etcd_.RestartEmpty());
  auto n2 = MustRegister(Record("n2", 7002));
  ASSERT_NE(n2, nullptr);
  ASSERT_LT(MustRead().revision, before.revision) << "etcd's revision did not go back";
  auto seen = log.WaitFor([](const MembershipView& v) { return Has(v, "n2"); });
  ASSERT_TRUE(seen) << "the watcher stayed blind after etcd's revision went back";
  EXPECT_GT(seen->epoch, before.epoch);
  ASSERT_TRUE(n2->Deregister().ok());
  EXPECT_TRUE(log.WaitFor([](const MembershipView& v) { return !Has(v, "n2"); }))
      << "the watcher does not watch on after reading again";
}

TEST_F(MembershipTest, RegistersAgainAfterItsLeaseExpiredInAPartition) {
  testing::TcpProxy link(etcd_.client_port());
  EtcdConfig via_link = config_;
  via_link.endpoints = {link.endpoint()};
  auto registered = MemberRegistration::Register(via_link, Record("n1", 7001));
  ASSERT_TRUE(registered.ok()) << registered.status().ToString();
  auto reg = std::move(*registered);
  ASSERT_TRUE(reg->SetHandoffRunning(true).ok());
  const int64_t old_lease = reg->lease_id();
  // n2 has no mark: registered again, it gets a catch-up mark with its record.
  auto second = MemberRegistration::Register(via_link, Record("n2", 7002));
  ASSERT_TRUE(second.ok()) << second.status().ToString();
  auto reg2 = std::move(*second);
  const auto registered_at = Clock::now();
  MemberRegistration::Hold hold = reg->hold();
  EXPECT_EQ(hold.generation, 1u);
  EXPECT_GT(hold.until, registered_at);
  EXPECT_LE(hold.until, registered_at + std::chrono::seconds(config_.lease_ttl_s));

  link.Cut();  // etcd, still up, lets the lease expire
  // The hold runs out before etcd can drop the record (the node fences itself first).
  Clock::time_point gone{};
  ASSERT_TRUE(WaitUntil(
      [&] {
        if (Has(MustRead(), "n1")) return false;
        gone = Clock::now();
        return true;
      },
      4s))
      << "the lease did not expire";
  hold = reg->hold();
  EXPECT_EQ(hold.generation, 1u);
  EXPECT_LT(hold.until, gone) << "the hold outlived the lease";
  std::printf("hold ran out %.0f ms before etcd dropped the record (TTL %d s)\n",
              std::chrono::duration<double, std::milli>(gone - hold.until).count(),
              config_.lease_ttl_s);
  EXPECT_TRUE(MustRead().handoffs_running.empty());
  link.Restore();
  ASSERT_TRUE(WaitUntil([&] {
    MembershipView v = MustRead();
    // The new lease is published just after the record is written: wait for both.
    return Has(v, "n1") && v.handoffs_running.count("n1") && reg->lease_id() != old_lease &&
           v.catching_up.count("n2") && reg2->hold().generation == 2;
  })) << "not registered again on a new lease";
  MembershipView v = MustRead();
  EXPECT_EQ(v.catching_up.count("n1"), 0u) << "a scan's mark stays a scan's mark";
  hold = reg->hold();
  EXPECT_EQ(hold.generation, 2u);
  EXPECT_GT(hold.until, Clock::now());
  // Deregistered: the node holds nothing.
  ASSERT_TRUE(reg->Deregister().ok());
  EXPECT_LE(reg->hold().until, Clock::now());
}

TEST_F(MembershipTest, RegistrationSurvivesAnEtcdRestart) {
  auto reg = MustRegister(Record("n1", 7001));
  ASSERT_NE(reg, nullptr);
  etcd_.Kill();
  std::this_thread::sleep_for(500ms);
  ASSERT_TRUE(etcd_.Restart());
  // Several TTLs after the restart the record is still (or again) there: keepalives resumed.
  std::this_thread::sleep_for(2500ms);
  MembershipView read = MustRead();
  ASSERT_TRUE(Has(read, "n1"));
  EXPECT_NE(reg->lease_id(), 0);
  EXPECT_TRUE(reg->Update(Record("n1", 7001, 3.0)).ok());
  EXPECT_EQ(MustRead().Find("n1")->node.weight, 3.0);
}

TEST_F(MembershipTest, DeadEtcdFailsFastAndNeverHangs) {
  etcd_.Stop();
  const auto bounded = [](const char* what, const std::function<Status()>& call) {
    const auto t0 = Clock::now();
    Status s = call();
    EXPECT_EQ(s.code(), StatusCode::kUnavailable) << what << ": " << s.ToString();
    EXPECT_LT(SecondsSince(t0), 2.0) << what;
  };
  bounded("Register",
          [&] { return MemberRegistration::Register(config_, Record("n1", 1)).status(); });
  bounded("ReadMembership", [&] { return ReadMembership(config_).status(); });
  bounded("RequestDrain", [&] { return RequestDrain(config_, "n1"); });
  bounded("MembershipWatcher::Start",
          [&] { return MembershipWatcher::Start(config_, nullptr).status(); });
  EtcdConfig none;
  EXPECT_EQ(ReadMembership(none).status().code(), StatusCode::kInvalidArgument);
}

TEST_F(MembershipTest, TriesTheEndpointsInOrder) {
  config_.endpoints = {"http://127.0.0.1:" + std::to_string(testing::FreePort()), etcd_.endpoint()};
  auto reg = MustRegister(Record("n1", 7001));
  ASSERT_NE(reg, nullptr);
  ViewLog log;
  auto watcher = MustWatch(log);
  ASSERT_NE(watcher, nullptr);
  EXPECT_TRUE(Has(watcher->Current(), "n1"));
  ASSERT_TRUE(RequestDrain(config_, "n1").ok());
  EXPECT_TRUE(log.WaitFor([](const MembershipView& v) { return v.drain_requested.count("n1"); }));
}

TEST_F(MembershipTest, WatcherStopsPromptlyUpOrDown) {
  {
    ViewLog log;
    auto watcher = MustWatch(log);
    ASSERT_NE(watcher, nullptr);
    ASSERT_TRUE(WaitUntil([&] { return watcher->connected(); }));
    const auto t0 = Clock::now();
    watcher.reset();
    EXPECT_LT(SecondsSince(t0), 0.5);
  }
  ViewLog log;
  auto watcher = MustWatch(log);
  ASSERT_NE(watcher, nullptr);
  etcd_.Kill();
  ASSERT_TRUE(WaitUntil([&] { return !watcher->connected(); }, 2s));
  std::this_thread::sleep_for(300ms);
  const auto t0 = Clock::now();
  watcher.reset();
  EXPECT_LT(SecondsSince(t0), 0.5);
  // Likewise a registration whose etcd is gone.
  ASSERT_TRUE(etcd_.Restart());
  auto reg = MustRegister(Record("n1", 7001));
  ASSERT_NE(reg, nullptr);
  etcd_.Kill();
  std::this_thread::sleep_for(500ms);
  const auto t1 = Clock::now();
  reg.reset();
  EXPECT_LT(SecondsSince(t1), 0.5);
}

}  // namespace
}  // namespace gkv
