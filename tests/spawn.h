// SpawnLogged() for test process helpers (cluster_harness.h, etcd_harness.h, elastic_test.cc):
// starts a child whose stdout and stderr append to a log file and which dies with the thread
// that forked it (PR_SET_PDEATHSIG), so a crashed test leaves no process behind. The child
// keeps no other descriptor of the test's: UCX opens its sockets without close-on-exec, and a
// node restarted while the test's clients were connected used to hold their sockets open, so
// when a client closed, the nodes it talked to never saw its connection go.
#pragma once

#include <signal.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

namespace gkv::testing {

// args[0] is the program (looked up in PATH). Returns the child's pid, or -1 if fork failed.
// `child_env`: NAME=VALUE pairs set in the child only, unless its environment has NAME.
inline pid_t SpawnLogged(std::vector<std::string> args, const std::string& log,
                         const std::vector<std::pair<std::string, std::string>>& child_env = {}) {
  pid_t pid = fork();
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    for (const auto& [name, value] : child_env) setenv(name.c_str(), value.c_str(), 0);
    FILE* out = freopen(log.c_str(), "a", stderr);
    out = freopen(log.c_str(), "a", stdout);
    (void)out;
    int closed = -1;
#ifdef SYS_close_range  // Linux 5.9 headers
    closed = static_cast<int>(syscall(SYS_close_range, 3u, ~0u, 0u));
#endif
    if (closed != 0) {  // one by one
      const long open_max = sysconf(_SC_OPEN_MAX);
      for (long fd = 3; fd < (open_max > 0 ? open_max : 65536); ++fd) close(static_cast<int>(fd));
    }
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    execvp(argv[0], argv.data());
    std::fprintf(stderr, "exec %s failed: %s\n", argv[0], std::strerror(errno));
    _exit(127);
  }
  return pid;
}

}  // namespace gkv::testing
