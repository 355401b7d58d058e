// gkv-gpu-check: the cluster half of scripts/gpu-check.sh. Against running nodes with a GPU tier
// it checks, with every byte compared, that
//   1. a client puts from and gets into cudaMalloc buffers for each size (4 KiB .. 256 MiB by
//      default), and times both (p50 over repetitions, GB/s), next to cudaMemcpy device to
//      device and pinned host <-> device of the same sizes measured in the same run;
//   2. values written past the GPU and host tiers spill GPU -> host -> disk and read back
//      intact, and reads bring them back up (promotion), as the nodes' stats show.
// A missing GPU is a failure (exit 2), never a skip. In fake-device mode (GKV_FAKE_DEVICE, the
// script's CPU mode) the same code runs on host memory standing in for the GPU, so the check
// itself cannot rot; its figures then measure memcpy, not a GPU.
// Exit status: 0 all checks passed, 1 a check failed, 2 it could not run.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "gkv/client.h"
#include "gkv/cuda.h"
#include "gkv/random.h"
#include "gkv/size.h"

namespace gkv {
namespace {

using Clock = std::chrono::steady_clock;

// Device or pinned host memory, freed on scope exit.
class Buffer {
 public:
  static Result<Buffer> Device(size_t size) {
    auto p = CudaMallocDevice(0, size);
    if (!p.ok()) return p.status();
    return Buffer(*p, size, true);
  }
  static Result<Buffer> Pinned(size_t size) {
    auto p = CudaMallocPinnedHost(size);
    if (!p.ok()) return p.status();
    return Buffer(*p, size, false);
  }
  Buffer(Buffer&& o) noexcept : p_(o.p_), size_(o.size_), device_(o.device_) { o.p_ = nullptr; }
  Buffer(const Buffer&) = delete;
  ~Buffer() {
    if (!p_) return;
    if (device_) {
      CudaFreeDevice(0, p_);
    } else {
      CudaFreePinnedHost(p_);
    }
  }
  void* get() const { return p_; }
  size_t size() const { return size_; }

