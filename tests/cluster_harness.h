// Starts real gkv-server processes on 127.0.0.1 for integration tests and stops every one of
// them. Ports are taken free from the kernel; each node gets its own disk directory.
// A node that fails to come up fails the test (it never skips).
#pragma once

#include <algorithm>

#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <memory>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "free_port.h"
#include "gkv/client.h"
#include "gkv/cuda.h"
#include "spawn.h"
#include "test_util.h"

namespace gkv::testing {

struct NodeSpec {
  std::string host_mem = "256MiB";
  std::string disk_capacity = "1GiB";
  bool disk = true;
  int threads = 2;  // --threads (executors)
  // --io-threads: 2, so every cluster test runs a node's connections on two UCX workers
  // (worker 0 and another, which serves its connections' data requests itself and hands the
  // rest to worker 0).
  int io_threads = 2;
  // --placement-partitions: 2, so every cluster test runs a node's cache as two placement
  // partitions (two slices of each memory tier, two locks), one per I/O thread.
  int placement_partitions = 2;
  std::vector<std::string> extra_args;
  std::string secret;       // written to the cluster file when set
  std::string peer_secret;  // likewise
  bool metrics = false;     // give each node a free --metrics-port
  // The GPU tier each node gets in fake-device mode (GKV_FAKE_DEVICE=1), unless extra_args
  // gives --gpu-mem.
  std::string fake_gpu_mem = "8MiB";
};

// The tier a fresh small value lands in on a node of this harness: the GPU tier every node
// gets in fake-device mode when UCX moves device memory (GKV_FAKE_DEVICE=ucx), else the host
// tier (without a GPU tier, or with one placed behind host memory because this UCX cannot
// move device memory: --gpu-placement auto).
inline std::string TopMemoryTier() {
  return FakeDeviceKind() == FakeDevice::kMovedByUcx ? "gpu" : "host";
}

// The first key of the form key-SALT-N that `client` places on `node`.
inline std::string KeyOn(Client& client, int node, int salt = 0) {
  for (int i = 0;; ++i) {
    std::string k = "key-" + std::to_string(salt) + "-" + std::to_string(i);
    if (client.NodeFor(k) == node) return k;
  }
}

// A number in node `node`'s stats JSON: the first field `name` after `within` (e.g.
// "\"replication\":{"). A missing field or node fails the test (and reads as 0).
inline uint64_t StatsCounter(Client& c, int node, const std::string& name,
                             const std::string& within = "") {
  auto stats = c.NodeStats(node);
  if (!stats.ok()) {
    ADD_FAILURE() << "stats of node " << node << ": " << stats.status().ToString();
    return 0;
  }
  const size_t from = within.empty() ? 0 : stats->find(within);
  const size_t at = from == std::string::npos ? from : stats->find("\"" + name + "\":", from);
  if (at == std::string::npos) {
    ADD_FAILURE() << "no field " << within << name << " in the stats of node " << node;
    return 0;
  }
  return std::stoull(stats->substr(at + name.size() + 3));
}

// Node `node`'s count of requests answered by each of its I/O threads (requests_by_io_thread in
// its stats; `name` picks another per-thread list, e.g. reads_served_by_io_thread). A missing
// field or node fails the test (and reads as an empty list).
inline std::vector<uint64_t> RequestsByIoThread(Client& client, int node = 0,
                                                const std::string& name = "requests_by_io_thread") {
  std::vector<uint64_t> by_thread;
  auto stats = client.NodeStats(node);
  if (!stats.ok()) {
    ADD_FAILURE() << "stats of node " << node << ": " << stats.status().ToString();
    return by_thread;
  }
  const std::string field = "\"" + name + "\":[";
  const size_t at = stats->find(field);
  if (at == std::string::npos) {
    ADD_FAILURE() << "no " << name << " in the stats of node " << node;
    return by_thread;
  }
  const size_t end = stats->find(']', at);
  std::stringstream list(stats->substr(at + field.size(), end - at - field.size()));
  for (std::string n; std::getline(list, n, ',');) by_thread.push_back(std::stoull(n));
  return by_thread;
}

// After SIGSTOP: waits (up to 5 s) until every thread of process `pid` is stopped, so it
// certainly answers nothing more. A loaded machine can take a while to stop them all.
inline bool WaitProcessStopped(pid_t pid) {
  const std::string tasks = "/proc/" + std::to_string(pid) + "/task";
  for (int attempt = 0; attempt < 500; ++attempt) {
    bool all = true;
    for (const auto& t : std::filesystem::directory_iterator(tasks)) {
      std::ifstream stat(t.path() / "stat");
      std::string line;
      std::getline(stat, line);
      const auto close = line.rfind(')');  // "pid (comm) STATE ..."
      if (close == std::string::npos || close + 2 >= line.size() || line[close + 2] != 'T') {
        all = false;
      }
    }
    if (all) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return false;
}

class Cluster {
 public:
  // Writes the cluster file and starts `n` nodes; waits until each answers a ping.
  explicit Cluster(int n, NodeSpec spec = {}) : spec_(std::move(spec)) {
    for (int i = 0; i < n; ++i) ports_.push_back(FreePort());
    cluster_file_ = dir_.Sub("cluster.yaml");
    std::ofstream f(cluster_file_);
    f << "nodes:\n";
    for (int i = 0; i < n; ++i) {
      f << "  - {id: n" << i << ", address: 127.0.0.1:" << ports_[i] << "}\n";
    }
    if (!spec_.secret.empty()) f << "secret: \"" << spec_.secret << "\"\n";
    if (!spec_.peer_secret.empty()) f << "peer_secret: \"" << spec_.peer_secret << "\"\n";
    f.close();
    for (int i = 0; i < n; ++i) metrics_ports_.push_back(spec_.metrics ? FreePort() : 0);
    pids_.assign(n, -1);
    for (int i = 0; i < n; ++i) StartNode(i);
    WaitReady();
  }

  // Stops every node still running with SIGTERM: a graceful stop must exit 0, so a node that
  // crashed meanwhile, or whose sanitizer reported an error (ASan aborts, TSan exits 66), fails
  // the test here even when no request saw it.
  ~Cluster() {
    for (size_t i = 0; i < pids_.size(); ++i) {
      if (pids_[i] <= 0) continue;
      kill(pids_[i], SIGCONT);  // a node a failed test left stopped (SIGSTOP) takes the SIGTERM
      const int status = StopNode(static_cast<int>(i), SIGTERM);
      if (status != 0) {
        const std::string log = ReadLog(static_cast<int>(i));
        ADD_FAILURE() << "node " << i << " ended with "
                      << (status > 0 ? "exit " + std::to_string(status)
                                     : "signal " + std::to_string(-status))
                      << " on SIGTERM at the end of the test; its log ends:\n"
                      << log.substr(log.size() > 6000 ? log.size() - 6000 : 0);
      }
    }
  }

  const std::string& cluster_file() const { return cluster_file_; }
  // A cluster file naming node `i` alone: a client opened on it sends every key there (what a
  // node itself holds, without the other replicas answering for it).
  std::string SingleNodeFile(int i) const {
    std::string path = dir_.Sub("only-n" + std::to_string(i) + ".yaml");
    std::ofstream f(path);
    f << "nodes:\n  - {id: n" << i << ", address: 127.0.0.1:" << ports_[i] << "}\n";
    if (!spec_.secret.empty()) f << "secret: \"" << spec_.secret << "\"\n";
    return path;
  }
  std::string disk_dir(int i) const { return dir_.Sub("disk" + std::to_string(i)); }
  std::string log_file(int i) const { return dir_.Sub("node" + std::to_string(i) + ".log"); }
  int size() const { return static_cast<int>(pids_.size()); }

  // Call from the test's main thread: the node is killed when the thread that forked it ends.
  void StartNode(int i) {
    std::vector<std::string> args = {GKV_SERVER_BIN,
                                     "--cluster",
                                     cluster_file_,
                                     "--node",
                                     "n" + std::to_string(i),
                                     "--host-mem",
                                     spec_.host_mem,
                                     "--threads",
                                     std::to_string(spec_.threads),
                                     "--io-threads",
                                     std::to_string(spec_.io_threads),
                                     "--placement-partitions",
                                     std::to_string(spec_.placement_partitions)};
    if (spec_.disk) {
      args.insert(args.end(), {"--disk", disk_dir(i), "--disk-capacity", spec_.disk_capacity});
    }
    args.insert(args.end(), spec_.extra_args.begin(), spec_.extra_args.end());
    // Fake-device mode (GKV_FAKE_DEVICE=1, inherited by the node): every node gets a GPU tier
    // of "device" memory, so the tests run through the server's device paths.
    if (FakeDeviceMode() && std::find(args.begin(), args.end(), "--gpu-mem") == args.end()) {
      args.insert(args.end(), {"--gpu-mem", spec_.fake_gpu_mem});
    }
    if (metrics_ports_[i]) {
      args.insert(args.end(), {"--metrics-port", std::to_string(metrics_ports_[i])});
    }
    std::vector<std::pair<std::string, std::string>> env;
#if !defined(__SANITIZE_ADDRESS__) && !defined(__SANITIZE_THREAD__)
    // A node that crashes prints the crashing thread's stack to its log (which a failing test
    // prints): the wheel's UCX defaults to UCX_HANDLE_ERRORS=none (a silent SIGSEGV, no core on
    // most machines). Not under sanitizers, whose own handlers report better. An explicit
    // setting wins. The node's environment only: this process's UCX has read its own already.
    env.emplace_back("UCX_HANDLE_ERRORS", "bt");
#endif
    pid_t pid = SpawnLogged(std::move(args), log_file(i), env);
    ASSERT_GT(pid, 0) << "fork failed";
    pids_[i] = pid;
  }

  // Sends `sig` and waits for the process; returns its exit status (or -signal).
  int StopNode(int i, int sig) {
    if (pids_[i] <= 0) return 0;
    kill(pids_[i], sig);
    int status = 0;
    for (int waited = 0; waited < 200; ++waited) {  // up to 20 s, then SIGKILL
      if (waitpid(pids_[i], &status, WNOHANG) == pids_[i]) {
        pids_[i] = -1;
        return WIFEXITED(status) ? WEXITSTATUS(status) : -WTERMSIG(status);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    kill(pids_[i], SIGKILL);
    waitpid(pids_[i], &status, 0);
    pids_[i] = -1;
    ADD_FAILURE() << "node " << i << " did not stop within 20 s";
    return -SIGKILL;
  }

  uint16_t metrics_port(int i) const { return metrics_ports_[i]; }
  pid_t pid(int i) const { return pids_[i]; }  // -1 once stopped

  // Sends `sig` without waiting (SIGSTOP / SIGCONT a node to make it hang, then recover).
  void Signal(int i, int sig) {
    if (pids_[i] > 0) kill(pids_[i], sig);
  }

  // After SIGSTOP: waits (up to 5 s) until every thread of node i is stopped.
  bool WaitStopped(int i) { return WaitProcessStopped(pids_[i]); }

  void WaitReady() {
    ClientOptions o;
    o.cluster_file = cluster_file_;
    o.default_timeout = std::chrono::milliseconds(500);
    auto client = Client::Open(o);
    ASSERT_TRUE(client.ok()) << client.status().ToString();
    for (int i = 0; i < size(); ++i) {
      if (pids_[i] <= 0) continue;
      // Up to 30 s: a loaded 2-core machine has been seen to take over 10 s to start a node
      // (its host pool is pre-faulted). A node that exited fails at once.
      bool up = false;
      const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
      while (!up && std::chrono::steady_clock::now() < until) {
        int status = 0;
        if (waitpid(pids_[i], &status, WNOHANG) == pids_[i]) {
          pids_[i] = -1;
          FAIL() << "node " << i << " exited while starting ("
                 << (WIFEXITED(status) ? "exit " + std::to_string(WEXITSTATUS(status))
                                       : "signal " + std::to_string(WTERMSIG(status)))
                 << "); log:\n"
                 << ReadLog(i);
        }
        auto r = (*client)->Ping(i);
        up = r.ok() && *r == "n" + std::to_string(i);
        if (!up) std::this_thread::sleep_for(std::chrono::milliseconds(100));
      }
      ASSERT_TRUE(up) << "node " << i << " did not come up in 30 s; log:\n" << ReadLog(i);
    }
  }

  std::string ReadLog(int i) const {
    std::ifstream f(log_file(i));
    return std::string(std::istreambuf_iterator<char>(f), {});
  }

  std::unique_ptr<Client> NewClient(std::chrono::milliseconds timeout = std::chrono::seconds(5)) {
    ClientOptions o;
    o.default_timeout = timeout;
    return NewClient(o);
  }
  // A client that streams every put of more than `stream_threshold` bytes (ClientOptions).
  std::unique_ptr<Client> NewStreamingClient(std::chrono::milliseconds timeout,
                                             uint64_t stream_threshold = 1 << 20) {
    ClientOptions o;
    o.default_timeout = timeout;
    o.stream_threshold = stream_threshold;
    return NewClient(o);
  }
  // A client with these options, on this cluster's file.
  std::unique_ptr<Client> NewClient(ClientOptions o) {
    o.cluster_file = cluster_file_;
    auto c = Client::Open(o);
    EXPECT_TRUE(c.ok()) << c.status().ToString();
    return c.ok() ? std::move(*c) : nullptr;
  }

 private:
  NodeSpec spec_;
  TempDir dir_;
  std::string cluster_file_;
  std::vector<uint16_t> ports_;
  std::vector<uint16_t> metrics_ports_;
  std::vector<pid_t> pids_;
};

// Opens `n` clients of `cluster`, one after another. Each connects to a node on its first
// request there, and a node deals its connections to its I/O workers in turn (peers' included).
inline void OpenClients(Cluster& cluster, int n, std::vector<std::unique_ptr<Client>>* clients,
                        std::chrono::milliseconds timeout = std::chrono::seconds(30)) {
  for (int c = 0; c < n; ++c) {
    clients->push_back(cluster.NewClient(timeout));
    ASSERT_TRUE(clients->back());
  }
}

}  // namespace gkv::testing
