// SimulatedCrashFs: a test-only file system for the disk tier that can lose, on demand, every
// byte that was not synced, as a power loss would. A process kill (SIGKILL) keeps everything
// RocksDB handed to the kernel, synced or not, so it cannot show that a write was durable; this
// can.
//
// Use: pass it in DiskTier::Options::crash_fs (or CacheOptions::disk_crash_fs), write, then
//   Crash();              // from now on every write and sync is discarded (the machine is off)
//   <destroy the DiskTier / TieredCache>   // its closing flushes go nowhere
//   DropUnsyncedData();   // each file written through it shrinks to its last synced size
// and reopen the same directory (with this or no crash_fs). What survives is what a machine
// crash at the Crash() call could have left: every synced byte, no unsynced byte. Files created
// since their directory was last synced are kept (truncated), which is kinder than some file
// systems; the tests use it to check synced data survives and unsynced data does not.
// Thread-safety: thread-safe.
#pragma once

#include <cstdint>
#include <memory>

#include "gkv/status.h"

namespace gkv {

class SimulatedCrashFs {
 public:
  static std::shared_ptr<SimulatedCrashFs> Create();
  ~SimulatedCrashFs();

  // Discards every later append and sync, and remembers nothing more as synced.
  void Crash();
  // REQUIRES: Crash() was called and no DiskTier using this file system is open. Truncates
  // every file written through this file system to its last synced size, then forgets them and
  // accepts writes again.
  Status DropUnsyncedData();
  // Bytes appended but not synced yet, over all files (what a crash now would lose).
  uint64_t unsynced_bytes() const;

  struct Impl;
  Impl* impl() const { return impl_.get(); }

 private:
  SimulatedCrashFs();
  std::shared_ptr<Impl> impl_;
};

}  // namespace gkv
