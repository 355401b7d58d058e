// Elastic membership with a real etcd and real gkv-server processes (docs/ARCHITECTURE.md,
// "Membership"): nodes join, drain, die, and etcd itself restarts, while a validating load
// runs throughout. The load checks every read against the writes acknowledged before it began:
//   - lost: a key with an acknowledged durable write read as missing;
//   - stale: a value older than the newest write acknowledged before the read began;
//   - corrupt: bytes no writer ever wrote.
// Each must stay 0. Times (lease expiry to rerouting, handoff rate, p99) are printed.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "etcd_harness.h"
#include "free_port.h"
#include "gkv/client.h"
#include "gkv/histogram.h"
#include "gkv/membership.h"
#include "gkv/sanitizers.h"
#include "spawn.h"
#include "test_util.h"

namespace gkv::testing {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

class ElasticCluster {
 public:
  explicit ElasticCluster(int replicas = 1, int lease_ttl_s = 2)
      : replicas_(replicas), lease_ttl_s_(lease_ttl_s) {
    EXPECT_TRUE(etcd_.Start());
    etcd_config_.endpoints = {etcd_.endpoint()};
    etcd_config_.cluster = "elastic";
    etcd_config_.lease_ttl_s = lease_ttl_s;
    file_ = dir_.Sub("cluster.yaml");
    std::ofstream f(file_);
    f << "membership: etcd\n"
      << "etcd: {endpoints: [" << etcd_.endpoint()
      << "], cluster: elastic, lease_ttl_s: " << lease_ttl_s << "}\n"
      << "replicas: " << replicas << "\n";
  }
  ~ElasticCluster() {
    for (auto& [id, pid] : pids_) {
      if (pid > 0) Stop(id, SIGKILL);
    }
  }

  const std::string& file() const { return file_; }

  // Node `id` (when started next) reaches etcd at `endpoint` (a TcpProxy's, to cut it off
  // from etcd while clients and the other nodes still reach it).
  void UseEtcdEndpoint(const std::string& id, const std::string& endpoint) {
    const std::string path = dir_.Sub(id + "-cluster.yaml");
    std::ofstream f(path);
    f << "membership: etcd\n"
      << "etcd: {endpoints: [" << endpoint << "], cluster: elastic, lease_ttl_s: " << lease_ttl_s_
      << "}\n"
      << "replicas: " << replicas_ << "\n";
    cluster_file_of_[id] = path;
  }
  const EtcdConfig& etcd_config() const { return etcd_config_; }
  EtcdProcess& etcd() { return etcd_; }
  std::string log(const std::string& id) const { return dir_.Sub(id + ".log"); }

  // Starts node `id` (on the disk directory of node `disk_of`, its own by default) and waits
  // until etcd lists it.
  void Start(const std::string& id, std::vector<std::string> extra = {},
             const std::string& disk_of = "") {
    pid_t pid = Spawn(id, std::move(extra), disk_of);
    ASSERT_GT(pid, 0);
    ASSERT_TRUE(WaitMember(id, true, milliseconds(15000))) << "node " << id << " did not register";
  }

  // Starts node `id` and returns its pid (-1: the fork failed), not waiting for anything.
  pid_t Spawn(const std::string& id, std::vector<std::string> extra = {},
              const std::string& disk_of = "") {
    const uint16_t port = FreePort();
    auto own_file = cluster_file_of_.find(id);
    std::vector<std::string> args = {GKV_SERVER_BIN,
                                     "--cluster",
                                     own_file == cluster_file_of_.end() ? file_ : own_file->second,
                                     "--node",
                                     id,
                                     "--listen",
                                     "127.0.0.1:" + std::to_string(port),
                                     "--host-mem",
                                     "64MiB",
                                     "--disk",
                                     dir_.Sub(disk_of.empty() ? id : disk_of),
                                     "--disk-capacity",
                                     "256MiB",
                                     "--threads",
                                     "2",
                                     "--io-threads",
                                     "2",
                                     "--placement-partitions",
                                     "2",
                                     "--leave-timeout-ms",
                                     "20000"};
    // An option given in `extra` replaces its default here (the server refuses one twice).
    for (size_t i = 0; i + 1 < extra.size(); ++i) {
      if (!extra[i].starts_with("--")) continue;
      auto at = std::find(args.begin(), args.end(), extra[i]);
      if (at != args.end() && at + 1 != args.end()) args.erase(at, at + 2);
    }
    args.insert(args.end(), extra.begin(), extra.end());
    pid_t pid = SpawnLogged(std::move(args), log(id));
    pids_[id] = pid;
    ports_[id] = port;
    return pid;
  }

  // Sends `sig`, without waiting.
  void Signal(const std::string& id, int sig) {
    if (pids_[id] > 0) kill(pids_[id], sig);
  }

  // Sends `sig` and waits (up to 30 s) for the exit; returns the exit code or -signal.
  int Stop(const std::string& id, int sig) {
    pid_t pid = pids_[id];
    if (pid <= 0) return 0;
    kill(pid, sig);
    return Wait(id, milliseconds(30000));
  }

  int Wait(const std::string& id, milliseconds timeout) {
    pid_t pid = pids_[id];
    int status = 0;
    const auto until = Clock::now() + timeout;
    while (Clock::now() < until) {
      if (waitpid(pid, &status, WNOHANG) == pid) {
        pids_[id] = -1;
        return WIFEXITED(status) ? WEXITSTATUS(status) : -WTERMSIG(status);
      }
      std::this_thread::sleep_for(milliseconds(20));
    }
    kill(pid, SIGKILL);
    waitpid(pid, &status, 0);
    pids_[id] = -1;
    ADD_FAILURE() << "node " << id << " did not exit in time";
    return -SIGKILL;
  }

  // SIGKILLs node `id`, then waits (up to 15 s) until `watcher`'s ring changes (the node's
  // lease expired); returns the seconds from the kill, or -1 if the ring never changed.
  double KillAndWaitForRingChange(const std::string& id, Client& watcher) {
    const uint64_t epoch = watcher.RingEpoch();
    const auto killed = Clock::now();
    Stop(id, SIGKILL);
    while (watcher.RingEpoch() == epoch && Clock::now() - killed < std::chrono::seconds(15)) {
      std::this_thread::sleep_for(milliseconds(10));
    }
    if (watcher.RingEpoch() == epoch) return -1;
    return std::chrono::duration<double>(Clock::now() - killed).count();
  }

  bool WaitMember(const std::string& id, bool present, milliseconds timeout) {
    const auto until = Clock::now() + timeout;
    while (Clock::now() < until) {
      auto v = ReadMembership(etcd_config_);
      if (v.ok() && (v->Find(id) != nullptr) == present) return true;
      std::this_thread::sleep_for(milliseconds(50));
    }
    return false;
  }

  // Until no node has a handoff running (and at least `settle` has passed since the call).
  bool WaitHandoffsDone(milliseconds timeout) {
    std::this_thread::sleep_for(milliseconds(500));
    const auto until = Clock::now() + timeout;
    while (Clock::now() < until) {
      auto v = ReadMembership(etcd_config_);
      if (v.ok() && v->handoffs_running.empty()) return true;
      std::this_thread::sleep_for(milliseconds(50));
    }
    return false;
  }

