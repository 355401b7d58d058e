#include "server.h"

#include <httplib.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <thread>

#include "gkv/hash.h"
#include "gkv/log.h"
#include "gkv/size.h"
#include "gkv/transport/hello_proof.h"
#include "server_impl.h"

namespace gkv {

void Server::Impl::Reply(const Req& r, const Status& status, std::string_view body,
                         const void* payload, size_t size, MemoryKind kind,
                         std::function<void()> after, ReadHandle pinned) {
  if (const int here = WorkerHere(); r.worker != here) {
    // Made on another worker than the one that admitted the request (worker 0 finishing a
    // request another worker began): sent from that one, whose tables hold its admission.
    auto held = std::make_shared<ReadHandle>(std::move(pinned));
    transport->PostTo(r.worker, [this, r, status, b = std::string(body), payload, size, kind,
                                 after = std::move(after), held]() mutable {
      Reply(r, status, b, payload, size, kind, std::move(after), std::move(*held));
    });
    return;
  }
  if (r.start != Clock::time_point{} && Clock::now() - r.start >= kSlowReply) {
    NoteSlowReply(r, status);
  }
  if (!status.ok()) {
    counters.errors[static_cast<int>(status.code())].fetch_add(1, std::memory_order_relaxed);
    // Every request answered protocol_error counts, whether its header or its body was bad.
    if (status.code() == StatusCode::kProtocolError) {
      counters.protocol_errors.fetch_add(1, std::memory_order_relaxed);
    }
  }
  OutgoingReply* out = StartReply(r, size, std::move(after));
  out->pinned = std::move(pinned);
  transport->Send(r.conn, w::kAmReply, EncodeReplyHeader(r, body), payload, size, kind,
                  [this, out](Status s) { FinishReply(out, s); });
}

void Server::Impl::NoteSlowReply(const Req& r, const Status& status) {
  counters.slow_replies.fetch_add(1, std::memory_order_relaxed);
  IoWorker& ws = W();
  const auto now = Clock::now();
  if (now - ws.last_slow_log < std::chrono::seconds(1)) {
    ++ws.slow_unlogged;
    return;
  }
  ws.last_slow_log = now;
  GKV_LOG_WARN("slow reply: {}{} answered {} after {} ms{}", w::OpcodeName(r.h.opcode),
               (r.h.flags & w::kFlagDurable) ? " (durable)" : "",
               status.ok() ? "ok" : StatusCodeName(status.code()),
               std::chrono::duration_cast<std::chrono::milliseconds>(now - r.start).count(),
               ws.slow_unlogged > 0
                   ? fmt::format("; {} more slow replies since the last line", ws.slow_unlogged)
                   : std::string());
  ws.slow_unlogged = 0;
}

Server::Impl::OutgoingReply* Server::Impl::StartReply(const Req& r, uint64_t size,
                                                      std::function<void()> after) {
  counters.bytes_out.fetch_add(size, std::memory_order_relaxed);
  // Recycled on the I/O worker where the reply is made and completes (the transport completes a
  // send to another worker's connection back on the worker that made it).
  IoWorker& ws = W();
  OutgoingReply* out = ws.outgoing_free.Take();
  out->worker = &ws;
  out->req = r;
  out->transfer = size > 0 ? TrackTransfer(r.conn) : 0;
  out->after = std::move(after);
  return out;
}

std::string_view Server::Impl::EncodeReplyHeader(const Req& r, std::string_view body) {
  // The transport copies the header before Send returns: one buffer per thread serves them all.
  static thread_local std::string message;
  w::EncodeMessageTo(&message, {r.h.opcode, 0, r.h.request_id}, body);
  return message;
}

void Server::Impl::ReplyGather(const Req& r, std::string_view body,
                               std::vector<UcxTransport::Segment> segments,
                               std::function<void()> after) {
  if (const int here = WorkerHere(); r.worker != here) {
    transport->PostTo(r.worker, [this, r, b = std::string(body), segments = std::move(segments),
                                 after = std::move(after)]() mutable {
      ReplyGather(r, b, std::move(segments), std::move(after));
    });
    return;
  }
  uint64_t size = 0;
  for (const UcxTransport::Segment& s : segments) size += s.size;
  OutgoingReply* out = StartReply(r, size, std::move(after));
  transport->SendGather(r.conn, w::kAmReply, EncodeReplyHeader(r, body), std::move(segments),
                        [this, out](Status s) { FinishReply(out, s); });
}

void Server::Impl::FinishReply(OutgoingReply* out, const Status& s) {
  if (!s.ok()) GKV_LOG_DEBUG("reply send failed: {}", s.ToString());
  const Req& rq = out->req;
  if (out->after) {
    auto after = std::move(out->after);
    out->after = nullptr;
    after();
  }
  out->pinned = ReadHandle();  // the value's pin goes: UCX is done with its bytes
  if (out->transfer != 0) TransferDone(rq.conn, out->transfer);
  Release(rq);
  counters.RecordLatency(
      rq.h.opcode,
      std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - rq.start).count(),
      out->worker->index);
  counters.CountAnswered(out->worker->index);
  if (rq.counted) in_flight.fetch_sub(1, std::memory_order_acq_rel);
  out->worker->outgoing_free.Give(out);
}

