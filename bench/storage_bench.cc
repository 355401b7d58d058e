// gkv-storage-bench: microbenchmarks of the node cache (Google Benchmark).
//
//   Memcpy/SIZE                    host memcpy: the ceiling for the host-memory tiers
//   CacheFixture/PutGpuTier/SIZE   put into the GPU tier (a host-memory stand-in without a GPU)
//   CacheFixture/PutHostTier/SIZE  put into the host tier
//   CacheFixture/GetGpuTier/SIZE   get (copy out) of an object in the GPU tier
//   CacheFixture/GetHostTier/SIZE  get of an object in the host tier
//   CacheFixture/GetDiskTier/SIZE  get of an object in the disk tier (RocksDB), no promotion
//   Allocator/AllocateFree         RangeAllocator allocate+free pairs with random sizes
//   SpillHostToDisk/SIZE           puts into a full host tier: each spills one object to RocksDB
//   PromoteDiskToHost/SIZE         second reads of disk objects: RocksDB read + move to host
//   DurablePut/SIZE/threads:N      durable puts (synced write-through) of distinct keys, N threads
//   DurablePutBatch/SIZE           durable CommitBatch of 64 objects (one RocksDB write, one sync)
//   FastPathThreads/P/threads:N    fast-path gets of 64 B objects from N threads
//                                  (P=1: one operation in 8 is a put; P=2: keys of 40 bytes,
//                                  longer than std::string's inline buffer)
//   FastPuts/partitions:P/threads:N  fast-path puts of 64 B objects from N threads, the cache
//                                  in P placement partitions
//   IndexOverhead                  heap bytes of index metadata per cached object (measured)
//   Gpu* (only with a usable GPU)  cudaMemcpy H2D/D2H next to GPU put/get, GPU->host spill and
//                                  host->GPU promotion
// Run: build/bin/gkv-storage-bench [--benchmark_filter=REGEX]
#include <benchmark/benchmark.h>
#include <malloc.h>

#include <cstring>
#include <filesystem>

#include "gkv/cache/tiered_cache.h"
#include "gkv/cuda.h"
#include "gkv/random.h"
#include "gkv/storage/memory_arena.h"
#include "gkv/storage/range_allocator.h"

