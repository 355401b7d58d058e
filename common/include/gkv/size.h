// Human-readable byte sizes: "512MiB", "8GiB", "4k", "1.5GB", "4096".
// Binary suffixes (KiB, MiB, GiB, TiB, and the short K, M, G, T) are powers of 1024; decimal
// ones (KB, MB, GB, TB) are powers of 1000; a bare number is bytes. Case-insensitive.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "gkv/status.h"

namespace gkv {

Result<uint64_t> ParseSize(std::string_view text);
// "16 MiB", "1.50 GiB", "512 B".
std::string FormatSize(uint64_t bytes);

}  // namespace gkv
