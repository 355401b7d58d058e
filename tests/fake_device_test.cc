// The device branches of server, client and transport, run without a GPU (issue 10 item 7).
// This process and the nodes it starts run in fake-device mode (GKV_FAKE_DEVICE=1, gkv/cuda.h):
// "device" memory is host memory the CUDA boundary remembers, every copy checks that the
// memory kinds it is given are what the pointers are, and UCX cannot move device memory, so
// every staging path runs: puts from and gets into device buffers, single and batched, with
// every byte checked; objects in the nodes' GPU tiers (device memory) served, spilled and
// promoted; hot-key copies in a replica's GPU tier served.
#include <gtest/gtest.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <future>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "cluster_harness.h"
#include "gkv/cuda.h"
#include "gkv/random.h"

namespace gkv {
namespace {

using testing::Cluster;
using testing::KeyOn;
using testing::NodeSpec;
using testing::StatsCounter;

// Before main (and before anything asks gkv/cuda.h), so this process and its children run in
// fake-device mode: "1" (UCX cannot move device memory, the staging paths) unless the
// environment already chose a flavour (ctest runs these again with "ucx": the direct paths).
const bool kFakeDevice = [] {
  setenv("GKV_FAKE_DEVICE", "1", /*overwrite=*/0);
  return true;
}();

// A "device" buffer of the fake device, freed with the object.
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t size) : size_(size) {
    auto p = CudaMallocDevice(0, size);
    EXPECT_TRUE(p.ok()) << p.status().ToString();
    if (p.ok()) ptr_ = *p;
  }
  ~DeviceBuffer() { CudaFreeDevice(0, ptr_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  void* get() const { return ptr_; }
  size_t size() const { return size_; }
  void Write(const std::string& bytes) const {
    ASSERT_TRUE(CudaCopySync(ptr_, bytes.data(), bytes.size()).ok());
  }
  std::string Read(size_t n) const {
    std::string out(n, '\0');
    EXPECT_TRUE(CudaCopySync(out.data(), ptr_, n).ok());
    return out;
  }

 private:
  void* ptr_ = nullptr;
  size_t size_;
};

std::string Pattern(Random& rng, size_t size) {
  std::string v(size, '\0');
  rng.Fill(v.data(), size);
  return v;
}

TEST(FakeDeviceTest, TheModeIsOnAndDeviceMemoryIsTracked) {
  ASSERT_TRUE(FakeDeviceMode());
  ASSERT_TRUE(ProbeCuda().usable);
  std::printf("fake device flavour: %s\n",
              FakeDeviceKind() == FakeDevice::kMovedByUcx ? "ucx (direct paths)" : "1 (staging)");
  DeviceBuffer d(4096);
  EXPECT_TRUE(IsDevicePointer(d.get()));
  EXPECT_TRUE(IsDevicePointer(static_cast<char*>(d.get()) + 4095));
  std::string host(16, 'h');
  EXPECT_FALSE(IsDevicePointer(host.data()));
  EXPECT_TRUE(CheckMemoryKind(d.get(), 4096, MemoryKind::kDevice).ok());
  EXPECT_FALSE(CheckMemoryKind(d.get(), 4097, MemoryKind::kDevice).ok());
  EXPECT_FALSE(CheckMemoryKind(d.get(), 16, MemoryKind::kHost).ok());
  EXPECT_FALSE(CheckMemoryKind(host.data(), 16, MemoryKind::kDevice).ok());
}

// Puts from device buffers and gets into device buffers (and into host memory), sizes from one
// byte to past the GPU tier, every byte checked; the values that fit land in the nodes' GPU
// tiers, which are device memory.
// Streamed puts from device buffers: into the nodes' GPU tier (received straight into it when
// UCX moves device memory, else through the stream buffers and a copy to the device) and to
// disk; every byte read back into device buffers.
TEST(FakeDeviceTest, StreamedPutsFromDeviceBuffersKeepEveryByte) {
  NodeSpec spec;
  spec.fake_gpu_mem = "16MiB";
  spec.host_mem = "8MiB";  // the 20 MiB value goes to disk
  spec.extra_args = {"--gpu-placement", "first", "--stream-chunk-size", "1MiB"};
  Cluster cluster(1, spec);
  auto client = cluster.NewStreamingClient(std::chrono::seconds(30));
  ASSERT_TRUE(client);
  Random rng(testing::TestSeed());
  for (auto [size, tier] : {std::pair<size_t, const char*>{(6 << 20) + 3, "gpu"},
                            std::pair<size_t, const char*>{(20 << 20) + 1, "disk"}}) {
    SCOPED_TRACE("size " + std::to_string(size));
    const std::string key = "streamed/" + std::to_string(size);
    const std::string value = Pattern(rng, size);
    DeviceBuffer src(size);
    src.Write(value);
    auto put = client->Put(key, src.get(), size);
    ASSERT_TRUE(put.ok()) << put.status().ToString();
    EXPECT_EQ(client->Stat(key)->tier, tier);
    DeviceBuffer dst(size);
    auto info = client->GetInto(key, dst.get(), size);
    ASSERT_TRUE(info.ok()) << info.status().ToString();
    EXPECT_TRUE(dst.Read(size) == value) << "device buffer bytes differ";
  }
  EXPECT_EQ(testing::StatsCounter(*client, 0, "completed", "\"streamed_puts\":{"), 2u);
}

// One node that takes streamed pieces of 1 MiB (`spec`'s other settings kept), and a client of
// it that pipelines staging above `threshold`, with 30 s deadlines.
struct PipeliningSetup {
  explicit PipeliningSetup(uint64_t threshold, NodeSpec spec = {}) : cluster(1, WithPieces(spec)) {
    options.default_timeout = std::chrono::seconds(30);
    options.pipeline_threshold = threshold;
    client = cluster.NewClient(options);
  }
  static NodeSpec WithPieces(NodeSpec spec) {
    spec.extra_args.insert(spec.extra_args.end(), {"--stream-chunk-size", "1MiB"});
    return spec;
  }
  Cluster cluster;
  ClientOptions options;
  std::unique_ptr<Client> client;
};

// Issue 10 item 3: a put from a device buffer that UCX cannot send from, larger than
// ClientOptions::pipeline_threshold, is staged piece by piece (a streamed put: each piece is
// copied while the ones before it are on the wire), synchronous and asynchronous alike; a
// smaller one is staged whole and sent as one message. A GetInto of a device buffer with room
// for more than the threshold reads the value in ranges of 8 MiB (the client's piece) and copies
// each to the device while the next ones are on the wire. Where UCX moves device memory nothing
// is staged, streamed or read in ranges. Every byte read back into device and host memory.
TEST(FakeDeviceTest, LargeStagedPutsAndGetsArePipelinedPieceByPiece) {
  NodeSpec spec;
  spec.fake_gpu_mem = "64MiB";
  spec.extra_args = {"--gpu-placement", "first"};
  PipeliningSetup setup(4 << 20, spec);  // below the (default) stream threshold of 64 MiB
  const ClientOptions& o = setup.options;
  Client* client = setup.client.get();
  ASSERT_TRUE(client);
  const bool staged = FakeDeviceKind() == FakeDevice::kStaged;
  constexpr uint64_t kRangePiece = 8 << 20;
  Random rng(testing::TestSeed() + 5);
  uint64_t pipelined_puts = 0, ranges = 0;
  for (size_t size : {size_t{3} << 20, (size_t{17} << 20) + 5, (size_t{4} << 20) + 1}) {
    for (bool async : {false, true}) {
      SCOPED_TRACE("size " + std::to_string(size) + (async ? " async" : " sync"));
      const std::string key = "piped/" + std::to_string(size) + (async ? "/a" : "/s");
      const std::string value = Pattern(rng, size);
      DeviceBuffer src(size);
      src.Write(value);
      auto put =
          async ? client->PutAsync(key, src.get(), size).get() : client->Put(key, src.get(), size);
      ASSERT_TRUE(put.ok()) << put.status().ToString();
      const bool over = size > o.pipeline_threshold;
      if (over) {
        pipelined_puts++;
        ranges += (size + kRangePiece - 1) / kRangePiece;
      }
      DeviceBuffer dst(size);
      auto info = client->GetInto(key, dst.get(), size);
      ASSERT_TRUE(info.ok()) << info.status().ToString();
      EXPECT_EQ(info->size, size);
      EXPECT_EQ(info->version, *put);
      EXPECT_TRUE(dst.Read(size) == value) << "device buffer bytes differ";
      auto host = client->Get(key);
      ASSERT_TRUE(host.ok()) << host.status().ToString();
      EXPECT_TRUE(host->view() == value) << "host copy differs";
      if (over) {  // a buffer too small is refused at the first range, whatever reads it
        DeviceBuffer small(size - 1);
        EXPECT_EQ(client->GetInto(key, small.get(), size - 1).status().code(),
                  StatusCode::kInvalidArgument);
        if (staged && size - 1 > o.pipeline_threshold) ranges++;
      }
    }
  }
  DeviceBuffer room(8 << 20);
  EXPECT_EQ(client->GetInto("piped/none", room.get(), 8 << 20).status().code(),
            StatusCode::kNotFound);  // the owner's miss on the first range is the answer
  if (staged) ranges++;
  // A value `accept` refuses is refused at the first range, once, with nothing written.
  {
    const size_t size = (size_t{17} << 20) + 5;
    DeviceBuffer dst(size);
    dst.Write(std::string(size, 'u'));
    int asked = 0;
    GetOptions refuse;
    refuse.accept = [&asked](const ValueInfo&) {
      asked++;
      return Status::InvalidArgument("not this one");
    };
    auto got = client->GetInto("piped/" + std::to_string(size) + "/s", dst.get(), size, refuse);
    EXPECT_EQ(got.status().code(), StatusCode::kInvalidArgument) << got.status().ToString();
    EXPECT_EQ(asked, 1);
    EXPECT_TRUE(dst.Read(size) == std::string(size, 'u')) << "a refused value was written";
    if (staged) ranges++;
  }
  EXPECT_EQ(StatsCounter(*client, 0, "completed", "\"streamed_puts\":{"),
            staged ? pipelined_puts : 0u);
  EXPECT_EQ(StatsCounter(*client, 0, "ranged_gets"), staged ? ranges : 0u);
}

// More pipelined puts at once than a node opens streams for on one connection (8): the ones
// refused Busy open again after a backoff, and every one lands whole.
TEST(FakeDeviceTest, ManyPipelinedPutsAtOnceAllLand) {
  PipeliningSetup setup(1 << 20);
  Client* client = setup.client.get();
  ASSERT_TRUE(client);
  constexpr int kPuts = 12;
  constexpr size_t kSize = (3 << 20) + 11;
  Random rng(testing::TestSeed() + 7);
  std::vector<std::string> values;
  std::vector<std::unique_ptr<DeviceBuffer>> buffers;
  std::vector<std::future<Result<uint64_t>>> puts;
  for (int i = 0; i < kPuts; ++i) {
    values.push_back(Pattern(rng, kSize));
    buffers.push_back(std::make_unique<DeviceBuffer>(kSize));
    buffers.back()->Write(values.back());
  }
  for (int i = 0; i < kPuts; ++i) {
    puts.push_back(client->PutAsync("many/" + std::to_string(i), buffers[i]->get(), kSize));
  }
  for (int i = 0; i < kPuts; ++i) {
    auto put = puts[i].get();
    EXPECT_TRUE(put.ok()) << i << ": " << put.status().ToString();
  }
  for (int i = 0; i < kPuts; ++i) {
    auto got = client->Get("many/" + std::to_string(i));
    ASSERT_TRUE(got.ok()) << i << ": " << got.status().ToString();
    EXPECT_TRUE(got->view() == values[i]) << i;
  }
  // Read back into a device buffer in ranges served from the host tier's memory (the node has
  // no GPU tier): 8 MiB, 8 MiB, then the rest.
  const size_t big_size = (size_t{20} << 20) + 3;
  const std::string big = Pattern(rng, big_size);
  ASSERT_TRUE(client->Put("many/big", big.data(), big.size()).ok());
  DeviceBuffer dst(big_size);
  auto info = client->GetInto("many/big", dst.get(), big_size);
  ASSERT_TRUE(info.ok()) << info.status().ToString();
  EXPECT_EQ(info->tier, "host");
  EXPECT_TRUE(dst.Read(big_size) == big) << "device buffer bytes differ";
  if (FakeDeviceKind() == FakeDevice::kStaged) {
    EXPECT_EQ(StatsCounter(*client, 0, "completed", "\"streamed_puts\":{"),
              static_cast<uint64_t>(kPuts));
    EXPECT_EQ(StatsCounter(*client, 0, "ranged_gets"), 3u);
  }
}

// A client closed while pipelined puts are staging answers each of them (stored, or Aborted /
// Unavailable), from its destructor, and leaves no staging thread behind. It is closed once a
// stream is open (staging runs), before 192 MiB can all have moved.
TEST(FakeDeviceTest, AClientClosedDuringPipelinedPutsAnswersEachOne) {
  PipeliningSetup setup(1 << 20);
  ASSERT_TRUE(setup.client);
  constexpr int kPuts = 3;
  constexpr size_t kSize = 64 << 20;
  std::vector<std::unique_ptr<DeviceBuffer>> buffers;
  for (int i = 0; i < kPuts; ++i) {
    buffers.push_back(std::make_unique<DeviceBuffer>(kSize));
    buffers.back()->Write(std::string(kSize, static_cast<char>('a' + i)));
  }
  std::atomic<int> answered{0}, stored{0};
  for (int i = 0; i < kPuts; ++i) {
    setup.client->PutAsync(
        "closed/" + std::to_string(i), buffers[i]->get(), kSize, {}, [&](Result<uint64_t> r) {
          const StatusCode c = r.status().code();
          EXPECT_TRUE(r.ok() || c == StatusCode::kAborted || c == StatusCode::kUnavailable)
              << r.status().ToString();
          if (r.ok()) stored++;
          answered++;
        });
  }
  if (FakeDeviceKind() == FakeDevice::kStaged) {
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    while (StatsCounter(*setup.client, 0, "opened", "\"streamed_puts\":{") == 0 &&
           std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }
  setup.client.reset();
  EXPECT_EQ(answered.load(), kPuts);
  EXPECT_LT(stored.load(), kPuts) << "every put had landed before the close: nothing was tested";
}

// A pipelined put whose copy fails part-way (here the caller's length runs past its device
// buffer, which the fake device refuses as a GPU would fault) fails with the copy's error once
// the pieces already sent have settled; nothing is stored, and the node drops the stream.
TEST(FakeDeviceTest, APipelinedPutWhoseCopyFailsPartWayStoresNothing) {
  if (FakeDeviceKind() != FakeDevice::kStaged) {
    GTEST_SKIP() << "UCX moves device memory in this flavour: nothing is staged";
  }
  NodeSpec spec;
  spec.extra_args = {"--send-timeout-ms", "1500"};
  PipeliningSetup setup(2 << 20, spec);
  Client* client = setup.client.get();
  ASSERT_TRUE(client);
  const size_t length = (6 << 20) + (512 << 10);
  DeviceBuffer src(length);
  src.Write(std::string(length, 'd'));
  auto put = client->Put("torn", src.get(), 10 << 20);  // the 7th piece runs past the buffer
  ASSERT_FALSE(put.ok());
  EXPECT_NE(put.status().message().find("past its allocation"), std::string::npos)
      << put.status().ToString();
  EXPECT_EQ(client->Stat("torn").status().code(), StatusCode::kNotFound);
  // The node heard nothing more on the stream: dropped after its send timeout.
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (StatsCounter(*client, 0, "dropped", "\"streamed_puts\":{") == 0 &&
         std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  EXPECT_EQ(StatsCounter(*client, 0, "dropped", "\"streamed_puts\":{"), 1u);
  // The client works on: a pipelined put of the buffer's own length lands whole.
  ASSERT_TRUE(client->Put("whole", src.get(), length).ok());
  auto got = client->Get("whole");
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_TRUE(got->view() == std::string(length, 'd'));
}

TEST(FakeDeviceTest, PutsFromAndGetsIntoDeviceBuffersKeepEveryByte) {
  NodeSpec spec;
  spec.fake_gpu_mem = "16MiB";
  spec.extra_args = {"--gpu-placement", "first"};  // the device tier serves (staged or not)
  Cluster cluster(2, spec);
  auto client = cluster.NewClient(std::chrono::seconds(10));
  ASSERT_TRUE(client);
  Random rng(testing::TestSeed());
  const std::vector<size_t> sizes = {1, 64, 4096, 100'000, 1 << 20, 6 << 20, 20 << 20};
  for (size_t size : sizes) {
    SCOPED_TRACE("size " + std::to_string(size));
    const std::string key = "dev/" + std::to_string(size);
    const std::string value = Pattern(rng, size);
    DeviceBuffer src(size);
    src.Write(value);
    auto put = client->Put(key, src.get(), size);
    ASSERT_TRUE(put.ok()) << put.status().ToString();
    DeviceBuffer dst(size);
    auto info = client->GetInto(key, dst.get(), size);
    ASSERT_TRUE(info.ok()) << info.status().ToString();
    EXPECT_EQ(info->size, size);
    EXPECT_TRUE(dst.Read(size) == value) << "device buffer bytes differ";
    auto host = client->Get(key);
    ASSERT_TRUE(host.ok()) << host.status().ToString();
    EXPECT_TRUE(host->view() == value) << "host copy differs";
  }
  uint64_t gpu_objects = 0;
  for (int n = 0; n < 2; ++n) gpu_objects += StatsCounter(*client, n, "objects", "\"gpu\":{");
  EXPECT_GT(gpu_objects, 0u) << "no value landed in a GPU tier";
}

// Issue 10 item 9: a put whose fast reservation lands in GPU memory that UCX cannot receive
// into takes the slow path, which stages through host memory; the fast reservation is released
// first, so a value of most of the GPU tier still lands there (before, the two reservations
// together did not fit and the value went to the host tier).
TEST(FakeDeviceTest, ASlowPathPutDoesNotHoldItsFastReservationToo) {
  if (FakeDeviceKind() != FakeDevice::kStaged) {
    GTEST_SKIP() << "UCX moves device memory in this flavour: the put takes the fast path";
  }
  NodeSpec spec;
  spec.fake_gpu_mem = "8MiB";
  spec.placement_partitions = 1;  // the 6 MiB object needs the whole 8 MiB tier, not a slice
  spec.extra_args = {"--gpu-placement", "first"};
  Cluster cluster(1, spec);
  auto client = cluster.NewClient(std::chrono::seconds(10));
  ASSERT_TRUE(client);
  std::string value(6 << 20, 'v');
  ASSERT_TRUE(client->Put("big", value.data(), value.size()).ok());
  auto st = client->Stat("big");
  ASSERT_TRUE(st.ok()) << st.status().ToString();
  EXPECT_EQ(st->tier, "gpu");
  auto got = client->Get("big");
  ASSERT_TRUE(got.ok());
  EXPECT_TRUE(got->view() == value);
}

// Issue 10 item 9: a node whose UCX cannot move device memory places its GPU tier behind the
// host tier (--gpu-placement auto): new objects land in host memory, where a read is served
// straight away, and the GPU tier takes what the host tier spills, before the disk does.
TEST(FakeDeviceTest, WithoutADeviceCapableUcxTheGpuTierSitsBehindHostMemory) {
  NodeSpec spec;
  spec.fake_gpu_mem = "8MiB";
  spec.host_mem = "4MiB";
  Cluster cluster(1, spec);
  auto client = cluster.NewClient(std::chrono::seconds(10));
  ASSERT_TRUE(client);
  const bool behind = FakeDeviceKind() == FakeDevice::kStaged;
  Random rng(testing::TestSeed() + 3);
  std::vector<std::string> values;
  for (int i = 0; i < 10; ++i) {
    values.push_back(Pattern(rng, 1 << 20));
    ASSERT_TRUE(client->Put("p/" + std::to_string(i), values[i].data(), values[i].size()).ok());
  }
  // The newest is in the first memory tier, the oldest spilled to the second.
  EXPECT_EQ(client->Stat("p/9")->tier, behind ? "host" : "gpu");
  EXPECT_EQ(client->Stat("p/0")->tier, behind ? "gpu" : "host");
  for (int i = 0; i < 10; ++i) {
    auto got = client->Get("p/" + std::to_string(i));
    ASSERT_TRUE(got.ok()) << i << ": " << got.status().ToString();
    EXPECT_TRUE(got->view() == values[i]) << i;
  }
  EXPECT_NE(cluster.ReadLog(0).find(behind ? "behind the host tier" : "GPU tier on"),
            std::string::npos);
}

// The GPU tier fills, spills to host and disk, and reads bring values back, through device
// memory on the node's side; every byte checked.
TEST(FakeDeviceTest, SpillAndPromotionThroughTheDeviceTierKeepBytes) {
  NodeSpec spec;
  spec.fake_gpu_mem = "2MiB";
  spec.host_mem = "4MiB";
  spec.extra_args = {"--gpu-placement", "first"};
  Cluster cluster(1, spec);
  auto client = cluster.NewClient(std::chrono::seconds(10));
  ASSERT_TRUE(client);
  Random rng(testing::TestSeed() + 1);
  std::vector<std::string> values;
  for (int i = 0; i < 40; ++i) {
    values.push_back(Pattern(rng, 256 * 1024));
    ASSERT_TRUE(
        client->Put("spill/" + std::to_string(i), values.back().data(), values.back().size()).ok());
  }
  for (int round = 0; round < 3; ++round) {
    for (int i = 0; i < 40; ++i) {
      auto got = client->Get("spill/" + std::to_string(i));
      ASSERT_TRUE(got.ok()) << i << ": " << got.status().ToString();
      ASSERT_TRUE(got->view() == values[i]) << "value " << i << " differs";
    }
  }
  EXPECT_GT(StatsCounter(*client, 0, "objects", "\"gpu\":{"), 0u);
  EXPECT_GT(StatsCounter(*client, 0, "objects", "\"disk\":{"), 0u);
}

// Batches from and into device memory: MultiPut from device items, MultiGetInto into one device
// buffer of rows, MultiGet into host memory.
TEST(FakeDeviceTest, BatchesFromAndIntoDeviceMemory) {
  NodeSpec spec;
  spec.extra_args = {"--gpu-placement", "first"};
  Cluster cluster(2, spec);
  auto client = cluster.NewClient(std::chrono::seconds(10));
  ASSERT_TRUE(client);
  Random rng(testing::TestSeed() + 2);
  constexpr size_t kRows = 32, kRow = 3000;
  DeviceBuffer src(kRows * kRow);
  std::string all = Pattern(rng, kRows * kRow);
  src.Write(all);
  std::vector<PutItem> items;
  std::vector<std::string> keys;
  for (size_t i = 0; i < kRows; ++i) {
    keys.push_back("row/" + std::to_string(i));
    items.push_back({keys.back(), static_cast<char*>(src.get()) + i * kRow, kRow, {}});
  }
  // The rows of one device buffer stage with one copy each way, not one per row (issue 39
  // item 3).
  const uint64_t copies_before_put = FakeDeviceCopies();
  auto put = client->MultiPut(items);
  for (size_t i = 0; i < kRows; ++i) ASSERT_TRUE(put[i].ok()) << put[i].status().ToString();
  EXPECT_EQ(FakeDeviceCopies() - copies_before_put, 1u);
  DeviceBuffer rows(kRows * kRow);
  const uint64_t copies_before_get = FakeDeviceCopies();
  auto got = client->MultiGetInto(keys, rows.get(), kRow, kRow);
  for (size_t i = 0; i < kRows; ++i) ASSERT_TRUE(got[i].ok()) << got[i].ToString();
  EXPECT_EQ(FakeDeviceCopies() - copies_before_get, 1u);
  EXPECT_TRUE(rows.Read(kRows * kRow) == all) << "device rows differ";
  auto host = client->MultiGet(keys);
  for (size_t i = 0; i < kRows; ++i) {
    ASSERT_TRUE(host[i].ok()) << host[i].status().ToString();
    EXPECT_TRUE(host[i]->view() == all.substr(i * kRow, kRow)) << "row " << i;
  }
}

// A hot key's copies land in the other nodes' GPU tiers (device memory here) and serve reads.
TEST(FakeDeviceTest, HotKeyCopiesInAReplicasDeviceTierServeReads) {
  NodeSpec spec;
  spec.extra_args = {"--replicate-hot", "100", "--hot-replicas", "2", "--gpu-placement", "first"};
  Cluster cluster(3, spec);
  auto client = cluster.NewClient(std::chrono::seconds(2));
  ASSERT_TRUE(client);
  const std::string key = KeyOn(*client, 0);
  std::string value(4096, 'g');
  ASSERT_TRUE(client->Put(key, value.data(), value.size()).ok());
  for (int i = 0; i < 3000; ++i) {
    auto r = client->Get(key);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    ASSERT_TRUE(r->view() == value);
  }
  uint64_t created = 0, served = 0;
  for (int n = 0; n < 3; ++n) {
    created += StatsCounter(*client, n, "created", "\"replication\":{");
    served += StatsCounter(*client, n, "reads_served", "\"replication\":{");
  }
  EXPECT_EQ(created, 2u);
  for (int n = 1; n <= 2; ++n) {
    EXPECT_EQ(StatsCounter(*client, n, "objects", "\"replication\":{"), 1u)
        << "node " << n << ": the copy is not in the GPU tier";
  }
  DeviceBuffer dst(value.size());
  for (int i = 0; i < 600; ++i) {
    auto r = client->GetInto(key, dst.get(), dst.size());
    ASSERT_TRUE(r.ok()) << r.status().ToString();
  }
  EXPECT_TRUE(dst.Read(value.size()) == value);
  uint64_t served_after = 0;
  for (int n = 0; n < 3; ++n) {
    served_after += StatsCounter(*client, n, "reads_served", "\"replication\":{");
  }
  EXPECT_GT(served_after, served + 100) << "the copies in the GPU tiers served no read";
}

}  // namespace
}  // namespace gkv
