// TieredCache: the node-local cache. GPU memory -> pinned host memory -> RocksDB on disk.
//
// Placement:
//  - Placement partitions (CacheOptions::placement_partitions, 1 by default): each owns an
//    equal slice of every memory tier, its own LRU lists and its own placement lock; a key's
//    partition is fixed by its hash. Everything below happens within the key's partition: "a
//    tier" is that partition's slice of it, and eviction is LRU among that partition's keys.
//  - A put lands in the highest tier whose capacity can hold the object; when that tier is full,
//    its least recently used entries that can move (not pinned, and no commit of their key in
//    flight: see docs/ARCHITECTURE.md, "Eviction") move one tier down (GPU -> host -> disk; CLOCK:
//    a read marks its entry, and the eviction scan gives a marked entry a second chance) until the
//    new object fits. An object larger than a tier (slice) skips it; one larger than every tier
//    is refused with NoSpace. The disk tier drops its oldest cache-only objects past its own
//    capacity; durable objects are never dropped (they have their own budget, see DiskTier).
//  - A move never changes a byte: the copy is made first, then the entry is switched over.
//  - Writes reach disk on eviction (write-back), unless the put is durable: then the object is
//    written through to RocksDB (fsync'ed WAL) before Commit/Put returns. A memory entry whose
//    current version is already on disk is dropped from memory without another write.
//  - A commit that replaces a version with a disk copy (or one being written) writes the new
//    version through, synced, in place of that copy; a Delete of such a key is synced. What
//    survives a crash is written down in docs/ARCHITECTURE.md ("Durability across crash and
//    restart").
//  - Versions are hybrid clocks (at least the wall clock in microseconds times 1024), so those of
//    different nodes compare in write order up to clock skew, and grow across restarts (a
//    high-water mark persisted in the disk tier covers a clock that went backwards).
//  - Promotion (admission rule): a read of an entry in a lower tier promotes it to the highest
//    tier on the entry's second read within `promotion_window` (the first read only records
//    the time). A single scan therefore reads through the lower tiers without flushing the hot
//    set out of GPU memory.
//
// Invariants (held under the placement lock, which is the key's partition's):
//  - Bytes allocated in a tier never exceed its capacity (each slice is exactly that big).
//  - An entry with pins > 0 is never moved or freed; a deleted or replaced entry keeps its
//    memory until its last pin is released. The fast path pins and every handle releases
//    without the placement lock (an atomic pin count that placement freezes while it moves an
//    entry; see Impl).
//  - Every live memory-tier entry is in exactly one LRU list, that of its tier.
//  - The index maps a key to the entry with the highest version committed for it.
//
// Thread-safety: all methods are thread-safe. The index is sharded by key hash (one mutex per
// shard); tier placement (LRU lists, arena slices, moves) is under the placement mutex of the
// key's partition (a shard belongs to one partition). Lock order: shard mutex, then placement
// mutex; no code holds two partitions' mutexes. TryAcquireFromMemory takes only the key's
// shard mutex and
// releasing a ReadHandle takes no lock, so readers on many threads share no lock; the one
// exception is the last release of a dead entry's pin (replaced, deleted or dropped while
// read), which frees its memory under the placement mutex. So never release a handle while
// holding the placement mutex. Byte
// copies and disk I/O run with no lock held; the entries involved are pinned meanwhile.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "gkv/cuda.h"
#include "gkv/status.h"
#include "gkv/storage/crash_fs.h"
#include "gkv/storage/memory_arena.h"
#include "gkv/tensor.h"

namespace gkv {

enum class Tier : uint8_t { kGpu = 0, kHost = 1, kDisk = 2 };
inline constexpr int kTierCount = 3;
std::string_view TierName(Tier tier);

struct CacheOptions {
  // GPU tier: one arena of gpu_capacity bytes on each listed device. 0 disables the tier. When no
  // usable GPU exists the tier is off and Open() logs one line saying why.
  uint64_t gpu_capacity = 0;
  std::vector<int> gpu_devices = {0};
  // Tests and CPU-only benchmarks: back the GPU tier with ordinary host memory so the tier logic
  // runs without a GPU.
  bool gpu_tier_in_host_memory = false;
  // The GPU tier sits behind the host tier: new objects and promotions go to host memory
  // first, and the GPU tier takes what the host tier spills (before the disk does). For a node
  // whose UCX cannot move device memory, where every read of a GPU-tier object needs a copy
  // to host memory first: the hot objects stay where a read is served straight away.
  bool gpu_behind_host = false;

