#include "server_stats.h"

#include <cstdio>

namespace gkv {

namespace w = wire;

namespace {

constexpr int kFirstOp = static_cast<int>(w::Opcode::kPing);
constexpr int kLastOp = static_cast<int>(w::Opcode::kPutChunk);
static_assert(kLastOp < kOpSlots);

std::string TierLabel(int t) { return std::string(TierName(static_cast<gkv::Tier>(t))); }

std::string Num(double v) {
  char b[64];
  std::snprintf(b, sizeof b, "%.9g", v);
  return b;
}

// Reads that looked in tier t and had to go further down (served by a lower tier).
uint64_t TierMisses(const CacheStats& c, int t) {
  if (!c.tiers[t].enabled) return 0;
  uint64_t below = 0;
  for (int u = t + 1; u < kTierCount; ++u) below += c.tiers[u].hits;
  return below + c.misses;
}

}  // namespace

std::string RenderStatsJson(const std::string& node_id, const CacheStats& st,
                            const ServerCounters& counters, const CacheStats& rep) {
  std::string j = "{\"node\":\"" + node_id + "\",\"tiers\":{";
  for (int t = 0; t < kTierCount; ++t) {
    const TierStats& ts = st.tiers[t];
    if (t) j += ",";
    j += "\"" + TierLabel(t) + "\":{";
    j += "\"enabled\":" + std::string(ts.enabled ? "true" : "false");
    j += ",\"capacity_bytes\":" + std::to_string(ts.capacity);
    j += ",\"used_bytes\":" + std::to_string(ts.used_bytes);
    j += ",\"objects\":" + std::to_string(ts.objects);
    j += ",\"hits\":" + std::to_string(ts.hits);
    j += ",\"misses\":" + std::to_string(TierMisses(st, t)) + "}";
  }
  j += "},\"misses\":" + std::to_string(st.misses);
  j += ",\"moves\":{";
  bool first = true;
  for (int a = 0; a < kTierCount; ++a) {
    for (int b = 0; b < kTierCount; ++b) {
      if (a == b) continue;
      if (!first) j += ",";
      first = false;
      j += "\"" + TierLabel(a) + "_to_" + TierLabel(b) +
           "\":{\"objects\":" + std::to_string(st.moves[a][b]) +
           ",\"bytes\":" + std::to_string(st.moved_bytes[a][b]) + "}";
    }
  }
  j += "},\"disk_evictions\":" + std::to_string(st.disk_evictions);
  j += ",\"dropped\":" + std::to_string(st.dropped);
  j += ",\"durable_writes\":" + std::to_string(st.durable_writes);
  j += ",\"bytes_in\":" + std::to_string(counters.bytes_in.load());
  j += ",\"bytes_out\":" + std::to_string(counters.bytes_out.load());
  j += ",\"protocol_errors\":" + std::to_string(counters.protocol_errors.load());
  j += ",\"slow_replies\":" + std::to_string(counters.slow_replies.load());
  j += ",\"auth_failures\":" + std::to_string(counters.auth_failures.load());
  j += ",\"stuck_connections_closed\":" + std::to_string(counters.stuck_connections_closed.load());
  j += ",\"connections_accepted\":" + std::to_string(counters.connections_accepted.load());
  j += ",\"streamed_puts\":{\"opened\":" + std::to_string(counters.streams_opened.load()) +
       ",\"completed\":" + std::to_string(counters.streams_completed.load()) +
       ",\"dropped\":" + std::to_string(counters.streams_dropped.load()) + "}";
  j += ",\"ranged_gets\":" + std::to_string(counters.ranged_gets.load());
  const int io_threads =
      static_cast<int>(std::min<uint64_t>(counters.io_threads.load(), ServerCounters::kIoSlots));
  j += ",\"io_threads\":" + std::to_string(counters.io_threads.load());
  j += ",\"placement_partitions\":" + std::to_string(st.placement_partitions);
  j += ",\"requests_by_io_thread\":[";
  for (int i = 0; i < io_threads; ++i) {
    if (i) j += ",";
    j += std::to_string(counters.requests_by_io_thread[i].requests.load());
  }
  j += "]";
  j += ",\"ucx_registration\":{\"regions\":" +
       std::to_string(counters.ucx_registered_regions.load()) +
       ",\"bytes\":" + std::to_string(counters.ucx_registered_bytes.load()) +
       ",\"ops\":" + std::to_string(counters.ucx_registered_ops.load()) + "}";
  j += ",\"ops\":{";
  for (int op = kFirstOp; op <= kLastOp; ++op) {
    if (op != kFirstOp) j += ",";
    j += "\"" + std::string(w::OpcodeName(static_cast<w::Opcode>(op))) +
         "\":" + std::to_string(counters.ops[op].load());
  }
  j += "},\"errors\":{";
  for (int c = 1; c <= static_cast<int>(kLastStatusCode); ++c) {
    if (c != 1) j += ",";
    j += "\"" + std::string(StatusCodeName(static_cast<StatusCode>(c))) +
         "\":" + std::to_string(counters.errors[c].load());
  }
  j += "},\"replication\":{\"created\":" + std::to_string(counters.replicas_created.load());
  j += ",\"dropped\":" + std::to_string(counters.replicas_dropped.load());
  j += ",\"installed\":" + std::to_string(counters.replica_installs.load());
  // The total is the sum of the same loads as the list, so the two agree under load.
  std::string served_by_thread;
  uint64_t served = 0;
  for (int i = 0; i < io_threads; ++i) {
    const uint64_t n = counters.requests_by_io_thread[i].replica_reads.load();
    served += n;
    if (i) served_by_thread += ",";
    served_by_thread += std::to_string(n);
  }
  j += ",\"reads_served\":" + std::to_string(served);
  j += ",\"reads_served_by_io_thread\":[" + served_by_thread + "]";
  j += ",\"refused\":" + std::to_string(counters.replica_refused.load());
  j += ",\"rows_read\":" + std::to_string(counters.rows_read.load());
  j += ",\"reads_per_s\":" + std::to_string(counters.reads_per_s.load());
  j += std::string(",\"overloaded\":") + (counters.overloaded.load() ? "true" : "false");
  j += ",\"tiers\":{";
  for (int t = 0; t < 2; ++t) {
    if (t) j += ",";
    j += "\"" + TierLabel(t) + "\":{\"capacity_bytes\":" + std::to_string(rep.tiers[t].capacity) +
         ",\"used_bytes\":" + std::to_string(rep.tiers[t].used_bytes) +
         ",\"objects\":" + std::to_string(rep.tiers[t].objects) + "}";
  }
  j += "}}";
  j += ",\"membership\":{\"ring_epoch\":" + std::to_string(counters.ring_epoch.load());
  j += ",\"ring_changes\":" + std::to_string(counters.ring_changes.load());
  j += ",\"fenced_refusals\":" + std::to_string(counters.fenced_refusals.load());
  j += ",\"handoff_keys_out\":" + std::to_string(counters.handoff_keys_out.load());
  j += ",\"handoff_bytes_out\":" + std::to_string(counters.handoff_bytes_out.load());
  j += ",\"handoff_keys_in\":" + std::to_string(counters.handoff_keys_in.load());
  j += ",\"handoff_bytes_in\":" + std::to_string(counters.handoff_bytes_in.load());
  j += ",\"handoffs_running\":" + std::to_string(counters.handoffs_running.load());
  j += ",\"repairs\":" + std::to_string(counters.repairs.load());
  j += ",\"read_repairs\":" + std::to_string(counters.read_repairs.load());
  j += "},\"latency_us\":{";
  first = true;
  for (int op = kFirstOp; op <= kLastOp; ++op) {
    Histogram h = counters.LatencyOf(op);
    if (h.count() == 0) continue;
    if (!first) j += ",";
    first = false;
    j += "\"" + std::string(w::OpcodeName(static_cast<w::Opcode>(op))) +
         "\":{\"count\":" + std::to_string(h.count()) + ",\"p50\":" + Num(h.Percentile(0.5) / 1e3) +
         ",\"p90\":" + Num(h.Percentile(0.9) / 1e3) + ",\"p99\":" + Num(h.Percentile(0.99) / 1e3) +
         ",\"p999\":" + Num(h.Percentile(0.999) / 1e3) + ",\"max\":" + Num(h.max() / 1e3) + "}";
  }
  j += "}}";
  return j;
}

std::string RenderPrometheus(const std::string& node_id, const CacheStats& st,
                             const ServerCounters& counters, const CacheStats& rep) {
  std::string o;
  const std::string node = "node=\"" + node_id + "\"";
  auto family = [&](const char* name, const char* type, const char* help) {
    o += "# HELP ";
    o += name;
    o += " ";
    o += help;
    o += "\n# TYPE ";
    o += name;
    o += " ";
    o += type;
    o += "\n";
  };
  auto sample = [&](const std::string& name, const std::string& labels, double v) {
    o += name + "{" + node + (labels.empty() ? "" : "," + labels) + "} " + Num(v) + "\n";
  };
  family("gkv_tier_capacity_bytes", "gauge", "Configured capacity of a cache tier.");
  for (int t = 0; t < kTierCount; ++t) {
    if (st.tiers[t].enabled)
      sample("gkv_tier_capacity_bytes", "tier=\"" + TierLabel(t) + "\"", st.tiers[t].capacity);
  }
  family("gkv_tier_used_bytes", "gauge", "Bytes allocated in a cache tier.");
  for (int t = 0; t < kTierCount; ++t) {
    if (st.tiers[t].enabled)
      sample("gkv_tier_used_bytes", "tier=\"" + TierLabel(t) + "\"", st.tiers[t].used_bytes);
  }
  family("gkv_tier_objects", "gauge", "Objects whose current home is a tier.");
  for (int t = 0; t < kTierCount; ++t) {
    if (st.tiers[t].enabled)
      sample("gkv_tier_objects", "tier=\"" + TierLabel(t) + "\"", st.tiers[t].objects);
  }
  family("gkv_tier_hits_total", "counter", "Reads served from a tier.");
  for (int t = 0; t < kTierCount; ++t) {
    if (st.tiers[t].enabled)
      sample("gkv_tier_hits_total", "tier=\"" + TierLabel(t) + "\"", st.tiers[t].hits);
  }
  family("gkv_tier_misses_total", "counter",
         "Reads that looked in a tier and were served below it or not at all.");
  for (int t = 0; t < kTierCount; ++t) {
    if (st.tiers[t].enabled)
      sample("gkv_tier_misses_total", "tier=\"" + TierLabel(t) + "\"", TierMisses(st, t));
  }
  family("gkv_misses_total", "counter", "Reads of keys the node does not hold.");
  sample("gkv_misses_total", "", st.misses);
  family("gkv_tier_moves_total", "counter", "Objects moved between tiers (spills and promotions).");
  for (int a = 0; a < kTierCount; ++a) {
    for (int b = 0; b < kTierCount; ++b) {
      if (a != b)
        sample("gkv_tier_moves_total", "from=\"" + TierLabel(a) + "\",to=\"" + TierLabel(b) + "\"",
               st.moves[a][b]);
    }
  }
  family("gkv_tier_moved_bytes_total", "counter", "Bytes moved between tiers.");
  for (int a = 0; a < kTierCount; ++a) {
    for (int b = 0; b < kTierCount; ++b) {
      if (a != b)
        sample("gkv_tier_moved_bytes_total",
               "from=\"" + TierLabel(a) + "\",to=\"" + TierLabel(b) + "\"", st.moved_bytes[a][b]);
    }
  }
  family("gkv_disk_evictions_total", "counter", "Objects the disk tier dropped past its capacity.");
  sample("gkv_disk_evictions_total", "", st.disk_evictions);
  family("gkv_dropped_total", "counter",
         "Objects evicted from memory with no lower tier to take them.");
  sample("gkv_dropped_total", "", st.dropped);
  family("gkv_durable_writes_total", "counter",
         "Puts written through to disk before acknowledgement.");
  sample("gkv_durable_writes_total", "", st.durable_writes);
  family("gkv_received_bytes_total", "counter", "Payload bytes received.");
  sample("gkv_received_bytes_total", "", counters.bytes_in.load());
  family("gkv_sent_bytes_total", "counter", "Payload bytes sent.");
  sample("gkv_sent_bytes_total", "", counters.bytes_out.load());
  family("gkv_protocol_errors_total", "counter", "Malformed requests.");
  sample("gkv_protocol_errors_total", "", counters.protocol_errors.load());
  family("gkv_slow_replies_total", "counter",
         "Replies made a second or more after their request arrived.");
  sample("gkv_slow_replies_total", "", counters.slow_replies.load());
  family("gkv_auth_failures_total", "counter",
         "Connections refused for a missing or wrong secret.");
  sample("gkv_auth_failures_total", "", counters.auth_failures.load());
  family("gkv_stuck_connections_closed_total", "counter",
         "Connections closed because a reply was not taken within the send timeout.");
  sample("gkv_stuck_connections_closed_total", "", counters.stuck_connections_closed.load());
  family("gkv_connections_accepted_total", "counter", "Connections accepted.");
  sample("gkv_connections_accepted_total", "", counters.connections_accepted.load());
  family("gkv_io_thread_requests_total", "counter",
         "Requests answered by each I/O thread (UCX worker; --io-threads).");
  for (int i = 0; i < static_cast<int>(
                          std::min<uint64_t>(counters.io_threads.load(), ServerCounters::kIoSlots));
       ++i) {
    sample("gkv_io_thread_requests_total", "io_thread=\"" + std::to_string(i) + "\"",
           static_cast<double>(counters.requests_by_io_thread[i].requests.load()));
  }
  family("gkv_ucx_registered_bytes", "gauge",
         "Memory registered with UCX once (the tiers' arenas), in bytes.");
  sample("gkv_ucx_registered_bytes", "", counters.ucx_registered_bytes.load());
  family("gkv_ucx_registered_ops_total", "counter",
         "Sends and receives whose buffer lay in registered memory (passed its handle).");
  sample("gkv_ucx_registered_ops_total", "", counters.ucx_registered_ops.load());
  family("gkv_replicas_created_total", "counter",
         "Copies of this node's hot keys made on other nodes.");
  sample("gkv_replicas_created_total", "", counters.replicas_created.load());
  family("gkv_replicas_dropped_total", "counter",
         "Copies withdrawn (cooled down, or invalidated by a write).");
  sample("gkv_replicas_dropped_total", "", counters.replicas_dropped.load());
  family("gkv_replica_reads_total", "counter",
         "Reads this node served from copies it holds for other primaries.");
  sample("gkv_replica_reads_total", "", counters.ReplicaReads());
  family("gkv_rows_read_total", "counter",
         "Rows read from this node (gets, batch rows, replica reads): the load replication evens.");
  sample("gkv_rows_read_total", "", counters.rows_read.load());
  family("gkv_read_load_overloaded", "gauge",
         "1 while this node's read load is above the cluster's mean by more than the slack.");
  sample("gkv_read_load_overloaded", "", counters.overloaded.load() ? 1 : 0);
  family("gkv_ring_epoch", "gauge", "Epoch of the ring this node routes by (etcd revision).");
  sample("gkv_ring_epoch", "", counters.ring_epoch.load());
  family("gkv_ring_changes_total", "counter", "Ring changes this node applied.");
  sample("gkv_ring_changes_total", "", counters.ring_changes.load());
  family("gkv_fenced_refusals_total", "counter",
         "Requests refused while this node was fenced (its etcd lease may have lapsed).");
  sample("gkv_fenced_refusals_total", "", counters.fenced_refusals.load());
  family("gkv_handoff_keys_total", "counter", "Keys handed off by ring changes, by direction.");
  sample("gkv_handoff_keys_total", "direction=\"out\"", counters.handoff_keys_out.load());
  sample("gkv_handoff_keys_total", "direction=\"in\"", counters.handoff_keys_in.load());
  family("gkv_handoff_bytes_total", "counter", "Bytes handed off by ring changes, by direction.");
  sample("gkv_handoff_bytes_total", "direction=\"out\"", counters.handoff_bytes_out.load());
  sample("gkv_handoff_bytes_total", "direction=\"in\"", counters.handoff_bytes_in.load());
  family("gkv_handoffs_running", "gauge", "1 while this node hands keys off after a ring change.");
  sample("gkv_handoffs_running", "", counters.handoffs_running.load());
  family("gkv_repairs_total", "counter",
         "Copies re-created on a key's new owners after a ring change (replicas > 1).");
  sample("gkv_repairs_total", "", counters.repairs.load());
  family("gkv_read_repairs_total", "counter",
         "Copies this node pushed to a replica that lagged behind it (read repair).");
  sample("gkv_read_repairs_total", "", counters.read_repairs.load());
  family("gkv_replica_used_bytes", "gauge", "Bytes of copies held for other primaries, by tier.");
  for (int t = 0; t < 2; ++t) {
    sample("gkv_replica_used_bytes", "tier=\"" + TierLabel(t) + "\"", rep.tiers[t].used_bytes);
  }
  family("gkv_requests_total", "counter", "Requests received, by operation.");
  for (int op = kFirstOp; op <= kLastOp; ++op) {
    sample("gkv_requests_total",
           "op=\"" + std::string(w::OpcodeName(static_cast<w::Opcode>(op))) + "\"",
           counters.ops[op].load());
  }
  family("gkv_errors_total", "counter", "Error replies, by status code.");
  for (int c = 1; c <= static_cast<int>(kLastStatusCode); ++c) {
    sample("gkv_errors_total",
           "code=\"" + std::string(StatusCodeName(static_cast<StatusCode>(c))) + "\"",
           counters.errors[c].load());
  }
  // Request latency from arrival to the reply's send completion.
  static const double kBuckets[] = {25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3,
                                    25e-3, 50e-3, 0.1,    0.25,   0.5,    1,    2.5,    5,    10};
  family("gkv_request_duration_seconds", "histogram",
         "Time from a request's arrival to its reply leaving, by operation.");
  for (int op = kFirstOp; op <= kLastOp; ++op) {
    Histogram h = counters.LatencyOf(op);
    const std::string opl = "op=\"" + std::string(w::OpcodeName(static_cast<w::Opcode>(op))) + "\"";
    for (double le : kBuckets) {
      sample("gkv_request_duration_seconds_bucket", opl + ",le=\"" + Num(le) + "\"",
             h.CountAtOrBelow(static_cast<uint64_t>(le * 1e9)));
    }
    sample("gkv_request_duration_seconds_bucket", opl + ",le=\"+Inf\"", h.count());
    sample("gkv_request_duration_seconds_sum", opl, h.sum() / 1e9);
    sample("gkv_request_duration_seconds_count", opl, h.count());
  }
  return o;
}

}  // namespace gkv
