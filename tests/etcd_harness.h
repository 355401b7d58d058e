// Runs a real single-member etcd for tests: on free 127.0.0.1 ports (client and peer), with its
// data directory and log (etcd.log) in a temporary directory of its own, stopped by its process
// id. A test that cannot start etcd fails (ASSERT_TRUE(etcd.Start())); it never skips.
// The binary is `etcd` from PATH, or $GKV_ETCD_BIN.
//
// TcpProxy stands between a process and etcd to cut the link while etcd stays up (a partition).
//
// Raft timing is shortened (50 ms heartbeats, 500 ms elections) so that a (re)start elects
// itself leader within a second and etcd's minimum lease TTL is 1 s, not 2 s.
#pragma once

#include <gtest/gtest.h>
#include <httplib.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "free_port.h"
#include "spawn.h"
#include "test_util.h"

namespace gkv::testing {

class EtcdProcess {
 public:
  EtcdProcess() : client_port_(FreePort()), peer_port_(FreePort()) {}
  ~EtcdProcess() {
    if (pid_ > 0) Kill();
  }
  EtcdProcess(const EtcdProcess&) = delete;
  EtcdProcess& operator=(const EtcdProcess&) = delete;

  // Starts etcd and waits (up to 10 s) until it answers /health; on failure says why, with the
  // end of its log. Call from the test's main thread: etcd dies with the thread that forked it.
  // A first start whose port another process took between the pick and etcd's bind (tests run
  // in parallel) is tried again on new ports, up to 3 times; a restart keeps its ports.
  ::testing::AssertionResult Start() {
    for (int attempt = 1;; ++attempt) {
      ::testing::AssertionResult started = StartOnce();
      if (started || started_once_ || attempt == 3 || pid_ > 0 ||
          LogTail().find("address already in use") == std::string::npos) {
        started_once_ = started_once_ || started;
        return started;
      }
      std::filesystem::remove_all(dir_.Sub("data"));
      std::filesystem::remove(log_file());
      client_port_ = FreePort();
      peer_port_ = FreePort();
    }
  }

