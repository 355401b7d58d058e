// gkv::Client: the C++ client of a gkv cluster.
//
// Keys map to nodes by consistent hashing (gkv/cluster.h) computed here, so a get costs one
// round trip to the owning node. Values move with UCX straight between the server's tier and the
// caller's buffer, host or CUDA device memory (device buffers go to UCX directly when UCX can
// move device memory, through a pinned staging copy when it can't).
//
// Membership: a static cluster file, or `membership: etcd` (gkv/membership.h): the client then
// watches the cluster's members and routes by the newest ring it has seen; a node that answers
// "not mine" (WrongNode) is asked again after a few milliseconds, and while keys move between
// nodes a miss is asked of the key's previous owner before it is reported.
// Thread-safety: a Client is safe to use from many threads at once. Every call has a deadline
// (per call, or ClientOptions::default_timeout) and returns Timeout or Unavailable instead of
// hanging. A deadline that passes while bytes still move through buffers the client made (a
// value Get or MultiGet receives, MultiGetInto's reply block, a batch's request block, a device
// value GetInto or Put stages through host memory) fails that call alone: the bytes finish
// moving unseen (still moving the default timeout later, at least 1 s, the connection is
// closed; past 256 MiB of such buffers held, a call is cut off as below). One that passes while
// bytes move into or out of the caller's own buffer (GetInto's destination, Put's value)
// closes that node's connection, failing its other calls in flight, so the buffer is never
// touched after the call returns; the next call reconnects. docs/ARCHITECTURE.md, "Failures".
// Ownership: buffers passed to Put/GetInto are borrowed for the duration of the call (for the
// async forms: until the future is ready or the callback has run).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <future>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "gkv/cluster.h"
#include "gkv/status.h"
#include "gkv/tensor.h"

namespace gkv {

struct ClientOptions {
  std::string cluster_file;  // or fill `cluster` directly
  ClusterConfig cluster;     // its `secret`, when set, is presented on every connection
  // Deadline of a call that does not give its own: a dead or hung node costs at most this.
  // Raise it (per call or here) for values of tens of MiB on slow links.
  std::chrono::milliseconds default_timeout{500};
  // Base replication: every put (and delete) goes to the key's first `replicas` distinct nodes
  // on the ring; reads go to the first live one of them. 1 = the cluster file's `replicas:`
  // (1 when it has none).
  int replicas = 1;
  // Read repair (replicas > 1): after a read that the key's first node served, this share of
  // reads also asks the key's other replicas for their version, off the caller's path, and has
  // the first node push its copy to any replica holding an older version or none (a replica
  // that missed a write would otherwise serve it once the first node fails). 0 turns it off.
  double read_repair_chance = 0.1;
  // After a node fails, calls to it fail fast with Unavailable for a backoff period (doubling
  // from the initial value to the maximum while it stays down), then the client reconnects.
  std::chrono::milliseconds reconnect_backoff_initial{50};
  std::chrono::milliseconds reconnect_backoff_max{2000};
  // A Put of a value larger than this is streamed: sent in pieces of the node's choosing, so a
  // node stores a value bound for its disk without a buffer as large as the value. Smaller ones
  // go as one message (but see pipeline_threshold).
  uint64_t stream_threshold = uint64_t{64} << 20;
  // Device buffers that this client's UCX cannot move (staged through pinned host memory):
  // a Put larger than this is staged piece by piece, each piece copied while the ones before it
  // are on the wire (a streamed put whatever its size; a smaller one, and any with more than
  // one replica, is copied whole before it is sent); a GetInto whose buffer holds more than
  // this reads the value in ranges, copying each to the device while the next ones arrive (a
  // key with hot-key copies is read whole). If the value changes or a node fails part-way, the
  // GetInto reads it again whole: then `accept` may run twice, and a call that fails may have
  // written part of the buffer.
  uint64_t pipeline_threshold = uint64_t{16} << 20;
};

// What the server knows about a stored object.
struct ValueInfo {
  uint64_t size = 0;
  uint64_t version = 0;
  TensorMeta tensor;
  std::string tier;  // "gpu", "host" or "disk": where the server held it when it answered
  bool on_disk = false;
};

// Where a buffer lives. kAuto asks the CUDA runtime (host when no GPU is usable).
enum class BufferMemory : uint8_t { kAuto, kHost, kDevice };

// Device buffers and the work that produces or consumes them: before the client reads a device
// buffer (Put, PutAsync, MultiPut) or writes one (GetInto, MultiGetInto) it waits, on the
// calling thread, for `cuda_stream` (a cudaStream_t the caller's kernels use on that buffer),
// or, when none is given, for the work queued so far on the legacy default stream of the
// buffer's device and on that device's blocking streams. So a value is never taken from a
// buffer a kernel is still writing, nor written under one still reading it. Work on other
// non-blocking streams is the caller's to finish first. PutAsync waits too before it returns.
// The calling thread's current CUDA device is left as it was.
struct PutOptions {
  TensorMeta tensor;  // default: raw bytes
  bool durable = false;
  std::chrono::milliseconds timeout{0};  // 0: the client's default
  BufferMemory memory = BufferMemory::kAuto;
  void* cuda_stream = nullptr;  // see above; device buffers only
};

struct GetOptions {
  std::chrono::milliseconds timeout{0};
  BufferMemory memory = BufferMemory::kAuto;  // of GetInto's destination
  void* cuda_stream = nullptr;                // of GetInto's device destination: see PutOptions
  // Fail open: when no node holding the key answers (Unavailable or Timeout), report a miss
  // (NotFound) instead, so a training step falls back to its own loader.
  bool fail_open = false;
  // GetInto / MultiGetInto: called on the thread that drives the client's I/O (its I/O thread,
  // or a thread waiting in a synchronous call of this Client, not necessarily the caller's own;
  // keep it short, no blocking, take no lock a caller of this Client may hold) with
  // a value's metadata before any of its bytes reaches the caller's buffer; a non-OK status
  // refuses the value (the call returns that status for the key; the buffer is untouched; but
  // see ClientOptions::pipeline_threshold).
  // E.g. to require an exact dtype and byte size.
  std::function<Status(const ValueInfo&)> accept;
};

// An owned value in host memory.
class Value {
 public:
  Value() = default;
  const std::byte* data() const { return bytes_ ? bytes_.get() : staged_.get(); }
  std::byte* mutable_data() { return bytes_ ? bytes_.get() : staged_.get(); }
  size_t size() const { return info_.size; }
  std::string_view view() const { return {reinterpret_cast<const char*>(data()), size()}; }
  const ValueInfo& info() const { return info_; }

