// Status and Result<T>: the one error style of gkv.
//
// Every fallible function in a module API returns Status or Result<T>; no exceptions cross a
// module boundary. An OK Status carries no allocation. Foreign error codes (cudaError_t,
// ucs_status_t, rocksdb::Status) are translated into a Status at exactly one place each.
//
// Thread-safety: Status and Result are values; distinct objects may be used from distinct
// threads freely, one object needs external synchronization like any value type.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <variant>

namespace gkv {

enum class StatusCode : uint8_t {
  kOk = 0,
  kNotFound = 1,
  kInvalidArgument = 2,
  kNoSpace = 3,           // no tier (or node) has room for the object
  kUnavailable = 4,       // peer down, connection lost, tier not present
  kTimeout = 5,           // the deadline passed
  kIOError = 6,           // disk or device failure
  kCorruption = 7,        // stored or received bytes failed a check
  kProtocolError = 8,     // malformed or unexpected message on the wire
  kPermissionDenied = 9,  // missing or wrong cluster secret
  kNotSupported = 10,     // feature not compiled in or not available at run time
  kAborted = 11,          // operation cancelled (shutdown, superseded)
  kInternal = 12,         // a bug: an invariant did not hold
  kBusy = 13,             // the node sheds load (too much in flight); retry after a pause
  kWrongNode = 14,        // the node does not own the key in its ring (membership changed)
};
inline constexpr StatusCode kLastStatusCode = StatusCode::kWrongNode;

// Returns a stable lower-case name, e.g. "not_found"; used in logs, stats and JSON.
std::string_view StatusCodeName(StatusCode code);

class [[nodiscard]] Status {
 public:
  Status() = default;  // OK
  Status(StatusCode code, std::string_view message);

  static Status OK() { return Status(); }
  static Status NotFound(std::string_view m) { return {StatusCode::kNotFound, m}; }
  static Status InvalidArgument(std::string_view m) { return {StatusCode::kInvalidArgument, m}; }
  static Status NoSpace(std::string_view m) { return {StatusCode::kNoSpace, m}; }
  static Status Unavailable(std::string_view m) { return {StatusCode::kUnavailable, m}; }
  static Status Timeout(std::string_view m) { return {StatusCode::kTimeout, m}; }
  static Status IOError(std::string_view m) { return {StatusCode::kIOError, m}; }
  static Status Corruption(std::string_view m) { return {StatusCode::kCorruption, m}; }
  static Status ProtocolError(std::string_view m) { return {StatusCode::kProtocolError, m}; }
  static Status PermissionDenied(std::string_view m) { return {StatusCode::kPermissionDenied, m}; }
  static Status NotSupported(std::string_view m) { return {StatusCode::kNotSupported, m}; }
  static Status Aborted(std::string_view m) { return {StatusCode::kAborted, m}; }
  static Status Internal(std::string_view m) { return {StatusCode::kInternal, m}; }
  static Status Busy(std::string_view m) { return {StatusCode::kBusy, m}; }
  static Status WrongNode(std::string_view m) { return {StatusCode::kWrongNode, m}; }

  bool ok() const { return state_ == nullptr; }
  StatusCode code() const { return state_ ? state_->code : StatusCode::kOk; }
  // Empty for OK.
  std::string_view message() const { return state_ ? std::string_view(state_->message) : ""; }
  // "ok" or "<code name>: <message>".
  std::string ToString() const;

  bool IsNotFound() const { return code() == StatusCode::kNotFound; }

  // Returns a copy whose message is "<context>: <message>"; OK stays OK.
  Status WithContext(std::string_view context) const;

 private:
  struct State {
    StatusCode code;
    std::string message;
  };
  std::shared_ptr<const State> state_;  // null means OK; shared so copies are cheap
};

// Result<T> holds either a T or a non-OK Status.
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : v_(std::move(value)) {}        // NOLINT: implicit by design
  Result(Status status) : v_(std::move(status)) {  // NOLINT: implicit by design
    if (std::get<Status>(v_).ok()) v_ = Status::Internal("Result built from an OK status");
  }

  bool ok() const { return std::holds_alternative<T>(v_); }
  // OK when a value is held.
  Status status() const { return ok() ? Status::OK() : std::get<Status>(v_); }

  // REQUIRES: ok().
  T& value() & { return std::get<T>(v_); }
  const T& value() const& { return std::get<T>(v_); }
  T&& value() && { return std::get<T>(std::move(v_)); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  T&& operator*() && { return std::move(*this).value(); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }

 private:
  std::variant<T, Status> v_;
};

}  // namespace gkv

#define GKV_CONCAT_INNER_(a, b) a##b
#define GKV_CONCAT_(a, b) GKV_CONCAT_INNER_(a, b)

// Returns the Status from the enclosing function if `expr` is not OK.
#define GKV_RETURN_IF_ERROR(expr)              \
  do {                                         \
    ::gkv::Status gkv_status_ = (expr);        \
    if (!gkv_status_.ok()) return gkv_status_; \
  } while (0)

// `GKV_ASSIGN_OR_RETURN(auto x, MakeX());` unwraps a Result or returns its Status.
#define GKV_ASSIGN_OR_RETURN(lhs, expr) \
  GKV_ASSIGN_OR_RETURN_IMPL_(GKV_CONCAT_(gkv_result_, __LINE__), lhs, expr)
#define GKV_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                               \
  if (!tmp.ok()) return tmp.status();              \
  lhs = std::move(tmp).value()