 private:
  ::testing::AssertionResult StartOnce() {
    if (pid_ > 0) return ::testing::AssertionFailure() << "etcd is running already";
    if (client_port_ == 0 || peer_port_ == 0) {
      return ::testing::AssertionFailure() << "no free ports for etcd";
    }
    const std::string peer = "http://127.0.0.1:" + std::to_string(peer_port_);
    const char* bin = std::getenv("GKV_ETCD_BIN");
    std::vector<std::string> args = {bin && *bin ? bin : "etcd",
                                     "--name=gkv-test",
                                     "--data-dir=" + dir_.Sub("data"),
                                     "--listen-client-urls=" + endpoint(),
                                     "--advertise-client-urls=" + endpoint(),
                                     "--listen-peer-urls=" + peer,
                                     "--initial-advertise-peer-urls=" + peer,
                                     "--initial-cluster=gkv-test=" + peer,
                                     "--initial-cluster-state=new",
                                     "--heartbeat-interval=50",
                                     "--election-timeout=500"};
    pid_t pid = SpawnLogged(std::move(args), log_file());
    if (pid < 0) return ::testing::AssertionFailure() << "fork failed";
    pid_ = pid;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (std::chrono::steady_clock::now() < deadline) {
      int status = 0;
      if (waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        return ::testing::AssertionFailure()
               << "etcd exited at start (status " << status << "); log:\n"
               << LogTail();
      }
      if (Healthy()) return ::testing::AssertionSuccess();
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    Kill();
    return ::testing::AssertionFailure() << "etcd did not answer within 10 s; log:\n" << LogTail();
  }

 public:
  // SIGKILL (a crash: no goodbye to its clients), then waits for it.
  void Kill() { Signal(SIGKILL); }
  // SIGTERM, then waits (up to 10 s; then SIGKILL and a test failure).
  void Stop() { Signal(SIGTERM); }
  // After Kill() or Stop(): starts again on the same ports and data directory.
  ::testing::AssertionResult Restart() {
    if (pid_ > 0) Stop();
    return Start();
  }
  // Kills etcd and starts it again on the same ports with no data: its revision starts over
  // (as after a rebuild from nothing, or from an older snapshot).
  ::testing::AssertionResult RestartEmpty() {
    if (pid_ > 0) Kill();
    std::filesystem::remove_all(dir_.Sub("data"));
    return Start();
  }

  bool running() const { return pid_ > 0; }
  std::string endpoint() const { return "http://127.0.0.1:" + std::to_string(client_port_); }
  uint16_t client_port() const { return client_port_; }
  std::string log_file() const { return dir_.Sub("etcd.log"); }

  std::string LogTail(size_t bytes = 4000) const {
    std::ifstream f(log_file());
    std::string log(std::istreambuf_iterator<char>(f), {});
    return log.size() > bytes ? "..." + log.substr(log.size() - bytes) : log;
  }

 private:
  bool Healthy() const {
    httplib::Client http(endpoint());
    http.set_connection_timeout(std::chrono::milliseconds(200));
    http.set_read_timeout(std::chrono::milliseconds(500));
    auto res = http.Get("/health");
    return res && res->status == 200 && res->body.find("\"true\"") != std::string::npos;
  }

  void Signal(int sig) {
    if (pid_ <= 0) return;
    kill(pid_, sig);
    int status = 0;
    for (int waited = 0; waited < 1000; ++waited) {  // up to 10 s
      if (waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        return;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    kill(pid_, SIGKILL);
    waitpid(pid_, &status, 0);
    pid_ = -1;
    ADD_FAILURE() << "etcd did not stop within 10 s of signal " << sig;
  }

  TempDir dir_;
  uint16_t client_port_;
  uint16_t peer_port_;
  pid_t pid_ = -1;
  bool started_once_ = false;  // a restart keeps its ports (clients know the endpoint)
};

// A TCP relay on a free 127.0.0.1 port to `upstream_port`. Cut() breaks every relayed
// connection and refuses new ones (the port is closed); Restore() opens it again.
class TcpProxy {
 public:
  explicit TcpProxy(uint16_t upstream_port) : upstream_port_(upstream_port), port_(FreePort()) {
    Restore();
  }
  ~TcpProxy() { Cut(); }
  TcpProxy(const TcpProxy&) = delete;
  TcpProxy& operator=(const TcpProxy&) = delete;

  std::string endpoint() const { return "http://127.0.0.1:" + std::to_string(port_); }

  void Restore() {
    std::lock_guard<std::mutex> lock(mu_);
    if (listen_fd_ >= 0) return;
    cut_ = false;
    listen_fd_ = socket(AF_INET, SOCK_STREAM, 0);
    int one = 1;
    setsockopt(listen_fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    sockaddr_in addr = Loopback(port_);
    if (bind(listen_fd_, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 ||
        listen(listen_fd_, 16) != 0) {
      ADD_FAILURE() << "proxy: cannot listen on port " << port_ << ": " << std::strerror(errno);
      close(listen_fd_);
      listen_fd_ = -1;
      return;
    }
    accept_thread_ = std::thread([this, fd = listen_fd_] { AcceptLoop(fd); });
  }

  void Cut() {
    std::thread acceptor;
    std::vector<std::thread> relays;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (listen_fd_ < 0) return;
      cut_ = true;
      shutdown(listen_fd_, SHUT_RDWR);  // wakes accept()
      for (int fd : open_fds_) shutdown(fd, SHUT_RDWR);
      acceptor = std::move(accept_thread_);
      relays = std::move(relays_);
    }
    acceptor.join();
    for (auto& t : relays) t.join();  // each closes its own descriptors
    std::lock_guard<std::mutex> lock(mu_);
    close(listen_fd_);
    listen_fd_ = -1;
  }

 private:
  static sockaddr_in Loopback(uint16_t port) {
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = htons(port);
    return addr;
  }

  void AcceptLoop(int listen_fd) {
    for (;;) {
      const int client = accept(listen_fd, nullptr, nullptr);
      if (client < 0) return;  // Cut()
      const int upstream = socket(AF_INET, SOCK_STREAM, 0);
      sockaddr_in addr = Loopback(upstream_port_);
      if (connect(upstream, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
        close(upstream);
        close(client);
        continue;
      }
      std::lock_guard<std::mutex> lock(mu_);
      if (cut_) {  // accepted just before Cut(): it must not outlive it
        close(upstream);
        close(client);
        return;
      }
      open_fds_.insert(open_fds_.end(), {client, upstream});
      relays_.emplace_back([this, client, upstream] { Relay(client, upstream); });
    }
  }

  // Copies bytes both ways until either end closes (or Cut() shuts both down), then closes
  // both; a connection that ended leaves no descriptor behind.
  void Relay(int a, int b) {
    char buffer[16384];
    pollfd fds[2] = {{a, POLLIN, 0}, {b, POLLIN, 0}};
    bool open = true;
    while (open && poll(fds, 2, -1) > 0) {
      for (int i = 0; i < 2 && open; ++i) {
        if (!(fds[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
        const ssize_t n = read(fds[i].fd, buffer, sizeof buffer);
        open = n > 0 && send(fds[1 - i].fd, buffer, static_cast<size_t>(n), MSG_NOSIGNAL) == n;
      }
    }
    std::lock_guard<std::mutex> lock(mu_);
    for (int fd : {a, b}) {
      open_fds_.erase(std::remove(open_fds_.begin(), open_fds_.end(), fd), open_fds_.end());
      close(fd);
    }
  }

  const uint16_t upstream_port_;
  const uint16_t port_;
  std::mutex mu_;
  int listen_fd_ = -1;               // guarded by mu_
  bool cut_ = false;                 // guarded by mu_: Cut() is under way or done
  std::thread accept_thread_;        // guarded by mu_
  std::vector<std::thread> relays_;  // guarded by mu_
  std::vector<int> open_fds_;        // guarded by mu_: the relays' sockets, until they close them
};

}  // namespace gkv::testing
