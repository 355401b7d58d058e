// gkv-server: one node of a gkv cluster.
//   gkv-server --cluster FILE --node ID [--gpu-mem SIZE] [--gpu-tier-in-host-memory]
//              [--host-mem SIZE] [--disk DIR]
//              [--disk-capacity SIZE] [--durable-share F] [--promotion-window MS]
//              [--threads N] [--metrics-port N] [--log-level L]
//              [--max-value-size SIZE] [--max-inflight SIZE] [--max-conn-inflight SIZE]
//              [--max-conn-requests N] [--max-queued N] [--send-timeout-ms MS]
//              [--replicate-hot auto|off|R] [--replicate-cool R] [--hot-share F]
//              [--load-slack F] [--hot-replicas N] [--replica-share F]
//              [--listen HOST:PORT] [--weight W] [--handoff-rate SIZE] [--leave-timeout-ms MS]
// Under etcd (`membership: etcd` in the cluster file) the node registers itself at --listen
// (port 0: a free one) with --weight; it need not be in the file.
// SIGTERM or SIGINT: stop accepting, finish what is in flight, write back to disk, exit 0. Under
// etcd the node first hands its keys to their new owners and leaves the cluster; after
// `gkv drain` names it, it does the same by itself and exits 0.
// Exit codes: 0 clean stop, 1 could not start (message on stderr), 2 bad usage.
#include <signal.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <cstdlib>

#include "gkv/log.h"
#include "gkv/size.h"
#include "server.h"

