#include "server.h"

#include <httplib.h>

#include <chrono>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>
#include <unordered_map>

#include "gkv/hash.h"
#include "gkv/log.h"
#include "gkv/size.h"
#include "gkv/transport/protocol.h"
#include "gkv/transport/ucx_transport.h"
#include "hot_keys.h"
#include "server_stats.h"
#include "thread_pool.h"

namespace gkv {

namespace w = wire;

namespace {

using Clock = std::chrono::steady_clock;

w::ObjectMeta ToWire(const ObjectInfo& info) {
  return w::ObjectMeta{info.size, info.version, info.tensor, static_cast<uint8_t>(info.tier),
                       info.on_disk};
}

// Compares without an early exit, so timing does not reveal how much of the secret matched.
bool SecretEquals(std::string_view a, std::string_view b) {
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  for (size_t i = 0; i < a.size(); ++i) diff |= a[i] ^ b[i % (b.empty() ? 1 : b.size())];
  return diff == 0 && !b.empty();
}

// One request as it travels between the I/O thread and the executors.
struct Req {
  ConnId conn = 0;
  w::Header h;
  Clock::time_point start;
  Clock::time_point deadline = Clock::time_point::max();  // from the header's budget
  uint64_t charged = 0;   // payload bytes admitted against the in-flight limits
  bool admitted = false;  // counted in its connection's load until its reply is sent
  bool counted = false;   // counted in in_flight (what a graceful stop waits for)
  bool Expired() const { return Clock::now() > deadline; }
};

// A batch payload read into memory that is not zero-filled first (it is overwritten at once).
struct PayloadBuffer {
  explicit PayloadBuffer(size_t n) : bytes(new char[n ? n : 1]), size(n) {}
  std::unique_ptr<char[]> bytes;
  size_t size;
  char* data() { return bytes.get(); }
  std::string_view view() const { return {bytes.get(), size}; }
};

}  // namespace

struct Server::Impl {
  ServerOptions options;
  NodeInfo self;
  std::unique_ptr<TieredCache> cache;
  std::unique_ptr<UcxTransport> transport;
  std::unique_ptr<ThreadPool> executors;
  std::unique_ptr<httplib::Server> metrics_http;
  std::thread metrics_thread;
  int metrics_bound_port = 0;
  std::atomic<bool> stopping{false};
  std::atomic<int64_t> in_flight{0};
  ServerCounters counters;
  std::once_flag stop_once;

  // --- adaptive replication ---
  std::unique_ptr<TieredCache> replica_cache;  // copies held for other primaries (memory only)
  std::unique_ptr<HashRing> ring;
  int self_index = 0;
  HotKeySketch sketch;
  struct ReplicaSet {
    std::vector<int> nodes;  // nodes holding a copy of `version`
    uint64_t version = 0;
    bool pending = true;     // copies being made; no hints until done
    bool cancelled = false;  // written meanwhile: the copies are dropped when they land
  };
  std::unordered_map<std::string, ReplicaSet> registry;  // as primary
  // Keys whose copies a write just invalidated: not copied again until then, so a key that is
  // written often does not churn copies on every write.
  std::unordered_map<std::string, Clock::time_point> copy_again_after;
  std::unordered_map<std::string, uint64_t> replica_version;  // as replica: version held
  // As replica: invalidated up to `version`. A floor only has to outlive the hints and the
  // installs in flight that could name an older version (hints live 1 s on clients, installs
  // are sent with a 500 ms deadline), so floors expire after kFloorLifetime: the table is bounded
  // by the invalidation rate, not by the number of keys ever invalidated.
  struct Floor {
    uint64_t version = 0;
    Clock::time_point set_at;
  };
  static constexpr auto kFloorLifetime = std::chrono::seconds(10);
  std::unordered_map<std::string, Floor> replica_floor;
  Clock::time_point last_floor_prune = Clock::now();
  bool CoveredByFloor(const std::string& key, uint64_t version) const {
    auto fl = replica_floor.find(key);
    return fl != replica_floor.end() && fl->second.version >= version;
  }
  struct PeerCall {
    int node;
    ConnId conn;  // a reply counts only on the connection the call went out on
    Clock::time_point deadline;
    std::function<void(Status, std::string_view body)> done;
  };
  std::vector<ConnId> peer_conn;
  std::unordered_map<ConnId, int> peer_of_conn;
  std::unordered_map<uint64_t, PeerCall> peer_calls;
  uint64_t next_peer_call = 1;
  std::vector<std::pair<Clock::time_point, std::function<void()>>> timers;
  Clock::time_point last_decay = Clock::now();

  bool replication_on() const { return options.hot_reads_per_s > 0; }

  // I/O-thread state.
  std::unordered_map<ConnId, bool> authenticated;
  // Admission control (ServerOptions): what each connection and the node have in flight.
  struct ConnLoad {
    uint32_t requests = 0;
    uint64_t bytes = 0;
    // Replies with a payload, oldest first, each with its send deadline and a done flag; done
    // ones are popped from the front, so a hung peer leaves its oldest one at the front.
    std::deque<std::pair<Clock::time_point, std::shared_ptr<bool>>> sends;
  };
  std::unordered_map<ConnId, ConnLoad> conn_load;
  uint64_t inflight_bytes = 0;
  Clock::time_point last_send_check = Clock::now();
  // Accepted connections whose peer said PEER_HELLO (with the peer secret, where the cluster has
  // one): the only ones allowed REPLICA_PUT and INVALIDATE. Value: the node's index.
  std::unordered_map<ConnId, int> peer_node_of_conn;
  Clock::time_point last_pressure_check = Clock::now();
  uint64_t last_spills = 0, last_drops = 0;

  // --- replies (I/O thread) ---
  void Reply(const Req& r, const Status& status, std::string body, const void* payload, size_t size,
             MemoryKind kind, std::function<void()> after) {
    if (!status.ok()) {
      counters.errors[static_cast<int>(status.code())].fetch_add(1, std::memory_order_relaxed);
      // Every request answered protocol_error counts, whether its header or its body was bad.
      if (status.code() == StatusCode::kProtocolError) {
        counters.protocol_errors.fetch_add(1, std::memory_order_relaxed);
      }
    }
    counters.bytes_out.fetch_add(size, std::memory_order_relaxed);
    std::shared_ptr<bool> sent;
    if (size > 0) {
      sent = std::make_shared<bool>(false);
      conn_load[r.conn].sends.emplace_back(Clock::now() + options.send_timeout, sent);
    }
    transport->Send(
        r.conn, w::kAmReply, w::EncodeMessage({r.h.opcode, 0, r.h.request_id}, body), payload, size,
        kind, [this, r, sent, after = std::move(after)](Status s) {
          if (!s.ok()) GKV_LOG_DEBUG("reply send failed: {}", s.ToString());
          if (after) after();
          Release(r, sent);
          counters.RecordLatency(
              r.h.opcode,
              std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - r.start).count());
          if (r.counted) in_flight.fetch_sub(1, std::memory_order_acq_rel);
        });
  }

