#include "gkv/cluster.h"

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cctype>
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

namespace {

// `etcd: {endpoints: [http://host:port, ...], cluster: NAME, lease_ttl_s: N,
//         username: U, password: P | password_env: VAR}`.
Status ParseEtcd(const YAML::Node& node, EtcdConfig* etcd) {
  if (!node || !node.IsMap()) {
    return Status::InvalidArgument("'membership: etcd' needs an 'etcd:' map with 'endpoints'");
  }
  const YAML::Node endpoints = node["endpoints"];
  if (!endpoints || !endpoints.IsSequence() || endpoints.size() == 0) {
    return Status::InvalidArgument("etcd: 'endpoints' must be a non-empty list");
  }
  for (const auto& e : endpoints) {
    const std::string endpoint = e.as<std::string>();
    constexpr std::string_view kScheme = "http://";
    std::string host;
    uint16_t port = 0;
    if (!std::string_view(endpoint).starts_with(kScheme) ||
        !ParseAddress(std::string_view(endpoint).substr(kScheme.size()), &host, &port).ok() ||
        host.find('/') != std::string::npos) {
      return Status::InvalidArgument("etcd: endpoint '" + endpoint + "' is not http://host:port");
    }
    etcd->endpoints.push_back(endpoint);
  }
  if (node["cluster"]) {
    etcd->cluster = node["cluster"].as<std::string>();
    const bool valid =
        !etcd->cluster.empty() &&
        std::all_of(etcd->cluster.begin(), etcd->cluster.end(), [](char c) {
          return std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '.' || c == '-';
        });
    if (!valid) {
      return Status::InvalidArgument("etcd: cluster name '" + etcd->cluster +
                                     "' must be letters, digits, '_', '.' or '-'");
    }
  }
  if (node["lease_ttl_s"]) {
    etcd->lease_ttl_s = node["lease_ttl_s"].as<int>();
    if (etcd->lease_ttl_s < 1 || etcd->lease_ttl_s > 3600) {
      return Status::InvalidArgument("etcd: lease_ttl_s must be 1..3600");
    }
  }
  // etcd's own user/password authentication (etcd started with auth enabled).
  if (node["username"]) etcd->username = node["username"].as<std::string>();
  if (node["password"]) etcd->password = node["password"].as<std::string>();
  if (node["password_env"]) {
    const std::string name = node["password_env"].as<std::string>();
    const char* value = std::getenv(name.c_str());
    if (value == nullptr) {
      return Status::InvalidArgument("etcd: password_env names '" + name + "', which is not set");
    }
    etcd->password = value;
  }
  if (etcd->username.empty() != etcd->password.empty()) {
    return Status::InvalidArgument("etcd: 'username' and 'password' go together");
  }
  for (const auto& entry : node) {
    const std::string key = entry.first.as<std::string>();
    if (key != "endpoints" && key != "cluster" && key != "lease_ttl_s" && key != "username" &&
        key != "password" && key != "password_env") {
      return Status::InvalidArgument("etcd: unknown field '" + key + "'");
    }
  }
  return Status::OK();
}

}  // namespace

Result<ClusterConfig> ParseClusterYaml(std::string_view text) {
  // yaml-cpp reports errors with exceptions; they stop at this boundary.
  try {
    YAML::Node root = YAML::Load(std::string(text));
    if (!root.IsMap()) return Status::InvalidArgument("cluster file is not a YAML map");
    ClusterConfig config;
    if (root["membership"]) {
      const std::string membership = root["membership"].as<std::string>();
      if (membership == "etcd") {
        config.membership = ClusterConfig::Membership::kEtcd;
      } else if (membership != "static") {
        return Status::InvalidArgument("membership must be 'static' or 'etcd', not '" + membership +
                                       "'");
      }
    }
    if (config.membership == ClusterConfig::Membership::kEtcd) {
      GKV_RETURN_IF_ERROR(ParseEtcd(root["etcd"], &config.etcd));
    } else if (root["etcd"]) {
      return Status::InvalidArgument("an 'etcd:' section needs 'membership: etcd'");
    }
    if (root["replicas"]) {
      config.replicas = root["replicas"].as<int>();
      if (config.replicas < 1 || config.replicas > 16) {
        return Status::InvalidArgument("replicas must be between 1 and 16");
      }
    }
    const bool static_members = config.membership == ClusterConfig::Membership::kStatic;
    if (static_members && (!root["nodes"] || !root["nodes"].IsSequence())) {
      return Status::InvalidArgument("cluster file needs a 'nodes:' list");
    }
    // With etcd the members come from etcd; a `nodes:` list (say, left from a static file) is
    // ignored, not checked.
    const YAML::Node listed = static_members ? root["nodes"] : YAML::Node(YAML::NodeType::Sequence);
    std::set<std::string> ids, addresses;
    for (const auto& n : listed) {
      if (!n.IsMap() || !n["id"] || !n["address"]) {
        return Status::InvalidArgument("each node needs 'id' and 'address'");
      }
      NodeInfo info;
      info.id = n["id"].as<std::string>();
      GKV_RETURN_IF_ERROR(ParseAddress(n["address"].as<std::string>(), &info.host, &info.port)
                              .WithContext("node '" + info.id + "'"));
      if (n["weight"]) info.weight = n["weight"].as<double>();
      if (!IsValidNodeWeight(info.weight)) {
        return Status::InvalidArgument("node '" + info.id + "' needs a weight in (0, " +
                                       std::to_string(static_cast<int>(kMaxNodeWeight)) + "]");
      }
      if (!ids.insert(info.id).second) {
        return Status::InvalidArgument("node id '" + info.id + "' appears twice");
      }
      if (!addresses.insert(info.address()).second) {
        return Status::InvalidArgument("address " + info.address() + " appears twice");
      }
      config.nodes.push_back(std::move(info));
    }
    if (static_members && config.nodes.empty()) {
      return Status::InvalidArgument("cluster file lists no nodes");
    }
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
    // Weights are checked where they enter (cluster file, member records); the clamp keeps a
    // ring built from anything else finite.
    const double weight = nodes[i].weight > 0 ? std::min(nodes[i].weight, kMaxNodeWeight) : 0.0;
    const int vnodes = std::max(1, static_cast<int>(std::lround(weight * vnodes_per_weight)));
    // Positions derive from the node id, not its index or address, so membership changes and
    // address moves leave the other nodes' points where they were.
    const uint64_t id_hash = HashKey(nodes[i].id);
    for (int v = 0; v < vnodes; ++v) {
      points_.push_back({RingPointPosition(id_hash, static_cast<uint64_t>(v)), i});
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
  NodesFor(key, count, &out);
  return out;
}

void HashRing::NodesFor(std::string_view key, int count, std::vector<int>* out) const {
  out->clear();
  count = std::min(count, node_count_);
  size_t i = Find(HashKey(key));
  for (size_t step = 0; step < points_.size() && static_cast<int>(out->size()) < count; ++step) {
    int node = points_[(i + step) % points_.size()].node;
    if (std::find(out->begin(), out->end(), node) == out->end()) out->push_back(node);
  }
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
