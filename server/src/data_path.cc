// The request handlers of the data path (see server_impl.h for the map of server/).
#include <cstring>

#include "gkv/log.h"
#include "gkv/size.h"
#include "server_impl.h"

namespace gkv {

void Server::Impl::FreePutOp(PutOp* op) {
  // Emptied, but the key keeps its capacity for the next one.
  op->msg.reset();
  op->handle = WriteHandle();
  op->staging.clear();
  op->put.key.clear();
  op->put.tensor = TensorMeta{};
  op->put.size = 0;
  op->ring_epoch = 0;
  op->client_version = 0;
  op->transfer = 0;
  W().put_ops_free.Give(op);
}

std::shared_ptr<Server::Impl::PutOp> Server::Impl::SharePutOp(PutOp* op) {
  auto shared = std::make_shared<PutOp>(std::move(*op));
  FreePutOp(op);
  return shared;
}

void Server::Impl::HandlePut(const Req& r, std::string_view body, std::unique_ptr<Incoming> msg) {
  // A recycled op (I/O thread): the fast path below allocates nothing for it; the other paths
  // move it into a shared one (SharePutOp).
  PutOp* op = W().put_ops_free.Take();
  op->req = r;
  Status s;
  if (r.h.flags & w::kFlagClientVersion) {
    s = w::TakeVersion(&body, &op->client_version);
    if (s.ok()) s = CheckClientVersion(op->client_version);
  }
  if (s.ok()) s = w::DecodePutRequest(body, &op->put);
  // A streamed put's PUT carries no bytes: they come in PUT_CHUNKs.
  const bool streamed = (r.h.flags & w::kFlagStreamed) != 0;
  if (s.ok() && op->put.size != msg->payload_size() && !streamed) {
    s = Status::ProtocolError("put declares " + std::to_string(op->put.size) +
                              " bytes but carries " + std::to_string(msg->payload_size()));
  }
  if (s.ok() && streamed && (msg->payload_size() != 0 || op->put.size == 0)) {
    s = Status::ProtocolError("a streamed put declares a size and carries no bytes");
  }
  if (s.ok()) s = CheckValueSize(op->put.size);
  if (s.ok() && Misrouted(r, op->put.key)) s = WrongNode();
  if (!s.ok()) {
    FreePutOp(op);
    return ReplyStatus(r, s);  // msg dropped: an unreceived payload is released
  }
  op->ring_epoch = RingHere()->epoch();
  if (streamed) {
    msg.reset();
    return OpenStream(SharePutOp(op));
  }
  // Hot path, all on the I/O thread: free room in a memory tier, receive straight into it,
  // publish. Anything that would evict or touch the disk goes through the executors.
  if (cache->TryReserveInMemory(op->put.key, op->put.size, op->put.tensor, &op->handle) ==
          TieredCache::FastPath::kServed &&
      (op->handle.memory_kind() == MemoryKind::kHost || device_zero_copy())) {
    if (op->client_version != 0) op->handle.RequestVersion(op->client_version);
    void* dst = op->handle.data();
    MemoryKind kind = op->handle.memory_kind();
    // Watched like ReceivePayload's, with a closure that fits std::function's small buffer.
    op->transfer = msg->payload_is_rendezvous() ? TrackTransfer(r.conn) : 0;
    transport->Receive(std::move(msg), dst, kind, [this, op](Status rs) { FinishFastPut(op, rs); });
    return;
  }
  // A fast reservation that this path cannot use (GPU memory that UCX cannot receive into) is
  // released before the slow path reserves: holding both would count the value twice and could
  // evict for nothing.
  op->handle = WriteHandle();
  op->msg = std::move(msg);
  SlowPut(SharePutOp(op));
}

// The fast put's payload is in (or failed): publish it in memory and reply, or hand the op to
// an executor (durable, or no room without eviction).
void Server::Impl::FinishFastPut(PutOp* op, const Status& rs) {
  if (op->transfer != 0) TransferDone(op->req.conn, op->transfer);
  op->transfer = 0;
  if (!rs.ok()) {
    op->handle = WriteHandle();
    const Req req = op->req;
    FreePutOp(op);
    return ReplyStatus(req, rs);
  }
  if (FencedSince(op->req)) {
    op->handle = WriteHandle();
    const Req req = op->req;
    FreePutOp(op);
    return ReplyStatus(req, FencedAtCommit());
  }
  uint64_t version = 0;
  if ((op->req.h.flags & w::kFlagDurable) == 0 &&
      cache->TryCommitInMemory(&op->handle, &version) == TieredCache::FastPath::kServed) {
    NoteCommittedKey(op->put.key, op->ring_epoch);
    if (!WriteWaitsForCopies(op->put.key)) {
      const Req req = op->req;
      FreePutOp(op);
      return Reply(req, Status::OK(), w::EncodePutReply(Status::OK(), version), nullptr, 0,
                   MemoryKind::kHost, nullptr);
    }
    std::shared_ptr<PutOp> shared = SharePutOp(op);
    // (The copies are worker 0's; the reply goes out on the request's worker.)
    auto after_write = [this, shared, version] {
      AfterWrite({shared->put.key}, [this, shared, version] {
        Reply(shared->req, Status::OK(), w::EncodePutReply(Status::OK(), version), nullptr, 0,
              MemoryKind::kHost, nullptr);
      });
    };
    if (!OnControlThread()) return transport->Post(after_write);
    return after_write();
  }
  std::shared_ptr<PutOp> shared = SharePutOp(op);
  executors->Submit([this, shared] { CommitAndReply(shared); });
}

void Server::Impl::SlowPut(std::shared_ptr<PutOp> op) {
  const Req& r = op->req;
  SubmitRequestWork(r, [this, op] {
    if (op->req.Expired()) {
      return transport->PostTo(op->req.worker, [this, op] {
        op->msg.reset();
        ReplyStatus(op->req, DeadlinePassed());
      });
    }
    auto reserved = cache->Reserve(op->put.key, op->put.size, op->put.tensor);
    if (!reserved.ok()) {
      Status err = reserved.status();
      // Dropping the message releases an unreceived rendezvous payload (the sender's send is
      // cancelled); the reply carries the reason.
      return transport->PostTo(op->req.worker, [this, op, err] {
        op->msg.reset();
        ReplyStatus(op->req, err);
      });
    }
    op->handle = std::move(*reserved);
    if (op->client_version != 0) op->handle.RequestVersion(op->client_version);
    // The payload is received on the request's own worker, whose table watches the transfer
    // (send_timeout) and holds the request's admission.
    transport->PostTo(op->req.worker, [this, op] {
      void* dst = op->handle.data();
      MemoryKind kind = op->handle.memory_kind();
      if (kind == MemoryKind::kDevice && !device_zero_copy()) {
        op->staging.resize(op->put.size);
        dst = op->staging.data();
        kind = MemoryKind::kHost;
      }
      ReceivePayload(op->req.conn, std::move(op->msg), dst, kind, [this, op](Status rs) {
        if (!rs.ok()) {
          return executors->Submit([this, op, rs] {
            op->handle = WriteHandle();
            PostReplyStatus(op->req, rs);
          });
        }
        executors->Submit([this, op] { CommitAndReply(op); });
      });
    });
  });
}

Status Server::Impl::CheckVersionLead(uint64_t version, uint64_t max_lead, std::string_view what,
                                      std::string_view limit) const {
  const uint64_t clock = cache->VersionClock();
  if (version <= clock || version - clock <= max_lead) return Status::OK();
  return Status::InvalidArgument(
      std::string(what) + " is " + std::to_string((version - clock) / 1024 / 1000000) +
      " s ahead of node " + self.id + "'s clock (" + std::string(limit) + ")");
}

Status Server::Impl::CheckValueSize(uint64_t size) const {
  if (size <= options.max_value_size) return Status::OK();
  return Status::InvalidArgument("value of " + FormatSize(size) +
                                 " exceeds the node's maximum value size of " +
                                 FormatSize(options.max_value_size));
}

void Server::Impl::CommitAndReply(const std::shared_ptr<PutOp>& op) {
  Status s;
  // The caller has given up: nothing is published (a durable write is not made durable for a
  // call that reported Timeout).
  if (op->req.Expired()) s = DeadlinePassed();
  if (s.ok() && FencedSince(op->req)) s = FencedAtCommit();
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
  // Finished on the request's own worker (worker 0 only if FinishWrite needs it).
  transport->PostTo(op->req.worker, [this, op, s, version] {
    auto reply = [this, op, s, version] {
      Reply(op->req, s, w::EncodePutReply(s, version), nullptr, 0, MemoryKind::kHost, nullptr);
    };
    // Nothing was written when it failed: the copies stay, and the error is not held up.
    if (!s.ok()) return reply();
    FinishWrite({op->put.key}, op->ring_epoch, std::move(reply));
  });
}

void Server::Impl::SendObject(const Req& r, const std::string& key,
                              std::shared_ptr<ReadHandle> handle, const void* data, uint64_t size,
                              MemoryKind kind, std::shared_ptr<std::string> staging) {
  // The handle keeps the entry pinned until UCX is done with its bytes.
  Reply(r, Status::OK(),
        w::EncodeObjectReply(Status::OK(), ToWire(handle->info()),
                             HintFor(key, handle->info().version)),
        data, size, kind, [handle, staging] {});
}

Server::Impl::Slice Server::Impl::SliceFor(const ReadHandle& h, const w::GetRange& range) {
  if (range.length == 0 || h.info().tier == Tier::kDisk) return {0, h.size()};
  const uint64_t offset = std::min(range.offset, h.size());
  return {offset, std::min(range.length, h.size() - offset)};
}

Status Server::Impl::CheckRangeVersion(const ReadHandle& h, const w::GetRange& range) {
  if (range.version == 0 || h.info().version == range.version) return Status::OK();
  return Status::Aborted("the value changed: version " + std::to_string(h.info().version) +
                         " is here, the range asked for " + std::to_string(range.version));
}

void Server::Impl::ReadOnExecutor(const Req& r, TieredCache* from, std::string key,
                                  std::optional<Status> error_as, SendRead send,
                                  const w::GetRange& range) {
  SubmitRequestWork(r, [this, r, from, key = std::move(key), error_as, send, range] {
    if (r.Expired()) return PostReplyStatus(r, DeadlinePassed());
    // A value on disk is read whole into memory: its bytes count against the node's in-flight
    // limit, as a batch reply's do, from before the read until its reply is sent (a read alone
    // always goes), so concurrent reads of large values cannot take the node's memory.
    std::shared_ptr<std::string> held;
    if (auto st = from->Stat(key); st.ok() && st->tier == Tier::kDisk) {
      // A later range of a value now on disk: refused before any bytes are reserved for it
      // (Acquire refuses it too, should it reach the disk after this look).
      if (!range.IsFirst()) {
        return PostReplyStatus(r, Status::Aborted("the value went to disk; read it whole"));
      }
      held = ReserveBatchReply(st->size);
      if (!held) {
        return PostReplyStatus(r, Status::Busy("node has " + FormatSize(batch_reply_bytes->load()) +
                                               " of read replies in flight; this value needs " +
                                               FormatSize(st->size)));
      }
    }
    auto acquired = from->Acquire(key, ReadKindFor(range));
    const Status err = acquired.ok() ? CheckRangeVersion(*acquired, range)
                                     : (error_as ? *error_as : acquired.status());
    if (!err.ok()) {
      return transport->PostTo(r.worker, [this, r, err] {
        Reply(r, err, w::EncodeObjectReply(err, {}), nullptr, 0, MemoryKind::kHost, nullptr);
      });
    }
    // (`held` goes with the handle: once the reply's send is done.)
    std::shared_ptr<ReadHandle> handle(new ReadHandle(std::move(*acquired)),
                                       [held](ReadHandle* h) { delete h; });
    std::shared_ptr<std::string> staging;
    const void* data = nullptr;
    MemoryKind kind = MemoryKind::kHost;
    const Slice part = SliceFor(*handle, range);
    Status cs = StageForSend(*from, *handle, part, &data, &kind, &staging);
    if (!cs.ok()) return PostReplyStatus(r, cs);
    transport->PostTo(r.worker, [send, handle, data, size = part.size, kind, staging] {
      send(handle, data, size, kind, staging);
    });
  });
}

Status Server::Impl::StageForSend(TieredCache& from, const ReadHandle& h, Slice part,
                                  const void** data, MemoryKind* kind,
                                  std::shared_ptr<std::string>* staging) {
  *data = h.data() + part.offset;
  *kind = h.memory_kind();
  if (*kind != MemoryKind::kDevice || device_zero_copy()) return Status::OK();
  *staging = std::make_shared<std::string>(part.size, '\0');
  GKV_RETURN_IF_ERROR(
      from.CopyBytes((*staging)->data(), MemoryKind::kHost, *data, *kind, part.size));
  *data = (*staging)->data();
  *kind = MemoryKind::kHost;
  return Status::OK();
}

bool Server::Impl::ServeHere(std::unique_ptr<Incoming>& msg) {
  if (msg->am_id() != w::kAmRequest || msg->conn() == 0) return false;
  Req r;
  r.conn = msg->conn();
  r.start = Clock::now();
  std::string_view body;
  if (!w::DecodeMessage(msg->header().data(), msg->header().size(), &r.h, &body).ok()) {
    return false;
  }
  // GETs, of a key's own copy or of a copy held for another node (held_copies), batches,
  // deletes and stats.
  const bool get = r.h.opcode == w::Opcode::kGet && msg->payload_size() == 0;
  const bool batch = r.h.opcode == w::Opcode::kMultiGet || r.h.opcode == w::Opcode::kMultiPut;
  const bool key_op = (r.h.opcode == w::Opcode::kDelete || r.h.opcode == w::Opcode::kStat) &&
                      msg->payload_size() == 0;
  if (!get && !batch && !key_op && r.h.opcode != w::Opcode::kPut) return false;
  IoWorker& ws = W();
  r.worker = ws.index;
  if (!options.cluster.secret.empty()) {
    auto auth = ws.authenticated.find(r.conn);
    if (auth == ws.authenticated.end() || !auth->second) return false;
  }
  // Fenced: worker 0 refuses. (Held-back keys are checked here too: Unconfirmed is
  // thread-safe.) The generation first (see OnMessage).
  r.generation = serving_generation.load(std::memory_order_acquire);
  if (Fenced(r.start) || stopping.load(std::memory_order_acquire)) return false;
  // The ring changed and its copy is on its way here: worker 0 routes meanwhile.
  if (elastic() && ws.ring->epoch() != ring_epoch_now.load(std::memory_order_acquire)) {
    return false;
  }
  if (r.h.budget_ms > 0) r.deadline = r.start + std::chrono::milliseconds(r.h.budget_ms);
  if (!get) {
    // A put or a batch: admitted here (or refused: this connection's limits are kept here), or
    // worker 0 decides (node claims, near the node's limit); the rest as on worker 0.
    bool to_worker0 = false;
    Status admitted = AdmitHere(&r, msg->payload_size(), &to_worker0);
    if (to_worker0) return false;
    counters.ops[static_cast<int>(r.h.opcode)].fetch_add(1, std::memory_order_relaxed);
    counters.bytes_in.fetch_add(msg->payload_size(), std::memory_order_relaxed);
    in_flight.fetch_add(1, std::memory_order_acq_rel);
    r.counted = true;
    if (!admitted.ok()) {
      ReplyStatus(r, admitted);  // the unreceived payload is released with `msg`
      return true;
    }
    if (r.h.opcode == w::Opcode::kMultiGet) {
      HandleMultiGet(r, std::move(msg));
    } else if (r.h.opcode == w::Opcode::kMultiPut) {
      HandleMultiPut(r, std::move(msg));
    } else if (key_op) {
      HandleKeyOp(r, body);
    } else {
      HandlePut(r, body, std::move(msg));
    }
    return true;
  }
  // A read of a copy held for another node has no routing to check; a key's own, as on worker 0.
  static thread_local std::string key;  // keeps its capacity: no allocation per request
  const bool replica_read = (r.h.flags & w::kFlagReplicaRead) != 0;
  w::GetRange range;
  if (!replica_read) {
    if (!DecodeGet(r, body, &key, &range).ok()) return false;
    if (Misrouted(r, key)) return false;  // worker 0 answers wrong_node
  }
  // From here on as OnMessage and HandleGet would (the message itself is no longer needed).
  counters.ops[static_cast<int>(r.h.opcode)].fetch_add(1, std::memory_order_relaxed);
  in_flight.fetch_add(1, std::memory_order_acq_rel);
  r.counted = true;
  if (Status admitted = Admit(&r, 0); !admitted.ok()) {
    ReplyStatus(r, admitted);
    return true;
  }
  if (replica_read) {
    HandleReplicaGet(r, body);
  } else {
    ServeGet(r, key, range);
  }
  return true;
}

void Server::Impl::ReplyFromMemory(const Req& r, TieredCache::FastPath fp, ReadHandle fast,
                                   const std::vector<uint16_t>& hint, const w::GetRange& range) {
  if (fp == TieredCache::FastPath::kMiss) {
    Status nf = Status::NotFound("key not found");
    return Reply(r, nf, w::EncodeObjectReply(nf, {}), nullptr, 0, MemoryKind::kHost, nullptr);
  }
  if (Status vs = CheckRangeVersion(fast, range); !vs.ok()) {
    return Reply(r, vs, w::EncodeObjectReply(vs, {}), nullptr, 0, MemoryKind::kHost, nullptr);
  }
  // Sent straight from the tier; the reply keeps the pin until UCX is done with the bytes.
  // The body is encoded into this thread's buffer (Reply copies it into the message).
  static thread_local std::string reply_body;
  w::EncodeObjectReplyTo(&reply_body, Status::OK(), ToWire(fast.info()), hint);
  const Slice part = SliceFor(fast, range);
  const void* data = fast.data() + part.offset;
  const size_t size = part.size;
  const MemoryKind kind = fast.memory_kind();
  Reply(r, Status::OK(), reply_body, data, size, kind, nullptr, std::move(fast));
}

Status Server::Impl::DecodeGet(const Req& r, std::string_view body, std::string* key,
                               w::GetRange* range) {
  if (r.h.flags & w::kFlagRange) {
    GKV_RETURN_IF_ERROR(w::DecodeRangeGet(body, key, range));
    if (range->length == 0) return Status::InvalidArgument("a ranged get of 0 bytes");
    return Status::OK();
  }
  return w::DecodeKeyRequest(body, key);
}

void Server::Impl::HandleGet(const Req& r, std::string_view body) {
  if (r.h.flags & w::kFlagReplicaRead) return HandleReplicaGet(r, body);
  std::string key;
  w::GetRange range;
  Status s = DecodeGet(r, body, &key, &range);
  if (s.ok() && Misrouted(r, key)) s = WrongNode();
  if (!s.ok()) return ReplyStatus(r, s);
  ServeGet(r, key, range);
}

void Server::Impl::ServeGet(const Req& r, const std::string& key, const w::GetRange& range) {
  if (range.IsFirst()) CountRow();  // a ranged read is one row, as it is one read
  const bool unconfirmed = Unconfirmed(key);
  if (unconfirmed && (r.h.flags & w::kFlagLastResort) == 0) {  // HeldBack
    Status held = HeldBackStatus();
    return Reply(r, held, w::EncodeObjectReply(held, {}), nullptr, 0, MemoryKind::kHost, nullptr);
  }
  if (range.length != 0) counters.ranged_gets.fetch_add(1, std::memory_order_relaxed);
  // No copies of those; a ranged read counts once, at its first range.
  if (replication_on() && !unconfirmed && range.IsFirst()) CountRead(key);
  // Hot path: an object in host memory (or in GPU memory that UCX can send) is answered right
  // here on the I/O thread, with the hint of a key with copies; anything that may block (disk,
  // promotion, GPU memory UCX cannot send from) goes to an executor.
  {
    ReadHandle fast;
    const auto fp = cache->TryAcquireFromMemory(key, &fast, device_zero_copy(), ReadKindFor(range));
    if (fp != TieredCache::FastPath::kNeedsSlowPath) {
      const std::vector<uint16_t> hint = fp == TieredCache::FastPath::kMiss
                                             ? std::vector<uint16_t>{}
                                             : HintFor(key, fast.info().version);
      return ReplyFromMemory(r, fp, std::move(fast), hint, range);
    }
  }
  ReadOnExecutor(
      r, cache.get(), key, std::nullopt,
      [this, r, key](std::shared_ptr<ReadHandle> handle, const void* data, uint64_t size,
                     MemoryKind kind, std::shared_ptr<std::string> staging) {
        SendObject(r, key, handle, data, size, kind, staging);
      },
      range);
}

void Server::Impl::HandleKeyOp(const Req& r, std::string_view body) {
  std::string key;
  uint64_t client_version = 0;
  Status s;
  if (r.h.opcode == w::Opcode::kDelete && (r.h.flags & w::kFlagClientVersion)) {
    s = w::TakeVersion(&body, &client_version);
    if (s.ok()) s = CheckClientVersion(client_version);
  }
  if (s.ok()) s = w::DecodeKeyRequest(body, &key);
  if (s.ok() && Misrouted(r, key)) s = WrongNode();
  if (s.ok() && r.h.opcode != w::Opcode::kDelete && HeldBack(r, key)) {
    s = HeldBackStatus();
  }
  if (!s.ok()) return ReplyStatus(r, s);
  SubmitRequestWork(r, [this, r, key = std::move(key), client_version] {
    if (r.Expired()) return PostReplyStatus(r, DeadlinePassed());
    if (r.h.opcode == w::Opcode::kDelete && FencedSince(r)) {
      return PostReplyStatus(r, FencedAtCommit());
    }
    if (r.h.opcode == w::Opcode::kDelete) {
      // Before the delete: a handoff or repair landing meanwhile is refused too.
      RememberDelete(key, client_version);
      Status ds = cache->Delete(key);
      return transport->PostTo(r.worker, [this, r, ds, key] { FinishDelete(r, ds, key); });
    }
    auto st = cache->Stat(key);
    Status status = st.status();
    w::ObjectMeta meta = st.ok() ? ToWire(*st) : w::ObjectMeta{};
    transport->PostTo(r.worker, [this, r, status, meta] {
      Reply(r, status, w::EncodeObjectReply(status, meta), nullptr, 0, MemoryKind::kHost, nullptr);
    });
  });
}

void Server::Impl::FinishDelete(const Req& r, const Status& ds, const std::string& key) {
  if (ds.ok() || ds.code() == StatusCode::kNotFound) Confirm(key);  // any worker
  auto on_control = [this, r, ds, key] {
    AfterWrite({key}, [this, r, ds] { ReplyStatus(r, ds); });
  };
  if (OnControlThread()) return on_control();
  // Another worker (as FinishWrite): worker 0 only when the key has copies to withdraw.
  if (WriteWaitsForCopies(key)) return transport->Post(std::move(on_control));
  ReplyStatus(r, ds);
}

void Server::Impl::HandleMultiGet(const Req& r, std::unique_ptr<Incoming> msg) {
  const bool versioned = (r.h.flags & w::kFlagVersionedKeys) != 0;
  // Executor: decode (up to a million rows) off the I/O thread.
  ReadPayloadThen(r, std::move(msg),
                  [this, r, versioned](Status s, std::shared_ptr<PayloadBuffer> buf) {
                    std::vector<std::string> keys;
                    std::vector<uint64_t> versions;
                    if (s.ok())
                      s = w::DecodeKeyList(buf->view(), &keys, versioned ? &versions : nullptr);
                    if (!s.ok()) return PostReplyStatus(r, s);
                    auto rows = std::make_shared<std::vector<BatchRow>>(keys.size());
                    for (size_t i = 0; i < keys.size(); ++i) {
                      (*rows)[i].key = std::move(keys[i]);
                      if (versioned) (*rows)[i].replica_version = versions[i];
                    }
                    transport->PostTo(r.worker, [this, r, rows] { MultiGetRows(r, rows); });
                  });
}

void Server::Impl::MultiGetRows(const Req& r, std::shared_ptr<std::vector<BatchRow>> rows) {
  const bool control = OnControlThread();
  // What only worker 0 can tell (misrouted keys under a ring this worker has not been given
  // yet): it runs the whole pass.
  if (!control && elastic() &&
      W().ring->epoch() != ring_epoch_now.load(std::memory_order_acquire)) {
    return transport->Post([this, r, rows] { MultiGetRows(r, rows); });
  }
  for (BatchRow& row : *rows) {
    if (row.replica_version == 0 && Misrouted(r, row.key)) {
      row.misrouted = true;
      continue;
    }
    if (row.replica_version == 0 && HeldBack(r, row.key)) {
      row.held_back = true;
      continue;
    }
    if (row.replica_version != 0) {
      if (replication_on()) row.replica_key = ReplicaRowKey(row.key, row.replica_version);
      if (!row.replica_key.empty()) CountRow();
      continue;
    }
    CountRow();
    if (replication_on()) CountRead(row.key);
  }
  SubmitRequestWork(r, [this, r, rows] { ServeMultiGet(r, rows); });
}

std::shared_ptr<std::string> Server::Impl::ReserveBatchReply(uint64_t values) {
  std::atomic<uint64_t>& held = *batch_reply_bytes;
  uint64_t cur = held.load();
  do {
    if (cur > 0 && cur + values > options.max_inflight_bytes) return nullptr;
  } while (!held.compare_exchange_weak(cur, cur + values));
  return std::shared_ptr<std::string>(new std::string(),
                                      [counter = batch_reply_bytes, values](std::string* s) {
                                        delete s;
                                        counter->fetch_sub(values);
                                      });
}

void Server::Impl::ServeMultiGet(const Req& r, std::shared_ptr<std::vector<BatchRow>> rows) {
  if (r.Expired()) return PostReplyStatus(r, DeadlinePassed());
  auto results = std::make_shared<std::vector<w::BatchGetResult>>(rows->size());
  std::vector<ReadHandle> handles;
  std::vector<TieredCache*> owners;  // the cache each handle's bytes come from
  std::vector<size_t> hint_rows;     // rows found whose key may have copies
  handles.reserve(rows->size());
  uint64_t total = 0;
  for (size_t i = 0; i < rows->size(); ++i) {
    const BatchRow& row = (*rows)[i];
    w::BatchGetResult& res = (*results)[i];
    TieredCache* from = cache.get();
    Result<ReadHandle> got = Status::NotFound("no replica of that version here");
    if (row.misrouted) {
      got = Status::WrongNode("");
    } else if (row.held_back) {
      got = HeldBackStatus();
    } else if (row.replica_version == 0) {
      got = cache->Acquire(row.key);
    } else if (!row.replica_key.empty()) {
      from = replica_cache.get();
      got = replica_cache->Acquire(row.replica_key);
    }
    res.code = got.status().code();
    if (!got.ok()) continue;
    if (total + got->size() > options.max_batch_bytes) {
      res.code = StatusCode::kNoSpace;  // the reply would be too large: ask again
      continue;
    }
    res.meta = ToWire(got->info());
    if (row.replica_version != 0) {
      res.meta.version = row.replica_version;  // the primary's version
      counters.CountReplicaRead(r.worker);
    } else if (replication_on() && replicated_keys.MaybeContains(row.key)) {
      hint_rows.push_back(i);  // its hint is noted below
    }
    total += got->size();
    handles.push_back(std::move(*got));
    owners.push_back(from);
  }
  // One reply: the result block, then every found value in order. UCX gathers them (iov)
  // from where they are, pinned until the send is done; only values in GPU memory are copied,
  // into host memory. `accounting` holds their bytes against the node's limit meanwhile.
  std::shared_ptr<std::string> accounting = ReserveBatchReply(total);
  if (!accounting) {
    handles.clear();
    return PostReplyStatus(
        r, Status::Busy("node has " + FormatSize(batch_reply_bytes->load()) +
                        " of batch replies in flight; this one needs " + FormatSize(total)));
  }
  struct Parts {
    std::shared_ptr<std::string> accounting;
    std::string block;
    std::vector<ReadHandle> handles;
    std::vector<std::unique_ptr<char[]>> staged;  // host copies of values in GPU memory
    std::vector<UcxTransport::Segment> values;
  };
  auto parts = std::make_shared<Parts>();
  parts->accounting = std::move(accounting);
  parts->handles = std::move(handles);  // (segments point into them only from here on)
  parts->values.reserve(parts->handles.size());
  Status cs;
  for (size_t j = 0; j < parts->handles.size() && cs.ok(); ++j) {
    ReadHandle& hd = parts->handles[j];
    if (hd.memory_kind() == MemoryKind::kHost) {
      parts->values.push_back({hd.data(), hd.size()});
      continue;
    }
    std::unique_ptr<char[]> copy(new char[hd.size() ? hd.size() : 1]);
    cs =
        owners[j]->CopyBytes(copy.get(), MemoryKind::kHost, hd.data(), hd.memory_kind(), hd.size());
    parts->values.push_back({copy.get(), hd.size()});
    parts->staged.push_back(std::move(copy));
    hd = ReadHandle();  // copied: its pin goes now
  }
  if (!cs.ok()) return PostReplyStatus(r, cs);
  // Hints are noted here from the copies published now (and the node's current ring) and
  // checked again on the request's I/O worker as the reply goes out, so copies withdrawn
  // meanwhile are never named; the block is encoded again there only if one changed (rare).
  if (!hint_rows.empty()) {
    const RingPtr ring_now = CurrentRing();
    for (size_t i : hint_rows) {
      w::BatchGetResult& res = (*results)[i];
      res.hint = HintFor((*rows)[i].key, res.meta.version, *ring_now);
    }
  }
  parts->block = w::EncodeBatchGetBlock(*results);
  auto send = [this, r, rows, results, parts, hint_rows = std::move(hint_rows)] {
    bool changed = false;
    for (size_t i : hint_rows) {
      w::BatchGetResult& res = (*results)[i];
      std::vector<uint16_t> now = HintFor((*rows)[i].key, res.meta.version);
      if (now != res.hint) {
        res.hint = std::move(now);
        changed = true;
      }
    }
    if (changed) parts->block = w::EncodeBatchGetBlock(*results);
    std::vector<UcxTransport::Segment> segments;
    segments.reserve(parts->values.size() + 1);
    segments.push_back({parts->block.data(), parts->block.size()});
    segments.insert(segments.end(), parts->values.begin(), parts->values.end());
    ReplyGather(r, w::EncodeStatusReply(Status::OK()), std::move(segments), [parts] {});
  };
  transport->PostTo(r.worker, std::move(send));
}

void Server::Impl::HandleMultiPut(const Req& r, std::unique_ptr<Incoming> msg) {
  const bool peer_conn_request = FromPeer(r.conn);
  ReadPayloadThen(
      r, std::move(msg),
      [this, r, peer_conn_request](Status s, std::shared_ptr<PayloadBuffer> buf) {
        std::vector<w::BatchPutItem> items;
        size_t block = 0;
        const bool versioned = (r.h.flags & w::kFlagClientVersion) != 0;
        if (s.ok()) s = w::DecodeBatchPutBlock(buf->view(), &items, &block, versioned);
        if (!s.ok()) return PostReplyStatus(r, s);
        std::vector<w::BatchPutResult> results(items.size());
        RingPtr now = CurrentRing();
        // Every item is reserved and filled, then all are committed together: a durable
        // batch is one RocksDB write with one sync (CommitBatch), not one fsync per
        // item. Items fail on their own (too large, no room); the others still land.
        std::vector<WriteHandle> handles;
        std::vector<size_t> slot;  // item index of each handle
        size_t off = block;
        for (size_t i = 0; i < items.size(); off += items[i].size, ++i) {
          Status is = CheckValueSize(items[i].size);
          if (is.ok() && versioned) is = CheckClientVersion(items[i].version);
          if (is.ok() && elastic() && (r.h.flags & w::kFlagPreviousOwner) == 0 &&
              !peer_conn_request && !Owns(*now, items[i].key)) {
            is = Status::WrongNode("");
          }
          Result<WriteHandle> h = is.ok()
                                      ? cache->Reserve(items[i].key, items[i].size, items[i].tensor)
                                      : Result<WriteHandle>(is);
          if (h.ok()) {
            is = cache->CopyBytes(h->data(), h->memory_kind(), buf->data() + off, MemoryKind::kHost,
                                  items[i].size);
          } else {
            is = h.status();
          }
          results[i].code = is.code();
          if (!is.ok()) continue;  // the reservation (if any) goes with `h`
          if (versioned) h->RequestVersion(items[i].version);
          handles.push_back(std::move(*h));
          slot.push_back(i);
        }
        if (FencedSince(r)) {
          handles.clear();  // the reservations go: nothing written
          for (size_t i : slot) results[i].code = StatusCode::kWrongNode;
          slot.clear();
        }
        auto committed = cache->CommitBatch(std::move(handles), (r.h.flags & w::kFlagDurable) != 0);
        for (size_t j = 0; j < committed.size(); ++j) {
          results[slot[j]].code = committed[j].status().code();
          if (committed[j].ok()) results[slot[j]].version = *committed[j];
        }
        auto payload = std::make_shared<std::string>(w::EncodeBatchPutResults(results));
        std::vector<std::string> keys;  // the ones written (their copies must go first)
        for (size_t i = 0; i < items.size(); ++i) {
          if (results[i].code == StatusCode::kOk) keys.push_back(items[i].key);
        }
        transport->PostTo(
            r.worker, [this, r, payload, keys = std::move(keys), epoch = now->epoch()]() mutable {
              FinishWrite(std::move(keys), epoch, [this, r, payload] { ReplyPayload(r, payload); });
            });
      });
}

void Server::Impl::FinishWrite(std::vector<std::string> keys, uint64_t epoch,
                               std::function<void()> reply) {
  if (OnControlThread()) {
    NoteCommitted(keys, epoch);
    return AfterWrite(keys, std::move(reply));
  }
  // Another worker: as its fast puts (FinishFastPut), worker 0 only when it has something to do.
  for (const std::string& key : keys) Confirm(key);  // cheap unless catching up
  bool control_needed = RingMovedSince(epoch);
  for (size_t i = 0; i < keys.size() && !control_needed; ++i) {
    control_needed = WriteWaitsForCopies(keys[i]);
  }
  if (!control_needed) return reply();
  transport->Post([this, keys = std::move(keys), epoch, reply = std::move(reply)]() mutable {
    NoteCommitted(keys, epoch);
    AfterWrite(keys, std::move(reply));
  });
}

void Server::Impl::HandleStats(const Req& r) {
  SubmitRequestWork(r, [this, r] {
    RefreshTransportCounters();
    auto payload = std::make_shared<std::string>(
        RenderStatsJson(self.id, cache->GetStats(), counters,
                        replica_cache ? replica_cache->GetStats() : CacheStats{}));
    PostReply([this, r, payload] { ReplyPayload(r, payload); });
  });
}

}  // namespace gkv
