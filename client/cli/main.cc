// gkv: command-line tool for a gkv cluster.
//   gkv --cluster FILE put KEY (--file F | --value TEXT) [--dtype T --shape 2,3] [--durable]
//   gkv --cluster FILE get KEY [--output F]
//   gkv --cluster FILE del KEY | stat KEY | stats [--json] | ring | ping
//   gkv --cluster FILE drain NODE      (membership: etcd) the node hands its keys off and leaves
//   gkv --cluster FILE undrain NODE    (membership: etcd) withdraws a drain not yet begun
// With `membership: etcd`, `ring`, `drain` and `undrain` read and write etcd only (no node is
// contacted).
// Exit codes: 0 success, 1 not found, 2 usage, 3 the cluster could not be reached, 4 any other
// error. Errors are one line on stderr.
#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iostream>
#include <sstream>

#include "gkv/client.h"
#include "gkv/log.h"
#include "gkv/membership.h"
#include "gkv/size.h"

namespace {

constexpr int kOk = 0, kNotFound = 1, kUsage = 2, kUnreachable = 3, kFailed = 4;

int ExitFor(const gkv::Status& s, const std::string& what) {
  std::fprintf(stderr, "gkv: %s: %s\n", what.c_str(), s.ToString().c_str());
  switch (s.code()) {
    case gkv::StatusCode::kNotFound:
      return kNotFound;
    case gkv::StatusCode::kUnavailable:
    case gkv::StatusCode::kTimeout:
      return kUnreachable;
    case gkv::StatusCode::kInvalidArgument:
      return kUsage;
    default:
      return kFailed;
  }
}

std::string Describe(const gkv::ValueInfo& i) {
  std::string out = "size " + std::to_string(i.size) + " version " + std::to_string(i.version) +
                    " tier " + i.tier + (i.on_disk ? " (on disk)" : "");
  if (i.tensor.is_tensor()) out = "tensor " + i.tensor.ToString() + " " + out;
  return out;
}

// "n0" -> {...}; a tiny reader for the fixed-order stats JSON.
uint64_t Num(const std::string& j, std::initializer_list<const char*> path) {
  size_t at = 0;
  for (const char* p : path) {
    at = j.find(p, at);
    if (at == std::string::npos) return 0;
    at += std::strlen(p);
  }
  return std::strtoull(j.c_str() + at, nullptr, 10);
}

// After a ring table: the largest and smallest share relative to the node's weight share, so
// an operator sees imbalance at a glance (1.00 is exact; 1,024 points per unit of weight give
// a few percent either way).
void PrintBalance(const std::vector<gkv::NodeInfo>& nodes, const std::vector<double>& shares) {
  if (nodes.empty() || shares.size() != nodes.size()) return;
  double total_weight = 0;
  for (const auto& n : nodes) total_weight += n.weight;
  size_t most = 0, least = 0;
  std::vector<double> ratio(nodes.size());
  for (size_t i = 0; i < nodes.size(); ++i) {
    ratio[i] = shares[i] / (nodes[i].weight / total_weight);
    if (ratio[i] > ratio[most]) most = i;
    if (ratio[i] < ratio[least]) least = i;
  }
  std::printf("share / weight share: largest %.3f (%s), smallest %.3f (%s); placement version %u\n",
              ratio[most], nodes[most].id.c_str(), ratio[least], nodes[least].id.c_str(),
              gkv::HashRing::kPlacementVersion);
}

// `gkv ring` with membership in etcd: every registered member, the ring's share of each.
int PrintEtcdRing(const gkv::EtcdConfig& etcd) {
  auto view = gkv::ReadMembership(etcd);
  if (!view.ok()) return ExitFor(view.status(), "reading the membership from etcd");
  const std::vector<gkv::NodeInfo> ring_nodes = view->RingNodes();
  std::vector<double> shares;
  if (!ring_nodes.empty()) shares = gkv::HashRing(ring_nodes).Shares();
  std::printf("epoch %llu, revision %llu, %zu members, %zu in the ring\n",
              (unsigned long long)view->epoch, (unsigned long long)view->revision,
              view->members.size(), ring_nodes.size());
  std::printf("%-10s %-24s %8s %8s  %s\n", "node", "address", "weight", "share", "state");
  for (const auto& m : view->members) {
    double share = 0;
    for (size_t i = 0; i < ring_nodes.size(); ++i) {
      if (ring_nodes[i].id == m.node.id) share = shares[i];
    }
    std::string state =
        m.placement != gkv::HashRing::kPlacementVersion
            ? "placement version " + std::to_string(m.placement) +
                  " (this build: " + std::to_string(gkv::HashRing::kPlacementVersion) +
                  "): not in the ring"
        : m.draining                             ? "draining"
        : view->drain_requested.count(m.node.id) ? "drain requested"
                                                 : "serving";
    if (view->handoffs_running.count(m.node.id)) state += ", handoff running";
    std::printf("%-10s %-24s %8.2f %7.2f%%  %s\n", m.node.id.c_str(), m.node.address().c_str(),
                m.node.weight, share * 100, state.c_str());
  }
  // Keys of ids that are not registered (a drain key written by a build whose drain keys had
  // no lease outlives its node: `gkv undrain` removes it).
  for (const auto& id : view->drain_requested) {
    if (!view->Find(id)) std::printf("%-10s drain requested, not registered\n", id.c_str());
  }
  for (const auto& id : view->handoffs_running) {
    if (!view->Find(id)) std::printf("%-10s handoff running, not registered\n", id.c_str());
  }
  PrintBalance(ring_nodes, shares);
  return kOk;
}

int Drain(const gkv::EtcdConfig& etcd, const std::string& node) {
  auto view = gkv::ReadMembership(etcd);
  if (!view.ok()) return ExitFor(view.status(), "reading the membership from etcd");
  const gkv::MemberRecord* member = view->Find(node);
  if (member && (member->draining || view->drain_requested.count(node))) {
    std::printf("%s is %s already\n", node.c_str(),
                member->draining ? "draining" : "asked to drain");
    return kOk;
  }
  gkv::Status s = gkv::RequestDrain(etcd, node);
  if (!s.ok()) return ExitFor(s, "drain " + node);
  std::printf(
      "asked %s (%s) to drain: it leaves the ring, hands its keys off to the others and exits; "
      "`gkv ring` shows its progress\n",
      node.c_str(), member ? member->node.address().c_str() : "?");
  return kOk;
}

int Undrain(const gkv::EtcdConfig& etcd, const std::string& node) {
  gkv::Status s = gkv::CancelDrain(etcd, node);
  if (!s.ok()) return ExitFor(s, "undrain " + node);
  std::printf("withdrew the drain request of %s\n", node.c_str());
  return kOk;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"gkv: talk to a gkv cluster"};
  app.require_subcommand(1);
  app.fallthrough();  // --cluster and --timeout-ms may come after the subcommand too
  std::string cluster_file;
  int timeout_ms = 2000;
  app.add_option("--cluster", cluster_file, "cluster file")->required();
  app.add_option("--timeout-ms", timeout_ms, "deadline per request");

