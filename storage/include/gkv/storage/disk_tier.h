// DiskTier: the bottom tier of a node, on RocksDB in a local directory.
//
// Layout (column families):
//   data  : key -> value bytes. Integrated BlobDB: values of min_blob_size or more live in blob
//           files (no rewrite on compaction), with blob garbage collection on.
//   meta  : key -> record {version, sequence, durable, size, tensor metadata}, little-endian
//           (gkv/bytes.h).
//   order : sequence (big-endian u64) -> key, for cache-only objects only: the eviction queue,
//           oldest write first. Durable objects are never in it.
//   chunks: (stream id, offset) (big-endian u64 each) -> bytes: the value of an object written in
//           pieces (a streamed put, BeginChunks/WriteChunk), whose meta names the stream
//           (StoredObjectMeta::chunks) and which has no `data` record. Chunks no meta names (a
//           stream aborted, or cut off by a crash before its commit) are deleted by AbortChunks
//           or at the next Open.
//   default: "version_mark" -> the version high-water mark (see VersionMark).
// An object's three records (and the evictions its write causes) go in one WriteBatch, so a
// crash never leaves them disagreeing.
//
// Capacity counts logical bytes (key + value) of stored objects, `capacity` in all. Durable
// objects (meta.durable) are the data a client was promised: capacity eviction never removes
// them. They have their own budget, durable_share of the capacity; a durable write past it gets
// NoSpace. Cache-only objects (write-back spills) use whatever durable objects leave; when a
// write pushes the total past the capacity, the oldest cache-only objects (by write sequence)
// are deleted in the same batch, and Put reports them so the cache can drop those index entries.
// A cache-only write that could not fit even after evicting every other cache-only object gets
// NoSpace and writes nothing. The objects of the write itself are never its victims.
// Eviction walks `order` from a cursor (the smallest sequence that may still be there), so it
// never rescans the tombstones of earlier evictions.
// A stream reserves its value's bytes in the capacity when it begins (evicting cache-only
// objects as a Put would; NoSpace when even that cannot make room, or when a durable stream's
// value would not fit the durable budget left now), so chunks in flight never take the disk
// past its capacity; the commit turns the reservation into the object's bytes, an abort gives
// it back.
// Warm restart: Open() rebuilds the byte counts and the sequence counter from `meta`, and
// ForEach() lists every stored key with its metadata.
// Durability: a write with sync=true fsyncs the WAL before returning (and with it every earlier
// write); sync=false survives a process crash but not a machine crash.
// Thread-safety: thread-safe. Admission (version check, byte accounting, sequence, victim
// choice) runs under an internal mutex; the RocksDB write and its sync run outside it, so
// concurrent synced writes share one fsync (RocksDB group commit). Writes of the same key are
// serialized (a key with a write in flight is waited for). Reads go straight to RocksDB.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "gkv/status.h"
#include "gkv/storage/crash_fs.h"
#include "gkv/tensor.h"

namespace rocksdb {
class DB;
class ColumnFamilyHandle;
struct ReadOptions;
class Env;
}  // namespace rocksdb

namespace gkv {

struct StoredObjectMeta {
  uint64_t size = 0;
  uint64_t version = 0;
  TensorMeta tensor;
  // Durable objects are never removed by capacity eviction and count against the durable
  // budget. Records written before this flag existed read as durable (the safe side).
  bool durable = false;
  // Nonzero: the value is in the `chunks` records of this stream (BeginChunks), not in `data`.
  uint64_t chunks = 0;
};

// One object of DiskTier::PutBatch. In: key, meta, data (meta.size bytes). Out: status (OK or
// NoSpace for this item) and written (false when a newer version of the key was kept, or when
// a later item of the same batch has the same key with a higher version).
struct DiskWrite {
  std::string_view key;
  StoredObjectMeta meta;
  const void* data = nullptr;
  Status status;
  bool written = false;
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
    // Share of `capacity` that durable objects may occupy, in (0, 1].
    double durable_share = 0.5;
    // Tests only: a file system that can drop unsynced data (crash_fs.h). Null: the real one.
    std::shared_ptr<SimulatedCrashFs> crash_fs;
  };

  static Result<std::unique_ptr<DiskTier>> Open(const Options& options);
  ~DiskTier();  // closes the database; everything acknowledged is on disk
  DiskTier(const DiskTier&) = delete;
  DiskTier& operator=(const DiskTier&) = delete;

  // Stores (replacing) `key`. NoSpace when it does not fit: a durable object past the durable
  // budget, a cache-only one past what durable objects leave; nothing is written then. Objects
  // evicted to make room are appended to `evicted` (may be null). A stored version newer than
  // meta.version is kept: the call then writes nothing and sets *written (may be null) to false.
  // Versions only grow, so a slow write of an old version can never overwrite a newer one.
  // Once the data is written the call returns OK: nothing after that point can fail.
  Status Put(std::string_view key, const StoredObjectMeta& meta, const void* data, bool sync,
             std::vector<DiskEviction>* evicted, bool* written = nullptr);
  // Put for several objects in one WriteBatch and (sync) one fsync. Each item gets its own
  // status and written flag (see DiskWrite); the returned Status is not OK only when the
  // RocksDB write itself failed, and then no item was written.
  // An item whose meta.chunks names a stream commits that stream's chunks as its value (data is
  // unused; the chunks must hold exactly meta.size bytes from offset 0, which the caller saw to).
  // Its chunks are the object's from then on only when the item is written; otherwise they stay
  // the caller's to AbortChunks.
  Status PutBatch(std::vector<DiskWrite>* writes, bool sync, std::vector<DiskEviction>* evicted);