uint64_t Server::Impl::TrackTransfer(ConnId conn) {
  IoWorker& ws = W();
  auto it = ws.conn_load.find(conn);
  if (it == ws.conn_load.end()) return 0;  // the connection is gone: nothing to watch
  const uint64_t token = ws.next_transfer_token++;
  it->second.transfers.Push(Clock::now() + options.send_timeout, token);
  return token;
}

void Server::Impl::TransferDone(ConnId conn, uint64_t token) {
  IoWorker& ws = W();
  auto it = ws.conn_load.find(conn);
  if (it == ws.conn_load.end()) return;
  it->second.transfers.Done(token);
}

void Server::Impl::ReceivePayload(ConnId conn, std::unique_ptr<Incoming> msg, void* dst,
                                  MemoryKind kind, std::function<void(Status)> done) {
  const uint64_t token = msg->payload_is_rendezvous() ? TrackTransfer(conn) : 0;
  transport->Receive(std::move(msg), dst, kind,
                     [this, conn, token, done = std::move(done)](Status s) {
                       if (token != 0) TransferDone(conn, token);
                       done(s);
                     });
}

void Server::Impl::ForgetConnection(ConnId conn) {
  IoWorker& ws = W();
  ws.authenticated.erase(conn);
  ws.conn_load.erase(conn);
  ws.peer_conns.erase(conn);
  if (OnControlThread()) {
    peer_node_of_conn.erase(conn);
    DropStreams(conn);
  }
}

void Server::Impl::CloseConnection(ConnId conn, bool force) {
  // Closed by this node: no on_disconnect comes, so the workers that may hold state of the
  // connection (its own, and worker 0, which answers what it hands over) forget it here. The
  // connection's own worker closes it and then tells worker 0, after everything it handed over
  // before (Post is in order), so no entry that such a request makes on worker 0 stays behind.
  ForgetConnection(conn);
  const int here = WorkerHere();
  const int owner = UcxTransport::WorkerOf(conn);
  if (owner != here) {
    return transport->PostTo(owner, [this, conn, force] { CloseConnection(conn, force); });
  }
  transport->Close(conn, force);
  if (owner != 0) transport->Post([this, conn] { ForgetConnection(conn); });
}

void Server::Impl::OnDisconnect(ConnId conn, const Status& s) {
  GKV_LOG_DEBUG("client connection {} closed: {}", conn, s.ToString());
  ForgetConnection(conn);
  if (!OnControlThread()) {
    // Worker 0 may hold state of this connection too (the requests handed to it).
    return transport->Post([this, conn] {
      ForgetConnection(conn);
      OnPeerDisconnect(conn);
    });
  }
  OnPeerDisconnect(conn);
}

void Server::Impl::TellConnWorker(ConnId conn, bool peer) {
  const int worker = UcxTransport::WorkerOf(conn);
  if (worker == 0) return;
  transport->PostTo(worker, [this, conn, peer] {
    if (!transport->IsOpen(conn)) return;  // gone meanwhile (and forgotten there)
    IoWorker& ws = W();
    ws.authenticated[conn] = true;
    if (peer) ws.peer_conns.insert(conn);
  });
}

Server::Impl::ConnLoad* Server::Impl::LoadOf(const Req& r, Status* refused) {
  // A message handled after its connection went: nothing to track it against.
  if (!transport->IsOpen(r.conn)) {
    *refused = Status::Unavailable("connection closed");
    return nullptr;
  }
  ConnLoad& load = W().conn_load[r.conn];
  if (load.requests >= options.max_conn_requests) {
    *refused = Status::Busy("connection has " + std::to_string(load.requests) +
                            " requests in flight (limit " +
                            std::to_string(options.max_conn_requests) + ")");
    return nullptr;
  }
  return &load;
}

Status Server::Impl::Admit(Req* r, uint64_t charge) {
  Status refused;
  ConnLoad* found = LoadOf(*r, &refused);
  if (found == nullptr) return refused;
  ConnLoad& load = *found;
  if (charge > 0) {
    const auto now = Clock::now();
    const uint64_t conn_limit = options.max_conn_inflight_bytes;
    const uint64_t node_limit = options.max_inflight_bytes;
    const bool conn_fits = BytesFit(load.bytes, charge, conn_limit, load.claim, now);
    const uint64_t node_used = inflight_bytes.load(std::memory_order_acquire);
    const bool node_fits = BytesFit(node_used, charge, node_limit, node_claim, now);
    const bool admitted = conn_fits && node_fits;
    UpdateClaim(&load.claim, load.bytes, charge, conn_limit, admitted, now);
    UpdateClaim(&node_claim, node_used, charge, node_limit, admitted, now);
    node_claim_live.store(node_claim.bytes > 0, std::memory_order_release);
    if (!conn_fits) {
      return Status::Busy("connection has " + FormatSize(load.bytes) + " of payloads in flight" +
                          (load.claim.bytes > charge ? " and room held for a larger one" : ""));
    }
    if (!node_fits) {
      return Status::Busy("node has " + FormatSize(node_used) + " of payloads in flight" +
                          (node_claim.bytes > charge ? " and room held for a larger one" : ""));
    }
  }
  load.requests++;
  load.bytes += charge;
  if (charge > 0) inflight_bytes.fetch_add(charge, std::memory_order_acq_rel);
  r->charged = charge;
  r->admitted = true;
  return Status::OK();
}

