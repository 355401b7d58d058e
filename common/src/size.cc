#include "gkv/size.h"

#include <cctype>
#include <cmath>
#include <cstdio>
#include <string>

namespace gkv {
namespace {

std::string Lower(std::string_view s) {
  std::string out;
  for (char c : s) out.push_back(static_cast<char>(std::tolower(static_cast<unsigned char>(c))));
  return out;
}

}  // namespace

Result<uint64_t> ParseSize(std::string_view text) {
  auto bad = [&] { return Status::InvalidArgument("bad size '" + std::string(text) + "'"); };
  size_t i = 0;
  while (i < text.size() && std::isspace(static_cast<unsigned char>(text[i]))) ++i;
  size_t num_start = i;
  bool seen_digit = false, seen_dot = false;
  while (i < text.size() &&
         (std::isdigit(static_cast<unsigned char>(text[i])) || (text[i] == '.' && !seen_dot))) {
    if (text[i] == '.')
      seen_dot = true;
    else
      seen_digit = true;
    ++i;
  }
  if (!seen_digit) return bad();
  std::string number(text.substr(num_start, i - num_start));
  while (i < text.size() && std::isspace(static_cast<unsigned char>(text[i]))) ++i;
  std::string suffix = Lower(text.substr(i));
  while (!suffix.empty() && std::isspace(static_cast<unsigned char>(suffix.back())))
    suffix.pop_back();

  long double multiplier;
  if (suffix.empty() || suffix == "b")
    multiplier = 1;
  else if (suffix == "k" || suffix == "kib")
    multiplier = 1024.0L;
  else if (suffix == "m" || suffix == "mib")
    multiplier = 1024.0L * 1024;
  else if (suffix == "g" || suffix == "gib")
    multiplier = 1024.0L * 1024 * 1024;
  else if (suffix == "t" || suffix == "tib")
    multiplier = 1024.0L * 1024 * 1024 * 1024;
  else if (suffix == "kb")
    multiplier = 1e3L;
  else if (suffix == "mb")
    multiplier = 1e6L;
  else if (suffix == "gb")
    multiplier = 1e9L;
  else if (suffix == "tb")
    multiplier = 1e12L;
  else
    return bad();

  long double value = std::strtold(number.c_str(), nullptr) * multiplier;
  if (!std::isfinite(value) || value >= 18446744073709551615.0L) return bad();
  if (value != std::floor(value)) {
    return Status::InvalidArgument("size '" + std::string(text) +
                                   "' is not a whole number of bytes");
  }
  return static_cast<uint64_t>(value);
}

std::string FormatSize(uint64_t bytes) {
  static const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  double v = static_cast<double>(bytes);
  int unit = 0;
  while (v >= 1024.0 && unit < 5) {
    v /= 1024.0;
    ++unit;
  }
  char buf[32];
  if (unit == 0)
    std::snprintf(buf, sizeof buf, "%llu B", static_cast<unsigned long long>(bytes));
  else if (v == std::floor(v))
    std::snprintf(buf, sizeof buf, "%.0f %s", v, kUnits[unit]);
  else
    std::snprintf(buf, sizeof buf, "%.2f %s", v, kUnits[unit]);
  return buf;
}

}  // namespace gkv
