// Tier logic of the node cache. The GPU tier is backed by host memory here
// (gpu_tier_in_host_memory), so every path runs without a GPU; tests labelled gpu cover the
// real device arena.
#include <gtest/gtest.h>

#include <cstring>
#include <fstream>

#include <atomic>
#include <future>
#include <map>
#include <mutex>
#include <thread>

#include "gkv/cache/tiered_cache.h"
#include "gkv/hash.h"
#include "gkv/hybrid_clock.h"
#include "gkv/random.h"
#include "gkv/storage/disk_tier.h"
#include "test_util.h"

namespace gkv {
namespace {

constexpr uint64_t kKiB = 1024;

CacheOptions SmallOptions(const std::string& disk, uint64_t gpu, uint64_t host, uint64_t dsk) {
  CacheOptions o;
  o.gpu_capacity = gpu;
  o.gpu_tier_in_host_memory = true;
  o.host_capacity = host;
  o.host_mode = MemoryArena::HostMode::kPageable;
  o.disk_path = disk;
  o.disk_capacity = dsk;
  o.promotion_window = std::chrono::milliseconds(60'000);
  return o;
}

std::unique_ptr<TieredCache> MustOpen(const CacheOptions& o) {
  auto r = TieredCache::Open(o);
  EXPECT_TRUE(r.ok()) << r.status().ToString();
  return r.ok() ? std::move(*r) : nullptr;
}

Tier TierOf(TieredCache& c, const std::string& key) {
  auto st = c.Stat(key);
  EXPECT_TRUE(st.ok()) << key << ": " << st.status().ToString();
  return st.ok() ? st->tier : Tier::kDisk;
}

std::string ValueFor(Random& rng, size_t size) {
  std::string v(size, '\0');
  rng.Fill(v.data(), size);
  return v;
}

TEST(TieredCacheTest, PutLandsInHighestTierWithRoom) {
  testing::TempDir dir;
  auto c = MustOpen(SmallOptions(dir.path(), 64 * kKiB, 256 * kKiB, 4 << 20));
  ASSERT_TRUE(c);
  std::string v(1000, 'a');
  ASSERT_TRUE(c->Put("small", v.data(), v.size()).ok());
  EXPECT_EQ(TierOf(*c, "small"), Tier::kGpu);
  // Bigger than the GPU tier, fits the host tier.
  std::string big(100 * kKiB, 'b');
  ASSERT_TRUE(c->Put("big", big.data(), big.size()).ok());
  EXPECT_EQ(TierOf(*c, "big"), Tier::kHost);
  // Bigger than both memory tiers: straight to disk.
  std::string huge(1 << 20, 'c');
  ASSERT_TRUE(c->Put("huge", huge.data(), huge.size()).ok());
  EXPECT_EQ(TierOf(*c, "huge"), Tier::kDisk);
  std::string out;
  ASSERT_TRUE(c->Get("huge", &out).ok());
  EXPECT_EQ(out, huge);
}

// gpu_behind_host (a node whose UCX cannot move device memory): host memory first, the GPU
// tier takes what it spills, reads promote back to host memory.
TEST(TieredCacheTest, AGpuTierBehindHostTakesWhatHostSpills) {
  testing::TempDir dir;
  auto o = SmallOptions(dir.path(), 64 * kKiB, 64 * kKiB, 4 << 20);
  o.gpu_behind_host = true;
  auto c = MustOpen(o);
  ASSERT_TRUE(c);
  std::string v(16 * kKiB, 'a');
  for (int i = 0; i < 6; ++i) {
    ASSERT_TRUE(c->Put("k" + std::to_string(i), v.data(), v.size()).ok());
  }
  EXPECT_EQ(TierOf(*c, "k5"), Tier::kHost);
  EXPECT_EQ(TierOf(*c, "k0"), Tier::kGpu);  // spilled host -> GPU, not to disk
  std::string out;
  ASSERT_TRUE(c->Get("k0", &out).ok());
  ASSERT_TRUE(c->Get("k0", &out).ok());  // a second read within the window promotes
  EXPECT_EQ(TierOf(*c, "k0"), Tier::kHost);
  EXPECT_EQ(out, v);
}

TEST(TieredCacheTest, EvictionOrderIsLeastRecentlyUsed) {
  testing::TempDir dir;
  // Four 16 KiB objects fill the GPU tier exactly.
  auto c = MustOpen(SmallOptions(dir.path(), 64 * kKiB, 1 << 20, 8 << 20));
  ASSERT_TRUE(c);
  std::string v(16 * kKiB, 'x');
  for (int i = 0; i < 4; ++i) ASSERT_TRUE(c->Put("k" + std::to_string(i), v.data(), v.size()).ok());
  std::string out;
  ASSERT_TRUE(c->Get("k0", &out).ok());  // k0 is now the most recent; k1 the least
  ASSERT_TRUE(c->Put("k4", v.data(), v.size()).ok());
  EXPECT_EQ(TierOf(*c, "k1"), Tier::kHost);
  for (const char* k : {"k0", "k2", "k3", "k4"}) EXPECT_EQ(TierOf(*c, k), Tier::kGpu) << k;
  ASSERT_TRUE(c->Put("k5", v.data(), v.size()).ok());
  EXPECT_EQ(TierOf(*c, "k2"), Tier::kHost);
  auto st = c->GetStats();
  EXPECT_EQ(st.moves[0][1], 2u);
}

TEST(TieredCacheTest, HostTierSpillsToDisk) {
  testing::TempDir dir;
  auto c = MustOpen(SmallOptions(dir.path(), 0, 64 * kKiB, 8 << 20));
  ASSERT_TRUE(c);
  std::string v(16 * kKiB, 'x');
  for (int i = 0; i < 6; ++i) ASSERT_TRUE(c->Put("k" + std::to_string(i), v.data(), v.size()).ok());
  EXPECT_EQ(TierOf(*c, "k0"), Tier::kDisk);
  EXPECT_EQ(TierOf(*c, "k1"), Tier::kDisk);
  EXPECT_EQ(TierOf(*c, "k5"), Tier::kHost);
  EXPECT_EQ(c->GetStats().moves[1][2], 2u);
}

TEST(TieredCacheTest, SpillAndPromotionKeepBytesIdentical) {
  testing::TempDir dir;
  auto c = MustOpen(SmallOptions(dir.path(), 256 * kKiB, 512 * kKiB, 64 << 20));
  ASSERT_TRUE(c);
  Random rng(testing::TestSeed());
  std::map<std::string, std::string> expect;
  for (int i = 0; i < 120; ++i) {
    std::string key = "obj/" + std::to_string(i);
    expect[key] = ValueFor(rng, rng.Uniform(0, 40 * kKiB));
    ASSERT_TRUE(c->Put(key, expect[key].data(), expect[key].size()).ok());
  }
  auto st = c->GetStats();
  ASSERT_GT(st.moves[0][1], 0u);
  ASSERT_GT(st.moves[1][2], 0u);
  // Read everything twice: the second read of a lower-tier object promotes it, which evicts
  // others; every byte must survive every move.
  for (int round = 0; round < 3; ++round) {
    for (auto& [key, value] : expect) {
      std::string out;
      auto info = c->Get(key, &out);
      ASSERT_TRUE(info.ok()) << key << ": " << info.status().ToString();
      ASSERT_EQ(out.size(), value.size()) << key;
      ASSERT_EQ(HashBytes(out.data(), out.size(), 1), HashBytes(value.data(), value.size(), 1))
          << key << " round " << round;
      ASSERT_EQ(out, value) << key;
    }
  }
  st = c->GetStats();
  EXPECT_GT(st.moves[2][0] + st.moves[2][1], 0u) << "disk objects were never promoted";
}

TEST(TieredCacheTest, PromotionNeedsASecondReadWithinTheWindow) {
  testing::TempDir dir;
  auto o = SmallOptions(dir.path(), 0, 64 * kKiB, 8 << 20);
  auto c = MustOpen(o);
  ASSERT_TRUE(c);
  std::string v(16 * kKiB, 'p');
  for (int i = 0; i < 5; ++i) ASSERT_TRUE(c->Put("k" + std::to_string(i), v.data(), v.size()).ok());
  ASSERT_EQ(TierOf(*c, "k0"), Tier::kDisk);
  std::string out;
  ASSERT_TRUE(c->Get("k0", &out).ok());
  EXPECT_EQ(TierOf(*c, "k0"), Tier::kDisk) << "one read must not promote (scan resistance)";
  auto info = c->Get("k0", &out);
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->tier, Tier::kDisk);  // served from disk, then moved up
  EXPECT_EQ(TierOf(*c, "k0"), Tier::kHost);
  EXPECT_EQ(out, v);

  // With a zero window the second read comes too late.
  testing::TempDir dir2;
  o = SmallOptions(dir2.path(), 0, 64 * kKiB, 8 << 20);
  o.promotion_window = std::chrono::milliseconds(0);
  auto c2 = MustOpen(o);
  ASSERT_TRUE(c2);
  for (int i = 0; i < 5; ++i)
    ASSERT_TRUE(c2->Put("k" + std::to_string(i), v.data(), v.size()).ok());
  std::this_thread::sleep_for(std::chrono::milliseconds(2));
  ASSERT_TRUE(c2->Get("k0", &out).ok());
  std::this_thread::sleep_for(std::chrono::milliseconds(2));
  ASSERT_TRUE(c2->Get("k0", &out).ok());
  EXPECT_EQ(TierOf(*c2, "k0"), Tier::kDisk);
}

// The later pieces of a read already counted (a ranged GET's ranges after the first) do not
// count as reads: a value read once in many pieces is not promoted, nor counted as hits, and a
// real second read still promotes it.
TEST(TieredCacheTest, ContinuedReadsNeitherCountNorPromote) {
  testing::TempDir dir;
  auto c = MustOpen(SmallOptions(dir.path(), 64 * kKiB, 256 * kKiB, 8 << 20));
  ASSERT_TRUE(c);
  std::string v(16 * kKiB, 'c');
  for (int i = 0; i < 6; ++i) ASSERT_TRUE(c->Put("k" + std::to_string(i), v.data(), v.size()).ok());
  ASSERT_EQ(TierOf(*c, "k0"), Tier::kHost);  // spilled from the 64 KiB GPU tier
  const uint64_t hits_before = c->GetStats().tiers[static_cast<int>(Tier::kHost)].hits;
  {
    auto first = c->Acquire("k0");
    ASSERT_TRUE(first.ok());
  }
  for (int piece = 0; piece < 5; ++piece) {
    ReadHandle h;
    EXPECT_EQ(c->TryAcquireFromMemory("k0", &h, true, TieredCache::ReadKind::kContinued),
              TieredCache::FastPath::kServed);
    auto slow = c->Acquire("k0", TieredCache::ReadKind::kContinued);
    ASSERT_TRUE(slow.ok());
    EXPECT_EQ(slow->info().tier, Tier::kHost);
  }
  EXPECT_EQ(TierOf(*c, "k0"), Tier::kHost) << "one read in pieces must not promote";
  EXPECT_EQ(c->GetStats().tiers[static_cast<int>(Tier::kHost)].hits, hits_before + 1);
  ASSERT_TRUE(c->Acquire("k0").ok());  // a second read within the window
  EXPECT_EQ(TierOf(*c, "k0"), Tier::kGpu);
  // A value on disk is not read for a piece of it.
  std::string big(128 * kKiB, 'd');  // four overflow both memory tiers: the first goes to disk
  for (int i = 0; i < 4; ++i) {
    ASSERT_TRUE(c->Put("big" + std::to_string(i), big.data(), big.size()).ok());
  }
  ASSERT_EQ(TierOf(*c, "big0"), Tier::kDisk);
  EXPECT_EQ(c->Acquire("big0", TieredCache::ReadKind::kContinued).status().code(),
            StatusCode::kAborted);
  EXPECT_TRUE(c->Acquire("big0").ok());
}

TEST(TieredCacheTest, ScanDoesNotFlushTheHotSet) {
  testing::TempDir dir;
  auto c = MustOpen(SmallOptions(dir.path(), 0, 64 * kKiB, 16 << 20));
  ASSERT_TRUE(c);
  std::string v(16 * kKiB, 's');
  for (int i = 0; i < 40; ++i)
    ASSERT_TRUE(c->Put("cold" + std::to_string(i), v.data(), v.size()).ok());
  for (int i = 0; i < 4; ++i)
    ASSERT_TRUE(c->Put("hot" + std::to_string(i), v.data(), v.size()).ok());
  std::string out;
  for (int i = 0; i < 40; ++i) ASSERT_TRUE(c->Get("cold" + std::to_string(i), &out).ok());
  for (int i = 0; i < 4; ++i) EXPECT_EQ(TierOf(*c, "hot" + std::to_string(i)), Tier::kHost);
}

TEST(TieredCacheTest, PinnedEntriesAreNeverMovedOrFreed) {
  testing::TempDir dir;
  auto c = MustOpen(SmallOptions(dir.path(), 64 * kKiB, 64 * kKiB, 8 << 20));
  ASSERT_TRUE(c);
  Random rng(testing::TestSeed());
  std::string pinned_value = ValueFor(rng, 16 * kKiB);
  ASSERT_TRUE(c->Put("pinned", pinned_value.data(), pinned_value.size()).ok());
  auto handle = c->Acquire("pinned");
  ASSERT_TRUE(handle.ok());
  const std::byte* where = handle->data();
  // Overwrite the tier many times over, and replace and delete the key itself.
  for (int i = 0; i < 40; ++i) {
    std::string v = ValueFor(rng, 16 * kKiB);
    ASSERT_TRUE(c->Put("other" + std::to_string(i), v.data(), v.size()).ok());
  }
  EXPECT_EQ(TierOf(*c, "pinned"), Tier::kGpu);
  std::string newer(8, 'n');
  ASSERT_TRUE(c->Put("pinned", newer.data(), newer.size()).ok());
  ASSERT_TRUE(c->Delete("pinned").ok());
  for (int i = 40; i < 60; ++i) {
    std::string v = ValueFor(rng, 16 * kKiB);
    ASSERT_TRUE(c->Put("other" + std::to_string(i), v.data(), v.size()).ok());
  }
  EXPECT_EQ(handle->data(), where);
  EXPECT_EQ(0, std::memcmp(handle->data(), pinned_value.data(), pinned_value.size()));
  uint64_t used_before = c->GetStats().tiers[0].used_bytes;
  *handle = ReadHandle();  // release: the old block is freed now
  EXPECT_LT(c->GetStats().tiers[0].used_bytes, used_before);
}

TEST(TieredCacheTest, FullyPinnedTierSendsPutsToTheNextTier) {
  testing::TempDir dir;
  auto c = MustOpen(SmallOptions("", 32 * kKiB, 64 * kKiB, 0));
  ASSERT_TRUE(c);
  std::string v(16 * kKiB, 'q');
  std::vector<ReadHandle> pins;
  for (int i = 0; i < 2; ++i) {
    ASSERT_TRUE(c->Put("g" + std::to_string(i), v.data(), v.size()).ok());
    pins.push_back(std::move(*c->Acquire("g" + std::to_string(i))));
  }
  ASSERT_TRUE(c->Put("next", v.data(), v.size()).ok());
  EXPECT_EQ(TierOf(*c, "next"), Tier::kHost);
  for (int i = 0; i < 2; ++i) EXPECT_EQ(TierOf(*c, "g" + std::to_string(i)), Tier::kGpu);
}

// Four threads put, get and delete 200 keys (values of up to 24 KiB that carry their own check)
// in a small three-tier cache of `partitions` placement partitions.
void CapacitiesHoldUnderConcurrentPutGetDelete(int partitions) {
  testing::TempDir dir;
  const uint64_t gpu = 256 * kKiB, host = 512 * kKiB, disk = 4 << 20;
  CacheOptions o = SmallOptions(dir.path(), gpu, host, disk);
  o.placement_partitions = partitions;
  auto c = MustOpen(o);
  ASSERT_TRUE(c);
  const uint64_t seed = testing::TestSeed();
  std::atomic<bool> failed{false};
  std::atomic<uint64_t> reads_ok{0};
  auto worker = [&](int t) {
    Random rng(seed + t);
    for (int i = 0; i < 1500 && !failed; ++i) {
      std::string key = "k" + std::to_string(rng.Uniform(0, 199));
      uint64_t op = rng.Uniform(0, 9);
      if (op < 4) {
        // The value carries its own check: 8 bytes of hash of the rest.
        std::string v = ValueFor(rng, rng.Uniform(8, 24 * kKiB));
        uint64_t h = HashBytes(v.data() + 8, v.size() - 8, 0);
        std::memcpy(v.data(), &h, 8);
        auto r = c->Put(key, v.data(), v.size(), {}, rng.Uniform(0, 9) == 0);
        if (!r.ok() && r.status().code() != StatusCode::kNoSpace) {
          ADD_FAILURE() << r.status().ToString();
          failed = true;
        }
      } else if (op < 9) {
        std::string out;
        auto r = c->Get(key, &out);
        if (r.ok()) {
          uint64_t h;
          std::memcpy(&h, out.data(), 8);
          if (h != HashBytes(out.data() + 8, out.size() - 8, 0)) {
            ADD_FAILURE() << "corrupt value for " << key;
            failed = true;
          }
          reads_ok++;
        } else if (!r.status().IsNotFound()) {
          ADD_FAILURE() << r.status().ToString();
          failed = true;
        }
      } else {
        Status s = c->Delete(key);
        if (!s.ok() && !s.IsNotFound()) {
          ADD_FAILURE() << s.ToString();
          failed = true;
        }
      }
      if (i % 100 == 0) {
        auto st = c->GetStats();
        if (st.tiers[0].used_bytes > gpu || st.tiers[1].used_bytes > host ||
            st.tiers[2].used_bytes > disk) {
          ADD_FAILURE() << "capacity exceeded";
          failed = true;
        }
      }
    }
  };
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) threads.emplace_back(worker, t);
  for (auto& th : threads) th.join();
  EXPECT_FALSE(failed);
  EXPECT_GT(reads_ok, 0u);
  auto st = c->GetStats();
  EXPECT_LE(st.tiers[0].used_bytes, gpu);
  EXPECT_LE(st.tiers[1].used_bytes, host);
  EXPECT_LE(st.tiers[2].used_bytes, disk);
}

TEST(TieredCacheTest, CapacitiesHoldUnderConcurrentPutGetDelete) {
  CapacitiesHoldUnderConcurrentPutGetDelete(1);
}

TEST(TieredCachePartitionTest, CapacitiesHoldUnderConcurrentPutGetDelete) {
  CapacitiesHoldUnderConcurrentPutGetDelete(4);
}

TEST(TieredCacheTest, DurableAndSpilledEntriesSurviveReopen) {
  testing::TempDir dir;
  Random rng(testing::TestSeed());
  std::map<std::string, std::string> durable, spilled;
  {
    auto c = MustOpen(SmallOptions(dir.path(), 0, 64 * kKiB, 32 << 20));
    ASSERT_TRUE(c);
    for (int i = 0; i < 10; ++i) {
      std::string key = "durable/" + std::to_string(i);
      durable[key] = ValueFor(rng, 10 * kKiB);
      ASSERT_TRUE(c->Put(key, durable[key].data(), durable[key].size(),
                         TensorMeta{DType::kU8, {10, 1024}}, true)
                      .ok());
    }
    for (int i = 0; i < 20; ++i) {
      std::string key = "plain/" + std::to_string(i);
      std::string v = ValueFor(rng, 12 * kKiB);
      ASSERT_TRUE(c->Put(key, v.data(), v.size()).ok());
      spilled[key] = v;
    }
    EXPECT_GT(c->GetStats().durable_writes, 9u);
    // Only what actually went to disk counts as spilled.
    for (auto it = spilled.begin(); it != spilled.end();) {
      auto st = c->Stat(it->first);
      it = (st.ok() && st->tier == Tier::kDisk) ? std::next(it) : spilled.erase(it);
    }
    ASSERT_FALSE(spilled.empty());
  }
  auto c = MustOpen(SmallOptions(dir.path(), 0, 64 * kKiB, 32 << 20));
  ASSERT_TRUE(c);
  for (auto* group : {&durable, &spilled}) {
    for (auto& [key, value] : *group) {
      std::string out;
      auto info = c->Get(key, &out);
      ASSERT_TRUE(info.ok()) << key << ": " << info.status().ToString();
      EXPECT_EQ(out, value) << key;
    }
  }
  EXPECT_EQ(c->Stat("durable/3")->tensor, (TensorMeta{DType::kU8, {10, 1024}}));
}

TEST(TieredCacheTest, FlushWritesBackMemoryEntries) {
  testing::TempDir dir;
  std::string v(1000, 'f');
  {
    auto c = MustOpen(SmallOptions(dir.path(), 64 * kKiB, 64 * kKiB, 8 << 20));
    ASSERT_TRUE(c);
    ASSERT_TRUE(c->Put("in-gpu", v.data(), v.size()).ok());
    ASSERT_TRUE(c->Flush().ok());
    EXPECT_TRUE(c->Stat("in-gpu")->on_disk);
  }
  auto c = MustOpen(SmallOptions(dir.path(), 64 * kKiB, 64 * kKiB, 8 << 20));
  std::string out;
  ASSERT_TRUE(c->Get("in-gpu", &out).ok());
  EXPECT_EQ(out, v);
}

// A non-durable overwrite of a key with a disk copy is written through (synced) in place of
// that copy: a restart serves the new value, never the old one, and never neither.
TEST(TieredCacheTest, OverwrittenDurableValueIsNotServedAfterRestart) {
  testing::TempDir dir;
  {
    auto c = MustOpen(SmallOptions(dir.path(), 0, 64 * kKiB, 8 << 20));
    ASSERT_TRUE(c);
    ASSERT_TRUE(c->Put("k", "old", 3, {}, true).ok());
    ASSERT_TRUE(c->Put("k", "new", 3, {}, false).ok());
    std::string out;
    ASSERT_TRUE(c->Get("k", &out).ok());
    EXPECT_EQ(out, "new");
  }
  auto c = MustOpen(SmallOptions(dir.path(), 0, 64 * kKiB, 8 << 20));
  std::string out;
  ASSERT_TRUE(c->Get("k", &out).ok());
  EXPECT_EQ(out, "new") << "stale value came back";
}

TEST(TieredCacheTest, DeleteRemovesEveryCopy) {
  testing::TempDir dir;
  {
    auto c = MustOpen(SmallOptions(dir.path(), 0, 64 * kKiB, 8 << 20));
    ASSERT_TRUE(c);
    ASSERT_TRUE(c->Put("k", "v", 1, {}, true).ok());
    ASSERT_TRUE(c->Delete("k").ok());
    EXPECT_TRUE(c->Delete("k").IsNotFound());
    std::string out;
    EXPECT_TRUE(c->Get("k", &out).status().IsNotFound());
  }
  auto c = MustOpen(SmallOptions(dir.path(), 0, 64 * kKiB, 8 << 20));
  EXPECT_TRUE(c->Stat("k").status().IsNotFound());
}

TEST(TieredCacheTest, InvalidTensorMetadataIsRefused) {
  auto c = MustOpen(SmallOptions("", 0, 64 * kKiB, 0));
  ASSERT_TRUE(c);
  std::string v(24, 't');
  EXPECT_EQ(c->Put("t", v.data(), v.size(), TensorMeta{DType::kF32, {2, 2}}).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(c->Put("t", v.data(), v.size(), TensorMeta{DType::kRaw, {24}}).status().code(),
            StatusCode::kInvalidArgument);
  auto ok = c->Put("t", v.data(), v.size(), TensorMeta{DType::kF32, {2, 3}});
  ASSERT_TRUE(ok.ok());
  EXPECT_EQ(c->Stat("t")->tensor, (TensorMeta{DType::kF32, {2, 3}}));
}

TEST(TieredCacheTest, OversizeObjectsAndKeysAreRefused) {
  testing::TempDir dir;
  auto c = MustOpen(SmallOptions(dir.path(), 16 * kKiB, 32 * kKiB, 64 * kKiB));
  ASSERT_TRUE(c);
  std::string v(128 * kKiB, 'o');
  auto r = c->Put("too-big", v.data(), v.size());
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kNoSpace);
  EXPECT_NE(r.status().message().find("larger than every tier"), std::string_view::npos);
  std::string long_key(2000, 'k');
  EXPECT_EQ(c->Put(long_key, "v", 1).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(c->Put("", "v", 1).status().code(), StatusCode::kInvalidArgument);
  std::string out;
  EXPECT_TRUE(c->Get("too-big", &out).status().IsNotFound());
}

// A disk-bound object is staged in host memory of its full size before it is written; a size
// the machine cannot give (the disk tier is larger than memory) is NoSpace for that put, and
// the cache goes on serving.
TEST(TieredCacheTest, ADiskBoundObjectLargerThanMemoryIsNoSpaceNotACrash) {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "sanitizer allocators abort on a failed allocation (allocator_may_return_null)";
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
  GTEST_SKIP() << "sanitizer allocators abort on a failed allocation (allocator_may_return_null)";
#endif
#endif
  {
    std::ifstream overcommit("/proc/sys/vm/overcommit_memory");
    int mode = 0;
    if (overcommit >> mode; mode == 1) {
      GTEST_SKIP() << "vm.overcommit_memory=1: the kernel grants any allocation";
    }
  }
  testing::TempDir dir;
  constexpr uint64_t kTiB = 1ull << 40;
  auto c = MustOpen(SmallOptions(dir.path(), 16 * kKiB, 32 * kKiB, 4 * kTiB));
  ASSERT_TRUE(c);
  // Far more than this machine's memory and swap, within the disk tier's capacity.
  auto h = c->Reserve("huge", 2 * kTiB, TensorMeta{});
  ASSERT_FALSE(h.ok());
  EXPECT_EQ(h.status().code(), StatusCode::kNoSpace) << h.status().ToString();
  EXPECT_NE(h.status().message().find("to stage an object bound for the disk tier"),
            std::string_view::npos)
      << h.status().ToString();
  ASSERT_TRUE(c->Put("after", "ok", 2).ok());
  std::string out;
  ASSERT_TRUE(c->Get("after", &out).ok());
  EXPECT_EQ(out, "ok");
}

// A streamed reservation bound for disk holds no buffer: its pieces go to disk as they are
// written (in any order), the commit publishes them, and the value reads back whole; one that
// fits memory is an ordinary reservation there. An abandoned one leaves no chunks on disk.
TEST(TieredCacheTest, StreamedReservationsWritePiecesToDiskOrMemory) {
  testing::TempDir dir;
  auto c = MustOpen(SmallOptions(dir.path(), 16 * kKiB, 64 * kKiB, 64 << 20));
  ASSERT_TRUE(c);
  Random rng(testing::TestSeed());
  const std::string big = ValueFor(rng, (5 << 20) + 11), small = ValueFor(rng, 40 * kKiB);
  constexpr uint64_t kPiece = 1 << 20;

  auto h = c->ReserveStreamed("big", big.size(), TensorMeta{}, /*durable=*/true);
  ASSERT_TRUE(h.ok()) << h.status().ToString();
  EXPECT_EQ(h->tier(), Tier::kDisk);
  EXPECT_EQ(h->data(), nullptr);
  for (uint64_t off = big.size() / kPiece * kPiece;; off -= kPiece) {
    const uint64_t n = std::min<uint64_t>(kPiece, big.size() - off);
    ASSERT_TRUE(c->WriteAt(*h, off, big.data() + off, n).ok());
    if (off == 0) break;
  }
  EXPECT_EQ(c->WriteAt(*h, big.size() - 1, big.data(), 2).code(), StatusCode::kInvalidArgument);
  auto v = c->Commit(std::move(*h), /*durable=*/true);
  ASSERT_TRUE(v.ok()) << v.status().ToString();
  std::string out;
  auto info = c->Get("big", &out);
  ASSERT_TRUE(info.ok()) << info.status().ToString();
  EXPECT_EQ(info->version, *v);
  EXPECT_TRUE(info->durable);
  EXPECT_TRUE(out == big);

  auto m = c->ReserveStreamed("small", small.size(), TensorMeta{}, false);
  ASSERT_TRUE(m.ok());
  EXPECT_EQ(m->tier(), Tier::kHost);
  ASSERT_TRUE(c->WriteAt(*m, 0, small.data(), small.size()).ok());
  ASSERT_TRUE(c->Commit(std::move(*m), false).ok());
  ASSERT_TRUE(c->Get("small", &out).ok());
  EXPECT_TRUE(out == small);

  EXPECT_EQ(*c->DiskChunkBytes(), big.size());
  {
    auto abandoned = c->ReserveStreamed("gone", big.size(), TensorMeta{}, false);
    ASSERT_TRUE(abandoned.ok());
    ASSERT_TRUE(c->WriteAt(*abandoned, 0, big.data(), kPiece).ok());
    EXPECT_EQ(*c->DiskChunkBytes(), big.size() + kPiece);
  }
  EXPECT_TRUE(c->Stat("gone").status().IsNotFound());
  EXPECT_EQ(*c->DiskChunkBytes(), big.size());  // the abandoned one's chunk is gone
  // Overwritten by an ordinary put: the chunks of "big" go with it.
  ASSERT_TRUE(c->Put("big", small.data(), small.size()).ok());
  EXPECT_EQ(*c->DiskChunkBytes(), 0u);
  // A durable stream past the durable budget (half of 64 MiB) is refused before any byte.
  EXPECT_EQ(c->ReserveStreamed("huge", 40 << 20, TensorMeta{}, true).status().code(),
            StatusCode::kNoSpace);
}

TEST(TieredCacheTest, ZeroByteObjectsRoundTrip) {
  auto c = MustOpen(SmallOptions("", 16 * kKiB, 0, 0));
  ASSERT_TRUE(c);
  ASSERT_TRUE(c->Put("empty", nullptr, 0).ok());
  std::string out = "junk";
  auto info = c->Get("empty", &out);
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(out.size(), 0u);
}

TEST(TieredCacheTest, NoDiskTierDropsColdObjects) {
  auto c = MustOpen(SmallOptions("", 0, 64 * kKiB, 0));
  ASSERT_TRUE(c);
  std::string v(16 * kKiB, 'd');
  for (int i = 0; i < 8; ++i) ASSERT_TRUE(c->Put("k" + std::to_string(i), v.data(), v.size()).ok());
  EXPECT_TRUE(c->Stat("k0").status().IsNotFound());
  EXPECT_TRUE(c->Stat("k7").ok());
  EXPECT_EQ(c->GetStats().dropped, 4u);
  EXPECT_EQ(c->Put("d", "x", 1, {}, true).status().code(), StatusCode::kNotSupported);
}

TEST(TieredCacheTest, GpuTierIsOffWithAReasonWithoutAGpu) {
  if (ProbeCuda().usable) GTEST_SKIP() << "a GPU is present; covered by the gpu tests";
  CacheOptions o;
  o.gpu_capacity = 1 << 20;
  o.host_capacity = 1 << 20;
  o.host_mode = MemoryArena::HostMode::kPageable;
  auto c = MustOpen(o);
  ASSERT_TRUE(c);
  EXPECT_FALSE(c->tier_enabled(Tier::kGpu));
  EXPECT_FALSE(c->gpu_tier_note().empty());
  ASSERT_TRUE(c->Put("k", "v", 1).ok());
  EXPECT_EQ(TierOf(*c, "k"), Tier::kHost);
}

}  // namespace
}  // namespace gkv