 private:
  friend class Client;
  std::unique_ptr<std::byte[]> bytes_;
  std::shared_ptr<std::byte[]> staged_;  // GetInto's staging buffer (a pooled one)
  ValueInfo info_;
};

struct PutItem {
  std::string key;
  const void* data = nullptr;
  size_t size = 0;
  TensorMeta tensor;
};

class Client {
 public:
  static Result<std::unique_ptr<Client>> Open(const ClientOptions& options);
  ~Client();  // fails whatever is still pending with Aborted, then disconnects
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  // Stores `size` bytes (host or device memory) under `key`; returns the new version.
  Result<uint64_t> Put(std::string_view key, const void* data, size_t size,
                       const PutOptions& options = {});
  Result<Value> Get(std::string_view key, const GetOptions& options = {});
  // Receives the value into `dst` (host or device). InvalidArgument if it holds fewer than the
  // value's bytes (nothing is written then; but see ClientOptions::pipeline_threshold).
  Result<ValueInfo> GetInto(std::string_view key, void* dst, size_t capacity,
                            const GetOptions& options = {});
  Status Delete(std::string_view key, std::chrono::milliseconds timeout = {});
  Result<ValueInfo> Stat(std::string_view key, std::chrono::milliseconds timeout = {});

  // One message per node involved; results in the order of `keys` / `items`.
  std::vector<Result<Value>> MultiGet(const std::vector<std::string>& keys,
                                      const GetOptions& options = {});
  std::vector<Result<uint64_t>> MultiPut(const std::vector<PutItem>& items,
                                         const PutOptions& options = {});
  // Batch read into the rows of one caller buffer (host or device memory): row i starts
  // i * row_stride bytes into `dst` and receives the value of keys[i]. One message per node
  // (like MultiGet); no allocation per key. Returns one status per key, in order: OK (row
  // written: exactly row_bytes bytes), NotFound (a miss), InvalidArgument when the value is not
  // exactly row_bytes bytes or options.accept refused it, or the node's failure. A row whose
  // status is not OK is left untouched. Keys whose node failed are retried one by one on their
  // other replicas (replicas > 1); options.fail_open turns node failures into misses.
  // REQUIRES: row_bytes <= row_stride; `dst` holds keys.size() rows.
  std::vector<Status> MultiGetInto(const std::vector<std::string>& keys, void* dst,
                                   size_t row_stride, size_t row_bytes,
                                   const GetOptions& options = {});

  // Async forms: the future becomes ready (or the callback runs, on the client's I/O thread:
  // keep it short) when the operation ends. Callbacks of different operations run in no
  // promised order.
  std::future<Result<Value>> GetAsync(std::string_view key, const GetOptions& options = {});
  void GetAsync(std::string_view key, const GetOptions& options,
                std::function<void(Result<Value>)> callback);
  std::future<Result<uint64_t>> PutAsync(std::string_view key, const void* data, size_t size,
                                         const PutOptions& options = {});
  void PutAsync(std::string_view key, const void* data, size_t size, const PutOptions& options,
                std::function<void(Result<uint64_t>)> callback);

  // The node's id, from the node itself.
  Result<std::string> Ping(int node, std::chrono::milliseconds timeout = {});
  // The node's statistics as JSON (docs/STATS.md).
  Result<std::string> NodeStats(int node, std::chrono::milliseconds timeout = {});
  // What this client's connection to the node runs over now, as UCX reports it ("sysv/memory
  // tcp/lo": shared memory on one host, once wireup completed). Unavailable when not connected
  // (Ping connects).
  Result<std::string> NodeTransports(int node);

  // The cluster as configured (under etcd, `nodes` is empty: see Nodes()).
  const ClusterConfig& cluster() const;
  // Every node this client knows of, by index (what Ping and NodeStats take): a static
  // cluster's nodes in file order; under etcd the members in the order this client learnt of
  // them (an index is never reused; a node that left stays listed).
  std::vector<NodeInfo> Nodes() const;
  // Indices into Nodes() of the members of the ring this client routes by now: a static
  // cluster's every node; under etcd the members that own keys (sorted by id).
  std::vector<int> RingMembers() const;
  // Index into Nodes() of the node that owns `key`; -1 when the ring has no members.
  int NodeFor(std::string_view key) const;
  // The epoch of the ring this client routes by (0 for a static cluster; gkv/membership.h).
  uint64_t RingEpoch() const;

 private:
  struct Impl;
  explicit Client(std::unique_ptr<Impl> impl);
  // *deleted_before: set when a previous owner (keys moving) deleted its copy.
  Status DeleteOnce(std::string_view key, std::chrono::milliseconds timeout, bool* deleted_before);
  Result<ValueInfo> StatOnce(std::string_view key, int node, uint16_t flags,
                             std::chrono::milliseconds timeout);
  std::unique_ptr<Impl> impl_;
};

}  // namespace gkv
