// Project logging: spdlog behind one logger named "gkv". Internal (not a client header).
// Default level is info: one line per significant event, nothing per request.
#pragma once

#include <spdlog/spdlog.h>

#include <string>
#include <string_view>

namespace gkv {

// The shared logger; created on first use, thread-safe.
spdlog::logger& Log();
// "trace", "debug", "info", "warn", "error", "off". Unknown names leave the level unchanged.
void SetLogLevel(std::string_view level);

// A key (or value) as log lines and error messages quote it: at most its first 40 bytes,
// bytes that are not printable ASCII as \xNN, and "..." when it was cut.
inline std::string LogKey(std::string_view key) {
  constexpr size_t kMax = 40;
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out;
  for (size_t i = 0; i < key.size() && i < kMax; ++i) {
    const unsigned char c = static_cast<unsigned char>(key[i]);
    if (c >= 0x20 && c < 0x7f && c != '\\') {
      out.push_back(static_cast<char>(c));
    } else {
      out += "\\x";
      out.push_back(kHex[c >> 4]);
      out.push_back(kHex[c & 15]);
    }
  }
  if (key.size() > kMax) out += "...";
  return out;
}

}  // namespace gkv

#define GKV_LOG_DEBUG(...) ::gkv::Log().debug(__VA_ARGS__)
#define GKV_LOG_INFO(...) ::gkv::Log().info(__VA_ARGS__)
#define GKV_LOG_WARN(...) ::gkv::Log().warn(__VA_ARGS__)
#define GKV_LOG_ERROR(...) ::gkv::Log().error(__VA_ARGS__)