namespace gkv {
namespace {

TEST(TieredCacheFastPathTest, AcquireServesMemoryAndDefersDiskAndPromotion) {
  testing::TempDir dir;
  auto c = MustOpen(SmallOptions(dir.path(), 0, 64 * kKiB, 8 << 20));
  ASSERT_TRUE(c);
  std::string v(16 * kKiB, 'f');
  for (int i = 0; i < 5; ++i) ASSERT_TRUE(c->Put("k" + std::to_string(i), v.data(), v.size()).ok());
  ReadHandle h;
  EXPECT_EQ(c->TryAcquireFromMemory("k4", &h), TieredCache::FastPath::kServed);
  EXPECT_EQ(std::memcmp(h.data(), v.data(), v.size()), 0);
  h = ReadHandle();
  EXPECT_EQ(c->TryAcquireFromMemory("nope", &h), TieredCache::FastPath::kMiss);
  ASSERT_EQ(TierOf(*c, "k0"), Tier::kDisk);
  EXPECT_EQ(c->TryAcquireFromMemory("k0", &h), TieredCache::FastPath::kNeedsSlowPath);
}

TEST(TieredCacheFastPathTest, ReserveAndCommitOnlyWithoutEvictionOrDiskIo) {
  testing::TempDir dir;
  auto c = MustOpen(SmallOptions(dir.path(), 0, 32 * kKiB, 8 << 20));
  ASSERT_TRUE(c);
  std::string v(16 * kKiB, 'r');
  WriteHandle w;
  ASSERT_EQ(c->TryReserveInMemory("a", v.size(), {}, &w), TieredCache::FastPath::kServed);
  std::memcpy(w.data(), v.data(), v.size());
  uint64_t version = 0;
  ASSERT_EQ(c->TryCommitInMemory(&w, &version), TieredCache::FastPath::kServed);
  EXPECT_GT(version, 0u);
  std::string out;
  ASSERT_TRUE(c->Get("a", &out).ok());
  EXPECT_EQ(out, v);
  ASSERT_TRUE(c->Put("b", v.data(), v.size()).ok());
  // Full: the fast reserve would have to evict.
  WriteHandle w2;
  EXPECT_EQ(c->TryReserveInMemory("c", v.size(), {}, &w2), TieredCache::FastPath::kNeedsSlowPath);
  // An older durable copy on disk needs a disk delete: not for the fast commit.
  ASSERT_TRUE(c->Delete("b").ok());
  ASSERT_TRUE(c->Put("d", "x", 1, {}, true).ok());
  WriteHandle w3;
  ASSERT_EQ(c->TryReserveInMemory("d", 1, {}, &w3), TieredCache::FastPath::kServed);
  EXPECT_EQ(c->TryCommitInMemory(&w3, &version), TieredCache::FastPath::kNeedsSlowPath);
  ASSERT_TRUE(c->Commit(std::move(w3), false).ok());
  // Invalid input is left to the slow path, which explains it.
  WriteHandle w4;
  EXPECT_EQ(c->TryReserveInMemory("", 1, {}, &w4), TieredCache::FastPath::kNeedsSlowPath);
}

// Read repair's conditional install: the pushed copy lands only while the key still holds the
// version the client compared against (a write that arrived since is newer than the push knew).
TEST(TieredCacheFastPathTest, ConditionalHandOffLandsOnlyOverTheExpectedVersion) {
  testing::TempDir dir;
  auto c = MustOpen(SmallOptions(dir.path(), 0, 256 * kKiB, 8 << 20));
  ASSERT_TRUE(c);
  auto handed = [&](uint64_t version, uint64_t expected, const std::string& bytes) {
    auto h = c->Reserve("k", bytes.size(), {});
    EXPECT_TRUE(h.ok());
    std::memcpy(h->data(), bytes.data(), bytes.size());
    auto r = c->CommitHandedOffIf(std::move(*h), false, version, expected);
    EXPECT_TRUE(r.ok());
    return r.ok() && *r;
  };
  const uint64_t base = c->VersionClock();
  EXPECT_FALSE(handed(base + 10, 5, "aa"));  // expected a version, the key is absent
  EXPECT_TRUE(handed(base + 10, 0, "bb"));   // absent, as expected
  auto put = c->Put("k", "cc", 2);           // a write lands meanwhile
  ASSERT_TRUE(put.ok());
  EXPECT_FALSE(handed(*put + 100, base + 10, "dd"));  // newer, but not over what was compared
  std::string out;
  ASSERT_TRUE(c->Get("k", &out).ok());
  EXPECT_EQ(out, "cc");
  EXPECT_TRUE(handed(*put + 100, *put, "ee"));
  ASSERT_TRUE(c->Get("k", &out).ok());
  EXPECT_EQ(out, "ee");

  // Durable: a push that cannot land writes nothing to disk either (it once replaced the disk
  // copy of the version the key held and then deleted it, leaving no disk copy at all).
  auto kept = c->Put("d", "keep", 4, {}, /*durable=*/true);
  ASSERT_TRUE(kept.ok());
  auto h = c->Reserve("d", 4, {});
  ASSERT_TRUE(h.ok());
  std::memcpy(h->data(), "push", 4);
  auto landed = c->CommitHandedOffIf(std::move(*h), /*durable=*/true, *kept + 1000, 0);
  ASSERT_TRUE(landed.ok());
  EXPECT_FALSE(*landed);
  c.reset();
  c = MustOpen(SmallOptions(dir.path(), 0, 256 * kKiB, 8 << 20));
  ASSERT_TRUE(c);
  ASSERT_TRUE(c->Get("d", &out).ok()) << "the durable copy is gone after a reopen";
  EXPECT_EQ(out, "keep");
}

// A client replicating a write assigns its version (kFlagClientVersion), so every replica
// gives the write the same one; a key already holding a newer version takes the next one up
// (the put still replaces it), and the cache's own versions stay above what it adopted.
TEST(TieredCacheFastPathTest, RequestedVersionsAreKeptUnlessTheKeyHoldsANewerOne) {
  testing::TempDir dir;
  auto c = MustOpen(SmallOptions(dir.path(), 0, 256 * kKiB, 8 << 20));
  ASSERT_TRUE(c);
  const uint64_t v = c->VersionClock() + (uint64_t{1} << 30);  // a client clock a second ahead
  for (bool fast : {true, false}) {
    const std::string key = fast ? "fast" : "slow";
    auto commit_at = [&](uint64_t requested, const std::string& bytes) -> uint64_t {
      uint64_t version = 0;
      WriteHandle h;
      if (fast) {
        EXPECT_EQ(c->TryReserveInMemory(key, bytes.size(), {}, &h), TieredCache::FastPath::kServed);
      } else {
        auto r = c->Reserve(key, bytes.size(), {});
        EXPECT_TRUE(r.ok());
        if (r.ok()) h = std::move(*r);
      }
      std::memcpy(h.data(), bytes.data(), bytes.size());
      h.RequestVersion(requested);
      if (fast) {
        EXPECT_EQ(c->TryCommitInMemory(&h, &version), TieredCache::FastPath::kServed);
      } else {
        auto r = c->Commit(std::move(h), false);
        EXPECT_TRUE(r.ok());
        version = r.ok() ? *r : 0;
      }
      return version;
    };
    EXPECT_EQ(commit_at(v, "one"), v);
    // Older than what the key holds: just above it, and it is the key's value now.
    EXPECT_EQ(commit_at(v - 100, "two"), v + 1);
    std::string out;
    auto info = c->Get(key, &out);
    ASSERT_TRUE(info.ok());
    EXPECT_EQ(info->version, v + 1);
    EXPECT_EQ(out, "two");
    EXPECT_EQ(commit_at(v + 50, "three"), v + 50);
  }
  // The cache's own next version is above every version it adopted.
  auto own = c->Put("own", "x", 1);
  ASSERT_TRUE(own.ok());
  EXPECT_GT(*own, v + 50);
}

}  // namespace
}  // namespace gkv

