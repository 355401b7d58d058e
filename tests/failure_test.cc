// Failures, restarts and bad input against real gkv-server processes: deadlines, fail-open,
// failover to replicas, warm restart after SIGKILL, malformed messages from a raw UCX client,
// overload, and a fault-injection run under load.
#include <gtest/gtest.h>

#include <atomic>
#include <fstream>
#include <future>
#include <iostream>
#include <map>
#include <regex>
#include <thread>

#include "cluster_harness.h"
#include "gkv/hash.h"
#include "gkv/random.h"
#include "gkv/transport/protocol.h"
#include "gkv/transport/ucx_transport.h"

namespace gkv {
namespace {

using testing::Cluster;
using testing::NodeSpec;
using Clock = std::chrono::steady_clock;

using testing::KeyOn;
using testing::StatsCounter;

// Tests set it to 0 by hand to see the read-repair test fail.
#ifndef GKV_READ_REPAIR_CHANCE
#define GKV_READ_REPAIR_CHANCE 1.0
#endif

TEST(FailureTest, FailOpenTurnsADeadNodeIntoAMiss) {
  Cluster cluster(3);
  auto client = cluster.NewClient(std::chrono::milliseconds(300));
  ASSERT_TRUE(client);
  std::string k = KeyOn(*client, 2);
  // Setup, not under test: a sanitizer build on a loaded machine can take longer than the
  // 300 ms the test gives the calls it measures.
  PutOptions setup;
  setup.timeout = std::chrono::seconds(5);
  auto put = client->Put(k, "v", 1, setup);
  ASSERT_TRUE(put.ok()) << put.status().ToString();
  cluster.StopNode(2, SIGKILL);
  auto t0 = Clock::now();
  auto strict = client->Get(k);
  EXPECT_TRUE(strict.status().code() == StatusCode::kUnavailable ||
              strict.status().code() == StatusCode::kTimeout)
      << strict.status().ToString();
  GetOptions open;
  open.fail_open = true;
  auto lenient = client->Get(k, open);
  EXPECT_EQ(lenient.status().code(), StatusCode::kNotFound) << lenient.status().ToString();
  EXPECT_LT(Clock::now() - t0, std::chrono::seconds(2));
  // Down nodes fail fast during the backoff instead of waiting out a deadline.
  auto t1 = Clock::now();
  EXPECT_FALSE(client->Get(k).ok());
  EXPECT_LT(Clock::now() - t1, std::chrono::milliseconds(100));
}

// Issue 38 item 9: fail-open against a hung node (SIGSTOPped: its sockets stay open, nothing
// answers), not only a dead one: a read of its key is a miss within the call's deadline, a
// batch answers the other nodes' rows, and once the node resumes its keys read back.
// SIGSTOPs node `i` and waits until the kernel shows it stopped ('T'): SIGSTOP lands
// asynchronously.
bool StopAndWait(Cluster& cluster, int i) {
  cluster.Signal(i, SIGSTOP);
  for (int tries = 0; tries < 200; ++tries) {
    std::ifstream stat("/proc/" + std::to_string(cluster.pid(i)) + "/stat");
    std::string line;
    std::getline(stat, line);
    const size_t paren = line.rfind(')');
    if (paren != std::string::npos && paren + 2 < line.size() && line[paren + 2] == 'T') {
      return true;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return false;
}

TEST(FailureTest, FailOpenTurnsAHungNodeIntoAMissWithinTheDeadline) {
  Cluster cluster(3);
  auto client = cluster.NewClient(std::chrono::milliseconds(300));
  ASSERT_TRUE(client);
  const std::string hung = KeyOn(*client, 2), alive = KeyOn(*client, 1);
  PutOptions setup;
  setup.timeout = std::chrono::seconds(5);
  ASSERT_TRUE(client->Put(hung, "12345678", 8, setup).ok());
  ASSERT_TRUE(client->Put(alive, "abcdefgh", 8, setup).ok());
  ASSERT_TRUE(StopAndWait(cluster, 2)) << "node 2 never showed as stopped";
  GetOptions open;
  open.fail_open = true;
  auto t0 = Clock::now();
  auto lenient = client->Get(hung, open);
  const double get_s = std::chrono::duration<double>(Clock::now() - t0).count();
  EXPECT_EQ(lenient.status().code(), StatusCode::kNotFound) << lenient.status().ToString();
  auto strict = client->Get(hung);
  EXPECT_TRUE(strict.status().code() == StatusCode::kTimeout ||
              strict.status().code() == StatusCode::kUnavailable)
      << strict.status().ToString();
  char rows[16] = {};
  t0 = Clock::now();
  auto batch = client->MultiGetInto({hung, alive}, rows, 8, 8, open);
  const double batch_s = std::chrono::duration<double>(Clock::now() - t0).count();
  ASSERT_EQ(batch.size(), 2u);
  EXPECT_EQ(batch[0].code(), StatusCode::kNotFound) << batch[0].ToString();
  EXPECT_TRUE(batch[1].ok()) << batch[1].ToString();
  EXPECT_EQ(std::string(rows + 8, 8), "abcdefgh");
  std::printf("hung node: fail-open get %.3f s, batch %.3f s (call timeout 0.3 s)\n", get_s,
              batch_s);
  // Bounded by the deadline, with slack for a loaded sanitizer build.
  EXPECT_LT(get_s, 1.5);
  EXPECT_LT(batch_s, 2.5);
  cluster.Signal(2, SIGCONT);
  GetOptions patient;
  patient.timeout = std::chrono::seconds(5);
  Result<Value> back = Status::Unavailable("not asked");
  for (int i = 0; i < 50 && !back.ok(); ++i) {
    back = client->Get(hung, patient);
    if (!back.ok()) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(back->view(), "12345678");
}

// Issue 38 item 9: with R = 2 and a key's primary hung (SIGSTOP), a batch reads those rows
// from their replicas within the batch's deadline, one MGET per node and round. Before, the
// rows left over went one by one through Get, each with a deadline of its own: 100-odd single
// gets here, and a batch could take twice its timeout.
TEST(FailureTest, ABatchWhosePrimaryHangsReadsTheReplicasInBatchesWithinItsDeadline) {
  Cluster cluster(3);
  ClientOptions o;
  o.replicas = 2;
  o.read_repair_chance = 0;
  o.default_timeout = std::chrono::milliseconds(1000);
  auto client = cluster.NewClient(o);
  ASSERT_TRUE(client);
  Client& c = *client;
  std::vector<std::string> keys;
  size_t on_hung = 0;
  PutOptions setup;
  setup.timeout = std::chrono::seconds(5);
  for (int i = 0; i < 300; ++i) {
    keys.push_back("batch-" + std::to_string(i));
    ASSERT_TRUE(c.Put(keys.back(), keys.back().data(), keys.back().size(), setup).ok());
    on_hung += c.NodeFor(keys.back()) == 0;
  }
  ASSERT_GT(on_hung, 50u);
  auto count = [&](int node, const char* op) { return StatsCounter(c, node, op, "\"ops\""); };
  const uint64_t gets_before = count(1, "get") + count(2, "get");
  const uint64_t mgets_before = count(1, "mget") + count(2, "mget");
  ASSERT_TRUE(StopAndWait(cluster, 0)) << "node 0 never showed as stopped";
  auto t0 = Clock::now();
  auto got = c.MultiGet(keys);
  const double batch_s = std::chrono::duration<double>(Clock::now() - t0).count();
  std::vector<char> rows(keys.size() * 16, 0);
  t0 = Clock::now();
  auto into = c.MultiGetInto(keys, rows.data(), 16, 9, GetOptions{});
  const double into_s = std::chrono::duration<double>(Clock::now() - t0).count();
  size_t served = 0;
  for (size_t i = 0; i < keys.size(); ++i) {
    ASSERT_TRUE(got[i].ok()) << keys[i] << ": " << got[i].status().ToString();
    EXPECT_EQ(got[i]->view(), keys[i]);
    if (keys[i].size() == 9) {  // MultiGetInto's rows are 9 bytes: the others do not fit
      ASSERT_TRUE(into[i].ok()) << keys[i] << ": " << into[i].ToString();
      EXPECT_EQ(std::string(rows.data() + i * 16, 9), keys[i]);
      ++served;
    }
  }
  EXPECT_GT(served, 50u);
  const uint64_t gets = count(1, "get") + count(2, "get") - gets_before;
  const uint64_t mgets = count(1, "mget") + count(2, "mget") - mgets_before;
  std::printf(
      "R=2, primary of %zu of %zu keys hung: MultiGet %.3f s, MultiGetInto %.3f s (timeout "
      "1 s); the replicas got %llu MGETs and %llu GETs\n",
      on_hung, keys.size(), batch_s, into_s, static_cast<unsigned long long>(mgets),
      static_cast<unsigned long long>(gets));
  // Each call: one MGET per live node in the first round, one per node in the fallback round.
  EXPECT_LE(mgets, 8u);
  EXPECT_EQ(gets, 0u);
  EXPECT_LT(batch_s, 1.5);  // the deadline, with slack for a loaded sanitizer build
  EXPECT_LT(into_s, 1.5);
  cluster.Signal(0, SIGCONT);
}

// A client and a node on one host talk over shared memory (NodeTransports), and a SIGKILL of
// the node still fails the client's calls as Unavailable (the connection manager's socket
// reports the dead peer), not by waiting out the deadline.
TEST(FailureTest, ASameHostNodeOnSharedMemoryIsSeenDeadAtOnce) {
  Cluster cluster(1);
  auto client = cluster.NewClient(std::chrono::seconds(5));
  ASSERT_TRUE(client);
  ASSERT_TRUE(client->Put("k", "v", 1).ok());
  std::string over;
  for (int i = 0; i < 100; ++i) {
    ASSERT_TRUE(client->Get("k").ok());
    auto t = client->NodeTransports(0);
    ASSERT_TRUE(t.ok()) << t.status().ToString();
    over = *t;
    if (over.find("/memory") != std::string::npos) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  const char* mm = std::getenv("UCX_MM_ERROR_HANDLING");
  if (!mm || std::string(mm) != "n") {
    EXPECT_NE(over.find("/memory"), std::string::npos) << "not on shared memory: " << over;
  }
  cluster.StopNode(0, SIGKILL);
  // Unavailable within a 1 s deadline: the loss was reported (a keepalive over shared memory
  // alone would take longer, and the get would time out).
  GetOptions quick;
  quick.timeout = std::chrono::seconds(1);
  const auto t0 = Clock::now();
  auto got = client->Get("k", quick);
  const auto waited = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0);
  EXPECT_EQ(got.status().code(), StatusCode::kUnavailable)
      << got.status().ToString() << " after " << waited.count() << " ms (over " << over << ")";
  std::printf("a SIGKILLed node (over %s) failed the next get in %lld ms\n", over.c_str(),
              static_cast<long long>(waited.count()));
}

TEST(FailureTest, ReplicatedKeysStayReadableWhenTheirPrimaryDies) {
  Cluster cluster(3);
  ClientOptions o;
  o.cluster_file = cluster.cluster_file();
  o.replicas = 2;
  o.default_timeout = std::chrono::milliseconds(500);
  auto client = Client::Open(o);
  ASSERT_TRUE(client.ok());
  Client& c = **client;
  std::string k = KeyOn(c, 0);
  ASSERT_TRUE(c.Put(k, "replicated", 10).ok());
  // Both replicas hold it.
  auto nodes = HashRing(c.cluster().nodes).NodesFor(k, 2);
  ASSERT_EQ(nodes[0], 0);
  cluster.StopNode(0, SIGKILL);
  auto got = c.Get(k);
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_EQ(got->view(), "replicated");
  auto many = c.MultiGet({k});
  ASSERT_TRUE(many[0].ok()) << many[0].status().ToString();
  EXPECT_EQ(many[0]->view(), "replicated");
  // Stat (an existence check) fails over as Get does (issue 38 (d)): it was Unavailable.
  auto info = c.Stat(k);
  ASSERT_TRUE(info.ok()) << info.status().ToString();
  EXPECT_EQ(info->size, 10u);
  EXPECT_EQ(info->version, got->info().version);
  // A key neither live owner holds is a miss, not a failure.
  std::string absent;
  for (int i = 0; absent.empty(); ++i) {
    const std::string candidate = "absent-" + std::to_string(i);
    if (HashRing(c.cluster().nodes).NodesFor(candidate, 1)[0] == 0) absent = candidate;
  }
  EXPECT_EQ(c.Stat(absent).status().code(), StatusCode::kNotFound);
  // A write is acknowledged only when every owner took it: with the primary down, puts and
  // deletes fail, though the live replica may have taken them (a read may then see them).
  auto put = c.Put(k, "newer", 5);
  EXPECT_TRUE(put.status().code() == StatusCode::kUnavailable ||
              put.status().code() == StatusCode::kTimeout)
      << put.status().ToString();
  auto after = c.Get(k);
  ASSERT_TRUE(after.ok()) << after.status().ToString();
  EXPECT_TRUE(after->view() == "newer" || after->view() == "replicated");
  Status del = c.Delete(k);
  EXPECT_TRUE(del.code() == StatusCode::kUnavailable || del.code() == StatusCode::kTimeout)
      << del.ToString();
  // A key whose owners are both alive is written, read and deleted normally.
  auto key_with_owners = [&](int first, int second) {
    for (int i = 0;; ++i) {
      const std::string candidate = "owners-" + std::to_string(i);
      if (HashRing(c.cluster().nodes).NodesFor(candidate, 2) == std::vector<int>{first, second}) {
        return candidate;
      }
    }
  };
  const std::string k1 = key_with_owners(1, 2);
  ASSERT_TRUE(c.Put(k1, "live", 4).ok());
  EXPECT_EQ(c.Get(k1)->view(), "live");
  ASSERT_TRUE(c.Delete(k1).ok());
  EXPECT_EQ(c.Get(k1).status().code(), StatusCode::kNotFound);
  // A write is acknowledged only when every owner has it (issue 38 item 3): with the second
  // owner down, the put and the delete fail and name it. Acknowledged on the primary alone, the
  // dead replica would serve the older value after the primary failed in turn.
  const std::string k2 = key_with_owners(1, 0);
  auto put2 = c.Put(k2, "one-copy", 8);
  EXPECT_TRUE(put2.status().code() == StatusCode::kUnavailable ||
              put2.status().code() == StatusCode::kTimeout)
      << put2.status().ToString();
  EXPECT_NE(put2.status().message().find("replica n0"), std::string::npos)
      << put2.status().ToString();
  auto batch = c.MultiPut({PutItem{k2, "one-copy", 8, {}}, PutItem{k1, "both", 4, {}}});
  EXPECT_FALSE(batch[0].ok());
  EXPECT_NE(batch[0].status().message().find("replica n0"), std::string::npos)
      << batch[0].status().ToString();
  EXPECT_TRUE(batch[1].ok()) << batch[1].status().ToString();
  Status del2 = c.Delete(k2);
  EXPECT_TRUE(del2.code() == StatusCode::kUnavailable || del2.code() == StatusCode::kTimeout)
      << del2.ToString();
}

// A client with replicas = 2 and read repair at GKV_READ_REPAIR_CHANCE.
std::unique_ptr<Client> RepairingClient(const Cluster& cluster) {
  ClientOptions o;
  o.cluster_file = cluster.cluster_file();
  o.replicas = 2;
  o.read_repair_chance = GKV_READ_REPAIR_CHANCE;
  o.default_timeout = std::chrono::milliseconds(500);
  auto client = Client::Open(o);
  EXPECT_TRUE(client.ok()) << client.status().ToString();
  return client.ok() ? std::move(*client) : nullptr;
}

PutOptions Durable() {
  PutOptions o;
  o.durable = true;
  return o;
}

// Reads `key` (each read must return `expect`, when given) until node `pusher` counts a read
// repair, for at most 100 reads 50 ms apart; returns its count.
uint64_t ReadUntilRepaired(Client& c, const std::string& key, int pusher, const char* expect) {
  uint64_t repairs = 0;
  for (int i = 0; i < 100 && repairs == 0; ++i) {
    auto got = c.Get(key);
    if (expect) {
      EXPECT_TRUE(got.ok()) << got.status().ToString();
      if (got.ok()) {
        EXPECT_EQ(got->view(), expect);
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    repairs = StatsCounter(c, pusher, "read_repairs");
  }
  return repairs;
}

// Issue 38 item 3: with R = 2 a write is acknowledged only when both owners took it. The key's
// replica n0 is down for the second put; it comes back on its disk (with the first value) and
// then the primary n1 dies, so reads go to n0. Acknowledged on n1 alone (as before), that put
// was then read back older: "v1" after "v2" was acknowledged. Now the put fails, naming n0.
TEST(FailureTest, AWriteIsAcknowledgedOnlyWhenEveryOwnerHasIt) {
  Cluster cluster(3);
  ClientOptions o;
  o.cluster_file = cluster.cluster_file();
  o.replicas = 2;
  o.read_repair_chance = 0;  // nothing repairs n0 behind the test's back
  o.default_timeout = std::chrono::milliseconds(500);
  auto client = Client::Open(o);
  ASSERT_TRUE(client.ok()) << client.status().ToString();
  Client& c = **client;
  std::string k;
  for (int i = 0; k.empty(); ++i) {
    const std::string candidate = "both-owners-" + std::to_string(i);
    if (HashRing(c.cluster().nodes).NodesFor(candidate, 2) == std::vector<int>{1, 0}) {
      k = candidate;
    }
  }
  ASSERT_TRUE(c.Put(k, "v1", 2, Durable()).ok());
  cluster.StopNode(0, SIGKILL);
  auto second = c.Put(k, "v2", 2, Durable());
  const bool acknowledged = second.ok();
  EXPECT_FALSE(acknowledged) << "acknowledged with its replica n0 down";
  EXPECT_NE(second.status().message().find("replica n0"), std::string::npos)
      << second.status().ToString();
  cluster.StartNode(0);  // on its disk, with "v1"
  cluster.WaitReady();
  cluster.StopNode(1, SIGKILL);
  auto got = c.Get(k);
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_TRUE(!acknowledged || got->view() == "v2")
      << "read \"" << got->view() << "\" after \"v2\" was acknowledged";
}

// Read repair: a replica that missed a write the key's first node took (it was down, so the
// put failed, and came back on its disk with the older version) is brought up to date by the
// first node once reads notice it lagging, so it serves that write after the first node dies.
// (With read_repair_chance = 0 the last read returns "old".)
TEST(FailureTest, ReadRepairBringsALaggingReplicaUpToDate) {
  Cluster cluster(2);
  auto client = RepairingClient(cluster);
  ASSERT_TRUE(client);
  Client& c = *client;
  const std::string k = KeyOn(c, 0);
  const PutOptions durable = Durable();
  {
    auto first = c.Put(k, "old", 3, durable);
    ASSERT_TRUE(first.ok()) << first.status().ToString();
  }
  cluster.StopNode(1, SIGKILL);
  // Taken by the key's first node, n0, and not acknowledged: n1 did not take it.
  auto put = c.Put(k, "new", 3, durable);
  ASSERT_EQ(put.status().code(), StatusCode::kUnavailable) << put.status().ToString();
  cluster.StartNode(1);  // on its disk, with "old"
  cluster.WaitReady();
  EXPECT_GT(ReadUntilRepaired(c, k, /*pusher=*/0, "new"), 0u) << "no read noticed that n1 lags";
  cluster.StopNode(0, SIGKILL);
  auto got = c.Get(k);
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_EQ(got->view(), "new");
}

// Read repair the other way: a replica holding a newer version than the key's first node
// (which was down for a write: the put failed, but the replica took it) pushes it there, so
// the replicas converge on one value instead of serving different ones by who answers.
TEST(FailureTest, ReadRepairBringsTheFirstNodeUpToAReplicasNewerWrite) {
  Cluster cluster(2);
  auto client = RepairingClient(cluster);
  ASSERT_TRUE(client);
  Client& c = *client;
  const std::string k = KeyOn(c, 0);
  const PutOptions durable = Durable();
  {
    auto first = c.Put(k, "old", 3, durable);
    ASSERT_TRUE(first.ok()) << first.status().ToString();
  }
  cluster.StopNode(0, SIGKILL);
  EXPECT_FALSE(c.Put(k, "new", 3, durable).ok());  // the first node is down: not acknowledged
  cluster.StartNode(0);                            // on its disk, with "old"
  cluster.WaitReady();
  EXPECT_GT(ReadUntilRepaired(c, k, /*pusher=*/1, nullptr), 0u)
      << "no read noticed that n0 lags behind n1";
  auto got = c.Get(k);
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_EQ(got->view(), "new");
}

// Replicated writes carry the version the client assigned (kFlagClientVersion): every replica
// gives a put and a batch item the same version, which is what
// lets read repair tell a lagging replica from an up-to-date one. (Before, each node versioned
// the write from its own clock and no two replicas agreed.)
TEST(FailureTest, ReplicasOfAWriteAgreeOnItsVersion) {
  Cluster cluster(3);
  ClientOptions o;
  o.cluster_file = cluster.cluster_file();
  o.replicas = 3;
  o.read_repair_chance = 0;
  auto client = Client::Open(o);
  ASSERT_TRUE(client.ok()) << client.status().ToString();
  Client& c = **client;
  std::vector<std::unique_ptr<Client>> only(3);
  for (int i = 0; i < 3; ++i) {
    ClientOptions oi;
    oi.cluster_file = cluster.SingleNodeFile(i);
    auto ci = Client::Open(oi);
    ASSERT_TRUE(ci.ok()) << ci.status().ToString();
    only[i] = std::move(*ci);
  }
  auto expect_everywhere = [&](const std::string& key, uint64_t version) {
    for (int i = 0; i < 3; ++i) {
      auto st = only[i]->Stat(key);
      ASSERT_TRUE(st.ok()) << "n" << i << ": " << st.status().ToString();
      EXPECT_EQ(st->version, version) << key << " on n" << i;
    }
  };
  for (int round = 0; round < 5; ++round) {
    const std::string key = "agree-" + std::to_string(round);
    auto put = c.Put(key, "v1", 2);
    ASSERT_TRUE(put.ok()) << put.status().ToString();
    expect_everywhere(key, *put);
    auto again = c.Put(key, "v2", 2);
    ASSERT_TRUE(again.ok());
    EXPECT_GT(*again, *put);
    expect_everywhere(key, *again);
  }
  std::vector<PutItem> items;
  for (int i = 0; i < 8; ++i) items.push_back({"agree-batch-" + std::to_string(i), "b", 1, {}});
  auto results = c.MultiPut(items);
  for (size_t i = 0; i < items.size(); ++i) {
    ASSERT_TRUE(results[i].ok()) << results[i].status().ToString();
    expect_everywhere(items[i].key, *results[i]);
  }
  // A write through one node alone (no client version) is versioned by that node's clock,
  // which has adopted the client's versions: it still orders after them.
  auto solo = only[1]->Put("agree-0", "v3", 2);
  ASSERT_TRUE(solo.ok());
  auto st = only[0]->Stat("agree-0");
  ASSERT_TRUE(st.ok());
  EXPECT_GT(*solo, st->version);
}

TEST(FailureTest, DurablePutsSurviveSigkillAndAWarmRestart) {
  Cluster cluster(1);
  Random rng(testing::TestSeed());
  std::map<std::string, std::string> written;
  {
    auto client = cluster.NewClient();
    ASSERT_TRUE(client);
    PutOptions durable;
    durable.durable = true;
    for (int i = 0; i < 40; ++i) {
      std::string v(rng.Uniform(1, 300000), '\0');
      rng.Fill(v.data(), v.size());
      std::string key = "durable/" + std::to_string(i);
      ASSERT_TRUE(client->Put(key, v.data(), v.size(), durable).ok());
      written[key] = v;
    }
  }
  EXPECT_EQ(cluster.StopNode(0, SIGKILL), -SIGKILL);
  cluster.StartNode(0);
  cluster.WaitReady();
  auto client = cluster.NewClient();
  for (auto& [key, value] : written) {
    auto got = client->Get(key);
    ASSERT_TRUE(got.ok()) << key << ": " << got.status().ToString();
    EXPECT_TRUE(got->view() == value) << key;
  }
  EXPECT_NE(cluster.ReadLog(0).find("40 objects"), std::string::npos) << cluster.ReadLog(0);
}

// Sends raw messages with a bare UcxTransport, as a broken or hostile client would.
TEST(FailureTest, MalformedMessagesGetErrorsAndTheNodeKeepsServing) {
  Cluster cluster(1);
  auto client = cluster.NewClient();
  ASSERT_TRUE(client);
  ASSERT_TRUE(client->Put("survivor", "alive", 5).ok());

  std::atomic<int> replies{0}, protocol_errors{0}, invalid{0};
  UcxTransport::Handlers h;
  std::unique_ptr<UcxTransport> raw;
  h.on_message = [&](std::unique_ptr<Incoming> m) {
    wire::Header hd;
    std::string_view body;
    // Every reply body starts with its status code (docs/PROTOCOL.md).
    StatusCode code = StatusCode::kOk;
    if (wire::DecodeMessage(m->header().data(), m->header().size(), &hd, &body).ok() &&
        !body.empty()) {
      code = static_cast<StatusCode>(body[0]);
    }
    if (code == StatusCode::kProtocolError) protocol_errors++;
    if (code == StatusCode::kInvalidArgument) invalid++;
    replies++;
  };
  auto t = UcxTransport::Create({}, std::move(h));
  ASSERT_TRUE(t.ok());
  raw = std::move(*t);
  auto cluster_cfg = *LoadClusterFile(cluster.cluster_file());
  const uint16_t port = cluster_cfg.nodes[0].port;

  auto header = [](wire::Opcode op, std::string body, uint64_t id) {
    return wire::EncodeMessage({op, 0, id}, body);
  };
  std::vector<std::pair<std::string, std::string>> msgs;  // header, payload
  std::string good_put = wire::EncodePutRequest({"k", {}, 10});
  msgs.push_back({"short", ""});  // truncated header
  std::string bad_magic = header(wire::Opcode::kGet, wire::EncodeKeyRequest("a"), 2);
  bad_magic[0] = 'X';
  msgs.push_back({bad_magic, ""});
  std::string bad_version = header(wire::Opcode::kGet, wire::EncodeKeyRequest("a"), 3);
  bad_version[4] = 9;
  msgs.push_back({bad_version, ""});
  std::string bad_len = header(wire::Opcode::kGet, wire::EncodeKeyRequest("a"), 4);
  bad_len[16] = 100;
  msgs.push_back({bad_len, ""});
  std::string bad_op = header(wire::Opcode::kGet, "", 5);
  bad_op[5] = 77;
  msgs.push_back({bad_op, ""});
  msgs.push_back({header(wire::Opcode::kPut, good_put, 6), std::string(3, 'x')});  // size lies
  msgs.push_back({header(wire::Opcode::kPut, good_put.substr(0, 5), 7), ""});      // cut body
  msgs.push_back({header(wire::Opcode::kGet, wire::EncodeKeyRequest(std::string(5000, 'k')), 8),
                  ""});  // key too long
  msgs.push_back({header(wire::Opcode::kMultiGet, "", 9), std::string("\xff\xff\xff\x0f", 4)});
  msgs.push_back({header(wire::Opcode::kMultiPut, "", 10), std::string(64, '\x07')});
  std::promise<void> sent;
  raw->Post([&] {
    auto conn = raw->Connect("127.0.0.1", port);
    ASSERT_TRUE(conn.ok());
    for (auto& [hd, payload] : msgs) {
      auto keep = std::make_shared<std::string>(payload);
      raw->Send(*conn, wire::kAmRequest, hd, keep->data(), keep->size(), MemoryKind::kHost,
                [keep](Status) {});
    }
    // A reply-type message to a server is ignored, not answered.
    raw->Send(*conn, wire::kAmReply, header(wire::Opcode::kPing, "", 11), nullptr, 0,
              MemoryKind::kHost, [](Status) {});
    sent.set_value();
  });
  sent.get_future().wait();
  for (int i = 0; i < 300 && replies.load() < static_cast<int>(msgs.size()); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(replies.load(), static_cast<int>(msgs.size())) << "every bad request gets a reply";
  EXPECT_GE(protocol_errors.load() + invalid.load(), static_cast<int>(msgs.size()) - 1);
  raw.reset();
  // The node goes on serving everyone else.
  EXPECT_EQ(client->Get("survivor")->view(), "alive");
  std::string stats = *client->NodeStats(0);
  auto at = stats.find("\"protocol_errors\":");
  ASSERT_NE(at, std::string::npos);
  EXPECT_GE(std::stoi(stats.substr(at + 18)), 5);
}

TEST(FailureTest, OverloadStaysWithinCapacityWithClearErrors) {
  NodeSpec spec;
  spec.host_mem = "8MiB";
  spec.disk = false;
  Cluster cluster(1, spec);
  auto client = cluster.NewClient(std::chrono::seconds(10));
  ASSERT_TRUE(client);
  std::string v(1 << 20, 'o');
  int ok = 0, no_space = 0, other = 0;
  for (int i = 0; i < 64; ++i) {
    auto r = client->Put("big/" + std::to_string(i), v.data(), v.size());
    if (r.ok())
      ok++;
    else if (r.status().code() == StatusCode::kNoSpace)
      no_space++;
    else
      other++;
  }
  EXPECT_EQ(other, 0);
  EXPECT_EQ(ok + no_space, 64);
  std::string stats = *client->NodeStats(0);
  std::smatch m;
  std::regex host_re(R"re("host":\{"enabled":true,"capacity_bytes":(\d+),"used_bytes":(\d+))re");
  ASSERT_TRUE(std::regex_search(stats, m, host_re)) << stats;
  EXPECT_LE(std::stoull(m[2]), std::stoull(m[1]));
  // Too big for the node at all: a clear refusal.
  std::string huge(16 << 20, 'h');
  auto r = client->Put("huge", huge.data(), huge.size());
  EXPECT_EQ(r.status().code(), StatusCode::kNoSpace);
  EXPECT_TRUE(client->Put("after", "fine", 4).ok());
}

// Value bytes derived from (key, sequence) so any read can be checked.
std::string MakeValue(const std::string& key, uint64_t seq, size_t size) {
  std::string v(size, '\0');
  Random r(HashKey(key) ^ (seq * 0x9e3779b97f4a7c15ULL));
  r.Fill(v.data(), size);
  std::memcpy(v.data(), &seq, 8);
  return v;
}

TEST(FailureTest, FaultInjectionKillAndRestartUnderLoad) {
  Cluster cluster(3);
  ClientOptions o;
  o.cluster_file = cluster.cluster_file();
  o.default_timeout = std::chrono::milliseconds(300);
  o.reconnect_backoff_max = std::chrono::milliseconds(400);
  auto opened = Client::Open(o);
  ASSERT_TRUE(opened.ok());
  Client& c = **opened;
  const int kKeys = 300;
  std::vector<std::string> keys;
  std::vector<std::atomic<uint64_t>> acked(kKeys), next_seq(kKeys);
  PutOptions durable;
  durable.durable = true;
  // The fill is setup, not under test: it gets a sanitizer-proof timeout (the load below keeps
  // the 300 ms the test is about).
  PutOptions fill = durable;
  fill.timeout = std::chrono::seconds(5);
  for (int i = 0; i < kKeys; ++i) {
    keys.push_back("fi/" + std::to_string(i));
    std::string v = MakeValue(keys[i], 1, 2048);
    auto put = c.Put(keys[i], v.data(), v.size(), fill);
    ASSERT_TRUE(put.ok()) << put.status().ToString();
    acked[i] = 1;
    next_seq[i] = 2;
  }
  std::atomic<bool> stop{false};
  std::atomic<uint64_t> ops{0}, errors{0}, wrong{0}, node1_errors{0};
  std::atomic<int64_t> restart_at_ns{0}, recovered_at_ns{0};
  const auto t0 = Clock::now();
  auto since = [&] {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t0).count();
  };
  std::vector<std::thread> load;
  for (int t = 0; t < 2; ++t) {
    load.emplace_back([&, t] {
      Random rng(testing::TestSeed() + t);
      while (!stop) {
        int i = static_cast<int>(rng.Uniform(0, kKeys - 1));
        const bool read = rng.Uniform(0, 1) == 0;
        // Each key has one writer thread, so "the last acknowledged write" is well defined
        // (two concurrent writers may legitimately land in either order).
        if (!read) i = i - i % 2 + t;
        const bool on1 = c.NodeFor(keys[i]) == 1;
        bool ok;
        if (read) {
          uint64_t floor = acked[i].load();
          auto r = c.Get(keys[i]);
          ok = r.ok();
          if (ok) {
            uint64_t seq;
            std::memcpy(&seq, r->data(), 8);
            if (seq < floor || r->view() != MakeValue(keys[i], seq, r->size())) wrong++;
          }
        } else {
          uint64_t seq = next_seq[i].fetch_add(1);
          std::string v = MakeValue(keys[i], seq, 2048);
          ok = c.Put(keys[i], v.data(), v.size(), durable).ok();
          if (ok) {
            uint64_t cur = acked[i].load();
            while (seq > cur && !acked[i].compare_exchange_weak(cur, seq)) {
            }
          }
        }
        ops++;
        if (!ok) {
          errors++;
          if (on1) node1_errors++;
        } else if (on1 && restart_at_ns.load() && !recovered_at_ns.load()) {
          int64_t zero = 0;
          recovered_at_ns.compare_exchange_strong(zero, since());
        }
      }
    });
  }
  std::this_thread::sleep_for(std::chrono::seconds(1));
  const uint64_t ops_before_kill = ops.load();
  cluster.StopNode(1, SIGKILL);
  const auto killed_at = Clock::now();
  std::this_thread::sleep_for(std::chrono::seconds(1));
  cluster.StartNode(1);
  restart_at_ns = since();
  std::this_thread::sleep_for(std::chrono::seconds(3));
  stop = true;
  for (auto& th : load) th.join();

  // Full service afterwards: every key readable, never older than its last acknowledged write.
  // A slow restart on a loaded machine: give node 1 up to 10 s to serve again.
  std::string probe;
  for (int i = 0; i < kKeys && probe.empty(); ++i) {
    if (c.NodeFor(keys[i]) == 1) probe = keys[i];
  }
  for (int retry = 0; retry < 100 && !c.Get(probe).ok(); ++retry) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  int readable = 0;
  for (int i = 0; i < kKeys; ++i) {
    auto r = c.Get(keys[i]);
    if (!r.ok()) continue;
    uint64_t seq;
    std::memcpy(&seq, r->data(), 8);
    EXPECT_GE(seq, acked[i].load()) << keys[i] << ": an acknowledged durable write was lost";
    EXPECT_TRUE(r->view() == MakeValue(keys[i], seq, r->size())) << keys[i];
    readable++;
  }
  std::smatch m;
  std::string log = cluster.ReadLog(1);
  std::regex rec_re(R"(disk tier at .*: (\d+) objects)");
  const std::string recovered = std::regex_search(log, m, rec_re) ? m[1].str() : "?";
  const double recover_ms =
      recovered_at_ns.load() ? (recovered_at_ns.load() - restart_at_ns.load()) / 1e6 : -1;
  std::cout << "fault injection: ops " << ops.load() << " (before the kill " << ops_before_kill
            << "), errors " << errors.load() << " (on node 1's keys " << node1_errors.load()
            << "), wrong values " << wrong.load() << ", first success on node 1 " << recover_ms
            << " ms after its restart, objects recovered by the warm restart " << recovered
            << ", keys readable after " << readable << "/" << kKeys << "\n";
  RecordProperty("errors", std::to_string(errors.load()));
  RecordProperty("recover_ms", std::to_string(recover_ms));
  (void)killed_at;
  EXPECT_EQ(wrong.load(), 0u);
  // Keys on the live nodes keep working; on a loaded 2-core machine an occasional durable write
  // can still miss the 300 ms deadline, so allow a sliver of those.
  const uint64_t other_errors = errors.load() - node1_errors.load();
  EXPECT_LE(other_errors, std::max<uint64_t>(5, ops.load() / 100)) << "live nodes failed requests";
  EXPECT_GT(recovered_at_ns.load(), 0) << "node 1 never served again after its restart";
  EXPECT_EQ(readable, kKeys);
}

}  // namespace
}  // namespace gkv