  // Admits a request against the in-flight limits, or says Busy. A request that brings `charge`
  // payload bytes is admitted anyway when its connection (or the node) has no bytes in flight,
  // so a single value up to max_value_size always gets through on an idle node.
  Status Admit(Req* r, uint64_t charge) {
    ConnLoad& load = conn_load[r->conn];
    if (load.requests >= options.max_conn_requests) {
      return Status::Busy("connection has " + std::to_string(load.requests) +
                          " requests in flight (limit " +
                          std::to_string(options.max_conn_requests) + ")");
    }
    if (charge > 0 && load.bytes > 0 && load.bytes + charge > options.max_conn_inflight_bytes) {
      return Status::Busy("connection has " + FormatSize(load.bytes) + " of payloads in flight");
    }
    if (charge > 0 && inflight_bytes > 0 && inflight_bytes + charge > options.max_inflight_bytes) {
      return Status::Busy("node has " + FormatSize(inflight_bytes) + " of payloads in flight");
    }
    load.requests++;
    load.bytes += charge;
    inflight_bytes += charge;
    r->charged = charge;
    r->admitted = true;
    return Status::OK();
  }

  // The reply to `r` is sent (or failed): its share of the limits goes back.
  void Release(const Req& r, const std::shared_ptr<bool>& sent) {
    inflight_bytes -= r.charged;
    auto it = conn_load.find(r.conn);
    if (it == conn_load.end()) return;  // the connection is gone
    ConnLoad& load = it->second;
    if (r.admitted) {
      load.requests--;
      load.bytes -= r.charged;
    }
    if (sent) {
      *sent = true;
      while (!load.sends.empty() && *load.sends.front().second) load.sends.pop_front();
    }
  }

  // I/O thread, a few times a second: a connection whose oldest reply payload has not been
  // taken within send_timeout is closed, which completes its sends and releases their pins.
  void CloseStuckConnections(Clock::time_point now) {
    std::vector<ConnId> stuck;
    for (auto& [conn, load] : conn_load) {
      if (!load.sends.empty() && load.sends.front().first < now) stuck.push_back(conn);
    }
    for (ConnId conn : stuck) {
      GKV_LOG_WARN("connection {} has not taken a reply for {} ms; closing it", conn,
                   options.send_timeout.count());
      counters.stuck_connections_closed.fetch_add(1, std::memory_order_relaxed);
      conn_load[conn].sends.clear();
      transport->Close(conn, /*force=*/true);
    }
  }

  // Hands request work to the executors, or answers Busy when their queue is full.
  bool SubmitRequestWork(const Req& r, std::function<void()> work) {
    if (executors->queued() >= options.max_queued_tasks) {
      ReplyStatus(r, Status::Busy("the node's work queue is full"));
      return false;
    }
    executors->Submit(std::move(work));
    return true;
  }

  static Status DeadlinePassed() {
    return Status::Timeout("the request's deadline passed before the node could start it");
  }

  void ReplyStatus(const Req& r, const Status& s) {
    Reply(r, s, w::EncodeStatusReply(s), nullptr, 0, MemoryKind::kHost, nullptr);
  }

  // From an executor thread: hand the reply to the I/O thread.
  void PostReply(std::function<void()> fn) { transport->Post(std::move(fn)); }

  // Reads a batch payload fully into a buffer, then continues on an executor.
  void ReadPayloadThen(const Req& r, std::unique_ptr<Incoming> msg,
                       std::function<void(Status, std::shared_ptr<PayloadBuffer>)> next) {
    if (msg->payload_size() > options.max_batch_bytes) {
      return ReplyStatus(r, Status::NoSpace("batch of " + FormatSize(msg->payload_size()) +
                                            " exceeds the node's limit of " +
                                            FormatSize(options.max_batch_bytes) + "; split it"));
    }
    if (executors->queued() >= options.max_queued_tasks) {
      return ReplyStatus(r, Status::Busy("the node's work queue is full"));
    }
    // Bounded by admission (the payload is charged against the in-flight limits).
    auto buf = std::make_shared<PayloadBuffer>(msg->payload_size());
    transport->Receive(std::move(msg), buf->data(), MemoryKind::kHost,
                       [this, r, buf, next = std::move(next)](Status s) {
                         executors->Submit([r, s, buf, next] {
                           next(r.Expired() ? DeadlinePassed() : s, buf);
                         });
                       });
  }

  // --- dispatch (I/O thread) ---
  void OnMessage(std::unique_ptr<Incoming> msg) {
    if (msg->am_id() == w::kAmReply) return OnPeerReply(std::move(msg));  // our peer calls
    if (msg->am_id() != w::kAmRequest) return;
    Req r;
    r.conn = msg->conn();
    r.start = Clock::now();
    std::string_view body;
    Status s = w::DecodeMessage(msg->header().data(), msg->header().size(), &r.h, &body);
    if (r.conn == 0) {
      counters.protocol_errors.fetch_add(1, std::memory_order_relaxed);
      return;  // the sender gave no reply endpoint: nothing to answer on
    }
    if (!s.ok()) {
      GKV_LOG_DEBUG("malformed request on connection {}: {}", r.conn, s.ToString());
      r.h.opcode = w::Opcode::kPing;
      return ReplyStatus(r, s);
    }
    counters.ops[static_cast<int>(r.h.opcode)].fetch_add(1, std::memory_order_relaxed);
    counters.bytes_in.fetch_add(msg->payload_size(), std::memory_order_relaxed);
    if (r.h.opcode == w::Opcode::kPeerHello) return AuthenticatePeer(r, body);
    if (!options.cluster.secret.empty() && !authenticated[r.conn]) return Authenticate(r, body);
    if (stopping.load(std::memory_order_acquire)) {
      return ReplyStatus(r, Status::Unavailable("node is shutting down"));
    }
    // A graceful stop waits for the requests taken before it began, not for the refusals of
    // the ones that keep arriving meanwhile (under load those never reach zero).
    in_flight.fetch_add(1, std::memory_order_acq_rel);
    r.counted = true;
    if (r.h.budget_ms > 0) r.deadline = r.start + std::chrono::milliseconds(r.h.budget_ms);
    switch (r.h.opcode) {
      case w::Opcode::kPut:
      case w::Opcode::kGet:
      case w::Opcode::kDelete:
      case w::Opcode::kStat:
      case w::Opcode::kMultiGet:
      case w::Opcode::kMultiPut:
      case w::Opcode::kReplicaPut: {
        // Refused here, before anything is reserved or allocated (an unreceived payload is
        // released when `msg` goes).
        Status admitted = Admit(&r, msg->payload_size());
        if (!admitted.ok()) return ReplyStatus(r, admitted);
        break;
      }
      default:
        break;
    }
    switch (r.h.opcode) {
      case w::Opcode::kPing:
        return Reply(r, Status::OK(), w::EncodePingReply(Status::OK(), self.id), nullptr, 0,
                     MemoryKind::kHost, nullptr);
      case w::Opcode::kHello:
        return ReplyStatus(r, Status::OK());
      case w::Opcode::kPut:
        return HandlePut(r, body, std::move(msg));
      case w::Opcode::kGet:
        return HandleGet(r, body);
      case w::Opcode::kDelete:
      case w::Opcode::kStat:
        return HandleKeyOp(r, body);
      case w::Opcode::kMultiGet:
        return HandleMultiGet(r, std::move(msg));
      case w::Opcode::kMultiPut:
        return HandleMultiPut(r, std::move(msg));
      case w::Opcode::kStats:
        return HandleStats(r);
      case w::Opcode::kReplicaPut:
        if (!PeerOnly(r)) return;
        return HandleReplicaPut(r, body, std::move(msg));
      case w::Opcode::kInvalidate:
        if (!PeerOnly(r)) return;
        return HandleInvalidate(r, body);
      case w::Opcode::kPeerHello:
        return;  // handled above
    }
  }

