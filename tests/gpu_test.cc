// Tests of the real CUDA arena and device copies. They skip with a reason on machines without a
// usable GPU and run in scripts/gpu-check.sh on a GPU machine.
#include <gtest/gtest.h>

#include <cstdlib>

#include "gkv/cache/tiered_cache.h"
#include "gkv/cuda.h"
#include "gkv/random.h"
#include "gkv/storage/memory_arena.h"
#include "test_util.h"

namespace gkv {
namespace {

class GpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (ProbeCuda().usable) return;
    // On the GPU machine (scripts/gpu-check.sh run sets GKV_REQUIRE_GPU) a missing GPU is a
    // broken setup and must fail, not skip.
    if (std::getenv("GKV_REQUIRE_GPU")) FAIL() << "GKV_REQUIRE_GPU is set: " << ProbeCuda().reason;
    GTEST_SKIP() << "no usable GPU: " << ProbeCuda().reason;
  }
};

TEST_F(GpuTest, DeviceArenaAllocatesDeviceMemory) {
  auto arena = MemoryArena::CreateDevice(0, 64 << 20);
  ASSERT_TRUE(arena.ok()) << arena.status().ToString();
  EXPECT_EQ((*arena)->kind(), MemoryKind::kDevice);
  std::byte* p = (*arena)->Allocate(1 << 20);
  ASSERT_NE(p, nullptr);
  EXPECT_TRUE(IsDevicePointer(p));
  (*arena)->Free(p);
}

TEST_F(GpuTest, PinnedHostPoolIsPinned) {
  auto arena = MemoryArena::CreateHost(64 << 20, MemoryArena::HostMode::kPinned);
  ASSERT_TRUE(arena.ok()) << arena.status().ToString();
  EXPECT_TRUE((*arena)->pinned());
}

TEST_F(GpuTest, SpillAndPromotionThroughRealGpuTierKeepBytes) {
  testing::TempDir dir;
  CacheOptions o;
  o.gpu_capacity = 8 << 20;
  o.host_capacity = 16 << 20;
  o.disk_path = dir.path();
  o.disk_capacity = 256 << 20;
  auto c = TieredCache::Open(o);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  ASSERT_TRUE((*c)->tier_enabled(Tier::kGpu));
  Random rng(testing::TestSeed());
  std::vector<std::string> values;
  for (int i = 0; i < 24; ++i) {
    std::string v(1 << 20, '\0');
    rng.Fill(v.data(), v.size());
    ASSERT_TRUE((*c)->Put("k" + std::to_string(i), v.data(), v.size()).ok());
    values.push_back(std::move(v));
  }
  auto st = (*c)->GetStats();
  EXPECT_GT(st.moves[0][1], 0u);
  EXPECT_GT(st.moves[1][2], 0u);
  for (int round = 0; round < 2; ++round) {
    for (int i = 0; i < 24; ++i) {
      std::string out;
      ASSERT_TRUE((*c)->Get("k" + std::to_string(i), &out).ok());
      ASSERT_EQ(out, values[i]) << i;
    }
  }
  // Put from and get into device memory.
  auto dev = MemoryArena::CreateDevice(0, 4 << 20);
  ASSERT_TRUE(dev.ok());
  std::byte* src = (*dev)->Allocate(1 << 20);
  std::byte* dst = (*dev)->Allocate(1 << 20);
  ASSERT_TRUE(
      (*c)->CopyBytes(src, MemoryKind::kDevice, values[0].data(), MemoryKind::kHost, 1 << 20).ok());
  ASSERT_TRUE((*c)->Put("from-device", src, 1 << 20, {}, false, MemoryKind::kDevice).ok());
  ASSERT_TRUE((*c)->GetInto("from-device", dst, 1 << 20, MemoryKind::kDevice).ok());
  std::string back(1 << 20, '\0');
  ASSERT_TRUE(
      (*c)->CopyBytes(back.data(), MemoryKind::kHost, dst, MemoryKind::kDevice, 1 << 20).ok());
  EXPECT_EQ(back, values[0]);
}

}  // namespace
}  // namespace gkv
