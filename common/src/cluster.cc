#include "gkv/cluster.h"

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <set>
#include <sstream>

#include "gkv/hash.h"

namespace gkv {

int ClusterConfig::FindNode(std::string_view id) const {
  for (size_t i = 0; i < nodes.size(); ++i) {
    if (nodes[i].id == id) return static_cast<int>(i);
  }
  return -1;
}

Status ParseAddress(std::string_view address, std::string* host, uint16_t* port) {
  size_t colon = address.rfind(':');
  if (colon == std::string_view::npos || colon == 0 || colon + 1 == address.size()) {
    return Status::InvalidArgument("address '" + std::string(address) + "' is not host:port");
  }
  std::string_view h = address.substr(0, colon);
  if (h.size() >= 2 && h.front() == '[' && h.back() == ']') h = h.substr(1, h.size() - 2);
  std::string_view p = address.substr(colon + 1);
  unsigned value = 0;
  auto [ptr, ec] = std::from_chars(p.data(), p.data() + p.size(), value);
  if (ec != std::errc() || ptr != p.data() + p.size() || value == 0 || value > 65535) {
    return Status::InvalidArgument("bad port in address '" + std::string(address) + "'");
  }
  *host = std::string(h);
  *port = static_cast<uint16_t>(value);
  return Status::OK();
}

Result<ClusterConfig> ParseClusterYaml(std::string_view text) {
  // yaml-cpp reports errors with exceptions; they stop at this boundary.
  try {
    YAML::Node root = YAML::Load(std::string(text));
    if (!root.IsMap() || !root["nodes"] || !root["nodes"].IsSequence()) {
      return Status::InvalidArgument("cluster file needs a 'nodes:' list");
    }
    ClusterConfig config;
    std::set<std::string> ids, addresses;
    for (const auto& n : root["nodes"]) {
      if (!n.IsMap() || !n["id"] || !n["address"]) {
        return Status::InvalidArgument("each node needs 'id' and 'address'");
      }
      NodeInfo info;
      info.id = n["id"].as<std::string>();
      GKV_RETURN_IF_ERROR(ParseAddress(n["address"].as<std::string>(), &info.host, &info.port)
                              .WithContext("node '" + info.id + "'"));
      if (n["weight"]) info.weight = n["weight"].as<double>();
      if (!(info.weight > 0) || !std::isfinite(info.weight)) {
        return Status::InvalidArgument("node '" + info.id + "' needs a positive weight");
      }
      if (!ids.insert(info.id).second) {
        return Status::InvalidArgument("node id '" + info.id + "' appears twice");
      }
      if (!addresses.insert(info.address()).second) {
        return Status::InvalidArgument("address " + info.address() + " appears twice");
      }
      config.nodes.push_back(std::move(info));
    }
    if (config.nodes.empty()) return Status::InvalidArgument("cluster file lists no nodes");
    if (root["secret"]) config.secret = root["secret"].as<std::string>();
    if (root["secret_env"]) {
      std::string name = root["secret_env"].as<std::string>();
      const char* v = std::getenv(name.c_str());
      if (!v || !*v) {
        return Status::InvalidArgument("secret_env names '" + name + "', which is not set");
      }
      config.secret = v;
    }
    if (root["peer_secret"]) config.peer_secret = root["peer_secret"].as<std::string>();
    if (root["peer_secret_env"]) {
      std::string name = root["peer_secret_env"].as<std::string>();
      const char* v = std::getenv(name.c_str());
      if (!v || !*v) {
        return Status::InvalidArgument("peer_secret_env names '" + name + "', which is not set");
      }
      config.peer_secret = v;
    }
    return config;
  } catch (const YAML::Exception& e) {
    return Status::InvalidArgument(std::string("cluster file: ") + e.what());
  }
}

Result<ClusterConfig> LoadClusterFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return Status::IOError("cannot read cluster file '" + path + "'");
  std::stringstream ss;
  ss << in.rdbuf();
  auto r = ParseClusterYaml(ss.str());
  if (!r.ok()) return r.status().WithContext(path);
  return r;
}

HashRing::HashRing(const std::vector<NodeInfo>& nodes, int vnodes_per_weight)
    : node_count_(static_cast<int>(nodes.size())) {
  for (int i = 0; i < node_count_; ++i) {
    const int vnodes =
        std::max(1, static_cast<int>(std::lround(nodes[i].weight * vnodes_per_weight)));
    // Positions derive from the node id, not its index or address, so membership changes and
    // address moves leave the other nodes' points where they were.
    const std::string& id = nodes[i].id;
    for (int v = 0; v < vnodes; ++v) {
      points_.push_back({HashBytes(id.data(), id.size(), static_cast<uint64_t>(v)), i});
    }
  }
  std::sort(points_.begin(), points_.end());
}

size_t HashRing::Find(uint64_t hash) const {
  auto it = std::lower_bound(points_.begin(), points_.end(), Point{hash, -1});
  return it == points_.end() ? 0 : static_cast<size_t>(it - points_.begin());
}

int HashRing::NodeFor(std::string_view key) const { return NodeForHash(HashKey(key)); }

int HashRing::NodeForHash(uint64_t hash) const { return points_[Find(hash)].node; }

std::vector<int> HashRing::NodesFor(std::string_view key, int count) const {
  std::vector<int> out;
  count = std::min(count, node_count_);
  size_t i = Find(HashKey(key));
  for (size_t step = 0; step < points_.size() && static_cast<int>(out.size()) < count; ++step) {
    int node = points_[(i + step) % points_.size()].node;
    if (std::find(out.begin(), out.end(), node) == out.end()) out.push_back(node);
  }
  return out;
}

std::vector<double> HashRing::Shares() const {
  std::vector<double> shares(node_count_, 0.0);
  if (points_.empty()) return shares;
  const long double space = 18446744073709551616.0L;
  for (size_t i = 0; i < points_.size(); ++i) {
    // Point i owns (previous point, point i].
    uint64_t prev = points_[(i + points_.size() - 1) % points_.size()].position;
    uint64_t span = points_[i].position - prev;  // wraps correctly for i == 0
    shares[points_[i].node] += static_cast<double>(span / space);
  }
  return shares;
}

}  // namespace gkv