  // Replication messages come from nodes of this cluster that identified themselves, and only
  // while replication is on; anything else is refused (and its payload released unreceived).
  bool PeerOnly(const Req& r) {
    if (peer_node_of_conn.count(r.conn) == 0) {
      ReplyStatus(r, Status::PermissionDenied(
                         "replication messages are accepted from peer nodes only (PEER_HELLO)"));
      return false;
    }
    if (!replication_on()) {
      ReplyStatus(r, Status::NotSupported("replication is off on this node"));
      return false;
    }
    return true;
  }

  void AuthenticatePeer(const Req& r, std::string_view body) {
    std::string node_id, proof;
    Status s = w::DecodePeerHello(body, &node_id, &proof);
    const int node = s.ok() ? options.cluster.FindNode(node_id) : -1;
    const std::string& want = options.cluster.effective_peer_secret();
    if (s.ok() && node >= 0 && node != self_index && (want.empty() || SecretEquals(proof, want))) {
      peer_node_of_conn[r.conn] = node;
      authenticated[r.conn] = true;  // a node of the cluster may also use the client protocol
      return ReplyStatus(r, Status::OK());
    }
    counters.auth_failures.fetch_add(1, std::memory_order_relaxed);
    GKV_LOG_WARN("refused peer connection {}: {}", r.conn,
                 !s.ok()     ? "malformed peer hello"
                 : node < 0  ? "unknown node id"
                 : node == self_index ? "claims this node's own id"
                                      : "wrong peer secret");
    const ConnId conn = r.conn;
    Status denied = Status::PermissionDenied("not a node of this cluster");
    Reply(r, denied, w::EncodeStatusReply(denied), nullptr, 0, MemoryKind::kHost, [this, conn] {
      authenticated.erase(conn);
      transport->Close(conn, /*force=*/false);
    });
  }

  void Authenticate(const Req& r, std::string_view body) {
    std::string secret;
    if (r.h.opcode == w::Opcode::kHello && w::DecodeHello(body, &secret).ok() &&
        SecretEquals(secret, options.cluster.secret)) {
      authenticated[r.conn] = true;
      return ReplyStatus(r, Status::OK());
    }
    counters.auth_failures.fetch_add(1, std::memory_order_relaxed);
    GKV_LOG_WARN("refused connection {}: {}", r.conn,
                 r.h.opcode == w::Opcode::kHello ? "wrong secret" : "no secret presented");
    const ConnId conn = r.conn;
    Reply(r, Status::PermissionDenied("this cluster requires its secret (HELLO) first"),
          w::EncodeStatusReply(Status::PermissionDenied("this cluster requires its secret")),
          nullptr, 0, MemoryKind::kHost, [this, conn] {
            authenticated.erase(conn);
            transport->Close(conn, /*force=*/false);
          });
  }

  struct PutOp {
    Req req;
    w::PutRequest put;
    std::unique_ptr<Incoming> msg;
    WriteHandle handle;
    std::string staging;  // device-tier target without device-capable UCX
  };

  void HandlePut(const Req& r, std::string_view body, std::unique_ptr<Incoming> msg) {
    auto op = std::make_shared<PutOp>();
    op->req = r;
    Status s = w::DecodePutRequest(body, &op->put);
    if (s.ok() && op->put.size != msg->payload_size()) {
      s = Status::ProtocolError("put declares " + std::to_string(op->put.size) +
                                " bytes but carries " + std::to_string(msg->payload_size()));
    }
    if (s.ok()) s = CheckValueSize(op->put.size);
    if (!s.ok()) return ReplyStatus(r, s);  // msg dropped: an unreceived payload is released
    op->msg = std::move(msg);
    // Hot path, all on the I/O thread: free room in a memory tier, receive straight into it,
    // publish. Anything that would evict or touch the disk goes through the executors.
    if (cache->TryReserveInMemory(op->put.key, op->put.size, op->put.tensor, &op->handle) ==
            TieredCache::FastPath::kServed &&
        (op->handle.memory_kind() == MemoryKind::kHost || transport->device_memory_supported())) {
      void* dst = op->handle.data();
      MemoryKind kind = op->handle.memory_kind();
      transport->Receive(std::move(op->msg), dst, kind, [this, op](Status rs) {
        if (!rs.ok()) {
          op->handle = WriteHandle();
          return ReplyStatus(op->req, rs);
        }
        uint64_t version = 0;
        if ((op->req.h.flags & w::kFlagDurable) == 0 &&
            cache->TryCommitInMemory(&op->handle, &version) == TieredCache::FastPath::kServed) {
          return AfterWrite({op->put.key}, [this, op, version] {
            Reply(op->req, Status::OK(), w::EncodePutReply(Status::OK(), version), nullptr, 0,
                  MemoryKind::kHost, nullptr);
          });
        }
        executors->Submit([this, op] { CommitAndReply(op); });
      });
      return;
    }
    SubmitRequestWork(r, [this, op] {
      if (op->req.Expired()) {
        return PostReply([this, op] {
          op->msg.reset();
          ReplyStatus(op->req, DeadlinePassed());
        });
      }
      auto reserved = cache->Reserve(op->put.key, op->put.size, op->put.tensor);
      if (!reserved.ok()) {
        Status err = reserved.status();
        // Dropping the message releases an unreceived rendezvous payload (the sender's send is
        // cancelled); the reply carries the reason.
        return PostReply([this, op, err] {
          op->msg.reset();
          ReplyStatus(op->req, err);
        });
      }
      op->handle = std::move(*reserved);
      PostReply([this, op] {
        void* dst = op->handle.data();
        MemoryKind kind = op->handle.memory_kind();
        if (kind == MemoryKind::kDevice && !transport->device_memory_supported()) {
          op->staging.resize(op->put.size);
          dst = op->staging.data();
          kind = MemoryKind::kHost;
        }
        transport->Receive(std::move(op->msg), dst, kind, [this, op](Status rs) {
          if (!rs.ok()) {
            return executors->Submit([this, op, rs] {
              op->handle = WriteHandle();
              PostReply([this, op, rs] { ReplyStatus(op->req, rs); });
            });
          }
          executors->Submit([this, op] { CommitAndReply(op); });
        });
      });
    });
  }

