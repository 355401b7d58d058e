#include "gkv/storage/crash_fs.h"

#include <rocksdb/file_system.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <map>
#include <mutex>
#include <string>

#include "crash_fs_internal.h"

namespace gkv {

namespace {

// Per file: bytes appended through the wrapper and the size at its last Sync/Fsync.
struct FileState {
  uint64_t size = 0;
  uint64_t synced = 0;
};

}  // namespace

struct SimulatedCrashFs::Impl {
  mutable std::mutex mu;
  bool crashed = false;                    // guarded by mu
  std::map<std::string, FileState> files;  // guarded by mu
  std::shared_ptr<rocksdb::FileSystem> fs;
};

namespace {

class CrashWritableFile : public rocksdb::FSWritableFileOwnerWrapper {
 public:
  CrashWritableFile(std::unique_ptr<rocksdb::FSWritableFile> f, SimulatedCrashFs::Impl* state,
                    std::string name)
      : FSWritableFileOwnerWrapper(std::move(f)), state_(state), name_(std::move(name)) {}

  rocksdb::IOStatus Append(const rocksdb::Slice& data, const rocksdb::IOOptions& o,
                           rocksdb::IODebugContext* dbg) override {
    if (!Appended(data.size())) return rocksdb::IOStatus::OK();
    return target()->Append(data, o, dbg);
  }
  rocksdb::IOStatus Append(const rocksdb::Slice& data, const rocksdb::IOOptions& o,
                           const rocksdb::DataVerificationInfo& v,
                           rocksdb::IODebugContext* dbg) override {
    if (!Appended(data.size())) return rocksdb::IOStatus::OK();
    return target()->Append(data, o, v, dbg);
  }
  rocksdb::IOStatus PositionedAppend(const rocksdb::Slice& data, uint64_t offset,
                                     const rocksdb::IOOptions& o,
                                     rocksdb::IODebugContext* dbg) override {
    if (!PositionedAppended(offset + data.size())) return rocksdb::IOStatus::OK();
    return target()->PositionedAppend(data, offset, o, dbg);
  }
  rocksdb::IOStatus PositionedAppend(const rocksdb::Slice& data, uint64_t offset,
                                     const rocksdb::IOOptions& o,
                                     const rocksdb::DataVerificationInfo& v,
                                     rocksdb::IODebugContext* dbg) override {
    if (!PositionedAppended(offset + data.size())) return rocksdb::IOStatus::OK();
    return target()->PositionedAppend(data, offset, o, v, dbg);
  }
  rocksdb::IOStatus Truncate(uint64_t size, const rocksdb::IOOptions& o,
                             rocksdb::IODebugContext* dbg) override {
    {
      std::lock_guard<std::mutex> lock(state_->mu);
      if (state_->crashed) return rocksdb::IOStatus::OK();
      FileState& f = state_->files[name_];
      f.size = size;
      f.synced = std::min(f.synced, size);
    }
    return target()->Truncate(size, o, dbg);
  }
  rocksdb::IOStatus Sync(const rocksdb::IOOptions& o, rocksdb::IODebugContext* dbg) override {
    if (crashed()) return rocksdb::IOStatus::OK();
    rocksdb::IOStatus s = target()->Sync(o, dbg);
    if (s.ok()) Synced();
    return s;
  }
  rocksdb::IOStatus Fsync(const rocksdb::IOOptions& o, rocksdb::IODebugContext* dbg) override {
    if (crashed()) return rocksdb::IOStatus::OK();
    rocksdb::IOStatus s = target()->Fsync(o, dbg);
    if (s.ok()) Synced();
    return s;
  }
  // sync_file_range is not a durability point: RangeSync does not count as synced.
  rocksdb::IOStatus Close(const rocksdb::IOOptions& o, rocksdb::IODebugContext* dbg) override {
    return target()->Close(o, dbg);
  }

 private:
  bool crashed() const {
    std::lock_guard<std::mutex> lock(state_->mu);
    return state_->crashed;
  }
  // False when the append must be discarded.
  bool Appended(uint64_t n) {
    std::lock_guard<std::mutex> lock(state_->mu);
    if (state_->crashed) return false;
    state_->files[name_].size += n;
    return true;
  }
  bool PositionedAppended(uint64_t end) {
    std::lock_guard<std::mutex> lock(state_->mu);
    if (state_->crashed) return false;
    FileState& f = state_->files[name_];
    f.size = std::max(f.size, end);
    return true;
  }
  void Synced() {
    std::lock_guard<std::mutex> lock(state_->mu);
    if (state_->crashed) return;
    FileState& f = state_->files[name_];
    f.synced = f.size;
  }

