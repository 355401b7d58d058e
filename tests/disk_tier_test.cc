#include <gtest/gtest.h>

#include <atomic>
#include <thread>

#include "gkv/random.h"
#include "gkv/storage/disk_tier.h"
#include "test_util.h"

namespace gkv {
namespace {

std::unique_ptr<DiskTier> OpenTier(const std::string& path, uint64_t capacity,
                                   double durable_share = 0.5,
                                   std::shared_ptr<SimulatedCrashFs> fs = nullptr) {
  DiskTier::Options o;
  o.path = path;
  o.capacity = capacity;
  o.durable_share = durable_share;
  o.crash_fs = std::move(fs);
  auto r = DiskTier::Open(o);
  EXPECT_TRUE(r.ok()) << r.status().ToString();
  return r.ok() ? std::move(*r) : nullptr;
}

TEST(DiskTierTest, PutGetDeleteWithTensorMetadata) {
  testing::TempDir dir;
  auto tier = OpenTier(dir.path(), 64 << 20);
  ASSERT_TRUE(tier);
  Random rng(testing::TestSeed());
  auto bytes = rng.Bytes(1 << 20);  // large: goes to a blob file
  StoredObjectMeta m{bytes.size(), 7, TensorMeta{DType::kF32, {256, 1024}}};
  ASSERT_TRUE(tier->Put("emb/1", m, bytes.data(), true, nullptr).ok());
  StoredObjectMeta back;
  std::string value;
  ASSERT_TRUE(tier->Get("emb/1", &back, &value).ok());
  EXPECT_EQ(back.version, 7u);
  EXPECT_EQ(back.tensor, m.tensor);
  ASSERT_EQ(value.size(), bytes.size());
  EXPECT_EQ(0, std::memcmp(value.data(), bytes.data(), bytes.size()));
  EXPECT_EQ(tier->used_bytes(), bytes.size() + 5);
  ASSERT_TRUE(tier->Delete("emb/1").ok());
  EXPECT_TRUE(tier->Get("emb/1", &back, &value).IsNotFound());
  EXPECT_EQ(tier->used_bytes(), 0u);
}

TEST(DiskTierTest, OldestObjectsGoPastCapacity) {
  testing::TempDir dir;
  auto tier = OpenTier(dir.path(), 10 * 1000 + 100);
  ASSERT_TRUE(tier);
  std::string v(1000, 'x');
  for (int i = 0; i < 10; ++i) {
    std::vector<DiskEviction> ev;
    ASSERT_TRUE(
        tier->Put("k" + std::to_string(i), {v.size(), uint64_t(i + 1), {}}, v.data(), false, &ev)
            .ok());
    EXPECT_TRUE(ev.empty());
  }
  std::vector<DiskEviction> ev;
  ASSERT_TRUE(tier->Put("k10", {v.size(), 11, {}}, v.data(), false, &ev).ok());
  ASSERT_EQ(ev.size(), 1u);
  EXPECT_EQ(ev[0].key, "k0");
  EXPECT_EQ(ev[0].version, 1u);
  StoredObjectMeta m;
  EXPECT_TRUE(tier->GetMeta("k0", &m).IsNotFound());
  EXPECT_TRUE(tier->GetMeta("k1", &m).ok());
  EXPECT_LE(tier->used_bytes(), tier->capacity());
  // Rewriting a key makes it the newest.
  ASSERT_TRUE(tier->Put("k1", {v.size(), 12, {}}, v.data(), false, nullptr).ok());
  ev.clear();
  ASSERT_TRUE(tier->Put("k11", {v.size(), 13, {}}, v.data(), false, &ev).ok());
  ASSERT_EQ(ev.size(), 1u);
  EXPECT_EQ(ev[0].key, "k2");
}

TEST(DiskTierTest, ObjectLargerThanCapacityIsRefused) {
  testing::TempDir dir;
  auto tier = OpenTier(dir.path(), 1000);
  ASSERT_TRUE(tier);
  std::string v(2000, 'x');
  Status s = tier->Put("big", {v.size(), 1, {}}, v.data(), false, nullptr);
  EXPECT_EQ(s.code(), StatusCode::kNoSpace);
}

TEST(DiskTierTest, ReopenListsEveryKeyWithMetadata) {
  testing::TempDir dir;
  Random rng(testing::TestSeed());
  std::map<std::string, std::vector<unsigned char>> written;
  {
    auto tier = OpenTier(dir.path(), 256 << 20);
    ASSERT_TRUE(tier);
    for (int i = 0; i < 50; ++i) {
      auto bytes = rng.Bytes(rng.Uniform(0, 200000));
      std::string key = "shard/" + std::to_string(i);
      ASSERT_TRUE(
          tier->Put(key, {bytes.size(), uint64_t(100 + i), {}}, bytes.data(), i % 2 == 0, nullptr)
              .ok());
      written[key] = std::move(bytes);
    }
  }
  auto tier = OpenTier(dir.path(), 256 << 20);
  ASSERT_TRUE(tier);
  size_t listed = 0;
  ASSERT_TRUE(tier->ForEach([&](std::string_view key, const StoredObjectMeta& m) {
                    auto it = written.find(std::string(key));
                    EXPECT_NE(it, written.end());
                    if (it != written.end()) {
                      EXPECT_EQ(m.size, it->second.size());
                    }
                    listed++;
                    return true;
                  })
                  .ok());
  EXPECT_EQ(listed, written.size());
  EXPECT_EQ(tier->object_count(), written.size());
  for (auto& [key, bytes] : written) {
    StoredObjectMeta m;
    std::string value;
    ASSERT_TRUE(tier->Get(key, &m, &value).ok());
    ASSERT_EQ(value.size(), bytes.size());
    EXPECT_EQ(0, std::memcmp(value.data(), bytes.data(), bytes.size())) << key;
  }
}

TEST(DiskTierTest, DeleteIfVersionKeepsNewerWrites) {
  testing::TempDir dir;
  auto tier = OpenTier(dir.path(), 1 << 20);
  ASSERT_TRUE(tier);
  ASSERT_TRUE(tier->Put("k", {1, 5, {}}, "a", false, nullptr).ok());
  ASSERT_TRUE(tier->DeleteIfVersion("k", 4).ok());
  StoredObjectMeta m;
  EXPECT_TRUE(tier->GetMeta("k", &m).ok());
  ASSERT_TRUE(tier->DeleteIfVersion("k", 5).ok());
  EXPECT_TRUE(tier->GetMeta("k", &m).IsNotFound());
}

TEST(DiskTierTest, OpenFailsClearlyOnUnusablePath) {
  DiskTier::Options o;
  o.path = "/proc/gkv-cannot-exist/db";
  o.capacity = 1 << 20;
  auto r = DiskTier::Open(o);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kIOError);
}

// Issue 12 item 1: capacity eviction removes cache-only objects only; durable ones have their
// own budget and a durable put past it gets NoSpace (nothing written).
TEST(DiskTierTest, DurableObjectsAreNeverEvictedAndHaveTheirOwnBudget) {
  testing::TempDir dir;
  auto tier = OpenTier(dir.path(), 10 * 1002, 0.5);  // durable budget: 5 objects
  ASSERT_TRUE(tier);
  std::string v(1000, 'd');
  for (int i = 0; i < 5; ++i) {
    ASSERT_TRUE(tier->Put("d" + std::to_string(i), {v.size(), uint64_t(i + 1), {}, true}, v.data(),
                          true, nullptr)
                    .ok());
  }
  Status s = tier->Put("d5", {v.size(), 6, {}, true}, v.data(), true, nullptr);
  EXPECT_EQ(s.code(), StatusCode::kNoSpace) << s.ToString();
  StoredObjectMeta m;
  EXPECT_TRUE(tier->GetMeta("d5", &m).IsNotFound());
  // 20 cache-only objects through the remaining half: only cache-only ones are evicted.
  for (int i = 0; i < 20; ++i) {
    std::vector<DiskEviction> ev;
    ASSERT_TRUE(tier->Put("c" + std::to_string(i), {v.size(), uint64_t(100 + i), {}, false},
                          v.data(), false, &ev)
                    .ok());
    for (const auto& e : ev) EXPECT_EQ(e.key[0], 'c') << e.key;
    EXPECT_LE(tier->used_bytes(), tier->capacity());
  }
  for (int i = 0; i < 5; ++i) EXPECT_TRUE(tier->GetMeta("d" + std::to_string(i), &m).ok()) << i;
  EXPECT_TRUE(tier->GetMeta("c19", &m).ok());
  EXPECT_TRUE(tier->GetMeta("c0", &m).IsNotFound());
  EXPECT_EQ(tier->durable_bytes(), 5 * 1002u);
  // Replacing a durable object with a cache-only version moves it out of the durable budget.
  ASSERT_TRUE(tier->Put("d0", {v.size(), 200, {}, false}, v.data(), true, nullptr).ok());
  EXPECT_EQ(tier->durable_bytes(), 4 * 1002u);
  ASSERT_TRUE(tier->Put("d5", {v.size(), 201, {}, true}, v.data(), true, nullptr).ok());
  // The budget and the durability flags survive a reopen.
  tier.reset();
  tier = OpenTier(dir.path(), 10 * 1002, 0.5);
  ASSERT_TRUE(tier);
  EXPECT_EQ(tier->durable_bytes(), 5 * 1002u);
  ASSERT_TRUE(tier->GetMeta("d5", &m).ok());
  EXPECT_TRUE(m.durable);
}

TEST(DiskTierTest, CacheOnlyObjectThatCannotFitBesideDurableOnesIsRefused) {
  testing::TempDir dir;
  auto tier = OpenTier(dir.path(), 4 * 1002, 1.0);
  ASSERT_TRUE(tier);
  std::string v(1000, 'x');
  for (int i = 0; i < 4; ++i) {
    ASSERT_TRUE(tier->Put("d" + std::to_string(i), {v.size(), uint64_t(i + 1), {}, true}, v.data(),
                          true, nullptr)
                    .ok());
  }
  bool written = true;
  Status s = tier->Put("c", {v.size(), 9, {}, false}, v.data(), false, nullptr, &written);
  EXPECT_EQ(s.code(), StatusCode::kNoSpace);
  EXPECT_FALSE(written);
  EXPECT_EQ(tier->object_count(), 4u);
}

TEST(DiskTierTest, PutBatchWritesEveryItemWithItsOwnStatus) {
  testing::TempDir dir;
  auto tier = OpenTier(dir.path(), 8 * 1002, 0.5);
  ASSERT_TRUE(tier);
  std::string v(1000, 'b');
  std::vector<DiskWrite> w(6);
  const char* keys[] = {"a", "b", "a", "c", "d", "e"};
  for (size_t i = 0; i < w.size(); ++i) {
    w[i].key = keys[i];
    w[i].meta = {v.size(), uint64_t(10 + i), {}, true};
    w[i].data = v.data();
  }
  ASSERT_TRUE(tier->PutBatch(&w, true, nullptr).ok());
  EXPECT_FALSE(w[0].written);  // "a" again, with a higher version, later in the batch
  EXPECT_TRUE(w[2].written);
  for (size_t i : {1, 2, 3, 4}) EXPECT_TRUE(w[i].status.ok() && w[i].written) << i;
  EXPECT_EQ(w[5].status.code(), StatusCode::kNoSpace);  // the fifth durable object
  StoredObjectMeta m;
  ASSERT_TRUE(tier->GetMeta("a", &m).ok());
  EXPECT_EQ(m.version, 12u);
  EXPECT_TRUE(tier->GetMeta("e", &m).IsNotFound());
}

TEST(DiskTierTest, VersionMarkPersists) {
  testing::TempDir dir;
  {
    auto tier = OpenTier(dir.path(), 1 << 20);
    ASSERT_TRUE(tier);
    EXPECT_EQ(*tier->ReadVersionMark(), 0u);
    ASSERT_TRUE(tier->WriteVersionMark(uint64_t{1} << 40).ok());
  }
  auto tier = OpenTier(dir.path(), 1 << 20);
  ASSERT_TRUE(tier);
  EXPECT_EQ(*tier->ReadVersionMark(), uint64_t{1} << 40);
  size_t listed = 0;
  ASSERT_TRUE(tier->ForEach([&](std::string_view, const StoredObjectMeta&) {
                    listed++;
                    return true;
                  })
                  .ok());
  EXPECT_EQ(listed, 0u) << "the mark is not an object";
}

// The crash file system keeps exactly the synced prefix: the check that the durability tests
// built on it can fail.
TEST(DiskTierTest, SimulatedCrashKeepsSyncedWritesAndLosesUnsyncedOnes) {
  testing::TempDir dir;
  auto fs = SimulatedCrashFs::Create();
  auto tier = OpenTier(dir.path(), 1 << 20, 0.5, fs);
  ASSERT_TRUE(tier);
  ASSERT_TRUE(tier->Put("a", {1, 1, {}, false}, "a", false, nullptr).ok());
  ASSERT_TRUE(tier->Put("b", {1, 2, {}, true}, "b", true, nullptr).ok());  // syncs "a" too
  ASSERT_TRUE(tier->Put("c", {1, 3, {}, false}, "c", false, nullptr).ok());
  ASSERT_TRUE(tier->Delete("a").ok());  // unsynced: lost, so "a" stays
  EXPECT_GT(fs->unsynced_bytes(), 0u);
  fs->Crash();
  tier.reset();
  ASSERT_TRUE(fs->DropUnsyncedData().ok());
  tier = OpenTier(dir.path(), 1 << 20, 0.5);
  ASSERT_TRUE(tier);
  StoredObjectMeta m;
  EXPECT_TRUE(tier->GetMeta("a", &m).ok());
  EXPECT_TRUE(tier->GetMeta("b", &m).ok());
  EXPECT_TRUE(tier->GetMeta("c", &m).IsNotFound());
}

// Concurrent durable puts of distinct keys, and of one key: every acknowledged write is there,
// each key holds its highest version, the accounting matches a reopen.
TEST(DiskTierTest, ConcurrentPutsKeepVersionsAndAccounting) {
  testing::TempDir dir;
  auto tier = OpenTier(dir.path(), 64 << 20, 0.5);
  ASSERT_TRUE(tier);
  std::atomic<uint64_t> version{1};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      std::string v(3000 + t, 'a' + t);
      for (int i = 0; i < 50; ++i) {
        const std::string key =
            (i % 2) ? "shared" : "t" + std::to_string(t) + "/" + std::to_string(i);
        Status s =
            tier->Put(key, {v.size(), version++, {}, i % 4 == 0}, v.data(), i % 3 == 0, nullptr);
        EXPECT_TRUE(s.ok()) << s.ToString();
      }
    });
  }
  for (auto& th : threads) th.join();
  StoredObjectMeta m;
  ASSERT_TRUE(tier->GetMeta("shared", &m).ok());
  const uint64_t used = tier->used_bytes(), durable = tier->durable_bytes(),
                 count = tier->object_count();
  EXPECT_EQ(count, 4u * 25 + 1);
  tier.reset();
  tier = OpenTier(dir.path(), 64 << 20, 0.5);
  ASSERT_TRUE(tier);
  EXPECT_EQ(tier->used_bytes(), used);
  EXPECT_EQ(tier->durable_bytes(), durable);
  EXPECT_EQ(tier->object_count(), count);
}

