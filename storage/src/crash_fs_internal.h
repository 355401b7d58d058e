// The RocksDB face of SimulatedCrashFs, for disk_tier.cc only (no RocksDB type in public headers).
#pragma once

#include <memory>

#include "gkv/storage/crash_fs.h"

namespace rocksdb {
class FileSystem;
}

namespace gkv {
std::shared_ptr<rocksdb::FileSystem> CrashFsFileSystem(const SimulatedCrashFs& fs);
}
