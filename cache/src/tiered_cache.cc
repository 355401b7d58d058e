#include "gkv/cache/tiered_cache.h"

#include <atomic>
#include <condition_variable>
#include <cstring>
#include <list>
#include <map>
#include <mutex>
#include <new>
#include <unordered_map>

#include "gkv/block_pool.h"
#include "gkv/hash.h"
#include "gkv/hybrid_clock.h"
#include "gkv/log.h"
#include "gkv/sanitizers.h"
#include "gkv/size.h"
#include "gkv/storage/disk_tier.h"

namespace gkv {

std::string_view TierName(Tier tier) {
  switch (tier) {
    case Tier::kGpu:
      return "gpu";
    case Tier::kHost:
      return "host";
    case Tier::kDisk:
      return "disk";
  }
  return "unknown";
}

namespace {

using Clock = std::chrono::steady_clock;

// Lifetime: the index holds the owning shared_ptr of every live entry; anyone who releases the
// placement lock while using an entry holds its own reference (shared_from_this).
struct Entry : std::enable_shared_from_this<Entry> {
  std::string key;
  uint64_t size = 0;
  uint64_t version = 0;
  TensorMeta tensor;

  // The placement partition that holds it (Impl::partitions), fixed by its key's hash.
  uint32_t partition = 0;
  // Placement: written under its partition's lock, and `tier`, `arena` and `data` only while no
  // reader's
  // pin is held and none can be taken (the pin protocol, see Impl::TryPin). A reader that holds
  // a pin reads them without the placement lock.
  Tier tier = Tier::kHost;
  MemoryArena* arena = nullptr;  // memory tiers
  std::byte* data = nullptr;     // memory tiers
  // Holds on the bytes at `data`: readers' (the fast path's under the key's shard lock and no
  // placement lock, Acquire's under the placement lock) and placement's own (under the
  // placement lock). Bit Impl::kFrozen: placement is
  // changing where the bytes are; no pin is taken while it is set. It is set and cleared within
  // one hold of the placement lock, so holders of that lock never see it.
  std::atomic<uint32_t> pins{0};
  std::atomic<bool> live{true};      // false once deleted, replaced or dropped; never true again
  std::atomic<bool> on_disk{false};  // the disk tier holds this version
  bool durable = false;  // committed durable (a disk copy that capacity eviction keeps); fixed
  // Writes of this version to the disk tier in flight (spill, Flush, write-through). While
  // > 0 the version may land on disk at any moment: whoever replaces or deletes it must see to
  // that copy (Impl::writeback_done signals the end of each).
  int writebacks = 0;
  std::list<Entry*>::iterator lru;  // placement lock
  // Read since the eviction scan last passed it (CLOCK's reference bit): a read sets it
  // without the placement lock, and the scan gives such an entry a second chance (to the front
  // of its list) instead of moving it down. Reads thus never reorder a list.
  std::atomic<bool> referenced{false};
  // The admission rule's read history (heuristics: relaxed, a lost update only delays a
  // promotion).
  std::atomic<Clock::rep> last_read{0};  // Clock ticks since its epoch
  std::atomic<uint32_t> reads_in_tier{0};
};

// One tier within one placement partition.
struct TierState {
  bool enabled = false;
  uint64_t capacity = 0;                             // per arena slice for memory tiers
  std::vector<std::unique_ptr<MemoryArena>> arenas;  // this partition's slice of each arena
  size_t next_arena = 0;
  std::list<Entry*> lru;  // front = most recently placed or given a second chance
  uint64_t objects = 0;
};

// Work found under the placement lock that needs the shard lock or disk I/O, done afterwards
// (the lock order forbids taking a shard lock while holding the placement lock).
struct PendingOp {
  enum Kind { kDiskEvicted, kDeleteStaleDiskCopy, kRemoveFromIndex } kind;
  std::string key;
  uint64_t version;
};

// Aligned so that two shards' locks and counters never share a cache line.
struct alignas(64) Shard {
  std::mutex mu;
  std::unordered_map<std::string, std::shared_ptr<Entry>, StringKeyHash, std::equal_to<>> map;
  // Reads of this shard's keys, summed by GetStats: counted here rather than on counters every
  // reader of the node shares (relaxed).
  std::atomic<uint64_t> hits[kTierCount] = {};
  std::atomic<uint64_t> misses{0};
  // This shard's keys with a commit between its disk write and its publish (CommitBatch), and
  // how many: the disk holds a version of theirs newer than the visible one. A leaf lock (taken
  // alone, or under a placement lock, and nothing taken under it).
  std::mutex committing_mu;
  std::unordered_map<std::string, int, StringKeyHash, std::equal_to<>> committing;
  std::atomic<int> commits_in_flight{0};  // the sum of `committing` (changed under its lock)
};

}  // namespace

struct TieredCache::Impl {
  CacheOptions options;
  std::vector<std::unique_ptr<Shard>> shards;
  std::unique_ptr<DiskTier> disk;
  // Device copies: one stream per GPU, each copy on the stream of the device whose memory it
  // touches (a GPU arena's device, or a caller's buffer's from its pointer attributes), so a
  // copy for GPU 1 neither runs on GPU 0's queue nor waits behind it. Made at Open for the GPU
  // tier's devices (and device 0 for a GPU machine without a GPU tier), others on first use.
  std::mutex copiers_mu;
  std::map<int, std::unique_ptr<DeviceCopier>> copiers;  // guarded by copiers_mu
  bool device_copies = false;  // a usable GPU (or the fake device): copiers can be made

  // The copier for the device that `device_ptr` belongs to; null when none can be made.
  DeviceCopier* CopierFor(const void* device_ptr) {
    if (!device_copies) return nullptr;
    int device = -1;
    for (const auto& arena : arenas[0]) {
      if (arena->kind() == MemoryKind::kDevice && arena->Contains(device_ptr)) {
        device = arena->device();
        break;
      }
    }
    if (device < 0) device = CudaPointerDevice(device_ptr);
    if (device < 0) device = 0;
    std::lock_guard<std::mutex> lock(copiers_mu);
    auto& slot = copiers[device];
    if (!slot) {
      auto made = DeviceCopier::Create(device);
      if (!made.ok()) return nullptr;
      slot = std::move(*made);
    }
    return slot.get();
  }
  std::string gpu_note;
  std::atomic<uint64_t> next_version{1};
  // Versions below version_limit are covered by the high-water mark persisted in the disk tier,
  // so a restart (which starts at that mark) never hands one out again. Extended in blocks.
  std::atomic<uint64_t> version_limit{UINT64_MAX};
  std::mutex mark_mu;  // serializes extensions of the mark

  // The memory tiers' whole arenas (one per GPU device; one host arena) as allocated at Open;
  // the partitions hold slices of them. memory_regions lists these.
  std::vector<std::unique_ptr<MemoryArena>> arenas[2];
  // Placement partitions: each owns a slice of every memory tier's arena, the LRU lists of
  // its keys and its counters, under its own lock, so puts and moves of keys in different
  // partitions share no lock. A key's partition follows from its index shard (PartitionIndex),
  // so the lock order shard mutex -> partition mutex is the old one. One partition is the
  // single placement lock this cache had before.
  // (Declared after `arenas`: the partitions' slices go before the arenas they slice.)
  struct Partition;
  std::vector<std::unique_ptr<Partition>> partitions;
  // Work found under a partition lock that needs a shard lock or disk I/O, done afterwards by
  // DrainEvictions. A leaf lock: taken under partition locks, nothing is taken under it.
  std::mutex pending_mu;
  std::vector<PendingOp> pending;  // guarded by pending_mu
  // Set (under pending_mu) when work is queued, cleared when it is taken: a DrainEvictions that
  // reads false skips the lock. Work queued concurrently with a drain is left to the next one,
  // as it was when the drain took the lock a moment before it was queued.
  std::atomic<bool> pending_queued{false};

  size_t ShardIndex(std::string_view key) const { return HashKey(key) % shards.size(); }
  Shard& ShardFor(std::string_view key) { return *shards[ShardIndex(key)]; }

  // A commit of `key` enters (before its disk write) and leaves (after its batch is published)
  // the span in which the disk may hold a version of the key newer than the visible one. Every
  // leave has its enter (CommitBatch's LeaveCommits).
  void EnterCommit(const std::string& key) {
    Shard& s = ShardFor(key);
    std::lock_guard<std::mutex> lock(s.committing_mu);
    s.committing[key]++;
    s.commits_in_flight.fetch_add(1, std::memory_order_release);
  }
  void LeaveCommit(const std::string& key) {
    Shard& s = ShardFor(key);
    std::lock_guard<std::mutex> lock(s.committing_mu);
    auto it = s.committing.find(key);
    if (it == s.committing.end()) {
      GKV_LOG_ERROR("commit of '{}' left without having entered (a bug)", key.substr(0, 32));
      return;
    }
    if (--it->second == 0) s.committing.erase(it);
    s.commits_in_flight.fetch_sub(1, std::memory_order_release);
  }
  // Whether a commit of `key` is in that span. Without the lock while its shard has none: a
  // commit enters before it writes to disk, so whoever saw its disk write sees it entered.
  bool HasCommitInFlight(std::string_view key) {
    Shard& s = ShardFor(key);
    if (s.commits_in_flight.load(std::memory_order_acquire) == 0) return false;
    std::lock_guard<std::mutex> lock(s.committing_mu);
    return s.committing.find(key) != s.committing.end();
  }
  uint32_t PartitionIndex(size_t shard_index) const {
    return static_cast<uint32_t>(shard_index % partitions.size());
  }
  Partition& PartOfShard(size_t shard_index) { return *partitions[PartitionIndex(shard_index)]; }
  Partition& PartOf(const Entry* e) { return *partitions[e->partition]; }
  // Every partition's tiers have one shape, fixed at Open (read without a lock): whether each
  // is on, and its capacity, which for a memory tier is the largest object it holds (a slice).
  const TierState& Shape(Tier t) const { return partitions.front()->tiers[static_cast<int>(t)]; }