// Writes `value` as chunks of `chunk` bytes, last chunk first (the order must not matter).
uint64_t WriteChunked(DiskTier& tier, const std::string& value, size_t chunk) {
  auto begun = tier.BeginChunks(value.size(), /*durable=*/false, nullptr);
  EXPECT_TRUE(begun.ok()) << begun.status().ToString();
  const uint64_t stream = begun.ok() ? *begun : 0;
  std::vector<size_t> offsets;
  for (size_t off = 0; off < value.size(); off += chunk) offsets.push_back(off);
  for (auto it = offsets.rbegin(); it != offsets.rend(); ++it) {
    const size_t n = std::min(chunk, value.size() - *it);
    EXPECT_TRUE(tier.WriteChunk(stream, *it, value.data() + *it, n).ok());
  }
  return stream;
}

// A value committed from chunks reads back whole; replacing it (by an ordinary value, or by
// another chunked one) or deleting it leaves no chunk behind, and its bytes count like any
// value's.
TEST(DiskTierTest, ChunkedValuesReadWholeAndLeaveNoChunksWhenReplacedOrDeleted) {
  testing::TempDir dir;
  auto tier = OpenTier(dir.path(), 64 << 20);
  ASSERT_TRUE(tier);
  Random rng(testing::TestSeed());
  auto bytes = [&](size_t n) {
    auto v = rng.Bytes(n);
    return std::string(v.begin(), v.end());
  };
  const std::string a = bytes((3 << 20) + 123), b = bytes(1 << 20), c = bytes((2 << 20) + 7);
  StoredObjectMeta m{a.size(), 5, TensorMeta{DType::kU8, {static_cast<int64_t>(a.size())}}};
  m.chunks = WriteChunked(*tier, a, 1 << 20);
  ASSERT_TRUE(tier->Put("shard", m, nullptr, true, nullptr).ok());
  StoredObjectMeta back;
  std::string value;
  ASSERT_TRUE(tier->Get("shard", &back, &value).ok());
  EXPECT_EQ(value, a);
  EXPECT_EQ(back.tensor, m.tensor);
  EXPECT_EQ(tier->used_bytes(), a.size() + 5);
  EXPECT_EQ(*tier->ChunkBytes(), a.size());

  ASSERT_TRUE(tier->Put("shard", {b.size(), 6, {}}, b.data(), false, nullptr).ok());
  ASSERT_TRUE(tier->Get("shard", &back, &value).ok());
  EXPECT_EQ(value, b);
  EXPECT_EQ(back.chunks, 0u);
  EXPECT_EQ(*tier->ChunkBytes(), 0u);

  StoredObjectMeta mc{c.size(), 7, {}};
  mc.chunks = WriteChunked(*tier, c, 512 << 10);
  ASSERT_TRUE(tier->Put("shard", mc, nullptr, false, nullptr).ok());
  ASSERT_TRUE(tier->Get("shard", &back, &value).ok());
  EXPECT_EQ(value, c);
  EXPECT_EQ(*tier->ChunkBytes(), c.size());
  EXPECT_EQ(tier->used_bytes(), c.size() + 5);

  // An older version is not written over a newer one: its chunks stay the caller's.
  StoredObjectMeta old{a.size(), 3, {}};
  old.chunks = WriteChunked(*tier, a, 1 << 20);
  EXPECT_EQ(tier->used_bytes(), c.size() + 5 + a.size());  // reserved while the stream is open
  bool written = true;
  ASSERT_TRUE(tier->Put("shard", old, nullptr, false, nullptr, &written).ok());
  EXPECT_FALSE(written);
  tier->AbortChunks(old.chunks);
  EXPECT_EQ(*tier->ChunkBytes(), c.size());
  EXPECT_EQ(tier->used_bytes(), c.size() + 5);

  ASSERT_TRUE(tier->Delete("shard").ok());
  EXPECT_TRUE(tier->Get("shard", &back, &value).IsNotFound());
  EXPECT_EQ(*tier->ChunkBytes(), 0u);
  EXPECT_EQ(tier->used_bytes(), 0u);
}

