// DiskTier: the bottom tier of a node, on RocksDB in a local directory.
//
// Layout (column families):
//   data  : key -> value bytes. Integrated BlobDB: values of min_blob_size or more live in blob
//           files (no rewrite on compaction), with blob garbage collection on.
//   meta  : key -> record {version, sequence, size, tensor metadata}, little-endian (gkv/bytes.h).
//   order : sequence (big-endian u64) -> key. The oldest write has the smallest sequence.
// All three are updated in one WriteBatch, so a crash never leaves them disagreeing.
//
// Capacity counts logical bytes (key + value) of stored objects. Past it, the oldest objects
// (by write sequence) are deleted until the total fits again; Put reports what it evicted so the
// cache can drop those index entries. The object just written is never evicted by its own Put.
// Warm restart: Open() rebuilds the byte count and the sequence counter from `meta`, and
// ForEach() lists every stored key with its metadata.
// Durability: Put(sync=true) fsyncs the WAL before returning; sync=false (write-back spills)
// survives a process crash but not a machine crash.
// Thread-safety: thread-safe. Writes are serialized by an internal mutex (sequence and byte
// accounting); reads go straight to RocksDB.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "gkv/status.h"
#include "gkv/tensor.h"

namespace rocksdb {
class DB;
class ColumnFamilyHandle;
}  // namespace rocksdb

namespace gkv {

struct StoredObjectMeta {
  uint64_t size = 0;
  uint64_t version = 0;
  TensorMeta tensor;
};

struct DiskEviction {
  std::string key;
  uint64_t version;
};

class DiskTier {
 public:
  struct Options {
    std::string path;
    uint64_t capacity = 0;          // logical bytes; must be > 0
    uint64_t min_blob_size = 4096;  // values at least this big go to blob files
  };

  static Result<std::unique_ptr<DiskTier>> Open(const Options& options);
  ~DiskTier();  // closes the database; everything acknowledged is on disk
  DiskTier(const DiskTier&) = delete;
  DiskTier& operator=(const DiskTier&) = delete;

  // Stores (replacing) `key`. NoSpace if the object alone exceeds the capacity. Evicted objects
  // are appended to `evicted` (may be null). A stored version newer than meta.version is kept:
  // the call then writes nothing and sets *written (may be null) to false. Versions only grow,
  // so a slow write of an old version can never overwrite a newer durable one.
  Status Put(std::string_view key, const StoredObjectMeta& meta, const void* data, bool sync,
             std::vector<DiskEviction>* evicted, bool* written = nullptr);
  // NotFound if absent. `value` receives exactly meta->size bytes.
  Status Get(std::string_view key, StoredObjectMeta* meta, std::string* value) const;
  Status GetMeta(std::string_view key, StoredObjectMeta* meta) const;
  // OK whether or not the key existed.
  Status Delete(std::string_view key);
  // Deletes only if the stored version equals `version` (so a newer write is kept).
  Status DeleteIfVersion(std::string_view key, uint64_t version);
  // Calls fn for every stored object, in key order. Stops early if fn returns false.
  Status ForEach(
      const std::function<bool(std::string_view key, const StoredObjectMeta&)>& fn) const;
  // Flushes memtables and syncs the WAL.
  Status Flush();

  uint64_t capacity() const { return options_.capacity; }
  uint64_t used_bytes() const;
  uint64_t object_count() const;

 private:
  explicit DiskTier(const Options& options) : options_(options) {}
  Status DeleteLocked(std::string_view key, const uint64_t* only_version);
  Status EvictOldestLocked(std::string_view keep_key, std::vector<DiskEviction>* evicted);

  Options options_;
  rocksdb::DB* db_ = nullptr;
  std::vector<rocksdb::ColumnFamilyHandle*> handles_;  // default, data, meta, order
  mutable std::mutex write_mu_;
  uint64_t used_bytes_ = 0;     // guarded by write_mu_
  uint64_t object_count_ = 0;   // guarded by write_mu_
  uint64_t next_sequence_ = 1;  // guarded by write_mu_
};

}  // namespace gkv
