// Streamed puts and the pipelined staging of device values (Client::Impl members; see
// client_impl.h and docs/ARCHITECTURE.md, "Streamed puts" and "Pipelined staging").
#include <algorithm>
#include <system_error>
#include <thread>

#include "client_impl.h"

namespace gkv {

void Client::Impl::StreamPutOnNode(int node, const std::string& key, const void* data, size_t size,
                                   MemoryKind kind, std::shared_ptr<std::byte[]> keepalive,
                                   const PutOptions& o, Clock::time_point deadline,
                                   uint64_t client_version,
                                   std::function<void(Result<uint64_t>)> done) {
  auto st = std::make_shared<PutStreamState>();
  st->node = node;
  st->data = static_cast<const std::byte*>(data);
  st->size = size;
  st->kind = kind;
  st->keepalive = std::move(keepalive);
  st->deadline = deadline;
  st->done = std::move(done);
  if (NeedsStaging(kind)) st->staging = std::make_shared<StagingShare>();
  st->open_flags = w::kFlagStreamed |
                   EncodePut(w::PutRequest{key, o.tensor, size}, o, client_version, &st->open);
  OpenStream(st, kPieceRetryFirst);
}

void Client::Impl::OpenStream(const std::shared_ptr<PutStreamState>& st,
                              std::chrono::milliseconds backoff) {
  auto on_reply = [this, st](const PendingPtr& p, std::unique_ptr<Incoming> msg) {
    w::StreamGrant grant;
    Status s = ParseReply(*msg, [&](std::string_view b, w::ReplyStatus* rs) {
      return w::DecodeStreamReply(b, rs, &grant);
    });
    if (!s.ok()) return Fail(p, s);
    Complete(p, [this, st, grant] {
      st->grant = grant;
      if (st->staging) return StartStaging(st);
      PumpStream(st);
    });
  };
  auto on_error = [this, st, backoff](Status s) {
    if (RetryIfBusy(s, st->deadline, backoff,
                    [this, st](std::chrono::milliseconds next) { OpenStream(st, next); })) {
      return;
    }
    EndStream(st, s);
  };
  Issue(st->node, w::Opcode::kPut, st->open_flags, st->open, nullptr, 0, MemoryKind::kHost,
        st->deadline, std::move(on_reply), std::move(on_error));
}

void Client::Impl::EndStream(const std::shared_ptr<PutStreamState>& st, Result<uint64_t> r) {
  if (!st->ended) {
    st->ended = true;
    st->end_status = r.status();
    if (r.ok()) st->end_version = *r;
    if (st->staging) {
      std::lock_guard<std::mutex> lock(st->staging->mu);
      st->staging->stop = true;
      st->staging->cv.notify_all();
    }
  }
  ReportStream(st);
}

void Client::Impl::ReportStream(const std::shared_ptr<PutStreamState>& st) {
  if (!st->ended || st->in_flight > 0 || st->staging_reads || !st->done) return;
  auto done = std::exchange(st->done, nullptr);
  if (!st->end_status.ok()) return done(st->end_status);
  done(st->end_version);
}

void Client::Impl::PumpStream(const std::shared_ptr<PutStreamState>& st) {
  while (!st->ended && st->in_flight < st->grant.window) {
    Piece piece;
    if (st->staging) {
      if (st->ready.empty()) return;  // the staging thread posts the next one
      piece = std::move(st->ready.front());
      st->ready.pop_front();
    } else {
      if (st->next >= st->size) return;
      piece.offset = st->next;
      piece.len = std::min<uint64_t>(st->grant.chunk_size, st->size - piece.offset);
      st->next += piece.len;
    }
    st->in_flight++;
    SendPiece(st, std::move(piece), kPieceRetryFirst);
  }
}

void Client::Impl::PieceSettled(const std::shared_ptr<PutStreamState>& st, Result<uint64_t> r) {
  st->in_flight--;
  if (!r.ok() || *r != 0 || st->ended) return EndStream(st, std::move(r));
  if (st->acked == st->size) {
    return EndStream(st, Status::ProtocolError("the node stored every piece of a streamed put "
                                               "but named no version"));
  }
  PumpStream(st);
}

void Client::Impl::SendPiece(const std::shared_ptr<PutStreamState>& st, Piece piece,
                             std::chrono::milliseconds backoff) {
  if (st->ended || closing) return PieceSettled(st, Status::Aborted("client closed"));
  const uint64_t offset = piece.offset;
  const uint64_t len = piece.len;
  const void* bytes = piece.staged ? piece.staged.get() : st->data + offset;
  const MemoryKind kind = piece.staged ? MemoryKind::kHost : st->kind;
  std::shared_ptr<std::byte[]> keepalive = piece.staged ? piece.staged : st->keepalive;
  auto on_reply = [this, st, piece](const PendingPtr& p, std::unique_ptr<Incoming> msg) {
    uint64_t version = 0;
    Status s = ParseReply(*msg, [&](std::string_view b, w::ReplyStatus* rs) {
      return w::DecodePutReply(b, rs, &version);
    });
    if (!s.ok()) return Fail(p, s);
    Complete(p, [this, st, piece, version] {
      st->acked += piece.len;
      if (version != 0) write_clock.Observe(version);
      // Stored: its buffer takes the staging thread's next piece. (A piece that failed keeps
      // its buffer: UCX may still be reading it.)
      if (piece.staged) {
        std::lock_guard<std::mutex> lock(st->staging->mu);
        st->staging->free.push_back(piece.staged);
        st->staging->cv.notify_all();
      }
      PieceSettled(st, version);
    });
  };
  auto on_error = [this, st, piece, backoff](Status s) {
    if (!st->ended &&
        RetryIfBusy(s, st->deadline, backoff, [this, st, piece](std::chrono::milliseconds next) {
          SendPiece(st, piece, next);
        })) {
      return;
    }
    PieceSettled(st, s);
  };
  Issue(st->node, w::Opcode::kPutChunk, 0, w::EncodePutChunk(st->grant.stream, offset), bytes, len,
        kind, st->deadline, std::move(on_reply), std::move(on_error), {}, std::move(keepalive));
}

bool Client::Impl::RetryIfBusy(const Status& s, Clock::time_point deadline,
                               std::chrono::milliseconds backoff,
                               std::function<void(std::chrono::milliseconds)> again) {
  if (s.code() != StatusCode::kBusy || closing || Clock::now() + backoff >= deadline) {
    return false;
  }
  AddTimer(Clock::now() + backoff,
           [again = std::move(again), backoff] { again(std::min(backoff * 2, kPieceRetryMax)); });
  return true;
}

void Client::Impl::StartStaging(const std::shared_ptr<PutStreamState>& st) {
  Status refused;
  {
    std::lock_guard<std::mutex> lock(staging_threads_mu);
    std::erase_if(staging_threads, [](StagingThread& t) {
      if (!t.finished->load(std::memory_order_acquire)) return false;
      t.thread.join();  // it has returned from its work, or is about to
      return true;
    });
    if (closing || staging_closed) {
      refused = Status::Aborted("client closed");
    } else {
      auto finished = std::make_shared<std::atomic<bool>>(false);
      staging_threads.emplace_back();  // the slot first: a thread made is never dropped
      try {
        staging_threads.back().thread = std::thread([this, st, finished] {
          StagePieces(st);
          finished->store(true, std::memory_order_release);
        });
        staging_threads.back().finished = std::move(finished);
        st->staging_reads = true;
      } catch (const std::system_error& e) {
        staging_threads.pop_back();
        refused = Status::Unavailable(std::string("no thread to stage the put: ") + e.what());
      }
    }
  }
  if (!refused.ok()) EndStream(st, refused);  // outside the lock: it may run the callback
}

void Client::Impl::JoinStagingThreads() {
  std::vector<StagingThread> threads;
  {
    std::lock_guard<std::mutex> lock(staging_threads_mu);
    staging_closed = true;
    threads.swap(staging_threads);
  }
  for (auto& t : threads) t.thread.join();
}

void Client::Impl::StagePieces(const std::shared_ptr<PutStreamState>& st) {
  StagingShare& share = *st->staging;
  const uint64_t piece = st->grant.chunk_size;
  const int buffers = st->grant.window + 1;
  int made = 0;
  Status s;
  for (uint64_t offset = 0; offset < st->size; offset += piece) {
    std::shared_ptr<std::byte[]> buffer;
    {
      std::unique_lock<std::mutex> lock(share.mu);
      share.cv.wait(lock, [&] { return share.stop || !share.free.empty() || made < buffers; });
      if (share.stop) break;
      if (!share.free.empty()) {
        buffer = std::move(share.free.back());
        share.free.pop_back();
      }
    }
    if (!buffer) {
      auto acquired = staging_pool->Acquire(piece);
      if (!acquired.ok()) {
        s = acquired.status();
        break;
      }
      buffer = std::move(*acquired);
      made++;
    }
    const uint64_t len = std::min(piece, st->size - offset);
    s = DeviceCopy(buffer.get(), st->data + offset, len, st->data);
    if (!s.ok()) break;
    transport->Post([this, st, p = Piece{offset, len, std::move(buffer)}]() mutable {
      st->ready.push_back(std::move(p));
      PumpStream(st);
    });
  }
  transport->Post([this, st, s] {
    st->staging_reads = false;
    if (!s.ok()) return EndStream(st, s);
    ReportStream(st);  // the put may have ended while this thread was still copying
  });
}

void Client::Impl::GetRangeOnNode(int node, const std::string& key,
                                  const std::shared_ptr<RangePiece>& rp, size_t capacity,
                                  Clock::time_point deadline, const Accept& accept,
                                  std::chrono::milliseconds backoff) {
  const bool first = rp->range.IsFirst();
  // A key with copies is read the usual way, which spreads its reads over them.
  if (first && HasCopies(key)) return rp->got.Set(Status::Aborted("the key has copies"));
  const Clock::time_point sent = Clock::now();
  // As OnGetAnswer, which takes whether keys move from when the get starts.
  const bool moving_at_send = first && Route()->Moving();
  auto on_reply = [this, node, key, first, moving_at_send, sent, rp, capacity, accept](
                      const PendingPtr& p, std::unique_ptr<Incoming> msg) {
    RangePiece::Got got;
    std::vector<uint16_t> hint;
    Status s = ParseReply(*msg, [&](std::string_view body, w::ReplyStatus* rs) {
      return w::DecodeObjectReply(body, rs, &got.meta, &hint);
    });
    std::shared_ptr<const Routing> route;  // the first range's only
    bool owner_answered = false;
    if (first) {
      route = Route();
      owner_answered = node == route->ring->Owner(key);
    }
    if (s.ok() && owner_answered) RememberHint(key, got.meta.version, std::move(hint), sent);
    // The owner's miss is the get's answer while keys stay where they are (as OnGetAnswer
    // takes it); while they move, the whole-value read asks the other owners too.
    if (s.code() == StatusCode::kNotFound && owner_answered && !moving_at_send &&
        !route->Moving()) {
      rp->final_error = true;
    }
    const w::GetRange& range = rp->range;
    got.bytes = msg->payload_size();
    if (s.ok()) {
      const uint64_t size = got.meta.size;
      const uint64_t cut = range.offset < size ? std::min(range.length, size - range.offset) : 0;
      const bool whole = first && got.bytes == size;
      if (got.bytes != cut && !whole) {
        s = Status::ProtocolError("a ranged reply carries a payload of the wrong size");
      }
    }
    if (s.ok() && first) {
      s = CheckAnswer(got.meta, capacity, accept);
      rp->final_error = !s.ok();
    }
    if (!s.ok()) return Fail(p, s);
    write_clock.Observe(got.meta.version);
    if (owner_answered && options.replicas > 1 && !moving_at_send && !route->Moving()) {
      static thread_local std::vector<int> owners;
      route->ring->Owners(key, options.replicas, &owners);
      MaybeReadRepair(key, owners, got.meta.version);
    }
    void* dst = rp->buffer.get();
    if (got.bytes > range.length) {
      // The whole value (the node holds it on disk): a pinned buffer when the pool has one
      // cached (this thread must not allocate one), else ordinary memory.
      got.whole = staging_pool->TryAcquireCached(got.bytes);
      got.whole_pinned = got.whole != nullptr;
      if (!got.whole) got.whole = std::shared_ptr<std::byte[]>(new std::byte[got.bytes]);
      dst = got.whole.get();
    }
    auto held = std::make_shared<RangePiece::Got>(std::move(got));
    // Our own buffers (kept by `rp` and `held`): the call may end before the bytes land.
    ReceivePayload(p, std::move(msg), dst, MemoryKind::kHost, /*dst_is_ours=*/true,
                   [this, p, rp, held](Status rs) {
                     if (!rs.ok()) return Fail(p, rs);
                     Complete(p, [rp, held] { rp->got.Set(std::move(*held)); });
                   });
  };
  auto on_error = [this, node, key, first, rp, capacity, deadline, accept, backoff](Status s) {
    // The first range's Busy is the get's answer, as a whole-value get's is; a later range
    // is asked again (the value is part read).
    if (first && s.code() == StatusCode::kBusy) rp->final_error = true;
    if (!first && RetryIfBusy(s, deadline, backoff, [=, this](std::chrono::milliseconds next) {
          GetRangeOnNode(node, key, rp, capacity, deadline, accept, next);
        })) {
      return;
    }
    rp->got.Set(s);
  };
  std::string& body = RequestBody();
  w::EncodeRangeGetTo(&body, key, rp->range);
  Issue(node, w::Opcode::kGet, w::kFlagRange, body, nullptr, 0, MemoryKind::kHost, deadline,
        std::move(on_reply), std::move(on_error));
}

std::optional<Result<ValueInfo>> Client::Impl::PipelinedGetInto(const std::string& key, void* dst,
                                                                size_t capacity,
                                                                const GetOptions& o,
                                                                Clock::time_point deadline) {
  const int node = Route()->ring->Owner(key);
  std::vector<std::shared_ptr<std::byte[]>> spare;  // pinned buffers whose piece is copied
  auto ask = [&](w::GetRange range) -> std::shared_ptr<RangePiece> {
    auto rp = std::make_shared<RangePiece>();
    rp->range = range;
    if (!spare.empty()) {
      rp->buffer = std::move(spare.back());
      spare.pop_back();
    } else {
      auto acquired = staging_pool->Acquire(kRangePiece);
      if (!acquired.ok()) return nullptr;
      rp->buffer = std::move(*acquired);
    }
    transport->Post([this, node, key, rp, capacity, deadline, accept = o.accept] {
      GetRangeOnNode(node, key, rp, capacity, deadline, accept);
    });
    return rp;
  };
  auto to_device = [&](uint64_t offset, const std::byte* bytes, uint64_t n) {
    return DeviceCopy(static_cast<std::byte*>(dst) + offset, bytes, n, dst);
  };
  auto first = ask({0, kRangePiece, 0});
  if (!first) return std::nullopt;
  auto r0 = Await(first->got);
  if (!r0.ok()) {
    if (first->final_error) return Result<ValueInfo>(r0.status());
    return std::nullopt;
  }
  const w::ObjectMeta meta = r0->meta;
  if (r0->bytes == meta.size) {  // all of it in one
    const std::byte* bytes = r0->whole ? r0->whole.get() : first->buffer.get();
    GKV_RETURN_IF_ERROR(to_device(0, bytes, meta.size));
    // Staged through ordinary memory: a pinned buffer of this size for next time, made here,
    // off the I/O thread (as GetInto's whole-value path does).
    if (r0->whole && !r0->whole_pinned) staging_pool->Warm(meta.size);
    return ToInfo(meta);
  }
  std::deque<std::shared_ptr<RangePiece>> asked;
  uint64_t next = r0->bytes;
  // Keeps kRangeWindow ranges on the wire (one buffer more than that: the one being copied).
  auto top_up = [&] {
    while (asked.size() < kRangeWindow && next < meta.size) {
      auto rp = ask({next, kRangePiece, meta.version});
      if (!rp) return false;
      asked.push_back(std::move(rp));
      next += kRangePiece;
    }
    return true;
  };
  if (!top_up()) return std::nullopt;
  GKV_RETURN_IF_ERROR(to_device(0, first->buffer.get(), r0->bytes));
  spare.push_back(std::move(first->buffer));
  while (!asked.empty()) {
    auto rp = std::move(asked.front());
    asked.pop_front();
    auto r = Await(rp->got);
    // Failed, or the value changed (the node checks the version; this checks it again): read
    // it whole.
    if (!r.ok() || r->meta.version != meta.version || r->meta.size != meta.size) {
      return std::nullopt;
    }
    if (!top_up()) return std::nullopt;
    GKV_RETURN_IF_ERROR(to_device(rp->range.offset, rp->buffer.get(), r->bytes));
    spare.push_back(std::move(rp->buffer));
  }
  return ToInfo(meta);
}

}  // namespace gkv