// Chunks no object owns (an aborted stream, or one a stop cut off before its commit) are gone
// after AbortChunks or the next Open; committed ones stay, and a reopened tier reads them.
TEST(DiskTierTest, UncommittedChunksAreDeletedByAbortOrTheNextOpen) {
  testing::TempDir dir;
  Random rng(testing::TestSeed());
  const auto raw = rng.Bytes(3 << 20);
  const std::string v(raw.begin(), raw.end());
  {
    auto tier = OpenTier(dir.path(), 64 << 20);
    ASSERT_TRUE(tier);
    tier->AbortChunks(WriteChunked(*tier, v, 1 << 20));
    EXPECT_EQ(*tier->ChunkBytes(), 0u);
    StoredObjectMeta m{v.size(), 9, {}, /*durable=*/true};
    m.chunks = WriteChunked(*tier, v, 1 << 20);
    ASSERT_TRUE(tier->Put("kept", m, nullptr, true, nullptr).ok());
    WriteChunked(*tier, v, 1 << 20);  // never committed
    EXPECT_EQ(*tier->ChunkBytes(), 2 * v.size());
  }
  auto tier = OpenTier(dir.path(), 64 << 20);
  ASSERT_TRUE(tier);
  EXPECT_EQ(*tier->ChunkBytes(), v.size());
  StoredObjectMeta back;
  std::string value;
  ASSERT_TRUE(tier->Get("kept", &back, &value).ok());
  EXPECT_EQ(value, v);
  EXPECT_TRUE(back.durable);
  // A stream begun after the reopen does not collide with the one it deleted.
  const uint64_t fresh = WriteChunked(*tier, v, 1 << 20);
  EXPECT_NE(fresh, back.chunks);
  EXPECT_EQ(*tier->ChunkBytes(), 2 * v.size());
}