namespace gkv {
namespace {

const std::vector<int64_t> kSizes = {4 << 10, 64 << 10, 1 << 20, 16 << 20};

std::string TempPath(const char* name) {
  auto p = std::filesystem::temp_directory_path() /
           ("gkv-bench-" + std::string(name) + "-" + std::to_string(getpid()));
  std::filesystem::remove_all(p);
  return p.string();
}

std::unique_ptr<TieredCache> OpenCache(const CacheOptions& o) {
  auto c = TieredCache::Open(o);
  if (!c.ok()) {
    fprintf(stderr, "cache open failed: %s\n", c.status().ToString().c_str());
    std::abort();
  }
  return std::move(*c);
}

std::unique_ptr<TieredCache> OpenCache(
    uint64_t gpu, uint64_t host, const std::string& disk, uint64_t disk_cap, bool real_gpu = false,
    std::chrono::milliseconds window = std::chrono::milliseconds(0)) {
  CacheOptions o;
  o.gpu_capacity = gpu;
  o.gpu_tier_in_host_memory = !real_gpu;
  o.host_capacity = host;
  o.disk_path = disk;
  o.disk_capacity = disk_cap;
  o.promotion_window = window;
  return OpenCache(o);
}

void SetBytes(benchmark::State& state, int64_t size) {
  state.SetBytesProcessed(state.iterations() * size);
}

void BM_Memcpy(benchmark::State& state) {
  const size_t size = state.range(0);
  std::vector<char> a(size, 1), b(size);
  for (auto _ : state) {
    std::memcpy(b.data(), a.data(), size);
    benchmark::DoNotOptimize(b.data());
    benchmark::ClobberMemory();
  }
  SetBytes(state, size);
}
BENCHMARK(BM_Memcpy)->ArgsProduct({kSizes});

// Put: 8 keys rotated, tier sized to hold them all (overwrites free the previous version).
void PutBench(benchmark::State& state, Tier tier) {
  const uint64_t size = state.range(0);
  const uint64_t cap = 16 * size + (1 << 20);
  auto c = tier == Tier::kGpu ? OpenCache(cap, 0, "", 0) : OpenCache(0, cap, "", 0);
  std::string v(size, '\0');
  Random(1).Fill(v.data(), size);
  int i = 0;
  for (auto _ : state) {
    auto r = c->Put("k" + std::to_string(i++ & 7), v.data(), size);
    if (!r.ok()) state.SkipWithError(r.status().ToString().c_str());
  }
  SetBytes(state, size);
}
void BM_PutGpuTier(benchmark::State& s) { PutBench(s, Tier::kGpu); }
void BM_PutHostTier(benchmark::State& s) { PutBench(s, Tier::kHost); }
BENCHMARK(BM_PutGpuTier)->ArgsProduct({kSizes});
BENCHMARK(BM_PutHostTier)->ArgsProduct({kSizes});

void GetBench(benchmark::State& state, Tier tier) {
  const uint64_t size = state.range(0);
  std::string disk = tier == Tier::kDisk ? TempPath("get") : "";
  std::unique_ptr<TieredCache> c;
  if (tier == Tier::kGpu) c = OpenCache(4 * size + (1 << 20), 0, "", 0);
  if (tier == Tier::kHost) c = OpenCache(0, 4 * size + (1 << 20), "", 0);
  if (tier == Tier::kDisk) c = OpenCache(0, 0, disk, 1ULL << 30);
  std::string v(size, '\0');
  Random(2).Fill(v.data(), size);
  for (int i = 0; i < 4; ++i) (void)c->Put("k" + std::to_string(i), v.data(), size);
  std::string out(size, '\0');
  int i = 0;
  for (auto _ : state) {
    auto r = c->GetInto("k" + std::to_string(i++ & 3), out.data(), size);
    if (!r.ok() || r->tier != tier) state.SkipWithError("get failed or wrong tier");
  }
  SetBytes(state, size);
  c.reset();
  if (!disk.empty()) std::filesystem::remove_all(disk);
}
void BM_GetGpuTier(benchmark::State& s) { GetBench(s, Tier::kGpu); }
void BM_GetHostTier(benchmark::State& s) { GetBench(s, Tier::kHost); }
void BM_GetDiskTier(benchmark::State& s) { GetBench(s, Tier::kDisk); }
BENCHMARK(BM_GetGpuTier)->ArgsProduct({kSizes});
BENCHMARK(BM_GetHostTier)->ArgsProduct({kSizes});
BENCHMARK(BM_GetDiskTier)->ArgsProduct({kSizes});

void BM_AllocatorAllocateFree(benchmark::State& state) {
  RangeAllocator a(1ULL << 30);
  Random rng(3);
  std::vector<uint64_t> live;
  // Keep ~1000 blocks live so the free lists have real structure.
  for (int i = 0; i < 1000; ++i) live.push_back(*a.Allocate(rng.Uniform(1, 1 << 20)));
  size_t j = 0;
  for (auto _ : state) {
    size_t idx = (j++ * 7919) % live.size();
    a.Free(live[idx]);
    auto off = a.Allocate(rng.Uniform(1, 1 << 20));
    if (!off) state.SkipWithError("allocation failed");
    live[idx] = *off;
  }
  state.counters["free_blocks"] = a.free_block_count();
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_AllocatorAllocateFree);

void BM_SpillHostToDisk(benchmark::State& state) {
  const uint64_t size = state.range(0);
  const std::string disk = TempPath("spill");
  auto c = OpenCache(0, 8 * size + (1 << 20), disk, 64ULL << 30);
  std::string v(size, '\0');
  Random(4).Fill(v.data(), size);
  uint64_t i = 0;
  for (; i < 8; ++i) (void)c->Put("k" + std::to_string(i), v.data(), size);
  const uint64_t before = c->GetStats().moved_bytes[1][2];
  for (auto _ : state) {
    auto r = c->Put("k" + std::to_string(i++), v.data(), size);
    if (!r.ok()) state.SkipWithError(r.status().ToString().c_str());
  }
  state.counters["spilled_MiB"] = (c->GetStats().moved_bytes[1][2] - before) / 1048576.0;
  SetBytes(state, size);
  c.reset();
  std::filesystem::remove_all(disk);
}
BENCHMARK(BM_SpillHostToDisk)->ArgsProduct({kSizes})->UseRealTime();

void BM_PromoteDiskToHost(benchmark::State& state) {
  const uint64_t size = state.range(0);
  const std::string disk = TempPath("promote");
  // Host holds 4 objects; 64 live on disk. Each measured get is the second read of a disk
  // object (so it is promoted); the entry it displaces is already on disk and leaves for free.
  auto c = OpenCache(0, 4 * size + (1 << 20), disk, 64ULL << 30, false,
                     std::chrono::milliseconds(3'600'000));
  std::string v(size, '\0');
  Random(5).Fill(v.data(), size);
  const int n = 64;
  for (int i = 0; i < n; ++i) (void)c->Put("k" + std::to_string(i), v.data(), size);
  (void)c->Flush();
  std::string out(size, '\0');
  for (int i = 0; i < n; ++i) (void)c->GetInto("k" + std::to_string(i), out.data(), size);
  int i = 0;
  for (auto _ : state) {
    state.PauseTiming();
    std::string key = "k" + std::to_string(i++ % n);
    auto st = c->Stat(key);
    bool on_disk = st.ok() && st->tier == Tier::kDisk;
    if (!on_disk) (void)c->GetInto(key, out.data(), size);  // not measured: a memory hit
    state.ResumeTiming();
    auto r = c->GetInto(key, out.data(), size);
    if (!r.ok()) state.SkipWithError(r.status().ToString().c_str());
  }
  auto st = c->GetStats();
  state.counters["promotions"] = st.moves[2][1];
  SetBytes(state, size);
  c.reset();
  std::filesystem::remove_all(disk);
}
BENCHMARK(BM_PromoteDiskToHost)->ArgsProduct({{64 << 10, 1 << 20}})->UseRealTime();

// Heap bytes per object of index metadata (entry, key, map node, LRU node, shared_ptr block),
// measured with mallinfo2 across 100,000 puts of 1-byte values with 16-byte keys.
// Durable puts: every put is a synced RocksDB write. With several threads, the writes of
// concurrent puts can share one fsync (RocksDB group commit) unless the disk tier serializes
// them. Memory-tier room for everything: no spills, no eviction.
std::unique_ptr<TieredCache> durable_cache;
std::string durable_path;

void DurableSetup(const benchmark::State&) {
  durable_path = TempPath("durable");
  durable_cache = OpenCache(0, 1ull << 30, durable_path, 8ull << 30);
}
void DurableTeardown(const benchmark::State&) {
  durable_cache.reset();
  std::filesystem::remove_all(durable_path);
}

void BM_DurablePut(benchmark::State& state) {
  const uint64_t size = state.range(0);
  std::string v(size, '\0');
  Random(state.thread_index() + 1).Fill(v.data(), size);
  const std::string prefix = "t" + std::to_string(state.thread_index()) + "/";
  uint64_t i = 0;
  for (auto _ : state) {
    // 256 keys per thread, rotated: overwrites of a durable key stay durable writes.
    auto r = durable_cache->Put(prefix + std::to_string(i++ % 256), v.data(), size, {}, true);
    if (!r.ok()) state.SkipWithError(r.status().ToString().c_str());
  }
  state.SetItemsProcessed(state.iterations());
  SetBytes(state, size);
}
BENCHMARK(BM_DurablePut)
    ->Arg(4 << 10)
    ->ThreadRange(1, 4)
    ->UseRealTime()
    ->Setup(DurableSetup)
    ->Teardown(DurableTeardown);

void BM_DurablePutBatch(benchmark::State& state) {
  const uint64_t size = state.range(0);
  constexpr int kBatch = 64;
  std::string v(size, '\0');
  Random(7).Fill(v.data(), size);
  uint64_t i = 0;
  for (auto _ : state) {
    std::vector<WriteHandle> hs;
    for (int k = 0; k < kBatch; ++k) {
      auto h = durable_cache->Reserve("b/" + std::to_string(i++ % 1024), size, {});
      if (!h.ok()) state.SkipWithError(h.status().ToString().c_str());
      std::memcpy(h->data(), v.data(), size);
      hs.push_back(std::move(*h));
    }
    for (auto& r : durable_cache->CommitBatch(std::move(hs), true)) {
      if (!r.ok()) state.SkipWithError(r.status().ToString().c_str());
    }
  }
  state.SetItemsProcessed(state.iterations() * kBatch);
  SetBytes(state, size * kBatch);
}
BENCHMARK(BM_DurablePutBatch)
    ->Arg(4 << 10)
    ->UseRealTime()
    ->Setup(DurableSetup)
    ->Teardown(DurableTeardown);

// The node's I/O-thread paths from N threads on one cache: fast-path gets (TryAcquireFromMemory
// and release) of 64 B host-tier objects, and with Arg 1 one put (TryReserveInMemory +
// TryCommitInMemory) in every 8 operations; Arg 2 reads keys of 40 bytes (what a key past the
// small-string buffer costs a read). What readers on different threads share shows here.
std::unique_ptr<TieredCache> fast_cache;
std::vector<std::string> fast_keys;

// Makes `cache` the fast-path benchmarks' cache, holding 4096 keys of 64 B (keys of 40 bytes
// when `long_keys`).
void SetFastCache(std::unique_ptr<TieredCache> cache, bool long_keys = false) {
  fast_cache = std::move(cache);
  fast_keys.clear();
  std::string v(64, 'v');
  for (int i = 0; i < 4096; ++i) {
    const std::string n = std::to_string(i);
    fast_keys.push_back(long_keys
                            ? "embeddings/user-table/row/" + std::string(14 - n.size(), '0') + n
                            : "key/" + n);
    (void)fast_cache->Put(fast_keys.back(), v.data(), v.size());
  }
}

void FastSetup(const benchmark::State& state) {
  SetFastCache(OpenCache(0, 64ull << 20, "", 0), state.range(0) == 2);
}
void FastTeardown(const benchmark::State&) {
  fast_cache.reset();
  fast_keys.clear();
}

void BM_FastPathThreads(benchmark::State& state) {
  const bool with_puts = state.range(0) == 1;
  Random rng(state.thread_index() + 11);
  std::string v(64, 'p');
  ReadHandle rh;
  WriteHandle wh;
  uint64_t i = 0, slow = 0;
  for (auto _ : state) {
    const std::string& key = fast_keys[rng.Uniform(0, fast_keys.size() - 1)];
    if (with_puts && (++i & 7) == 0) {
      uint64_t version = 0;
      if (fast_cache->TryReserveInMemory(key, v.size(), {}, &wh) ==
          TieredCache::FastPath::kServed) {
        std::memcpy(wh.data(), v.data(), v.size());
        (void)fast_cache->TryCommitInMemory(&wh, &version);
      }
      continue;
    }
    const auto got = fast_cache->TryAcquireFromMemory(key, &rh, false);
    if (got == TieredCache::FastPath::kMiss) {
      state.SkipWithError("a fast get missed");
      break;
    }
    // (kNeedsSlowPath: the key was being replaced at that moment; a node would take its slow
    // path, counted here.)
    if (got == TieredCache::FastPath::kNeedsSlowPath) ++slow;
    benchmark::DoNotOptimize(rh.data());
    rh = ReadHandle();
  }
  state.SetItemsProcessed(state.iterations());
  state.counters["slow_path"] = benchmark::Counter(slow, benchmark::Counter::kAvgIterations);
}
BENCHMARK(BM_FastPathThreads)
    ->Arg(0)
    ->Arg(1)
    ->Arg(2)
    ->ThreadRange(1, 4)
    ->UseRealTime()
    ->Setup(FastSetup)
    ->Teardown(FastTeardown);

// Fast-path puts only (TryReserveInMemory, 64 B copy, TryCommitInMemory: what an I/O thread does
// for a small PUT) of 4096 keys from N threads, the cache in P placement partitions: with P = 1
// every put takes the one placement lock twice; with P > 1 puts of keys in different partitions
// take different locks. (On a machine with fewer cores than threads, the threads mostly take
// turns, and the figures show the locking's instruction cost more than its contention.)
void FastPutSetup(const benchmark::State& state) {
  CacheOptions o;
  o.host_capacity = 64ull << 20;
  o.host_mode = MemoryArena::HostMode::kPageable;
  o.placement_partitions = static_cast<int>(state.range(0));
  SetFastCache(OpenCache(o));
}

void BM_FastPuts(benchmark::State& state) {
  Random rng(state.thread_index() + 17);
  std::string v(64, 'p');
  WriteHandle wh;
  uint64_t slow = 0;
  for (auto _ : state) {
    const std::string& key = fast_keys[rng.Uniform(0, fast_keys.size() - 1)];
    uint64_t version = 0;
    if (fast_cache->TryReserveInMemory(key, v.size(), {}, &wh) == TieredCache::FastPath::kServed) {
      std::memcpy(wh.data(), v.data(), v.size());
      if (fast_cache->TryCommitInMemory(&wh, &version) != TieredCache::FastPath::kServed) ++slow;
      wh = WriteHandle();
    } else {
      ++slow;
    }
  }
  state.SetItemsProcessed(state.iterations());
  state.counters["slow_path"] = benchmark::Counter(slow, benchmark::Counter::kAvgIterations);
}
BENCHMARK(BM_FastPuts)
    ->ArgName("partitions")
    ->Arg(1)
    ->Arg(4)
    ->ThreadRange(1, 4)
    ->UseRealTime()
    ->Setup(FastPutSetup)
    ->Teardown(FastTeardown);

void BM_IndexOverhead(benchmark::State& state) {
  for (auto _ : state) {
    auto c = OpenCache(0, 256ULL << 20, "", 0);
    const int n = 100'000;
    std::vector<std::string> keys;
    for (int i = 0; i < n; ++i) {
      char k[17];
      snprintf(k, sizeof k, "key-%012d", i);
      keys.emplace_back(k);
    }
    malloc_trim(0);
    const size_t before = mallinfo2().uordblks;
    for (int i = 0; i < n; ++i) (void)c->Put(keys[i], "x", 1);
    const size_t after = mallinfo2().uordblks;
    state.counters["bytes_per_object"] = double(after - before) / n;
    state.counters["arena_bytes_per_object"] = double(c->GetStats().tiers[1].used_bytes) / n;
  }
}
BENCHMARK(BM_IndexOverhead)->Iterations(1)->Unit(benchmark::kMillisecond);

// ---------------- GPU (registered only with a usable GPU) ----------------

void BM_GpuCudaMemcpy(benchmark::State& state) {
  // range(1): 0 = host->device, 1 = device->host, 2 = device->device.
  const uint64_t size = state.range(0);
  auto host = MemoryArena::CreateHost(size + 4096, MemoryArena::HostMode::kPinned);
  auto dev = MemoryArena::CreateDevice(0, 2 * size + 4096);
  auto copier = DeviceCopier::Create(0);
  if (!host.ok() || !dev.ok() || !copier.ok()) return state.SkipWithError("CUDA setup failed");
  std::byte* h = (*host)->Allocate(size);
  std::byte* d1 = (*dev)->Allocate(size);
  std::byte* d2 = (*dev)->Allocate(size);
  for (auto _ : state) {
    Status s = state.range(1) == 0   ? (*copier)->Copy(d1, h, size)
               : state.range(1) == 1 ? (*copier)->Copy(h, d1, size)
                                     : (*copier)->Copy(d2, d1, size);
    if (!s.ok()) state.SkipWithError(s.ToString().c_str());
  }
  SetBytes(state, size);
}

void BM_GpuPutFromHost(benchmark::State& state) {
  const uint64_t size = state.range(0);
  auto c = OpenCache(16 * size + (1 << 20), 0, "", 0, true);
  std::string v(size, 'g');
  int i = 0;
  for (auto _ : state) (void)c->Put("k" + std::to_string(i++ & 7), v.data(), size);
  SetBytes(state, size);
}

void BM_GpuGetToHost(benchmark::State& state) {
  const uint64_t size = state.range(0);
  auto c = OpenCache(8 * size + (1 << 20), 0, "", 0, true);
  std::string v(size, 'g'), out(size, '\0');
  for (int i = 0; i < 4; ++i) (void)c->Put("k" + std::to_string(i), v.data(), size);
  int i = 0;
  for (auto _ : state) (void)c->GetInto("k" + std::to_string(i++ & 3), out.data(), size);
  SetBytes(state, size);
}

void BM_GpuSpillToHost(benchmark::State& state) {
  const uint64_t size = state.range(0);
  auto c = OpenCache(4 * size + (1 << 20), 1ULL << 33, "", 0, true);
  std::string v(size, 'g');
  uint64_t i = 0;
  for (; i < 4; ++i) (void)c->Put("k" + std::to_string(i), v.data(), size);
  for (auto _ : state) {
    // Each put evicts one GPU object to host (the put's own H2D copy is included).
    (void)c->Put("k" + std::to_string(i++), v.data(), size);
    if (i % 256 == 0) {
      state.PauseTiming();
      for (uint64_t k = i - 256; k < i - 8; ++k) (void)c->Delete("k" + std::to_string(k));
      state.ResumeTiming();
    }
  }
  state.counters["spills"] = c->GetStats().moves[0][1];
  SetBytes(state, size);
}

void BM_GpuPromoteFromHost(benchmark::State& state) {
  const uint64_t size = state.range(0);
  auto c =
      OpenCache(2 * size + (1 << 20), 64 * size, "", 0, true, std::chrono::milliseconds(3'600'000));
  std::string v(size, 'g'), out(size, '\0');
  const int n = 32;
  for (int i = 0; i < n; ++i) (void)c->Put("k" + std::to_string(i), v.data(), size);
  int i = 0;
  for (auto _ : state) {
    // Reads cycle over 32 keys with room for 2 on the GPU: each read's second visit promotes.
    (void)c->GetInto("k" + std::to_string(i++ % n), out.data(), size);
  }
  state.counters["promotions"] = c->GetStats().moves[1][0];
  SetBytes(state, size);
}

void RegisterGpuBenchmarks() {
  if (!ProbeCuda().usable) {
    fprintf(stderr, "gkv-storage-bench: GPU benchmarks skipped: %s\n", ProbeCuda().reason.c_str());
    return;
  }
  for (int64_t size : kSizes) {
    for (int dir = 0; dir < 3; ++dir) {
      benchmark::RegisterBenchmark("BM_GpuCudaMemcpy", BM_GpuCudaMemcpy)->Args({size, dir});
    }
    benchmark::RegisterBenchmark("BM_GpuPutFromHost", BM_GpuPutFromHost)->Arg(size);
    benchmark::RegisterBenchmark("BM_GpuGetToHost", BM_GpuGetToHost)->Arg(size);
    benchmark::RegisterBenchmark("BM_GpuSpillToHost", BM_GpuSpillToHost)->Arg(size);
    benchmark::RegisterBenchmark("BM_GpuPromoteFromHost", BM_GpuPromoteFromHost)->Arg(size);
  }
}

}  // namespace
}  // namespace gkv

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  gkv::RegisterGpuBenchmarks();
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
