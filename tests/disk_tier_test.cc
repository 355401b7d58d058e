#include <gtest/gtest.h>

#include "gkv/random.h"
#include "gkv/storage/disk_tier.h"
#include "test_util.h"

namespace gkv {
namespace {

std::unique_ptr<DiskTier> OpenTier(const std::string& path, uint64_t capacity) {
  DiskTier::Options o;
  o.path = path;
  o.capacity = capacity;
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

}  // namespace
}  // namespace gkv