Status Server::Impl::AdmitHere(Req* r, uint64_t charge, bool* to_worker0) {
  *to_worker0 = false;
  Status refused;
  ConnLoad* found = LoadOf(*r, &refused);
  if (found == nullptr) return refused;
  ConnLoad& load = *found;
  if (charge > 0) {
    // Worker 0 keeps the node's claims: while one is live, and near the node's limit, it
    // decides. This connection's limits (its requests on this worker) are kept here.
    if (node_claim_live.load(std::memory_order_acquire)) {
      *to_worker0 = true;
      return Status::OK();
    }
    const auto now = Clock::now();
    const uint64_t conn_limit = options.max_conn_inflight_bytes;
    const bool conn_fits = BytesFit(load.bytes, charge, conn_limit, load.claim, now);
    if (!conn_fits) {
      UpdateClaim(&load.claim, load.bytes, charge, conn_limit, false, now);
      return Status::Busy("connection has " + FormatSize(load.bytes) + " of payloads in flight" +
                          (load.claim.bytes > charge ? " and room held for a larger one" : ""));
    }
    const uint64_t before = inflight_bytes.fetch_add(charge, std::memory_order_acq_rel);
    if (before + charge > options.max_inflight_bytes / 2) {
      inflight_bytes.fetch_sub(charge, std::memory_order_acq_rel);
      *to_worker0 = true;
      return Status::OK();
    }
    UpdateClaim(&load.claim, load.bytes, charge, conn_limit, true, now);
  }
  load.requests++;
  load.bytes += charge;
  r->charged = charge;
  r->admitted = true;
  return Status::OK();
}

bool Server::Impl::BytesFit(uint64_t used, uint64_t charge, uint64_t limit, const BytesClaim& claim,
                            Clock::time_point now) {
  const bool claim_live = claim.bytes > 0 && now < claim.until;
  const uint64_t held = claim_live && charge < claim.bytes ? claim.bytes : 0;
  // A value up to the maximum size gets through when nothing is in flight, unless it is
  // smaller than a live claim: then the claimant, retrying, must find the room first.
  if (used == 0 && held == 0) return true;
  return used + charge <= limit && held <= limit - used - charge;
}

void Server::Impl::UpdateClaim(BytesClaim* claim, uint64_t used, uint64_t charge, uint64_t limit,
                               bool admitted, Clock::time_point now) {
  if (claim->bytes > 0 && now >= claim->until) {  // expired
    claim->bytes = 0;
    claim->next_claim = claim->until + kClaimHold;
  }
  if (admitted) {
    if (claim->bytes > 0 && charge >= claim->bytes) {  // the claimant got in
      claim->bytes = 0;
      claim->next_claim = now + kClaimHold;
    }
    return;
  }
  // Refused because it does not fit beside what is in flight (not merely behind a claim), and
  // large: a request of at most a quarter of the limit fits again as soon as the in-flight
  // bytes fall below three quarters. (One over the limit claims more than the limit: nothing
  // smaller is admitted during its claim, and it gets in once nothing is in flight.)
  if (used + charge <= limit || charge <= limit / 4) return;
  if (claim->bytes > 0) {
    claim->bytes = std::max(claim->bytes, charge);  // the larger one waits; the end stays
  } else if (now >= claim->next_claim) {
    claim->bytes = charge;
    claim->until = now + kClaimHold;
  }
}

void Server::Impl::Release(const Req& r) {
  if (r.charged > 0) inflight_bytes.fetch_sub(r.charged, std::memory_order_acq_rel);
  IoWorker& ws = W();
  auto it = ws.conn_load.find(r.conn);
  if (it == ws.conn_load.end()) return;  // the connection is gone (and its load with it)
  ConnLoad& load = it->second;
  if (r.admitted) {
    load.requests--;
    load.bytes -= r.charged;
  }
}

void Server::Impl::CloseStuckConnections(Clock::time_point now) {
  std::vector<ConnId> stuck;
  for (auto& [conn, load] : W().conn_load) {
    if (!load.transfers.empty() && load.transfers.front().deadline < now) stuck.push_back(conn);
  }
  for (ConnId conn : stuck) {
    GKV_LOG_WARN("connection {} has not completed a transfer for {} ms; closing it", conn,
                 options.send_timeout.count());
    counters.stuck_connections_closed.fetch_add(1, std::memory_order_relaxed);
    // Closing completes its transfers with errors: pins and reservations go.
    CloseConnection(conn, /*force=*/true);
  }
}

bool Server::Impl::SubmitRequestWork(const Req& r, std::function<void()> work) {
  if (executors->queued() >= options.max_queued_tasks) {
    ReplyStatus(r, Status::Busy("the node's work queue is full"));
    return false;
  }
  executors->Submit(std::move(work));
  return true;
}

Status Server::Impl::DeadlinePassed() {
  return Status::Timeout("the request's deadline passed before the node could start it");
}

void Server::Impl::ReplyStatus(const Req& r, const Status& s) {
  Reply(r, s, w::EncodeStatusReply(s), nullptr, 0, MemoryKind::kHost, nullptr);
}

