#include "server.h"

#include <chrono>
#include <cstring>
#include <mutex>
#include <thread>

#include "gkv/log.h"
#include "gkv/size.h"
#include "gkv/transport/protocol.h"
#include "gkv/transport/ucx_transport.h"
#include "thread_pool.h"

namespace gkv {

namespace w = wire;

namespace {

w::ObjectMeta ToWire(const ObjectInfo& info) {
  return w::ObjectMeta{info.size, info.version, info.tensor, static_cast<uint8_t>(info.tier),
                       info.on_disk};
}

// Operation counters for the stats reply. Relaxed atomics: monotonic counts, no ordering needed.
struct OpCounters {
  std::atomic<uint64_t> ops[16] = {};
  std::atomic<uint64_t> errors[16] = {};  // by StatusCode
  std::atomic<uint64_t> bytes_in{0}, bytes_out{0};
  std::atomic<uint64_t> protocol_errors{0};
};

}  // namespace

struct Server::Impl {
  ServerOptions options;
  NodeInfo self;
  std::unique_ptr<TieredCache> cache;
  std::unique_ptr<UcxTransport> transport;
  std::unique_ptr<ThreadPool> executors;
  std::atomic<bool> stopping{false};
  std::atomic<int64_t> in_flight{0};
  OpCounters counters;
  std::once_flag stop_once;

  // --- replies (worker thread) ---
  void Reply(ConnId conn, w::Opcode op, uint64_t id, const Status& status, std::string body,
             const void* payload, size_t size, MemoryKind kind, std::function<void()> after) {
    if (!status.ok()) counters.errors[static_cast<int>(status.code())].fetch_add(1, std::memory_order_relaxed);
    counters.bytes_out.fetch_add(size, std::memory_order_relaxed);
    w::Header h{op, 0, id};
    transport->Send(conn, w::kAmReply, w::EncodeMessage(h, body), payload, size, kind,
                    [this, after = std::move(after)](Status s) {
                      if (!s.ok()) GKV_LOG_DEBUG("reply send failed: {}", s.ToString());
                      if (after) after();
                      in_flight.fetch_sub(1, std::memory_order_acq_rel);
                    });
  }

  void ReplyStatus(ConnId conn, w::Opcode op, uint64_t id, const Status& s) {
    Reply(conn, op, id, s, w::EncodeStatusReply(s), nullptr, 0, MemoryKind::kHost, nullptr);
  }

  // From an executor thread: hand the reply to the worker thread.
  void PostReply(std::function<void()> fn) { transport->Post(std::move(fn)); }

  // Reads a (small, metadata) payload fully into a string, then continues on an executor.
  void ReadPayloadThen(std::unique_ptr<Incoming> msg,
                       std::function<void(Status, std::shared_ptr<std::string>)> next) {
    auto buf = std::make_shared<std::string>(msg->payload_size(), '\0');
    transport->Receive(std::move(msg), buf->data(), MemoryKind::kHost,
                       [this, buf, next = std::move(next)](Status s) {
                         executors->Submit([s, buf, next] { next(s, buf); });
                       });
  }

  // --- dispatch (worker thread) ---
  void OnMessage(std::unique_ptr<Incoming> msg) {
    if (msg->am_id() != w::kAmRequest) return;  // a server never expects replies
    w::Header h;
    std::string_view body;
    Status s = w::DecodeMessage(msg->header().data(), msg->header().size(), &h, &body);
    const ConnId conn = msg->conn();
    if (conn == 0) {
      counters.protocol_errors.fetch_add(1, std::memory_order_relaxed);
      return;  // the sender gave no reply endpoint: nothing to answer on
    }
    in_flight.fetch_add(1, std::memory_order_acq_rel);
    if (!s.ok()) {
      counters.protocol_errors.fetch_add(1, std::memory_order_relaxed);
      GKV_LOG_DEBUG("malformed request: {}", s.ToString());
      ReplyStatus(conn, w::Opcode::kPing, h.request_id, s);
      return;
    }
    counters.ops[static_cast<int>(h.opcode)].fetch_add(1, std::memory_order_relaxed);
    counters.bytes_in.fetch_add(msg->payload_size(), std::memory_order_relaxed);
    if (stopping.load(std::memory_order_acquire)) {
      ReplyStatus(conn, h.opcode, h.request_id, Status::Unavailable("node is shutting down"));
      return;
    }
    switch (h.opcode) {
      case w::Opcode::kPing:
        Reply(conn, h.opcode, h.request_id, Status::OK(), w::EncodePingReply(Status::OK(), self.id),
              nullptr, 0, MemoryKind::kHost, nullptr);
        return;
      case w::Opcode::kHello:
        ReplyStatus(conn, h.opcode, h.request_id, Status::OK());
        return;
      case w::Opcode::kPut: return HandlePut(conn, h, body, std::move(msg));
      case w::Opcode::kGet: return HandleGet(conn, h, body);
      case w::Opcode::kDelete:
      case w::Opcode::kStat: return HandleKeyOp(conn, h, body);
      case w::Opcode::kMultiGet: return HandleMultiGet(conn, h, std::move(msg));
      case w::Opcode::kMultiPut: return HandleMultiPut(conn, h, std::move(msg));
      case w::Opcode::kStats: return HandleStats(conn, h);
    }
  }