  Status CheckValueSize(uint64_t size) const {
    if (size <= options.max_value_size) return Status::OK();
    return Status::InvalidArgument("value of " + FormatSize(size) +
                                   " exceeds the node's maximum value size of " +
                                   FormatSize(options.max_value_size));
  }

  // Executor thread: copy from staging if any, commit (write-through when durable), reply.
  void CommitAndReply(const std::shared_ptr<PutOp>& op) {
    Status s;
    // The caller has given up: nothing is published (a durable write is not made durable for a
    // call that reported Timeout).
    if (op->req.Expired()) s = DeadlinePassed();
    if (s.ok() && !op->staging.empty()) {
      s = cache->CopyBytes(op->handle.data(), op->handle.memory_kind(), op->staging.data(),
                           MemoryKind::kHost, op->put.size);
    }
    uint64_t version = 0;
    if (!s.ok()) {
      op->handle = WriteHandle();
    } else {
      auto v = cache->Commit(std::move(op->handle), (op->req.h.flags & w::kFlagDurable) != 0);
      if (v.ok())
        version = *v;
      else
        s = v.status();
    }
    PostReply([this, op, s, version] {
      AfterWrite({op->put.key}, [this, op, s, version] {
        Reply(op->req, s, w::EncodePutReply(s, version), nullptr, 0, MemoryKind::kHost, nullptr);
      });
    });
  }

  // Nodes holding a copy of exactly `version` of `key`, for the GET reply's hint.
  std::vector<uint16_t> HintFor(const std::string& key, uint64_t version) const {
    std::vector<uint16_t> hint;
    auto it = registry.find(key);
    if (it == registry.end() || it->second.pending || it->second.cancelled ||
        it->second.version != version) {
      return hint;
    }
    for (int n : it->second.nodes) hint.push_back(static_cast<uint16_t>(n));
    return hint;
  }

  void SendObject(const Req& r, const std::string& key, std::shared_ptr<ReadHandle> handle,
                  const void* data, MemoryKind kind, std::shared_ptr<std::string> staging) {
    // The handle keeps the entry pinned until UCX is done with its bytes.
    Reply(r, Status::OK(),
          w::EncodeObjectReply(Status::OK(), ToWire(handle->info()),
                               HintFor(key, handle->info().version)),
          data, handle->size(), kind, [handle, staging] {});
  }

  void HandleGet(const Req& r, std::string_view body) {
    if (r.h.flags & w::kFlagReplicaRead) return HandleReplicaGet(r, body);
    std::string key;
    Status s = w::DecodeKeyRequest(body, &key);
    if (!s.ok()) return ReplyStatus(r, s);
    if (replication_on()) CountRead(key);
    // Hot path: an object in host memory (or in GPU memory that UCX can send) is answered right
    // here on the I/O thread; anything that may block goes to an executor.
    {
      ReadHandle fast;
      auto fp = cache->TryAcquireFromMemory(key, &fast);
      if (fp == TieredCache::FastPath::kMiss) {
        Status nf = Status::NotFound("key not found");
        return Reply(r, nf, w::EncodeObjectReply(nf, {}), nullptr, 0, MemoryKind::kHost, nullptr);
      }
      if (fp == TieredCache::FastPath::kServed &&
          (fast.memory_kind() == MemoryKind::kHost || transport->device_memory_supported())) {
        auto handle = std::make_shared<ReadHandle>(std::move(fast));
        return SendObject(r, key, handle, handle->data(), handle->memory_kind(), nullptr);
      }
    }
    SubmitRequestWork(r, [this, r, key = std::move(key)] {
      if (r.Expired()) return PostReply([this, r] { ReplyStatus(r, DeadlinePassed()); });
      auto acquired = cache->Acquire(key);
      if (!acquired.ok()) {
        Status err = acquired.status();
        return PostReply([this, r, err] {
          Reply(r, err, w::EncodeObjectReply(err, {}), nullptr, 0, MemoryKind::kHost, nullptr);
        });
      }
      auto handle = std::make_shared<ReadHandle>(std::move(*acquired));
      std::shared_ptr<std::string> staging;
      const void* data = handle->data();
      MemoryKind kind = handle->memory_kind();
      if (kind == MemoryKind::kDevice && !transport->device_memory_supported()) {
        staging = std::make_shared<std::string>(handle->size(), '\0');
        Status cs =
            cache->CopyBytes(staging->data(), MemoryKind::kHost, data, kind, handle->size());
        if (!cs.ok()) return PostReply([this, r, cs] { ReplyStatus(r, cs); });
        data = staging->data();
        kind = MemoryKind::kHost;
      }
      PostReply([this, r, key, handle, staging, data, kind] {
        SendObject(r, key, handle, data, kind, staging);
      });
    });
  }