  // Versions are hybrid clocks: a version is at least the wall clock in microseconds times 1024
  // (WallClockVersion), above every version this node handed out or installed before. So
  // versions of different nodes compare in the order the writes happened (to within the clocks'
  // skew), which is what a handoff between nodes needs ("versions decide").
  // The persisted mark still guards a restart whose clock went backwards: a block of 2^32
  // (about 4.2 s of clock) per extension; the fast path leaves the last 2^30 (about 1 s) to the
  // slow path, so a node whose versions follow the clock writes the mark (one synced write)
  // about every 3 s. A restart starts at the mark, so its versions are at most one block ahead
  // of the clock: with 2^42 blocks (70 minutes) they ran an hour ahead of every other node's,
  // clients stamping with them were refused, and a handed-off older copy with such a version
  // beat newer writes (issue 38 (b)).
  static constexpr uint64_t kVersionBlock = uint64_t{1} << 32;
  static constexpr uint64_t kVersionMargin = uint64_t{1} << 30;

  // Takes a version from the clock (no disk I/O; the caller checks the mark).
  uint64_t TakeVersion() {
    const uint64_t floor = WallClockVersion();
    uint64_t cur = next_version.load(std::memory_order_relaxed);
    for (;;) {
      const uint64_t v = std::max(cur, floor);
      if (next_version.compare_exchange_weak(cur, v + 1, std::memory_order_relaxed)) return v;
    }
  }

  // Versions handed out from now on are above `v` (a version installed from another node).
  void ObserveVersion(uint64_t v) {
    uint64_t cur = next_version.load(std::memory_order_relaxed);
    while (cur <= v && !next_version.compare_exchange_weak(cur, v + 1, std::memory_order_relaxed)) {
    }
  }

  // The version a commit with a client-requested version `requested` gets (WriteHandle::
  // RequestVersion): `requested`, or just above the key's newest if that is newer. `current`
  // is the key's newest version (0: none).
  static uint64_t VersionForRequest(uint64_t requested, uint64_t current) {
    return current > requested ? current + 1 : requested;
  }

  // A version from outside (client-requested or handed off) that this cache now uses: versions
  // handed out from now on are above it, and the persisted mark covers it. May write the mark
  // (synced disk I/O). REQUIRES: no lock held.
  void AdoptVersion(uint64_t v) {
    // The mark first: once observed, the fast path may hand out versions above `v`.
    ExtendMarkPast(v);
    ObserveVersion(v);
  }

  // A new version, greater than every version handed out before, this run or an earlier one.
  // May write the mark (synced disk I/O). REQUIRES: no lock held.
  uint64_t NextVersion() {
    const uint64_t v = TakeVersion();
    ExtendMarkPast(v);
    return v;
  }

  // Keeps the persisted mark above `v` by the margin. REQUIRES: no lock held.
  void ExtendMarkPast(uint64_t v) {
    if (v + kVersionMargin >= version_limit.load()) {
      std::lock_guard<std::mutex> lock(mark_mu);
      const uint64_t limit = version_limit.load();
      if (v + kVersionMargin >= limit) {
        const uint64_t next_limit = std::max(limit, v) + kVersionBlock;
        Status s = disk->WriteVersionMark(next_limit);
        if (!s.ok()) {
          // Versions still grow in this run; only a restart could repeat one.
          GKV_LOG_ERROR("persisting the version mark: {}", s.ToString());
        }
        version_limit = next_limit;
      }
    }
  }

  // The version a reader sees for `key` now (0: none, or dropped and awaiting removal).
  uint64_t VisibleVersion(std::string_view key) {
    const size_t si = ShardIndex(key);
    Shard& s = *shards[si];
    std::lock_guard<std::mutex> shard_lock(s.mu);
    std::lock_guard<std::mutex> lock(partitions[PartitionIndex(si)]->mu);
    auto it = s.map.find(key);
    return it != s.map.end() && it->second->live ? it->second->version : 0;
  }

  std::shared_ptr<Entry> Lookup(std::string_view key) {
    Shard& s = ShardFor(key);
    std::lock_guard<std::mutex> lock(s.mu);
    auto it = s.map.find(key);
    return it == s.map.end() ? nullptr : it->second;
  }

  // --- the pin protocol ---
  // A reader pins an entry with no placement lock (TryPin, under the key's shard lock) and
  // releases it with none (ReleaseReadPin). Placement, under the partition lock, changes where
  // an entry's bytes are (Relocate) or drops it only after Freeze(e, own) succeeded: the pins
  // are exactly its own `own`, and none can be taken until Thaw. Kill and the last release of a
  // dead entry's pin decide who frees its memory: Kill stores live=false and then reads the
  // pins; a release drops its pin and then reads live (both sequentially consistent), so at
  // least one of them sees the other and frees, under the partition lock (FreeMemory is
  // idempotent).
  static constexpr uint32_t kFrozen = uint32_t{1} << 31;

  static bool TryPin(Entry* e) {
    uint32_t p = e->pins.load(std::memory_order_relaxed);
    do {
      if (p & kFrozen) return false;
    } while (!e->pins.compare_exchange_weak(p, p + 1, std::memory_order_seq_cst,
                                            std::memory_order_relaxed));
    return true;
  }

  // A reader's release. REQUIRES: no lock held.
  void ReleaseReadPin(Entry* e) {
    if (e->pins.fetch_sub(1) != 1 || e->live.load()) return;
    Partition& p = PartOf(e);
    std::lock_guard<std::mutex> lock(p.mu);
    if (PinCount(e) == 0) p.FreeMemory(e);
  }

  // --- pins, for the placement helpers below (which REQUIRE their partition's mu held) ---

  static uint32_t PinCount(const Entry* e) { return e->pins.load() & ~kFrozen; }
  static void Pin(Entry* e) { e->pins.fetch_add(1); }
  // Succeeds when the only pins are the caller's `own`; then no pin is taken until Thaw, which
  // must follow before the placement lock is released.
  static bool Freeze(Entry* e, uint32_t own) {
    uint32_t expected = own;
    return e->pins.compare_exchange_strong(expected, own | kFrozen);
  }
  static void Thaw(Entry* e) { e->pins.fetch_and(~kFrozen); }
  // Thaws at the end of its scope, so that a throw (bad_alloc linking a list node) between
  // Freeze and Thaw cannot leave an entry frozen for good.
  struct Frozen {
    Entry* e;
    ~Frozen() { Thaw(e); }
  };

  // One placement partition (see `partitions`). Its helpers all REQUIRE its mu held, except
  // where they say otherwise.
  struct Partition {
    Impl* impl = nullptr;
    uint32_t index = 0;
    mutable std::mutex mu;                   // this partition's placement lock
    std::condition_variable writeback_done;  // with mu: some Entry::writebacks went down
    TierState tiers[kTierCount];
    CacheStats counters;  // guarded by mu (tier figures, hits and misses filled in GetStats)

    // Waits until no write of `e` to disk is in flight. REQUIRES: `lock` holds mu.
    void WaitForWritebacks(Entry* e, std::unique_lock<std::mutex>& lock) {
      writeback_done.wait(lock, [e] { return e->writebacks == 0; });
    }

    void EndWriteback(Entry* e) {
      e->writebacks--;
      if (e->writebacks == 0) writeback_done.notify_all();
    }

    // List nodes unlinked from an LRU list are kept here (up to kSpareLruNodes) and spliced back
    // in by the next LinkLru: an overwrite or a move between tiers allocates no list node.
    // Placement lock.
    // None under AddressSanitizer: a stale Entry::lru then points at a freed node, which it
    // reports.
    static constexpr size_t kSpareLruNodes = kAddressSanitizer ? 0 : 64;
    std::list<Entry*> spare_lru_nodes;

    void LinkLru(Entry* e) {
      TierState& t = tiers[static_cast<int>(e->tier)];
      t.objects++;
      if (e->tier == Tier::kDisk) return;
      if (spare_lru_nodes.empty()) {
        t.lru.push_front(e);
      } else {
        t.lru.splice(t.lru.begin(), spare_lru_nodes, spare_lru_nodes.begin());
        t.lru.front() = e;
      }
      e->lru = t.lru.begin();
    }

    void UnlinkLru(Entry* e) {
      TierState& t = tiers[static_cast<int>(e->tier)];
      t.objects--;
      if (e->tier == Tier::kDisk) return;
      if (spare_lru_nodes.size() < kSpareLruNodes) {
        spare_lru_nodes.splice(spare_lru_nodes.begin(), t.lru, e->lru);
      } else {
        t.lru.erase(e->lru);
      }
    }

    void Touch(Entry* e) {
      if (e->tier == Tier::kDisk) return;
      TierState& t = tiers[static_cast<int>(e->tier)];
      t.lru.splice(t.lru.begin(), t.lru, e->lru);
    }

    void FreeMemory(Entry* e) {
      if (e->data) {
        e->arena->Free(e->data);
        e->data = nullptr;
        e->arena = nullptr;
      }
    }

    // Marks an entry dead; its memory goes now, or with its last pin.
    void Kill(Entry* e) {
      if (!e->live) return;
      e->live = false;
      UnlinkLru(e);
      if (PinCount(e) == 0) FreeMemory(e);
    }

    // Releases placement's own pin.
    void Unpin(Entry* e) {
      if (e->pins.fetch_sub(1) == 1 && !e->live) FreeMemory(e);
    }

    // The least recently used entry of `t` that can move now, giving entries read since the last
    // scan a second chance first (to the front, reference cleared). At most as many second
    // chances per call as the list has entries, so a stream of reads cannot keep the scan going.
    // Can move now: not pinned, and its key has no commit in flight (a move to disk would meet
    // the newer version and be refused, see MoveDown; picked again and again, the entry would
    // keep the allocating thread looping on this lock while the commit waits for it). nullptr if
    // none.
    Entry* PickVictim(TierState& t) {
      size_t chances = t.lru.size();
      auto it = t.lru.end();
      while (it != t.lru.begin()) {
        auto cur = std::prev(it);
        Entry* e = *cur;
        if (chances > 0 && e->referenced.load(std::memory_order_relaxed)) {
          chances--;
          e->referenced.store(false, std::memory_order_relaxed);
          t.lru.splice(t.lru.begin(), t.lru, cur);  // `it` stays valid: its predecessor is next
          continue;
        }
        if (PinCount(e) == 0 && !impl->HasCommitInFlight(e->key)) return e;
        it = cur;
      }
      return nullptr;
    }

