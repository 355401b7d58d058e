// Integration tests: three real gkv-server processes on 127.0.0.1, talked to over UCX.
#include <gtest/gtest.h>

#include <sstream>

#include <atomic>
#include <condition_variable>
#include <future>
#include <iostream>
#include <map>
#include <mutex>
#include <thread>

#include "cluster_harness.h"
#include "gkv/hash.h"
#include "gkv/random.h"

namespace gkv {
namespace {

using testing::Cluster;
using testing::NodeSpec;
using testing::OpenClients;

std::string RandomValue(Random& rng, size_t size) {
  std::string v(size, '\0');
  rng.Fill(v.data(), size);
  return v;
}

TEST(IntegrationTest, EveryOperationWorksAcrossThreeNodes) {
  Cluster cluster(3);
  auto client = cluster.NewClient();
  ASSERT_TRUE(client);
  for (int n = 0; n < 3; ++n) EXPECT_EQ(*client->Ping(n), "n" + std::to_string(n));

  std::vector<float> tensor(6);
  for (int i = 0; i < 6; ++i) tensor[i] = i * 1.5f;
  PutOptions po;
  po.tensor = TensorMeta{DType::kF32, {2, 3}};
  auto v1 = client->Put("emb/user/7", tensor.data(), sizeof(float) * 6, po);
  ASSERT_TRUE(v1.ok()) << v1.status().ToString();

  auto got = client->Get("emb/user/7");
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_EQ(got->size(), 24u);
  EXPECT_EQ(got->info().tensor, po.tensor);
  EXPECT_EQ(got->info().version, *v1);
  EXPECT_EQ(0, std::memcmp(got->data(), tensor.data(), 24));

  auto st = client->Stat("emb/user/7");
  ASSERT_TRUE(st.ok());
  EXPECT_EQ(st->size, 24u);
  EXPECT_EQ(st->tier, testing::TopMemoryTier());

  auto v2 = client->Put("emb/user/7", "xyz", 3);
  ASSERT_TRUE(v2.ok());
  EXPECT_GT(*v2, *v1);
  EXPECT_EQ(client->Get("emb/user/7")->view(), "xyz");

  ASSERT_TRUE(client->Delete("emb/user/7").ok());
  EXPECT_EQ(client->Get("emb/user/7").status().code(), StatusCode::kNotFound);
  EXPECT_EQ(client->Stat("emb/user/7").status().code(), StatusCode::kNotFound);
  EXPECT_EQ(client->Delete("emb/user/7").code(), StatusCode::kNotFound);

  // Tensor metadata that does not match the byte size is refused by the server.
  PutOptions bad;
  bad.tensor = TensorMeta{DType::kF32, {5}};
  EXPECT_EQ(client->Put("bad", tensor.data(), 24, bad).status().code(),
            StatusCode::kInvalidArgument);

  auto stats = client->NodeStats(0);
  ASSERT_TRUE(stats.ok());
  EXPECT_NE(stats->find("\"node\":\"n0\""), std::string::npos);
}

TEST(IntegrationTest, ValuesFromZeroBytesTo64MiBRoundTripByteIdentical) {
  Cluster cluster(3);
  auto client = cluster.NewClient(std::chrono::seconds(30));
  ASSERT_TRUE(client);
  Random rng(testing::TestSeed());
  const std::vector<size_t> sizes = {0,        1,       100, 4096, 8193, 64 << 10, (1 << 20) + 3,
                                     16 << 20, 64 << 20};
  for (size_t size : sizes) {
    std::string key = "blob/" + std::to_string(size);
    std::string value = RandomValue(rng, size);
    auto put = client->Put(key, value.data(), value.size());
    ASSERT_TRUE(put.ok()) << size << ": " << put.status().ToString();
    auto got = client->Get(key);
    ASSERT_TRUE(got.ok()) << size << ": " << got.status().ToString();
    ASSERT_EQ(got->size(), size);
    EXPECT_EQ(HashBytes(got->data(), size, 7), HashBytes(value.data(), size, 7)) << size;
    EXPECT_TRUE(got->view() == value) << size;
    // Into a caller's buffer.
    std::string into(size + 16, '\0');
    auto info = client->GetInto(key, into.data(), into.size());
    ASSERT_TRUE(info.ok()) << size << ": " << info.status().ToString();
    EXPECT_EQ(info->size, size);
    EXPECT_EQ(0, std::memcmp(into.data(), value.data(), size)) << size;
  }
}

// A node registers its arenas with UCX once (the host pool; a GPU arena when UCX moves device
// memory), and its gets and puts then pass that registration instead of UCX registering (or
// detecting the memory type of) each buffer.
TEST(IntegrationTest, NodesRegisterTheirArenasWithUcxAndServeThroughThem) {
  Cluster cluster(1);
  auto client = cluster.NewClient(std::chrono::seconds(30));
  ASSERT_TRUE(client);
  const std::string within = "\"ucx_registration\":{";
  // 256 MiB of host pool, and the 8 MiB GPU tier when UCX moves the fake device's memory.
  const bool gpu_registered = FakeDeviceKind() == FakeDevice::kMovedByUcx;
  EXPECT_EQ(testing::StatsCounter(*client, 0, "regions", within), gpu_registered ? 2u : 1u);
  EXPECT_EQ(testing::StatsCounter(*client, 0, "bytes", within),
            (256u << 20) + (gpu_registered ? 8u << 20 : 0u));
  const uint64_t before = testing::StatsCounter(*client, 0, "ops", within);
  Random rng(testing::TestSeed());
  const int rounds = 4;
  for (int i = 0; i < rounds; ++i) {
    const std::string key = "reg/" + std::to_string(i);
    const std::string value = RandomValue(rng, 1 << 20);
    ASSERT_TRUE(client->Put(key, value.data(), value.size()).ok());
    auto got = client->Get(key);
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    EXPECT_TRUE(got->view() == value) << key;
  }
  // Each get's reply went from the arena (and each rendezvous put was received into it).
  EXPECT_GE(testing::StatsCounter(*client, 0, "ops", within) - before, uint64_t{rounds})
      << *client->NodeStats(0);
}

// --io-threads: a node spreads its connections over its UCX workers; the workers other than 0
// serve their connections' GETs and PUTs themselves (counted per I/O thread in STATS). Every
// value read back intact, on a cluster with a secret (a connection's worker learns that it
// authenticated).
TEST(IntegrationTest, ANodeSpreadsConnectionsOverItsIoThreadsAndEachServesGets) {
  NodeSpec spec;
  spec.io_threads = 3;
  spec.secret = "io-threads-secret";
  Cluster cluster(1, spec);
  Random rng(testing::TestSeed());
  std::vector<std::unique_ptr<Client>> clients;
  ASSERT_NO_FATAL_FAILURE(OpenClients(cluster, 6, &clients));
  for (int c = 0; c < 6; ++c) {
    for (size_t size : {size_t{64}, size_t{1} << 20}) {
      const std::string key = "io/" + std::to_string(c) + "/" + std::to_string(size);
      const std::string value = RandomValue(rng, size);
      ASSERT_TRUE(clients[c]->Put(key, value.data(), value.size()).ok());
      for (int i = 0; i < 20; ++i) {
        auto got = clients[c]->Get(key);
        ASSERT_TRUE(got.ok()) << key << ": " << got.status().ToString();
        ASSERT_TRUE(got->view() == value) << key;
      }
    }
    EXPECT_EQ(clients[c]->Get("io/absent").status().code(), StatusCode::kNotFound);
    // A durable put takes the executors (its payload is received, and its reply sent, on the
    // connection's own worker).
    const std::string durable_key = "io/" + std::to_string(c) + "/durable";
    const std::string value = RandomValue(rng, 256 << 10);
    PutOptions durable;
    durable.durable = true;
    auto put = clients[c]->Put(durable_key, value.data(), value.size(), durable);
    ASSERT_TRUE(put.ok()) << put.status().ToString();
    auto got = clients[c]->Get(durable_key);
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    EXPECT_TRUE(got->view() == value);
    ASSERT_TRUE(clients[c]->Delete(durable_key).ok());
    EXPECT_EQ(clients[c]->Get(durable_key).status().code(), StatusCode::kNotFound);
  }
  EXPECT_EQ(testing::StatsCounter(*clients[0], 0, "io_threads"), 3u);
  EXPECT_EQ(testing::StatsCounter(*clients[0], 0, "placement_partitions"), 2u);  // the harness's
  const std::vector<uint64_t> by_thread = testing::RequestsByIoThread(*clients[0]);
  ASSERT_EQ(by_thread.size(), 3u);
  // Six connections over three workers: two each, and each worker other than 0 answered at
  // least the GETs of its two connections itself.
  EXPECT_GT(by_thread[0], 0u);
  EXPECT_GE(by_thread[1], 80u);
  EXPECT_GE(by_thread[2], 80u);
}

// --io-threads: MGET, MPUT, DELETE and STAT run on their connection's own I/O worker too
// (receive, row pass, reply), worker 0 taking part only for keys with copies, catch-up or a ring
// change. Six connections over three workers; every value (64 B to 1 MiB, so eager and
// rendezvous rows) reads back intact, a missing key reads as not found, and a deleted key is
// gone.
TEST(IntegrationTest, BatchesDeletesAndStatsAreServedOnTheirConnectionsOwnIoThread) {
  NodeSpec spec;
  spec.io_threads = 3;
  spec.secret = "batch-threads-secret";
  Cluster cluster(1, spec);
  Random rng(testing::TestSeed());
  std::vector<std::unique_ptr<Client>> clients;
  ASSERT_NO_FATAL_FAILURE(OpenClients(cluster, 6, &clients));
  const std::vector<uint64_t> before = testing::RequestsByIoThread(*clients[0]);
  ASSERT_EQ(before.size(), 3u);
  constexpr int kRounds = 10;
  const size_t sizes[] = {64, 4096, 100 << 10, 1 << 20};
  for (int c = 0; c < 6; ++c) {
    for (int round = 0; round < kRounds; ++round) {
      std::vector<std::string> keys, values;
      std::vector<PutItem> items;
      for (size_t i = 0; i < 8; ++i) {
        keys.push_back("batch/" + std::to_string(c) + "/" + std::to_string(round) + "/" +
                       std::to_string(i));
        values.push_back(RandomValue(rng, sizes[i % 4]));
      }
      for (size_t i = 0; i < keys.size(); ++i) {
        items.push_back({keys[i], values[i].data(), values[i].size(), {}});
      }
      auto put = clients[c]->MultiPut(items);
      ASSERT_EQ(put.size(), items.size());
      for (size_t i = 0; i < put.size(); ++i) {
        ASSERT_TRUE(put[i].ok()) << keys[i] << ": " << put[i].status().ToString();
      }
      keys.push_back("batch/absent");
      auto got = clients[c]->MultiGet(keys);
      ASSERT_EQ(got.size(), keys.size());
      for (size_t i = 0; i < values.size(); ++i) {
        ASSERT_TRUE(got[i].ok()) << keys[i] << ": " << got[i].status().ToString();
        ASSERT_TRUE(got[i]->view() == values[i]) << keys[i];
      }
      EXPECT_EQ(got.back().status().code(), StatusCode::kNotFound);
      auto stat = clients[c]->Stat(keys[3]);
      ASSERT_TRUE(stat.ok()) << stat.status().ToString();
      EXPECT_EQ(stat->size, values[3].size());
      ASSERT_TRUE(clients[c]->Delete(keys[3]).ok());
      EXPECT_EQ(clients[c]->Get(keys[3]).status().code(), StatusCode::kNotFound);
    }
  }
  const std::vector<uint64_t> after = testing::RequestsByIoThread(*clients[0]);
  ASSERT_EQ(after.size(), 3u);
  // Each worker's two connections sent 2 x kRounds x 5 requests (MPUT, MGET, STAT, DELETE,
  // GET): the others' are answered there (but a connection's first one, which may arrive before
  // worker 0 has told the connection's worker that it authenticated), and worker 0 answered its
  // own (and the stats calls), not the others' batches, stats and deletes too.
  EXPECT_GE(after[1] - before[1], uint64_t{10 * kRounds - 2});
  EXPECT_GE(after[2] - before[2], uint64_t{10 * kRounds - 2});
  EXPECT_LT(after[0] - before[0], uint64_t{15 * kRounds});
}

// --io-threads: a GET that needs an executor (an object spilled to the disk tier, or promoted
// back by its read) is answered by the connection's own I/O worker too. 24 MiB of 1 MiB values
// (half of them durable puts, committed on an executor) in an 8 MiB host tier: many reads come
// from disk, every byte intact.
TEST(IntegrationTest, DiskReadsAreAnsweredByTheirConnectionsOwnIoThread) {
  NodeSpec spec;
  spec.io_threads = 3;
  spec.host_mem = "8MiB";
  Cluster cluster(1, spec);
  Random rng(testing::TestSeed());
  std::vector<std::unique_ptr<Client>> clients;
  ASSERT_NO_FATAL_FAILURE(OpenClients(cluster, 6, &clients));
  std::vector<std::string> values;
  for (int i = 0; i < 24; ++i) {
    values.push_back(RandomValue(rng, 1 << 20));
    PutOptions durable;
    durable.durable = i % 2 == 0;
    auto put = clients[i % 6]->Put("spill/" + std::to_string(i), values.back().data(),
                                   values.back().size(), durable);
    ASSERT_TRUE(put.ok()) << put.status().ToString();
  }
  const std::vector<uint64_t> before = testing::RequestsByIoThread(*clients[0]);
  ASSERT_EQ(before.size(), 3u);
  const uint64_t disk_hits_before = testing::StatsCounter(*clients[0], 0, "hits", "\"disk\":");
  for (int c = 0; c < 6; ++c) {
    for (int i = 0; i < 24; ++i) {
      auto got = clients[c]->Get("spill/" + std::to_string(i));
      ASSERT_TRUE(got.ok()) << got.status().ToString();
      ASSERT_TRUE(got->view() == values[i]) << i;
    }
  }
  const std::vector<uint64_t> after = testing::RequestsByIoThread(*clients[0]);
  ASSERT_EQ(after.size(), 3u);
  // The reads that took the slow path: a third of them or more came from disk (the rest
  // mostly from values promoted back, which evicts others).
  const uint64_t disk_reads =
      testing::StatsCounter(*clients[0], 0, "hits", "\"disk\":") - disk_hits_before;
  std::cout << disk_reads << " of 144 reads came from disk; by I/O thread: " << after[0] - before[0]
            << " / " << after[1] - before[1] << " / " << after[2] - before[2] << "\n";
  EXPECT_GE(disk_reads, 48u) << "too few reads came from the disk tier";
  // Each worker's two connections read 2 x 24 values, from disk or memory: answered there.
  EXPECT_GE(after[1] - before[1], 48u - 2);
  EXPECT_GE(after[2] - before[2], 48u - 2);
  EXPECT_LT(after[0] - before[0], 72u);
}

// Streamed puts (values above the client's stream threshold go in pieces): into the top memory
// tier, to disk (larger than a slice of the memory tiers), durable, and over one another; every
// value reads back whole, by Get and by MultiGet.
TEST(IntegrationTest, StreamedPutsLandInMemoryOrOnDiskWhole) {
  NodeSpec spec;
  spec.host_mem = "8MiB";  // two slices of 4 MiB
  spec.extra_args = {"--stream-chunk-size", "1MiB"};
  Cluster cluster(1, spec);
  auto client = cluster.NewStreamingClient(std::chrono::seconds(30));
  ASSERT_TRUE(client);
  Random rng(testing::TestSeed());
  struct Case {
    std::string key;
    size_t size;
    bool durable;
    std::string tier;
  };
  const std::vector<Case> cases = {{"s/mem", (3 << 20) + 5, false, testing::TopMemoryTier()},
                                   {"s/disk", (12 << 20) + 3, false, "disk"},
                                   {"s/durable", 6 << 20, true, "disk"},
                                   {"s/over", (9 << 20) + 1, false, "disk"},
                                   {"s/over", (5 << 20) + 7, false, "disk"}};
  std::map<std::string, std::string> values;
  for (const Case& c : cases) {
    SCOPED_TRACE(c.key);
    values[c.key] = RandomValue(rng, c.size);
    PutOptions po;
    po.durable = c.durable;
    auto put = client->Put(c.key, values[c.key].data(), c.size, po);
    ASSERT_TRUE(put.ok()) << put.status().ToString();
    auto st = client->Stat(c.key);
    ASSERT_TRUE(st.ok()) << st.status().ToString();
    EXPECT_EQ(st->size, c.size);
    EXPECT_EQ(st->tier, c.tier);
  }
  EXPECT_EQ(testing::StatsCounter(*client, 0, "completed", "\"streamed_puts\":{"), cases.size());
  std::vector<std::string> keys;
  for (const auto& [key, value] : values) {
    auto got = client->Get(key);
    ASSERT_TRUE(got.ok()) << key << ": " << got.status().ToString();
    EXPECT_TRUE(got->view() == value) << key;
    keys.push_back(key);
  }
  auto many = client->MultiGet(keys);
  for (size_t i = 0; i < keys.size(); ++i) {
    ASSERT_TRUE(many[i].ok()) << keys[i] << ": " << many[i].status().ToString();
    EXPECT_TRUE(many[i]->view() == values[keys[i]]) << keys[i];
  }
  // Replaced by a small value (one message), then deleted.
  ASSERT_TRUE(client->Put("s/over", "tiny", 4).ok());
  EXPECT_EQ(client->Get("s/over")->view(), "tiny");
  ASSERT_TRUE(client->Delete("s/disk").ok());
  EXPECT_EQ(client->Get("s/disk").status().code(), StatusCode::kNotFound);
}

TEST(IntegrationTest, GetIntoASmallerBufferIsRefused) {
  Cluster cluster(1);
  auto client = cluster.NewClient();
  ASSERT_TRUE(client);
  std::string v(100000, 'q');
  ASSERT_TRUE(client->Put("k", v.data(), v.size()).ok());
  std::string small(10, '\0');
  auto r = client->GetInto("k", small.data(), small.size());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(small, std::string(10, '\0'));
  // The node is fine afterwards.
  EXPECT_EQ(client->Get("k")->size(), v.size());
}

TEST(IntegrationTest, BatchesSpanNodesOneMessagePerNode) {
  Cluster cluster(3);
  auto client = cluster.NewClient();
  ASSERT_TRUE(client);
  Random rng(testing::TestSeed());
  std::vector<std::string> keys, values;
  std::vector<PutItem> items;
  for (int i = 0; i < 300; ++i) {
    keys.push_back("row/" + std::to_string(i));
    values.push_back(RandomValue(rng, rng.Uniform(0, 3000)));
  }
  for (int i = 0; i < 300; ++i) items.push_back({keys[i], values[i].data(), values[i].size(), {}});
  auto put = client->MultiPut(items);
  ASSERT_EQ(put.size(), 300u);
  for (auto& r : put) ASSERT_TRUE(r.ok()) << r.status().ToString();
  std::set<int> nodes;
  for (auto& k : keys) nodes.insert(client->NodeFor(k));
  EXPECT_EQ(nodes.size(), 3u);

  std::vector<std::string> query = keys;
  query.push_back("row/missing");
  auto got = client->MultiGet(query);
  ASSERT_EQ(got.size(), 301u);
  for (int i = 0; i < 300; ++i) {
    ASSERT_TRUE(got[i].ok()) << keys[i] << ": " << got[i].status().ToString();
    EXPECT_TRUE(got[i]->view() == values[i]) << keys[i];
  }
  EXPECT_EQ(got[300].status().code(), StatusCode::kNotFound);
  // One mget per node, not per key.
  int mgets = 0;
  for (int n = 0; n < 3; ++n) {
    std::string s = *client->NodeStats(n);
    auto at = s.find("\"mget\":");
    ASSERT_NE(at, std::string::npos);
    mgets += std::stoi(s.substr(at + 7));
  }
  EXPECT_EQ(mgets, 3);
}

TEST(IntegrationTest, MultiGetIntoWritesRowsInPlaceAndLeavesOthersUntouched) {
  Cluster cluster(3);
  auto client = cluster.NewClient();
  ASSERT_TRUE(client);
  constexpr size_t kRow = 64;     // bytes of a row's value
  constexpr size_t kStride = 80;  // rows are padded: the padding must stay untouched
  Random rng(testing::TestSeed());
  std::vector<std::string> keys, values;
  for (int i = 0; i < 500; ++i) {
    keys.push_back("emb/" + std::to_string(i));
    values.push_back(RandomValue(rng, kRow));
  }
  std::vector<PutItem> items;
  for (int i = 0; i < 500; ++i) {
    if (i % 7 == 3) continue;  // misses
    items.push_back({keys[i], values[i].data(), kRow, {DType::kU8, {int64_t{kRow}}}});
  }
  ASSERT_TRUE(client->Put("emb/short", "abc", 3).ok());
  for (auto& r : client->MultiPut(items)) ASSERT_TRUE(r.ok()) << r.status().ToString();

  std::vector<std::string> query = keys;
  query.push_back("emb/short");  // the wrong size: refused, row untouched
  std::string dst(query.size() * kStride, '\x5a');
  auto res = client->MultiGetInto(query, dst.data(), kStride, kRow);
  ASSERT_EQ(res.size(), query.size());
  for (size_t i = 0; i < query.size(); ++i) {
    std::string_view row(dst.data() + i * kStride, kRow);
    std::string_view pad(dst.data() + i * kStride + kRow, kStride - kRow);
    EXPECT_EQ(pad, std::string(kStride - kRow, '\x5a')) << i;
    if (i == 500) {
      EXPECT_EQ(res[i].code(), StatusCode::kInvalidArgument) << res[i].ToString();
      EXPECT_EQ(row, std::string(kRow, '\x5a'));
    } else if (i % 7 == 3) {
      EXPECT_EQ(res[i].code(), StatusCode::kNotFound) << i;
      EXPECT_EQ(row, std::string(kRow, '\x5a')) << i;
    } else {
      ASSERT_TRUE(res[i].ok()) << i << ": " << res[i].ToString();
      EXPECT_TRUE(row == values[i]) << i;
    }
  }
  // One mget per node, not per key.
  int mgets = 0;
  for (int n = 0; n < 3; ++n) {
    std::string s = *client->NodeStats(n);
    auto at = s.find("\"mget\":");
    ASSERT_NE(at, std::string::npos);
    mgets += std::stoi(s.substr(at + 7));
  }
  EXPECT_EQ(mgets, 3);

  // `accept` sees the metadata first: a refused value writes nothing, in both calls.
  GetOptions f32_only;
  f32_only.accept = [](const ValueInfo& info) {
    return info.tensor.dtype == DType::kF32 ? Status::OK() : Status::InvalidArgument("not f32");
  };
  std::string one(kRow, '\0');
  auto r = client->GetInto(keys[0], one.data(), one.size(), f32_only);
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(one, std::string(kRow, '\0'));
  std::string two(2 * kRow, '\0');
  auto refused = client->MultiGetInto({keys[0], keys[1]}, two.data(), kRow, kRow, f32_only);
  EXPECT_EQ(refused[0].code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(refused[1].code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(two, std::string(2 * kRow, '\0'));
  EXPECT_TRUE(client->MultiGetInto({}, nullptr, kRow, kRow).empty());
}

// Batches of many small rows (2,400 rows: a metadata block of tens of KiB) and of a few large
// values (rendezvous transfers) arrive whole, for MultiPut, MultiGet and MultiGetInto.
TEST(IntegrationTest, BatchesOfManyRowsAndOfLargeValuesArriveWhole) {
  Cluster cluster(3);
  auto client = cluster.NewClient();
  ASSERT_TRUE(client);
  Random rng(testing::TestSeed());
  for (const auto& [rows, row_bytes] : {std::pair<int, size_t>{2400, 64}, {12, 300 << 10}}) {
    SCOPED_TRACE(std::to_string(rows) + " rows of " + std::to_string(row_bytes) + " bytes");
    std::vector<std::string> keys, values;
    std::vector<PutItem> items;
    for (int i = 0; i < rows; ++i) {
      keys.push_back("big/" + std::to_string(row_bytes) + "/" + std::to_string(i));
      values.push_back(RandomValue(rng, row_bytes));
    }
    for (int i = 0; i < rows; ++i) {
      if (i % 5 == 2) continue;  // misses
      items.push_back({keys[i], values[i].data(), row_bytes, {}});
    }
    for (auto& r : client->MultiPut(items)) ASSERT_TRUE(r.ok()) << r.status().ToString();
    auto got = client->MultiGet(keys);
    ASSERT_EQ(got.size(), keys.size());
    std::string dst(keys.size() * row_bytes, '\x5a');
    auto into = client->MultiGetInto(keys, dst.data(), row_bytes, row_bytes);
    ASSERT_EQ(into.size(), keys.size());
    for (int i = 0; i < rows; ++i) {
      std::string_view row(dst.data() + i * row_bytes, row_bytes);
      if (i % 5 == 2) {
        EXPECT_EQ(got[i].status().code(), StatusCode::kNotFound) << i;
        EXPECT_EQ(into[i].code(), StatusCode::kNotFound) << i;
        EXPECT_TRUE(row == std::string(row_bytes, '\x5a')) << i;
        continue;
      }
      ASSERT_TRUE(got[i].ok()) << i << ": " << got[i].status().ToString();
      EXPECT_TRUE(got[i]->view() == values[i]) << i;
      ASSERT_TRUE(into[i].ok()) << i << ": " << into[i].ToString();
      EXPECT_TRUE(row == values[i]) << i;
    }
  }
}

TEST(IntegrationTest, MultiGetIntoReportsADeadNodeAndServesTheOthers) {
  Cluster cluster(3);
  auto client = cluster.NewClient(std::chrono::milliseconds(800));
  ASSERT_TRUE(client);
  std::vector<std::string> keys;
  for (int i = 0; i < 60; ++i) {
    keys.push_back("k" + std::to_string(i));
    ASSERT_TRUE(client->Put(keys.back(), keys.back().data(), 2).ok());
  }
  cluster.StopNode(1, SIGKILL);
  std::string dst(keys.size() * 2, '\0');
  auto start = std::chrono::steady_clock::now();
  auto res = client->MultiGetInto(keys, dst.data(), 2, 2);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(3));
  int failed = 0;
  for (size_t i = 0; i < keys.size(); ++i) {
    if (client->NodeFor(keys[i]) == 1) {
      ++failed;
      EXPECT_TRUE(res[i].code() == StatusCode::kUnavailable ||
                  res[i].code() == StatusCode::kTimeout)
          << res[i].ToString();
    } else {
      ASSERT_TRUE(res[i].ok()) << res[i].ToString();
      EXPECT_EQ(dst.substr(i * 2, 2), keys[i].substr(0, 2));
    }
  }
  EXPECT_GT(failed, 0);
  GetOptions open;
  open.fail_open = true;
  for (auto& s : client->MultiGetInto(keys, dst.data(), 2, 2, open)) {
    EXPECT_TRUE(s.ok() || s.IsNotFound()) << s.ToString();
  }
}

// A node marked down fails a batch at once, inside the loop that issues the batch's messages;
// the call must not return while that loop still reads the caller's state (a crash before).
TEST(IntegrationTest, CallsToADownNodeFailFastAndSafely) {
  Cluster cluster(1);
  auto client = cluster.NewClient(std::chrono::milliseconds(500));
  ASSERT_TRUE(client);
  ASSERT_TRUE(client->Put("k", "v", 1).ok());
  cluster.StopNode(0, SIGKILL);
  (void)client->Get("k");  // notices the loss; the node is down for the backoff now
  char row[1];
  const std::vector<PutItem> items = {{"k", "v", 1, {}}};
  auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < 200; ++i) {
    EXPECT_FALSE(client->MultiGetInto({"k"}, row, 1, 1)[0].ok());
    EXPECT_FALSE(client->MultiGet({"k"})[0].ok());
    EXPECT_FALSE(client->MultiPut(items)[0].ok());
    EXPECT_FALSE(client->Delete("k").ok());
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(20));
}

TEST(IntegrationTest, SeveralClientThreadsAtOnce) {
  Cluster cluster(3);
  auto client = cluster.NewClient(std::chrono::seconds(20));
  ASSERT_TRUE(client);
  const uint64_t seed = testing::TestSeed();
  std::atomic<int> errors{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      Random rng(seed + t);
      for (int i = 0; i < 100; ++i) {
        std::string key = "t" + std::to_string(t) + "/" + std::to_string(i % 20);
        std::string value = RandomValue(rng, rng.Uniform(1, 200000));
        if (!client->Put(key, value.data(), value.size()).ok()) errors++;
        auto got = client->Get(key);
        if (!got.ok() || got->view() != value) errors++;
        if (i % 10 == 0) {
          auto fut = client->GetAsync(key);
          auto r = fut.get();
          if (!r.ok() || r->view() != value) errors++;
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(errors.load(), 0);
}

// A synchronous call completes on the caller's own thread (it drives the client's transport
// while it waits: GetInto's `accept` runs there), while async callbacks still run on the
// client's I/O thread, never on a thread that sits in a synchronous call (it may hold locks).
TEST(IntegrationTest, SyncCallsCompleteOnTheCallersThreadAndCallbacksOnTheIoThread) {
  if (const char* e = getenv("GKV_CALLER_DRIVES"); e != nullptr && std::string_view(e) == "0") {
    GTEST_SKIP() << "GKV_CALLER_DRIVES=0: every call hands off to the I/O thread";
  }
  Cluster cluster(1);
  auto client = cluster.NewClient(std::chrono::seconds(20));
  ASSERT_TRUE(client);
  for (int i = 0; i < 8; ++i) {
    const std::string v = "value-" + std::to_string(i);
    ASSERT_TRUE(client->Put("k" + std::to_string(i), v.data(), v.size()).ok());
  }
  // Alone: at least some calls are completed by the caller itself.
  const auto self = std::this_thread::get_id();
  int accepted_here = 0;
  GetOptions go;
  go.accept = [&](const ValueInfo&) {
    if (std::this_thread::get_id() == self) accepted_here++;
    return Status::OK();
  };
  char buf[64];
  for (int i = 0; i < 200; ++i) {
    auto r = client->GetInto("k" + std::to_string(i % 8), buf, sizeof buf, go);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    ASSERT_EQ(std::string_view(buf, r->size), "value-" + std::to_string(i % 8));
  }
  std::cout << accepted_here << " of 200 synchronous calls completed on the caller's thread\n";
  EXPECT_GT(accepted_here, 0) << "no synchronous call was completed on the caller's thread";

  // A synchronous caller beside async callbacks: no callback runs on the synchronous thread.
  std::atomic<bool> stop{false};
  std::atomic<int> sync_errors{0};
  std::promise<std::thread::id> sync_id;
  std::thread sync_caller([&] {
    sync_id.set_value(std::this_thread::get_id());
    for (int i = 0; !stop.load(); ++i) {
      auto r = client->Get("k" + std::to_string(i % 8));
      if (!r.ok() || r->view() != "value-" + std::to_string(i % 8)) sync_errors++;
    }
  });
  const std::thread::id sync_thread = sync_id.get_future().get();
  std::mutex mu;
  std::condition_variable cv;
  int done = 0, on_sync_thread = 0, wrong = 0;
  constexpr int kAsync = 300;
  for (int i = 0; i < kAsync; ++i) {
    const std::string want = "value-" + std::to_string(i % 8);
    client->GetAsync("k" + std::to_string(i % 8), {}, [&, want](Result<Value> r) {
      std::lock_guard<std::mutex> lock(mu);
      if (std::this_thread::get_id() == sync_thread) on_sync_thread++;
      if (!r.ok() || r->view() != want) wrong++;
      done++;
      cv.notify_all();
    });
    if (i % 16 == 15) std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  {
    // EXPECT, not ASSERT: the synchronous caller is stopped and joined either way.
    std::unique_lock<std::mutex> lock(mu);
    EXPECT_TRUE(cv.wait_for(lock, std::chrono::seconds(30), [&] { return done == kAsync; }))
        << done << " of " << kAsync << " callbacks ran";
  }
  stop = true;
  sync_caller.join();
  client.reset();  // any callback still due runs (or is dropped) while mu and cv live
  EXPECT_EQ(on_sync_thread, 0);
  EXPECT_EQ(wrong, 0);
  EXPECT_EQ(sync_errors.load(), 0);
}

TEST(IntegrationTest, AValueThatFitsNoNodeIsRefusedClearly) {
  NodeSpec spec;
  spec.host_mem = "8MiB";
  spec.disk_capacity = "16MiB";
  Cluster cluster(3, spec);
  auto client = cluster.NewClient(std::chrono::seconds(20));
  ASSERT_TRUE(client);
  std::string big(32 << 20, 'b');
  auto r = client->Put("too-big", big.data(), big.size());
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kNoSpace);
  EXPECT_NE(r.status().message().find("larger than every tier"), std::string_view::npos)
      << r.status().ToString();
  // The node goes on serving.
  ASSERT_TRUE(client->Put("small", "ok", 2).ok());
  EXPECT_EQ(client->Get("small")->view(), "ok");
}

TEST(IntegrationTest, OverflowSpillsToDiskAndReadsBackIntact) {
  NodeSpec spec;
  spec.host_mem = "4MiB";
  spec.disk_capacity = "512MiB";
  Cluster cluster(1, spec);
  auto client = cluster.NewClient(std::chrono::seconds(20));
  ASSERT_TRUE(client);
  Random rng(testing::TestSeed());
  std::vector<std::string> values;
  for (int i = 0; i < 24; ++i) {
    values.push_back(RandomValue(rng, 1 << 20));
    ASSERT_TRUE(client->Put("shard/" + std::to_string(i), values[i].data(), values[i].size()).ok());
  }
  EXPECT_EQ(client->Stat("shard/0")->tier, "disk");
  EXPECT_EQ(client->Stat("shard/23")->tier, testing::TopMemoryTier());
  for (int i = 0; i < 24; ++i) {
    auto got = client->Get("shard/" + std::to_string(i));
    ASSERT_TRUE(got.ok()) << i << ": " << got.status().ToString();
    EXPECT_TRUE(got->view() == values[i]) << i;
  }
  // Spilled from memory to disk: from the host tier, or (fake-device mode with a GPU tier
  // behind host memory) from the GPU tier.
  const uint64_t to_disk = testing::StatsCounter(*client, 0, "objects", "\"host_to_disk\":{") +
                           testing::StatsCounter(*client, 0, "objects", "\"gpu_to_disk\":{");
  EXPECT_GT(to_disk, 0u) << *client->NodeStats(0);
}

TEST(IntegrationTest, DeadNodeFailsFastAndOthersKeepServing) {
  Cluster cluster(3);
  auto client = cluster.NewClient(std::chrono::milliseconds(800));
  ASSERT_TRUE(client);
  // Find keys owned by node 1 and node 0.
  std::string on1, on0;
  for (int i = 0; on1.empty() || on0.empty(); ++i) {
    std::string k = "k" + std::to_string(i);
    if (client->NodeFor(k) == 1 && on1.empty()) on1 = k;
    if (client->NodeFor(k) == 0 && on0.empty()) on0 = k;
  }
  ASSERT_TRUE(client->Put(on1, "v1", 2).ok());
  ASSERT_TRUE(client->Put(on0, "v0", 2).ok());
  cluster.StopNode(1, SIGKILL);
  auto start = std::chrono::steady_clock::now();
  auto r = client->Get(on1);
  auto elapsed = std::chrono::steady_clock::now() - start;
  ASSERT_FALSE(r.ok());
  EXPECT_TRUE(r.status().code() == StatusCode::kUnavailable ||
              r.status().code() == StatusCode::kTimeout)
      << r.status().ToString();
  EXPECT_LT(elapsed, std::chrono::seconds(3));
  EXPECT_EQ(client->Get(on0)->view(), "v0");
}

TEST(IntegrationTest, SigtermStopsCleanlyAndDurableDataSurvivesRestart) {
  Cluster cluster(1);
  {
    auto client = cluster.NewClient();
    ASSERT_TRUE(client);
    PutOptions durable;
    durable.durable = true;
    ASSERT_TRUE(client->Put("keep/durable", "precious", 8, durable).ok());
    ASSERT_TRUE(client->Put("keep/plain", "flushed", 7).ok());
  }
  EXPECT_EQ(cluster.StopNode(0, SIGTERM), 0);
  cluster.StartNode(0);
  cluster.WaitReady();
  auto client = cluster.NewClient();
  ASSERT_TRUE(client);
  EXPECT_EQ(client->Get("keep/durable")->view(), "precious");
  // A graceful stop writes memory entries back, so this one is there too.
  EXPECT_EQ(client->Get("keep/plain")->view(), "flushed");
}

TEST(IntegrationTest, ServerRefusesToStartOnABusyPortOrBadDisk) {
  Cluster cluster(1);
  // Same node id, same port: must exit non-zero with a message.
  std::string cmd = std::string(GKV_SERVER_BIN) + " --cluster " + cluster.cluster_file() +
                    " --node n0 --host-mem 16MiB 2>/dev/null";
  int rc = std::system(cmd.c_str());
  EXPECT_NE(WEXITSTATUS(rc), 0);
  cmd = std::string(GKV_SERVER_BIN) + " --cluster " + cluster.cluster_file() +
        " --node n0 --host-mem 16MiB --disk /proc/nope/db 2>/dev/null";
  rc = std::system(cmd.c_str());
  EXPECT_NE(WEXITSTATUS(rc), 0);
  cmd = std::string(GKV_SERVER_BIN) + " --cluster " + cluster.cluster_file() +
        " --node nobody 2>/dev/null";
  rc = std::system(cmd.c_str());
  EXPECT_EQ(WEXITSTATUS(rc), 1);
}

}  // namespace
}  // namespace gkv