int main(int argc, char** argv) {
  CLI::App app{"gkv-server: one node of a gkv GPU key-value and tensor cache"};
  std::string cluster_file, node_id,
      gpu_mem = "0", host_mem = "1GiB", disk_dir, disk_capacity = "16GiB", log_level = "info",
      listen, max_value_size = "2GiB", max_inflight = "1GiB", max_conn_inflight = "256MiB",
      stream_chunk_size = "8MiB";
  int stream_window = 2, stream_buffers = 8;
  uint32_t max_conn_requests = 1024;
  size_t max_queued = 4096;
  int64_t send_timeout_ms = 30000;
  int threads = 4;
  int metrics_port = 0;
  std::string replicate_hot = "auto";
  double cool_rate = 0, replica_share = 0.10;
  gkv::HotnessRule rule;
  int hot_replicas = 2;
  std::vector<int> gpus = {0};
  int64_t promotion_window_ms = 10000;
  double weight = 1.0;
  std::string handoff_rate = "256MiB";
  int64_t leave_timeout_ms = 20000;
  app.add_option("--cluster", cluster_file, "cluster file (YAML)")->required();
  app.add_option("--node", node_id, "this node's id in the cluster file")->required();
  app.add_option("--gpu-mem", gpu_mem, "GPU tier size per device, e.g. 8GiB (0: off)");
  app.add_option("--gpus", gpus, "CUDA devices for the GPU tier")->delimiter(',');
  std::string gpu_placement = "auto";
  app.add_option("--gpu-placement", gpu_placement,
                 "the GPU tier first (new objects land there), behind-host (it takes what the "
                 "host tier spills), or auto: behind the host tier when this UCX cannot move "
                 "device memory")
      ->check(CLI::IsMember({"auto", "first", "behind-host"}));
  bool gpu_in_host_memory = false;
  app.add_flag("--gpu-tier-in-host-memory", gpu_in_host_memory,
               "tests and CPU-only machines: back the GPU tier with host memory, so its tier "
               "logic (placement, spills, copies) runs without a GPU");
  app.add_option("--host-mem", host_mem, "host (pinned) tier size (0: off)");
  app.add_option("--disk", disk_dir, "directory of the RocksDB disk tier (empty: no disk tier)");
  app.add_option("--disk-capacity", disk_capacity, "disk tier capacity");
  double durable_share = 0.5;
  app.add_option("--durable-share", durable_share,
                 "share of the disk capacity durable data may fill (never evicted)")
      ->check(CLI::Range(0.01, 1.0));
  app.add_option("--promotion-window", promotion_window_ms,
                 "ms within which a second read promotes an object from a lower tier")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--threads", threads, "executor threads for cache operations")
      ->check(CLI::Range(1, 256));
  int io_threads = 0;
  app.add_option("--io-threads", io_threads,
                 "UCX workers, each with an I/O thread; connections are spread over them "
                 "(0: a quarter of the cores, 1 to 16)")
      ->check(CLI::Range(0, 64));
  int placement_partitions = 0;
  app.add_option("--placement-partitions", placement_partitions,
                 "cache placement partitions, each with its own slice of every memory tier, "
                 "LRU and lock (a divisor of 16; 0: as many as I/O threads while each slice "
                 "keeps at least 1 GiB)")
      ->check(CLI::Range(0, 16));
  app.add_option("--log-level", log_level, "trace, debug, info, warn, error");
  app.add_option("--metrics-port", metrics_port, "serve Prometheus metrics on this port (/metrics)")
      ->check(CLI::Range(0, 65535));
  app.add_option("--max-value-size", max_value_size,
                 "largest value the node accepts (below 4 GiB, RocksDB's limit)");
  app.add_option("--max-inflight", max_inflight,
                 "payload bytes the node holds space for before their bytes arrive (then Busy)");
  app.add_option("--max-conn-inflight", max_conn_inflight, "the same, per connection");
  app.add_option("--max-conn-requests", max_conn_requests,
                 "requests in flight on one connection (then Busy)")
      ->check(CLI::Range(1u, 1u << 20));
  app.add_option("--max-queued", max_queued, "executor queue length (then Busy)")
      ->check(CLI::Range(size_t{1}, size_t{1} << 24));
  app.add_option("--send-timeout-ms", send_timeout_ms,
                 "close a connection whose peer has not taken a reply for this long")
      ->check(CLI::Range(int64_t{10}, int64_t{3600000}));
  app.add_option("--stream-chunk-size", stream_chunk_size,
                 "streamed puts: the largest piece the node takes (a power of two, 4KiB-64MiB)");
  app.add_option("--stream-window", stream_window,
                 "streamed puts: pieces one put may have in flight")
      ->check(CLI::Range(1, 64));
  app.add_option("--stream-buffers", stream_buffers,
                 "streamed puts: pinned buffers of --stream-chunk-size for pieces bound for disk, "
                 "shared by every stream (then Busy)")
      ->check(CLI::Range(1, 1024));
  app.add_option("--replicate-hot", replicate_hot,
                 "auto (default): copy a key when its node is loaded above the cluster's mean and "
                 "the key takes --hot-share of its reads; R: copy keys read more than R times a "
                 "second; off (or 0): never copy");
  app.add_option(
      "--replicate-cool", cool_rate,
      "with --replicate-hot R: drop the copies under this rate (default: a quarter of R)");
  app.add_option("--hot-share", rule.hot_share,
                 "auto mode: share of its node's reads that makes a key hot (cools at a quarter)")
      ->check(CLI::Range(0.0001, 1.0));
  app.add_option("--load-slack", rule.load_slack,
                 "auto mode: a node copies only while its read load exceeds its share of the "
                 "cluster's by more than this fraction")
      ->check(CLI::Range(0.0, 10.0));
  app.add_option("--listen", listen,
                 "HOST:PORT to listen on (default: the node's address in the cluster file; under "
                 "etcd required, port 0 picks a free one)");
  app.add_option("--weight", weight, "share of the key space relative to other nodes (etcd)")
      ->check(CLI::PositiveNumber)
      ->check(CLI::Range(0.0, gkv::kMaxNodeWeight));
  app.add_option("--handoff-rate", handoff_rate,
                 "bytes per second a ring change may move off this node (0: unbounded)");
  app.add_option("--leave-timeout-ms", leave_timeout_ms,
                 "etcd: how long a stop may spend handing keys off before it leaves anyway "
                 "(default 20 s: with the write-back after it, within an orchestrator's usual "
                 "30 s grace period before SIGKILL)");
  app.add_option("--hot-replicas", hot_replicas, "copies of a hot key (next nodes on the ring)")
      ->check(CLI::Range(1, 16));
  app.add_option("--replica-share", replica_share,
                 "share of the GPU and host tiers kept for copies of other nodes' hot keys");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;
  }
  gkv::SetLogLevel(log_level);

  auto fail = [](const std::string& what) {
    std::fprintf(stderr, "gkv-server: %s\n", what.c_str());
    return 1;
  };
  auto cluster = gkv::LoadClusterFile(cluster_file);
  if (!cluster.ok()) return fail(cluster.status().ToString());
  gkv::ServerOptions options;
  options.cluster = *cluster;
  options.node_id = node_id;
  options.weight = weight;
  options.leave_timeout = std::chrono::milliseconds(leave_timeout_ms);
  if (!listen.empty()) {
    // Port 0 is allowed here (a free port), which ParseAddress refuses.
    const size_t colon = listen.rfind(':');
    std::string host = colon == std::string::npos ? "" : listen.substr(0, colon);
    if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
      host = host.substr(1, host.size() - 2);
    }
    char* end = nullptr;
    const long port =
        colon == std::string::npos ? -1 : std::strtol(listen.c_str() + colon + 1, &end, 10);
    if (host.empty() || port < 0 || port > 65535 || (end && *end != '\0')) {
      std::fprintf(stderr, "gkv-server: --listen takes HOST:PORT, not '%s'\n", listen.c_str());
      return 2;
    }
    options.listen_host = host;
    options.listen_port = static_cast<uint16_t>(port);
  }
  options.executor_threads = threads;
  options.io_threads = io_threads;
  options.metrics_port = static_cast<uint16_t>(metrics_port);
  if (replicate_hot == "auto") {
    rule.mode = gkv::HotnessRule::Mode::kRelative;
  } else if (replicate_hot == "off") {
    rule.mode = gkv::HotnessRule::Mode::kOff;
  } else {
    char* end = nullptr;
    const double rate = std::strtod(replicate_hot.c_str(), &end);
    if (end == replicate_hot.c_str() || *end != '\0' || !(rate >= 0)) {
      std::fprintf(stderr, "gkv-server: --replicate-hot takes auto, off or a rate, not '%s'\n",
                   replicate_hot.c_str());
      return 2;
    }
    rule.mode = rate > 0 ? gkv::HotnessRule::Mode::kAbsolute : gkv::HotnessRule::Mode::kOff;
    rule.hot_reads_per_s = rate;
    if (rate > 0 && cool_rate >= rate) {
      std::fprintf(stderr,
                   "gkv-server: --replicate-cool (%g) must be below --replicate-hot (%g), or a "
                   "key near the rate would gain and lose its copies over and over\n",
                   cool_rate, rate);
      return 2;
    }
  }
  rule.cool_reads_per_s = cool_rate;
  options.replication = rule;
  options.hot_replicas = hot_replicas;
  options.replica_share = replica_share;
  for (auto [text, out] : {std::pair{&gpu_mem, &options.cache.gpu_capacity},
                           std::pair{&host_mem, &options.cache.host_capacity},
                           std::pair{&disk_capacity, &options.cache.disk_capacity},
                           std::pair{&handoff_rate, &options.handoff_bytes_per_s},
                           std::pair{&max_value_size, &options.max_value_size},
                           std::pair{&max_inflight, &options.max_inflight_bytes},
                           std::pair{&max_conn_inflight, &options.max_conn_inflight_bytes}}) {
    auto v = gkv::ParseSize(*text);
    if (!v.ok()) {
      std::fprintf(stderr, "gkv-server: %s\n", v.status().ToString().c_str());
      return 2;
    }
    *out = *v;
  }
  if (options.max_value_size == 0 ||
      options.max_value_size > gkv::ServerOptions::kMaxValueSizeLimit) {
    std::fprintf(stderr, "gkv-server: --max-value-size must be between 1 B and %s\n",
                 gkv::FormatSize(gkv::ServerOptions::kMaxValueSizeLimit).c_str());
    return 2;
  }
  {
    auto chunk = gkv::ParseSize(stream_chunk_size);
    if (!chunk.ok() || *chunk < (4u << 10) || *chunk > (64u << 20) || (*chunk & (*chunk - 1))) {
      std::fprintf(stderr,
                   "gkv-server: --stream-chunk-size must be a power of two from 4KiB "
                   "to 64MiB\n");
      return 2;
    }
    options.stream_chunk_size = static_cast<uint32_t>(*chunk);
  }
  options.stream_window = static_cast<uint16_t>(stream_window);
  options.stream_buffers = stream_buffers;
  options.max_conn_requests = max_conn_requests;
  options.max_queued_tasks = max_queued;
  options.send_timeout = std::chrono::milliseconds(send_timeout_ms);
  options.cache.gpu_devices = gpus;
  options.cache.gpu_tier_in_host_memory = gpu_in_host_memory;
  options.gpu_placement = gpu_placement == "first" ? gkv::ServerOptions::GpuPlacement::kFirst
                          : gpu_placement == "behind-host"
                              ? gkv::ServerOptions::GpuPlacement::kBehindHost
                              : gkv::ServerOptions::GpuPlacement::kAuto;
  options.cache.disk_path = disk_dir;
  options.cache.disk_durable_share = durable_share;
  options.cache.promotion_window = std::chrono::milliseconds(promotion_window_ms);
  options.cache.placement_partitions = placement_partitions;  // 0: chosen by the server

  // Block the stop signals before any thread starts, so only sigwait below receives them.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGTERM);
  sigaddset(&stop_signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);
  signal(SIGPIPE, SIG_IGN);

  auto server = gkv::Server::Start(options);
  if (!server.ok()) return fail(server.status().ToString());
  int sig = 0;
  for (;;) {
    const timespec tick{0, 100 * 1000 * 1000};
    sig = sigtimedwait(&stop_signals, nullptr, &tick);
    if (sig > 0) {
      GKV_LOG_INFO("{} received: stopping", sig == SIGTERM ? "SIGTERM" : "SIGINT");
      break;
    }
    if ((*server)->drained()) {
      GKV_LOG_INFO("drained: stopping");
      break;
    }
  }
  (*server)->Stop();
  server->reset();
  return 0;
}