  void HandleKeyOp(const Req& r, std::string_view body) {
    std::string key;
    Status s = w::DecodeKeyRequest(body, &key);
    if (!s.ok()) return ReplyStatus(r, s);
    SubmitRequestWork(r, [this, r, key = std::move(key)] {
      if (r.Expired()) return PostReply([this, r] { ReplyStatus(r, DeadlinePassed()); });
      if (r.h.opcode == w::Opcode::kDelete) {
        Status ds = cache->Delete(key);
        return PostReply(
            [this, r, ds, key] { AfterWrite({key}, [this, r, ds] { ReplyStatus(r, ds); }); });
      }
      auto st = cache->Stat(key);
      Status status = st.status();
      w::ObjectMeta meta = st.ok() ? ToWire(*st) : w::ObjectMeta{};
      PostReply([this, r, status, meta] {
        Reply(r, status, w::EncodeObjectReply(status, meta), nullptr, 0, MemoryKind::kHost,
              nullptr);
      });
    });
  }

  void ReplyPayload(const Req& r, std::shared_ptr<std::string> payload) {
    Reply(r, Status::OK(), w::EncodeStatusReply(Status::OK()), payload->data(), payload->size(),
          MemoryKind::kHost, [payload] {});
  }

  void HandleMultiGet(const Req& r, std::unique_ptr<Incoming> msg) {
    ReadPayloadThen(r, std::move(msg), [this, r](Status s, std::shared_ptr<PayloadBuffer> buf) {
      std::vector<std::string> keys;
      if (s.ok()) s = w::DecodeKeyList(buf->view(), &keys);
      if (!s.ok()) return PostReply([this, r, s] { ReplyStatus(r, s); });
      std::vector<w::BatchGetResult> results(keys.size());
      std::vector<ReadHandle> handles;
      handles.reserve(keys.size());
      uint64_t total = 0;
      for (size_t i = 0; i < keys.size(); ++i) {
        auto got = cache->Acquire(keys[i]);
        results[i].code = got.status().code();
        if (!got.ok()) continue;
        if (total + got->size() > options.max_batch_bytes) {
          results[i].code = StatusCode::kNoSpace;  // the reply would be too large: ask again
          continue;
        }
        results[i].meta = ToWire(got->info());
        total += got->size();
        handles.push_back(std::move(*got));
      }
      // One reply: the result block, then every found value in order (gathered here).
      auto payload = std::make_shared<std::string>(w::EncodeBatchGetBlock(results));
      const size_t block = payload->size();
      payload->resize(block + total);
      size_t off = block;
      Status cs;
      for (auto& hd : handles) {
        if (cs.ok()) {
          cs = cache->CopyBytes(payload->data() + off, MemoryKind::kHost, hd.data(),
                                hd.memory_kind(), hd.size());
        }
        off += hd.size();
      }
      handles.clear();
      if (!cs.ok()) return PostReply([this, r, cs] { ReplyStatus(r, cs); });
      PostReply([this, r, payload] { ReplyPayload(r, payload); });
    });
  }

  void HandleMultiPut(const Req& r, std::unique_ptr<Incoming> msg) {
    ReadPayloadThen(r, std::move(msg), [this, r](Status s, std::shared_ptr<PayloadBuffer> buf) {
      std::vector<w::BatchPutItem> items;
      size_t block = 0;
      if (s.ok()) s = w::DecodeBatchPutBlock(buf->view(), &items, &block);
      for (size_t i = 0; s.ok() && i < items.size(); ++i) s = CheckValueSize(items[i].size);
      if (!s.ok()) return PostReply([this, r, s] { ReplyStatus(r, s); });
      std::vector<w::BatchPutResult> results(items.size());
      size_t off = block;
      const bool durable = (r.h.flags & w::kFlagDurable) != 0;
      for (size_t i = 0; i < items.size(); ++i) {
        auto put =
            cache->Put(items[i].key, buf->data() + off, items[i].size, items[i].tensor, durable);
        results[i].code = put.status().code();
        if (put.ok()) results[i].version = *put;
        off += items[i].size;
      }
      auto payload = std::make_shared<std::string>(w::EncodeBatchPutResults(results));
      std::vector<std::string> keys;
      for (auto& it : items) keys.push_back(it.key);
      PostReply([this, r, payload, keys = std::move(keys)] {
        AfterWrite(keys, [this, r, payload] { ReplyPayload(r, payload); });
      });
    });
  }

  void HandleStats(const Req& r) {
    executors->Submit([this, r] {
      auto payload = std::make_shared<std::string>(
          RenderStatsJson(self.id, cache->GetStats(), counters,
                          replica_cache ? replica_cache->GetStats() : CacheStats{}));
      PostReply([this, r, payload] { ReplyPayload(r, payload); });
    });
  }

  // I/O thread, every loop: one log line when the node is under eviction pressure.
  void OnTick() {
    const auto now = Clock::now();
    if (!peer_calls.empty()) ExpirePeerCalls(now);
    if (now - last_send_check >= std::chrono::milliseconds(100)) {
      last_send_check = now;
      CloseStuckConnections(now);
    }
    if (!timers.empty()) RunTimers(now);
    if (replication_on() && now - last_decay >= std::chrono::seconds(1)) {
      last_decay = now;
      sketch.Decay();
      CoolDown();
      PruneFloors(now);
    }
    if (now - last_pressure_check < std::chrono::seconds(10)) return;
    last_pressure_check = now;
    executors->Submit([this] {
      CacheStats st = cache->GetStats();
      uint64_t spills = 0;
      for (int a = 0; a < kTierCount; ++a) {
        for (int b = a + 1; b < kTierCount; ++b) spills += st.moves[a][b];
      }
      const uint64_t new_spills = spills - last_spills, new_drops = st.dropped - last_drops;
      last_spills = spills;
      last_drops = st.dropped;
      if (new_spills > 0 || new_drops > 0) {
        GKV_LOG_INFO(
            "eviction pressure: {} objects spilled to a lower tier and {} dropped in the "
            "last 10 s (host {} of {} used)",
            new_spills, new_drops, FormatSize(st.tiers[1].used_bytes),
            FormatSize(st.tiers[1].capacity));
      }
    });
  }

  // ---------------- adaptive replication (I/O thread unless noted) ----------------

  // Counts a read of a key this node serves as primary; starts copying it when it turns hot.
  void CountRead(const std::string& key) {
    const uint32_t est = sketch.Add(HashKey(key));
    // Decay halves the counts every second: a steady R reads/s settles near 2R.
    if (est < 2 * options.hot_reads_per_s || registry.find(key) != registry.end()) return;
    auto wait = copy_again_after.find(key);
    if (wait != copy_again_after.end()) {
      if (Clock::now() < wait->second) return;
      copy_again_after.erase(wait);
    }
    StartReplication(key);
  }

  std::vector<int> ReplicaTargets(const std::string& key) const {
    std::vector<int> out;
    for (int n : ring->NodesFor(key, options.hot_replicas + 1)) {
      if (n != self_index && static_cast<int>(out.size()) < options.hot_replicas) out.push_back(n);
    }
    return out;
  }

