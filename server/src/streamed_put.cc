// Streamed puts: a large value arrives in pieces (PUT with kFlagStreamed, then PUT_CHUNKs), so
// that a value bound for the disk tier never needs a buffer as large as itself (see
// server_impl.h for the map of server/, docs/ARCHITECTURE.md "Streamed puts").
#include "gkv/log.h"
#include "gkv/size.h"
#include "server_impl.h"

namespace gkv {

void Server::Impl::OpenStream(std::shared_ptr<PutOp> op) {
  const Req& r = op->req;
  SubmitRequestWork(r, [this, op] {
    if (op->req.Expired()) return PostReplyStatus(op->req, DeadlinePassed());
    auto stream = std::make_shared<PutStream>();
    stream->conn = op->req.conn;
    stream->put = std::move(op->put);
    stream->flags = op->req.h.flags;
    stream->client_version = op->client_version;
    stream->ring_epoch = op->ring_epoch;
    stream->closed = true;  // opening: takes no piece until its reservation is in
    stream->last_activity = Clock::now();
    // The slot first, so that a stream refused for the limits reserves (and evicts) nothing.
    Status s;
    {
      std::lock_guard<std::mutex> lock(streams_mu);
      size_t on_conn = 0;
      for (const auto& [id, other] : streams) on_conn += other->conn == stream->conn;
      if (streams.size() >= options.max_streams) {
        s = Status::Busy("the node has " + std::to_string(streams.size()) +
                         " streamed puts open (limit " + std::to_string(options.max_streams) + ")");
      } else if (on_conn >= kMaxStreamsPerConn) {
        s = Status::Busy("this connection has " + std::to_string(on_conn) +
                         " streamed puts open (limit " + std::to_string(kMaxStreamsPerConn) + ")");
      } else {
        stream->id = next_stream_id++;
        streams.emplace(stream->id, stream);
      }
    }
    if (!s.ok()) return PostReplyStatus(op->req, s);
    auto reserved = cache->ReserveStreamed(stream->put.key, stream->put.size, stream->put.tensor,
                                           (stream->flags & w::kFlagDurable) != 0);
    if (reserved.ok() && stream->client_version != 0) {
      reserved->RequestVersion(stream->client_version);
    }
    bool still_open = false;
    {
      std::lock_guard<std::mutex> lock(streams_mu);
      still_open = streams.count(stream->id) > 0;  // not dropped with its connection meanwhile
      if (reserved.ok() && still_open) {
        stream->handle = std::move(*reserved);
        const uint64_t chunk = options.stream_chunk_size;
        stream->pieces.assign((stream->put.size + chunk - 1) / chunk, false);
        stream->last_activity = Clock::now();
        stream->closed = false;
        counters.streams_opened.fetch_add(1, std::memory_order_relaxed);
      } else {
        streams.erase(stream->id);
      }
    }
    // (A reservation not taken is released here, on this executor.)
    if (!reserved.ok()) return PostReplyStatus(op->req, reserved.status());
    if (!still_open) return PostReplyStatus(op->req, Status::Unavailable("connection closed"));
    const w::StreamGrant grant{stream->id, options.stream_chunk_size, options.stream_window};
    const ConnId conn = stream->conn;
    transport->PostTo(op->req.worker, [this, op, grant] {
      Reply(op->req, Status::OK(), w::EncodeStreamReply(Status::OK(), grant), nullptr, 0,
            MemoryKind::kHost, nullptr);
    });
    // A connection that went while the stream was opening had its streams dropped before this
    // one was in the table: its own worker knows it is gone (and one that goes later drops it).
    transport->PostTo(UcxTransport::WorkerOf(conn), [this, conn] {
      if (!transport->IsOpen(conn)) DropStreams(conn);
    });
  });
}

void Server::Impl::ReleaseStreamLocked(const std::shared_ptr<PutStream>& stream) {
  if (!stream->closed || stream->in_flight > 0) return;  // the last piece to settle does it
  // An executor releases the reservation: for one bound for disk that deletes its chunks
  // (a RocksDB write), which must not stall an I/O thread.
  auto handle = std::make_shared<WriteHandle>(std::move(stream->handle));
  executors->Submit([handle] {});
}

void Server::Impl::HandlePutChunk(const Req& r, std::string_view body,
                                  std::unique_ptr<Incoming> msg) {
  uint64_t id = 0, offset = 0;
  Status s = w::DecodePutChunk(body, &id, &offset);
  const uint64_t len = msg->payload_size();
  const uint64_t chunk = options.stream_chunk_size;
  std::shared_ptr<PutStream> stream;
  void* dst = nullptr;
  MemoryKind kind = MemoryKind::kHost;
  if (s.ok()) {
    std::lock_guard<std::mutex> lock(streams_mu);
    auto it = streams.find(id);
    if (it == streams.end() || it->second->conn != r.conn || it->second->closed) {
      // (A stream of another connection is not this one's to write to: the same answer.)
      s = Status::Aborted("no open streamed put " + std::to_string(id) +
                          " on this connection (it failed, was dropped, or never was)");
    } else {
      stream = it->second;
      const uint64_t size = stream->put.size;
      const uint64_t piece = offset / chunk;
      if (offset % chunk != 0 || offset >= size || len == 0 ||
          len != std::min(chunk, size - offset)) {
        s = Status::InvalidArgument("piece of " + std::to_string(len) + " bytes at offset " +
                                    std::to_string(offset) + " does not fit a " + FormatSize(size) +
                                    " value sent in pieces of " + FormatSize(chunk));
      } else if (stream->pieces[piece]) {
        s = Status::InvalidArgument("piece at offset " + std::to_string(offset) +
                                    " was sent twice");
      } else if (stream->in_flight >= options.stream_window) {
        s = Status::Busy("more pieces in flight than the stream's window of " +
                         std::to_string(options.stream_window));
      } else {
        stream->pieces[piece] = true;
        stream->in_flight++;
        stream->last_activity = Clock::now();
        dst = stream->handle.data();
        kind = stream->handle.memory_kind();
      }
    }
  }
  if (!s.ok()) {
    // A piece that does not fit its stream fails the stream (the client would be sending a
    // different value than the one it declared); a busy or unknown one only itself.
    if (stream && s.code() == StatusCode::kInvalidArgument) {
      std::lock_guard<std::mutex> lock(streams_mu);
      if (!stream->closed) counters.streams_dropped.fetch_add(1, std::memory_order_relaxed);
      stream->closed = true;
      streams.erase(stream->id);
      ReleaseStreamLocked(stream);
    }
    return ReplyStatus(r, s);  // the unreceived piece is released with `msg`
  }
  // Host memory (or GPU memory UCX can receive into) takes the piece where it belongs.
  if (dst != nullptr && (kind == MemoryKind::kHost || device_zero_copy())) {
    ReceivePayload(r.conn, std::move(msg), static_cast<std::byte*>(dst) + offset, kind,
                   [this, stream, r, len](Status rs) { PieceStored(stream, r, len, rs, false); });
    return;
  }
  // Disk (or GPU memory it cannot): through a buffer of the node's stream pool, then written on
  // an executor.
  std::shared_ptr<std::byte[]> buffer = stream_pool ? stream_pool->TryAcquireCached(len) : nullptr;
  if (!buffer) {
    {
      std::lock_guard<std::mutex> lock(streams_mu);
      stream->pieces[offset / chunk] = false;
      stream->in_flight--;
      ReleaseStreamLocked(stream);  // (when it was dropped meanwhile)
    }
    return ReplyStatus(r, Status::Busy("every stream buffer of the node is in use; send the "
                                       "piece again shortly"));
  }
  std::byte* into = buffer.get();  // (taken before the callback below moves `buffer` away)
  ReceivePayload(
      r.conn, std::move(msg), into, MemoryKind::kHost,
      [this, stream, r, len, offset, buffer = std::move(buffer)](Status rs) mutable {
        if (!rs.ok()) return PieceStored(stream, r, len, rs, false);
        executors->Submit([this, stream, r, len, offset, buffer = std::move(buffer)]() mutable {
          Status ws = cache->WriteAt(stream->handle, offset, buffer.get(), len);
          buffer.reset();  // back to the pool before a commit (and its fsync)
          PieceStored(stream, r, len, ws, true);
        });
      });
}

void Server::Impl::PieceStored(const std::shared_ptr<PutStream>& stream, const Req& r, uint64_t len,
                               const Status& s, bool on_executor) {
  bool complete = false;
  std::shared_ptr<PutOp> commit;
  {
    std::lock_guard<std::mutex> lock(streams_mu);
    stream->in_flight--;
    stream->last_activity = Clock::now();
    if (!s.ok()) {
      if (!stream->closed) counters.streams_dropped.fetch_add(1, std::memory_order_relaxed);
      stream->closed = true;
      streams.erase(stream->id);
      ReleaseStreamLocked(stream);
    } else if (stream->closed) {
      ReleaseStreamLocked(stream);  // dropped while this piece was moving
    } else {
      stream->stored += len;
      complete = stream->stored == stream->put.size;
      if (complete) {
        counters.streams_completed.fetch_add(1, std::memory_order_relaxed);
        stream->closed = true;
        streams.erase(stream->id);
        commit = std::make_shared<PutOp>();
        commit->req = r;
        commit->req.h.flags = stream->flags;
        commit->put = stream->put;
        commit->handle = std::move(stream->handle);
        commit->client_version = stream->client_version;
        commit->ring_epoch = stream->ring_epoch;
      }
    }
  }
  if (commit) {
    if (on_executor) return CommitAndReply(commit);
    executors->Submit([this, commit] { CommitAndReply(commit); });
    return;
  }
  // A failed piece fails its stream; a stored one that was not the last is answered version 0.
  auto reply = [this, r, s] {
    Reply(r, s, w::EncodePutReply(s, 0), nullptr, 0, MemoryKind::kHost, nullptr);
  };
  if (on_executor) return transport->PostTo(r.worker, reply);
  reply();
}

void Server::Impl::DropStreams(ConnId conn, Clock::time_point now) {
  std::vector<std::shared_ptr<PutStream>> dropped;  // logged outside the lock
  {
    std::lock_guard<std::mutex> lock(streams_mu);
    for (auto it = streams.begin(); it != streams.end();) {
      PutStream& st = *it->second;
      const bool opening = st.pieces.empty();  // OpenStream drops it itself if it must
      const bool gone = conn != 0 ? st.conn == conn
                                  : !opening && st.in_flight == 0 &&
                                        now - st.last_activity > options.send_timeout;
      if (!gone) {
        ++it;
        continue;
      }
      st.closed = true;
      ReleaseStreamLocked(it->second);
      if (!opening) {
        counters.streams_dropped.fetch_add(1, std::memory_order_relaxed);
        dropped.push_back(std::move(it->second));
      }
      it = streams.erase(it);
    }
  }
  for (const auto& st : dropped) {
    GKV_LOG_INFO("streamed put {} of '{}' dropped after {} of {}: {}", st->id, LogKey(st->put.key),
                 FormatSize(st->stored), FormatSize(st->put.size),
                 conn != 0 ? "its connection went" : "nothing arrived for the send timeout");
  }
}

}  // namespace gkv