// A stream reserves its bytes when it begins: cache-only objects are evicted to make room then,
// and a stream that cannot get room (durable objects hold it, or the durable budget is full)
// is refused before any chunk is written.
TEST(DiskTierTest, AStreamReservesItsRoomWhenItBegins) {
  testing::TempDir dir;
  auto tier = OpenTier(dir.path(), (8 << 20) + 100, 0.5);
  ASSERT_TRUE(tier);
  const std::string v(3 << 20, 'v');
  ASSERT_TRUE(tier->Put("cached", {v.size(), 1, {}, false}, v.data(), false, nullptr).ok());
  ASSERT_TRUE(tier->Put("kept", {v.size(), 2, {}, true}, v.data(), true, nullptr).ok());
  std::vector<DiskEviction> ev;
  auto s1 = tier->BeginChunks(4 << 20, /*durable=*/false, &ev);
  ASSERT_TRUE(s1.ok()) << s1.status().ToString();
  ASSERT_EQ(ev.size(), 1u);
  EXPECT_EQ(ev[0].key, "cached");
  // Durable: 3 MiB of a 4 MiB budget are taken.
  EXPECT_EQ(tier->BeginChunks(2 << 20, /*durable=*/true, nullptr).status().code(),
            StatusCode::kNoSpace);
  // The rest is held by the durable object and the open stream.
  EXPECT_EQ(tier->BeginChunks(2 << 20, /*durable=*/false, nullptr).status().code(),
            StatusCode::kNoSpace);
  tier->AbortChunks(*s1);
  EXPECT_TRUE(tier->BeginChunks(2 << 20, /*durable=*/false, nullptr).ok());
}