  // Host tier: 0 disables it.
  uint64_t host_capacity = 0;
  MemoryArena::HostMode host_mode = MemoryArena::HostMode::kAuto;

  // Disk tier: an empty path disables it.
  std::string disk_path;
  uint64_t disk_capacity = 0;
  // Share of disk_capacity that durable objects may occupy (DiskTier::Options::durable_share):
  // durable data is never evicted, and a durable put past this budget gets NoSpace. Write-back
  // spills use the rest and whatever durable objects leave unused.
  double disk_durable_share = 0.5;
  // Tests only: the disk tier's files go through this crash-simulating file system.
  std::shared_ptr<SimulatedCrashFs> disk_crash_fs;
  // Tests only: called with the key of an entry being moved from the fast memory tier to the
  // slow one, after its bytes were copied and before the placement lock is taken again (no lock
  // held): a reader can pin the entry at exactly that moment.
  std::function<void(const std::string& key)> test_after_spill_copy;
  // Tests only: called with the key of a commit after its disk write (if it has one) and before
  // it is published (no lock held): the key's previous version is still the visible one.
  std::function<void(const std::string& key)> test_before_publish;
  // Tests only: called with the key of an entry being written back from memory to disk, before
  // its disk write (no lock held; the entry is pinned).
  std::function<void(const std::string& key)> test_before_disk_spill;

  uint64_t max_key_size = 1024;
  int index_shards = 16;
  // Placement partitions (a divisor of index_shards): each owns an equal slice of every memory tier
  // (whole pages) with its own LRU lists and lock, and a key's partition is fixed by its hash,
  // so puts, evictions and moves of keys in different partitions share no lock. Eviction is
  // LRU within a partition. An object larger than one slice does not fit that tier (it goes to
  // the next tier down, or disk). 1: one lock and one LRU order for the whole tier.
  int placement_partitions = 1;
  // The partition count a node with `io_threads` I/O threads gets by default: the largest
  // divisor of index_shards that is at most io_threads and leaves every memory tier Open would
  // turn on slices of at least min_slice bytes (1 when none does).
  static int AutoPartitions(const CacheOptions& options, int io_threads,
                            uint64_t min_slice = uint64_t{1} << 30);
  std::chrono::milliseconds promotion_window{10'000};
  // false: reads never promote (the admission rule is off); an entry stays in the tier it was
  // written to or spilled to. A replica cache uses this: its copies are installed in the top tier.
  bool promote_on_read = true;
};

struct ObjectInfo {
  uint64_t size = 0;
  uint64_t version = 0;
  TensorMeta tensor;
  Tier tier = Tier::kHost;
  bool on_disk = false;  // the disk tier holds this version (durable put or earlier spill)
  bool durable = false;  // written durable (its disk copy stays)
};

struct TierStats {
  bool enabled = false;
  uint64_t capacity = 0;
  uint64_t used_bytes = 0;  // allocated bytes (for disk: logical bytes of stored objects)
  uint64_t objects = 0;
  uint64_t hits = 0;
  uint64_t largest_free_block = 0;  // memory tiers only
};

struct CacheStats {
  TierStats tiers[kTierCount];
  uint64_t misses = 0;
  uint64_t puts = 0;
  uint64_t deletes = 0;
  // moves[from][to]: spills (from < to) and promotions (from > to), in objects.
  uint64_t moves[kTierCount][kTierCount] = {};
  uint64_t moved_bytes[kTierCount][kTierCount] = {};
  uint64_t disk_evictions = 0;  // objects the disk tier dropped past its capacity
  uint64_t dropped = 0;         // objects evicted with no lower tier able to take them
  uint64_t durable_writes = 0;
  uint64_t placement_partitions = 0;
};

class TieredCache;

// A pinned view of one object. While the handle lives, the object's bytes stay where data()
// points (memory tiers) or in the handle's own buffer (objects read from disk). Move-only;
// release from any thread.
class ReadHandle {
 public:
  ReadHandle() = default;
  ReadHandle(ReadHandle&& other) noexcept;
  ReadHandle& operator=(ReadHandle&& other) noexcept;
  ~ReadHandle();

