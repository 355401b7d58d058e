// Server: one gkv node. A UcxTransport (one worker thread) receives requests and sends replies;
// a pool of executor threads runs the cache operations (which may evict, copy and hit the disk).
//
// Request path of a GET: worker thread decodes the header -> executor: cache Acquire (pins the
// entry, may promote) -> worker: send the reply with the value straight from the tier's memory
// (a device entry is staged through host memory when UCX can't read device memory) -> the pin is
// released when UCX reports the send done.
// PUT: worker decodes -> executor: Reserve space in the tier the object will live in -> worker:
// receive the payload straight into that space -> executor: Commit (write-through when durable)
// -> worker: reply with the new version.
// Shutdown (Stop): new requests get Unavailable, in-flight ones finish, the cache writes back
// memory entries to disk (Flush), then the transport and the cache close.
// Adaptive replication (docs/ARCHITECTURE.md, "Hot keys"): the primary counts reads in a
// decaying sketch, copies a hot key's current version to the next nodes on the ring
// (REPLICA_PUT), and hints those nodes in its GET replies; clients then spread reads over them.
// A write or delete of a replicated key makes every copy unreadable (INVALIDATE) before it is
// acknowledged. Replica nodes serve a copy only for the exact version a hint named.
// Access control: when the cluster file has a secret, a connection's first message must be a
// HELLO carrying it; anything else (or a wrong secret) gets PermissionDenied, is counted, and the
// connection is closed. The secret is never logged.
// Thread-safety: Start/Stop from one controlling thread; everything else is internal.
#pragma once

#include <atomic>
#include <chrono>
#include <memory>
#include <string>

#include "gkv/cache/tiered_cache.h"
#include "gkv/cluster.h"
#include "gkv/status.h"
#include "hotness.h"

namespace gkv {

struct ServerOptions {
  ClusterConfig cluster;
  std::string node_id;
  CacheOptions cache;
  // Where the GPU tier goes in placement order (cache.gpu_behind_host): first (new objects land
  // there), behind the host tier, or auto: behind it when this node's UCX cannot move device
  // memory (every read of a GPU-tier object would need a copy to host memory first).
  enum class GpuPlacement { kAuto, kFirst, kBehindHost };
  GpuPlacement gpu_placement = GpuPlacement::kAuto;
  int executor_threads = 4;
  // UCX workers, each with its own I/O thread; 0: DefaultIoThreads(). Connections are spread
  // over them; each serves the GETs from memory and the PUTs of its connections, and worker 0
  // also runs everything else (docs/ARCHITECTURE.md, "Threads").
  int io_threads = 0;
  std::string listen_host;   // default: the node's host from the cluster file
  uint16_t listen_port = 0;  // default: the node's port from the cluster file
  // Prometheus text exposition on http://HOST:PORT/metrics (HOST: the listen host); 0 = off.
  uint16_t metrics_port = 0;
  // Largest batch request or batch reply payload the node buffers (MGET/MPUT); larger ones are
  // refused with NoSpace so a client can't make the node allocate without bound.
  uint64_t max_batch_bytes = 256ull << 20;
  // Largest single value the node accepts (PUT, each MPUT item, replica copies), checked before
  // anything is allocated or reserved; larger ones get InvalidArgument. RocksDB refuses values
  // of 4 GiB or more, so the limit stays below that.
  uint64_t max_value_size = 2ull << 30;
  static constexpr uint64_t kMaxValueSizeLimit = (4ull << 30) - (1ull << 20);

  // Admission control: past these a request is answered Busy before anything is reserved,
  // allocated or queued, so one client (or a flood of async calls) cannot evict real data with
  // space held for bytes still trickling in, nor grow the node's queues without bound.
  // Bytes counted: payloads a request brings (put, batch, replica copy: space is held for them
  // from the request's arrival until its reply is sent).
  uint64_t max_inflight_bytes = 1ull << 30;         // the whole node
  uint64_t max_conn_inflight_bytes = 256ull << 20;  // one connection
  uint32_t max_conn_requests = 1024;                // requests in flight on one connection
  size_t max_queued_tasks = 4096;                   // executor queue
  // A reply whose payload the peer has not taken within this long (a hung client keeping the
  // entry pinned) closes that connection, which releases every pin it held.
  std::chrono::milliseconds send_timeout{30000};

  // Streamed puts (a client sends a large value in pieces; docs/ARCHITECTURE.md, "Streamed
  // puts"): the largest piece the node takes and how many one put may have in flight. A value
  // bound for the disk tier (or for GPU memory this UCX cannot receive into) passes through
  // `stream_buffers` buffers of stream_chunk_size, pinned, allocated at start and shared by every
  // stream: a piece that finds none free is answered Busy. At most max_streams streams are open
  // at once; one that receives nothing for send_timeout is dropped with what it stored.
  uint32_t stream_chunk_size = 8u << 20;
  uint16_t stream_window = 2;
  int stream_buffers = 8;
  uint32_t max_streams = 64;

  // Adaptive replication of hot keys, on by default (HotnessRule says when a key is hot and when
  // it cools). A hot key this node owns is copied to the next `hot_replicas` nodes on the ring.
  // Copies this node holds for others live in their own memory budget, `replica_share` of the
  // GPU and host tiers, so they never take room from the node's own data. A cluster of one node
  // has nobody to copy to: replication is off there and the whole memory is the node's.
  HotnessRule replication;
  int hot_replicas = 2;
  double replica_share = 0.10;

  // Membership under etcd (cluster.membership == kEtcd; docs/ARCHITECTURE.md, "Membership").
  // The node registers `node_id` at the listen address (listen_host and listen_port, 0: a free
  // port) with `weight`, and hands keys to their new owners when the ring changes, at most this
  // many bytes a second (0: unbounded).
  double weight = 1.0;
  uint64_t handoff_bytes_per_s = 256ull << 20;
  // Stop() under etcd first leaves the ring: every key is handed off (up to this long), then
  // the registration goes. 20 s leaves the stop's write-back room within the 30 s an
  // orchestrator usually grants between SIGTERM and SIGKILL.
  std::chrono::milliseconds leave_timeout{20000};
};

// A quarter of the machine's cores, between 1 and 16: the rest is left to the executors, the
// training job and the kernel's network stack.
int DefaultIoThreads();

class Server {
 public:
  // Opens the cache (disk tier included) and starts listening. Fails with a clear message when
  // the node id is unknown, the address can't be bound or the disk can't be opened.
  static Result<std::unique_ptr<Server>> Start(const ServerOptions& options);
  ~Server();  // Stop() if still running

  // Graceful stop; idempotent.
  void Stop();
  uint16_t port() const;
  // Under etcd: the node left the cluster after `gkv drain` named it (the process should exit).
  bool drained() const;
  uint16_t metrics_port() const;
  TieredCache& cache();

 private:
  struct Impl;
  explicit Server(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace gkv
