#include "gkv/status.h"

namespace gkv {

std::string_view StatusCodeName(StatusCode code) {
  switch (code) {
    case StatusCode::kOk:
      return "ok";
    case StatusCode::kNotFound:
      return "not_found";
    case StatusCode::kInvalidArgument:
      return "invalid_argument";
    case StatusCode::kNoSpace:
      return "no_space";
    case StatusCode::kUnavailable:
      return "unavailable";
    case StatusCode::kTimeout:
      return "timeout";
    case StatusCode::kIOError:
      return "io_error";
    case StatusCode::kCorruption:
      return "corruption";
    case StatusCode::kProtocolError:
      return "protocol_error";
    case StatusCode::kPermissionDenied:
      return "permission_denied";
    case StatusCode::kNotSupported:
      return "not_supported";
    case StatusCode::kAborted:
      return "aborted";
    case StatusCode::kInternal:
      return "internal";
    case StatusCode::kBusy:
      return "busy";
    case StatusCode::kWrongNode:
      return "wrong_node";
  }
  return "unknown";
}

Status::Status(StatusCode code, std::string_view message) {
  if (code != StatusCode::kOk) {
    state_ = std::make_shared<const State>(State{code, std::string(message)});
  }
}

std::string Status::ToString() const {
  if (ok()) return "ok";
  std::string out(StatusCodeName(code()));
  out += ": ";
  out += message();
  return out;
}

Status Status::WithContext(std::string_view context) const {
  if (ok()) return *this;
  std::string m(context);
  m += ": ";
  m += message();
  return Status(code(), m);
}

}  // namespace gkv