namespace gkv {
namespace {

// Issue 12 item 1: write-back spills past the disk capacity must never evict durable objects.
TEST(TieredCacheDurabilityTest, CapacityEvictionNeverRemovesDurableObjects) {
  testing::TempDir dir;
  Random rng(testing::TestSeed());
  // 4 objects of memory, 48 of disk: 150 spills overflow the disk tier three times over.
  auto o = SmallOptions(dir.path(), 0, 64 * kKiB, 48 * 16 * kKiB);
  std::map<std::string, std::string> durable;
  {
    auto c = MustOpen(o);
    ASSERT_TRUE(c);
    for (int i = 0; i < 8; ++i) {
      std::string key = "dur" + std::to_string(i);
      durable[key] = ValueFor(rng, 16 * kKiB - 64);
      ASSERT_TRUE(c->Put(key, durable[key].data(), durable[key].size(), {}, true).ok());
    }
    for (int i = 0; i < 150; ++i) {
      std::string v = ValueFor(rng, 16 * kKiB - 64);
      auto r = c->Put("plain" + std::to_string(i), v.data(), v.size());
      ASSERT_TRUE(r.ok()) << r.status().ToString();
    }
    EXPECT_GT(c->GetStats().disk_evictions, 0u);
    for (auto& [key, value] : durable) {
      std::string out;
      auto info = c->Get(key, &out);
      ASSERT_TRUE(info.ok()) << key << ": " << info.status().ToString();
      EXPECT_EQ(out, value) << key;
    }
  }
  auto c = MustOpen(o);
  ASSERT_TRUE(c);
  for (auto& [key, value] : durable) {
    std::string out;
    auto info = c->Get(key, &out);
    ASSERT_TRUE(info.ok()) << key << " after reopen: " << info.status().ToString();
    EXPECT_EQ(out, value) << key;
  }
}

// Issue 12 item 7: versions handed out after a restart exceed every version handed out before,
// including those of non-durable writes the restart lost. Issue 38 (b): and they stay near the
// clock (they started 70 minutes ahead, past the hour other nodes accept from a client).
TEST(TieredCacheDurabilityTest, VersionsNeverGoBackwardsAcrossARestart) {
  testing::TempDir dir;
  auto o = SmallOptions(dir.path(), 0, 64 * kKiB, 8 << 20);
  constexpr uint64_t kTenSeconds = uint64_t{10} * 1000000 * 1024;  // in versions (us x 1024)
  uint64_t highest = 0;
  for (int boot = 0; boot < 3; ++boot) {
    auto c = MustOpen(o);
    ASSERT_TRUE(c);
    for (int i = 0; i < 5; ++i) {
      auto v = c->Put("k" + std::to_string(i), "x", 1);  // memory only: lost at close
      ASSERT_TRUE(v.ok());
      EXPECT_GT(*v, highest) << "boot " << boot << " handed out an old version again";
      EXPECT_LT(*v, WallClockVersion() + kTenSeconds)
          << "boot " << boot << ": " << (*v - WallClockVersion()) / 1024 / 1000 << " ms ahead";
      highest = std::max(highest, *v);
    }
  }
}

// Issue 12 item 13: a read racing with the drop of the same key gets NotFound, never Aborted.
TEST(TieredCacheConcurrencyTest, ConcurrentReadsOfDroppedKeysGetNotFound) {
  // No disk tier: every eviction drops the object.
  auto c = MustOpen(SmallOptions("", 0, 8 * kKiB, 0));
  ASSERT_TRUE(c);
  std::atomic<bool> stop{false};
  std::atomic<uint64_t> aborted{0}, reads{0};
  std::atomic<int> written{0};
  std::thread writer([&] {
    std::string v(1 * kKiB, 'w');
    for (int i = 0; i < 200000 && !stop; ++i) {
      ASSERT_TRUE(c->Put("k" + std::to_string(i), v.data(), v.size()).ok());
      written = i;
    }
    stop = true;
  });
  std::vector<std::thread> readers;
  for (int t = 0; t < 2; ++t) {
    readers.emplace_back([&] {
      std::string out;
      while (!stop) {
        const int w = written.load();
        for (int k = std::max(0, w - 10); k <= w; ++k) {
          auto r = c->Get("k" + std::to_string(k), &out);
          reads++;
          if (!r.ok() && r.status().code() == StatusCode::kAborted) aborted++;
        }
      }
    });
  }
  std::this_thread::sleep_for(std::chrono::seconds(3));
  stop = true;
  writer.join();
  for (auto& r : readers) r.join();
  EXPECT_EQ(aborted.load(), 0u) << "of " << reads.load() << " reads";
}

// Writers overwrite a few keys, half the time durably (written to disk before published), in a
// host tier that holds half of them, so spills meet commits in flight all the time; a key that
// was written and is never deleted must be found by every read. (A spill used to drop the
// visible version while a newer one was between its disk write and its publish.) Run under
// TSan too.
TEST(TieredCacheConcurrencyTest, AKeyNeverDeletedIsFoundWhileCommitsAndSpillsRace) {
  testing::TempDir dir;
  auto c = MustOpen(SmallOptions(dir.path(), 0, 64 * kKiB, 64 << 20));
  ASSERT_TRUE(c);
  constexpr int kKeys = 8;
  std::string v(16 * kKiB, 'v');
  for (int k = 0; k < kKeys; ++k)
    ASSERT_TRUE(c->Put("k" + std::to_string(k), v.data(), v.size()).ok());
  std::atomic<bool> stop{false};
  std::atomic<uint64_t> reads{0}, misses{0}, other_errors{0}, puts{0};
  // 3000 puts per writer, or 3 s (half of them are synced: a slow disk or TSan takes long).
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(3);
  std::vector<std::thread> threads;
  for (int w = 0; w < 2; ++w) {
    threads.emplace_back([&, w] {
      Random rng(testing::TestSeed() + w);
      std::string value(16 * kKiB, static_cast<char>('a' + w));
      for (int i = 0; i < 3000 && std::chrono::steady_clock::now() < deadline; ++i) {
        const std::string key = "k" + std::to_string(rng.Uniform(0, kKeys - 1));
        const bool durable = rng.Uniform(0, 1) == 0;
        auto r = c->Put(key, value.data(), value.size(), TensorMeta(), durable);
        ASSERT_TRUE(r.ok()) << r.status().ToString();
        puts++;
      }
    });
  }
  threads.emplace_back([&] {
    Random rng(testing::TestSeed() + 7);
    std::string out;
    while (!stop) {
      auto r = c->Get("k" + std::to_string(rng.Uniform(0, kKeys - 1)), &out);
      reads++;
      if (!r.ok()) (r.status().code() == StatusCode::kNotFound ? misses : other_errors)++;
    }
  });
  threads[0].join();
  threads[1].join();
  stop = true;
  threads[2].join();
  EXPECT_EQ(misses.load(), 0u) << "of " << reads.load() << " reads, during " << puts.load()
                               << " puts (" << other_errors.load() << " other errors)";
  EXPECT_GT(c->GetStats().moves[1][2], 100u) << "too few spills to exercise the race";
}

// Readers on the fast path pin entries without the placement lock while writers overwrite,
// spill (GPU -> host -> disk), promote and delete the same keys: every value a reader holds
// stays whole and unchanged until it lets go, and the tiers stay within their capacities.
// Values carry their own check (a hash of the rest in the first 8 bytes). Run under TSan too.
void FastPathReadersHoldWholeValuesWhileEntriesMoveAndDie(int partitions) {
  testing::TempDir dir;
  const uint64_t gpu = 128 * kKiB, host = 256 * kKiB;
  CacheOptions o = SmallOptions(dir.path(), gpu, host, 16 << 20);
  o.placement_partitions = partitions;
  auto c = MustOpen(o);
  ASSERT_TRUE(c);
  const uint64_t seed = testing::TestSeed();
  auto checked = [](const std::byte* p, uint64_t n) {
    uint64_t h;
    std::memcpy(&h, p, 8);
    return h == HashBytes(p + 8, n - 8, 0);
  };
  std::atomic<bool> stop{false}, failed{false};
  std::atomic<uint64_t> fast_served{0}, slow_served{0}, puts{0};
  auto writer = [&](int t) {
    Random rng(seed + 100 + t);
    while (!stop && !failed) {
      const std::string key = "k" + std::to_string(rng.Uniform(0, 47));
      if (rng.Uniform(0, 19) == 0) {
        Status s = c->Delete(key);
        if (!s.ok() && !s.IsNotFound()) {
          ADD_FAILURE() << s.ToString();
          failed = true;
        }
        continue;
      }
      std::string v = ValueFor(rng, rng.Uniform(16, 20 * kKiB));
      const uint64_t h = HashBytes(v.data() + 8, v.size() - 8, 0);
      std::memcpy(v.data(), &h, 8);
      auto r = c->Put(key, v.data(), v.size());
      if (!r.ok() && r.status().code() != StatusCode::kNoSpace) {
        ADD_FAILURE() << r.status().ToString();
        failed = true;
      }
      puts++;
    }
  };
  auto reader = [&](int t) {
    Random rng(seed + 200 + t);
    ReadHandle h;
    while (!stop && !failed) {
      const std::string key = "k" + std::to_string(rng.Uniform(0, 47));
      auto got = c->TryAcquireFromMemory(key, &h);
      if (got == TieredCache::FastPath::kMiss) continue;
      if (got == TieredCache::FastPath::kNeedsSlowPath) {
        auto r = c->Acquire(key);  // promotes on a second read within the window
        if (!r.ok()) {
          if (!r.status().IsNotFound() && r.status().code() != StatusCode::kAborted) {
            ADD_FAILURE() << r.status().ToString();
            failed = true;
          }
          continue;
        }
        h = std::move(*r);
        slow_served++;
      } else {
        fast_served++;
      }
      if (!checked(h.data(), h.size())) {
        ADD_FAILURE() << "torn or foreign bytes in " << key << " (" << h.size() << " bytes)";
        failed = true;
      }
      std::this_thread::yield();  // let placement try to move it meanwhile
      if (!checked(h.data(), h.size())) {
        ADD_FAILURE() << "bytes of pinned " << key << " changed under the reader";
        failed = true;
      }
      h = ReadHandle();
    }
  };
  std::vector<std::thread> threads;
  for (int t = 0; t < 2; ++t) threads.emplace_back(writer, t);
  for (int t = 0; t < 3; ++t) threads.emplace_back(reader, t);
  std::this_thread::sleep_for(std::chrono::seconds(2));
  stop = true;
  for (auto& th : threads) th.join();
  EXPECT_FALSE(failed);
  EXPECT_GT(fast_served.load(), 0u);
  EXPECT_GT(slow_served.load(), 0u);
  auto st = c->GetStats();
  EXPECT_GT(st.moves[0][1] + st.moves[1][2], 0u) << "nothing spilled: the test exercised no move";
  EXPECT_LE(st.tiers[0].used_bytes, gpu);
  EXPECT_LE(st.tiers[1].used_bytes, host);
  // Every pin was released: a full cache can be emptied (nothing is held in memory).
  for (int i = 0; i < 48; ++i) (void)c->Delete("k" + std::to_string(i));
  st = c->GetStats();
  EXPECT_EQ(st.tiers[0].used_bytes + st.tiers[1].used_bytes, 0u);
  std::printf("%d partition(s): fast reads %llu, slow reads %llu, puts %llu\n", partitions,
              static_cast<unsigned long long>(fast_served.load()),
              static_cast<unsigned long long>(slow_served.load()),
              static_cast<unsigned long long>(puts.load()));
}

TEST(TieredCacheConcurrencyTest, FastPathReadersHoldWholeValuesWhileEntriesMoveAndDie) {
  FastPathReadersHoldWholeValuesWhileEntriesMoveAndDie(1);
}

TEST(TieredCacheConcurrencyTest, FastPathReadersHoldWholeValuesAcrossPlacementPartitions) {
  FastPathReadersHoldWholeValuesWhileEntriesMoveAndDie(4);
}

// A reader that pins an entry (fast path, no placement lock) while the entry's bytes are being
// copied down a tier keeps it where it is: the move is abandoned, the reader's bytes stay valid
// and unchanged, the entry is not dropped or sent to disk, and the put that needed room gets it
// from another entry. Deterministic: the test hook pins at exactly that moment.
TEST(TieredCacheFastPathTest, AReaderThatPinsDuringASpillKeepsTheEntryInPlace) {
  testing::TempDir dir;
  CacheOptions o = SmallOptions(dir.path(), 64 * kKiB, 64 * kKiB, 8 << 20);
  TieredCache* cache = nullptr;
  ReadHandle held;
  std::string pinned_key;
  o.test_after_spill_copy = [&](const std::string& key) {
    if (!pinned_key.empty()) return;  // once
    pinned_key = key;
    ASSERT_EQ(cache->TryAcquireFromMemory(key, &held), TieredCache::FastPath::kServed);
  };
  auto c = MustOpen(o);
  ASSERT_TRUE(c);
  cache = c.get();
  Random rng(testing::TestSeed());
  std::vector<std::string> values;
  for (int i = 0; i < 4; ++i) {  // fills the 64 KiB GPU tier
    values.push_back(ValueFor(rng, 16 * kKiB));
    ASSERT_TRUE(c->Put("k" + std::to_string(i), values[i].data(), values[i].size()).ok());
  }
  std::string v(16 * kKiB, 'n');
  ASSERT_TRUE(c->Put("k4", v.data(), v.size()).ok());  // spills one; the hook pins the first
  ASSERT_EQ(pinned_key, "k0");                         // the least recently used
  ASSERT_NE(held.data(), nullptr);
  EXPECT_EQ(held.info().tier, Tier::kGpu);
  EXPECT_EQ(TierOf(*c, "k0"), Tier::kGpu) << "the pinned entry was moved anyway";
  EXPECT_EQ(TierOf(*c, "k1"), Tier::kHost) << "the put's room should come from the next one";
  EXPECT_EQ(TierOf(*c, "k4"), Tier::kGpu);
  EXPECT_EQ(0, std::memcmp(held.data(), values[0].data(), values[0].size()));
  auto st = c->GetStats();
  EXPECT_EQ(st.dropped, 0u);
  EXPECT_EQ(st.moves[0][1], 1u);
  held = ReadHandle();
  // Unpinned, it moves as usual.
  std::string out;
  ASSERT_TRUE(c->Put("k5", v.data(), v.size()).ok());
  ASSERT_TRUE(c->Get("k0", &out).ok());
  EXPECT_EQ(out, values[0]);
}

// A durable put writes its disk copy before it publishes. An older version spilled in between
// would meet the newer one on disk and be refused; it must stay readable until the put
// publishes. (It used to be dropped as superseded, and reads in that window missed a key whose
// every version was acknowledged: the consistency checker's "read not found older than
// acknowledged write".) Eviction passes over it meanwhile and takes the room from another
// entry. Deterministic: the hook runs in that window.
TEST(TieredCacheTest, AVersionSpilledWhileANewerOneIsBeingCommittedStaysReadable) {
  testing::TempDir dir;
  CacheOptions o = SmallOptions(dir.path(), 0, 64 * kKiB, 8 << 20);
  TieredCache* cache = nullptr;
  Random rng(testing::TestSeed());
  const std::string filler = ValueFor(rng, 16 * kKiB);
  bool armed = false, hooked = false;
  Status put_in_window, get_in_window = Status::Internal("not run");
  std::string read_in_window;
  o.test_before_publish = [&](const std::string& key) {
    if (key != "k0" || !armed || hooked) return;
    hooked = true;
    // Memory is full (k0, k1, k2 and the new version's room): this put needs room, and k0, the
    // least recently used, is passed over (its commit is in flight); k1 moves instead.
    put_in_window = cache->Put("f", filler.data(), filler.size()).status();
    get_in_window = cache->Get("k0", &read_in_window).status();
  };
  auto c = MustOpen(o);
  ASSERT_TRUE(c);
  cache = c.get();
  std::vector<std::string> old_values;
  for (int i = 0; i < 3; ++i) {
    old_values.push_back(ValueFor(rng, 16 * kKiB));
    ASSERT_TRUE(c->Put("k" + std::to_string(i), old_values[i].data(), 16 * kKiB).ok());
  }
  const std::string v2 = ValueFor(rng, 16 * kKiB);
  armed = true;
  ASSERT_TRUE(c->Put("k0", v2.data(), v2.size(), TensorMeta(), /*durable=*/true).ok());
  ASSERT_TRUE(hooked);
  EXPECT_TRUE(put_in_window.ok()) << put_in_window.ToString();
  ASSERT_TRUE(get_in_window.ok()) << "k0 read before its new version was published: "
                                  << get_in_window.ToString();
  EXPECT_EQ(read_in_window, old_values[0]);
  std::string out;
  ASSERT_TRUE(c->Get("k1", &out).ok());  // the entry that made the room
  EXPECT_EQ(out, old_values[1]);
  EXPECT_EQ(c->GetStats().dropped, 0u);
  // Published, the new version moves like any other (its commit no longer counts as in flight).
  for (int i = 0; i < 4; ++i) {
    ASSERT_TRUE(c->Put("g" + std::to_string(i), filler.data(), filler.size()).ok());
  }
  EXPECT_EQ(TierOf(*c, "k0"), Tier::kDisk);
  ASSERT_TRUE(c->Get("k0", &out).ok());
  EXPECT_EQ(out, v2);
}

// The other order: a spill already picked (and on its way to disk) when a durable put of its
// key begins. The put writes its new version to disk and waits before publishing; the spill's
// write then meets that version and is refused, and the entry must stay, readable, rather than
// be dropped as superseded. Deterministic: one hook holds the spill until the put has written,
// the other holds the put's publish until the spill is done and the key was read.
TEST(TieredCacheTest, ASpillThatMeetsANewerVersionBeingCommittedKeepsTheEntry) {
  testing::TempDir dir;
  CacheOptions o = SmallOptions(dir.path(), 0, 64 * kKiB, 8 << 20);
  TieredCache* cache = nullptr;
  Random rng(testing::TestSeed());
  const std::string v2 = ValueFor(rng, 16 * kKiB);
  std::promise<void> written, may_publish;
  std::once_flag written_once;  // set at the put's publish, or when the put ends without one
  auto set_written = [&] { std::call_once(written_once, [&] { written.set_value(); }); };
  std::shared_future<void> publish_allowed = may_publish.get_future().share();
  std::thread committer;
  Status committed = Status::Internal("not run");
  bool armed = false, spill_held = false;
  o.test_before_disk_spill = [&](const std::string& key) {
    if (key != "k0" || !armed || spill_held) return;
    spill_held = true;
    committer = std::thread([&] {
      committed = cache->Put("k0", v2.data(), v2.size(), TensorMeta(), /*durable=*/true).status();
      set_written();  // a put that failed before its publish fails the test below, not hangs it
    });
    written.get_future().wait();  // the put's new version is on disk, not yet published
  };
  o.test_before_publish = [&](const std::string& key) {
    if (key != "k0" || !spill_held) return;
    set_written();
    publish_allowed.wait();
  };
  auto c = MustOpen(o);
  ASSERT_TRUE(c);
  cache = c.get();
  std::vector<std::string> old_values;
  for (int i = 0; i < 4; ++i) {  // fills the 64 KiB tier
    old_values.push_back(ValueFor(rng, 16 * kKiB));
    ASSERT_TRUE(c->Put("k" + std::to_string(i), old_values[i].data(), 16 * kKiB).ok());
  }
  armed = true;
  const std::string filler = ValueFor(rng, 16 * kKiB);
  // Spills k0 (the least recently used); the hooks run the durable put of k0 meanwhile.
  Status filled = c->Put("f", filler.data(), filler.size()).status();
  std::string out;
  Status read = c->Get("k0", &out).status();
  may_publish.set_value();
  ASSERT_TRUE(spill_held);
  committer.join();
  EXPECT_TRUE(filled.ok()) << filled.ToString();
  EXPECT_TRUE(committed.ok()) << committed.ToString();
  ASSERT_TRUE(read.ok()) << "k0 read while its new version was being committed: "
                         << read.ToString();
  EXPECT_EQ(out, old_values[0]);
  EXPECT_EQ(c->GetStats().dropped, 0u);
  ASSERT_TRUE(c->Get("k0", &out).ok());
  EXPECT_EQ(out, v2);
}

// A fast-path read (which never takes the placement lock, so never reorders an LRU list) still
// keeps the entry from being the next to move down: the eviction scan gives it a second chance.
TEST(TieredCacheFastPathTest, AFastReadKeepsAnEntryFromBeingTheNextToMove) {
  auto c = MustOpen(SmallOptions("", 64 * kKiB, 1 << 20, 0));
  ASSERT_TRUE(c);
  std::string v(16 * kKiB, 'x');
  for (int i = 0; i < 4; ++i) ASSERT_TRUE(c->Put("k" + std::to_string(i), v.data(), v.size()).ok());
  {
    ReadHandle h;
    ASSERT_EQ(c->TryAcquireFromMemory("k0", &h), TieredCache::FastPath::kServed);
  }
  ASSERT_TRUE(c->Put("k4", v.data(), v.size()).ok());
  EXPECT_EQ(TierOf(*c, "k0"), Tier::kGpu);
  EXPECT_EQ(TierOf(*c, "k1"), Tier::kHost);
  auto st = c->GetStats();
  EXPECT_EQ(st.tiers[0].hits, 1u);
}

// Issue 12 item 11: the fast paths accept a handle that still holds something (a pin or a
// reservation) and release it without deadlocking on the placement lock.
TEST(TieredCacheFastPathTest, FastPathsReleaseANonEmptyOutHandle) {
  auto c = MustOpen(SmallOptions("", 0, 64 * kKiB, 0));
  ASSERT_TRUE(c);
  ASSERT_TRUE(c->Put("a", "1", 1).ok());
  ASSERT_TRUE(c->Put("b", "2", 1).ok());
  std::atomic<bool> done{false};
  std::thread t([&] {
    ReadHandle h;
    EXPECT_EQ(c->TryAcquireFromMemory("a", &h), TieredCache::FastPath::kServed);
    EXPECT_EQ(c->TryAcquireFromMemory("b", &h), TieredCache::FastPath::kServed);  // h held "a"
    h = ReadHandle();
    WriteHandle w;
    EXPECT_EQ(c->TryReserveInMemory("c", 100, {}, &w), TieredCache::FastPath::kServed);
    EXPECT_EQ(c->TryReserveInMemory("d", 100, {}, &w), TieredCache::FastPath::kServed);
    // "a", "b" and the reservation for "d"; the one for "c" was released.
    EXPECT_EQ(c->GetStats().tiers[1].used_bytes, 3 * 256u);
    done = true;
  });
  for (int i = 0; i < 500 && !done; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  if (!done) {
    ADD_FAILURE() << "a fast path deadlocked releasing the handle it was given";
    std::fflush(stdout);
    std::_Exit(1);
  }
  t.join();
}

}  // namespace
}  // namespace gkv

namespace gkv {
namespace {

// A machine crash, simulated: every byte the disk tier did not sync is lost. `open` reopens.
struct CrashRig {
  testing::TempDir dir;
  std::shared_ptr<SimulatedCrashFs> fs = SimulatedCrashFs::Create();
  CacheOptions Options(uint64_t host = 64 * kKiB, uint64_t disk = 8 << 20) {
    auto o = SmallOptions(dir.path(), 0, host, disk);
    o.disk_crash_fs = fs;
    return o;
  }
  // Crashes and destroys `c` (its closing writes go nowhere), then drops the unsynced data.
  void Crash(std::unique_ptr<TieredCache>& c) {
    fs->Crash();
    c.reset();
    Status s = fs->DropUnsyncedData();
    EXPECT_TRUE(s.ok()) << s.ToString();
  }
};

// Issue 12 item 13: durability shown against lost unsynced data, not a process kill.
TEST(TieredCacheCrashTest, AcknowledgedDurablePutsSurviveAMachineCrash) {
  CrashRig rig;
  Random rng(testing::TestSeed());
  std::map<std::string, std::string> durable, plain;
  auto c = MustOpen(rig.Options());
  ASSERT_TRUE(c);
  for (int i = 0; i < 20; ++i) {
    std::string key = "dur" + std::to_string(i);
    durable[key] = ValueFor(rng, rng.Uniform(1, 20 * kKiB));
    ASSERT_TRUE(c->Put(key, durable[key].data(), durable[key].size(), {}, true).ok());
  }
  // Non-durable puts after the last durable one: spilled (unsynced) or only in memory.
  for (int i = 0; i < 20; ++i) {
    std::string key = "plain" + std::to_string(i);
    plain[key] = ValueFor(rng, 12 * kKiB);
    ASSERT_TRUE(c->Put(key, plain[key].data(), plain[key].size()).ok());
  }
  ASSERT_GT(c->GetStats().moves[1][2], 0u);
  ASSERT_GT(rig.fs->unsynced_bytes(), 0u);
  rig.Crash(c);
  c = MustOpen(rig.Options());
  ASSERT_TRUE(c);
  for (auto& [key, value] : durable) {
    std::string out;
    auto info = c->Get(key, &out);
    ASSERT_TRUE(info.ok()) << key << ": " << info.status().ToString();
    EXPECT_EQ(out, value) << key;
  }
  // Non-durable data may be lost (and here it is: the crash dropped the unsynced spills), but
  // what comes back is what was written.
  size_t lost = 0;
  for (auto& [key, value] : plain) {
    std::string out;
    auto info = c->Get(key, &out);
    if (info.ok()) {
      EXPECT_EQ(out, value) << key;
    } else {
      EXPECT_TRUE(info.status().IsNotFound()) << info.status().ToString();
      lost++;
    }
  }
  EXPECT_EQ(lost, plain.size()) << "unsynced spills survived the simulated crash";
}

// Issue 12 item 8: a delete of a durable key, once acknowledged, survives a crash.
TEST(TieredCacheCrashTest, DeletedDurableKeyStaysDeletedAfterACrash) {
  CrashRig rig;
  auto c = MustOpen(rig.Options());
  ASSERT_TRUE(c);
  ASSERT_TRUE(c->Put("k", "durable", 7, {}, true).ok());
  ASSERT_TRUE(c->Delete("k").ok());
  rig.Crash(c);
  c = MustOpen(rig.Options());
  ASSERT_TRUE(c);
  std::string out;
  EXPECT_TRUE(c->Get("k", &out).status().IsNotFound()) << "deleted value came back: " << out;
}

// Issue 12 item 8: a non-durable overwrite of a durable key leaves, after a crash, the new
// value: never the old one (stale) and never neither.
TEST(TieredCacheCrashTest, NonDurableOverwriteOfADurableKeySurvivesACrash) {
  CrashRig rig;
  auto c = MustOpen(rig.Options());
  ASSERT_TRUE(c);
  ASSERT_TRUE(c->Put("k", "old", 3, {}, true).ok());
  ASSERT_TRUE(c->Put("k", "new", 3, {}, false).ok());
  rig.Crash(c);
  c = MustOpen(rig.Options());
  ASSERT_TRUE(c);
  std::string out;
  auto info = c->Get("k", &out);
  ASSERT_TRUE(info.ok()) << info.status().ToString();
  EXPECT_EQ(out, "new");
}

// Issue 12 item 8: overwriting a key whose older value was spilled (and made durable by a later
// sync) never lets a crash bring the older value back.
TEST(TieredCacheCrashTest, OverwriteOfASpilledKeyNeverServesTheOldValueAfterACrash) {
  CrashRig rig;
  auto c = MustOpen(rig.Options(32 * kKiB));
  ASSERT_TRUE(c);
  std::string v1(16 * kKiB, '1'), filler(16 * kKiB, 'f');
  ASSERT_TRUE(c->Put("k", v1.data(), v1.size()).ok());
  for (int i = 0; i < 2; ++i)
    ASSERT_TRUE(c->Put("fill" + std::to_string(i), filler.data(), filler.size()).ok());
  ASSERT_EQ(TierOf(*c, "k"), Tier::kDisk);
  ASSERT_TRUE(c->Put("sync", "s", 1, {}, true).ok());  // syncs the WAL, the spill of v1 with it
  ASSERT_TRUE(c->Put("k", "v2", 2).ok());
  rig.Crash(c);
  c = MustOpen(rig.Options(32 * kKiB));
  ASSERT_TRUE(c);
  std::string out;
  auto info = c->Get("k", &out);
  if (info.ok()) {
    EXPECT_TRUE(out == "v2") << "a stale value came back (" << out.size() << " bytes)";
  }
}

}  // namespace
}  // namespace gkv

namespace gkv {
namespace {

// Issue 12 item 6: a batch of durable puts is one RocksDB write and one sync; each item gets
// its own result, and every acknowledged item survives a crash.
TEST(TieredCacheCrashTest, DurableCommitBatchSurvivesACrashWithPerItemResults) {
  CrashRig rig;
  auto o = rig.Options(64 * kKiB, 40 * 1040);  // durable budget: 20 objects of ~1 KiB
  auto c = MustOpen(o);
  ASSERT_TRUE(c);
  std::vector<WriteHandle> hs;
  for (int i = 0; i < 24; ++i) {
    auto h = c->Reserve("b" + std::to_string(i), 1000, {});
    ASSERT_TRUE(h.ok());
    std::memset(h->data(), 'a' + i % 26, 1000);
    hs.push_back(std::move(*h));
  }
  auto results = c->CommitBatch(std::move(hs), /*durable=*/true);
  ASSERT_EQ(results.size(), 24u);
  size_t ok = 0, no_space = 0;
  uint64_t last = 0;
  for (auto& r : results) {
    if (r.ok()) {
      ok++;
      EXPECT_GT(*r, last);
      last = *r;
    } else {
      EXPECT_EQ(r.status().code(), StatusCode::kNoSpace) << r.status().ToString();
      no_space++;
    }
  }
  EXPECT_GT(ok, 0u);
  EXPECT_GT(no_space, 0u);
  rig.Crash(c);
  c = MustOpen(o);
  ASSERT_TRUE(c);
  for (int i = 0; i < 24; ++i) {
    std::string out;
    auto info = c->Get("b" + std::to_string(i), &out);
    EXPECT_EQ(info.ok(), results[i].ok()) << i;
    if (info.ok()) {
      EXPECT_EQ(out, std::string(1000, 'a' + i % 26)) << i;
    }
  }
}

}  // namespace
}  // namespace gkv

namespace gkv {
namespace {

// Membership handoff: versions of different caches compare in write order (hybrid clocks), a
// handed-off version never replaces a newer one, and later versions are above it.
TEST(TieredCacheTest, HandedOffObjectsKeepTheirVersionAndNeverReplaceANewerOne) {
  testing::TempDir da, db, dc;
  auto a = MustOpen(SmallOptions(da.path(), 0, 1 << 20, 8 << 20));
  auto b = MustOpen(SmallOptions(db.path(), 0, 1 << 20, 8 << 20));
  auto c = MustOpen(SmallOptions(dc.path(), 0, 1 << 20, 8 << 20));
  auto va = a->Put("k", "old", 3);
  ASSERT_TRUE(va.ok());
  auto vb = b->Put("k", "new", 3);  // written later, on another cache
  ASSERT_TRUE(vb.ok());
  EXPECT_GT(*vb, *va);

  // b holds a newer version: the handed-off one does not land.
  auto h = b->Reserve("k", 3, {});
  ASSERT_TRUE(h.ok());
  std::memcpy(h->data(), "old", 3);
  auto landed = b->CommitHandedOff(std::move(*h), /*durable=*/true, *va);
  ASSERT_TRUE(landed.ok()) << landed.status().ToString();
  EXPECT_FALSE(*landed);
  std::string got;
  ASSERT_TRUE(b->Get("k", &got).ok());
  EXPECT_EQ(got, "new");

  // c has nothing: it keeps the version the object had, durable flag included.
  h = c->Reserve("k", 3, {});
  ASSERT_TRUE(h.ok());
  std::memcpy(h->data(), "old", 3);
  landed = c->CommitHandedOff(std::move(*h), /*durable=*/true, *va);
  ASSERT_TRUE(landed.ok() && *landed);
  auto info = c->Stat("k");
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->version, *va);
  EXPECT_TRUE(info->on_disk);
  auto listed = c->ListKeys();
  ASSERT_EQ(listed.size(), 1u);
  EXPECT_TRUE(listed[0].durable);
  EXPECT_GT(c->VersionClock(), *va);
  auto vc = c->Put("k2", "x", 1);
  ASSERT_TRUE(vc.ok());
  EXPECT_GT(*vc, *va);

