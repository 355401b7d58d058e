// Project logging: spdlog behind one logger named "gkv". Internal (not a client header).
// Default level is info: one line per significant event, nothing per request.
#pragma once

#include <spdlog/spdlog.h>

namespace gkv {

// The shared logger; created on first use, thread-safe.
spdlog::logger& Log();
// "trace", "debug", "info", "warn", "error", "off". Unknown names leave the level unchanged.
void SetLogLevel(std::string_view level);

}  // namespace gkv

#define GKV_LOG_DEBUG(...) ::gkv::Log().debug(__VA_ARGS__)
#define GKV_LOG_INFO(...) ::gkv::Log().info(__VA_ARGS__)
#define GKV_LOG_WARN(...) ::gkv::Log().warn(__VA_ARGS__)
#define GKV_LOG_ERROR(...) ::gkv::Log().error(__VA_ARGS__)