void Server::Impl::ReadPayloadThen(const Req& r, std::unique_ptr<Incoming> msg,
                                   std::function<void(Status, std::shared_ptr<PayloadBuffer>)> next,
                                   bool on_executor, uint64_t limit) {
  if (limit == 0) limit = options.max_batch_bytes;
  if (msg->payload_size() > limit) {
    return ReplyStatus(
        r, Status::NoSpace("batch of " + FormatSize(msg->payload_size()) +
                           " exceeds the node's limit of " + FormatSize(limit) + "; split it"));
  }
  if (executors->queued() >= options.max_queued_tasks) {
    return ReplyStatus(r, Status::Busy("the node's work queue is full"));
  }
  // Bounded by admission (the payload is charged against the in-flight limits).
  auto buf = std::make_shared<PayloadBuffer>(msg->payload_size());
  ReceivePayload(
      r.conn, std::move(msg), buf->data(), MemoryKind::kHost,
      [this, r, buf, next = std::move(next), on_executor](Status s) {
        if (!on_executor) return next(r.Expired() ? DeadlinePassed() : s, buf);
        executors->Submit([r, s, buf, next] { next(r.Expired() ? DeadlinePassed() : s, buf); });
      });
}

void Server::Impl::OnMessage(std::unique_ptr<Incoming> msg) {
  // A message can arrive between the listener's start (inside UcxTransport::Create) and the
  // assignment of `transport` a few instructions later: wait for that.
  // (Bounded: should Create fail after its listener started, the message is dropped.)
  for (auto give_up = Clock::now() + std::chrono::seconds(1);
       !ticking.load(std::memory_order_acquire);) {
    if (Clock::now() > give_up) return;
    std::this_thread::yield();
  }
  if (!OnControlThread()) {
    if (ServeHere(msg)) return;
    // Everything else is worker 0's (it answers on this connection through the transport).
    auto held = std::make_shared<std::unique_ptr<Incoming>>(std::move(msg));
    return transport->Post([this, held] { OnMessage(std::move(*held)); });
  }
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
  if (!options.cluster.secret.empty()) {
    IoWorker& ws = W();
    auto auth = ws.authenticated.find(r.conn);
    if (auth == ws.authenticated.end() || !auth->second) return Authenticate(r, body);
  }
  if (stopping.load(std::memory_order_acquire)) {
    // Drained: every key went to its new owners, and the node left the ring. It holds nothing
    // a previous owner is asked for (a miss sends the client on), and a client whose ring
    // still names it as owner asks the ring again. Any other stop may still hold keys.
    if (holds_nothing.load(std::memory_order_acquire) && FencedOp(r.h.opcode)) {
      if (r.h.flags & w::kFlagPreviousOwner) {
        return ReplyStatus(r, Status::NotFound("node " + self.id + " left; it holds no keys"));
      }
      return ReplyStatus(r, Status::WrongNode("node " + self.id + " left the cluster"));
    }
    return ReplyStatus(r, Status::Unavailable("node is shutting down"));
  }
  // The generation first: a registration that changes between the two loads then fails the
  // write's commit (FencedSince) rather than letting it commit under the new one.
  r.generation = serving_generation.load(std::memory_order_acquire);
  if (FencedOp(r.h.opcode) && Fenced(r.start)) {
    counters.fenced_refusals.fetch_add(1, std::memory_order_relaxed);
    return ReplyStatus(r, FencedStatus(r.start));
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
    case w::Opcode::kStats:
    case w::Opcode::kReplicaPut:
    case w::Opcode::kHandoffPut:
    case w::Opcode::kRepair:
    case w::Opcode::kPutChunk: {
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
    case w::Opcode::kLoadReport:
      if (!PeerOnly(r)) return;
      return HandleLoadReport(r, body);
    case w::Opcode::kHandoffPut:
      return HandleHandoffPut(r, body, std::move(msg));
    case w::Opcode::kRepair:
      return HandleRepair(r, body);
    case w::Opcode::kPutChunk:
      return HandlePutChunk(r, body, std::move(msg));
    case w::Opcode::kPeerHello:
      return;  // handled above
  }
}

bool Server::Impl::PeerOnly(const Req& r) {
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

void Server::Impl::AuthenticatePeer(const Req& r, std::string_view body) {
  std::string node_id, proof;
  uint32_t placement = 0;
  Status s = w::DecodePeerHello(body, &node_id, &proof, &placement);
  const int node = s.ok() ? options.cluster.FindNode(node_id) : -1;
  const std::string& want = options.cluster.effective_peer_secret();
  // The proof binds the caller's id and this node's: it cannot be replayed elsewhere, and once
  // here (hello_guard).
  Status proof_status = Status::OK();
  if (s.ok() && node >= 0 && node != self_index && !want.empty()) {
    proof_status =
        w::CheckHelloProof(proof, want, w::kPeerHelloLabel, self.id, node_id, w::UnixMillisNow());
    if (proof_status.ok()) proof_status = hello_guard.Admit(proof, Clock::now());
  }
  const bool proven = s.ok() && node >= 0 && node != self_index && proof_status.ok();
  if (proven && placement != HashRing::kPlacementVersion) {
    // A node that places keys differently would hand off, replicate and repair by another
    // ring: refused, loudly, on both sides (its calls fail as the connection closes).
    counters.auth_failures.fetch_add(1, std::memory_order_relaxed);
    GKV_LOG_ERROR(
        "refused peer {}: it places keys by placement version {}, this node by version {}; "
        "nodes of two placements split the key space: upgrade every node together (README, "
        "'Upgrading')",
        LogKey(node_id), placement, HashRing::kPlacementVersion);
    const ConnId conn = r.conn;
    Status refused = Status::NotSupported("this node places keys by placement version " +
                                          std::to_string(HashRing::kPlacementVersion) +
                                          ", yours by " + std::to_string(placement));
    return Reply(r, refused, w::EncodeStatusReply(refused), nullptr, 0, MemoryKind::kHost,
                 [this, conn] { CloseConnection(conn, /*force=*/false); });
  }
  if (proven) {
    peer_node_of_conn[r.conn] = node;
    W().authenticated[r.conn] = true;  // a node of the cluster may also use the client protocol
    TellConnWorker(r.conn, /*peer=*/true);
    return ReplyStatus(r, Status::OK());
  }
  counters.auth_failures.fetch_add(1, std::memory_order_relaxed);
  GKV_LOG_WARN("refused peer connection {}: {}", r.conn,
               !s.ok()              ? std::string("malformed peer hello")
               : node < 0           ? std::string("unknown node id")
               : node == self_index ? std::string("claims this node's own id")
                                    : "peer secret: " + std::string(proof_status.message()));
  const ConnId conn = r.conn;
  Status denied = Status::PermissionDenied("not a node of this cluster");
  Reply(r, denied, w::EncodeStatusReply(denied), nullptr, 0, MemoryKind::kHost,
        [this, conn] { CloseConnection(conn, /*force=*/false); });
}

void Server::Impl::Authenticate(const Req& r, std::string_view body) {
  std::string proof;
  Status s = Status::PermissionDenied("this cluster requires a proof of its secret (HELLO) first");
  if (r.h.opcode == w::Opcode::kHello) {
    s = w::DecodeHello(body, &proof);
    if (s.ok()) {
      s = w::CheckHelloProof(proof, options.cluster.secret, w::kClientHelloLabel, self.id, "",
                             w::UnixMillisNow());
    }
    if (s.ok()) s = hello_guard.Admit(proof, Clock::now());
  }
  if (s.ok()) {
    W().authenticated[r.conn] = true;
    TellConnWorker(r.conn, /*peer=*/false);
    return ReplyStatus(r, Status::OK());
  }
  counters.auth_failures.fetch_add(1, std::memory_order_relaxed);
  GKV_LOG_WARN("refused connection {}: {}", r.conn, s.message());
  const ConnId conn = r.conn;
  // Busy stays Busy (the client may come back); everything else is a refusal.
  const Status refused = s.code() == StatusCode::kBusy
                             ? s
                             : Status::PermissionDenied("refused: " + std::string(s.message()));
  Reply(r, refused, w::EncodeStatusReply(refused), nullptr, 0, MemoryKind::kHost,
        [this, conn] { CloseConnection(conn, /*force=*/false); });
}

void Server::Impl::ReplyPayload(const Req& r, std::shared_ptr<std::string> payload) {
  Reply(r, Status::OK(), w::EncodeStatusReply(Status::OK()), payload->data(), payload->size(),
        MemoryKind::kHost, [payload] {});
}

void Server::Impl::OnTick() {
  if (!ticking.load(std::memory_order_acquire)) return;
  const auto now = Clock::now();
  IoWorker& ws = W();
  if (now - ws.last_send_check >= std::chrono::milliseconds(100)) {
    ws.last_send_check = now;
    CloseStuckConnections(now);
  }
  if (!OnControlThread()) return;  // the rest is worker 0's
  if (!boot_sync_started) StartBootSync();
  if (now >= next_stream_expiry) {
    next_stream_expiry = now + std::chrono::seconds(1);
    DropStreams(0, now);
  }
  if (!peer_deadlines.empty()) ExpirePeerCalls(now);
  if (io.size() > 1) {
    node_read_count += static_cast<double>(rows_elsewhere.exchange(0, std::memory_order_relaxed));
    if (replication_on() && now - last_copy_floor >= std::chrono::milliseconds(1)) {
      last_copy_floor = now;
      PublishCopyFloor();
    }
  }
  if (!timers.empty()) RunTimers(now);
  if (elastic()) FenceTick(now);
  CatchUpTick(now);
  if (replication_on() && now - last_decay >= std::chrono::seconds(1)) {
    last_decay = now;
    ReplicationTick(now);
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

std::vector<UcxTransport::Options::Region> Server::Impl::ArenaRegions() {
  arena_regions.clear();
  std::vector<UcxTransport::Options::Region> out;
  for (TieredCache* c : {cache.get(), replica_cache.get()}) {
    if (!c) continue;
    for (const MemoryRegion& r : c->memory_regions()) {
      arena_regions.push_back({r, c == replica_cache.get()});
      out.push_back({r.base, r.size, r.kind});
    }
  }
  return out;
}

Server::Impl::~Impl() {
  if (transport) transport->Stop();
  if (executors) executors->Join();
  executors.reset();
  transport.reset();
}

void Server::Impl::CheckArenaRegistrations() {
  bool zero_copy = transport->device_memory_supported();
  const std::vector<Status>& results = transport->initial_registrations();
  for (size_t i = 0; i < arena_regions.size() && i < results.size(); ++i) {
    const MemoryRegion& r = arena_regions[i].region;
    const Status& s = results[i];
    const char* which = arena_regions[i].replica ? "replica " : "";
    // Device memory this UCX cannot move is staged through host memory: never registered.
    if (s.ok() || (r.kind == MemoryKind::kDevice && !transport->device_memory_supported())) {
      continue;
    }
    if (r.kind == MemoryKind::kDevice) {
      zero_copy = false;
      GKV_LOG_WARN(
          "registering the {}GPU tier's arena on device {} ({}) with UCX failed: {}; its "
          "objects are staged through host memory",
          which, r.device, FormatSize(r.size), s.ToString());
    } else {
      GKV_LOG_WARN(
          "registering the {}{} tier's memory ({}) with UCX failed: {}; UCX registers it per "
          "operation instead",
          which, TierName(r.tier), FormatSize(r.size), s.ToString());
    }
  }
  gpu_zero_copy.store(zero_copy, std::memory_order_relaxed);
}

void Server::Impl::RefreshTransportCounters() {
  const UcxTransport::RegistrationStats r = transport->registration_stats();
  counters.ucx_registered_regions.store(r.regions, std::memory_order_relaxed);
  counters.ucx_registered_bytes.store(r.bytes, std::memory_order_relaxed);
  counters.ucx_registered_ops.store(r.registered_ops, std::memory_order_relaxed);
}

Status Server::Impl::StartMetrics() {
  metrics_http = std::make_unique<httplib::Server>();
  metrics_http->Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
    RefreshTransportCounters();
    res.set_content(RenderPrometheus(self.id, cache->GetStats(), counters,
                                     replica_cache ? replica_cache->GetStats() : CacheStats{}),
                    "text/plain; version=0.0.4");
  });
  metrics_bound_port = options.metrics_port;
  // The address the node serves on (its cluster-file host, or --listen), not every interface:
  // a node on 127.0.0.1 keeps its metrics there too.
  const std::string host = options.listen_host.empty() ? self.host : options.listen_host;
  if (!metrics_http->bind_to_port(host, options.metrics_port)) {
    return Status::Unavailable("cannot listen for metrics on " + host + ":" +
                               std::to_string(options.metrics_port));
  }
  metrics_thread = std::thread([this] { metrics_http->listen_after_bind(); });
  // httplib's stop() does nothing until the loop runs: a stop right after this start (a failed
  // registration) would leave the thread to join forever.
  const auto until = Clock::now() + std::chrono::seconds(5);
  while (!metrics_http->is_running() && Clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return Status::OK();
}

int DefaultIoThreads() {
  const int cores = static_cast<int>(std::thread::hardware_concurrency());
  return std::clamp(cores / 4, 1, 16);
}

Server::Server(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Server::~Server() { Stop(); }

Result<std::unique_ptr<Server>> Server::Start(const ServerOptions& options) {
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  impl->replicas = std::max(1, options.cluster.replicas);
  const bool elastic = impl->elastic();
  if (elastic) {
    // The address this node registers: where it listens.
    if (options.node_id.empty()) return Status::InvalidArgument("a node needs an id");
    if (options.listen_host.empty()) {
      return Status::InvalidArgument("under etcd a node needs a listen address (--listen)");
    }
    if (!IsValidNodeWeight(options.weight)) {
      return Status::InvalidArgument("weight must be in (0, " +
                                     std::to_string(static_cast<int>(kMaxNodeWeight)) + "]");
    }
    impl->self =
        NodeInfo{options.node_id, options.listen_host, options.listen_port, options.weight};
    GKV_RETURN_IF_ERROR(impl->StartMembership());
    std::vector<NodeInfo> members;
    std::vector<int> slots;
    for (const NodeInfo& n : impl->view.RingNodes()) {
      if (n.id == impl->self.id) continue;  // not registered yet (an old record: expiring)
      members.push_back(n);
      slots.push_back(impl->options.cluster.FindNode(n.id));
    }
    impl->ring = std::make_shared<RingView>(impl->view.epoch, members, slots,
                                            impl->options.cluster.nodes.size());
  } else {
    int idx = options.cluster.FindNode(options.node_id);
    if (idx < 0) {
      return Status::InvalidArgument("node '" + options.node_id + "' is not in the cluster file");
    }
    impl->self = options.cluster.nodes[idx];
    impl->self_index = idx;
    std::vector<int> slots(options.cluster.nodes.size());
    for (size_t i = 0; i < slots.size(); ++i) slots[i] = static_cast<int>(i);
    impl->ring = std::make_shared<RingView>(0, options.cluster.nodes, std::move(slots),
                                            options.cluster.nodes.size());
  }
  const size_t table = impl->options.cluster.nodes.size();
  impl->peer_conn.assign(table, 0);
  impl->peer_down_until.assign(table, {});
  const int io_threads = options.io_threads > 0 ? options.io_threads : DefaultIoThreads();
  if (io_threads > UcxTransport::kMaxWorkers) {
    return Status::InvalidArgument("at most " + std::to_string(UcxTransport::kMaxWorkers) +
                                   " I/O threads");
  }
  CacheOptions own = options.cache;
  if (own.gpu_capacity > 0 && !own.gpu_tier_in_host_memory) {
    using P = ServerOptions::GpuPlacement;
    own.gpu_behind_host = options.gpu_placement == P::kBehindHost ||
                          (options.gpu_placement == P::kAuto && ProbeCuda().usable &&
                           !UcxTransport::CanMoveDeviceMemory());
  }
  impl->ring_epoch_now.store(impl->ring->epoch());
  impl->ring_shares = impl->ring->SharesByIndex();
  impl->copy_tokens = options.replication.max_copy_starts_per_s;
  impl->peer_load.resize(table);
  impl->report_again_after.resize(table);
  impl->next_attempt =
      static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::microseconds>(
                                std::chrono::system_clock::now().time_since_epoch())
                                .count());
  // (Under etcd the cluster may grow: replication is ready from the start.)
  if (options.replication.mode != HotnessRule::Mode::kOff &&
      (elastic || options.cluster.nodes.size() > 1)) {
    if (options.replica_share <= 0 || options.replica_share >= 1 || options.hot_replicas < 1) {
      return Status::InvalidArgument("replica share must be in (0, 1) and hot replicas >= 1");
    }
    // Copies held for other primaries get their own share of each memory tier and no disk.
    CacheOptions rep = own;  // (same placement)
    rep.gpu_capacity = static_cast<uint64_t>(options.cache.gpu_capacity * options.replica_share);
    rep.host_capacity = static_cast<uint64_t>(options.cache.host_capacity * options.replica_share);
    rep.disk_path.clear();
    rep.disk_capacity = 0;
    rep.max_key_size = options.cache.max_key_size + 17;  // key, a zero byte, version, attempt
    rep.promote_on_read = false;  // copies stay where they were installed (the top tier)
    own.gpu_capacity -= rep.gpu_capacity;
    own.host_capacity -= rep.host_capacity;
    // As many partitions as the node's own cache at most, fewer where the replica share would
    // leave slices under the automatic rule's minimum (an explicit count included: a small
    // share must not refuse every hot object, or fail to split at all).
    rep.placement_partitions = CacheOptions::AutoPartitions(
        rep,
        options.cache.placement_partitions > 0 ? options.cache.placement_partitions : io_threads);
    auto rc = TieredCache::Open(rep);
    if (!rc.ok()) return rc.status().WithContext("opening the replica cache");
    impl->replica_cache = std::move(*rc);
  }
  if (options.cache.placement_partitions <= 0) {
    own.placement_partitions = CacheOptions::AutoPartitions(own, io_threads);
  }
  auto cache = TieredCache::Open(own);
  if (!cache.ok()) return cache.status().WithContext("opening the cache");
  impl->cache = std::move(*cache);
  if (elastic) impl->BeginCatchUp();
  impl->executors = std::make_unique<ThreadPool>(std::max(1, options.executor_threads));
  // Streamed pieces bound for disk (or for GPU memory UCX cannot receive into) pass through
  // these buffers, all made now: the I/O threads only take cached ones (TryAcquireCached), so
  // their number bounds the memory streamed puts use.
  if (options.stream_buffers > 0 &&
      (impl->cache->tier_enabled(Tier::kDisk) || impl->cache->tier_enabled(Tier::kGpu))) {
    const uint64_t chunk = options.stream_chunk_size;
    impl->stream_pool =
        PinnedBufferPool::Create({chunk, chunk * static_cast<uint64_t>(options.stream_buffers)});
    std::vector<std::shared_ptr<std::byte[]>> made;
    for (int i = 0; i < options.stream_buffers; ++i) {
      auto b = impl->stream_pool->Acquire(chunk);
      if (!b.ok()) return b.status().WithContext("allocating the stream buffers");
      made.push_back(std::move(*b));
    }
  }

  for (int i = 0; i < io_threads; ++i) {
    impl->io.push_back(std::make_unique<Impl::IoWorker>());
    impl->io.back()->index = i;
    impl->io.back()->ring = impl->ring;
  }

  impl->counters.io_threads.store(static_cast<uint64_t>(io_threads));
  UcxTransport::Options topts;
  topts.workers = io_threads;
  topts.listen = true;
  topts.listen_host = options.listen_host.empty() ? impl->self.host : options.listen_host;
  topts.listen_port = options.listen_port ? options.listen_port : impl->self.port;
  // A node listening on loopback serves (and is a peer of) this host only.
  topts.loopback_only = UcxTransport::IsLoopbackHost(topts.listen_host);
  topts.register_regions = impl->ArenaRegions();
  Impl* raw = impl.get();
  UcxTransport::Handlers handlers;
  handlers.on_message = [raw](std::unique_ptr<Incoming> m) { raw->OnMessage(std::move(m)); };
  handlers.on_accept = [raw](ConnId) {
    raw->counters.connections_accepted.fetch_add(1, std::memory_order_relaxed);
  };
  handlers.on_disconnect = [raw](ConnId id, const Status& s) { raw->OnDisconnect(id, s); };
  handlers.on_tick = [raw] { raw->OnTick(); };
  // The I/O thread inherits the current CUDA device (UcxTransport::Create): the node's first
  // GPU when it has a GPU tier.
  const int caller_device = CudaCurrentDevice();  // given back after Create
  const bool bind_gpu = options.cache.gpu_capacity > 0 && !options.cache.gpu_devices.empty() &&
                        !options.cache.gpu_tier_in_host_memory;
  if (bind_gpu) {
    if (Status cs = CudaBindThread(options.cache.gpu_devices.front()); !cs.ok()) {
      GKV_LOG_WARN("no CUDA context on GPU {}: {}", options.cache.gpu_devices.front(),
                   cs.ToString());
    }
  }
  auto transport = UcxTransport::Create(topts, std::move(handlers));
  if (bind_gpu && caller_device >= 0) (void)CudaBindThread(caller_device);
  if (!transport.ok()) return transport.status();
  impl->transport = std::move(*transport);
  impl->CheckArenaRegistrations();
  // The worker thread ticks from inside Create: its timers and peer calls start only now that
  // `transport` is set.
  impl->ticking.store(true, std::memory_order_release);
  // A start that fails from here on undoes what it started, in reverse: the watcher first (no
  // callback posts to the transport after its destructor), the handoff thread (a joinable
  // thread must not be destroyed), the transport (its thread calls into impl).
  auto fail = [&impl](Status s) {
    impl->ticking.store(false, std::memory_order_release);
    impl->watcher.reset();
    impl->StopHandoffThread();
    if (impl->metrics_http) {
      impl->metrics_http->stop();
      if (impl->metrics_thread.joinable()) impl->metrics_thread.join();
    }
    impl->transport->Stop();
    // A drain request seen before registering (a previous run's) may have started this.
    if (impl->drain_thread.joinable()) impl->drain_thread.join();
    return s;
  };
  // Before registering, so that a node that cannot serve its metrics never joins the ring
  // (under etcd this failure ended in std::terminate: the handoff thread was left running).
  if (options.metrics_port) {
    if (Status ms = impl->StartMetrics(); !ms.ok()) return fail(ms);
  }
  if (elastic) {
    impl->StartHandoffThread();
    // Changes seen while the transport was starting: the view as it is now.
    MembershipView now = impl->watcher->Current();
    impl->transport->Post([raw, now] { raw->ApplyMembership(now); });
    Status rs = impl->RegisterSelf(impl->transport->listen_port());
    if (!rs.ok()) return fail(rs);
    if (impl->catching_up.load()) {
      GKV_LOG_INFO(
          "node {}: {} keys recovered from disk are held back until the cluster's "
          "handoff has compared their versions",
          impl->self.id, impl->recovered_keys);
    }
    impl->SyncHandoffMark();  // on while catching up (or a scan started before registering)
    // From now on the cluster routes to this run, and clients see its mark.
    impl->transport->Post([raw] { raw->joined_at.store(Clock::now()); });
  }
  const Impl& I = *impl;
  auto tier = [&](Tier t) {
    return I.cache->tier_enabled(t) ? FormatSize(I.cache->tier_capacity(t)) : std::string("off");
  };
  std::string replication = "replication off";
  if (I.replica_cache) {
    const HotnessRule& rule = options.replication;
    replication = rule.mode == HotnessRule::Mode::kAbsolute
                      ? fmt::format("replication of keys above {} reads/s", rule.hot_reads_per_s)
                      : fmt::format("replication auto (hot share {}, load slack {})",
                                    rule.hot_share, rule.load_slack);
  }
  const int parts = I.cache->placement_partitions();
  GKV_LOG_INFO(
      "node {} up on {}:{} (gpu {}{}, host {}, disk {}; {} placement partition{}; {}; {}, {} I/O "
      "thread{}){}",
      I.self.id, topts.listen_host, I.transport->listen_port(), tier(Tier::kGpu),
      !ProbeCuda().fake ? ""
      : FakeDeviceKind() == FakeDevice::kMovedByUcx
          ? " FAKE DEVICE (GKV_FAKE_DEVICE=ucx: host memory, moved by UCX)"
          : " FAKE DEVICE (GKV_FAKE_DEVICE=1: host memory, staged)",
      tier(Tier::kHost), tier(Tier::kDisk), parts, parts == 1 ? "" : "s", replication,
      I.transport->Describe(), io_threads, io_threads == 1 ? "" : "s",
      options.cluster.secret.empty() ? "" : "; clients must present the cluster secret");
  return std::unique_ptr<Server>(new Server(std::move(impl)));
}

void Server::Stop() {
  Impl* I = impl_.get();
  std::call_once(I->stop_once, [I] {
    // Under etcd a stop is a departure: keys go to their new owners first (the node still serves
    // meanwhile), then the registration goes.
    if (I->registration && !I->drained.load()) I->Leave(I->options.leave_timeout);
    if (I->drain_thread.joinable()) I->drain_thread.join();
    I->StopHandoffThread();
    I->watcher.reset();  // no more views posted
    I->stopping.store(true, std::memory_order_release);
    // Let what is in flight finish (bounded: a stuck peer must not block shutdown forever).
    auto deadline = Clock::now() + std::chrono::seconds(10);
    while (I->in_flight.load(std::memory_order_acquire) > 0 && Clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    // Nothing can be installed now (stopping refuses every request): a node that left the
    // cluster and holds no key (its leave handed every one off, and no peer whose ring lagged
    // handed one in since) answers as one that holds nothing until it exits.
    bool left = false;
    {
      std::lock_guard<std::mutex> lock(I->leave_mu);
      left = I->left_cluster;
    }
    if (left && I->cache->ListKeys().empty()) {
      I->holds_nothing.store(true, std::memory_order_release);
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
    // Join before reset: reset() nulls `executors` before the pool's destructor runs what is
    // queued, so a queued task reaching `executors` would dereference null.
    I->executors->Join();
    I->executors.reset();
    I->transport.reset();
    // Streams never committed release their reservations (and chunks) before the write-back.
    {
      std::lock_guard<std::mutex> lock(I->streams_mu);
      I->streams.clear();
    }
    Status fs = I->cache->Flush();
    if (!fs.ok()) GKV_LOG_ERROR("flush at shutdown failed: {}", fs.ToString());
    GKV_LOG_INFO("node {} stopped", I->self.id);
  });
}

bool Server::drained() const { return impl_->drained.load(std::memory_order_acquire); }

uint16_t Server::port() const { return impl_->transport ? impl_->transport->listen_port() : 0; }
uint16_t Server::metrics_port() const { return static_cast<uint16_t>(impl_->metrics_bound_port); }

TieredCache& Server::cache() { return *impl_->cache; }

}  // namespace gkv