  // A delete of a version that is no longer the newest leaves the key alone.
  EXPECT_EQ(c->DeleteVersion("k", *va + 1).code(), StatusCode::kAborted);
  EXPECT_TRUE(c->DeleteVersion("k", *va).ok());
  EXPECT_EQ(c->Stat("k").status().code(), StatusCode::kNotFound);
}

}  // namespace
}  // namespace gkv

namespace gkv {
namespace {

// The placement partition of `key` in a cache of `partitions` partitions over the default 16
// index shards (as TieredCache computes it).
int PartitionOf(const std::string& key, int partitions) {
  return static_cast<int>(HashKey(key) % 16 % static_cast<uint64_t>(partitions));
}

// Keys of the form PREFIX-N in partition `want` (or, with `except`, in any other one).
std::vector<std::string> KeysIn(const std::string& prefix, int want, int partitions, size_t n,
                                bool except = false) {
  std::vector<std::string> keys;
  for (int i = 0; keys.size() < n; ++i) {
    std::string k = prefix + "-" + std::to_string(i);
    if ((PartitionOf(k, partitions) == want) != except) keys.push_back(k);
  }
  return keys;
}

// Each partition owns a quarter of the host tier and evicts only its own keys: writes to the
// other partitions, many times the tier's size, leave a key in a quiet partition in memory,
// where one placement lock and one LRU order (1 partition) drop it.
TEST(TieredCachePartitionTest, EachPartitionEvictsOnlyItsOwnKeys) {
  for (int partitions : {1, 4}) {
    CacheOptions o = SmallOptions("", 0, 1 << 20, 0);
    o.placement_partitions = partitions;
    auto c = MustOpen(o);
    ASSERT_TRUE(c);
    EXPECT_EQ(c->placement_partitions(), partitions);
    const std::string quiet = KeysIn("quiet", 0, 4, 1).front();
    const std::string v(16 * kKiB, 'q');
    ASSERT_TRUE(c->Put(quiet, v.data(), v.size()).ok());
    const std::string w(16 * kKiB, 'w');
    for (const std::string& k : KeysIn("busy", 0, 4, 400, /*except=*/true)) {
      ASSERT_TRUE(c->Put(k, w.data(), w.size()).ok()) << k;
    }
    std::string out;
    auto got = c->Get(quiet, &out);
    if (partitions == 4) {
      ASSERT_TRUE(got.ok()) << got.status().ToString();
      EXPECT_EQ(out, v);
    } else {
      EXPECT_TRUE(got.status().IsNotFound()) << "one LRU order over 6 MiB of writes kept it";
    }
    auto st = c->GetStats();
    EXPECT_EQ(st.tiers[1].capacity, uint64_t{1} << 20);
    EXPECT_LE(st.tiers[1].used_bytes, uint64_t{1} << 20);
    EXPECT_GT(st.dropped, 0u);
  }
}

// A memory tier holds objects up to one partition's slice: a larger one goes to the next tier
// down (here disk), and with no tier that fits it is NoSpace; the tier's capacity (for weights
// and stats) stays the whole arena.
TEST(TieredCachePartitionTest, AnObjectLargerThanASliceGoesToTheNextTier) {
  testing::TempDir dir;
  CacheOptions o = SmallOptions(dir.path(), 1 << 20, 4 << 20, 64 << 20);
  o.placement_partitions = 4;
  auto c = MustOpen(o);
  ASSERT_TRUE(c);
  EXPECT_EQ(c->tier_capacity(Tier::kGpu), uint64_t{1} << 20);
  EXPECT_EQ(c->tier_capacity(Tier::kHost), uint64_t{4} << 20);
  Random rng(testing::TestSeed());
  const std::string small = ValueFor(rng, 200 * kKiB);   // fits a GPU slice (256 KiB)
  const std::string medium = ValueFor(rng, 600 * kKiB);  // only a host slice (1 MiB)
  const std::string large = ValueFor(rng, 2 << 20);      // no memory slice
  ASSERT_TRUE(c->Put("small", small.data(), small.size()).ok());
  ASSERT_TRUE(c->Put("medium", medium.data(), medium.size()).ok());
  ASSERT_TRUE(c->Put("large", large.data(), large.size()).ok());
  EXPECT_EQ(TierOf(*c, "small"), Tier::kGpu);
  EXPECT_EQ(TierOf(*c, "medium"), Tier::kHost);
  EXPECT_EQ(TierOf(*c, "large"), Tier::kDisk);
  std::string out;
  ASSERT_TRUE(c->Get("large", &out).ok());
  EXPECT_EQ(out, large);
  ASSERT_TRUE(c->Get("medium", &out).ok());
  EXPECT_EQ(out, medium);

  auto no_disk = SmallOptions("", 0, 4 << 20, 0);
  no_disk.placement_partitions = 4;
  auto m = MustOpen(no_disk);
  ASSERT_TRUE(m);
  EXPECT_EQ(m->max_object_size(), uint64_t{1} << 20);
  auto r = m->Put("large", large.data(), large.size());
  EXPECT_EQ(r.status().code(), StatusCode::kNoSpace) << r.status().ToString();
}

// Objects on disk are found again by a cache reopened with another partition count, each in
// its key's partition: a recovered key promoted to memory stays there while 200 puts fill every
// other partition (in any other partition, those puts would have evicted it).
TEST(TieredCachePartitionTest, AReopenWithOtherPartitionsPlacesEveryDiskObjectInItsPartition) {
  testing::TempDir dir;
  Random rng(testing::TestSeed());
  std::map<std::string, std::string> values;
  {
    auto c = MustOpen(SmallOptions(dir.path(), 0, 256 * kKiB, 16 << 20));
    ASSERT_TRUE(c);
    for (int i = 0; i < 64; ++i) {
      const std::string k = "k" + std::to_string(i);
      values[k] = ValueFor(rng, rng.Uniform(1, 16 * kKiB));
      ASSERT_TRUE(c->Put(k, values[k].data(), values[k].size(), {}, i % 2 == 0).ok());
    }
    ASSERT_TRUE(c->Flush().ok());
  }
  constexpr int kParts = 8;
  CacheOptions o = SmallOptions(dir.path(), 0, 256 * kKiB, 16 << 20);
  o.placement_partitions = kParts;
  auto c = MustOpen(o);
  ASSERT_TRUE(c);
  EXPECT_EQ(c->GetStats().tiers[2].objects, values.size());
  std::string hot;
  for (const auto& [k, v] : values) {
    if (PartitionOf(k, kParts) != 0) hot = k;
  }
  ASSERT_FALSE(hot.empty());
  std::string out;
  ASSERT_TRUE(c->Get(hot, &out).ok());
  ASSERT_TRUE(c->Get(hot, &out).ok());  // the second read within the window promotes it
  ASSERT_EQ(TierOf(*c, hot), Tier::kHost);
  const std::string filler(16 * kKiB, 'f');
  for (const std::string& k : KeysIn("fill", PartitionOf(hot, kParts), kParts, 200, true)) {
    ASSERT_TRUE(c->Put(k, filler.data(), filler.size()).ok()) << k;
  }
  EXPECT_EQ(TierOf(*c, hot), Tier::kHost);
  for (const auto& [k, v] : values) {
    auto got = c->Get(k, &out);
    ASSERT_TRUE(got.ok()) << k << ": " << got.status().ToString();
    EXPECT_EQ(out, v) << k;
  }
}

TEST(TieredCachePartitionTest, ThePartitionCountMustDivideTheShards) {
  for (int partitions : {0, 3, 32}) {
    CacheOptions o = SmallOptions("", 0, 1 << 20, 0);
    o.placement_partitions = partitions;
    auto r = TieredCache::Open(o);
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << partitions;
  }
  CacheOptions tiny = SmallOptions("", 0, 8 * kKiB, 0);
  tiny.placement_partitions = 4;  // 2 KiB slices are not whole pages
  EXPECT_EQ(TieredCache::Open(tiny).status().code(), StatusCode::kInvalidArgument);
}

TEST(TieredCachePartitionTest, ANodeGetsAsManyPartitionsAsIoThreadsWhileSlicesStayLarge) {
  CacheOptions o;
  o.host_capacity = uint64_t{16} << 30;
  EXPECT_EQ(CacheOptions::AutoPartitions(o, 1), 1);
  EXPECT_EQ(CacheOptions::AutoPartitions(o, 4), 4);
  EXPECT_EQ(CacheOptions::AutoPartitions(o, 3), 2);    // a divisor of the 16 shards
  EXPECT_EQ(CacheOptions::AutoPartitions(o, 64), 16);  // at most one per shard
  o.host_capacity = uint64_t{2} << 30;
  EXPECT_EQ(CacheOptions::AutoPartitions(o, 8), 2);  // slices of at least 1 GiB
  o.host_capacity = uint64_t{1} << 30;
  EXPECT_EQ(CacheOptions::AutoPartitions(o, 8), 1);
  o.host_capacity = uint64_t{4} << 30;
  EXPECT_EQ(CacheOptions::AutoPartitions(o, 8, uint64_t{256} << 20), 8);  // another minimum
  o.gpu_tier_in_host_memory = true;  // a GPU tier that Open turns on
  o.gpu_capacity = uint64_t{80} << 30;
  EXPECT_EQ(CacheOptions::AutoPartitions(o, 8), 4);  // every memory tier's slices
  o.host_capacity = 0;
  EXPECT_EQ(CacheOptions::AutoPartitions(o, 8), 8);
  o.gpu_capacity = uint64_t{1} << 30;  // gpu-check's tiers: one partition, 256 MiB values fit
  EXPECT_EQ(CacheOptions::AutoPartitions(o, 4), 1);
  // A GPU tier on a machine without a usable GPU is off, and does not count.
  o.gpu_tier_in_host_memory = false;
  EXPECT_EQ(CacheOptions::AutoPartitions(o, 8), ProbeCuda().usable ? 1 : 8);
}

}  // namespace
}  // namespace gkv
