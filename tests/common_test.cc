#include <gtest/gtest.h>

#include <cstring>
#include <set>

#include "gkv/bytes.h"
#include "gkv/hash.h"
#include "gkv/hybrid_clock.h"
#include "gkv/pinned_pool.h"
#include "gkv/size.h"
#include "gkv/status.h"
#include "gkv/tensor.h"

namespace gkv {
namespace {

// Client write versions: above the wall clock and everything observed, never equal between
// two clocks with different tags (two writers' puts of one key cannot tie), and a batch's
// versions one tick apart with the tag kept.
TEST(HybridClockTest, TaggedClocksNeverHandOutTheSameVersion) {
  HybridClock a(1), b(2);
  const uint64_t wall = WallClockVersion();
  const uint64_t va = a.Take();
  EXPECT_GE(va, wall & ~HybridClock::kTagMask);
  EXPECT_EQ(va & HybridClock::kTagMask, 1u);
  b.Observe(va);  // b saw a's write: its next is above it, and still ends in b's tag
  const uint64_t vb = b.Take();
  EXPECT_GT(vb, va);
  EXPECT_EQ(vb & HybridClock::kTagMask, 2u);
  a.Observe(vb);
  const uint64_t first = a.Take(3);
  EXPECT_GT(first, vb);
  EXPECT_EQ(first & HybridClock::kTagMask, 1u);
  EXPECT_GT(a.Take(), first + 2 * HybridClock::kStep);  // the batch's three are taken
  std::set<uint64_t> seen;
  for (int i = 0; i < 1000; ++i) {
    EXPECT_TRUE(seen.insert(a.Take()).second);
    EXPECT_TRUE(seen.insert(b.Take()).second);
  }
}

TEST(StatusTest, OkIsDefaultAndCarriesNoMessage) {
  Status s;
  EXPECT_TRUE(s.ok());
  EXPECT_EQ(s.ToString(), "ok");
  Status e = Status::NoSpace("tier full");
  EXPECT_FALSE(e.ok());
  EXPECT_EQ(e.code(), StatusCode::kNoSpace);
  EXPECT_EQ(e.ToString(), "no_space: tier full");
  EXPECT_EQ(e.WithContext("put k").ToString(), "no_space: put k: tier full");
}

Result<int> Half(int x) {
  if (x % 2) return Status::InvalidArgument("odd");
  return x / 2;
}

Result<int> Quarter(int x) {
  GKV_ASSIGN_OR_RETURN(int h, Half(x));
  return Half(h);
}

TEST(StatusTest, ResultPropagatesErrors) {
  EXPECT_EQ(*Quarter(8), 2);
  Result<int> r = Quarter(6);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  Result<int> from_ok = Status::OK();
  EXPECT_EQ(from_ok.status().code(), StatusCode::kInternal);
}

TEST(TensorTest, ByteSizeMustMatchShapeAndDtype) {
  TensorMeta m{DType::kF32, {2, 3}};
  EXPECT_TRUE(m.Validate(24).ok());
  EXPECT_EQ(m.Validate(23).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(m.ToString(), "f32[2,3]");
  TensorMeta bf{DType::kBF16, {4}};
  EXPECT_TRUE(bf.Validate(8).ok());
  TensorMeta scalar{DType::kF64, {}};
  EXPECT_TRUE(scalar.Validate(8).ok());
  TensorMeta empty{DType::kI8, {0, 5}};
  EXPECT_TRUE(empty.Validate(0).ok());
}

TEST(TensorTest, EveryDtypeHasItsItemSize) {
  EXPECT_EQ(ItemSize(DType::kF64), 8u);
  EXPECT_EQ(ItemSize(DType::kF32), 4u);
  EXPECT_EQ(ItemSize(DType::kF16), 2u);
  EXPECT_EQ(ItemSize(DType::kBF16), 2u);
  EXPECT_EQ(ItemSize(DType::kF8E4M3), 1u);
  EXPECT_EQ(ItemSize(DType::kF8E5M2), 1u);
  EXPECT_EQ(ItemSize(DType::kI64), 8u);
  EXPECT_EQ(ItemSize(DType::kI32), 4u);
  EXPECT_EQ(ItemSize(DType::kI16), 2u);
  EXPECT_EQ(ItemSize(DType::kI8), 1u);
  EXPECT_EQ(ItemSize(DType::kU8), 1u);
  EXPECT_EQ(ItemSize(DType::kBool), 1u);
  for (int d = 0; d <= static_cast<int>(DType::kBool); ++d) {
    auto dt = static_cast<DType>(d);
    EXPECT_EQ(*ParseDType(DTypeName(dt)), dt);
  }
  EXPECT_FALSE(ParseDType("f128").ok());
}

TEST(TensorTest, InvalidMetadataIsRefused) {
  EXPECT_FALSE((TensorMeta{DType::kF32, {1, 1, 1, 1, 1, 1, 1, 1, 1}}).Validate(4).ok());
  EXPECT_TRUE((TensorMeta{DType::kF32, {1, 1, 1, 1, 1, 1, 1, 1}}).Validate(4).ok());
  EXPECT_FALSE((TensorMeta{DType::kF32, {-1, 2}}).Validate(8).ok());
  EXPECT_FALSE((TensorMeta{DType::kRaw, {3}}).Validate(3).ok());
  // Element count overflowing 64 bits must not wrap around to a matching size.
  EXPECT_FALSE((TensorMeta{DType::kF32, {1LL << 62, 1LL << 62}}).Validate(0).ok());
  EXPECT_FALSE((TensorMeta{static_cast<DType>(99), {}}).Validate(1).ok());
}

TEST(TensorTest, ShapeParsing) {
  EXPECT_EQ(*ParseShape("2,3"), (std::vector<int64_t>{2, 3}));
  EXPECT_TRUE(ParseShape("")->empty());
  EXPECT_FALSE(ParseShape("2,,3").ok());
  EXPECT_FALSE(ParseShape("2,-3").ok());
  EXPECT_FALSE(ParseShape("1,1,1,1,1,1,1,1,1").ok());
}

TEST(BytesTest, TensorRoundTripAndTruncation) {
  std::string buf;
  ByteWriter w(&buf);
  TensorMeta m{DType::kBF16, {7, 11, 13}};
  w.Tensor(m);
  w.String("key");
  ByteReader r(buf);
  TensorMeta back;
  std::string key;
  ASSERT_TRUE(r.Tensor(&back));
  ASSERT_TRUE(r.String(&key, 100));
  EXPECT_EQ(back, m);
  EXPECT_EQ(key, "key");
  for (size_t cut = 0; cut < buf.size(); ++cut) {
    ByteReader t(buf.data(), cut);
    TensorMeta x;
    std::string k;
    bool ok = t.Tensor(&x) && t.String(&k, 100);
    EXPECT_FALSE(ok) << "cut at " << cut;
  }
}

// The wire and disk layout of integers: little-endian, exactly as wide as the type, whatever
// the host. Pinned byte for byte so a faster encoder cannot change what other versions read.
TEST(BytesTest, IntegersAreLittleEndianAndExactlyTheirWidth) {
  std::string buf;
  ByteWriter w(&buf);
  w.U8(0x01);
  w.U16(0x0302);
  w.U32(0x07060504);
  w.U64(0x0f0e0d0c0b0a0908ULL);
  w.I64(-2);
  std::string want;
  for (int b = 1; b <= 15; ++b) want.push_back(static_cast<char>(b));
  want += std::string("\xfe\xff\xff\xff\xff\xff\xff\xff", 8);
  EXPECT_EQ(buf, want);

  ByteReader r(buf);
  uint8_t a = 0;
  uint16_t b = 0;
  uint32_t c = 0;
  uint64_t d = 0;
  int64_t e = 0;
  ASSERT_TRUE(r.U8(&a) && r.U16(&b) && r.U32(&c) && r.U64(&d) && r.I64(&e));
  EXPECT_EQ(a, 0x01);
  EXPECT_EQ(b, 0x0302);
  EXPECT_EQ(c, 0x07060504u);
  EXPECT_EQ(d, 0x0f0e0d0c0b0a0908ULL);
  EXPECT_EQ(e, -2);
  EXPECT_EQ(r.remaining(), 0u);
  // Each width refuses input one byte short, reads nothing, and the reader stays failed.
  const std::string bytes = "\xaa\xbb\xcc\xdd\xee\x11\x22\x33";
  ByteReader short16(bytes.data(), 1), short32(bytes.data(), 3), short64(bytes.data(), 7);
  EXPECT_FALSE(short16.U16(&b));
  EXPECT_FALSE(short32.U32(&c));
  EXPECT_FALSE(short64.U64(&d));
  for (ByteReader* r : {&short16, &short32, &short64}) {
    EXPECT_TRUE(r->failed());
    EXPECT_FALSE(r->U8(&a));  // failed: even a byte that is there is not read
  }
  EXPECT_EQ(short16.remaining(), 1u);
  EXPECT_EQ(short32.remaining(), 3u);
  EXPECT_EQ(short64.remaining(), 7u);
}

TEST(HashTest, StableXxh3Values) {
  // Pinned so that every client and server version maps keys to the same nodes.
  EXPECT_EQ(HashKey(""), 0x2D06800538D394C2ULL);
  EXPECT_NE(HashKey("a"), HashKey("b"));
  EXPECT_EQ(HashKey("embedding/42"), HashKey(std::string("embedding/42")));
}

TEST(SizeTest, ParsesBinaryAndDecimalSuffixes) {
  EXPECT_EQ(*ParseSize("512MiB"), 512ULL << 20);
  EXPECT_EQ(*ParseSize("8GiB"), 8ULL << 30);
  EXPECT_EQ(*ParseSize("4k"), 4096u);
  EXPECT_EQ(*ParseSize("1.5GiB"), 3ULL << 29);
  EXPECT_EQ(*ParseSize("2GB"), 2000000000ULL);
  EXPECT_EQ(*ParseSize("4096"), 4096u);
  EXPECT_EQ(*ParseSize("64 mib"), 64ULL << 20);
  EXPECT_FALSE(ParseSize("").ok());
  EXPECT_FALSE(ParseSize("MiB").ok());
  EXPECT_FALSE(ParseSize("12XB").ok());
  EXPECT_FALSE(ParseSize("0.3B").ok());
  EXPECT_FALSE(ParseSize("99999999999TiB").ok());
  EXPECT_EQ(FormatSize(16ULL << 20), "16 MiB");
  EXPECT_EQ(FormatSize(512), "512 B");
}

}  // namespace
}  // namespace gkv

#include "gkv/cluster.h"
#include "gkv/random.h"

namespace gkv {
namespace {

ClusterConfig ThreeNodes() {
  auto c = ParseClusterYaml(R"(
nodes:
  - {id: a, address: 127.0.0.1:7000, weight: 1}
  - {id: b, address: 127.0.0.1:7001, weight: 2}
  - {id: c, address: "127.0.0.1:7002"}
)");
  EXPECT_TRUE(c.ok()) << c.status().ToString();
  return *c;
}

TEST(ClusterTest, ParsesNodesWeightsAndDefaults) {
  ClusterConfig c = ThreeNodes();
  ASSERT_EQ(c.nodes.size(), 3u);
  EXPECT_EQ(c.nodes[1].weight, 2.0);
  EXPECT_EQ(c.nodes[2].weight, 1.0);
  EXPECT_EQ(c.nodes[2].port, 7002);
  EXPECT_EQ(c.FindNode("b"), 1);
  EXPECT_TRUE(c.secret.empty());
}

TEST(ClusterTest, RefusesBadFiles) {
  EXPECT_FALSE(ParseClusterYaml("nodes: []").ok());
  EXPECT_FALSE(ParseClusterYaml("nodes: [{id: a}]").ok());
  EXPECT_FALSE(ParseClusterYaml("nodes: [{id: a, address: 'x:0'}]").ok());
  EXPECT_FALSE(ParseClusterYaml("nodes: [{id: a, address: 'x:1', weight: -1}]").ok());
  EXPECT_FALSE(ParseClusterYaml("nodes: [{id: a, address: 'x:1'}, {id: a, address: 'x:2'}]").ok());
  EXPECT_FALSE(ParseClusterYaml("{{{").ok());
  EXPECT_FALSE(LoadClusterFile("/nonexistent/cluster.yaml").ok());
}

TEST(HashRingTest, SharesFollowWeightsWithinFivePercent) {
  ClusterConfig c = ThreeNodes();
  HashRing ring(c.nodes);
  std::vector<int> counts(3, 0);
  const int n = 1'000'000;
  for (int i = 0; i < n; ++i) counts[ring.NodeFor("key:" + std::to_string(i))]++;
  const double total_weight = 4.0;
  for (int i = 0; i < 3; ++i) {
    double expected = c.nodes[i].weight / total_weight;
    double got = static_cast<double>(counts[i]) / n;
    EXPECT_NEAR(got / expected, 1.0, 0.05) << "node " << c.nodes[i].id << " got " << got;
  }
}

TEST(HashRingTest, RemovingANodeMovesOnlyItsKeys) {
  std::vector<NodeInfo> nodes;
  for (int i = 0; i < 5; ++i) {
    nodes.push_back({"n" + std::to_string(i), "127.0.0.1", uint16_t(7000 + i), 1.0});
  }
  HashRing before(nodes);
  std::vector<NodeInfo> fewer = nodes;
  fewer.erase(fewer.begin() + 2);
  HashRing after(fewer);
  int moved_from_others = 0, moved_from_removed = 0;
  for (int i = 0; i < 200'000; ++i) {
    std::string key = "k" + std::to_string(i);
    const std::string& was = nodes[before.NodeFor(key)].id;
    const std::string& now = fewer[after.NodeFor(key)].id;
    if (was == "n2")
      moved_from_removed++;
    else if (was != now)
      moved_from_others++;
  }
  EXPECT_EQ(moved_from_others, 0);
  EXPECT_GT(moved_from_removed, 0);
}

TEST(HashRingTest, NodesForGivesDistinctNodesOwnerFirst) {
  ClusterConfig c = ThreeNodes();
  HashRing ring(c.nodes);
  for (int i = 0; i < 1000; ++i) {
    std::string key = "r" + std::to_string(i);
    auto nodes = ring.NodesFor(key, 5);
    ASSERT_EQ(nodes.size(), 3u);
    EXPECT_EQ(nodes[0], ring.NodeFor(key));
    EXPECT_NE(nodes[0], nodes[1]);
    EXPECT_NE(nodes[1], nodes[2]);
    EXPECT_NE(nodes[0], nodes[2]);
  }
  auto shares = ring.Shares();
  EXPECT_NEAR(shares[0] + shares[1] + shares[2], 1.0, 1e-9);
}

TEST(PinnedBufferPoolTest, ReleasedBuffersAreHandedOutAgainWithinTheCap) {
  PinnedBufferPool::Options o;
  o.min_buffer = 4096;
  o.max_cached_bytes = 64 << 10;
  auto pool = PinnedBufferPool::Create(o);
  std::byte* first = nullptr;
  {
    auto a = pool->Acquire(5000);  // rounded up to 8 KiB
    ASSERT_TRUE(a.ok());
    first = a->get();
    std::memset(first, 1, 8192);  // the whole rounded-up capacity is usable
  }
  EXPECT_EQ(pool->stats().cached_bytes, 8192u);
  {
    auto b = pool->Acquire(8000);  // fits the released buffer: the same one comes back
    ASSERT_TRUE(b.ok());
    EXPECT_EQ(b->get(), first);
    auto c = pool->Acquire(8000);  // the first is in use: a new one
    ASSERT_TRUE(c.ok());
    EXPECT_NE(c->get(), first);
  }
  auto s = pool->stats();
  EXPECT_EQ(s.allocations, 2u);
  EXPECT_EQ(s.reuses, 1u);
  EXPECT_EQ(s.cached_bytes, 16384u);
  {
    // Past the cap: a 128 KiB buffer is ordinary memory, freed when released, never kept.
    auto big = pool->Acquire(100 << 10);
    ASSERT_TRUE(big.ok());
  }
  EXPECT_EQ(pool->stats().cached_bytes, 16384u);
  // A 1-byte request (4 KiB) takes a cached 8 KiB buffer: within 4x of its size.
  auto small = pool->Acquire(1);
  ASSERT_TRUE(small.ok());
  EXPECT_EQ(pool->stats().reuses, 2u);
  // TryAcquireCached never allocates: a cached buffer or nothing.
  {
    auto cached = pool->TryAcquireCached(4096);
    ASSERT_NE(cached, nullptr);
    auto none = pool->TryAcquireCached(32 << 10);  // nothing that large is cached
    EXPECT_EQ(none, nullptr);
  }
  EXPECT_EQ(pool->stats().allocations, 2u);  // the 128 KiB one was never the pool's
  // Warm caches a buffer for a size with none cached, within the cap.
  pool->Warm(16 << 10);
  EXPECT_EQ(pool->stats().allocations, 3u);
  EXPECT_NE(pool->TryAcquireCached(16 << 10), nullptr);
  // A buffer may outlive its pool.
  auto kept = pool->Acquire(4096);
  ASSERT_TRUE(kept.ok());
  pool.reset();
  std::memset(kept->get(), 2, 4096);
}

}  // namespace
}  // namespace gkv

#include <malloc.h>

#include <array>
#include <functional>
#include <thread>
#include <unordered_map>

#include "gkv/block_pool.h"
#include "gkv/ring_view.h"

namespace gkv {
namespace {

// A block given back is the next one handed out for its size class (on the same thread), so a
// hot path that makes and drops one object per request stops calling malloc.
TEST(BlockPoolTest, AFreedBlockIsReusedForItsSizeClass) {
  if (BlockPool::kKeep == 0) GTEST_SKIP() << "pooling is off under AddressSanitizer";
  void* a = BlockPool::Allocate(40);
  std::memset(a, 0xab, 40);
  BlockPool::Free(a, 40);
  EXPECT_EQ(BlockPool::Allocate(64), a) << "40 and 64 bytes share the 33-64 class";
  BlockPool::Free(a, 64);
  void* b = BlockPool::Allocate(100);  // another class: not the block above
  EXPECT_NE(b, a);
  BlockPool::Free(b, 100);
  void* big = BlockPool::Allocate(4096);  // above kMaxBlock: plain operator new
  std::memset(big, 1, 4096);
  BlockPool::Free(big, 4096);
}

// Every block of a class holds the class's largest size, whichever size it was first taken for
// (a block made for 33 bytes is later handed out for 64), and alignment is operator new's.
TEST(BlockPoolTest, EveryBlockHoldsItsWholeClass) {
  std::thread fresh([] {  // a thread of its own: its lists start empty
    std::vector<void*> blocks;
    for (int i = 0; i < 300; ++i) blocks.push_back(BlockPool::Allocate(33 + i % 32));
    for (void* b : blocks) {
      EXPECT_GE(malloc_usable_size(b), BlockPool::kKeep == 0 ? 33u : 64u);
      EXPECT_EQ(reinterpret_cast<uintptr_t>(b) % __STDCPP_DEFAULT_NEW_ALIGNMENT__, 0u);
    }
    for (size_t i = 0; i < blocks.size(); ++i) BlockPool::Free(blocks[i], 33 + i % 32);
  });
  fresh.join();
}

// Blocks dropped while a thread exits, after its pool is gone (another thread_local's
// destructor), are freed (not kept on the destroyed lists): the memory comes back. Fewer blocks
// than a thread keeps per class, of a class nothing else here uses, so a pool that kept them
// would neither spill them to the shared lists nor have taken them from there.
TEST(BlockPoolTest, BlocksDroppedAfterAThreadsPoolIsGoneAreFreed) {
  struct Large {
    char bytes[440];  // with its control block, the 449-480 byte class
  };
  struct DropsLate {
    std::vector<std::shared_ptr<Large>> held;
    ~DropsLate() { held.clear(); }
  };
  constexpr int kHeld = 200;  // under kKeep: a pool that kept them would keep them all
  static_assert(kHeld < 256);
  auto in_use = [] { return mallinfo2().uordblks; };
  const size_t before = in_use();
  std::thread t([] {
    static thread_local DropsLate late;  // constructed first, so destroyed after the pool
    late.held.reserve(kHeld);
    for (int i = 0; i < kHeld; ++i) late.held.push_back(MakePooledShared<Large>());
  });
  t.join();
  const size_t after = in_use();
  // Kept, they would be 200 x 480 bytes (94 KiB) still in use.
  EXPECT_LT(after, before + 32 * 1024) << "blocks dropped after the pool went were kept";
}

// Closures a std::function keeps on the heap, shared_ptrs and containers on PoolAllocator work
// as usual, with blocks made on one thread and dropped on another (a caller's request finished
// by the I/O thread), in both directions, without losing or sharing a block (TSan covers it).
TEST(BlockPoolTest, BlocksMadeOnOneThreadAndDroppedOnAnotherStayWhole) {
  constexpr int kRounds = 20000;
  std::vector<std::function<uint64_t()>> made(kRounds);
  std::vector<std::shared_ptr<std::string>> shared(kRounds);
  std::thread producer([&] {
    for (int i = 0; i < kRounds; ++i) {
      auto s = MakePooledShared<std::string>(std::to_string(i));
      made[i] = Pooled([s, i, pad = std::array<uint64_t, 6>{}]() -> uint64_t {
        return std::stoull(*s) + static_cast<uint64_t>(i) + pad[5];
      });
      shared[i] = std::move(s);
    }
  });
  producer.join();
  std::unordered_map<uint64_t, std::shared_ptr<std::string>, std::hash<uint64_t>,
                     std::equal_to<uint64_t>,
                     PoolAllocator<std::pair<const uint64_t, std::shared_ptr<std::string>>>>
      map;
  std::thread consumer([&] {
    for (int i = 0; i < kRounds; ++i) {
      ASSERT_EQ(made[i](), 2u * i);
      map.emplace(i, std::move(shared[i]));
      made[i] = nullptr;  // frees the closure's block here, on the consumer
      if (i % 3 == 0) map.erase(i);
    }
  });
  consumer.join();
  for (const auto& [k, v] : map) ASSERT_EQ(*v, std::to_string(k));
  EXPECT_EQ(map.size(), static_cast<size_t>(kRounds - (kRounds + 2) / 3));
}

TEST(RingViewTest, OwnersIntoAVectorAreDistinctOwnerFirst) {
  std::vector<NodeInfo> nodes;
  for (int i = 0; i < 5; ++i) {
    nodes.push_back(
        NodeInfo{"n" + std::to_string(i), "127.0.0.1", static_cast<uint16_t>(1000 + i), 1.0});
  }
  RingView ring(1, nodes, {4, 3, 2, 1, 0}, 5);
  std::vector<int, PoolAllocator<int>> into;
  for (int k = 0; k < 200; ++k) {
    const std::string key = "key" + std::to_string(k);
    into.push_back(99);  // cleared first
    ring.Owners(key, 3, &into);
    ASSERT_EQ(into.size(), 3u) << key;
    ASSERT_EQ(into[0], ring.Owner(key)) << key;
    ASSERT_TRUE(into[0] != into[1] && into[0] != into[2] && into[1] != into[2]) << key;
    for (int n : into) ASSERT_TRUE(n >= 0 && n < 5) << key;
  }
}

}  // namespace
}  // namespace gkv

#include <dlfcn.h>

#include "gkv/cuda.h"

namespace gkv {
namespace {

// Without a usable GPU the probe says why in words a user acts on: no driver at all, or one
// too old for the CUDA runtime gkv was built with (the runtime calls both "insufficient
// driver"). Skips where a GPU answers, or where gkv was built without CUDA.
TEST(CudaProbeTest, AMissingDriverIsToldApartFromAnOldOne) {
  const CudaProbe& probe = ProbeCuda();
  if (probe.usable || !probe.compiled_in) {
    GTEST_SKIP() << "needs a build with CUDA on a machine where it is not usable";
  }
  void* driver = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_LOCAL);
  if (driver == nullptr) {
    EXPECT_NE(probe.reason.find("no NVIDIA driver"), std::string::npos) << probe.reason;
  } else {
    dlclose(driver);
    EXPECT_EQ(probe.reason.find("no NVIDIA driver"), std::string::npos) << probe.reason;
  }
}

}  // namespace
}  // namespace gkv