  std::string key, file, value, dtype, shape, output;
  bool durable = false, json = false;
  auto* put = app.add_subcommand("put", "store a value");
  put->add_option("key", key)->required();
  auto* src = put->add_option_group("source")->require_option(1);
  src->add_option("--file", file, "read the value from a file");
  src->add_option("--value", value, "the value as text");
  put->add_option("--dtype", dtype, "tensor dtype (f32, bf16, i64, ...)");
  put->add_option("--shape", shape, "tensor shape, e.g. 2,3");
  put->add_flag("--durable", durable, "write through to disk before acknowledging");
  auto* get = app.add_subcommand("get", "fetch a value");
  get->add_option("key", key)->required();
  get->add_option("--output", output, "write the value to this file (else to stdout)");
  auto* del = app.add_subcommand("del", "delete a key");
  del->add_option("key", key)->required();
  auto* stat = app.add_subcommand("stat", "metadata of a key");
  stat->add_option("key", key)->required();
  auto* stats = app.add_subcommand("stats", "per-node statistics");
  stats->add_flag("--json", json, "one JSON document per node, as a JSON array");
  auto* ring = app.add_subcommand("ring", "nodes, weights and share of the key space");
  auto* ping = app.add_subcommand("ping", "round trip to every node");
  std::string drain_node;
  auto* drain = app.add_subcommand(
      "drain", "membership: etcd: have a node hand its keys off, leave the ring and exit");
  drain->add_option("node", drain_node, "node id")->required();
  auto* undrain = app.add_subcommand(
      "undrain", "membership: etcd: withdraw a drain request the node has not begun");
  undrain->add_option("node", drain_node, "node id")->required();
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    app.exit(e);
    return e.get_exit_code() == 0 ? kOk : kUsage;
  }

  gkv::SetLogLevel("error");  // failures are reported once, as the one line below
  gkv::ClientOptions options;
  options.cluster_file = cluster_file;
  options.default_timeout = std::chrono::milliseconds(timeout_ms);
  if (*ring || *drain || *undrain) {
    auto cluster = gkv::LoadClusterFile(cluster_file);
    if (!cluster.ok()) return ExitFor(cluster.status(), "cluster file");
    const bool in_etcd = cluster->membership == gkv::ClusterConfig::Membership::kEtcd;
    if (*drain || *undrain) {
      if (!in_etcd) {
        std::fprintf(stderr, "gkv: %s needs 'membership: etcd' in the cluster file\n",
                     *drain ? "drain" : "undrain");
        return kUsage;
      }
      return *drain ? Drain(cluster->etcd, drain_node) : Undrain(cluster->etcd, drain_node);
    }
    if (in_etcd) return PrintEtcdRing(cluster->etcd);
    gkv::HashRing r(cluster->nodes);
    auto shares = r.Shares();
    std::printf("%-10s %-24s %8s %8s\n", "node", "address", "weight", "share");
    for (size_t i = 0; i < cluster->nodes.size(); ++i) {
      const auto& n = cluster->nodes[i];
      std::printf("%-10s %-24s %8.2f %7.2f%%\n", n.id.c_str(), n.address().c_str(), n.weight,
                  shares[i] * 100);
    }
    PrintBalance(cluster->nodes, shares);
    return kOk;
  }
  auto client = gkv::Client::Open(options);
  if (!client.ok()) return ExitFor(client.status(), "opening the cluster");
  gkv::Client& c = **client;

  if (*put) {
    std::string data = value;
    if (!file.empty()) {
      std::ifstream in(file, std::ios::binary);
      if (!in) {
        std::fprintf(stderr, "gkv: cannot read '%s'\n", file.c_str());
        return kUsage;
      }
      std::stringstream ss;
      ss << in.rdbuf();
      data = ss.str();
    }
    gkv::PutOptions po;
    po.durable = durable;
    po.memory = gkv::BufferMemory::kHost;
    if (!dtype.empty() || !shape.empty()) {
      auto dt = gkv::ParseDType(dtype.empty() ? "u8" : dtype);
      if (!dt.ok()) return ExitFor(dt.status(), "--dtype");
      auto sh = gkv::ParseShape(shape);
      if (!sh.ok()) return ExitFor(sh.status(), "--shape");
      po.tensor = {*dt, *sh};
    }
    auto r = c.Put(key, data.data(), data.size(), po);
    if (!r.ok()) return ExitFor(r.status(), "put " + key);
    std::printf("stored %s: %zu bytes, version %llu\n", key.c_str(), data.size(),
                (unsigned long long)*r);
    return kOk;
  }
  if (*get) {
    auto r = c.Get(key);
    if (!r.ok()) return ExitFor(r.status(), "get " + key);
    if (!output.empty()) {
      std::ofstream out(output, std::ios::binary);
      out.write(reinterpret_cast<const char*>(r->data()), r->size());
      if (!out) {
        std::fprintf(stderr, "gkv: cannot write '%s'\n", output.c_str());
        return kFailed;
      }
      std::printf("%s\n", Describe(r->info()).c_str());
    } else {
      if (r->info().tensor.is_tensor()) std::fprintf(stderr, "%s\n", Describe(r->info()).c_str());
      std::fwrite(r->data(), 1, r->size(), stdout);
    }
    return kOk;
  }
  if (*del) {
    gkv::Status s = c.Delete(key);
    if (!s.ok()) return ExitFor(s, "del " + key);
    std::printf("deleted %s\n", key.c_str());
    return kOk;
  }
  if (*stat) {
    auto r = c.Stat(key);
    if (!r.ok()) return ExitFor(r.status(), "stat " + key);
    const auto nodes = c.Nodes();  // under etcd the members (the file names none)
    const int owner = c.NodeFor(key);
    std::printf("%s: %s (node %s)\n", key.c_str(), Describe(*r).c_str(),
                owner >= 0 ? nodes[owner].id.c_str() : "?");
    return kOk;
  }
  if (*ping) {
    int rc = kOk;
    const auto nodes = c.Nodes();  // under etcd the members (the file names none)
    for (size_t i = 0; i < nodes.size(); ++i) {
      // The first ping also connects; report the best of three round trips.
      gkv::Result<std::string> r = gkv::Status::Unavailable("not tried");
      double us = 1e18;
      for (int attempt = 0; attempt < 3; ++attempt) {
        auto t0 = std::chrono::steady_clock::now();
        r = c.Ping(static_cast<int>(i));
        if (!r.ok()) break;
        us = std::min(
            us, std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0)
                    .count());
      }
      const auto& n = nodes[i];
      if (r.ok()) {
        auto over = c.NodeTransports(static_cast<int>(i));
        std::printf("%-10s %-24s ok %.0f us (%s)\n", n.id.c_str(), n.address().c_str(), us,
                    over.ok() ? over->c_str() : "transports unknown");
      } else {
        std::printf("%-10s %-24s %s\n", n.id.c_str(), n.address().c_str(),
                    r.status().ToString().c_str());
        rc = kUnreachable;
      }
    }
    return rc;
  }
  if (*stats) {
    std::vector<std::string> docs;
    int rc = kOk;
    const auto nodes = c.Nodes();  // under etcd the members (the file names none)
    for (size_t i = 0; i < nodes.size(); ++i) {
      auto r = c.NodeStats(static_cast<int>(i));
      if (!r.ok()) {
        std::fprintf(stderr, "gkv: stats %s: %s\n", nodes[i].id.c_str(),
                     r.status().ToString().c_str());
        rc = kUnreachable;
        docs.push_back("{\"node\":\"" + nodes[i].id + "\",\"error\":\"" +
                       std::string(gkv::StatusCodeName(r.status().code())) + "\"}");
        continue;
      }
      docs.push_back(*r);
    }
    if (json) {
      std::printf("[");
      for (size_t i = 0; i < docs.size(); ++i)
        std::printf("%s%s", i ? ",\n " : "", docs[i].c_str());
      std::printf("]\n");
      return rc;
    }
    for (const auto& j : docs) {
      if (j.find("\"error\"") != std::string::npos) continue;
      std::printf("node %s\n", nodes[&j - &docs[0]].id.c_str());
      std::printf("  %-5s %22s %10s %12s\n", "tier", "used / capacity", "objects", "hits");
      for (const char* t : {"gpu", "host", "disk"}) {
        std::string anchor = std::string("\"") + t + "\":{";
        if (Num(j, {"\"tiers\"", anchor.c_str(), "\"capacity_bytes\":"}) == 0) continue;
        std::string used =
            gkv::FormatSize(Num(j, {"\"tiers\"", anchor.c_str(), "\"used_bytes\":"})) + " / " +
            gkv::FormatSize(Num(j, {"\"tiers\"", anchor.c_str(), "\"capacity_bytes\":"}));
        std::printf("  %-5s %22s %10llu %12llu\n", t, used.c_str(),
                    (unsigned long long)Num(j, {"\"tiers\"", anchor.c_str(), "\"objects\":"}),
                    (unsigned long long)Num(j, {"\"tiers\"", anchor.c_str(), "\"hits\":"}));
      }
      std::printf(
          "  misses %llu, spills host->disk %llu, gpu->host %llu, promotions %llu,"
          " disk evictions %llu\n",
          (unsigned long long)Num(j, {"\"misses\":"}),
          (unsigned long long)Num(j, {"\"host_to_disk\":{\"objects\":"}),
          (unsigned long long)Num(j, {"\"gpu_to_host\":{\"objects\":"}),
          (unsigned long long)(Num(j, {"\"disk_to_host\":{\"objects\":"}) +
                               Num(j, {"\"disk_to_gpu\":{\"objects\":"}) +
                               Num(j, {"\"host_to_gpu\":{\"objects\":"})),
          (unsigned long long)Num(j, {"\"disk_evictions\":"}));
      std::printf("  bytes in %s, out %s\n", gkv::FormatSize(Num(j, {"\"bytes_in\":"})).c_str(),
                  gkv::FormatSize(Num(j, {"\"bytes_out\":"})).c_str());
    }
    return rc;
  }
  return kUsage;
}