  void StartReplication(const std::string& key) {
    std::vector<int> targets = ReplicaTargets(key);
    if (targets.empty()) return;
    registry[key] = ReplicaSet{};
    executors->Submit([this, key, targets] {
      auto got = cache->Acquire(key);
      if (!got.ok()) {
        return PostReply([this, key] { registry.erase(key); });
      }
      auto bytes = std::make_shared<std::string>(got->size(), '\0');
      Status cs = cache->CopyBytes(bytes->data(), MemoryKind::kHost, got->data(),
                                   got->memory_kind(), got->size());
      const ObjectInfo info = got->info();
      *got = ReadHandle();
      PostReply([this, key, targets, bytes, info, cs] {
        if (!cs.ok()) {
          registry.erase(key);
          return;
        }
        auto results = std::make_shared<std::vector<int>>();
        auto remaining = std::make_shared<size_t>(targets.size());
        for (int node : targets) {
          std::string body = w::EncodeReplicaPut({key, info.tensor, info.size}, info.version);
          CallPeer(node, w::Opcode::kReplicaPut, std::move(body), bytes,
                   [this, key, node, info, results, remaining, bytes](Status s, std::string_view) {
                     if (s.ok()) results->push_back(node);
                     if (--*remaining == 0) ReplicationDone(key, info.version, *results);
                   });
        }
      });
    });
  }

  void ReplicationDone(const std::string& key, uint64_t version, const std::vector<int>& nodes) {
    auto it = registry.find(key);
    if (it == registry.end()) return;
    if (it->second.cancelled || nodes.empty()) {
      // Written while the copies were made: they are of an old version and never hinted;
      // drop them anyway so they do not take replica room.
      for (int n : nodes)
        CallPeer(n, w::Opcode::kInvalidate, w::EncodeInvalidate(key, version), nullptr,
                 [](Status, std::string_view) {});
      registry.erase(it);
      return;
    }
    it->second.pending = false;
    it->second.nodes = nodes;
    it->second.version = version;
    counters.replicas_created.fetch_add(nodes.size(), std::memory_order_relaxed);
    std::string list;
    for (int n : nodes) list += (list.empty() ? "" : ",") + options.cluster.nodes[n].id;
    GKV_LOG_INFO("replicating hot key '{}' (version {}) to {}", key, version, list);
  }

  // Before a write or delete of `keys` is acknowledged: every copy of an older version becomes
  // unreadable. Runs `reply` when that holds (at once for keys that are not replicated).
  void AfterWrite(const std::vector<std::string>& keys, std::function<void()> reply) {
    if (registry.empty()) return reply();
    auto remaining = std::make_shared<size_t>(1);
    auto any_failed = std::make_shared<bool>(false);
    auto finish = [this, remaining, any_failed, reply] {
      if (--*remaining > 0) return;
      if (!*any_failed) return reply();
      // A replica node that did not confirm may still serve clients holding a hint; hints live
      // kHintTtl on the client, so wait that out (plus a deadline's margin) before acknowledging.
      timers.push_back({Clock::now() + std::chrono::milliseconds(1500), reply});
    };
    for (const std::string& key : keys) {
      auto it = registry.find(key);
      if (it == registry.end()) continue;
      copy_again_after[key] = Clock::now() + std::chrono::seconds(2);
      if (it->second.pending) {
        it->second.cancelled = true;
        continue;
      }
      const ReplicaSet set = it->second;
      registry.erase(it);
      counters.replicas_dropped.fetch_add(set.nodes.size(), std::memory_order_relaxed);
      for (int n : set.nodes) {
        ++*remaining;
        CallPeer(n, w::Opcode::kInvalidate, w::EncodeInvalidate(key, set.version), nullptr,
                 [finish, any_failed](Status s, std::string_view) {
                   if (!s.ok()) *any_failed = true;
                   finish();
                 });
      }
    }
    finish();
  }

  // Once a second, after the decay: copies of keys that cooled down are dropped.
  void CoolDown() {
    const double cool =
        options.cool_reads_per_s > 0 ? options.cool_reads_per_s : options.hot_reads_per_s / 4;
    const auto now = Clock::now();
    for (auto it = copy_again_after.begin(); it != copy_again_after.end();) {
      it = it->second <= now ? copy_again_after.erase(it) : std::next(it);
    }
    std::vector<std::string> cold;
    for (auto& [key, set] : registry) {
      if (!set.pending && sketch.Estimate(HashKey(key)) < 2 * cool) cold.push_back(key);
    }
    for (const std::string& key : cold) {
      ReplicaSet set = registry[key];
      registry.erase(key);
      counters.replicas_dropped.fetch_add(set.nodes.size(), std::memory_order_relaxed);
      GKV_LOG_INFO("dropping the copies of cooled key '{}' (version {})", key, set.version);
      for (int n : set.nodes) {
        CallPeer(n, w::Opcode::kInvalidate, w::EncodeInvalidate(key, set.version), nullptr,
                 [](Status, std::string_view) {});
      }
    }
  }

  void PruneFloors(Clock::time_point now) {
    for (auto it = replica_floor.begin(); it != replica_floor.end();) {
      it = now - it->second.set_at > kFloorLifetime ? replica_floor.erase(it) : std::next(it);
    }
  }

  static std::string ReplicaKey(const std::string& key, uint64_t version) {
    std::string k = key;
    k.push_back('\0');
    k.append(reinterpret_cast<const char*>(&version), sizeof version);
    return k;
  }

  // As a replica node: install a copy (unless a newer invalidation already covers it).
  void HandleReplicaPut(const Req& r, std::string_view body, std::unique_ptr<Incoming> msg) {
    w::PutRequest put;
    uint64_t version = 0;
    Status s = w::DecodeReplicaPut(body, &put, &version);
    if (s.ok() && put.size != msg->payload_size())
      s = Status::ProtocolError("replica size mismatch");
    if (s.ok() && !replica_cache) s = Status::NotSupported("replication is off on this node");
    if (s.ok()) s = CheckValueSize(put.size);
    // Within the replica budget: a copy larger than the largest replica tier can never fit.
    if (s.ok() && put.size > replica_cache->max_object_size()) {
      s = Status::NoSpace("replica of " + FormatSize(put.size) + " exceeds the replica budget");
    }
    if (!s.ok()) return ReplyStatus(r, s);
    auto buf = std::make_shared<std::string>(put.size, '\0');
    transport->Receive(
        std::move(msg), buf->data(), MemoryKind::kHost, [this, r, put, version, buf](Status rs) {
          if (!rs.ok()) return ReplyStatus(r, rs);
          if (CoveredByFloor(put.key, version)) {
            return ReplyStatus(r, Status::OK());  // already invalidated
          }
          executors->Submit([this, r, put, version, buf] {
            auto p =
                replica_cache->Put(ReplicaKey(put.key, version), buf->data(), put.size, put.tensor);
            Status ps = p.status();
            PostReply([this, r, put, version, ps] {
              if (ps.ok()) InstallReplica(put.key, version);
              ReplyStatus(r, ps);
            });
          });
        });
  }

