// Calls to other nodes: peer connections (PEER_HELLO first), replies matched on (connection,
// id), deadlines and timers. See server_impl.h for the map of server/.
#include <algorithm>

#include "gkv/log.h"
#include "gkv/transport/hello_proof.h"
#include "server_impl.h"

namespace gkv {

Result<ConnId> Server::Impl::PeerConn(int node) {
  if (peer_conn[node] != 0 && transport->IsOpen(peer_conn[node])) return peer_conn[node];
  const NodeInfo& n = options.cluster.nodes[node];
  GKV_ASSIGN_OR_RETURN(ConnId conn, transport->Connect(n.host, n.port));
  peer_conn[node] = conn;
  peer_of_conn[conn] = node;
  // First on the endpoint (ordered before every call): who this node is. Its reply (id 0)
  // matches no call and is dropped; a refusal closes the connection, failing the calls.
  transport->Send(
      conn, w::kAmRequest,
      w::EncodeMessage({w::Opcode::kPeerHello, 0, 0},
                       w::EncodePeerHello(self.id,
                                          w::MakeHelloProof(options.cluster.effective_peer_secret(),
                                                            w::kPeerHelloLabel, n.id, self.id),
                                          HashRing::kPlacementVersion)),
      nullptr, 0, MemoryKind::kHost, [](Status) {});
  return conn;
}

void Server::Impl::CallPeer(int node, w::Opcode op, std::string body,
                            std::shared_ptr<std::string> payload,
                            std::function<void(Status, std::string_view)> done, uint16_t flags,
                            std::chrono::milliseconds budget) {
  // A peer whose connection was just lost is not dialled again on every call.
  if (Clock::now() < peer_down_until[node]) {
    return done(Status::Unavailable("peer " + options.cluster.nodes[node].id + " is down"), {});
  }
  auto conn = PeerConn(node);
  if (!conn.ok()) return done(conn.status(), {});
  const uint64_t id = next_peer_call++;
  const auto deadline = Clock::now() + budget;
  peer_calls[id] = PeerCall{node, *conn, deadline, done};
  peer_deadlines.push({deadline, id});
  // The budget travels too: a replica drops an install that arrives after the caller gave up.
  transport->Send(*conn, w::kAmRequest,
                  w::EncodeMessage({op, flags, id, static_cast<uint32_t>(budget.count())}, body),
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

void Server::Impl::OnPeerReply(std::unique_ptr<Incoming> msg) {
  w::Header h;
  std::string_view body;
  if (!w::DecodeMessage(msg->header().data(), msg->header().size(), &h, &body).ok()) return;
  // Only on a connection this node opened to a peer, and only for a call made on it: a client
  // (or any other connection) can never answer a pending INVALIDATE or REPLICA_PUT.
  auto from = peer_of_conn.find(msg->conn());
  if (from == peer_of_conn.end()) return;
  if (h.request_id == 0) {  // PEER_HELLO's answer: only a refusal is worth a word
    w::ReplyStatus rs;
    if (!w::DecodeStatusPrefix(body, &rs).ok() || rs.code == StatusCode::kOk) return;
    const int node = from->second;
    if (rs.code == StatusCode::kNotSupported) {
      // Another placement version: not dialled again for a while (its calls fail fast
      // meanwhile), so the refusal is logged once a period rather than on every call.
      peer_down_until[node] = Clock::now() + kPeerRefusedFor;
      GKV_LOG_ERROR("peer {} refused this node's PEER_HELLO: {}",
                    LogKey(options.cluster.nodes[node].id), rs.ToStatus().ToString());
    } else {
      // Often passing: a peer whose watch has not applied this node's record yet does not know
      // its id. (A build before placement versions refuses this build's hello this way too.)
      GKV_LOG_DEBUG("peer {} refused this node's PEER_HELLO: {}",
                    LogKey(options.cluster.nodes[node].id), rs.ToStatus().ToString());
    }
    return;
  }
  auto it = peer_calls.find(h.request_id);
  if (it == peer_calls.end() || it->second.conn != msg->conn()) return;
  auto cb = std::move(it->second.done);
  peer_calls.erase(it);
  answered_conns.insert(msg->conn());
  w::ReplyStatus rs;
  Status s = w::DecodeStatusPrefix(body, &rs);  // some replies carry more (LOAD_REPORT's rate)
  cb(s.ok() ? rs.ToStatus() : s, body);
}

void Server::Impl::ExpirePeerCalls(Clock::time_point now) {
  while (!peer_deadlines.empty() && peer_deadlines.top().first <= now) {
    const uint64_t id = peer_deadlines.top().second;
    peer_deadlines.pop();
    auto it = peer_calls.find(id);
    if (it == peer_calls.end()) continue;  // answered or failed already
    auto cb = std::move(it->second.done);
    peer_calls.erase(it);
    cb(Status::Timeout("peer did not answer"), {});
  }
}

void Server::Impl::AddTimer(Clock::time_point due, std::function<void()> fn) {
  timers.push_back({due, next_timer++, std::move(fn)});
  std::push_heap(timers.begin(), timers.end(), std::greater<Timer>());
}

void Server::Impl::RunTimers(Clock::time_point now) {
  // Due ones first, then run: a timer may add timers.
  std::vector<std::function<void()>> due;
  while (!timers.empty() && timers.front().due <= now) {
    std::pop_heap(timers.begin(), timers.end(), std::greater<Timer>());
    due.push_back(std::move(timers.back().fn));
    timers.pop_back();
  }
  for (auto& fn : due) fn();
}

void Server::Impl::OnPeerDisconnect(ConnId conn) {
  auto it = peer_of_conn.find(conn);
  if (it == peer_of_conn.end()) return;
  const int node = it->second;
  peer_of_conn.erase(it);
  if (peer_conn[node] == conn) peer_conn[node] = 0;
  // Only a connection the peer had answered on: one dialled before the peer listened (nodes
  // starting together) says nothing about it once it is up.
  if (answered_conns.erase(conn) > 0) peer_down_until[node] = Clock::now() + kPeerDownFor;
  std::vector<uint64_t> failed;
  for (auto& [id, call] : peer_calls) {
    if (call.conn == conn) failed.push_back(id);  // not calls already on a newer connection
  }
  for (uint64_t id : failed) {
    auto cb = std::move(peer_calls[id].done);
    peer_calls.erase(id);
    cb(Status::Unavailable("peer connection lost"), {});
  }
}

}  // namespace gkv