  struct PutOp {
    ConnId conn;
    w::Header header;
    w::PutRequest req;
    std::unique_ptr<Incoming> msg;
    WriteHandle handle;
    std::string staging;  // device-tier target without device-capable UCX
  };

  void HandlePut(ConnId conn, const w::Header& h, std::string_view body,
                 std::unique_ptr<Incoming> msg) {
    auto op = std::make_shared<PutOp>();
    op->conn = conn;
    op->header = h;
    Status s = w::DecodePutRequest(body, &op->req);
    if (s.ok() && op->req.size != msg->payload_size()) {
      s = Status::ProtocolError("put declares " + std::to_string(op->req.size) +
                                " bytes but carries " + std::to_string(msg->payload_size()));
    }
    if (!s.ok()) return ReplyStatus(conn, h.opcode, h.request_id, s);  // msg dropped: released
    op->msg = std::move(msg);
    // Hot path, all on the I/O thread: free room in a memory tier, receive straight into it,
    // publish. Anything that would evict or touch the disk goes through the executors.
    if (cache->TryReserveInMemory(op->req.key, op->req.size, op->req.tensor, &op->handle) ==
            TieredCache::FastPath::kServed &&
        (op->handle.memory_kind() == MemoryKind::kHost || transport->device_memory_supported())) {
      void* dst = op->handle.data();
      MemoryKind kind = op->handle.memory_kind();
      transport->Receive(std::move(op->msg), dst, kind, [this, op](Status rs) {
        if (!rs.ok()) {
          op->handle = WriteHandle();
          return ReplyStatus(op->conn, op->header.opcode, op->header.request_id, rs);
        }
        uint64_t version = 0;
        if ((op->header.flags & w::kFlagDurable) == 0 &&
            cache->TryCommitInMemory(&op->handle, &version) == TieredCache::FastPath::kServed) {
          return Reply(op->conn, op->header.opcode, op->header.request_id, Status::OK(),
                       w::EncodePutReply(Status::OK(), version), nullptr, 0, MemoryKind::kHost,
                       nullptr);
        }
        executors->Submit([this, op] { CommitAndReply(op); });
      });
      return;
    }
    executors->Submit([this, op] {
      auto r = cache->Reserve(op->req.key, op->req.size, op->req.tensor);
      if (!r.ok()) {
        Status err = r.status();
        // Dropping the message releases an unreceived rendezvous payload (the sender's send is
        // cancelled); the reply carries the reason.
        return PostReply([this, op, err] {
          op->msg.reset();
          ReplyStatus(op->conn, op->header.opcode, op->header.request_id, err);
        });
      }
      op->handle = std::move(*r);
      PostReply([this, op] {
        void* dst = op->handle.data();
        MemoryKind kind = op->handle.memory_kind();
        if (kind == MemoryKind::kDevice && !transport->device_memory_supported()) {
          op->staging.resize(op->req.size);
          dst = op->staging.data();
          kind = MemoryKind::kHost;
        }
        transport->Receive(std::move(op->msg), dst, kind, [this, op](Status rs) {
          if (!rs.ok()) {
            return executors->Submit([this, op, rs] {
              op->handle = WriteHandle();
              PostReply([this, op, rs] {
                ReplyStatus(op->conn, op->header.opcode, op->header.request_id, rs);
              });
            });
          }
          executors->Submit([this, op] { CommitAndReply(op); });
        });
      });
    });
  }