  // A value written in pieces, so that no buffer as large as the value is needed: BeginChunks
  // reserves `size` bytes (see above; its evictions are appended to `evicted`) and returns a
  // new stream id; WriteChunk stores bytes at an offset of it (unsynced; a synced
  // commit syncs them too, they precede it in the WAL); PutBatch/Put with meta.chunks = id
  // makes them the key's value; AbortChunks deletes a stream that will not be committed.
  Result<uint64_t> BeginChunks(uint64_t size, bool durable, std::vector<DiskEviction>* evicted);
  Status WriteChunk(uint64_t stream, uint64_t offset, const void* data, uint64_t size);
  void AbortChunks(uint64_t stream);
  // Bytes held in chunk records, committed or not (a full scan of them: tests and diagnostics).
  Result<uint64_t> ChunkBytes() const;
  // NotFound if absent. `value` receives exactly meta->size bytes.
  Status Get(std::string_view key, StoredObjectMeta* meta, std::string* value) const;
  Status GetMeta(std::string_view key, StoredObjectMeta* meta) const;
  // OK whether or not the key existed. sync: the delete is on stable storage when this returns
  // (a crash cannot bring the object back).
  Status Delete(std::string_view key, bool sync = false);
  // Deletes only if the stored version equals `version` (so a newer write is kept).
  Status DeleteIfVersion(std::string_view key, uint64_t version, bool sync = false);
  // The version high-water mark: a number greater than every version the cache handed out
  // before (0 when never written). Written synced.
  Result<uint64_t> ReadVersionMark() const;
  Status WriteVersionMark(uint64_t mark);
  // Calls fn for every stored object, in key order. Stops early if fn returns false.
  Status ForEach(
      const std::function<bool(std::string_view key, const StoredObjectMeta&)>& fn) const;
  // Flushes memtables and syncs the WAL.
  Status Flush();

  uint64_t capacity() const { return options_.capacity; }
  uint64_t durable_capacity() const { return durable_capacity_; }
  uint64_t used_bytes() const;
  uint64_t durable_bytes() const;
  uint64_t object_count() const;

 private:
  struct Victim;
  explicit DiskTier(const Options& options);
  Status DeleteImpl(std::string_view key, const uint64_t* only_version, bool sync);
  // Chooses cache-only victims until used_bytes_ fits the capacity, adding their deletes to
  // `batch`. Skips keys in `busy_` and in `keep`. False (nothing changed) when keys in flight
  // hold the bytes that would have to go. REQUIRES: write_mu_.
  bool ChooseVictimsLocked(const std::vector<std::string_view>& keep, void* batch,
                           std::vector<Victim>* victims);
  // Waits until none of `keys` has a write in flight, then marks them. REQUIRES: write_mu_.
  void ClaimLocked(std::unique_lock<std::mutex>& lock, const std::vector<std::string_view>& keys);
  void ReleaseLocked(const std::vector<std::string>& keys);
  // Reads a chunked value (meta.chunks) into `value`.
  Status ReadChunks(const rocksdb::ReadOptions& ro, const StoredObjectMeta& meta,
                    std::string* value) const;
  // Open: deletes the chunks of streams no meta record names.
  Status DropUnreferencedChunks(const std::set<uint64_t>& referenced);
  // Adds the deletion of everything `meta` stores its value in (data, or its chunks) to `batch`.
  void DeleteValueTo(void* batch, std::string_view key, const StoredObjectMeta& meta);
  // Writes `batch` (a rocksdb::WriteBatch) with write_mu_ released and the `claimed` keys
  // marked busy meanwhile (their other writers wait in ClaimLocked), so RocksDB's group commit
  // can form; returns with the lock held again and the keys released.
  Status WriteClaimedLocked(std::unique_lock<std::mutex>& lock, void* batch, bool sync,
                            const std::vector<std::string>& claimed, const char* what);

  Options options_;
  uint64_t durable_capacity_;
  std::unique_ptr<rocksdb::Env> env_;  // only with crash_fs
  rocksdb::DB* db_ = nullptr;
  std::vector<rocksdb::ColumnFamilyHandle*> handles_;  // default, data, meta, order, chunks
  mutable std::mutex write_mu_;
  std::condition_variable key_released_;
  std::set<std::string, std::less<>> busy_;  // keys with a write in flight; guarded by write_mu_
  uint64_t used_bytes_ = 0;                  // guarded by write_mu_; includes writes in flight
  uint64_t durable_bytes_ = 0;               // guarded by write_mu_
  uint64_t object_count_ = 0;                // guarded by write_mu_
  uint64_t next_sequence_ = 1;               // guarded by write_mu_
  uint64_t evict_cursor_ = 0;  // guarded by write_mu_: no order entry below this sequence
  // Streams begun and not yet committed or aborted: the bytes each reserved in used_bytes_.
  std::map<uint64_t, uint64_t> open_chunks_;  // guarded by write_mu_
};

}  // namespace gkv
