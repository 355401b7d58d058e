// FreePort() for test process helpers (cluster_harness.h, etcd_harness.h): one picker per test
// process, so two helpers never hand out the same port.
#pragma once

#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <random>
#include <set>

namespace gkv::testing {

// A free port below the kernel's ephemeral range (32768+), so client connections of tests
// running in parallel can't take it between the pick and the node's bind. Random, checked by
// binding it, and never handed out twice in one process (two nodes of one cluster are not
// bound yet when their ports are picked).
inline uint16_t FreePort() {
  static std::set<uint16_t> handed_out;
  static std::mt19937 rng(
      static_cast<unsigned>(getpid()) * 2654435761u ^
      static_cast<unsigned>(std::chrono::steady_clock::now().time_since_epoch().count()));
  for (int attempt = 0; attempt < 1000; ++attempt) {
    const uint16_t port = static_cast<uint16_t>(20000 + rng() % 12000);
    if (handed_out.count(port)) continue;
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = htons(port);
    const bool ok = bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0;
    close(fd);
    if (ok) {
      handed_out.insert(port);
      return port;
    }
  }
  ADD_FAILURE() << "no free port found";
  return 0;
}

}  // namespace gkv::testing