  const std::byte* data() const { return data_; }
  uint64_t size() const { return info_.size; }
  // kDevice when data() is GPU memory.
  MemoryKind memory_kind() const { return kind_; }
  // info().tier is the tier the bytes were served from.
  const ObjectInfo& info() const { return info_; }

 private:
  friend class TieredCache;
  void Release();
  TieredCache* cache_ = nullptr;
  std::shared_ptr<void> entry_;  // pinned entry (memory tiers)
  std::string owned_;            // bytes read from disk
  const std::byte* data_ = nullptr;
  MemoryKind kind_ = MemoryKind::kHost;
  ObjectInfo info_;
};

// Space reserved for one incoming object. Fill data() (host or device memory per
// memory_kind()), or (any reservation from ReserveStreamed) TieredCache::WriteAt, then
// TieredCache::Commit. Destroying it uncommitted releases the space (and deletes the chunks a
// streamed one wrote to disk).
class WriteHandle {
 public:
  WriteHandle() = default;
  WriteHandle(WriteHandle&& other) noexcept;
  WriteHandle& operator=(WriteHandle&& other) noexcept;
  ~WriteHandle();

  // Null for a streamed reservation bound for the disk tier (see ReserveStreamed).
  std::byte* data() const { return data_; }
  uint64_t size() const { return size_; }
  MemoryKind memory_kind() const { return kind_; }
  Tier tier() const { return tier_; }
  const std::string& key() const { return key_; }
  // Commit at `version` (a version the writing client assigned, the same on every replica of
  // the write) instead of one from this cache's clock; if the key already holds a newer
  // version, the commit takes the version just above it (a put still replaces what it finds).
  // Versions handed out afterwards are above the one committed.
  void RequestVersion(uint64_t version) { requested_version_ = version; }

 private:
  friend class TieredCache;
  void Release();
  TieredCache* cache_ = nullptr;
  std::string key_;
  size_t shard_ = 0;  // the key's index shard (and so its placement partition)
  TensorMeta tensor_;
  uint64_t size_ = 0;
  Tier tier_ = Tier::kHost;
  MemoryArena* arena_ = nullptr;  // memory tiers
  std::byte* data_ = nullptr;
  std::unique_ptr<std::byte[]> staging_;  // objects going straight to disk
  uint64_t disk_stream_ = 0;              // streamed, bound for disk: its DiskTier chunk stream
  MemoryKind kind_ = MemoryKind::kHost;
  uint64_t handed_version_ = 0;     // CommitHandedOff: the version the object keeps
  uint64_t requested_version_ = 0;  // RequestVersion
  bool expect_current_ = false;     // CommitHandedOffIf: publish only over this version
  uint64_t expected_current_ = 0;
};

// One memory tier arena as TieredCache::memory_regions lists it: where its bytes live, for
// registering them with the transport once (every ReadHandle::data() and WriteHandle::data() of
// that tier points inside it).
struct MemoryRegion {
  std::byte* base = nullptr;
  uint64_t size = 0;
  MemoryKind kind = MemoryKind::kHost;  // kDevice: a GPU arena (device memory)
  int device = -1;                      // the CUDA device of a GPU arena
  Tier tier = Tier::kHost;
};

// One key as ListKeys saw it.
struct KeyListing {
  std::string key;
  uint64_t version = 0;
  uint64_t size = 0;
  bool durable = false;
  Tier tier = Tier::kHost;
};

class TieredCache {
 public:
  // Fails if no tier is enabled, or a configured tier can't be set up (except the GPU tier on a
  // machine without a usable GPU, which is turned off with a log line).
  static Result<std::unique_ptr<TieredCache>> Open(const CacheOptions& options);
  // REQUIRES: no ReadHandle or WriteHandle of this cache is still alive.
  ~TieredCache();
  TieredCache(const TieredCache&) = delete;
  TieredCache& operator=(const TieredCache&) = delete;