  void InstallReplica(const std::string& key, uint64_t version) {
    const bool covered = CoveredByFloor(key, version);
    uint64_t& current = replica_version[key];
    if (covered || current > version) {
      DropReplicaCopy(key, version);  // landed after its invalidation, or older than what we hold
      return;
    }
    if (current != 0 && current != version) DropReplicaCopy(key, current);
    current = version;
    counters.replica_installs.fetch_add(1, std::memory_order_relaxed);
  }

  void DropReplicaCopy(const std::string& key, uint64_t version) {
    executors->Submit([this, rk = ReplicaKey(key, version)] { (void)replica_cache->Delete(rk); });
  }

  void HandleInvalidate(const Req& r, std::string_view body) {
    std::string key;
    uint64_t version = 0;
    Status s = w::DecodeInvalidate(body, &key, &version);
    if (!s.ok()) return ReplyStatus(r, s);
    Floor& floor = replica_floor[key];
    floor.version = std::max(floor.version, version);
    floor.set_at = Clock::now();
    auto it = replica_version.find(key);
    if (it != replica_version.end() && it->second <= floor.version) {
      if (replica_cache) DropReplicaCopy(key, it->second);
      replica_version.erase(it);
    }
    ReplyStatus(r, Status::OK());
  }

  // As a replica node: serve a copy only for the exact version the client's hint named, and
  // never one an invalidation has covered.
  void HandleReplicaGet(const Req& r, std::string_view body) {
    std::string key;
    uint64_t version = 0;
    Status s = w::DecodeReplicaGet(body, &key, &version);
    if (!s.ok()) return ReplyStatus(r, s);
    Status miss = Status::NotFound("no replica of that version here");
    auto it = replica_version.find(key);
    ReadHandle h;
    if (!replica_cache || it == replica_version.end() || it->second != version ||
        CoveredByFloor(key, version) ||
        replica_cache->TryAcquireFromMemory(ReplicaKey(key, version), &h) !=
            TieredCache::FastPath::kServed ||
        (h.memory_kind() == MemoryKind::kDevice && !transport->device_memory_supported())) {
      return Reply(r, miss, w::EncodeObjectReply(miss, {}), nullptr, 0, MemoryKind::kHost, nullptr);
    }
    counters.replica_reads.fetch_add(1, std::memory_order_relaxed);
    auto handle = std::make_shared<ReadHandle>(std::move(h));
    w::ObjectMeta meta = ToWire(handle->info());
    meta.version = version;  // the primary's version, not this cache's own counter
    Reply(r, Status::OK(), w::EncodeObjectReply(Status::OK(), meta), handle->data(), handle->size(),
          handle->memory_kind(), [handle] {});
  }

  // --- requests to peer nodes ---
  Result<ConnId> PeerConn(int node) {
    if (peer_conn[node] != 0 && transport->IsOpen(peer_conn[node])) return peer_conn[node];
    const NodeInfo& n = options.cluster.nodes[node];
    GKV_ASSIGN_OR_RETURN(ConnId conn, transport->Connect(n.host, n.port));
    peer_conn[node] = conn;
    peer_of_conn[conn] = node;
    // First on the endpoint (ordered before every call): who this node is. Its reply (id 0)
    // matches no call and is dropped; a refusal closes the connection, failing the calls.
    transport->Send(conn, w::kAmRequest,
                    w::EncodeMessage({w::Opcode::kPeerHello, 0, 0},
                                     w::EncodePeerHello(self.id,
                                                        options.cluster.effective_peer_secret())),
                    nullptr, 0, MemoryKind::kHost, [](Status) {});
    return conn;
  }

  void CallPeer(int node, w::Opcode op, std::string body, std::shared_ptr<std::string> payload,
                std::function<void(Status, std::string_view)> done) {
    auto conn = PeerConn(node);
    if (!conn.ok()) return done(conn.status(), {});
    const uint64_t id = next_peer_call++;
    peer_calls[id] = PeerCall{node, *conn, Clock::now() + std::chrono::milliseconds(500), done};
    transport->Send(*conn, w::kAmRequest, w::EncodeMessage({op, 0, id}, body),
                    payload ? payload->data() : nullptr, payload ? payload->size() : 0,
                    MemoryKind::kHost, [this, id, payload](Status s) {
                      if (s.ok() || s.code() == StatusCode::kAborted) return;
                      auto it = peer_calls.find(id);
                      if (it == peer_calls.end()) return;
                      auto cb = std::move(it->second.done);
                      peer_calls.erase(it);
                      cb(s, {});
                    });
  }

  void OnPeerReply(std::unique_ptr<Incoming> msg) {
    w::Header h;
    std::string_view body;
    if (!w::DecodeMessage(msg->header().data(), msg->header().size(), &h, &body).ok()) return;
    // Only on a connection this node opened to a peer, and only for a call made on it: a client
    // (or any other connection) can never answer a pending INVALIDATE or REPLICA_PUT.
    if (peer_of_conn.count(msg->conn()) == 0) return;
    auto it = peer_calls.find(h.request_id);
    if (it == peer_calls.end() || it->second.conn != msg->conn()) return;
    auto cb = std::move(it->second.done);
    peer_calls.erase(it);
    w::ReplyStatus rs;
    Status s = w::DecodeStatusReply(body, &rs);
    cb(s.ok() ? rs.ToStatus() : s, body);
  }

  void ExpirePeerCalls(Clock::time_point now) {
    std::vector<uint64_t> expired;
    for (auto& [id, call] : peer_calls) {
      if (call.deadline <= now) expired.push_back(id);
    }
    for (uint64_t id : expired) {
      auto cb = std::move(peer_calls[id].done);
      peer_calls.erase(id);
      cb(Status::Timeout("peer did not answer"), {});
    }
  }

  void RunTimers(Clock::time_point now) {
    std::vector<std::function<void()>> due;
    for (auto it = timers.begin(); it != timers.end();) {
      if (it->first <= now) {
        due.push_back(std::move(it->second));
        it = timers.erase(it);
      } else {
        ++it;
      }
    }
    for (auto& fn : due) fn();
  }

