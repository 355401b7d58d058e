#include "gkv/log.h"

#include <spdlog/sinks/stdout_color_sinks.h>

#include <cstdlib>

namespace gkv {

spdlog::logger& Log() {
  static std::shared_ptr<spdlog::logger> logger = [] {
    auto l = spdlog::stderr_color_mt("gkv");
    l->set_pattern("%Y-%m-%dT%H:%M:%S.%e %^%l%$ [%n] %v");
    l->set_level(spdlog::level::info);
    if (const char* env = std::getenv("GKV_LOG_LEVEL")) {
      l->set_level(spdlog::level::from_str(env));
    }
    return l;
  }();
  return *logger;
}

void SetLogLevel(std::string_view level) {
  auto lvl = spdlog::level::from_str(std::string(level));
  if (lvl == spdlog::level::off && level != "off") return;
  Log().set_level(lvl);
}

}  // namespace gkv