  uint16_t port(const std::string& id) { return ports_[id]; }

  // The deadline of OpenClient's clients. The tests count errors from membership changes, not
  // slowness, and a node on this 2-core machine answers late when it is loaded: a durable put
  // waits for its RocksDB sync, which took 6.1 s beside an fsync-heavy writer (`slow reply` in
  // the node's log). CI failed a drain under ASan on a 5 s deadline that way, and a join then
  // drain failed on 2 s while a build ran beside it. Tests that stall a node (SIGSTOP) shorten
  // it: a call sent to the stalled node waits it out.
  void set_client_timeout(milliseconds t) { client_timeout_ = t; }

  std::unique_ptr<Client> OpenClient() {
    ClientOptions o;
    o.cluster_file = file_;
    o.default_timeout = client_timeout_;
    auto c = Client::Open(o);
    EXPECT_TRUE(c.ok()) << c.status().ToString();
    return c.ok() ? std::move(*c) : nullptr;
  }

 private:
  TempDir dir_;
  EtcdProcess etcd_;
  EtcdConfig etcd_config_;
  std::string file_;
  std::map<std::string, pid_t> pids_;
  std::map<std::string, uint16_t> ports_;
  std::map<std::string, std::string> cluster_file_of_;
  const int replicas_, lease_ttl_s_;
  milliseconds client_timeout_{kAddressSanitizer ? 15000 : 10000};
};

// A value that names its key and write number, with filler derived from both (checked).
std::string MakeValue(int key, uint64_t seq) {
  std::string v = std::to_string(key) + "|" + std::to_string(seq) + "|";
  const size_t size = 512 + (seq * 7919 + key) % 3584;
  for (size_t i = v.size(); i < size; ++i)
    v.push_back(static_cast<char>('a' + (key + seq + i) % 26));
  return v;
}

bool ParseValue(std::string_view v, int* key, uint64_t* seq) {
  const size_t a = v.find('|');
  const size_t b = a == std::string_view::npos ? a : v.find('|', a + 1);
  if (b == std::string_view::npos) return false;
  try {
    *key = std::stoi(std::string(v.substr(0, a)));
    *seq = std::stoull(std::string(v.substr(a + 1, b - a - 1)));
  } catch (...) {
    return false;
  }
  return MakeValue(*key, *seq) == v;
}

// Writers and readers over `keys` keys with durable writes, checking every read.
class Checker {
 public:
  Checker(ElasticCluster& cluster, int keys)
      : cluster_(cluster), keys_(keys), acked_(keys), reach_floor_(keys) {
    for (auto& a : acked_) a.store(0);
    for (auto& a : reach_floor_) a.store(0);
  }
  ~Checker() { StopLoad(); }  // a test that ended early (a failed ASSERT) still joins its load

  // Writes every key once (so every key has an acknowledged durable value).
  void Fill() {
    auto c = cluster_.OpenClient();
    ASSERT_NE(c, nullptr);
    for (int k = 0; k < keys_; ++k) Write(*c, k);
    ASSERT_EQ(write_errors_.load(), 0u) << "setup writes failed";
  }

  void Start(int writers = 1, int readers = 2) {
    stop_ = false;
    for (int t = 0; t < writers; ++t) {
      threads_.emplace_back([this, t] {
        auto c = cluster_.OpenClient();
        if (!c) return;
        uint64_t i = t;
        while (!stop_) Write(*c, static_cast<int>((i += 7) % keys_));
      });
    }
    for (int t = 0; t < readers; ++t) {
      threads_.emplace_back([this, t] {
        auto c = cluster_.OpenClient();
        if (!c) return;
        uint64_t i = t * 13;
        while (!stop_) Read(*c, static_cast<int>((i += 3) % keys_));
      });
    }
  }

  void StopLoad() {
    stop_ = true;
    for (auto& t : threads_) t.join();
    threads_.clear();
  }

  // After the load: every key read once more, each must hold its newest acknowledged write.
  void FinalCheck() {
    auto c = cluster_.OpenClient();
    ASSERT_NE(c, nullptr);
    for (int k = 0; k < keys_; ++k) Read(*c, k);
  }

  std::string Key(int k) const { return "elastic-" + std::to_string(k); }

  void Write(Client& c, int k) {
    const uint64_t seq = next_seq_.fetch_add(1) + 1;
    const std::string v = MakeValue(k, seq);
    PutOptions po;
    po.durable = true;
    const auto start = Clock::now();
    auto r = c.Put(Key(k), v.data(), v.size(), po);
    Record(start, /*read=*/false);
    if (!r.ok()) {
      write_errors_++;
      std::lock_guard<std::mutex> lock(mu_);
      if (first_write_error_.empty()) first_write_error_ = r.status().ToString() + Window(start);
      return;
    }
    writes_++;
    // The newest acknowledged write of the key (writes of one key by two writers may ack in
    // either order: the larger seq is not necessarily the last one, so keep the larger only
    // when the writes did not overlap; one writer per key set keeps this exact).
    uint64_t cur = acked_[k].load();
    while (cur < seq && !acked_[k].compare_exchange_weak(cur, seq)) {
    }
  }

  void Read(Client& c, int k) {
    const uint64_t floor = acked_[k].load();  // acknowledged before this read began
    const auto start = Clock::now();
    auto r = c.Get(Key(k));
    Record(start, /*read=*/true);
    reads_++;
    int key = -1;
    uint64_t seq = 0;
    if (!r.ok()) {
      if (r.status().code() == StatusCode::kNotFound && floor > 0 && OutOfReach(k, floor)) {
        unreachable_++;
      } else if (r.status().code() == StatusCode::kNotFound && floor > 0) {
        // When, and against what: the write it missed, and (R = 1 faults) whether the key's
        // only node was out and what the key held when it went.
        const auto ms = [this](Clock::time_point t) {
          return std::to_string(
              std::chrono::duration_cast<std::chrono::milliseconds>(t - born_).count());
        };
        std::string what = "lost " + Key(k) + ": " + r.status().ToString() + " (read " + ms(start) +
                           "-" + ms(Clock::now()) + " ms, missed write " + std::to_string(floor);
        if (tracked_) {
          what += ", out of reach " + std::string(away_.load() ? "yes" : "no") +
                  ", written before the fault " + std::to_string(reach_floor_[k].load());
        }
        Anomaly(lost_, what + ")");
      } else if (r.status().code() != StatusCode::kNotFound) {
        read_errors_++;
        std::lock_guard<std::mutex> lock(mu_);
        if (first_read_error_.empty()) first_read_error_ = r.status().ToString() + Window(start);
      }
      return;
    }
    if (!ParseValue(r->view(), &key, &seq) || key != k) {
      return Anomaly(corrupt_, "corrupt value for " + Key(k));
    }
    if (seq < floor) {
      Anomaly(stale_, "stale " + Key(k) + ": read write " + std::to_string(seq) + " after write " +
                          std::to_string(floor) + " was acknowledged");
    }
  }

