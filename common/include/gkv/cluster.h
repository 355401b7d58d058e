// Cluster membership and the consistent-hash ring, shared by clients, servers and tools.
//
// Cluster file (YAML):
//   nodes:
//     - {id: n0, address: 127.0.0.1:7000, weight: 2}
//     - {id: n1, address: 127.0.0.1:7001}          # weight defaults to 1
//   secret: ...        # optional shared secret (or secret_env: NAME to read it from the env)
//   peer_secret: ...   # optional, nodes only: what nodes present to each other (peer_secret_env)
//
// HashRing: `vnodes_per_weight * weight` virtual points per node, so a node's share of the key
// space follows its weight (set it from the node's memory). Point v of a node sits at
// RingPointPosition(HashKey(id), v) (gkv/hash.h): positions depend only on the id, whatever
// its form or length, so membership changes and address moves leave the other nodes' points
// where they were. A key belongs to the first point clockwise from HashKey(key). Removing a
// node moves only its own keys.
// Thread-safety: immutable after construction; share freely.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "gkv/status.h"

namespace gkv {

struct NodeInfo {
  std::string id;
  std::string host;
  uint16_t port = 0;
  double weight = 1.0;
  std::string address() const { return host + ":" + std::to_string(port); }
};

// Where the members come from when the cluster file says `membership: etcd`:
//   membership: etcd
//   etcd: {endpoints: [http://127.0.0.1:2379], cluster: prod, lease_ttl_s: 5}
// (gkv/membership.h). `nodes:` is then optional and ignored.
struct EtcdConfig {
  std::vector<std::string> endpoints;  // http://host:port, tried in order
  std::string cluster = "gkv";         // the key prefix is /gkv/<cluster>/
  int lease_ttl_s = 5;                 // a dead node leaves every ring within about this
  // etcd's user/password authentication (both empty: none). The password may come from the
  // environment (`password_env:`); it is never logged.
  std::string username, password;
  std::string prefix() const { return "/gkv/" + cluster + "/"; }
};

struct ClusterConfig {
  enum class Membership { kStatic, kEtcd };
  Membership membership = Membership::kStatic;
  EtcdConfig etcd;              // membership == kEtcd
  std::vector<NodeInfo> nodes;  // kStatic: the members; kEtcd: unused
  // `replicas: R`: every write goes to a key's first R owners on the ring (clients default to
  // it; nodes use it to route and to repair copies after a node is lost).
  int replicas = 1;
  std::string secret;  // empty: no access control
  // What a node presents to another node (PEER_HELLO) to be allowed the replication messages.
  // Empty: the cluster secret serves (so any holder of it may act as a node); set it (or
  // peer_secret_env) in the nodes' cluster file only, to keep clients out of the peer protocol.
  std::string peer_secret;
  const std::string& effective_peer_secret() const {
    return peer_secret.empty() ? secret : peer_secret;
  }

  // Index into nodes, or -1.
  int FindNode(std::string_view id) const;
};

Result<ClusterConfig> ParseClusterYaml(std::string_view yaml);
Result<ClusterConfig> LoadClusterFile(const std::string& path);
// "host:port" (IPv4 or a name; "[v6]:port" for IPv6).
Status ParseAddress(std::string_view address, std::string* host, uint16_t* port);

// A node's weight is in (0, kMaxNodeWeight]: the ring holds weight * 1024 points per node, so
// an unbounded weight (a typo, a hostile member record) would exhaust memory.
inline constexpr double kMaxNodeWeight = 1000.0;
// Whether `weight` is in (0, kMaxNodeWeight] (false for NaN).
inline bool IsValidNodeWeight(double weight) { return weight > 0 && weight <= kMaxNodeWeight; }

class HashRing {
 public:
  static constexpr int kDefaultVnodesPerWeight = 1024;
  // Which construction places keys on nodes (point positions, points per weight, key hash).
  // Processes that place keys differently would split the key space two ways, so nodes
  // publish it (member records, PEER_HELLO) and refuse to join a ring of another version
  // (README, "Upgrading"). Version 1 (before December 2026) seeded XXH3 with the point index;
  // version 2 derives points with RingPointPosition. Bump it with any change that moves keys.
  static constexpr uint32_t kPlacementVersion = 2;

  explicit HashRing(const std::vector<NodeInfo>& nodes,
                    int vnodes_per_weight = kDefaultVnodesPerWeight);

  // Index (into the node list given at construction) of the node owning `key`.
  // REQUIRES: at least one node.
  int NodeFor(std::string_view key) const;
  // The same for a key whose HashKey() the caller already has.
  int NodeForHash(uint64_t hash) const;
  // Up to `count` distinct nodes clockwise from the key's position, the owner first.
  std::vector<int> NodesFor(std::string_view key, int count) const;
  // The same into `*out` (cleared first), which allocates nothing once it has the capacity.
  void NodesFor(std::string_view key, int count, std::vector<int>* out) const;
  int node_count() const { return node_count_; }
  // Fraction of the 64-bit hash space each node owns.
  std::vector<double> Shares() const;

 private:
  struct Point {
    uint64_t position;
    int node;
    bool operator<(const Point& o) const {
      return position < o.position || (position == o.position && node < o.node);
    }
  };
  size_t Find(uint64_t hash) const;
  std::vector<Point> points_;
  int node_count_ = 0;
};

}  // namespace gkv