 private:
  Buffer(void* p, size_t size, bool device) : p_(p), size_(size), device_(device) {}
  void* p_;
  size_t size_;
  bool device_;
};

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

// Repetitions for a size: about 1 GiB moved per measurement, between 3 and `max_reps`.
int RepsFor(size_t size, int max_reps) {
  const size_t by_bytes = (size_t{1} << 30) / std::max<size_t>(size, 1);
  const size_t most = static_cast<size_t>(std::max(3, max_reps));
  return static_cast<int>(std::clamp<size_t>(by_bytes, 3, most));
}

// Seconds of one call, median over `reps` (after one warm-up call). A failed call ends it.
template <typename F>
Result<double> TimeMedian(int reps, F&& call) {
  GKV_RETURN_IF_ERROR(call());
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    const auto t0 = Clock::now();
    GKV_RETURN_IF_ERROR(call());
    t.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
  }
  return Median(t);
}

// Fills a device buffer with fresh random bytes (through `host`, pinned, at least as big).
Status FillRandom(Random& rng, void* dev, void* host, size_t size) {
  rng.Fill(host, size);
  return CudaCopySync(dev, host, size);
}

// Overwrites a device buffer with a pattern no value has, so an unwritten byte shows.
Status Poison(void* dev, void* host, size_t size) {
  std::memset(host, 0xA5, size);
  return CudaCopySync(dev, host, size);
}

// Compares a device buffer with the expected host bytes; reports the first difference.
Status CheckBytes(const void* dev, const void* expect, void* scratch, size_t size,
                  const std::string& what) {
  GKV_RETURN_IF_ERROR(CudaCopySync(scratch, dev, size));
  if (std::memcmp(scratch, expect, size) == 0) return Status::OK();
  const auto* a = static_cast<const unsigned char*>(scratch);
  const auto* b = static_cast<const unsigned char*>(expect);
  size_t i = 0;
  while (a[i] == b[i]) ++i;
  size_t bad = 0;
  for (size_t j = 0; j < size; ++j) bad += a[j] != b[j];
  return Status::Internal(what + ": " + std::to_string(bad) + " of " + std::to_string(size) +
                          " bytes differ, the first at offset " + std::to_string(i));
}

// Objects moved between two tiers, summed over every node's stats (moves.FROM_to_TO.objects).
uint64_t Moves(Client& c, const std::string& from_to) {
  uint64_t total = 0;
  for (size_t n = 0; n < c.cluster().nodes.size(); ++n) {
    auto s = c.NodeStats(static_cast<int>(n));
    if (!s.ok()) continue;
    const std::string field = "\"" + from_to + "\":{\"objects\":";
    const size_t at = s->find(field);
    if (at != std::string::npos) total += std::stoull(s->substr(at + field.size()));
  }
  return total;
}

struct Row {
  size_t size;
  double put_s, get_s, d2d_s, h2d_s, d2h_s;
  std::string tier;  // where the node held the value when it answered the last get
};

double GBps(size_t size, double s) { return s > 0 ? size / s / 1e9 : 0; }

int Run(int argc, char** argv) {
  CLI::App app{"gkv-gpu-check: GPU-tier puts and gets from and into device buffers, checked"};
  std::string cluster_file, sizes_arg = "4KiB,16KiB,64KiB,256KiB,1MiB,4MiB,16MiB,64MiB,256MiB";
  std::string spill_value = "4MiB";
  std::string expect_tier;
  int spill_values = 0, max_reps = 50;
  app.add_option("--cluster", cluster_file, "the nodes' cluster file")->required();
  app.add_option("--sizes", sizes_arg, "comma-separated value sizes");
  app.add_option("--reps", max_reps, "at most this many timed repetitions per size");
  app.add_option("--spill-values", spill_values,
                 "values written for the spill and promotion check (0: skip it); choose more "
                 "than the nodes' GPU and host tiers hold together");
  app.add_option("--spill-value-size", spill_value, "size of each of those values");
  app.add_option("--expect-tier", expect_tier,
                 "gpu | host: the tier each timed value must be served from (a check fails "
                 "when a get was answered from another one); empty: only reported");
  CLI11_PARSE(app, argc, argv);

  const CudaProbe& probe = ProbeCuda();
  if (!probe.usable) {
    std::fprintf(stderr, "gkv-gpu-check: FAILED: no usable GPU: %s\n", probe.reason.c_str());
    return 2;
  }
  std::vector<size_t> sizes;
  for (size_t pos = 0; pos <= sizes_arg.size();) {
    size_t comma = sizes_arg.find(',', pos);
    if (comma == std::string::npos) comma = sizes_arg.size();
    auto s = ParseSize(sizes_arg.substr(pos, comma - pos));
    if (!s.ok() || *s == 0) {
      std::fprintf(stderr, "gkv-gpu-check: bad size in --sizes: %s\n", sizes_arg.c_str());
      return 2;
    }
    sizes.push_back(*s);
    pos = comma + 1;
  }
  auto spill_size = ParseSize(spill_value);
  if (!spill_size.ok() || *spill_size == 0) {
    std::fprintf(stderr, "gkv-gpu-check: bad --spill-value-size\n");
    return 2;
  }
  ClientOptions co;
  co.cluster_file = cluster_file;
  co.default_timeout = std::chrono::seconds(60);
  auto opened = Client::Open(co);
  if (!opened.ok()) {
    std::fprintf(stderr, "gkv-gpu-check: %s\n", opened.status().ToString().c_str());
    return 2;
  }
  Client& client = **opened;
  std::printf("gkv-gpu-check: %s, %zu node(s)\n",
              probe.fake ? "FAKE DEVICE (host memory standing in for a GPU)" : "GPU 0",
              client.cluster().nodes.size());

  const size_t largest = std::max(*std::max_element(sizes.begin(), sizes.end()), *spill_size);
  auto src = Buffer::Device(largest), dst = Buffer::Device(largest);
  auto host = Buffer::Pinned(largest), scratch = Buffer::Pinned(largest);
  for (const Status& s : {src.status(), dst.status(), host.status(), scratch.status()}) {
    if (!s.ok()) {
      std::fprintf(stderr, "gkv-gpu-check: FAILED: cannot allocate %s buffers: %s\n",
                   FormatSize(largest).c_str(), s.ToString().c_str());
      return 2;
    }
  }
  Random rng(20261204);
  int failures = 0, passed = 0;
  auto fail = [&](const Status& s) {
    ++failures;
    std::printf("FAILED: %s\n", s.ToString().c_str());
  };

  // 1. Round trips and timings, size by size.
  std::vector<Row> rows;
  for (size_t size : sizes) {
    const std::string key = "gpu-check/" + std::to_string(size);
    const int reps = RepsFor(size, max_reps);
    Row row{size, 0, 0, 0, 0, 0, ""};
    Status st = FillRandom(rng, src->get(), host->get(), size);
    PutOptions po;
    po.memory = BufferMemory::kDevice;
    GetOptions go;
    go.memory = BufferMemory::kDevice;
    auto put = [&]() -> Status { return client.Put(key, src->get(), size, po).status(); };
    auto get = [&]() -> Status {
      auto r = client.GetInto(key, dst->get(), size, go);
      if (r.ok() && r->size != size) return Status::Internal("get returned a wrong size");
      if (r.ok()) row.tier = r->tier;
      if (r.ok() && !expect_tier.empty() && r->tier != expect_tier) {
        return Status::Internal("served from the " + r->tier + " tier, not " + expect_tier);
      }
      return r.status();
    };
    // A get into a poisoned device buffer brings back exactly the bytes put.
    auto verified_get = [&](const std::string& when) -> Status {
      GKV_RETURN_IF_ERROR(Poison(dst->get(), scratch->get(), size));
      GKV_RETURN_IF_ERROR(get());
      return CheckBytes(dst->get(), host->get(), scratch->get(), size,
                        "get of " + FormatSize(size) + " " + when);
    };
    // Correctness first: the bytes that came back are the bytes that went.
    if (st.ok()) st = put();
    if (st.ok()) st = verified_get("into a device buffer");
    if (!st.ok()) {
      fail(st.WithContext(FormatSize(size)));
      continue;
    }
    auto tp = TimeMedian(reps, put);
    auto tg = TimeMedian(reps, get);
    auto d2d = TimeMedian(reps, [&] { return CudaCopySync(dst->get(), src->get(), size); });
    auto h2d = TimeMedian(reps, [&] { return CudaCopySync(dst->get(), host->get(), size); });
    auto d2h = TimeMedian(reps, [&] { return CudaCopySync(scratch->get(), src->get(), size); });
    for (const Status& s : {tp.status(), tg.status(), d2d.status(), h2d.status(), d2h.status()}) {
      if (!s.ok()) st = s;
    }
    // And once more after the timed calls (the value was rewritten by each timed put).
    if (st.ok()) st = verified_get("after the timed calls");
    if (!st.ok()) {
      fail(st.WithContext(FormatSize(size)));
      continue;
    }
    row.put_s = *tp;
    row.get_s = *tg;
    row.d2d_s = *d2d;
    row.h2d_s = *h2d;
    row.d2h_s = *d2h;
    rows.push_back(row);
    ++passed;
    (void)client.Delete(key);
  }

  // 2. Spill GPU -> host -> disk, and promotion back, bytes checked on every read.
  if (spill_values > 0) {
    const int failures_before = failures;
    const size_t vs = *spill_size;
    // Moves summed over the nodes. Which way the memory tiers spill depends on the nodes'
    // placement (a GPU tier behind host memory takes what host memory spills), so the check
    // asks for moves between the memory tiers, moves down to disk, and promotions from it.
    auto moves = [&] {
      return std::vector<uint64_t>{Moves(client, "gpu_to_host") + Moves(client, "host_to_gpu"),
                                   Moves(client, "gpu_to_disk") + Moves(client, "host_to_disk"),
                                   Moves(client, "disk_to_gpu") + Moves(client, "disk_to_host")};
    };
    const std::vector<uint64_t> before = moves();
    auto value_of = [&](int i) {  // value i's bytes, into host (seeded by i: reproducible)
      Random r(1000 + i);
      r.Fill(host->get(), vs);
    };
    PutOptions po;
    po.memory = BufferMemory::kDevice;
    GetOptions go;
    go.memory = BufferMemory::kDevice;
    int written = 0, checked = 0;
    for (int i = 0; i < spill_values; ++i) {
      value_of(i);
      Status st = CudaCopySync(src->get(), host->get(), vs);
      if (st.ok()) st = client.Put("spill/" + std::to_string(i), src->get(), vs, po).status();
      if (!st.ok()) {
        fail(st.WithContext("spill put " + std::to_string(i)));
        break;
      }
      ++written;
    }
    std::vector<std::string> tiers_seen;
    for (int pass = 0; pass < 2; ++pass) {  // the second read of a lower-tier value promotes it
      for (int i = 0; i < written; ++i) {
        value_of(i);
        Status st = Poison(dst->get(), scratch->get(), vs);
        Result<ValueInfo> got =
            st.ok() ? client.GetInto("spill/" + std::to_string(i), dst->get(), vs, go)
                    : Result<ValueInfo>(st);
        if (got.ok()) {
          if (pass == 0) tiers_seen.push_back(got->tier);
          st = CheckBytes(dst->get(), host->get(), scratch->get(), vs,
                          "spilled value " + std::to_string(i) + " (read from " + got->tier + ")");
        } else {
          st = got.status();
        }
        if (!st.ok()) {
          fail(st.WithContext("spill read " + std::to_string(i)));
        } else {
          ++checked;
        }
      }
    }
    std::vector<uint64_t> after = moves();
    for (size_t k = 0; k < after.size(); ++k) after[k] -= before[k];
    auto count = [&](const char* t) { return std::count(tiers_seen.begin(), tiers_seen.end(), t); };
    std::printf(
        "spill: %d values of %s written, %d reads checked; first reads served from gpu %ld, "
        "host %ld, disk %ld; moves between GPU and host %llu, down to disk %llu, promotions "
        "from disk %llu\n",
        written, FormatSize(vs).c_str(), checked, static_cast<long>(count("gpu")),
        static_cast<long>(count("host")), static_cast<long>(count("disk")),
        static_cast<unsigned long long>(after[0]), static_cast<unsigned long long>(after[1]),
        static_cast<unsigned long long>(after[2]));
    if (after[0] == 0) fail(Status::Internal("nothing moved between the GPU and host tiers"));
    if (after[1] == 0 || count("disk") == 0) {
      fail(
          Status::Internal("nothing spilled to disk: write more --spill-values than the GPU "
                           "and host tiers hold"));
    }
    if (after[2] == 0) fail(Status::Internal("no value was promoted by its second read"));
    for (int i = 0; i < written; ++i) (void)client.Delete("spill/" + std::to_string(i));
    if (failures == failures_before) ++passed;
  }

  // The table: the cluster's GPU-tier paths next to the copies they are bounded by.
  std::printf("\n%10s %5s | %9s %9s | %9s %9s | %9s %11s %11s\n", "size", "tier", "put GB/s",
              "put p50", "get GB/s", "get p50", "D2D GB/s", "H2D pinned", "D2H pinned");
  for (const Row& r : rows) {
    std::printf("%10s %5s | %9.2f %7.0fus | %9.2f %7.0fus | %9.2f %11.2f %11.2f\n",
                FormatSize(r.size).c_str(), r.tier.c_str(), GBps(r.size, r.put_s), r.put_s * 1e6,
                GBps(r.size, r.get_s), r.get_s * 1e6, GBps(r.size, r.d2d_s), GBps(r.size, r.h2d_s),
                GBps(r.size, r.d2h_s));
  }
  std::printf("(p50 over repetitions; D2D counts the bytes once; %s)\n",
              probe.fake ? "FAKE DEVICE: these figures are memcpy on host memory, not a GPU"
                         : "cudaMemcpy on the default stream");
  std::printf("gkv-gpu-check: %d checks passed, %d failed\n", passed, failures);
  return failures == 0 ? 0 : 1;
}

}  // namespace
}  // namespace gkv

int main(int argc, char** argv) { return gkv::Run(argc, argv); }
