#include "etcd_http.h"

#include <httplib.h>

#include <charconv>
#include <nlohmann/json.hpp>

namespace gkv::etcd {
namespace {

using nlohmann::json;

constexpr char kBase64Alphabet[] =
    "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

// The gateway writes int64 fields as JSON strings and leaves out fields that are zero.
int64_t Int(const json& object, const char* field) {
  auto it = object.find(field);
  if (it == object.end() || it->is_null()) return 0;
  if (it->is_number_integer()) return it->get<int64_t>();
  if (it->is_string()) {
    const std::string& s = it->get_ref<const std::string&>();
    int64_t value = 0;
    auto [ptr, ec] = std::from_chars(s.data(), s.data() + s.size(), value);
    if (ec == std::errc() && ptr == s.data() + s.size()) return value;
  }
  return 0;
}

bool Bool(const json& object, const char* field) {
  auto it = object.find(field);
  return it != object.end() && it->is_boolean() && it->get<bool>();
}

std::string Str(const json& object, const char* field) {
  auto it = object.find(field);
  return it != object.end() && it->is_string() ? it->get<std::string>() : std::string();
}

Result<KeyValue> ParseKeyValue(const json& kv) {
  if (!kv.is_object()) return Status::ProtocolError("etcd: a kv is not an object");
  KeyValue out;
  GKV_ASSIGN_OR_RETURN(out.key, Base64Decode(Str(kv, "key")));
  GKV_ASSIGN_OR_RETURN(out.value, Base64Decode(Str(kv, "value")));
  out.create_revision = Int(kv, "create_revision");
  out.mod_revision = Int(kv, "mod_revision");
  out.lease = Int(kv, "lease");
  return out;
}

// etcd's errors arrive as {"error": ..., "code": <gRPC code>, "message": ...}.
Status StatusFromGrpc(int code, const std::string& message) {
  const std::string m = "etcd: " + message;
  switch (code) {
    case 3:   // INVALID_ARGUMENT
    case 11:  // OUT_OF_RANGE (e.g. a compacted revision)
      return Status::InvalidArgument(m);
    case 4:  // DEADLINE_EXCEEDED
      return Status::Timeout(m);
    case 5:  // NOT_FOUND (e.g. "requested lease not found")
      return Status::NotFound(m);
    case 7:   // PERMISSION_DENIED
    case 16:  // UNAUTHENTICATED
      return Status::PermissionDenied(m);
    case 8:  // RESOURCE_EXHAUSTED
      return Status::Busy(m);
    case 12:  // UNIMPLEMENTED
      return Status::NotSupported(m);
    case 13:  // INTERNAL
      return Status::Internal(m);
    default:  // UNAVAILABLE ("no leader", "request timed out"), UNKNOWN, ...: worth a retry
      return Status::Unavailable(m);
  }
}

Status StatusFromErrorBody(const std::string& body, int http_status) {
  json reply = json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (reply.is_object() && reply.contains("code")) {
    return StatusFromGrpc(static_cast<int>(Int(reply, "code")), Str(reply, "message"));
  }
  return Status::Unavailable("etcd: HTTP " + std::to_string(http_status));
}

std::string TransportError(const std::string& endpoint, httplib::Error error) {
  std::string what;
  switch (error) {
    case httplib::Error::Connection:
      what = "cannot connect";
      break;
    case httplib::Error::ConnectionTimeout:
      what = "connect timed out";
      break;
    case httplib::Error::Read:
      what = "no reply (connection lost or read timed out)";
      break;
    case httplib::Error::Write:
      what = "cannot send the request";
      break;
    case httplib::Error::Canceled:
      what = "cancelled";
      break;
    default:
      what = httplib::to_string(error);
  }
  return "etcd at " + endpoint + ": " + what;
}

}  // namespace

std::string Base64Encode(std::string_view bytes) {
  std::string out;
  out.reserve((bytes.size() + 2) / 3 * 4);
  size_t i = 0;
  for (; i + 3 <= bytes.size(); i += 3) {
    const uint32_t n = (uint32_t(uint8_t(bytes[i])) << 16) |
                       (uint32_t(uint8_t(bytes[i + 1])) << 8) | uint8_t(bytes[i + 2]);
    out.push_back(kBase64Alphabet[(n >> 18) & 63]);
    out.push_back(kBase64Alphabet[(n >> 12) & 63]);
    out.push_back(kBase64Alphabet[(n >> 6) & 63]);
    out.push_back(kBase64Alphabet[n & 63]);
  }
  if (i + 1 == bytes.size()) {
    const uint32_t n = uint32_t(uint8_t(bytes[i])) << 16;
    out.push_back(kBase64Alphabet[(n >> 18) & 63]);
    out.push_back(kBase64Alphabet[(n >> 12) & 63]);
    out += "==";
  } else if (i + 2 == bytes.size()) {
    const uint32_t n = (uint32_t(uint8_t(bytes[i])) << 16) | (uint32_t(uint8_t(bytes[i + 1])) << 8);
    out.push_back(kBase64Alphabet[(n >> 18) & 63]);
    out.push_back(kBase64Alphabet[(n >> 12) & 63]);
    out.push_back(kBase64Alphabet[(n >> 6) & 63]);
    out.push_back('=');
  }
  return out;
}

Result<std::string> Base64Decode(std::string_view text) {
  if (text.size() % 4 != 0) return Status::ProtocolError("etcd: base64 of a bad length");
  std::string out;
  out.reserve(text.size() / 4 * 3);
  for (size_t i = 0; i < text.size(); i += 4) {
    uint32_t n = 0;
    int padding = 0;
    for (size_t j = 0; j < 4; ++j) {
      const char c = text[i + j];
      uint32_t v = 0;
      if (c == '=' && i + 4 == text.size() && j >= 2) {
        ++padding;
      } else if (padding > 0) {
        return Status::ProtocolError("etcd: base64 with data after the padding");
      } else if (c >= 'A' && c <= 'Z') {
        v = c - 'A';
      } else if (c >= 'a' && c <= 'z') {
        v = c - 'a' + 26;
      } else if (c >= '0' && c <= '9') {
        v = c - '0' + 52;
      } else if (c == '+') {
        v = 62;
      } else if (c == '/') {
        v = 63;
      } else {
        return Status::ProtocolError("etcd: not base64");
      }
      n = (n << 6) | v;
    }
    out.push_back(static_cast<char>((n >> 16) & 0xff));
    if (padding < 2) out.push_back(static_cast<char>((n >> 8) & 0xff));
    if (padding < 1) out.push_back(static_cast<char>(n & 0xff));
  }
  return out;
}

std::string PrefixEnd(std::string_view prefix) {
  std::string end(prefix);
  while (!end.empty()) {
    if (static_cast<uint8_t>(end.back()) < 0xff) {
      end.back() = static_cast<char>(static_cast<uint8_t>(end.back()) + 1);
      return end;
    }
    end.pop_back();
  }
  return std::string(1, '\0');  // etcd's "every key"
}

TxnOp PutOp(std::string_view key, std::string_view value, int64_t lease) {
  json put = {{"key", Base64Encode(key)}, {"value", Base64Encode(value)}};
  if (lease != 0) put["lease"] = std::to_string(lease);
  return {std::make_shared<json>(json{{"request_put", std::move(put)}})};
}

TxnOp DeleteOp(std::string_view key) {
  return {std::make_shared<json>(json{{"request_delete_range", {{"key", Base64Encode(key)}}}})};
}

TxnOp KeyMissing(std::string_view key) {
  return {std::make_shared<json>(json{{"target", "CREATE"},
                                      {"key", Base64Encode(key)},
                                      {"result", "EQUAL"},
                                      {"create_revision", "0"}})};
}

TxnOp KeyExists(std::string_view key) {
  return {std::make_shared<json>(json{{"target", "CREATE"},
                                      {"key", Base64Encode(key)},
                                      {"result", "GREATER"},
                                      {"create_revision", "0"}})};
}

TxnOp KeyOnLease(std::string_view key, int64_t lease) {
  return {std::make_shared<json>(json{{"target", "LEASE"},
                                      {"key", Base64Encode(key)},
                                      {"result", "EQUAL"},
                                      {"lease", std::to_string(lease)}})};
}

namespace {

// etcd answers a missing, expired or refused authentication with several codes (user name is
// empty and authentication failed are INVALID_ARGUMENT): all are PermissionDenied here, saying
// what to set.
Status AuthError(Status s, bool have_credentials) {
  const std::string_view m = s.message();
  if (m.find("authentication is not enabled") != std::string_view::npos) {
    return Status::PermissionDenied(std::string(m) +
                                    " (etcd.username is set, but this etcd runs without "
                                    "authentication: remove username and password)");
  }
  const bool auth = m.find("user name is empty") != std::string_view::npos ||
                    m.find("authentication failed") != std::string_view::npos ||
                    m.find("auth token") != std::string_view::npos ||
                    m.find("revision of auth store is old") != std::string_view::npos ||
                    m.find("permission denied") != std::string_view::npos;
  if (!auth && s.code() != StatusCode::kPermissionDenied) return s;
  return Status::PermissionDenied(
      std::string(m) + (have_credentials ? " (check etcd.username and etcd.password)"
                                         : " (this etcd requires a user: set etcd.username and "
                                           "etcd.password, or password_env, in the cluster file)"));
}

// A token etcd no longer takes: expired (simple tokens lapse after --auth-token-ttl idle),
// from a restarted etcd, or issued before the auth store changed (a user or role added or
// changed: etcd then refuses every older token as "revision of auth store is old", as etcd's
// own client renews on).
bool TokenRejected(const Status& s) {
  const std::string_view m = s.message();
  return m.find("auth token") != std::string_view::npos ||
         m.find("revision of auth store is old") != std::string_view::npos ||
         m.find("user name is empty") != std::string_view::npos;
}

// One POST of JSON. etcd's gateway sends error replies chunked with a gRPC trailer that
// cpp-httplib 0.11 cannot parse: it reports a read error after the whole reply arrived. So the
// status and body are collected as they come, and an error reply whose body arrived whole
// counts, trailer or not (without this an auth refusal read as "no reply").
struct HttpReply {
  int status = 0;  // 0: no reply (see error)
  std::string body;
  httplib::Error error = httplib::Error::Success;
};

// A connection per call: calls are rare (a keepalive every few seconds), and a fresh
// connection never inherits a half-dead socket from an etcd that restarted.
HttpReply PostJson(const std::string& endpoint, Timeouts timeouts, const std::string& path,
                   const httplib::Headers& headers, const std::string& payload) {
  httplib::Client http(endpoint);
  http.set_connection_timeout(timeouts.connect);
  http.set_read_timeout(timeouts.read);
  http.set_write_timeout(timeouts.read);
  http.set_keep_alive(false);
  HttpReply out;
  httplib::Request req;
  req.method = "POST";
  req.path = path;
  req.headers = headers;
  req.body = payload;
  req.set_header("Content-Type", "application/json");
  req.response_handler = [&](const httplib::Response& r) {
    out.status = r.status;
    return true;
  };
  req.content_receiver = [&](const char* data, size_t size, uint64_t, uint64_t) {
    out.body.append(data, size);
    return true;
  };
  httplib::Response res;
  if (http.send(req, res, out.error)) {
    out.status = res.status;
    return out;
  }
  if (!(out.status >= 400 && json::accept(out.body))) out.status = 0;
  return out;
}

}  // namespace

Result<std::string> Authenticate(const std::string& endpoint, const Credentials& credentials,
                                 Timeouts timeouts) {
  const std::string payload =
      json{{"name", credentials.username}, {"password", credentials.password}}.dump();
  const HttpReply res = PostJson(endpoint, timeouts, "/v3/auth/authenticate", {}, payload);
  if (res.status == 0) return Status::Unavailable(TransportError(endpoint, res.error));
  if (res.status != 200) {
    Status s = StatusFromErrorBody(res.body, res.status);
    if (s.code() == StatusCode::kUnavailable) return s.WithContext(endpoint);
    return AuthError(s, true);
  }
  json reply = json::parse(res.body, nullptr, /*allow_exceptions=*/false);
  if (!reply.is_object() || Str(reply, "token").empty()) {
    return Status::ProtocolError("etcd at " + endpoint + ": authenticate gave no token");
  }
  return Str(reply, "token");
}

EtcdClient::EtcdClient(std::vector<std::string> endpoints, Timeouts timeouts,
                       Credentials credentials)
    : endpoints_(std::move(endpoints)), timeouts_(timeouts), credentials_(std::move(credentials)) {}

Result<json> EtcdClient::Call(const std::string& path, const json& body) {
  if (endpoints_.empty()) return Status::InvalidArgument("etcd: no endpoints");
  const std::string payload = body.dump();
  Status last = Status::Unavailable("etcd: no endpoint answered");
  const size_t first = preferred_.load(std::memory_order_relaxed);
  // A token an endpoint no longer takes is renewed there once per call (simple tokens live
  // per member, so another endpoint may refuse one this one took).
  size_t renewed_at = SIZE_MAX;
  for (size_t attempt = 0; attempt < endpoints_.size(); ++attempt) {
    const size_t index = (first + attempt) % endpoints_.size();
    const std::string& endpoint = endpoints_[index];
    httplib::Headers headers;
    std::string token;  // the one sent (empty: none)
    if (!credentials_.empty()) {
      {
        std::lock_guard<std::mutex> lock(token_mu_);
        token = token_;
      }
      if (token.empty()) {
        auto fresh = Authenticate(endpoint, credentials_, timeouts_);
        if (!fresh.ok()) {
          if (fresh.status().code() == StatusCode::kPermissionDenied) return fresh.status();
          last = fresh.status();
          continue;
        }
        token = *fresh;
        std::lock_guard<std::mutex> lock(token_mu_);
        token_ = token;
      }
      headers.emplace("Authorization", token);
    }
    const HttpReply res = PostJson(endpoint, timeouts_, path, headers, payload);
    if (res.status == 0) {
      last = Status::Unavailable(TransportError(endpoint, res.error));
      continue;
    }
    if (res.status != 200) {
      Status s = StatusFromErrorBody(res.body, res.status);
      if (!token.empty() && TokenRejected(s) && renewed_at != index) {
        // Authenticate again and retry this endpoint (unless another call renewed it already).
        renewed_at = index;
        {
          std::lock_guard<std::mutex> lock(token_mu_);
          if (token_ == token) token_.clear();
        }
        --attempt;
        continue;
      }
      s = AuthError(std::move(s), !credentials_.empty());
      // Another member may have a leader when this one has none.
      if (s.code() == StatusCode::kUnavailable) {
        last = s.WithContext(endpoint);
        continue;
      }
      preferred_.store(index, std::memory_order_relaxed);
      return s;
    }
    json reply = json::parse(res.body, nullptr, /*allow_exceptions=*/false);
    if (!reply.is_object()) {
      last = Status::ProtocolError("etcd at " + endpoint + ": a reply that is not JSON");
      continue;
    }
    preferred_.store(index, std::memory_order_relaxed);
    return reply;
  }
  return last;
}

Result<RangeResult> EtcdClient::Range(std::string_view key, std::string_view range_end) {
  json body = {{"key", Base64Encode(key)}};
  if (!range_end.empty()) body["range_end"] = Base64Encode(range_end);
  GKV_ASSIGN_OR_RETURN(json reply, Call("/v3/kv/range", body));
  RangeResult out;
  if (reply.contains("header")) out.revision = Int(reply["header"], "revision");
  if (auto it = reply.find("kvs"); it != reply.end() && it->is_array()) {
    for (const auto& kv : *it) {
      GKV_ASSIGN_OR_RETURN(KeyValue parsed, ParseKeyValue(kv));
      out.kvs.push_back(std::move(parsed));
    }
  }
  return out;
}

Result<int64_t> EtcdClient::Put(std::string_view key, std::string_view value, int64_t lease) {
  json body = {{"key", Base64Encode(key)}, {"value", Base64Encode(value)}};
  if (lease != 0) body["lease"] = std::to_string(lease);
  GKV_ASSIGN_OR_RETURN(json reply, Call("/v3/kv/put", body));
  return reply.contains("header") ? Int(reply["header"], "revision") : int64_t{0};
}

Result<int64_t> EtcdClient::Delete(std::string_view key, std::string_view range_end) {
  json body = {{"key", Base64Encode(key)}};
  if (!range_end.empty()) body["range_end"] = Base64Encode(range_end);
  GKV_ASSIGN_OR_RETURN(json reply, Call("/v3/kv/deleterange", body));
  return reply.contains("header") ? Int(reply["header"], "revision") : int64_t{0};
}

Result<TxnResult> EtcdClient::Txn(const std::vector<TxnOp>& compare,
                                  const std::vector<TxnOp>& success,
                                  const std::vector<TxnOp>& failure) {
  auto list = [](const std::vector<TxnOp>& ops) {
    json array = json::array();
    for (const auto& op : ops) array.push_back(*op.json);
    return array;
  };
  json body = {{"compare", list(compare)}, {"success", list(success)}, {"failure", list(failure)}};
  GKV_ASSIGN_OR_RETURN(json reply, Call("/v3/kv/txn", body));
  TxnResult out;
  if (reply.contains("header")) out.revision = Int(reply["header"], "revision");
  out.succeeded = Bool(reply, "succeeded");
  return out;
}

Result<EtcdClient::Lease> EtcdClient::LeaseGrant(int64_t ttl_s) {
  GKV_ASSIGN_OR_RETURN(json reply, Call("/v3/lease/grant", {{"TTL", std::to_string(ttl_s)}}));
  Lease lease{Int(reply, "ID"), Int(reply, "TTL")};
  if (lease.id == 0 || lease.ttl_s <= 0) {
    return Status::ProtocolError("etcd: lease grant without an ID or TTL: " + Str(reply, "error"));
  }
  return lease;
}

Result<int64_t> EtcdClient::LeaseKeepAlive(int64_t id) {
  // A streaming call in gRPC; through the gateway one request gives one {"result": ...}.
  GKV_ASSIGN_OR_RETURN(json reply, Call("/v3/lease/keepalive", {{"ID", std::to_string(id)}}));
  if (auto it = reply.find("error"); it != reply.end() && it->is_object()) {
    return StatusFromGrpc(static_cast<int>(Int(*it, "grpc_code")), Str(*it, "message"));
  }
  auto it = reply.find("result");
  if (it == reply.end() || !it->is_object()) {
    return Status::ProtocolError("etcd: keepalive reply without a result");
  }
  return std::max<int64_t>(0, Int(*it, "TTL"));  // absent TTL: the lease is gone
}

Status EtcdClient::LeaseRevoke(int64_t id) {
  return Call("/v3/lease/revoke", {{"ID", std::to_string(id)}}).status();
}

WatchStream::WatchStream(std::vector<std::string> endpoints, Timeouts connect_timeouts,
                         std::chrono::milliseconds idle_timeout, Credentials credentials)
    : endpoints_(std::move(endpoints)),
      timeouts_(connect_timeouts),
      idle_timeout_(idle_timeout),
      credentials_(std::move(credentials)) {}

WatchStream::~WatchStream() = default;

void WatchStream::Cancel() {
  cancelled_.store(true);
  std::shared_ptr<httplib::Client> client;
  {
    std::lock_guard<std::mutex> lock(client_mu_);
    client = client_;
  }
  // Shuts the socket of a request in flight down; a request still connecting takes the
  // client's socket lock first, so a caller that must be sure repeats Cancel() (as
  // MembershipWatcher's destructor does) until Run() returned.
  if (client) client->stop();
}

Status WatchStream::Run(std::string_view key, std::string_view range_end, int64_t start_revision,
                        const Handler& handler) {
  if (endpoints_.empty()) return Status::InvalidArgument("etcd: no endpoints");
  const std::string& endpoint = endpoints_[preferred_ % endpoints_.size()];
  auto client = std::make_shared<httplib::Client>(endpoint);
  client->set_connection_timeout(timeouts_.connect);
  client->set_read_timeout(idle_timeout_);
  client->set_write_timeout(timeouts_.read);
  {
    std::lock_guard<std::mutex> lock(client_mu_);
    client_ = client;
  }
  struct Unpublish {
    WatchStream* self;
    ~Unpublish() {
      std::lock_guard<std::mutex> lock(self->client_mu_);
      self->client_.reset();
    }
  } unpublish{this};
  if (cancelled_.load()) return Status::Aborted("watch cancelled");

  json create = {{"key", Base64Encode(key)}, {"start_revision", std::to_string(start_revision)}};
  if (!range_end.empty()) create["range_end"] = Base64Encode(range_end);
  httplib::Request req;
  req.method = "POST";
  req.path = "/v3/watch";
  req.body = json{{"create_request", std::move(create)}}.dump();
  req.set_header("Content-Type", "application/json");
  if (!credentials_.empty()) {
    // A token per stream (a stream lasts until it idles out; tokens lapse when idle).
    auto token = Authenticate(endpoint, credentials_, timeouts_);
    if (!token.ok()) return token.status();
    req.set_header("Authorization", *token);
  }

  std::string buffer;  // bytes of a message not yet terminated by '\n'
  bool got_message = false;
  Status stream_status;  // set when a message ends the stream (an error or a cancelled watch)
  req.content_receiver = [&](const char* data, size_t size, uint64_t, uint64_t) {
    if (cancelled_.load()) return false;
    buffer.append(data, size);
    size_t newline;
    while ((newline = buffer.find('\n')) != std::string::npos) {
      const std::string line = buffer.substr(0, newline);
      buffer.erase(0, newline + 1);
      if (line.find_first_not_of(" \r\t") == std::string::npos) continue;
      json j = json::parse(line, nullptr, /*allow_exceptions=*/false);
      if (!j.is_object()) {
        stream_status = Status::ProtocolError("etcd watch: a message that is not JSON");
        return false;
      }
      if (auto err = j.find("error"); err != j.end()) {
        const json& e = err->is_object() ? *err : j;
        stream_status = StatusFromGrpc(
            static_cast<int>(Int(e, "grpc_code") ? Int(e, "grpc_code") : Int(e, "code")),
            Str(e, "message"));
        return false;
      }
      auto result = j.find("result");
      if (result == j.end() || !result->is_object()) continue;
      WatchMessage message;
      message.created = Bool(*result, "created");
      message.canceled = Bool(*result, "canceled");
      message.compact_revision = Int(*result, "compact_revision");
      if (auto h = result->find("header"); h != result->end() && h->is_object()) {
        message.header_revision = Int(*h, "revision");
      }
      if (auto events = result->find("events"); events != result->end() && events->is_array()) {
        for (const auto& e : *events) {
          if (!e.is_object()) continue;
          WatchEvent event;
          event.is_delete = Str(e, "type") == "DELETE";
          auto kv = e.find("kv");
          if (kv == e.end()) continue;
          auto parsed = ParseKeyValue(*kv);
          if (!parsed.ok()) {
            stream_status = parsed.status();
            return false;
          }
          event.kv = std::move(*parsed);
          message.events.push_back(std::move(event));
        }
      }
      got_message = true;
      if (!handler(message)) {
        stream_status = Status::Aborted("etcd watch: ended by its reader");
        return false;
      }
      if (message.canceled) {
        stream_status = message.compact_revision > 0
                            ? Status::Aborted("etcd watch: start revision compacted")
                            : Status::Unavailable("etcd watch cancelled by etcd: " +
                                                  Str(*result, "cancel_reason"));
        return false;
      }
      if (cancelled_.load()) return false;
    }
    return true;
  };

  httplib::Response res;
  httplib::Error error = httplib::Error::Success;
  const bool sent = client->send(req, res, error);
  if (cancelled_.load()) return Status::Aborted("watch cancelled");
  if (!stream_status.ok()) return stream_status;
  if (!got_message) {
    // Never established: next time try the next endpoint.
    preferred_ = (preferred_ + 1) % endpoints_.size();
    if (!sent) return Status::Unavailable(TransportError(endpoint, error));
    // An error reply without a final newline is still in the buffer.
    return StatusFromErrorBody(buffer, res.status).WithContext(endpoint);
  }
  if (!sent) return Status::Unavailable(TransportError(endpoint, error));
  return Status::Unavailable("etcd at " + endpoint + " ended the watch");
}

}  // namespace gkv::etcd