  // Outcome of the non-blocking fast paths below.
  enum class FastPath { kServed, kMiss, kNeedsSlowPath };

  // Reserves room for `size` bytes under `key`, evicting as needed. InvalidArgument for a bad
  // key or tensor metadata, NoSpace when the object fits no tier or no candidate can move now.
  Result<WriteHandle> Reserve(std::string_view key, uint64_t size, const TensorMeta& tensor);
  // Reserve for a value that arrives in pieces (a streamed put), filled through WriteAt: a
  // reservation in a memory tier is the same as Reserve's; one bound for the disk tier has no
  // buffer (data() is null) and WriteAt writes its pieces to disk as they come, so no memory as
  // large as the value is needed; the disk tier reserves the value's room when the stream
  // begins (DiskTier::BeginChunks). `durable`: the commit will be durable, so a value past what
  // the durable budget has left now (or a cache without a disk tier) is refused here, before
  // any of it is sent, rather than at the commit (which still checks).
  Result<WriteHandle> ReserveStreamed(std::string_view key, uint64_t size, const TensorMeta& tensor,
                                      bool durable);
  // Stores `size` bytes from `src` (host or device memory) at `offset` of the reservation.
  // Pieces may come in any order and from several threads at once, but must not overlap; the
  // caller commits only once every byte was written. InvalidArgument outside the reservation.
  Status WriteAt(const WriteHandle& handle, uint64_t offset, const void* src, uint64_t size,
                 MemoryKind src_kind = MemoryKind::kHost);
  // Publishes the reserved object as the newest version of its key; returns that version.
  // durable: written through to disk (fsync) before returning; fails with NotSupported when
  // there is no disk tier.
  Result<uint64_t> Commit(WriteHandle handle, bool durable);
  // Commit for several reservations at once (MPUT): what goes to disk (every item when
  // durable) is written in one RocksDB batch with one fsync. Returns one result per handle, in
  // order; items fail independently (a durable item past the disk tier's durable budget gets
  // NoSpace). Items with the same key are committed in order (the last one is the newest).
  std::vector<Result<uint64_t>> CommitBatch(std::vector<WriteHandle> handles, bool durable);

  // Non-blocking forms of Reserve and Commit for I/O threads. TryReserveInMemory succeeds only
  // when a memory tier has a free block without evicting anything; TryCommitInMemory only for a
  // non-durable commit of a memory reservation that needs no disk I/O (no older copy of the key
  // on disk). kNeedsSlowPath leaves `handle` untouched: use Reserve / Commit then.
  FastPath TryReserveInMemory(std::string_view key, uint64_t size, const TensorMeta& tensor,
                              WriteHandle* out);
  FastPath TryCommitInMemory(WriteHandle* handle, uint64_t* version);

  // Reserve + copy (from host or device memory) + Commit.
  Result<uint64_t> Put(std::string_view key, const void* data, uint64_t size,
                       const TensorMeta& tensor = {}, bool durable = false,
                       MemoryKind src_kind = MemoryKind::kHost);

  // How a read counts: kRead is a read (admission rule, hit counters, promotion); kContinued is
  // a further piece of a read already counted (a ranged GET's later ranges), which counts no hit
  // and promotes nothing (a miss, the key gone between pieces, is still counted), so reading one
  // value in pieces is one read, not several in a row, and
  // which does not read a value on disk (Aborted: reading it whole for a piece is the caller's
  // choice to make again).
  enum class ReadKind { kRead, kContinued };
  // A pinned view of the newest version; may promote the object (see the admission rule).
  // Served as TryAcquireFromMemory serves it when it can; only disk, promotion and an entry
  // being moved take the placement lock.
  Result<ReadHandle> Acquire(std::string_view key, ReadKind how = ReadKind::kRead);
  // The non-blocking subset of Acquire, for I/O threads that must not wait on disk or on
  // eviction: kServed (and *out set) when the object is in a memory tier and this read would not
  // promote it; kMiss when the key is absent; kNeedsSlowPath otherwise (call Acquire).
  // `device_ok`: the caller can serve device memory as it is; when false, an object in device
  // memory is kNeedsSlowPath before it is counted as a read (the slow path counts it once).
  FastPath TryAcquireFromMemory(std::string_view key, ReadHandle* out, bool device_ok = true,
                                ReadKind how = ReadKind::kRead);

