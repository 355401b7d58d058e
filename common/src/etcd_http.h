// A small client for etcd's v3 JSON gateway (private to gkv_common; gkv/membership.h is the
// API). Keys and values are bytes on our side; the gateway wants them base64-encoded and sends
// int64 fields as JSON strings: both are translated here, and nowhere else.
//
// Every unary call tries the endpoints in order (starting with the one that last answered) and
// gives up on an endpoint after a short connect and read timeout, so a dead etcd is an
// Unavailable Status within seconds, never a hang. etcd's own errors become a Status by their
// gRPC code (NotFound for an unknown lease, and so on).
//
// Thread-safety: EtcdClient may be used from any number of threads at once (each call uses its
// own HTTP connection). A WatchStream runs on one thread; only Cancel() may come from another.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "gkv/status.h"

namespace httplib {
class Client;
}

namespace gkv::etcd {

std::string Base64Encode(std::string_view bytes);
Result<std::string> Base64Decode(std::string_view text);
// The range_end that makes a range or watch cover every key starting with `prefix`.
std::string PrefixEnd(std::string_view prefix);

struct KeyValue {
  std::string key;
  std::string value;
  int64_t create_revision = 0;
  int64_t mod_revision = 0;
  int64_t lease = 0;
};

struct RangeResult {
  int64_t revision = 0;  // the store's revision the result is current at
  std::vector<KeyValue> kvs;
};

struct TxnResult {
  int64_t revision = 0;
  bool succeeded = false;
};

// One operation of a transaction (nlohmann::json objects in the gateway's format, built by the
// helpers below, so that callers need not know it).
struct TxnOp {
  std::shared_ptr<const nlohmann::json> json;
};
TxnOp PutOp(std::string_view key, std::string_view value, int64_t lease = 0);
TxnOp DeleteOp(std::string_view key);
// Compares: members of a txn's condition list.
TxnOp KeyMissing(std::string_view key);                 // create_revision == 0
TxnOp KeyExists(std::string_view key);                  // create_revision > 0
TxnOp KeyOnLease(std::string_view key, int64_t lease);  // the key is attached to `lease`

struct Timeouts {
  std::chrono::milliseconds connect{1000};
  std::chrono::milliseconds read{2000};
};

// etcd's user/password authentication: /v3/auth/authenticate trades them for a token that
// goes with every call (the Authorization header). Empty: etcd runs without authentication.
struct Credentials {
  std::string username, password;
  bool empty() const { return username.empty(); }
};

// A token for `credentials` from the etcd at `endpoint`. PermissionDenied for a wrong user or
// password, and for an etcd that runs without authentication (it refuses to authenticate).
Result<std::string> Authenticate(const std::string& endpoint, const Credentials& credentials,
                                 Timeouts timeouts);

class EtcdClient {
 public:
  // `endpoints`: "http://host:port", already validated (ParseClusterYaml).
  explicit EtcdClient(std::vector<std::string> endpoints, Timeouts timeouts = {},
                      Credentials credentials = {});

  Result<RangeResult> Range(std::string_view key, std::string_view range_end = "");
  // Returns the revision of the write.
  Result<int64_t> Put(std::string_view key, std::string_view value, int64_t lease = 0);
  Result<int64_t> Delete(std::string_view key, std::string_view range_end = "");
  Result<TxnResult> Txn(const std::vector<TxnOp>& compare, const std::vector<TxnOp>& success,
                        const std::vector<TxnOp>& failure = {});
  struct Lease {
    int64_t id = 0;
    int64_t ttl_s = 0;  // as granted: etcd raises a TTL below its minimum
  };
  Result<Lease> LeaseGrant(int64_t ttl_s);
  // The lease's remaining TTL after the refresh; 0 when etcd no longer knows the lease.
  Result<int64_t> LeaseKeepAlive(int64_t id);
  Status LeaseRevoke(int64_t id);

  const std::vector<std::string>& endpoints() const { return endpoints_; }
  const Timeouts& timeouts() const { return timeouts_; }

 private:
  // POSTs `body` to `path` on the first endpoint that answers; the parsed JSON reply.
  Result<nlohmann::json> Call(const std::string& path, const nlohmann::json& body);

  const std::vector<std::string> endpoints_;
  const Timeouts timeouts_;
  const Credentials credentials_;
  std::atomic<size_t> preferred_{0};  // the endpoint that answered last
  std::mutex token_mu_;
  std::string token_;  // guarded by token_mu_: the last token etcd gave (empty: none yet)
};

// One event of a watch: a put (value set) or a delete of `kv.key`.
struct WatchEvent {
  bool is_delete = false;
  KeyValue kv;
};

// One message of a watch stream.
struct WatchMessage {
  bool created = false;  // the first message: the watch is established
  int64_t header_revision = 0;
  int64_t compact_revision = 0;  // > 0: start_revision was compacted; the stream is cancelled
  bool canceled = false;
  std::vector<WatchEvent> events;  // in revision order
};

// A watch of [key, range_end) from `start_revision`, over one streaming HTTP request.
class WatchStream {
 public:
  // Returns whether the stream goes on (false ends it: Run returns Aborted).
  using Handler = std::function<bool(const WatchMessage&)>;
  WatchStream(std::vector<std::string> endpoints, Timeouts connect_timeouts,
              std::chrono::milliseconds idle_timeout, Credentials credentials = {});
  ~WatchStream();

  // Blocks until the stream ends: Cancel(), a broken connection, an error from etcd, a
  // cancelled watch (compaction), `idle_timeout` without any message, or `handler` returning
  // false. Calls `handler` on this thread for each message. Returns Aborted after Cancel() or a
  // handler's false, else why the stream ended (Unavailable for a connection that never got
  // established or broke).
  Status Run(std::string_view key, std::string_view range_end, int64_t start_revision,
             const Handler& handler);
  // Ends a Run() in progress, or the next one, promptly. Thread-safe; idempotent.
  void Cancel();

 private:
  const std::vector<std::string> endpoints_;
  const Timeouts timeouts_;
  const std::chrono::milliseconds idle_timeout_;
  const Credentials credentials_;
  std::atomic<bool> cancelled_{false};
  std::mutex client_mu_;                     // guards client_ (the pointer, not its use)
  std::shared_ptr<httplib::Client> client_;  // the HTTP client of the Run() in progress
  size_t preferred_ = 0;
};

}  // namespace gkv::etcd