    std::byte* TryAllocate(Tier tier, uint64_t size, MemoryArena** arena) {
      TierState& t = tiers[static_cast<int>(tier)];
      const size_t n = t.arenas.size();
      for (size_t i = 0; i < n; ++i) {
        MemoryArena* a = t.arenas[(t.next_arena + i) % n].get();
        if (std::byte* p = a->Allocate(size)) {
          t.next_arena = (t.next_arena + i + 1) % n;
          *arena = a;
          return p;
        }
      }
      return nullptr;
    }

    // Allocates `size` bytes in memory tier `tier`, moving LRU entries down until it fits.
    // May release and retake `lock`. Returns nullptr if no remaining entry can move now
    // (PickVictim).
    std::byte* AllocateIn(Tier tier, uint64_t size, MemoryArena** arena,
                          std::unique_lock<std::mutex>& lock) {
      TierState& t = tiers[static_cast<int>(tier)];
      if (!t.enabled || size > t.capacity) return nullptr;
      for (;;) {
        if (std::byte* p = TryAllocate(tier, size, arena)) return p;
        Entry* victim = PickVictim(t);
        if (!victim) return nullptr;
        MoveDown(victim, lock);
      }
    }

    // Moves one unpinned live entry out of its memory tier: to the next memory tier with room,
    // else to disk, else drops it. Progress: the entry leaves its tier, or (a reader pinned it
    // meanwhile) goes to the front of its LRU list, so the caller's next pick is another one.
    void MoveDown(Entry* e, std::unique_lock<std::mutex>& lock) {
      // A live entry in an LRU list is owned by the index right now (we hold the placement lock);
      // keep it alive across the unlocked copy below even if it is replaced or deleted meanwhile.
      std::shared_ptr<Entry> keep = e->shared_from_this();
      const Tier from = e->tier;
      // Fast memory tier -> slow one.
      const TierState& slow = tiers[static_cast<int>(impl->slow_tier)];
      bool read_meanwhile = false;
      if (from == impl->fast_tier && slow.enabled && e->size <= slow.capacity) {
        Pin(e);  // keeps the victim in place while the lock is released
        MemoryArena* dst_arena = nullptr;
        std::byte* dst = AllocateIn(impl->slow_tier, e->size, &dst_arena, lock);
        if (dst) {
          MemoryArena* src_arena = e->arena;
          std::byte* src = e->data;
          lock.unlock();
          Status s = impl->Copy(dst, dst_arena->kind(), src, src_arena->kind(), e->size);
          if (impl->options.test_after_spill_copy) impl->options.test_after_spill_copy(e->key);
          lock.lock();
          // Readers that pinned the entry meanwhile hold pointers into the old block: then the
          // move is abandoned and the entry stays where it is.
          if (s.ok() && e->live && Freeze(e, 1)) {
            {
              Frozen frozen{e};
              Relocate(e, impl->slow_tier, dst_arena, dst);
            }
            Unpin(e);
            return;
          }
          // (A reader's pin refused the freeze; it may be released already, but the entry was
          // in use: it stays, rather than going on to disk below.)
          read_meanwhile = s.ok() && e->live;
          dst_arena->Free(dst);
          if (!s.ok()) {
            GKV_LOG_WARN("spill {} -> {} of '{}' failed: {}", TierName(from),
                         TierName(impl->slow_tier), e->key, s.ToString());
          }
        }
        Unpin(e);
        if (!e->live || e->tier != from) return;
        if (read_meanwhile || PinCount(e) > 0) {
          // Someone pinned it while we were away; it can't move now. Let the caller pick again
          // by touching it (it is in use, after all).
          Touch(e);
          return;
        }
      }
      // Memory -> disk. (Readers may pin the victim at any moment: each change below is made
      // frozen, and a reader that got in first keeps the entry where it is.)
      if (e->on_disk) {
        if (!Freeze(e, 0)) {
          Touch(e);
          return;
        }
        Frozen frozen{e};
        Relocate(e, Tier::kDisk, nullptr, nullptr);
        return;
      }
      if (impl->disk && e->size + e->key.size() <= impl->disk->capacity()) {
        Pin(e);
        e->writebacks++;
        const std::byte* src = e->data;
        MemoryArena* src_arena = e->arena;
        StoredObjectMeta meta{e->size, e->version, e->tensor};
        const std::string key = e->key;
        lock.unlock();
        if (impl->options.test_before_disk_spill) impl->options.test_before_disk_spill(key);
        std::vector<DiskEviction> evicted;
        std::string staging;
        Status s;
        if (src_arena->kind() == MemoryKind::kDevice) {
          staging.resize(e->size);
          s = impl->Copy(staging.data(), MemoryKind::kHost, src, MemoryKind::kDevice, e->size);
          src = reinterpret_cast<const std::byte*>(staging.data());
        }
        bool written = false;
        if (s.ok()) s = impl->disk->Put(key, meta, src, /*sync=*/false, &evicted, &written);
        lock.lock();
        impl->QueueDiskEvictions(evicted);
        if (s.ok() && written) e->on_disk = true;  // of this version, even if it is dead now
        EndWriteback(e);
        Unpin(e);
        if (s.ok() && !written) {
          // A newer version of the key is already on disk: this one is superseded. While the
          // commit that wrote it has not published it yet (a durable or disk-tier put writes
          // before it publishes), this entry is still what readers must find: dropped now, they
          // would miss in between (an acknowledged value read as not found). So it stays, and
          // the room comes from another entry (PickVictim passes over it until the commit has
          // replaced it). Otherwise (a hand-off refused at publish leaves its newer copy) it
          // goes.
          if (e->live && e->tier == from) {
            if (impl->HasCommitInFlight(e->key) || !Freeze(e, 0)) {
              Touch(e);
              return;
            }
            Frozen frozen{e};
            counters.dropped++;
            impl->RemoveFromIndexLater(e);
            Kill(e);
          }
          return;
        }
        if (s.ok()) {
          if (!e->live) {
            // Deleted or replaced while being written. The Delete or Commit that killed it waits
            // for this write and deletes (or overwrites) the copy, synced; this queued delete only
            // covers a failure there.
            impl->AddPending({PendingOp::kDeleteStaleDiskCopy, key, meta.version});
            return;
          }
          if (e->tier == from && Freeze(e, 0)) {
            Frozen frozen{e};
            Relocate(e, Tier::kDisk, nullptr, nullptr);
          } else if (e->tier == from) {
            Touch(e);
          }
          return;
        }
        if (s.code() == StatusCode::kNoSpace) {
          GKV_LOG_DEBUG("spill {} -> disk of '{}' refused: {}", TierName(from), key, s.ToString());
        } else {
          GKV_LOG_WARN("spill {} -> disk of '{}' failed: {}", TierName(from), key, s.ToString());
        }
        if (!e->live || e->tier != from) return;
      }
      if (!Freeze(e, 0)) {
        Touch(e);
        return;
      }
      // Nowhere to go: a cache may drop what it can't keep (it was never promised durable).
      Frozen frozen{e};
      counters.dropped++;
      impl->RemoveFromIndexLater(e);
      Kill(e);
    }

    // `e` replaced `old`, whose version is on disk or on its way there, and `e` is not on disk.
    // A restart must serve neither the old copy (stale) nor nothing where a durable value was:
    // `e` is written through (synced), which replaces the old copy in one RocksDB write, and a
    // late write of the old version is refused (versions only grow). If the disk tier cannot take
    // `e`, the old copy is deleted, synced, once its writes in flight are done. REQUIRES: no lock
    // held; `e` pinned and its writebacks raised by the caller (released here).
    void ReplaceDiskCopy(Entry* e, Entry* old) {
      Status s;
      const void* src = e->data;
      std::string staging;
      if (e->arena && e->arena->kind() == MemoryKind::kDevice) {
        staging.resize(e->size);
        s = impl->Copy(staging.data(), MemoryKind::kHost, e->data, MemoryKind::kDevice, e->size);
        src = staging.data();
      }
      std::vector<DiskEviction> evicted;
      bool written = false;
      if (s.ok()) {
        s = impl->disk->Put(e->key, {e->size, e->version, e->tensor, false}, src, /*sync=*/true,
                            &evicted, &written);
      }
      std::unique_lock<std::mutex> lock(mu);
      impl->QueueDiskEvictions(evicted);
      if (s.ok() && written) e->on_disk = true;
      EndWriteback(e);
      Unpin(e);
      if (s.ok()) return;  // written, or a newer version is on disk already
      GKV_LOG_DEBUG("write-through of '{}' refused ({}); deleting the older disk copy", e->key,
                    s.ToString());
      WaitForWritebacks(old, lock);
      const bool old_on_disk = old->on_disk;
      lock.unlock();
      if (!old_on_disk) return;
      Status ds = impl->disk->DeleteIfVersion(old->key, old->version, /*sync=*/true);
      if (!ds.ok()) {
        GKV_LOG_ERROR(
            "deleting the replaced disk copy of '{}' (version {}): {}; a crash before "
            "the queued retry could serve it",
            old->key, old->version, ds.ToString());
        lock.lock();
        impl->AddPending({PendingOp::kDeleteStaleDiskCopy, old->key, old->version});
      }
    }

    void Relocate(Entry* e, Tier to, MemoryArena* arena, std::byte* data) {
      const Tier from = e->tier;
      counters.moves[static_cast<int>(from)][static_cast<int>(to)]++;
      counters.moved_bytes[static_cast<int>(from)][static_cast<int>(to)] += e->size;
      UnlinkLru(e);
      FreeMemory(e);
      e->tier = to;
      e->arena = arena;
      e->data = data;
      e->reads_in_tier.store(0, std::memory_order_relaxed);
      LinkLru(e);
    }

