// Counters and latency histograms of one node, and their two renderings: the JSON document of
// the STATS reply (docs/STATS.md) and the Prometheus text exposition (docs/METRICS.md).
// Thread-safety: counters are relaxed atomics (monotonic counts); the histograms are guarded by
// a mutex per I/O worker (recorded there, read by the stats and metrics paths).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>

#include "gkv/cache/tiered_cache.h"
#include "gkv/histogram.h"
#include "gkv/transport/protocol.h"

namespace gkv {

inline constexpr int kOpSlots = 17;

struct ServerCounters {
  std::atomic<uint64_t> ops[kOpSlots] = {};
  std::atomic<uint64_t> errors[kOpSlots] = {};  // by StatusCode
  std::atomic<uint64_t> bytes_in{0}, bytes_out{0};
  std::atomic<uint64_t> protocol_errors{0};
  std::atomic<uint64_t> slow_replies{0};  // replies made a second or more after the request came
  std::atomic<uint64_t> auth_failures{0};
  std::atomic<uint64_t> stuck_connections_closed{0};  // a reply not taken within send_timeout
  std::atomic<uint64_t> connections_accepted{0};
  // Streamed puts (streamed_put.cc): opened, completed (every piece stored, the commit begun),
  // and dropped before that (a
  // failed piece, the connection gone, or nothing received for the send timeout).
  std::atomic<uint64_t> streams_opened{0}, streams_completed{0}, streams_dropped{0};
  // GETs of a range of a value (kFlagRange: a client reads a large value for a device buffer
  // piece by piece), each range counted.
  std::atomic<uint64_t> ranged_gets{0};
  // Adaptive replication: copies this node made of its hot keys (created) and withdrew (dropped),
  // and copies it installed for other primaries. The reads it served from those copies are
  // counted by I/O thread (IoSlot::replica_reads, ReplicaReads() for the node).
  std::atomic<uint64_t> replicas_created{0}, replicas_dropped{0};
  std::atomic<uint64_t> replica_installs{0};
  // Installs this node refused (an invalidation of that attempt came first, or a newer copy is
  // held): the primary counts and hints only real installs.
  std::atomic<uint64_t> replica_refused{0};
  // Rows read from this node, of every kind (get, each MultiGet row, replica reads): the load
  // adaptive replication evens out; and the rate it last reported to its peers (gauge).
  std::atomic<uint64_t> rows_read{0};
  std::atomic<uint64_t> reads_per_s{0};
  std::atomic<bool> overloaded{false};  // its read load is above the cluster's mean (gauge)
  // Membership (docs/STATS.md): the ring's epoch and changes; keys and bytes handed off to new
  // owners and received from old ones; handoff scans running (gauge, 0 or 1); repair copies
  // sent (a key whose owners changed while this node stays one of them).
  std::atomic<uint64_t> ring_epoch{0}, ring_changes{0};
  // Requests refused while fenced (lease lapsed or a new registration not yet caught up).
  std::atomic<uint64_t> fenced_refusals{0};
  std::atomic<uint64_t> handoff_keys_out{0}, handoff_bytes_out{0};
  std::atomic<uint64_t> handoff_keys_in{0}, handoff_bytes_in{0};
  std::atomic<uint64_t> handoffs_running{0}, repairs{0};
  std::atomic<uint64_t> read_repairs{0};  // copies pushed to lagging replicas (REPAIR)
  // Memory registered with UCX once (the arenas: regions, bytes; gauges) and the sends and
  // receives that passed that registration: copied from the transport before rendering.
  std::atomic<uint64_t> ucx_registered_regions{0}, ucx_registered_bytes{0};
  std::atomic<uint64_t> ucx_registered_ops{0};
  // I/O workers (--io-threads) and the requests each answered (workers past kIoSlots - 1 are
  // counted in the last slot). One cache line per slot: the workers do not share one.
  static constexpr int kIoSlots = 16;
  std::atomic<uint64_t> io_threads{1};
  struct alignas(64) IoSlot {
    std::atomic<uint64_t> requests{0};
    std::atomic<uint64_t> replica_reads{0};  // reads answered from copies held for others
  };
  IoSlot requests_by_io_thread[kIoSlots];
  void CountAnswered(int worker) {
    requests_by_io_thread[std::min(worker, kIoSlots - 1)].requests.fetch_add(
        1, std::memory_order_relaxed);
  }
  void CountReplicaRead(int worker) {
    requests_by_io_thread[std::min(worker, kIoSlots - 1)].replica_reads.fetch_add(
        1, std::memory_order_relaxed);
  }
  uint64_t ReplicaReads() const {
    uint64_t n = 0;
    for (const IoSlot& slot : requests_by_io_thread) n += slot.replica_reads.load();
    return n;
  }

  // `stripe`: the recording I/O worker's index. Each worker records into a stripe of its own
  // (its mutex is contended only by a stats or metrics read), which LatencyOf merges; one per
  // I/O thread up to kIoSlots (the default is at most 16), so workers share none below that.
  void RecordLatency(wire::Opcode op, uint64_t ns, int stripe = 0) {
    Stripe& s = stripes_[static_cast<size_t>(stripe) % kStripes];
    std::lock_guard<std::mutex> lock(s.mu);
    s.latency[static_cast<int>(op) % kOpSlots].Record(ns);
  }
  Histogram LatencyOf(int op) const {
    Histogram out;
    for (const Stripe& s : stripes_) {
      std::lock_guard<std::mutex> lock(s.mu);
      out.Merge(s.latency[op]);
    }
    return out;
  }

 private:
  static constexpr size_t kStripes = kIoSlots;  // 256 KiB each
  struct alignas(64) Stripe {
    mutable std::mutex mu;
    Histogram latency[kOpSlots];
  };
  Stripe stripes_[kStripes];
};

// `replicas` is the cache of copies held for other primaries (all zero when replication is off).
std::string RenderStatsJson(const std::string& node_id, const CacheStats& cache,
                            const ServerCounters& counters, const CacheStats& replicas);
std::string RenderPrometheus(const std::string& node_id, const CacheStats& cache,
                             const ServerCounters& counters, const CacheStats& replicas);

}  // namespace gkv
