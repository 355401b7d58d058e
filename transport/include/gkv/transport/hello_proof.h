// HELLO and PEER_HELLO prove that the caller knows the cluster's secret without sending it
// (docs/PROTOCOL.md, "Access control"). The proof is
//   nonce (16 random bytes) | unix_ms (u64, little-endian: the caller's clock) |
//   HMAC-SHA256(secret, label | to | from | nonce | unix_ms)
// 56 bytes, where `label` tells client hellos from peer hellos, `to` is the id of the node the
// connection goes to (a proof made for one node is refused by every other) and `from` is the
// calling node's id (empty for clients). A node takes a proof once (HelloReplayGuard) and only
// within kHelloWindow of its own clock, so a captured hello cannot be replayed.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_set>

#include "gkv/status.h"

namespace gkv::wire {

inline constexpr std::string_view kClientHelloLabel = "gkv client hello 1";
inline constexpr std::string_view kPeerHelloLabel = "gkv peer hello 1";
inline constexpr size_t kHelloProofSize = 16 + 8 + 32;
// How far a proof's clock may be from the node's; a used nonce is remembered twice this, and a
// minute more, from its arrival.
inline constexpr std::chrono::minutes kHelloWindow{5};

// The proof of `secret` for a hello from `from` to the node `to`, made now. Empty when the
// secret is (a cluster without one: nothing to prove).
std::string MakeHelloProof(std::string_view secret, std::string_view label, std::string_view to,
                           std::string_view from);

// OK when `proof` proves `secret` for this hello at `now_unix_ms`; PermissionDenied saying why
// not (not a proof: e.g. a client from before proofs, which sends the secret itself; a clock
// outside the window; a wrong secret or another node's proof). Says nothing about replays.
Status CheckHelloProof(std::string_view proof, std::string_view secret, std::string_view label,
                       std::string_view to, std::string_view from, uint64_t now_unix_ms);

uint64_t UnixMillisNow();

// The nonces of the proofs a node took in the last 2 x kHelloWindow + 1 min: a proof whose
// nonce is here is a replay. In memory: a proof captured up to kHelloWindow before a node
// restarts can be replayed to the restarted node once. Bounded: past kMaxNonces remembered at once,
// new hellos are refused (Busy) until old ones age out. Thread-safe.
class HelloReplayGuard {
 public:
  static constexpr size_t kMaxNonces = 1 << 20;
  // Records the nonce of a proof CheckHelloProof accepted; PermissionDenied if it was seen.
  Status Admit(std::string_view proof, std::chrono::steady_clock::time_point now);
  size_t size() const;

 private:
  mutable std::mutex mu_;
  std::unordered_set<std::string> seen_;  // guarded by mu_
  std::deque<std::pair<std::chrono::steady_clock::time_point, std::string>> by_arrival_;  // mu_
};

}  // namespace gkv::wire