// Capacity eviction of a cache-only chunked object deletes its chunks with it.
TEST(DiskTierTest, EvictingAChunkedObjectDeletesItsChunks) {
  testing::TempDir dir;
  auto tier = OpenTier(dir.path(), (5 << 20) + 100);
  ASSERT_TRUE(tier);
  const std::string v(3 << 20, 'c'), w(3 << 20, 'w');
  StoredObjectMeta m{v.size(), 1, {}};
  m.chunks = WriteChunked(*tier, v, 1 << 20);
  ASSERT_TRUE(tier->Put("old", m, nullptr, false, nullptr).ok());
  std::vector<DiskEviction> ev;
  ASSERT_TRUE(tier->Put("new", {w.size(), 2, {}}, w.data(), false, &ev).ok());
  ASSERT_EQ(ev.size(), 1u);
  EXPECT_EQ(ev[0].key, "old");
  EXPECT_EQ(*tier->ChunkBytes(), 0u);
}

// The chunks are written unsynced, but a synced commit syncs them: a crash right after keeps the
// whole value.
TEST(DiskTierTest, ASyncedCommitOfChunksSurvivesACrash) {
  testing::TempDir dir;
  auto fs = SimulatedCrashFs::Create();
  Random rng(testing::TestSeed());
  const auto raw = rng.Bytes((2 << 20) + 5);
  const std::string v(raw.begin(), raw.end());
  {
    auto tier = OpenTier(dir.path(), 64 << 20, 0.5, fs);
    ASSERT_TRUE(tier);
    StoredObjectMeta m{v.size(), 4, {}, /*durable=*/true};
    m.chunks = WriteChunked(*tier, v, 1 << 20);
    ASSERT_TRUE(tier->Put("d", m, nullptr, /*sync=*/true, nullptr).ok());
    WriteChunked(*tier, v, 1 << 20);  // unsynced, uncommitted: lost or deleted
    fs->Crash();
  }
  ASSERT_TRUE(fs->DropUnsyncedData().ok());
  auto tier = OpenTier(dir.path(), 64 << 20);
  ASSERT_TRUE(tier);
  StoredObjectMeta back;
  std::string value;
  ASSERT_TRUE(tier->Get("d", &back, &value).ok());
  EXPECT_EQ(value, v);
  EXPECT_EQ(*tier->ChunkBytes(), v.size());
}