  SimulatedCrashFs::Impl* state_;
  std::string name_;
};

class CrashFileSystem : public rocksdb::FileSystemWrapper {
 public:
  CrashFileSystem(std::shared_ptr<rocksdb::FileSystem> base, SimulatedCrashFs::Impl* state)
      : FileSystemWrapper(std::move(base)), state_(state) {}
  const char* Name() const override { return "GkvSimulatedCrashFs"; }

  rocksdb::IOStatus NewWritableFile(const std::string& f, const rocksdb::FileOptions& fo,
                                    std::unique_ptr<rocksdb::FSWritableFile>* r,
                                    rocksdb::IODebugContext* dbg) override {
    rocksdb::IOStatus s = target()->NewWritableFile(f, fo, r, dbg);
    if (s.ok()) Wrap(f, 0, r);
    return s;
  }
  rocksdb::IOStatus ReopenWritableFile(const std::string& f, const rocksdb::FileOptions& fo,
                                       std::unique_ptr<rocksdb::FSWritableFile>* r,
                                       rocksdb::IODebugContext* dbg) override {
    rocksdb::IOStatus s = target()->ReopenWritableFile(f, fo, r, dbg);
    if (s.ok()) {
      uint64_t size = 0;  // what was there before is taken as synced
      if (!target()->GetFileSize(f, rocksdb::IOOptions(), &size, dbg).ok()) size = 0;
      Wrap(f, size, r);
    }
    return s;
  }
  rocksdb::IOStatus ReuseWritableFile(const std::string& f, const std::string& old,
                                      const rocksdb::FileOptions& fo,
                                      std::unique_ptr<rocksdb::FSWritableFile>* r,
                                      rocksdb::IODebugContext* dbg) override {
    rocksdb::IOStatus s = target()->ReuseWritableFile(f, old, fo, r, dbg);
    if (s.ok()) {
      std::lock_guard<std::mutex> lock(state_->mu);
      state_->files.erase(old);
    }
    if (s.ok()) Wrap(f, 0, r);
    return s;
  }
  rocksdb::IOStatus DeleteFile(const std::string& f, const rocksdb::IOOptions& o,
                               rocksdb::IODebugContext* dbg) override {
    {
      std::lock_guard<std::mutex> lock(state_->mu);
      if (state_->crashed) return rocksdb::IOStatus::OK();  // the machine is off
      state_->files.erase(f);
    }
    return target()->DeleteFile(f, o, dbg);
  }
  rocksdb::IOStatus RenameFile(const std::string& src, const std::string& dst,
                               const rocksdb::IOOptions& o, rocksdb::IODebugContext* dbg) override {
    {
      std::lock_guard<std::mutex> lock(state_->mu);
      if (state_->crashed) return rocksdb::IOStatus::OK();
    }
    rocksdb::IOStatus s = target()->RenameFile(src, dst, o, dbg);
    if (s.ok()) {
      std::lock_guard<std::mutex> lock(state_->mu);
      auto it = state_->files.find(src);
      state_->files.erase(dst);
      if (it != state_->files.end()) {
        state_->files[dst] = it->second;
        state_->files.erase(it);
      }
    }
    return s;
  }

 private:
  void Wrap(const std::string& f, uint64_t size, std::unique_ptr<rocksdb::FSWritableFile>* r) {
    {
      std::lock_guard<std::mutex> lock(state_->mu);
      state_->files[f] = FileState{size, size};
    }
    *r = std::make_unique<CrashWritableFile>(std::move(*r), state_, f);
  }

  SimulatedCrashFs::Impl* state_;
};

}  // namespace

SimulatedCrashFs::SimulatedCrashFs() : impl_(std::make_shared<Impl>()) {
  impl_->fs = std::make_shared<CrashFileSystem>(rocksdb::FileSystem::Default(), impl_.get());
}

SimulatedCrashFs::~SimulatedCrashFs() = default;

std::shared_ptr<SimulatedCrashFs> SimulatedCrashFs::Create() {
  return std::shared_ptr<SimulatedCrashFs>(new SimulatedCrashFs());
}

void SimulatedCrashFs::Crash() {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->crashed = true;
}

Status SimulatedCrashFs::DropUnsyncedData() {
  std::lock_guard<std::mutex> lock(impl_->mu);
  for (const auto& [name, f] : impl_->files) {
    if (::truncate(name.c_str(), static_cast<off_t>(f.synced)) != 0 && errno != ENOENT) {
      return Status::IOError("truncating " + name + ": " + std::strerror(errno));
    }
  }
  impl_->files.clear();
  impl_->crashed = false;
  return Status::OK();
}

uint64_t SimulatedCrashFs::unsynced_bytes() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  uint64_t n = 0;
  for (const auto& [name, f] : impl_->files) n += f.size - f.synced;
  return n;
}

std::shared_ptr<rocksdb::FileSystem> CrashFsFileSystem(const SimulatedCrashFs& fs) {
  return fs.impl()->fs;
}

}  // namespace gkv