  // Executor thread: copy from staging if any, commit (write-through when durable), reply.
  void CommitAndReply(const std::shared_ptr<PutOp>& op) {
    Status s;
    if (!op->staging.empty()) {
      s = cache->CopyBytes(op->handle.data(), op->handle.memory_kind(), op->staging.data(),
                           MemoryKind::kHost, op->req.size);
    }
    uint64_t version = 0;
    if (s.ok()) {
      auto v = cache->Commit(std::move(op->handle), (op->header.flags & w::kFlagDurable) != 0);
      if (v.ok()) version = *v;
      else s = v.status();
    }
    PostReply([this, op, s, version] {
      Reply(op->conn, op->header.opcode, op->header.request_id, s, w::EncodePutReply(s, version),
            nullptr, 0, MemoryKind::kHost, nullptr);
    });
  }

  void HandleGet(ConnId conn, const w::Header& h, std::string_view body) {
    std::string key;
    Status s = w::DecodeKeyRequest(body, &key);
    if (!s.ok()) return ReplyStatus(conn, h.opcode, h.request_id, s);
    // Hot path: an object in host memory (or in GPU memory that UCX can send) is answered right
    // here on the I/O thread; anything that may block goes to an executor.
    {
      ReadHandle fast;
      auto fp = cache->TryAcquireFromMemory(key, &fast);
      if (fp == TieredCache::FastPath::kMiss) {
        Status nf = Status::NotFound("key not found");
        return Reply(conn, h.opcode, h.request_id, nf, w::EncodeObjectReply(nf, {}), nullptr, 0,
                     MemoryKind::kHost, nullptr);
      }
      if (fp == TieredCache::FastPath::kServed &&
          (fast.memory_kind() == MemoryKind::kHost || transport->device_memory_supported())) {
        auto handle = std::make_shared<ReadHandle>(std::move(fast));
        return Reply(conn, h.opcode, h.request_id, Status::OK(),
                     w::EncodeObjectReply(Status::OK(), ToWire(handle->info())), handle->data(),
                     handle->size(), handle->memory_kind(), [handle] {});
      }
    }
    executors->Submit([this, conn, h, key = std::move(key)] {
      auto r = cache->Acquire(key);
      if (!r.ok()) {
        Status err = r.status();
        return PostReply([this, conn, h, err] {
          Reply(conn, h.opcode, h.request_id, err, w::EncodeObjectReply(err, {}), nullptr, 0,
                MemoryKind::kHost, nullptr);
        });
      }
      // The handle keeps the entry pinned until the send completes.
      auto handle = std::make_shared<ReadHandle>(std::move(*r));
      auto staging = std::make_shared<std::string>();
      const void* data = handle->data();
      MemoryKind kind = handle->memory_kind();
      if (kind == MemoryKind::kDevice && !transport->device_memory_supported()) {
        staging->resize(handle->size());
        Status cs = cache->CopyBytes(staging->data(), MemoryKind::kHost, data, kind, handle->size());
        if (!cs.ok()) {
          return PostReply([this, conn, h, cs] { ReplyStatus(conn, h.opcode, h.request_id, cs); });
        }
        data = staging->data();
        kind = MemoryKind::kHost;
      }
      PostReply([this, conn, h, handle, staging, data, kind] {
        Reply(conn, h.opcode, h.request_id, Status::OK(),
              w::EncodeObjectReply(Status::OK(), ToWire(handle->info())), data, handle->size(),
              kind, [handle, staging] {});
      });
    });
  }