    // Makes `e` the key's entry, unless a newer version is there already (then `e` dies at once
    // and false is returned). *old receives the entry it replaced. REQUIRES: the key's shard lock
    // and the placement lock.
    // `expected`: publish only while the key's newest version is exactly *expected (0: absent).
    // `*newer` (when given) tells a refusal for a newer version from one for the expectation.
    bool Publish(Shard& s, const std::shared_ptr<Entry>& e, std::shared_ptr<Entry>* old,
                 const uint64_t* expected = nullptr, bool* newer = nullptr) {
      LinkLru(e.get());
      counters.puts++;
      auto it = s.map.find(e->key);
      const bool found = it != s.map.end();
      // What a reader sees: a dropped entry waiting for its removal reads as absent.
      const uint64_t visible = found && it->second->live ? it->second->version : 0;
      const bool newer_there = found && it->second->version > e->version;
      if (newer) *newer = newer_there;
      if (newer_there || (expected && visible != *expected)) {
        Kill(e.get());
        return false;
      }
      if (it != s.map.end()) {
        *old = it->second;
        Kill(old->get());
        it->second = e;
      } else {
        s.map.emplace(e->key, e);
      }
      return true;
    }
  };

  void AddPending(PendingOp op) {
    std::lock_guard<std::mutex> lock(pending_mu);
    pending.push_back(std::move(op));
    pending_queued.store(true, std::memory_order_release);
  }

  void RemoveFromIndexLater(Entry* e) {
    // The index entry is removed outside the partition lock (lock order), by version.
    AddPending({PendingOp::kRemoveFromIndex, e->key, e->version});
  }

  void QueueDiskEvictions(const std::vector<DiskEviction>& evicted) {
    if (evicted.empty()) return;
    std::lock_guard<std::mutex> lock(pending_mu);
    for (const auto& ev : evicted) pending.push_back({PendingOp::kDiskEvicted, ev.key, ev.version});
    pending_queued.store(true, std::memory_order_release);
  }

  Status Copy(void* dst, MemoryKind dk, const void* src, MemoryKind sk, uint64_t size) {
    if (size == 0) return Status::OK();
    // Fake-device mode (tests): the kinds must be what the pointers are.
    GKV_RETURN_IF_ERROR(CheckMemoryKind(dst, size, dk));
    GKV_RETURN_IF_ERROR(CheckMemoryKind(src, size, sk));
    if (dk == MemoryKind::kHost && sk == MemoryKind::kHost) {
      std::memcpy(dst, src, size);
      return Status::OK();
    }
    DeviceCopier* copier = CopierFor(dk == MemoryKind::kDevice ? dst : src);
    if (!copier) return Status::NotSupported("device memory copy without a usable GPU");
    return copier->Copy(dst, src, size);
  }

  // Applies what the disk tier evicted, and index removals queued under partition locks.
  // REQUIRES: no lock held.
  void DrainEvictions() {
    // Most calls find nothing queued: they take no lock that every partition shares.
    if (!pending_queued.load(std::memory_order_acquire)) return;
    std::vector<PendingOp> work;
    {
      std::lock_guard<std::mutex> lock(pending_mu);
      pending_queued.store(false, std::memory_order_relaxed);
      if (pending.empty()) return;
      work.swap(pending);
    }
    for (const PendingOp& op : work) {
      if (op.kind == PendingOp::kDeleteStaleDiskCopy) {
        if (disk) {
          Status ds = disk->DeleteIfVersion(op.key, op.version);
          if (!ds.ok())
            GKV_LOG_WARN("deleting a stale disk copy of '{}': {}", op.key, ds.ToString());
        }
        continue;
      }
      const size_t si = ShardIndex(op.key);
      Shard& s = *shards[si];
      std::lock_guard<std::mutex> shard_lock(s.mu);
      auto it = s.map.find(op.key);
      Partition& p = *partitions[PartitionIndex(si)];
      std::lock_guard<std::mutex> lock(p.mu);
      if (op.kind == PendingOp::kDiskEvicted) p.counters.disk_evictions++;
      if (it == s.map.end() || it->second->version != op.version) continue;
      Entry* e = it->second.get();
      if (op.kind == PendingOp::kRemoveFromIndex) {
        s.map.erase(it);
        continue;
      }
      e->on_disk = false;
      if (e->live && e->tier == Tier::kDisk) {
        p.Kill(e);
        s.map.erase(it);
      }
    }
  }

  // Whether a read now falls within the window of an earlier one (the admission rule).
  bool ReadAgainWithinWindow(const Entry* e, Clock::time_point now) const {
    return options.promote_on_read && e->reads_in_tier.load(std::memory_order_relaxed) >= 1 &&
           now - Clock::time_point(Clock::duration(e->last_read.load(std::memory_order_relaxed))) <=
               options.promotion_window;
  }

  bool WouldPromote(const Entry* e, Clock::time_point now) const {
    return ReadAgainWithinWindow(e, now) && Rank(TopMemoryTierFor(e->size)) < Rank(e->tier);
  }

  // Records a read; returns whether it promotes (tier permitting). No lock needed.
  bool Admit(Entry* e, Clock::time_point now) {
    const bool promote = ReadAgainWithinWindow(e, now);
    e->reads_in_tier.fetch_add(1, std::memory_order_relaxed);
    e->last_read.store(now.time_since_epoch().count(), std::memory_order_relaxed);
    return promote;
  }

  // Marks a read for the eviction scan (CLOCK's reference bit), without writing the entry's
  // line when it is marked already.
  static void MarkReferenced(Entry* e) {
    if (!e->referenced.load(std::memory_order_relaxed)) {
      e->referenced.store(true, std::memory_order_relaxed);
    }
  }

  // The memory tiers in placement order: new objects and promotions go to `fast_tier` first,
  // and it spills to `slow_tier` (GPU then host, or host then GPU with gpu_behind_host).
  Tier fast_tier = Tier::kGpu;
  Tier slow_tier = Tier::kHost;
  // Placement rank: 0 fast memory tier, 1 slow memory tier, 2 disk.
  int Rank(Tier t) const { return t == fast_tier ? 0 : t == slow_tier ? 1 : 2; }