  void OnPeerDisconnect(ConnId conn) {
    auto it = peer_of_conn.find(conn);
    if (it == peer_of_conn.end()) return;
    const int node = it->second;
    peer_of_conn.erase(it);
    if (peer_conn[node] == conn) peer_conn[node] = 0;
    std::vector<uint64_t> failed;
    for (auto& [id, call] : peer_calls) {
      if (call.node == node) failed.push_back(id);
    }
    for (uint64_t id : failed) {
      auto cb = std::move(peer_calls[id].done);
      peer_calls.erase(id);
      cb(Status::Unavailable("peer connection lost"), {});
    }
  }

  Status StartMetrics() {
    metrics_http = std::make_unique<httplib::Server>();
    metrics_http->Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
      res.set_content(RenderPrometheus(self.id, cache->GetStats(), counters,
                                       replica_cache ? replica_cache->GetStats() : CacheStats{}),
                      "text/plain; version=0.0.4");
    });
    metrics_bound_port = options.metrics_port;
    if (!metrics_http->bind_to_port("0.0.0.0", options.metrics_port)) {
      return Status::Unavailable("cannot listen for metrics on port " +
                                 std::to_string(options.metrics_port));
    }
    metrics_thread = std::thread([this] { metrics_http->listen_after_bind(); });
    return Status::OK();
  }
};

Server::Server(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Server::~Server() { Stop(); }

Result<std::unique_ptr<Server>> Server::Start(const ServerOptions& options) {
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  int idx = options.cluster.FindNode(options.node_id);
  if (idx < 0) {
    return Status::InvalidArgument("node '" + options.node_id + "' is not in the cluster file");
  }
  impl->self = options.cluster.nodes[idx];
  impl->self_index = idx;
  impl->ring = std::make_unique<HashRing>(options.cluster.nodes);
  impl->peer_conn.assign(options.cluster.nodes.size(), 0);
  CacheOptions own = options.cache;
  if (options.hot_reads_per_s > 0) {
    if (options.replica_share <= 0 || options.replica_share >= 1 || options.hot_replicas < 1) {
      return Status::InvalidArgument("replica share must be in (0, 1) and hot replicas >= 1");
    }
    // Copies held for other primaries get their own share of each memory tier and no disk.
    CacheOptions rep = options.cache;
    rep.gpu_capacity = static_cast<uint64_t>(options.cache.gpu_capacity * options.replica_share);
    rep.host_capacity = static_cast<uint64_t>(options.cache.host_capacity * options.replica_share);
    rep.disk_path.clear();
    rep.disk_capacity = 0;
    rep.max_key_size = options.cache.max_key_size + 9;  // key, a zero byte, the version
    own.gpu_capacity -= rep.gpu_capacity;
    own.host_capacity -= rep.host_capacity;
    auto rc = TieredCache::Open(rep);
    if (!rc.ok()) return rc.status().WithContext("opening the replica cache");
    impl->replica_cache = std::move(*rc);
  }
  auto cache = TieredCache::Open(own);
  if (!cache.ok()) return cache.status().WithContext("opening the cache");
  impl->cache = std::move(*cache);
  impl->executors = std::make_unique<ThreadPool>(std::max(1, options.executor_threads));

  UcxTransport::Options topts;
  topts.listen = true;
  topts.listen_host = options.listen_host.empty() ? impl->self.host : options.listen_host;
  topts.listen_port = options.listen_port ? options.listen_port : impl->self.port;
  Impl* raw = impl.get();
  UcxTransport::Handlers handlers;
  handlers.on_message = [raw](std::unique_ptr<Incoming> m) { raw->OnMessage(std::move(m)); };
  handlers.on_accept = [raw](ConnId) {
    raw->counters.connections_accepted.fetch_add(1, std::memory_order_relaxed);
  };
  handlers.on_disconnect = [raw](ConnId id, const Status& s) {
    raw->authenticated.erase(id);
    raw->peer_node_of_conn.erase(id);
    raw->conn_load.erase(id);
    raw->OnPeerDisconnect(id);
    GKV_LOG_DEBUG("client connection {} closed: {}", id, s.ToString());
  };
  handlers.on_tick = [raw] { raw->OnTick(); };
  auto transport = UcxTransport::Create(topts, std::move(handlers));
  if (!transport.ok()) return transport.status();
  impl->transport = std::move(*transport);
  if (options.metrics_port) GKV_RETURN_IF_ERROR(impl->StartMetrics());
  const Impl& I = *impl;
  auto tier = [&](Tier t) {
    return I.cache->tier_enabled(t) ? FormatSize(I.cache->tier_capacity(t)) : std::string("off");
  };
  GKV_LOG_INFO("node {} up on {}:{} (gpu {}, host {}, disk {}; {}){}", I.self.id, topts.listen_host,
               I.transport->listen_port(), tier(Tier::kGpu), tier(Tier::kHost), tier(Tier::kDisk),
               I.transport->Describe(),
               options.cluster.secret.empty() ? "" : "; clients must present the cluster secret");
  return std::unique_ptr<Server>(new Server(std::move(impl)));
}

void Server::Stop() {
  Impl* I = impl_.get();
  std::call_once(I->stop_once, [I] {
    I->stopping.store(true, std::memory_order_release);
    // Let what is in flight finish (bounded: a stuck peer must not block shutdown forever).
    auto deadline = Clock::now() + std::chrono::seconds(10);
    while (I->in_flight.load(std::memory_order_acquire) > 0 && Clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    if (I->metrics_http) {
      I->metrics_http->stop();
      if (I->metrics_thread.joinable()) I->metrics_thread.join();
    }
    // Phases, so that no callback ever reaches something already gone: (1) intake stopped
    // above (new requests get Unavailable); (2) the listener and every endpoint close while the
    // executors still run, since completions that arrive meanwhile hand work to them; (3) the
    // executors finish what is queued (replies they post now are dropped: the connections are
    // gone); (4) the worker and context go; (5) memory is written back to the disk tier.
    I->transport->Stop();
    I->executors.reset();
    I->transport.reset();
    Status fs = I->cache->Flush();
    if (!fs.ok()) GKV_LOG_ERROR("flush at shutdown failed: {}", fs.ToString());
    GKV_LOG_INFO("node {} stopped", I->self.id);
  });
}

uint16_t Server::port() const { return impl_->transport ? impl_->transport->listen_port() : 0; }
uint16_t Server::metrics_port() const { return static_cast<uint16_t>(impl_->metrics_bound_port); }

TieredCache& Server::cache() { return *impl_->cache; }

}  // namespace gkv