  // Copies the object into `dst` (host or device memory). InvalidArgument if dst_size is
  // smaller than the object.
  Result<ObjectInfo> GetInto(std::string_view key, void* dst, uint64_t dst_size,
                             MemoryKind dst_kind = MemoryKind::kHost);
  // Copies the object into `out` (host memory).
  Result<ObjectInfo> Get(std::string_view key, std::string* out);
  // NotFound if absent.
  Result<ObjectInfo> Stat(std::string_view key);
  // NotFound if absent. The disk copy, if any, is deleted too.
  Status Delete(std::string_view key);
  // Delete only while `version` is the key's newest version (Aborted when another is; 0: any).
  Status DeleteVersion(std::string_view key, uint64_t version);

  // Membership handoff: commits an object that another node handed over, keeping the version it
  // had there, unless this cache already holds a newer version of the key (then nothing
  // changes). Returns whether the handed-off version is now the key's. Versions handed out
  // afterwards are above `version`.
  Result<bool> CommitHandedOff(WriteHandle handle, bool durable, uint64_t version);
  // As CommitHandedOff, but the object is installed only while the key's newest version is
  // exactly `expected_current` (0: the key is absent) at the moment it is published (read
  // repair: a write that reached this cache since the comparison wins over the push).
  Result<bool> CommitHandedOffIf(WriteHandle handle, bool durable, uint64_t version,
                                 uint64_t expected_current);
  // A version above every one this cache has handed out or installed so far (and at least the
  // wall clock's): what a delete "happens at", for comparing with handed-off versions.
  uint64_t VersionClock() const;
  // Every key with its newest version (one snapshot per index shard; keys written meanwhile may
  // be missing). For handoff scans: O(keys) memory.
  std::vector<KeyListing> ListKeys() const;

  // Copies between host and device memory (memcpy when both are host).
  Status CopyBytes(void* dst, MemoryKind dst_kind, const void* src, MemoryKind src_kind,
                   uint64_t size);

  // Bytes the disk tier holds in chunk records (DiskTier::ChunkBytes: a full scan; tests and
  // diagnostics). 0 without a disk tier.
  Result<uint64_t> DiskChunkBytes() const;

  // Writes every memory entry whose version is not on disk yet to the disk tier, then syncs it.
  // Used at shutdown so a restart finds everything. No-op without a disk tier.
  Status Flush();

  CacheStats GetStats() const;
  bool tier_enabled(Tier t) const;
  uint64_t tier_capacity(Tier t) const;
  // The largest object any tier can hold (for a memory tier: one placement partition's slice).
  uint64_t max_object_size() const;
  int placement_partitions() const;
  // Why the GPU tier is off (empty when on or not configured).
  const std::string& gpu_tier_note() const;
  // Whether the host tier is pinned (cudaHostAlloc) memory; false without a host tier. When not,
  // host_tier_note() says why (the start log says it too).
  bool host_pinned() const;
  std::string host_tier_note() const;
  // Every memory tier arena (GPU ones first), allocated at Open and valid until the cache is
  // destroyed.
  std::vector<MemoryRegion> memory_regions() const;

 private:
  struct Impl;
  friend class ReadHandle;
  friend class WriteHandle;
  explicit TieredCache(std::unique_ptr<Impl> impl);
  Result<WriteHandle> ReserveImpl(std::string_view key, uint64_t size, const TensorMeta& tensor,
                                  bool streamed, bool durable);
  // Publishes a committed entry (an Entry) as the newest version of its key; the part of a
  // commit that cannot fail.
  uint64_t Publish(WriteHandle& h, std::shared_ptr<void> entry);
  // Fills `out` from a live memory-tier entry (an Entry) already pinned for it, and marks the
  // entry read for the eviction scan. REQUIRES: `out` holds nothing.
  void FillReadHandle(std::shared_ptr<void> entry, ReadHandle* out);
  std::unique_ptr<Impl> impl_;
};

}  // namespace gkv