  void HandleKeyOp(ConnId conn, const w::Header& h, std::string_view body) {
    std::string key;
    Status s = w::DecodeKeyRequest(body, &key);
    if (!s.ok()) return ReplyStatus(conn, h.opcode, h.request_id, s);
    executors->Submit([this, conn, h, key = std::move(key)] {
      if (h.opcode == w::Opcode::kDelete) {
        Status ds = cache->Delete(key);
        return PostReply([this, conn, h, ds] { ReplyStatus(conn, h.opcode, h.request_id, ds); });
      }
      auto r = cache->Stat(key);
      Status st = r.status();
      w::ObjectMeta meta = r.ok() ? ToWire(*r) : w::ObjectMeta{};
      PostReply([this, conn, h, st, meta] {
        Reply(conn, h.opcode, h.request_id, st, w::EncodeObjectReply(st, meta), nullptr, 0,
              MemoryKind::kHost, nullptr);
      });
    });
  }

  void HandleMultiGet(ConnId conn, const w::Header& h, std::unique_ptr<Incoming> msg) {
    ReadPayloadThen(std::move(msg), [this, conn, h](Status s, std::shared_ptr<std::string> buf) {
      std::vector<std::string> keys;
      if (s.ok()) s = w::DecodeKeyList(*buf, &keys);
      if (!s.ok()) {
        return PostReply([this, conn, h, s] { ReplyStatus(conn, h.opcode, h.request_id, s); });
      }
      std::vector<w::BatchGetResult> results(keys.size());
      std::vector<ReadHandle> handles;
      handles.reserve(keys.size());
      uint64_t total = 0;
      for (size_t i = 0; i < keys.size(); ++i) {
        auto r = cache->Acquire(keys[i]);
        results[i].code = r.status().code();
        if (r.ok()) {
          results[i].meta = ToWire(r->info());
          total += r->size();
          handles.push_back(std::move(*r));
        }
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
      if (!cs.ok()) {
        return PostReply([this, conn, h, cs] { ReplyStatus(conn, h.opcode, h.request_id, cs); });
      }
      PostReply([this, conn, h, payload] {
        Reply(conn, h.opcode, h.request_id, Status::OK(), w::EncodeStatusReply(Status::OK()),
              payload->data(), payload->size(), MemoryKind::kHost, [payload] {});
      });
    });
  }

  void HandleMultiPut(ConnId conn, const w::Header& h, std::unique_ptr<Incoming> msg) {
    ReadPayloadThen(std::move(msg), [this, conn, h](Status s, std::shared_ptr<std::string> buf) {
      std::vector<w::BatchPutItem> items;
      size_t block = 0;
      if (s.ok()) s = w::DecodeBatchPutBlock(*buf, &items, &block);
      if (!s.ok()) {
        return PostReply([this, conn, h, s] { ReplyStatus(conn, h.opcode, h.request_id, s); });
      }
      std::vector<w::BatchPutResult> results(items.size());
      size_t off = block;
      const bool durable = (h.flags & w::kFlagDurable) != 0;
      for (size_t i = 0; i < items.size(); ++i) {
        auto r = cache->Put(items[i].key, buf->data() + off, items[i].size, items[i].tensor,
                            durable);
        results[i].code = r.status().code();
        if (r.ok()) results[i].version = *r;
        off += items[i].size;
      }
      auto payload = std::make_shared<std::string>(w::EncodeBatchPutResults(results));
      PostReply([this, conn, h, payload] {
        Reply(conn, h.opcode, h.request_id, Status::OK(), w::EncodeStatusReply(Status::OK()),
              payload->data(), payload->size(), MemoryKind::kHost, [payload] {});
      });
    });
  }

  std::string StatsJson() const;

  void HandleStats(ConnId conn, const w::Header& h) {
    executors->Submit([this, conn, h] {
      auto payload = std::make_shared<std::string>(StatsJson());
      PostReply([this, conn, h, payload] {
        Reply(conn, h.opcode, h.request_id, Status::OK(), w::EncodeStatusReply(Status::OK()),
              payload->data(), payload->size(), MemoryKind::kHost, [payload] {});
      });
    });
  }
};

std::string Server::Impl::StatsJson() const {
  CacheStats st = cache->GetStats();
  std::string j = "{\"node\":\"" + self.id + "\",\"tiers\":{";
  for (int t = 0; t < kTierCount; ++t) {
    const TierStats& ts = st.tiers[t];
    if (t) j += ",";
    j += "\"" + std::string(TierName(static_cast<Tier>(t))) + "\":{";
    j += "\"enabled\":" + std::string(ts.enabled ? "true" : "false");
    j += ",\"capacity_bytes\":" + std::to_string(ts.capacity);
    j += ",\"used_bytes\":" + std::to_string(ts.used_bytes);
    j += ",\"objects\":" + std::to_string(ts.objects);
    j += ",\"hits\":" + std::to_string(ts.hits) + "}";
  }
  j += "},\"misses\":" + std::to_string(st.misses);
  j += ",\"moves\":{";
  bool first = true;
  for (int a = 0; a < kTierCount; ++a) {
    for (int b = 0; b < kTierCount; ++b) {
      if (a == b) continue;
      if (!first) j += ",";
      first = false;
      j += "\"" + std::string(TierName(static_cast<Tier>(a))) + "_to_" +
           std::string(TierName(static_cast<Tier>(b))) + "\":{\"objects\":" +
           std::to_string(st.moves[a][b]) + ",\"bytes\":" + std::to_string(st.moved_bytes[a][b]) +
           "}";
    }
  }
  j += "},\"disk_evictions\":" + std::to_string(st.disk_evictions);
  j += ",\"dropped\":" + std::to_string(st.dropped);
  j += ",\"durable_writes\":" + std::to_string(st.durable_writes);
  j += ",\"bytes_in\":" + std::to_string(counters.bytes_in.load());
  j += ",\"bytes_out\":" + std::to_string(counters.bytes_out.load());
  j += ",\"protocol_errors\":" + std::to_string(counters.protocol_errors.load());
  j += ",\"ops\":{";
  first = true;
  for (int op = 1; op <= static_cast<int>(w::Opcode::kHello); ++op) {
    if (!first) j += ",";
    first = false;
    j += "\"" + std::string(w::OpcodeName(static_cast<w::Opcode>(op))) +
         "\":" + std::to_string(counters.ops[op].load());
  }
  j += "},\"errors\":{";
  first = true;
  for (int c = 1; c <= static_cast<int>(StatusCode::kInternal); ++c) {
    if (!first) j += ",";
    first = false;
    j += "\"" + std::string(StatusCodeName(static_cast<StatusCode>(c))) +
         "\":" + std::to_string(counters.errors[c].load());
  }
  j += "}}";
  return j;
}

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
  auto cache = TieredCache::Open(options.cache);
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
  handlers.on_disconnect = [raw](ConnId id, const Status& s) {
    GKV_LOG_DEBUG("peer connection {} lost: {}", id, s.ToString());
  };
  auto transport = UcxTransport::Create(topts, std::move(handlers));
  if (!transport.ok()) return transport.status();
  impl->transport = std::move(*transport);
  const Impl& I = *impl;
  GKV_LOG_INFO("node {} up on {}:{} (gpu {}, host {}, disk {}){}", I.self.id, topts.listen_host,
               I.transport->listen_port(),
               I.cache->tier_enabled(Tier::kGpu) ? FormatSize(I.cache->tier_capacity(Tier::kGpu)) : "off",
               I.cache->tier_enabled(Tier::kHost) ? FormatSize(I.cache->tier_capacity(Tier::kHost)) : "off",
               I.cache->tier_enabled(Tier::kDisk) ? FormatSize(I.cache->tier_capacity(Tier::kDisk)) : "off",
               I.transport->device_memory_supported() ? "; UCX moves device memory" : "");
  return std::unique_ptr<Server>(new Server(std::move(impl)));
}

void Server::Stop() {
  Impl* I = impl_.get();
  std::call_once(I->stop_once, [I] {
    I->stopping.store(true, std::memory_order_release);
    // Let what is in flight finish (bounded: a stuck peer must not block shutdown forever).
    auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (I->in_flight.load(std::memory_order_acquire) > 0 &&
           std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    I->executors.reset();  // runs what is queued
    I->transport.reset();  // closes endpoints, listener, worker
    Status fs = I->cache->Flush();
    if (!fs.ok()) GKV_LOG_ERROR("flush at shutdown failed: {}", fs.ToString());
    GKV_LOG_INFO("node {} stopped", I->self.id);
  });
}

uint16_t Server::port() const { return impl_->transport ? impl_->transport->listen_port() : 0; }

TieredCache& Server::cache() { return *impl_->cache; }

}  // namespace gkv