  // With R = 1 a key's only copy is on its node: while that node is out of the ring its keys
  // miss (NotFound) until it is back and caught up. From BeginOutOfReach to EndOutOfReach such
  // a miss of a key in `keys` that was not written since is counted as unreachable, not lost;
  // a miss after a newer write (its new owner took it) is still lost.
  void BeginOutOfReach(const std::vector<bool>& keys) {
    for (int k = 0; k < keys_; ++k) {
      if (keys[k]) reach_floor_[k].store(acked_[k].load());
    }
    tracked_ = true;
    away_.store(true, std::memory_order_release);
  }
  void EndOutOfReach() { away_.store(false, std::memory_order_release); }
  bool OutOfReach(int k, uint64_t floor) const {
    const uint64_t before = reach_floor_[k].load();
    return away_.load(std::memory_order_acquire) && before != 0 && before == floor;
  }

  // " (call 1234-5234 ms)": when a call ran, since the checker was made.
  std::string Window(Clock::time_point start) const {
    const auto ms = [this](Clock::time_point t) {
      return std::to_string(
          std::chrono::duration_cast<std::chrono::milliseconds>(t - born_).count());
    };
    return " (call " + ms(start) + "-" + ms(Clock::now()) + " ms)";
  }

  void Record(Clock::time_point start, bool read) {
    const int64_t ns =
        std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - start).count();
    std::lock_guard<std::mutex> lock(mu_);
    (read ? read_latency_ : write_latency_).Record(ns);
  }
  // Latency percentiles since the last call (ms).
  std::pair<double, double> TakeReadP50P99() {
    std::lock_guard<std::mutex> lock(mu_);
    auto out =
        std::make_pair(read_latency_.Percentile(0.5) / 1e6, read_latency_.Percentile(0.99) / 1e6);
    read_latency_ = Histogram();
    return out;
  }

  void Anomaly(std::atomic<uint64_t>& counter, const std::string& what) {
    counter++;
    std::lock_guard<std::mutex> lock(mu_);
    if (examples_.size() < 5) examples_.push_back(what);
  }

  std::string Report() const {
    std::string s = "writes " + std::to_string(writes_) + " (failed " +
                    std::to_string(write_errors_) + "), reads " + std::to_string(reads_) +
                    " (failed " + std::to_string(read_errors_) + "); lost " +
                    std::to_string(lost_) + ", stale " + std::to_string(stale_) + ", corrupt " +
                    std::to_string(corrupt_);
    if (unreachable_ > 0) {
      s += "; " + std::to_string(unreachable_) + " misses of keys whose only node was out";
    }
    for (const auto& e : examples_) s += "\n  " + e;
    if (!first_write_error_.empty()) s += "\n  first write error: " + first_write_error_;
    if (!first_read_error_.empty()) s += "\n  first read error: " + first_read_error_;
    return s;
  }

  void ExpectNoAnomalies() {
    EXPECT_EQ(lost_.load(), 0u) << Report();
    EXPECT_EQ(stale_.load(), 0u) << Report();
    EXPECT_EQ(corrupt_.load(), 0u) << Report();
  }

  std::atomic<uint64_t> writes_{0}, reads_{0}, write_errors_{0}, read_errors_{0};
  std::atomic<uint64_t> lost_{0}, stale_{0}, corrupt_{0}, unreachable_{0};

 private:
  ElasticCluster& cluster_;
  const int keys_;
  std::vector<std::atomic<uint64_t>> acked_;
  std::vector<std::atomic<uint64_t>> reach_floor_;  // the key's floor when its node went out
  std::atomic<bool> away_{false}, tracked_{false};
  const Clock::time_point born_ = Clock::now();
  std::atomic<uint64_t> next_seq_{0};
  std::atomic<bool> stop_{false};
  std::vector<std::thread> threads_;
  mutable std::mutex mu_;
  std::vector<std::string> examples_;
  std::string first_write_error_, first_read_error_;
  Histogram read_latency_, write_latency_;
};

// How many of the keys `client` routes to node `id`, and answers there.
double ShareOn(Client& client, const Checker& checker, int keys, const std::string& id) {
  auto nodes = client.Nodes();
  int on = 0;
  for (int k = 0; k < keys; ++k) {
    const int n = client.NodeFor(checker.Key(k));
    if (n >= 0 && nodes[n].id == id && client.Stat(checker.Key(k)).ok()) ++on;
  }
  return static_cast<double>(on) / keys;
}

void PrintHandoffLines(const ElasticCluster& cluster, const std::vector<std::string>& ids) {
  for (const auto& id : ids) {
    std::ifstream f(cluster.log(id));
    std::string line;
    while (std::getline(f, line)) {
      if (line.find("handoff for ring epoch") != std::string::npos ||
          line.find("ring epoch") != std::string::npos ||
          line.find("caught up") != std::string::npos || line.find("fenced") != std::string::npos ||
          line.find("slow reply") != std::string::npos ||
          line.find("membership:") != std::string::npos) {
        std::printf("[%s] %s\n", id.c_str(), line.c_str());
      }
    }
  }
}

constexpr int kKeys = 1500;