  Tier TopMemoryTierFor(uint64_t size) const {
    for (Tier t : {fast_tier, slow_tier}) {
      if (Shape(t).enabled && size <= Shape(t).capacity) return t;
    }
    return Tier::kDisk;
  }
};

// ---------------- handles ----------------

ReadHandle::ReadHandle(ReadHandle&& o) noexcept { *this = std::move(o); }

ReadHandle& ReadHandle::operator=(ReadHandle&& o) noexcept {
  if (this != &o) {
    Release();
    cache_ = o.cache_;
    entry_ = std::move(o.entry_);
    owned_ = std::move(o.owned_);
    kind_ = o.kind_;
    info_ = std::move(o.info_);
    data_ = entry_ ? o.data_ : reinterpret_cast<const std::byte*>(owned_.data());
    o.cache_ = nullptr;
    o.data_ = nullptr;
  }
  return *this;
}

ReadHandle::~ReadHandle() { Release(); }

void ReadHandle::Release() {
  if (cache_ && entry_) cache_->impl_->ReleaseReadPin(static_cast<Entry*>(entry_.get()));
  entry_.reset();
  cache_ = nullptr;
  data_ = nullptr;
}

WriteHandle::WriteHandle(WriteHandle&& o) noexcept { *this = std::move(o); }

WriteHandle& WriteHandle::operator=(WriteHandle&& o) noexcept {
  if (this != &o) {
    Release();
    cache_ = o.cache_;
    key_ = std::move(o.key_);
    shard_ = o.shard_;
    tensor_ = std::move(o.tensor_);
    size_ = o.size_;
    tier_ = o.tier_;
    arena_ = o.arena_;
    data_ = o.data_;
    staging_ = std::move(o.staging_);
    disk_stream_ = o.disk_stream_;
    kind_ = o.kind_;
    handed_version_ = o.handed_version_;
    requested_version_ = o.requested_version_;
    expect_current_ = o.expect_current_;
    expected_current_ = o.expected_current_;
    o.cache_ = nullptr;
    o.arena_ = nullptr;
    o.data_ = nullptr;
    o.disk_stream_ = 0;
  }
  return *this;
}

WriteHandle::~WriteHandle() { Release(); }

void WriteHandle::Release() {
  if (cache_ && arena_ && data_) {
    std::lock_guard<std::mutex> lock(cache_->impl_->PartOfShard(shard_).mu);
    arena_->Free(data_);
  }
  if (cache_ && disk_stream_ != 0) cache_->impl_->disk->AbortChunks(disk_stream_);
  cache_ = nullptr;
  arena_ = nullptr;
  data_ = nullptr;
  disk_stream_ = 0;
  staging_.reset();
}

// ---------------- TieredCache ----------------

TieredCache::TieredCache(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

TieredCache::~TieredCache() {
  // Entries first (they reference arenas), then arenas, then the disk tier.
  for (auto& s : impl_->shards) s->map.clear();
}

int CacheOptions::AutoPartitions(const CacheOptions& options, int io_threads, uint64_t min_slice) {
  const int shards = std::max(1, options.index_shards);
  // A GPU tier that Open will turn off (no usable GPU) does not count.
  const bool gpu_on =
      options.gpu_capacity > 0 && (options.gpu_tier_in_host_memory || ProbeCuda().usable);
  int best = 1;
  for (int p = 2; p <= std::min(io_threads, shards); ++p) {
    if (shards % p != 0) continue;
    bool fits = true;
    for (uint64_t capacity : {gpu_on ? options.gpu_capacity : 0, options.host_capacity}) {
      if (capacity > 0 && capacity / static_cast<uint64_t>(p) < min_slice) fits = false;
    }
    if (fits) best = p;
  }
  return best;
}

Result<std::unique_ptr<TieredCache>> TieredCache::Open(const CacheOptions& options) {
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  if (options.gpu_behind_host) {
    impl->fast_tier = Tier::kHost;
    impl->slow_tier = Tier::kGpu;
  }
  const int nshards = std::max(1, options.index_shards);
  for (int i = 0; i < nshards; ++i) impl->shards.push_back(std::make_unique<Shard>());
  // A divisor of the shard count: each partition then holds as many shards (as much of the
  // key space) as it has memory.
  if (options.placement_partitions < 1 || nshards % options.placement_partitions != 0) {
    return Status::InvalidArgument("placement partitions must divide the index shards (" +
                                   std::to_string(nshards) + "), not be " +
                                   std::to_string(options.placement_partitions));
  }
  for (int i = 0; i < options.placement_partitions; ++i) {
    auto part = std::make_unique<Impl::Partition>();
    part->impl = impl.get();
    part->index = static_cast<uint32_t>(i);
    impl->partitions.push_back(std::move(part));
  }

  // GPU tier.
  if (options.gpu_capacity > 0) {
    auto& t = impl->arenas[0];
    if (options.gpu_tier_in_host_memory) {
      GKV_ASSIGN_OR_RETURN(auto arena, MemoryArena::CreateHost(options.gpu_capacity,
                                                               MemoryArena::HostMode::kPageable));
      t.push_back(std::move(arena));
    } else if (!ProbeCuda().usable) {
      impl->gpu_note = ProbeCuda().reason;
      GKV_LOG_WARN("GPU tier off: {}", impl->gpu_note);
    } else {
      for (int dev : options.gpu_devices) {
        if (dev < 0 || dev >= ProbeCuda().device_count) {
          return Status::InvalidArgument("GPU device " + std::to_string(dev) + " does not exist");
        }
        GKV_ASSIGN_OR_RETURN(auto arena, MemoryArena::CreateDevice(dev, options.gpu_capacity));
        t.push_back(std::move(arena));
      }
      for (int dev : options.gpu_devices) {
        GKV_ASSIGN_OR_RETURN(impl->copiers[dev], DeviceCopier::Create(dev));
      }
      impl->device_copies = true;
      GKV_LOG_INFO("GPU tier on: {} on {} device(s){}", FormatSize(options.gpu_capacity),
                   options.gpu_devices.size(),
                   options.gpu_behind_host ? ", behind the host tier (takes what it spills)" : "");
    }
  }
  // Host tier.
  if (options.host_capacity > 0) {
    GKV_ASSIGN_OR_RETURN(auto arena,
                         MemoryArena::CreateHost(options.host_capacity, options.host_mode));
    if (arena->pinned()) {
      GKV_LOG_INFO("host tier: {} of pinned memory", FormatSize(options.host_capacity));
    } else {
      GKV_LOG_WARN(
          "host tier: {} of pageable memory, not pinned ({}): device copies and UCX "
          "stage through bounce buffers",
          FormatSize(options.host_capacity), arena->backing_note());
    }
    impl->arenas[1].push_back(std::move(arena));
    // A usable GPU without a GPU tier (or with one) still gets device copies for GetInto.
    if (!impl->device_copies && ProbeCuda().usable) {
      auto c = DeviceCopier::Create(0);
      if (c.ok()) {
        impl->copiers[0] = std::move(*c);
        impl->device_copies = true;
      }
    }
  }
  // Each partition gets one slice of every arena: equal slices of whole pages (what is left
  // past the last, under a page per partition, goes unused), so an object fits a tier in one
  // partition exactly when it fits in every other.
  const uint64_t nparts = impl->partitions.size();
  for (int t = 0; t < 2; ++t) {
    if (impl->arenas[t].empty()) continue;
    const uint64_t capacity = impl->arenas[t].front()->capacity();
    const uint64_t slice = nparts == 1 ? capacity : capacity / nparts / 4096 * 4096;
    if (slice == 0) {
      return Status::InvalidArgument(
          "a " + FormatSize(capacity) + " " + std::string(TierName(static_cast<Tier>(t))) +
          " tier cannot be split into " + std::to_string(nparts) + " placement partitions");
    }
    for (auto& part : impl->partitions) {
      TierState& ts = part->tiers[t];
      for (const auto& arena : impl->arenas[t]) {
        ts.arenas.push_back(MemoryArena::Slice(*arena, part->index * slice, slice));
      }
      ts.enabled = true;
      ts.capacity = slice;
    }
  }
  // Disk tier, with warm restart.
  if (!options.disk_path.empty()) {
    DiskTier::Options d;
    d.path = options.disk_path;
    d.capacity = options.disk_capacity;
    d.durable_share = options.disk_durable_share;
    d.crash_fs = options.disk_crash_fs;
    GKV_ASSIGN_OR_RETURN(impl->disk, DiskTier::Open(d));
    for (auto& part : impl->partitions) {
      part->tiers[2].enabled = true;
      part->tiers[2].capacity = options.disk_capacity;
    }
    uint64_t max_version = 0;
    uint64_t recovered = 0;
    GKV_RETURN_IF_ERROR(impl->disk->ForEach([&](std::string_view key, const StoredObjectMeta& m) {
      auto e = MakePooledShared<Entry>();
      e->key = std::string(key);
      e->size = m.size;
      e->version = m.version;
      e->durable = m.durable;
      e->tensor = m.tensor;
      e->tier = Tier::kDisk;
      e->on_disk = true;
      const size_t si = impl->ShardIndex(key);
      e->partition = impl->PartitionIndex(si);
      impl->PartOf(e.get()).LinkLru(e.get());
      impl->shards[si]->map.emplace(e->key, std::move(e));
      recovered++;
      max_version = std::max(max_version, m.version);
      return true;
    }));
    // Start above every version handed out before (the persisted mark), and persist the mark
    // of this run before the first put.
    GKV_ASSIGN_OR_RETURN(uint64_t mark, impl->disk->ReadVersionMark());
    const uint64_t start = std::max({mark, max_version + 1, WallClockVersion()});
    GKV_RETURN_IF_ERROR(impl->disk->WriteVersionMark(start + Impl::kVersionBlock)
                            .WithContext("persisting the version mark"));
    impl->next_version = start;
    impl->version_limit = start + Impl::kVersionBlock;
    if (recovered > 0) {
      GKV_LOG_INFO("disk tier at {}: {} objects, {} recovered", options.disk_path, recovered,
                   FormatSize(impl->disk->used_bytes()));
    }
  }
  if (!impl->Shape(Tier::kGpu).enabled && !impl->Shape(Tier::kHost).enabled &&
      !impl->Shape(Tier::kDisk).enabled) {
    return Status::InvalidArgument("no cache tier is enabled");
  }
  return std::unique_ptr<TieredCache>(new TieredCache(std::move(impl)));
}

Result<WriteHandle> TieredCache::Reserve(std::string_view key, uint64_t size,
                                         const TensorMeta& tensor) {
  return ReserveImpl(key, size, tensor, /*streamed=*/false, /*durable=*/false);
}

Result<WriteHandle> TieredCache::ReserveStreamed(std::string_view key, uint64_t size,
                                                 const TensorMeta& tensor, bool durable) {
  if (durable && !impl_->disk) return Status::NotSupported("durable put needs a disk tier");
  if (durable &&
      impl_->disk->durable_bytes() + size + key.size() > impl_->disk->durable_capacity()) {
    return Status::NoSpace("the disk tier's durable budget (" +
                           FormatSize(impl_->disk->durable_capacity()) + ") has no room for " +
                           FormatSize(size));
  }
  return ReserveImpl(key, size, tensor, /*streamed=*/true, durable);
}

Result<uint64_t> TieredCache::DiskChunkBytes() const {
  if (!impl_->disk) return uint64_t{0};
  return impl_->disk->ChunkBytes();
}

Status TieredCache::WriteAt(const WriteHandle& h, uint64_t offset, const void* src, uint64_t size,
                            MemoryKind src_kind) {
  if (h.cache_ != this || offset > h.size_ || size > h.size_ - offset) {
    return Status::InvalidArgument("write outside the reservation");
  }
  if (h.disk_stream_ == 0) {
    if (!h.data_) return Status::InvalidArgument("invalid write handle");
    return impl_->Copy(h.data_ + offset, h.kind_, src, src_kind, size);
  }
  if (src_kind != MemoryKind::kDevice) {
    return impl_->disk->WriteChunk(h.disk_stream_, offset, src, size);
  }
  std::string staged(size, '\0');
  GKV_RETURN_IF_ERROR(impl_->Copy(staged.data(), MemoryKind::kHost, src, src_kind, size));
  return impl_->disk->WriteChunk(h.disk_stream_, offset, staged.data(), size);
}

Result<WriteHandle> TieredCache::ReserveImpl(std::string_view key, uint64_t size,
                                             const TensorMeta& tensor, bool streamed,
                                             bool durable) {
  Impl& I = *impl_;
  if (key.empty()) return Status::InvalidArgument("empty key");
  if (key.size() > I.options.max_key_size) {
    return Status::InvalidArgument("key of " + std::to_string(key.size()) +
                                   " bytes exceeds the maximum of " +
                                   std::to_string(I.options.max_key_size));
  }
  GKV_RETURN_IF_ERROR(tensor.Validate(size));
  if (size > max_object_size()) {
    return Status::NoSpace("object of " + FormatSize(size) +
                           " is larger than every tier (largest " + FormatSize(max_object_size()) +
                           ")");
  }
  WriteHandle h;
  h.cache_ = this;
  h.key_ = std::string(key);
  h.shard_ = I.ShardIndex(key);
  h.tensor_ = tensor;
  h.size_ = size;
  {
    Impl::Partition& part = I.PartOfShard(h.shard_);
    std::unique_lock<std::mutex> lock(part.mu);
    for (Tier t : {I.fast_tier, I.slow_tier}) {
      MemoryArena* arena = nullptr;
      if (std::byte* p = part.AllocateIn(t, size, &arena, lock)) {
        h.tier_ = t;
        h.arena_ = arena;
        h.data_ = p;
        h.kind_ = arena->kind();
        break;
      }
    }
  }
  I.DrainEvictions();
  if (h.data_) return h;
  if (I.disk && size + key.size() <= I.disk->capacity()) {
    h.tier_ = Tier::kDisk;
    h.kind_ = MemoryKind::kHost;
    if (streamed) {
      std::vector<DiskEviction> evicted;
      auto stream = I.disk->BeginChunks(size, durable, &evicted);
      I.QueueDiskEvictions(evicted);
      if (!stream.ok()) return stream.status();
      h.disk_stream_ = *stream;
      return h;
    }
    // The staging buffer for a disk-bound value is as large as the value (bounded by the node's
    // maximum value size and in-flight limits, not by its memory): a machine that cannot give
    // it gets NoSpace for this put, never a bad_alloc that takes the node down.
    h.staging_.reset(new (std::nothrow) std::byte[size ? size : 1]);
    if (!h.staging_) {
      return Status::NoSpace("cannot allocate " + FormatSize(size) +
                             " of host memory to stage an object bound for the disk tier");
    }
    h.data_ = h.staging_.get();
    h.kind_ = MemoryKind::kHost;
    return h;
  }
  return Status::NoSpace("no tier has room for " + FormatSize(size) +
                         " (memory is held by entries that cannot move now: pinned, or being "
                         "replaced)");
}

Result<uint64_t> TieredCache::Commit(WriteHandle h, bool durable) {
  std::vector<WriteHandle> one;
  one.push_back(std::move(h));
  return std::move(CommitBatch(std::move(one), durable).front());
}

std::vector<Result<uint64_t>> TieredCache::CommitBatch(std::vector<WriteHandle> handles,
                                                       bool durable) {
  Impl& I = *impl_;
  const size_t n = handles.size();
  std::vector<Result<uint64_t>> results(n, Status::Internal("not committed"));
  std::vector<std::shared_ptr<void>> entries(n);
  // Everything that goes to disk now (durable puts, and reservations in the disk tier) goes in
  // one DiskTier::PutBatch: one WriteBatch, and for durable puts one fsync.
  std::vector<DiskWrite> writes;
  std::vector<size_t> write_of;  // writes[j] belongs to handles[write_of[j]]
  // The keys in write_of count as committing (Impl::EnterCommit) from before their disk write
  // until the batch is published, and leave on every way out of this function. A key is entered
  // just before it is recorded, into room reserved beforehand: each leave has its enter.
  struct LeaveCommits {
    Impl& impl;
    const std::vector<WriteHandle>& handles;
    std::vector<size_t>& entered;
    void Now() {
      for (size_t i : entered) impl.LeaveCommit(handles[i].key_);
      entered.clear();
    }
    ~LeaveCommits() { Now(); }
  } leave_commits{I, handles, write_of};
  std::vector<std::string> staging(n);
  for (size_t i = 0; i < n; ++i) {
    WriteHandle& h = handles[i];
    if (h.cache_ != this || (!h.data_ && h.disk_stream_ == 0)) {
      results[i] = Status::InvalidArgument("invalid write handle");
      continue;
    }
    if (durable && !I.disk) {
      results[i] = Status::NotSupported("durable put needs a disk tier");
      continue;
    }
    auto e = MakePooledShared<Entry>();
    e->key = h.key_;
    e->partition = I.PartitionIndex(h.shard_);
    e->size = h.size_;
    e->tensor = h.tensor_;
    if (h.handed_version_ != 0) {
      e->version = h.handed_version_;
      // A conditional install (read repair) that already cannot land writes nothing, not even
      // to disk: a disk write would replace the copy of the version the key does hold. (Publish
      // checks again: a write may land in between.)
      if (h.expect_current_ && I.VisibleVersion(h.key_) != h.expected_current_) {
        results[i] = e->version;  // not installed: CommitHandedOff reports it unchanged
        continue;
      }
      I.AdoptVersion(e->version);
    } else if (h.requested_version_ != 0) {
      std::shared_ptr<Entry> current = I.Lookup(h.key_);
      e->version = Impl::VersionForRequest(h.requested_version_, current ? current->version : 0);
      I.AdoptVersion(e->version);
    } else {
      e->version = I.NextVersion();
    }
    e->durable = durable;
    e->tier = h.tier_;
    if (durable || h.tier_ == Tier::kDisk) {
      const void* src = h.data_;
      if (h.kind_ == MemoryKind::kDevice) {
        staging[i].resize(h.size_);
        Status cs = I.Copy(staging[i].data(), MemoryKind::kHost, h.data_, h.kind_, h.size_);
        if (!cs.ok()) {
          results[i] = cs;
          continue;
        }
        src = staging[i].data();
      }
      DiskWrite w;
      w.key = e->key;
      w.meta = StoredObjectMeta{e->size, e->version, e->tensor, durable};
      w.meta.chunks = h.disk_stream_;
      w.data = src;
      if (writes.empty()) {  // room for every item at the first: recording one cannot fail
        writes.reserve(n);
        write_of.reserve(n);
      }
      writes.push_back(std::move(w));
      I.EnterCommit(h.key_);
      write_of.push_back(i);
    }
    entries[i] = std::move(e);
  }
  if (!writes.empty()) {
    std::vector<DiskEviction> evicted;
    Status bs = I.disk->PutBatch(&writes, durable, &evicted);
    I.QueueDiskEvictions(evicted);
    for (size_t j = 0; j < writes.size(); ++j) {
      const size_t i = write_of[j];
      Status ws = bs.ok() ? writes[j].status : bs;
      // Written chunks are the object's now; unwritten ones go (AbortChunks) right away, even
      // when the commit still publishes (lost to a newer version on disk), which consumes the
      // handle without releasing it.
      if (WriteHandle& h = handles[i]; h.disk_stream_ != 0) {
        if (!(ws.ok() && writes[j].written)) I.disk->AbortChunks(h.disk_stream_);
        h.disk_stream_ = 0;
      }
      if (!ws.ok()) {
        results[i] = ws;
        entries[i].reset();
        continue;
      }
      // Not written means a newer version is already on disk; this commit will be superseded.
      Entry* e = static_cast<Entry*>(entries[i].get());
      Impl::Partition& part = I.PartOf(e);
      std::lock_guard<std::mutex> lock(part.mu);
      e->on_disk = writes[j].written;
      if (durable) part.counters.durable_writes++;
    }
  }
  for (size_t i = 0; i < n; ++i) {
    if (!entries[i]) continue;
    if (I.options.test_before_publish) I.options.test_before_publish(handles[i].key_);
    results[i] = Publish(handles[i], std::move(entries[i]));
  }
  leave_commits.Now();
  I.DrainEvictions();
  return results;
}

uint64_t TieredCache::Publish(WriteHandle& h, std::shared_ptr<void> entry) {
  Impl& I = *impl_;
  auto e = std::static_pointer_cast<Entry>(std::move(entry));
  std::shared_ptr<Entry> old;
  bool superseded = false;
  bool newer_there = false;  // superseded by a newer version (not only by an expectation)
  bool replaces_disk_copy = false;
  Impl::Partition& part = I.PartOf(e.get());
  {
    Shard& s = *I.shards[h.shard_];
    std::lock_guard<std::mutex> shard_lock(s.mu);
    std::lock_guard<std::mutex> lock(part.mu);
    if (h.tier_ != Tier::kDisk) {
      e->arena = h.arena_;
      e->data = h.data_;
      h.arena_ = nullptr;  // ownership moves to the entry
      h.data_ = nullptr;
    }
    // A newer commit may have won the race: then this one is already overwritten.
    superseded =
        !part.Publish(s, e, &old, h.expect_current_ ? &h.expected_current_ : nullptr, &newer_there);
    // (A disk-tier reservation that was not written lost to a newer version already on disk,
    // which replaced the old copy there; it has no bytes in memory to write.)
    replaces_disk_copy = !superseded && old && (old->on_disk || old->writebacks > 0) &&
                         !e->on_disk && e->tier != Tier::kDisk && I.disk;
    // Pinned and marked so that the write-through below can read its bytes and a later commit
    // sees the copy coming.
    if (replaces_disk_copy) {
      Impl::Pin(e.get());
      e->writebacks++;
    }
  }
  h.cache_ = nullptr;
  // Past this point the new version is published: nothing below may fail the put (it committed);
  // what goes wrong is logged and its cleanup queued.
  if (replaces_disk_copy) part.ReplaceDiskCopy(e.get(), old.get());
  // A copy refused only for the expectation (a write landed between CommitBatch's check and
  // now) stays on disk: it replaced the disk copy of a version no newer than itself, and
  // deleting it would leave the key with no disk copy at all.
  if (superseded && e->on_disk && newer_there) {
    // Synced, so that a crash cannot bring this copy back over the newer version.
    Status ds = I.disk->DeleteIfVersion(e->key, e->version, /*sync=*/true);
    if (!ds.ok()) {
      GKV_LOG_WARN("deleting a superseded disk copy of '{}': {}", e->key, ds.ToString());
      I.AddPending({PendingOp::kDeleteStaleDiskCopy, e->key, e->version});
    }
  }
  return e->version;
}

TieredCache::FastPath TieredCache::TryReserveInMemory(std::string_view key, uint64_t size,
                                                      const TensorMeta& tensor, WriteHandle* out) {
  Impl& I = *impl_;
  if (key.empty() || key.size() > I.options.max_key_size || !tensor.Validate(size).ok()) {
    return FastPath::kNeedsSlowPath;  // the slow path reports the error
  }
  // Released before the partition lock is taken: releasing a reservation takes that lock.
  *out = WriteHandle();
  const size_t si = I.ShardIndex(key);
  Impl::Partition& part = I.PartOfShard(si);
  std::lock_guard<std::mutex> lock(part.mu);
  for (Tier t : {I.fast_tier, I.slow_tier}) {
    const TierState& ts = part.tiers[static_cast<int>(t)];
    if (!ts.enabled || size > ts.capacity) continue;
    MemoryArena* arena = nullptr;
    std::byte* p = part.TryAllocate(t, size, &arena);
    if (!p) return FastPath::kNeedsSlowPath;  // would have to evict
    out->cache_ = this;
    out->key_ = std::string(key);
    out->shard_ = si;
    out->tensor_ = tensor;
    out->size_ = size;
    out->tier_ = t;
    out->arena_ = arena;
    out->data_ = p;
    out->kind_ = arena->kind();
    return FastPath::kServed;
  }
  return FastPath::kNeedsSlowPath;
}

TieredCache::FastPath TieredCache::TryCommitInMemory(WriteHandle* h, uint64_t* version) {
  Impl& I = *impl_;
  if (h->cache_ != this || !h->data_ || h->tier_ == Tier::kDisk) return FastPath::kNeedsSlowPath;
  // Near the end of the persisted version block: extending it is disk I/O.
  if (std::max(I.next_version.load(), WallClockVersion()) + Impl::kVersionMargin >=
      I.version_limit.load()) {
    return FastPath::kNeedsSlowPath;
  }
  Shard& s = *I.shards[h->shard_];
  const uint32_t pi = I.PartitionIndex(h->shard_);
  Impl::Partition& part = *I.partitions[pi];
  std::shared_ptr<Entry> old;
  {
    std::lock_guard<std::mutex> shard_lock(s.mu);
    std::lock_guard<std::mutex> lock(part.mu);
    auto it = s.map.find(h->key_);
    // An older copy on disk (or on its way there) must be replaced on disk: not for this path.
    if (it != s.map.end() && (it->second->on_disk || it->second->writebacks > 0)) {
      return FastPath::kNeedsSlowPath;
    }
    auto e = MakePooledShared<Entry>();
    e->key = h->key_;
    e->partition = pi;
    e->size = h->size_;
    e->tensor = h->tensor_;
    if (h->requested_version_ != 0) {
      const uint64_t v = Impl::VersionForRequest(h->requested_version_,
                                                 it != s.map.end() ? it->second->version : 0);
      // Adopting a version near the persisted mark's end means disk I/O: not for this path.
      if (v + Impl::kVersionMargin >= I.version_limit.load()) return FastPath::kNeedsSlowPath;
      e->version = v;
      I.ObserveVersion(v);
    } else {
      e->version = I.TakeVersion();  // below version_limit (checked above)
    }
    e->tier = h->tier_;
    e->arena = h->arena_;
    e->data = h->data_;
    h->arena_ = nullptr;
    h->data_ = nullptr;
    h->cache_ = nullptr;
    // The version was taken under the shard lock, so nothing newer can be in the map.
    part.Publish(s, e, &old);
    *version = e->version;
  }
  return FastPath::kServed;
}

Result<uint64_t> TieredCache::Put(std::string_view key, const void* data, uint64_t size,
                                  const TensorMeta& tensor, bool durable, MemoryKind src_kind) {
  GKV_ASSIGN_OR_RETURN(WriteHandle h, Reserve(key, size, tensor));
  GKV_RETURN_IF_ERROR(CopyBytes(h.data(), h.memory_kind(), data, src_kind, size));
  return Commit(std::move(h), durable);
}

Result<ReadHandle> TieredCache::Acquire(std::string_view key, ReadKind how) {
  Impl& I = *impl_;
  const bool counted = how == ReadKind::kRead;
  // From memory without the placement lock where it can (it counts nothing when it leaves the
  // read to the code below); under that lock for disk, promotion and entries being moved.
  {
    ReadHandle fast;
    switch (TryAcquireFromMemory(key, &fast, /*device_ok=*/true, how)) {
      case FastPath::kServed:
        return fast;
      case FastPath::kMiss:
        return Status::NotFound("key not found");
      case FastPath::kNeedsSlowPath:
        break;
    }
  }
  std::string retry_reason;
  for (int attempt = 0; attempt < 8; ++attempt) {
    Shard& shard = I.ShardFor(key);
    std::shared_ptr<Entry> sp = I.Lookup(key);
    if (!sp) {
      shard.misses.fetch_add(1, std::memory_order_relaxed);
      return Status::NotFound("key not found");
    }
    Entry* e = sp.get();
    Impl::Partition& part = I.PartOf(e);
    std::unique_lock<std::mutex> lock(part.mu);
    if (!e->live) {
      // Replaced or deleted meanwhile (look again), or dropped: a dropped entry stays in the
      // index until its queued removal runs, and a read of it is a miss, not a retry.
      lock.unlock();
      if (I.Lookup(key) == sp) {
        shard.misses.fetch_add(1, std::memory_order_relaxed);
        return Status::NotFound("key not found");
      }
      retry_reason = "replaced";
      continue;
    }
    const auto now = Clock::now();
    const bool promote =
        counted && I.Admit(e, now) && I.Rank(I.TopMemoryTierFor(e->size)) < I.Rank(e->tier);

    if (e->tier != Tier::kDisk) {
      if (promote && I.PinCount(e) > 0) {
        // Being read elsewhere: not now (see below).
        e->reads_in_tier.store(0, std::memory_order_relaxed);
      } else if (promote) {
        // Slow memory tier -> fast one. The entry is pinned while its new home is prepared.
        Impl::Pin(e);
        MemoryArena* arena = nullptr;
        std::byte* dst = part.AllocateIn(I.fast_tier, e->size, &arena, lock);
        if (dst) {
          std::byte* src = e->data;
          MemoryKind sk = e->arena->kind();
          lock.unlock();
          Status s = I.Copy(dst, arena->kind(), src, sk, e->size);
          lock.lock();
          // Frozen: no reader pinned it meanwhile (one would hold the old block).
          if (s.ok() && e->live && e->tier == I.slow_tier && Impl::Freeze(e, 1)) {
            Impl::Frozen frozen{e};
            part.Relocate(e, I.fast_tier, arena, dst);
          } else {
            arena->Free(dst);
            // Read by others meanwhile: start the admission count again, so that the next
            // reads are served where the entry is (fast path) instead of each trying again.
            if (s.ok() && e->live) e->reads_in_tier.store(0, std::memory_order_relaxed);
          }
        }
        part.Unpin(e);
        if (!e->live) {
          retry_reason = "replaced during promotion";
          continue;
        }
      }
      ReadHandle h;
      Impl::Pin(e);
      if (counted) shard.hits[static_cast<int>(e->tier)].fetch_add(1, std::memory_order_relaxed);
      FillReadHandle(std::move(sp), &h);
      lock.unlock();
      I.DrainEvictions();
      return h;
    }

    // Disk tier: read without any lock held. A continued read does not read a whole value
    // from disk for one piece of it: its caller reads the value again as a whole.
    if (!counted) return Status::Aborted("the value is on disk: read it whole");
    shard.hits[2].fetch_add(1, std::memory_order_relaxed);
    const uint64_t version = e->version;
    lock.unlock();
    ReadHandle h;
    StoredObjectMeta meta;
    Status s = I.disk->Get(key, &meta, &h.owned_);
    // A newer version on disk belongs to a put that is committing right now (it writes through
    // before it publishes): serving it is correct, since that put overlaps this read.
    if (s.IsNotFound() || (s.ok() && meta.version < version)) {
      // The disk tier dropped it: look again from the index.
      retry_reason = s.ok() ? "disk holds version " + std::to_string(meta.version) + ", index " +
                                  std::to_string(version)
                            : "dropped from disk";
      if (s.IsNotFound()) {
        Shard& sh = I.ShardFor(key);
        std::lock_guard<std::mutex> sl(sh.mu);
        auto it = sh.map.find(key);
        if (it != sh.map.end() && it->second.get() == e) {
          std::lock_guard<std::mutex> l2(part.mu);
          if (e->tier == Tier::kDisk) {
            part.Kill(e);
            sh.map.erase(it);
          }
        }
      }
      continue;
    }
    GKV_RETURN_IF_ERROR(s);
    h.data_ = reinterpret_cast<const std::byte*>(h.owned_.data());
    h.kind_ = MemoryKind::kHost;
    h.info_ = ObjectInfo{meta.size, meta.version, meta.tensor, Tier::kDisk, true, meta.durable};

    if (promote && meta.version == version) {
      lock.lock();
      const Tier target = I.TopMemoryTierFor(e->size);
      MemoryArena* arena = nullptr;
      std::byte* dst = nullptr;
      if (e->live && e->tier == Tier::kDisk && e->version == version) {
        Impl::Pin(e);
        dst = part.AllocateIn(target, e->size, &arena, lock);
        part.Unpin(e);
      }
      if (dst) {
        lock.unlock();
        Status cs = I.Copy(dst, arena->kind(), h.owned_.data(), MemoryKind::kHost, e->size);
        lock.lock();
        // Frozen: a fast-path reader may be looking at the entry (it leaves a disk entry alone).
        if (cs.ok() && e->live && e->tier == Tier::kDisk && e->version == version &&
            Impl::Freeze(e, 0)) {
          Impl::Frozen frozen{e};
          part.Relocate(e, target, arena, dst);  // the disk copy stays as a clean copy
        } else {
          arena->Free(dst);
        }
      }
      lock.unlock();
      I.DrainEvictions();
    }
    return h;
  }
  return Status::Aborted("key kept changing during the read (" + retry_reason + "); try again");
}

void TieredCache::FillReadHandle(std::shared_ptr<void> entry, ReadHandle* out) {
  Entry* e = static_cast<Entry*>(entry.get());
  Impl::MarkReferenced(e);
  out->cache_ = this;
  out->data_ = e->data;
  out->kind_ = e->arena->kind();
  out->info_ = ObjectInfo{e->size, e->version, e->tensor, e->tier, e->on_disk, e->durable};
  out->entry_ = std::move(entry);
}

TieredCache::FastPath TieredCache::TryAcquireFromMemory(std::string_view key, ReadHandle* out,
                                                        bool device_ok, ReadKind how) {
  Impl& I = *impl_;
  const bool counted = how == ReadKind::kRead;
  *out = ReadHandle();
  // No placement lock: the pin is taken under the shard lock (the entry cannot be replaced
  // meanwhile) and placement never moves a pinned entry (the pin protocol in Impl).
  Shard& s = I.ShardFor(key);
  std::shared_ptr<Entry> sp;
  {
    std::lock_guard<std::mutex> shard_lock(s.mu);
    auto it = s.map.find(key);
    if (it == s.map.end()) {
      s.misses.fetch_add(1, std::memory_order_relaxed);
      return FastPath::kMiss;
    }
    if (!Impl::TryPin(it->second.get())) return FastPath::kNeedsSlowPath;  // being moved
    sp = it->second;
  }
  Entry* e = sp.get();
  const auto now = Clock::now();
  // Not counted here when the slow path will serve it: a second Admit there would count one
  // read twice (and promote on the first read).
  if (!e->live || e->tier == Tier::kDisk || (counted && I.WouldPromote(e, now)) ||
      (!device_ok && e->arena->kind() == MemoryKind::kDevice)) {
    I.ReleaseReadPin(e);
    return FastPath::kNeedsSlowPath;
  }
  if (counted) {
    I.Admit(e, now);
    s.hits[static_cast<int>(e->tier)].fetch_add(1, std::memory_order_relaxed);
  }
  FillReadHandle(std::move(sp), out);
  return FastPath::kServed;
}

Result<ObjectInfo> TieredCache::GetInto(std::string_view key, void* dst, uint64_t dst_size,
                                        MemoryKind dst_kind) {
  GKV_ASSIGN_OR_RETURN(ReadHandle h, Acquire(key));
  if (dst_size < h.size()) {
    return Status::InvalidArgument("buffer of " + std::to_string(dst_size) +
                                   " bytes is smaller than the object (" +
                                   std::to_string(h.size()) + " bytes)");
  }
  GKV_RETURN_IF_ERROR(CopyBytes(dst, dst_kind, h.data(), h.memory_kind(), h.size()));
  return h.info();
}

Result<ObjectInfo> TieredCache::Get(std::string_view key, std::string* out) {
  GKV_ASSIGN_OR_RETURN(ReadHandle h, Acquire(key));
  out->resize(h.size());
  GKV_RETURN_IF_ERROR(
      CopyBytes(out->data(), MemoryKind::kHost, h.data(), h.memory_kind(), h.size()));
  return h.info();
}

Result<ObjectInfo> TieredCache::Stat(std::string_view key) {
  Impl& I = *impl_;
  std::shared_ptr<Entry> sp = I.Lookup(key);
  if (!sp) return Status::NotFound("key not found");
  std::lock_guard<std::mutex> lock(I.PartOf(sp.get()).mu);
  if (!sp->live) return Status::NotFound("key not found");
  return ObjectInfo{sp->size, sp->version, sp->tensor, sp->tier, sp->on_disk, sp->durable};
}

Status TieredCache::Delete(std::string_view key) { return DeleteVersion(key, 0); }

Result<bool> TieredCache::CommitHandedOff(WriteHandle handle, bool durable, uint64_t version) {
  if (version == 0) return Status::InvalidArgument("a handed-off object needs its version");
  handle.handed_version_ = version;
  const std::string key = handle.key_;
  GKV_ASSIGN_OR_RETURN(uint64_t v, Commit(std::move(handle), durable));
  (void)v;
  // Superseded (a newer version was there or landed meanwhile) is not an error: the key then
  // holds something at least as new as what was handed off.
  auto info = Stat(key);
  return info.ok() && info->version == version;
}

Result<bool> TieredCache::CommitHandedOffIf(WriteHandle handle, bool durable, uint64_t version,
                                            uint64_t expected_current) {
  handle.expect_current_ = true;
  handle.expected_current_ = expected_current;
  return CommitHandedOff(std::move(handle), durable, version);
}

uint64_t TieredCache::VersionClock() const {
  return std::max(impl_->next_version.load(), WallClockVersion());
}

std::vector<KeyListing> TieredCache::ListKeys() const {
  Impl& I = *impl_;
  std::vector<KeyListing> out;
  for (size_t si = 0; si < I.shards.size(); ++si) {
    Shard& s = *I.shards[si];
    std::lock_guard<std::mutex> shard_lock(s.mu);
    std::lock_guard<std::mutex> lock(I.partitions[I.PartitionIndex(si)]->mu);
    for (auto& [k, e] : s.map) {
      if (e->live) out.push_back(KeyListing{k, e->version, e->size, e->durable, e->tier});
    }
  }
  return out;
}

Status TieredCache::DeleteVersion(std::string_view key, uint64_t version) {
  Impl& I = *impl_;
  std::shared_ptr<Entry> victim;
  {
    Shard& s = I.ShardFor(key);
    std::lock_guard<std::mutex> shard_lock(s.mu);
    auto it = s.map.find(key);
    if (it == s.map.end()) return Status::NotFound("key not found");
    if (version != 0 && it->second->version != version) {
      return Status::Aborted("the key has another version now");
    }
    victim = it->second;
    s.map.erase(it);
    Impl::Partition& part = I.PartOf(victim.get());
    std::lock_guard<std::mutex> lock(part.mu);
    part.Kill(victim.get());
    part.counters.deletes++;
  }
  if (I.disk) {
    // A copy on its way to disk is waited for, then the delete is synced: once Delete returns,
    // no crash brings the value back.
    Impl::Partition& part = I.PartOf(victim.get());
    std::unique_lock<std::mutex> lock(part.mu);
    part.WaitForWritebacks(victim.get(), lock);
    const bool on_disk = victim->on_disk;
    lock.unlock();
    if (on_disk) {
      GKV_RETURN_IF_ERROR(I.disk->DeleteIfVersion(key, victim->version, /*sync=*/true));
    }
  }
  I.DrainEvictions();
  return Status::OK();
}

Status TieredCache::CopyBytes(void* dst, MemoryKind dst_kind, const void* src, MemoryKind src_kind,
                              uint64_t size) {
  return impl_->Copy(dst, dst_kind, src, src_kind, size);
}

Status TieredCache::Flush() {
  Impl& I = *impl_;
  if (!I.disk) return Status::OK();
  std::vector<std::shared_ptr<Entry>> dirty;
  for (size_t si = 0; si < I.shards.size(); ++si) {
    Shard& s = *I.shards[si];
    std::lock_guard<std::mutex> shard_lock(s.mu);
    std::lock_guard<std::mutex> lock(I.partitions[I.PartitionIndex(si)]->mu);
    for (auto& [k, e] : s.map) {
      if (e->live && !e->on_disk && e->tier != Tier::kDisk) {
        Impl::Pin(e.get());
        e->writebacks++;
        dirty.push_back(e);
      }
    }
  }
  Status first_error;
  std::string staging;
  for (auto& e : dirty) {
    const void* src = e->data;
    Status s;
    if (e->arena->kind() == MemoryKind::kDevice) {
      staging.resize(e->size);
      s = I.Copy(staging.data(), MemoryKind::kHost, e->data, MemoryKind::kDevice, e->size);
      src = staging.data();
    }
    std::vector<DiskEviction> evicted;
    bool written = false;
    if (s.ok()) {
      s = I.disk->Put(e->key, {e->size, e->version, e->tensor}, src, false, &evicted, &written);
    }
    Impl::Partition& part = I.PartOf(e.get());
    std::lock_guard<std::mutex> lock(part.mu);
    if (s.ok() && written) {
      e->on_disk = true;
      if (!e->live) I.AddPending({PendingOp::kDeleteStaleDiskCopy, e->key, e->version});
    } else if (first_error.ok()) {
      first_error = s;
    }
    I.QueueDiskEvictions(evicted);
    part.EndWriteback(e.get());
    part.Unpin(e.get());
  }
  I.DrainEvictions();
  GKV_RETURN_IF_ERROR(first_error);
  return I.disk->Flush();
}

CacheStats TieredCache::GetStats() const {
  const Impl& I = *impl_;
  CacheStats st;
  // One partition at a time: the figures of different partitions are not one snapshot.
  for (const auto& part : I.partitions) {
    std::lock_guard<std::mutex> lock(part->mu);
    const CacheStats& c = part->counters;
    st.puts += c.puts;
    st.deletes += c.deletes;
    st.disk_evictions += c.disk_evictions;
    st.dropped += c.dropped;
    st.durable_writes += c.durable_writes;
    for (int a = 0; a < kTierCount; ++a) {
      for (int b = 0; b < kTierCount; ++b) {
        st.moves[a][b] += c.moves[a][b];
        st.moved_bytes[a][b] += c.moved_bytes[a][b];
      }
    }
    for (int t = 0; t < kTierCount; ++t) {
      const TierState& ts = part->tiers[t];
      TierStats& o = st.tiers[t];
      o.objects += ts.objects;
      if (t < 2) {
        for (const auto& a : ts.arenas) {
          o.capacity += a->capacity();
          o.used_bytes += a->used();
          o.largest_free_block =
              std::max(o.largest_free_block, a->allocator().largest_free_block());
        }
      }
    }
  }
  for (const auto& s : I.shards) {
    st.misses += s->misses.load(std::memory_order_relaxed);
    for (int t = 0; t < kTierCount; ++t) {
      st.tiers[t].hits += s->hits[t].load(std::memory_order_relaxed);
    }
  }
  for (int t = 0; t < kTierCount; ++t) st.tiers[t].enabled = I.Shape(static_cast<Tier>(t)).enabled;
  st.placement_partitions = I.partitions.size();
  if (I.disk) {
    st.tiers[2].capacity = I.disk->capacity();
    st.tiers[2].used_bytes = I.disk->used_bytes();
  }
  return st;
}

bool TieredCache::tier_enabled(Tier t) const { return impl_->Shape(t).enabled; }

uint64_t TieredCache::tier_capacity(Tier t) const {
  const int i = static_cast<int>(t);
  if (t == Tier::kDisk) return impl_->Shape(t).capacity;
  return impl_->arenas[i].empty() ? 0 : impl_->arenas[i].front()->capacity();
}

uint64_t TieredCache::max_object_size() const {
  uint64_t m = 0;
  for (int t = 0; t < 2; ++t) {
    const TierState& shape = impl_->Shape(static_cast<Tier>(t));
    if (shape.enabled) m = std::max(m, shape.capacity);
  }
  if (impl_->disk)
    m = std::max(m, impl_->disk->capacity() -
                        std::min<uint64_t>(impl_->disk->capacity(), impl_->options.max_key_size));
  return m;
}

int TieredCache::placement_partitions() const { return static_cast<int>(impl_->partitions.size()); }

const std::string& TieredCache::gpu_tier_note() const { return impl_->gpu_note; }

bool TieredCache::host_pinned() const {
  const auto& arenas = impl_->arenas[1];
  return !arenas.empty() && arenas.front()->pinned();
}

std::string TieredCache::host_tier_note() const {
  const auto& arenas = impl_->arenas[1];
  return arenas.empty() ? std::string() : arenas.front()->backing_note();
}

std::vector<MemoryRegion> TieredCache::memory_regions() const {
  std::vector<MemoryRegion> regions;
  for (Tier tier : {Tier::kGpu, Tier::kHost}) {
    for (const auto& arena : impl_->arenas[static_cast<int>(tier)]) {
      regions.push_back({arena->base(), arena->capacity(), arena->kind(), arena->device(), tier});
    }
  }
  return regions;
}

}  // namespace gkv
