#include "gkv/transport/hello_proof.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>

#include <random>

#include "gkv/bytes.h"

namespace gkv::wire {

namespace {

constexpr size_t kNonceSize = 16;
constexpr size_t kMacSize = 32;

// HMAC-SHA256 over the fields, each length-prefixed so that no two field lists hash alike.
std::string Mac(std::string_view secret, std::string_view label, std::string_view to,
                std::string_view from, std::string_view nonce_and_time) {
  std::string data;
  ByteWriter w(&data);
  w.String(label);
  w.String(to);
  w.String(from);
  w.String(nonce_and_time);
  unsigned char out[EVP_MAX_MD_SIZE];
  unsigned int n = 0;
  HMAC(EVP_sha256(), secret.data(), static_cast<int>(secret.size()),
       reinterpret_cast<const unsigned char*>(data.data()), data.size(), out, &n);
  return std::string(reinterpret_cast<const char*>(out), n);
}

}  // namespace

uint64_t UnixMillisNow() {
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::milliseconds>(
                                   std::chrono::system_clock::now().time_since_epoch())
                                   .count());
}

std::string MakeHelloProof(std::string_view secret, std::string_view label, std::string_view to,
                           std::string_view from) {
  if (secret.empty()) return {};
  std::string proof(kNonceSize, '\0');
  if (RAND_bytes(reinterpret_cast<unsigned char*>(proof.data()), kNonceSize) != 1) {
    std::random_device rd;  // OpenSSL's generator failed: the OS's, which is as good here
    for (char& c : proof) c = static_cast<char>(rd());
  }
  ByteWriter(&proof).U64(UnixMillisNow());
  proof += Mac(secret, label, to, from, proof);
  return proof;
}

Status CheckHelloProof(std::string_view proof, std::string_view secret, std::string_view label,
                       std::string_view to, std::string_view from, uint64_t now_unix_ms) {
  if (proof.size() != kHelloProofSize) {
    return Status::PermissionDenied(
        "the hello carries no proof of the secret (a gkv build from before proofs sends the "
        "secret itself: upgrade it)");
  }
  ByteReader r(proof.substr(kNonceSize, 8));
  uint64_t made = 0;
  (void)r.U64(&made);
  const uint64_t window = std::chrono::milliseconds(kHelloWindow).count();
  const uint64_t off = made > now_unix_ms ? made - now_unix_ms : now_unix_ms - made;
  if (off > window) {
    return Status::PermissionDenied("the hello's clock is " + std::to_string(off / 1000) +
                                    " s off this node's (at most " + std::to_string(window / 1000) +
                                    " s)");
  }
  const std::string want = Mac(secret, label, to, from, proof.substr(0, kNonceSize + 8));
  if (want.size() != kMacSize ||
      CRYPTO_memcmp(want.data(), proof.data() + kNonceSize + 8, kMacSize) != 0) {
    return Status::PermissionDenied("wrong secret");
  }
  return Status::OK();
}

Status HelloReplayGuard::Admit(std::string_view proof, std::chrono::steady_clock::time_point now) {
  const std::string nonce(proof.substr(0, kNonceSize));
  std::lock_guard<std::mutex> lock(mu_);
  // Past this from its arrival a proof's clock is out of the window (plus a minute for a
  // wall clock that steps back meanwhile), so its nonce can go.
  const auto keep = std::chrono::duration_cast<std::chrono::steady_clock::duration>(
      2 * kHelloWindow + std::chrono::minutes(1));
  while (!by_arrival_.empty() && now - by_arrival_.front().first > keep) {
    seen_.erase(by_arrival_.front().second);
    by_arrival_.pop_front();
  }
  if (seen_.count(nonce)) return Status::PermissionDenied("a hello replayed");
  if (seen_.size() >= kMaxNonces) {
    return Status::Busy("too many hellos in the last " +
                        std::to_string(std::chrono::minutes(2 * kHelloWindow).count() + 1) +
                        " minutes; try again later");
  }
  seen_.insert(nonce);
  by_arrival_.emplace_back(now, nonce);
  return Status::OK();
}

size_t HelloReplayGuard::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return seen_.size();
}

}  // namespace gkv::wire