// Runs the gkv tool; returns its exit code and what it printed (stdout and stderr).
std::pair<int, std::string> Gkv(const std::string& cluster_file, const std::string& args) {
  const std::string cmd =
      std::string(GKV_CLI_BIN) + " --cluster " + cluster_file + " " + args + " 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  std::string out;
  char buf[4096];
  size_t n;
  while (p && (n = fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  const int status = p ? pclose(p) : -1;
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out};
}

size_t Count(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

TEST(ElasticTest, ScaleOutFromThreeToFourNodesLosesNothing) {
  ElasticCluster cluster;
  for (const char* id : {"n0", "n1", "n2"}) cluster.Start(id);
  Checker checker(cluster, kKeys);
  checker.Fill();
  checker.Start();
  std::this_thread::sleep_for(milliseconds(1500));
  auto before = checker.TakeReadP50P99();
  const auto joined = Clock::now();
  cluster.Start("n3");
  ASSERT_TRUE(cluster.WaitHandoffsDone(milliseconds(30000)));
  const double handoff_s = std::chrono::duration<double>(Clock::now() - joined).count();
  auto during = checker.TakeReadP50P99();
  std::this_thread::sleep_for(milliseconds(1000));
  checker.StopLoad();
  checker.FinalCheck();
  std::printf(
      "scale-out 3->4: %s\n  join to handoffs done %.2f s; read p50/p99 before %.2f/%.2f ms, "
      "during %.2f/%.2f ms\n",
      checker.Report().c_str(), handoff_s, before.first, before.second, during.first,
      during.second);
  PrintHandoffLines(cluster, {"n0", "n1", "n2", "n3"});
  checker.ExpectNoAnomalies();
  EXPECT_EQ(checker.read_errors_.load(), 0u) << checker.Report();
  EXPECT_EQ(checker.write_errors_.load(), 0u) << checker.Report();
  auto c = cluster.OpenClient();
  ASSERT_NE(c, nullptr);
  // n3 holds every key it owns, and owns its weight's share of the key space (within the
  // ring's 15%, HashRingBalanceTest; of 1,500 keys it owns 0.215 under placement version 2,
  // sampling noise of about 0.011 on top of its ring share of 0.240).
  const double share = ShareOn(*c, checker, kKeys, "n3");
  int owned = 0;
  for (int k = 0; k < kKeys; ++k) owned += c->Nodes()[c->NodeFor(checker.Key(k))].id == "n3";
  std::printf("  n3 holds %.3f of the keys and owns %.3f (weight share 0.25)\n", share,
              static_cast<double>(owned) / kKeys);
  EXPECT_DOUBLE_EQ(share, static_cast<double>(owned) / kKeys);
  EXPECT_NEAR(share, 0.25, 0.25 * 0.15 + 4 * 0.0112);
  // The tool reaches every member named in etcd (the cluster file names none).
  auto [stats_code, stats] = Gkv(cluster.file(), "stats --json");
  EXPECT_EQ(stats_code, 0) << stats;
  EXPECT_EQ(Count(stats, "\"handoff_keys_in\":"), 4u) << stats;
  auto [stat_code, stat] = Gkv(cluster.file(), "stat " + checker.Key(0));
  EXPECT_EQ(stat_code, 0) << stat;
  EXPECT_NE(stat.find("(node n"), std::string::npos) << stat;
}

TEST(ElasticTest, DrainingOneOfFourNodesHandsEverythingOff) {
  ElasticCluster cluster;
  for (const char* id : {"n0", "n1", "n2", "n3"}) cluster.Start(id);
  Checker checker(cluster, kKeys);
  checker.Fill();
  checker.Start();
  std::this_thread::sleep_for(milliseconds(1000));
  const auto asked = Clock::now();
  ASSERT_TRUE(RequestDrain(cluster.etcd_config(), "n1").ok());
  // The node hands off, leaves etcd and exits 0 by itself.
  EXPECT_EQ(cluster.Wait("n1", milliseconds(30000)), 0);
  const double drain_s = std::chrono::duration<double>(Clock::now() - asked).count();
  EXPECT_TRUE(cluster.WaitMember("n1", false, milliseconds(2000)));
  std::this_thread::sleep_for(milliseconds(1000));
  checker.StopLoad();
  checker.FinalCheck();
  std::printf("drain 1 of 4: %s\n  drain request to exit %.2f s\n", checker.Report().c_str(),
              drain_s);
  PrintHandoffLines(cluster, {"n0", "n1", "n2", "n3"});
  checker.ExpectNoAnomalies();
  // A key that answered wrong_node, a timeout or unavailable after the move is an error, not
  // a pass (issue 38 item 9).
  EXPECT_EQ(checker.read_errors_.load(), 0u) << checker.Report();
  EXPECT_EQ(checker.write_errors_.load(), 0u) << checker.Report();
}

// SIGTERM under etcd while writers and readers run (issue 38 item 9): the node hands every
// key off and exits 0, and nothing acknowledged is lost or stale. The ring it leaves by has an
// epoch of its own (item 3: it kept the previous one, so writes admitted just before the flip
// were not looked at again and could stay on the departed disk only).
TEST(ElasticTest, SigtermUnderWriteLoadHandsEverythingOffAndLosesNothing) {
  ElasticCluster cluster;
  for (const char* id : {"n0", "n1", "n2"}) cluster.Start(id);
  Checker checker(cluster, kKeys);
  checker.Fill();
  checker.Start(/*writers=*/2, /*readers=*/2);
  std::this_thread::sleep_for(milliseconds(1000));
  const uint64_t writes_before = checker.writes_.load();
  const auto asked = Clock::now();
  EXPECT_EQ(cluster.Stop("n1", SIGTERM), 0);
  const double leave_s = std::chrono::duration<double>(Clock::now() - asked).count();
  EXPECT_TRUE(cluster.WaitMember("n1", false, milliseconds(2000)));
  std::this_thread::sleep_for(milliseconds(1000));
  checker.StopLoad();
  checker.FinalCheck();
  std::printf("SIGTERM of 1 of 3 under load: %s\n  SIGTERM to exit %.2f s\n",
              checker.Report().c_str(), leave_s);
  PrintHandoffLines(cluster, {"n1"});
  checker.ExpectNoAnomalies();
  EXPECT_GT(checker.writes_.load(), writes_before) << "the load did not run";
  EXPECT_EQ(checker.read_errors_.load(), 0u) << checker.Report();
  EXPECT_EQ(checker.write_errors_.load(), 0u) << checker.Report();
  // n1's rings, in its log: each epoch differs from the one before, the last leaves n1 out.
  std::ifstream log(cluster.log("n1"));
  std::vector<uint64_t> epochs;
  std::string line, last;
  while (std::getline(log, line)) {
    const size_t at = line.find("ring epoch ");
    if (at == std::string::npos || line.find(" members [") == std::string::npos) continue;
    epochs.push_back(std::stoull(line.substr(at + 11)));
    last = line;
  }
  ASSERT_GE(epochs.size(), 2u);
  for (size_t i = 1; i < epochs.size(); ++i) EXPECT_NE(epochs[i], epochs[i - 1]) << i;
  EXPECT_NE(last.find("this node left"), std::string::npos) << last;
}

// Issue 38 item 12: a start that fails after the node has begun joining (here its metrics port
// is taken) exits 1 with the reason as its last line, and leaves no record in etcd. Under etcd
// it ended in std::terminate (the handoff thread was left running), registered.
TEST(ElasticTest, AStartThatFailsExitsOneAndLeavesNoRecord) {
  ElasticCluster cluster;
  cluster.Start("n0");
  const uint16_t taken = FreePort();
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(taken);
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  ASSERT_EQ(listen(fd, 4), 0);
  ASSERT_GT(cluster.Spawn("n1", {"--metrics-port", std::to_string(taken)}), 0);
  EXPECT_EQ(cluster.Wait("n1", milliseconds(20000)), 1);
  close(fd);
  std::ifstream f(cluster.log("n1"));
  std::string line, last;
  while (std::getline(f, line)) {
    EXPECT_EQ(line.find("terminate"), std::string::npos) << line;
    if (!line.empty()) last = line;
  }
  EXPECT_EQ(last.rfind("gkv-server: ", 0), 0u) << last;
  EXPECT_NE(last.find("cannot listen for metrics"), std::string::npos) << last;
  auto view = ReadMembership(cluster.etcd_config());
  ASSERT_TRUE(view.ok()) << view.status().ToString();
  EXPECT_EQ(view->Find("n1"), nullptr);
  EXPECT_NE(view->Find("n0"), nullptr);
}

// Deletes issued while keys are moving (the handoff is slowed to last seconds): each is
// acknowledged, and no read finds the value again, neither while the keys move (a miss is asked
// of the previous owner, which must have deleted its copy) nor after (the handoff must not
// bring a deleted key back).
TEST(ElasticTest, DeletesDuringAHandoffStayDeleted) {
  ElasticCluster cluster;
  const std::vector<std::string> slow = {"--handoff-rate", "64KiB"};
  cluster.Start("n0", slow);
  cluster.Start("n1", slow);
  auto c = cluster.OpenClient();
  ASSERT_NE(c, nullptr);
  constexpr int kCount = 400;
  const std::string value(4096, 'v');
  auto key = [](int k) { return "moving-" + std::to_string(k); };
  for (int k = 0; k < kCount; ++k) ASSERT_TRUE(c->Put(key(k), value.data(), value.size()).ok());
  const uint64_t epoch = c->RingEpoch();
  cluster.Start("n2");
  const auto until = Clock::now() + std::chrono::seconds(10);
  while (c->RingEpoch() == epoch && Clock::now() < until) {
    std::this_thread::sleep_for(milliseconds(5));
  }
  ASSERT_NE(c->RingEpoch(), epoch) << "the client never saw n2 join";
  // About a third of the keys (~550 KB) move to n2 at 64 KiB/s: the deletes land mid-move.
  // A handoff is running when the first delete goes out, and the deletes overtake it: fewer
  // keys are handed off than move (issue 38 item 9: the test asserts the condition it exists
  // for; the scan skips keys deleted before it reaches them).
  auto handoff_running = [&] {
    auto v = ReadMembership(cluster.etcd_config());
    return v.ok() && !v->handoffs_running.empty();
  };
  const auto marked_until = Clock::now() + std::chrono::seconds(5);
  while (!handoff_running() && Clock::now() < marked_until) {
    std::this_thread::sleep_for(milliseconds(5));
  }
  EXPECT_TRUE(handoff_running()) << "no handoff was running when the deletes began";
  int failed_deletes = 0, found_during = 0, found_after = 0;
  for (int k = 0; k < kCount; ++k) {
    Status s = c->Delete(key(k));
    if (!s.ok()) {
      if (failed_deletes++ == 0) ADD_FAILURE() << "delete of " << key(k) << ": " << s.ToString();
    }
  }
  for (int k = 0; k < kCount; ++k) found_during += c->Get(key(k)).ok() ? 1 : 0;
  ASSERT_TRUE(cluster.WaitHandoffsDone(milliseconds(30000)));
  for (int k = 0; k < kCount; ++k) found_after += c->Get(key(k)).ok() ? 1 : 0;
  int moving = 0;
  for (int k = 0; k < kCount; ++k) moving += c->Nodes()[c->NodeFor(key(k))].id == "n2";
  uint64_t handed_off = 0;
  for (const char* id : {"n0", "n1"}) {
    std::ifstream f(cluster.log(id));
    std::string line;
    while (std::getline(f, line)) {
      const size_t at = line.find("handoff for ring epoch ");
      if (at == std::string::npos) continue;
      handed_off += std::stoull(line.substr(line.find(": ", at) + 2));
    }
  }
  std::printf(
      "deletes during a handoff: %d failed, %d found while moving, %d after; %llu of the %d "
      "moving keys handed off before their delete\n",
      failed_deletes, found_during, found_after, static_cast<unsigned long long>(handed_off),
      moving);
  EXPECT_LT(handed_off, static_cast<uint64_t>(moving)) << "no delete overtook the handoff";
  EXPECT_EQ(failed_deletes, 0);
  EXPECT_EQ(found_during, 0);
  EXPECT_EQ(found_after, 0);
}

// Issue 38 item 5: a client opened while a handoff runs has seen no ring change, so it had no
// previous owners to ask: its reads of keys not yet moved missed (durable ones included) and
// its deletes reached only the new owner, which the paced handoff then undid. The handoff
// marks now name the ring before the change, and a client builds its previous owners from them.
TEST(ElasticTest, AClientOpenedMidHandoffReadsAndDeletesAsTheOthersDo) {
  ElasticCluster cluster;
  const std::vector<std::string> slow = {"--handoff-rate", "64KiB"};
  cluster.Start("n0", slow);
  cluster.Start("n1", slow);
  constexpr int kCount = 400;
  const std::string value(4096, 'v');
  auto key = [](int k) { return "mid-" + std::to_string(k); };
  {
    auto c = cluster.OpenClient();
    ASSERT_NE(c, nullptr);
    PutOptions durable;
    durable.durable = true;
    for (int k = 0; k < kCount; ++k) {
      ASSERT_TRUE(c->Put(key(k), value.data(), value.size(), durable).ok());
    }
  }
  cluster.Start("n2");
  auto handoff_running = [&] {
    auto v = ReadMembership(cluster.etcd_config());
    return v.ok() && !v->handoffs_running.empty();
  };
  const auto marked_until = Clock::now() + std::chrono::seconds(5);
  while (!handoff_running() && Clock::now() < marked_until) {
    std::this_thread::sleep_for(milliseconds(5));
  }
  ASSERT_TRUE(handoff_running()) << "no handoff was running";
  // Opened now: the ring it starts from already has n2, which lacks most of its keys.
  auto late = cluster.OpenClient();
  ASSERT_NE(late, nullptr);
  int missing = 0, failed = 0;
  for (int k = 0; k < kCount; ++k) {
    auto r = late->Get(key(k));
    if (r.ok()) continue;
    (r.status().code() == StatusCode::kNotFound ? missing : failed)++;
  }
  const bool still_moving = handoff_running();
  // Half of the keys deleted by the late client while the handoff still runs.
  int failed_deletes = 0;
  for (int k = 0; k < kCount; k += 2) failed_deletes += late->Delete(key(k)).ok() ? 0 : 1;
  ASSERT_TRUE(cluster.WaitHandoffsDone(milliseconds(60000)));
  auto after = cluster.OpenClient();
  ASSERT_NE(after, nullptr);
  int resurrected = 0, lost = 0;
  for (int k = 0; k < kCount; ++k) {
    const bool found = after->Get(key(k)).ok();
    if (k % 2 == 0) resurrected += found ? 1 : 0;
    if (k % 2 == 1) lost += found ? 0 : 1;
  }
  std::printf(
      "a client opened mid-handoff: %d of %d reads missed, %d failed (handoff still running "
      "after them: %s); %d deletes failed; after the handoff %d deleted keys back, %d kept keys "
      "lost\n",
      missing, kCount, failed, still_moving ? "yes" : "no", failed_deletes, resurrected, lost);
  EXPECT_TRUE(still_moving) << "the handoff ended before the reads did";
  EXPECT_EQ(missing, 0);
  EXPECT_EQ(failed, 0);
  EXPECT_EQ(failed_deletes, 0);
  EXPECT_EQ(resurrected, 0);
  EXPECT_EQ(lost, 0);
}

// Issue 38 item 3: a ring flap, join then drain. n3 joins while the load runs and is asked to
// drain while the keys are still moving to it (the others hand off at 256 KiB/s): it hands
// everything back and exits 0, and no read is older than an acknowledged write.
TEST(ElasticTest, JoinThenDrainUnderLoadLosesNothing) {
  ElasticCluster cluster;
  const std::vector<std::string> slow = {"--handoff-rate", "256KiB"};
  for (const char* id : {"n0", "n1", "n2"}) cluster.Start(id, slow);
  Checker checker(cluster, kKeys);
  checker.Fill();
  checker.Start();
  std::this_thread::sleep_for(milliseconds(500));
  cluster.Start("n3", slow);
  // Drain it once the handoffs toward it are running (not before: then nothing flapped).
  const auto until = Clock::now() + std::chrono::seconds(5);
  bool moving = false;
  while (!moving && Clock::now() < until) {
    auto v = ReadMembership(cluster.etcd_config());
    moving = v.ok() && !v->handoffs_running.empty();
    if (!moving) std::this_thread::sleep_for(milliseconds(5));
  }
  EXPECT_TRUE(moving) << "no handoff ran after n3 joined";
  std::this_thread::sleep_for(milliseconds(200));
  ASSERT_TRUE(RequestDrain(cluster.etcd_config(), "n3").ok());
  EXPECT_EQ(cluster.Wait("n3", milliseconds(60000)), 0);
  EXPECT_TRUE(cluster.WaitHandoffsDone(milliseconds(30000)));
  std::this_thread::sleep_for(milliseconds(500));
  checker.StopLoad();
  checker.FinalCheck();
  std::printf("join then drain of n3 under load: %s\n", checker.Report().c_str());
  PrintHandoffLines(cluster, {"n0", "n1", "n2", "n3"});
  checker.ExpectNoAnomalies();
  EXPECT_EQ(checker.read_errors_.load(), 0u) << checker.Report();
  EXPECT_EQ(checker.write_errors_.load(), 0u) << checker.Report();
}

// Issue 38 item 6: a value larger than the batch limit (256 MiB) but within --max-value-size
// used to be refused by every handoff ("batch ... exceeds the node's limit"): its node's drain
// retried every second until its timeout, then left it behind. Now it moves whole.
TEST(ElasticTest, A300MiBValueMovesWhenItsNodeDrains) {
  ElasticCluster cluster;
  const std::vector<std::string> big = {"--disk-capacity", "1GiB", "--host-mem", "128MiB"};
  cluster.Start("n0", big);
  cluster.Start("n1", big);
  auto c = cluster.OpenClient();
  ASSERT_NE(c, nullptr);
  const std::string key = "big-value";
  std::string value(300u << 20, '\0');
  for (size_t i = 0; i < value.size(); i += 4096)
    value[i] = static_cast<char>('a' + (i >> 12) % 26);
  PutOptions po;
  po.durable = true;
  po.timeout = std::chrono::seconds(120);
  const auto put_at = Clock::now();
  auto put = c->Put(key, value.data(), value.size(), po);
  ASSERT_TRUE(put.ok()) << put.status().ToString();
  const double put_s = std::chrono::duration<double>(Clock::now() - put_at).count();
  const std::string owner = c->Nodes()[c->NodeFor(key)].id;
  const std::string other = owner == "n0" ? "n1" : "n0";
  const auto asked = Clock::now();
  ASSERT_TRUE(RequestDrain(cluster.etcd_config(), owner).ok());
  EXPECT_EQ(cluster.Wait(owner, milliseconds(120000)), 0);
  const double drain_s = std::chrono::duration<double>(Clock::now() - asked).count();
  ASSERT_TRUE(cluster.WaitMember(owner, false, milliseconds(5000)));
  GetOptions go;
  go.timeout = std::chrono::seconds(120);
  Result<Value> got = Status::Unavailable("not asked");
  for (int i = 0; i < 50 && !got.ok(); ++i) {  // until the client's ring has only `other`
    got = c->Get(key, go);
    if (!got.ok()) std::this_thread::sleep_for(milliseconds(100));
  }
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_EQ(c->Nodes()[c->NodeFor(key)].id, other);
  EXPECT_TRUE(got->view() == value) << "the value read back differs";
  std::printf("300 MiB value: put %.2f s, drain of %s (handing it to %s) %.2f s\n", put_s,
              owner.c_str(), other.c_str(), drain_s);
  std::ifstream f(cluster.log(owner));
  const std::string log((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  std::printf("  handoff passes that had to retry the value: %zu\n", Count(log, ", 1 to retry"));
  EXPECT_EQ(Count(log, "did not finish"), 0u);
}

TEST(ElasticTest, AKilledNodeIsRoutedAroundAndItsCopiesAreRepaired) {
  ElasticCluster cluster(/*replicas=*/2, /*lease_ttl_s=*/2);
  for (const char* id : {"n0", "n1", "n2", "n3"}) cluster.Start(id);
  Checker checker(cluster, kKeys);
  checker.Fill();
  checker.Start();
  auto watcher = cluster.OpenClient();
  ASSERT_NE(watcher, nullptr);
  std::this_thread::sleep_for(milliseconds(1000));
  const auto killed = Clock::now();
  // Lease expiry, then every client's ring drops n1.
  const double reroute_s = cluster.KillAndWaitForRingChange("n1", *watcher);
  ASSERT_GE(reroute_s, 0) << "the ring never dropped the killed node";
  ASSERT_TRUE(cluster.WaitHandoffsDone(milliseconds(30000)));
  const double repaired_s = std::chrono::duration<double>(Clock::now() - killed).count();
  checker.StopLoad();
  std::printf(
      "SIGKILL with R=2: %s\n  kill to ring without n1 %.2f s (lease TTL 2 s); kill to "
      "repairs done %.2f s\n",
      checker.Report().c_str(), reroute_s, repaired_s);
  PrintHandoffLines(cluster, {"n0", "n2", "n3"});
  checker.ExpectNoAnomalies();
  EXPECT_EQ(checker.read_errors_.load(), 0u) << checker.Report();
  // Every key has two copies again: with a second node gone before its lease expires (so the
  // ring still names it), each key still reads from its other owner.
  cluster.Stop("n2", SIGKILL);
  checker.FinalCheck();
  checker.ExpectNoAnomalies();
  EXPECT_EQ(checker.read_errors_.load(), 0u) << checker.Report();
}

// A node killed with R = 2 comes back on its old disk while the load runs: the keys written
// while it was away are newer elsewhere, and none of its older copies may be read (it serves a
// recovered key only once the cluster's handoff to it has compared versions). It keeps its own
// share of the keys and everything stays readable.
TEST(ElasticTest, ANodeBackOnItsOldDiskServesNothingOlder) {
  ElasticCluster cluster(/*replicas=*/2, /*lease_ttl_s=*/2);
  for (const char* id : {"n0", "n1", "n2"}) cluster.Start(id);
  Checker checker(cluster, kKeys);
  checker.Fill();
  checker.Start();
  auto watcher = cluster.OpenClient();
  ASSERT_NE(watcher, nullptr);
  std::this_thread::sleep_for(milliseconds(500));
  ASSERT_GE(cluster.KillAndWaitForRingChange("n1", *watcher), 0)
      << "the ring never dropped the killed node";
  ASSERT_TRUE(cluster.WaitHandoffsDone(milliseconds(30000)));
  // Every key is rewritten at least once while n1 is away (one writer, ~1,500 keys).
  const uint64_t writes_before = checker.writes_.load();
  const auto until = Clock::now() + std::chrono::seconds(20);
  while (checker.writes_.load() < writes_before + 2 * kKeys && Clock::now() < until) {
    std::this_thread::sleep_for(milliseconds(50));
  }
  const auto back = Clock::now();
  cluster.Start("n1");
  // Under ASan (two clusters at once on 2 cores) this test ran 71-81 s in three runs, one of
  // them past this wait's 30 s (the ring epoch at 232 by then: a mark flip in etcd per
  // recheck pass, issue 38 item 4's scale cost), against 16-21 s without ASan.
  ASSERT_TRUE(cluster.WaitHandoffsDone(milliseconds(kAddressSanitizer ? 90000 : 30000)));
  const double settle_s = std::chrono::duration<double>(Clock::now() - back).count();
  std::this_thread::sleep_for(milliseconds(1000));
  checker.StopLoad();
  checker.FinalCheck();
  std::printf("n1 back on its old disk (R=2): %s\n  restart to handoffs done %.2f s\n",
              checker.Report().c_str(), settle_s);
  PrintHandoffLines(cluster, {"n0", "n1", "n2"});
  checker.ExpectNoAnomalies();
  EXPECT_EQ(checker.read_errors_.load(), 0u) << checker.Report();
  auto c = cluster.OpenClient();
  ASSERT_NE(c, nullptr);
  const double share = ShareOn(*c, checker, kKeys, "n1");
  std::printf("  n1 is the first owner of %.3f of the keys and holds them\n", share);
  EXPECT_GT(share, 0.2);
}

// Issue 38 (a): node n1 loses its lease while it still holds keys, by a stall (SIGSTOP) or by
// a partition from etcd alone (its etcd link goes through a proxy the test cuts; clients and
// the other nodes still reach it). etcd drops it, the others take its keys and acknowledge
// newer writes; then it comes back (SIGCONT, or the link restored) and registers again.
// Nothing older than an acknowledged write may be read meanwhile or after: a fenced node
// refuses once its lease may have lapsed, and a node registered again catches up first (its
// keys held back until the cluster's handoffs compared versions). Before that fix it served
// its pre-stall copies at once (stale reads, every run).
enum class LeaseFault { kStall, kPartition };

void LoseTheLeaseUnderLoad(int replicas, LeaseFault fault) {
  ElasticCluster cluster(replicas, /*lease_ttl_s=*/2);
  cluster.set_client_timeout(milliseconds(kAddressSanitizer ? 5000 : 2000));
  std::unique_ptr<TcpProxy> proxy;
  if (fault == LeaseFault::kPartition) {
    proxy = std::make_unique<TcpProxy>(cluster.etcd().client_port());
    cluster.UseEtcdEndpoint("n1", proxy->endpoint());
  }
  for (const char* id : {"n0", "n1", "n2"}) cluster.Start(id);
  Checker checker(cluster, kKeys);
  checker.Fill();
  checker
      .Start();  // one writer: "stale" is then exact (two may ack one key's writes in either order)
  auto probe = cluster.OpenClient();  // knows n1 (by its index) after etcd forgets it
  ASSERT_NE(probe, nullptr);
  int n1 = -1;
  for (size_t i = 0; i < probe->Nodes().size(); ++i) {
    if (probe->Nodes()[i].id == "n1") n1 = static_cast<int>(i);
  }
  ASSERT_GE(n1, 0);
  std::this_thread::sleep_for(milliseconds(1000));
  if (replicas == 1) {
    std::vector<bool> on_n1(kKeys);
    for (int k = 0; k < kKeys; ++k) on_n1[k] = probe->NodeFor(checker.Key(k)) == n1;
    checker.BeginOutOfReach(on_n1);
  }
  const auto cut = Clock::now();
  if (fault == LeaseFault::kStall) {
    cluster.Signal("n1", SIGSTOP);
  } else {
    proxy->Cut();
  }
  // etcd drops n1 once its lease expires; the load goes on against the others for a while.
  ASSERT_TRUE(cluster.WaitMember("n1", false, milliseconds(10000))) << "n1's lease never expired";
  const double dropped_s = std::chrono::duration<double>(Clock::now() - cut).count();
  const uint64_t writes_at_drop = checker.writes_.load();
  // n1 stays out for 2 s and until the one writer had 21 writes acknowledged (at most 15 s):
  // a call the writer had sent to n1 before the drop waits out its timeout first (5 s under
  // ASan), so a fixed window could close before the writer had moved on.
  const auto away_at_least = Clock::now() + milliseconds(2000);
  const auto away_at_most = Clock::now() + milliseconds(15000);
  while ((Clock::now() < away_at_least || checker.writes_.load() - writes_at_drop <= 20) &&
         Clock::now() < away_at_most) {
    std::this_thread::sleep_for(milliseconds(50));
  }
  const uint64_t writes_while_away = checker.writes_.load() - writes_at_drop;
  if (fault == LeaseFault::kStall) {
    cluster.Signal("n1", SIGCONT);
  } else {
    proxy->Restore();
  }
  ASSERT_TRUE(cluster.WaitMember("n1", true, milliseconds(15000))) << "n1 never registered again";
  // The load runs on while n1 catches up and the keys move back to it.
  if (!cluster.WaitHandoffsDone(milliseconds(30000))) {
    PrintHandoffLines(cluster, {"n0", "n1", "n2"});
    auto v = ReadMembership(cluster.etcd_config());
    std::string running;
    for (const auto& id : v.ok() ? v->handoffs_running : std::set<std::string>{})
      running += id + " ";
    FAIL() << "handoffs still running 30 s after n1 came back: " << running;
  }
  checker.EndOutOfReach();  // n1 is back and caught up: a miss now is a loss
  std::this_thread::sleep_for(milliseconds(1000));
  checker.StopLoad();
  checker.FinalCheck();
  // Requests that reached n1 while its lease may have lapsed were refused (a partitioned n1
  // still hears from clients until etcd expires its lease and their watch reports it).
  auto stats = probe->NodeStats(n1);
  ASSERT_TRUE(stats.ok()) << stats.status().ToString();
  const size_t at = stats->find("\"fenced_refusals\":");
  ASSERT_NE(at, std::string::npos);
  const uint64_t fenced = std::stoull(stats->substr(at + 18));
  std::printf("n1 refused %llu requests while fenced\n", static_cast<unsigned long long>(fenced));
  if (fault == LeaseFault::kPartition) {
    EXPECT_GT(fenced, 0u);
  }
  std::printf(
      "%s of n1 past its lease (R=%d): %s\n  dropped from etcd %.2f s after the %s; "
      "%llu writes acknowledged while it was out\n",
      fault == LeaseFault::kStall ? "SIGSTOP" : "etcd partition", replicas,
      checker.Report().c_str(), dropped_s, fault == LeaseFault::kStall ? "stop" : "cut",
      static_cast<unsigned long long>(writes_while_away));
  PrintHandoffLines(cluster, {"n0", "n1", "n2"});
  checker.ExpectNoAnomalies();
  EXPECT_GT(writes_while_away, 20u) << "the cluster took too few writes while n1 was out";
  // The fault happened as staged: n1 lost its lease and registered again under a new one.
  std::ifstream f(cluster.log("n1"));
  const std::string log((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  EXPECT_EQ(Count(log, "registered again after its lease lapsed"), 1u) << log.substr(0, 4000);
}

TEST(ElasticTest, AStallPastTheLeaseServesNothingOlderR1) {
  LoseTheLeaseUnderLoad(1, LeaseFault::kStall);
}
TEST(ElasticTest, AStallPastTheLeaseServesNothingOlderR2) {
  LoseTheLeaseUnderLoad(2, LeaseFault::kStall);
}
TEST(ElasticTest, APartitionFromEtcdServesNothingOlderR1) {
  LoseTheLeaseUnderLoad(1, LeaseFault::kPartition);
}
TEST(ElasticTest, APartitionFromEtcdServesNothingOlderR2) {
  LoseTheLeaseUnderLoad(2, LeaseFault::kPartition);
}

// Issue 37: an upgrade that changes placement restarts every node on its old disk, each then
// holding keys the new ring gives to others. Restarting each node on another node's disk makes
// the same situation with one build: every recovered key is on a node that does not own it. The
// ring changes as the nodes register hand each to its owner, and nothing acknowledged is lost.
TEST(ElasticTest, ARestartOnDisksWhoseKeysBelongElsewhereMovesThemToTheirOwners) {
  ElasticCluster cluster(/*replicas=*/1, /*lease_ttl_s=*/2);
  const std::vector<std::string> ids = {"n0", "n1", "n2"};
  for (const auto& id : ids) cluster.Start(id);
  Checker checker(cluster, kKeys);
  checker.Fill();
  // Stopped together, as README's "Upgrading" says: SIGTERM to all at once (one at a time,
  // each would hand its keys to the nodes still up).
  const auto stopping = Clock::now();
  for (const auto& id : ids) cluster.Signal(id, SIGTERM);
  for (const auto& id : ids) EXPECT_EQ(cluster.Wait(id, milliseconds(30000)), 0) << id;
  const double stop_s = std::chrono::duration<double>(Clock::now() - stopping).count();
  for (const auto& id : ids) {
    // With every member leaving none waits out --leave-timeout-ms sending to the others.
    std::ifstream f(cluster.log(id));
    const std::string log((std::istreambuf_iterator<char>(f)), {});
    EXPECT_EQ(log.find("handoff did not finish within"), std::string::npos) << id;
  }
  for (const auto& id : ids) {
    ASSERT_TRUE(cluster.WaitMember(id, false, milliseconds(15000))) << id << "'s record stayed";
  }
  const auto back = Clock::now();
  for (size_t i = 0; i < ids.size(); ++i) cluster.Start(ids[i], {}, ids[(i + 1) % ids.size()]);
  ASSERT_TRUE(cluster.WaitHandoffsDone(milliseconds(60000)));
  const double settle_s = std::chrono::duration<double>(Clock::now() - back).count();
  checker.FinalCheck();
  std::printf(
      "3 nodes back on each other's disks (R=1): %s\n  SIGTERM of all to exits %.2f s, "
      "restarts to handoffs done %.2f s\n",
      checker.Report().c_str(), stop_s, settle_s);
  PrintHandoffLines(cluster, ids);
  checker.ExpectNoAnomalies();
  EXPECT_EQ(checker.read_errors_.load(), 0u) << checker.Report();
  auto c = cluster.OpenClient();
  ASSERT_NE(c, nullptr);
  double on_owner = 0;
  for (const auto& id : ids) on_owner += ShareOn(*c, checker, kKeys, id);
  EXPECT_DOUBLE_EQ(on_owner, 1.0) << "of the keys, this share is held by its owner";
}

// A call waiting to be asked again when its client closes gets its answer before the client is
// gone; it is not dropped with the timer that held it. Here the waits are WrongNode retries: a
// client that knows n0 alone sends every key there, and n0 refuses those that n1 owns (about
// half), which the client asks again every few milliseconds until their 20 s deadline.
TEST(ElasticTest, CallsWaitingToBeAskedAgainAreAnsweredWhenTheClientCloses) {
  ElasticCluster cluster;
  cluster.Start("n0");
  cluster.Start("n1");
  TempDir dir;
  const std::string only_n0 = dir.Sub("only-n0.yaml");
  {
    std::ofstream f(only_n0);
    f << "nodes:\n  - {id: n0, address: 127.0.0.1:" << cluster.port("n0") << "}\n";
  }
  // (Before the client: its callbacks may run until it is gone.)
  std::atomic<int> answered{0}, aborted{0};
  ClientOptions o;
  o.cluster_file = only_n0;
  o.default_timeout = milliseconds(20000);
  auto c = Client::Open(o);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  // Rounds of 32 calls until some wait (n0 answers every key until its ring holds n1).
  constexpr int kCalls = 32;
  int issued = 0;
  const auto until = Clock::now() + std::chrono::seconds(20);
  while (Clock::now() < until) {
    for (int i = 0; i < kCalls; ++i, ++issued) {
      (*c)->GetAsync("parked-" + std::to_string(issued), {}, [&](Result<Value> r) {
        if (r.status().code() == StatusCode::kAborted) aborted++;
        answered++;
      });
    }
    std::this_thread::sleep_for(milliseconds(300));
    if (answered.load() < issued) break;
  }
  EXPECT_LT(answered.load(), issued) << "no call was refused as misrouted: nothing waited";
  const auto closing = Clock::now();
  c->reset();
  const double close_s = std::chrono::duration<double>(Clock::now() - closing).count();
  EXPECT_EQ(answered.load(), issued) << "calls dropped when the client closed";
  EXPECT_GT(aborted.load(), 0);
  EXPECT_LT(close_s, 5.0);
}

TEST(ElasticTest, EtcdRestartingMidRunFailsNoRequest) {
  ElasticCluster cluster(/*replicas=*/1, /*lease_ttl_s=*/3);
  for (const char* id : {"n0", "n1", "n2"}) cluster.Start(id);
  Checker checker(cluster, kKeys);
  checker.Fill();
  checker.Start();
  std::this_thread::sleep_for(milliseconds(1000));
  cluster.etcd().Kill();
  std::this_thread::sleep_for(milliseconds(2000));
  ASSERT_TRUE(cluster.etcd().Restart());
  std::this_thread::sleep_for(milliseconds(3000));
  checker.StopLoad();
  checker.FinalCheck();
  std::printf("etcd killed for 2 s and restarted: %s\n", checker.Report().c_str());
  checker.ExpectNoAnomalies();
  EXPECT_EQ(checker.write_errors_.load(), 0u) << checker.Report();
  EXPECT_EQ(checker.read_errors_.load(), 0u) << checker.Report();
  // The nodes kept (or renewed) their registrations.
  for (const char* id : {"n0", "n1", "n2"})
    EXPECT_TRUE(cluster.WaitMember(id, true, milliseconds(5000))) << id;
}

}  // namespace
}  // namespace gkv::testing