// Streams beginning (and waiting for room), committing and aborting beside puts and deletes on a
// disk that is always full: afterwards the tier's byte count is exactly what its objects hold
// (what a reopen counts). Each undo takes back only its own change, never a snapshot another
// thread's change went into while the lock was released.
TEST(DiskTierTest, ConcurrentStreamsPutsAndDeletesKeepTheAccounting) {
  testing::TempDir dir;
  auto tier = OpenTier(dir.path(), 7 << 20, 0.5);
  ASSERT_TRUE(tier);
  const std::string v(1 << 20, 'x');
  std::vector<std::thread> threads;
  std::atomic<uint64_t> next_version{1};
  for (int t = 0; t < 6; ++t) {
    threads.emplace_back([&, t] {
      Random rng(testing::TestSeed() + t);
      for (int i = 0; i < 100; ++i) {
        const std::string key = "k" + std::to_string(rng.Uniform(0, 7));
        const uint64_t version = next_version.fetch_add(1);
        switch (rng.Uniform(0, 3)) {
          case 0: {  // a stream that is committed
            const uint64_t size = rng.Uniform(1, 3) << 20;
            auto s = tier->BeginChunks(size, false, nullptr);
            if (!s.ok()) break;
            for (uint64_t off = 0; off < size; off += v.size()) {
              EXPECT_TRUE(tier->WriteChunk(*s, off, v.data(), v.size()).ok());
            }
            StoredObjectMeta m{size, version, {}};
            m.chunks = *s;
            bool written = false;
            Status ps = tier->Put(key, m, nullptr, /*sync=*/true, nullptr, &written);
            if (!ps.ok() || !written) tier->AbortChunks(*s);
            break;
          }
          case 1: {  // a stream that is abandoned
            auto s = tier->BeginChunks(2 << 20, false, nullptr);
            if (s.ok()) tier->AbortChunks(*s);
            break;
          }
          case 2:
            (void)tier->Put(key, {v.size(), version, {}}, v.data(), /*sync=*/true, nullptr);
            break;
          default:
            EXPECT_TRUE(tier->Delete(key).ok());
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  const uint64_t used = tier->used_bytes(), count = tier->object_count();
  EXPECT_LE(used, tier->capacity());
  tier.reset();
  tier = OpenTier(dir.path(), 7 << 20, 0.5);
  ASSERT_TRUE(tier);
  EXPECT_EQ(tier->used_bytes(), used);
  EXPECT_EQ(tier->object_count(), count);
}

}  // namespace
}  // namespace gkv
