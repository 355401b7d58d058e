// Cluster membership in etcd (docs/ARCHITECTURE.md, "Membership").
//
// gkv talks to etcd's v3 JSON gateway (POST /v3/kv/range, /v3/watch, /v3/lease/...) over HTTP
// with cpp-httplib: no gRPC stack to build, and every etcd >= 3.4 serves it.
//
// Keys under the cluster's prefix ("/gkv/<cluster>/"):
//   members/<id>   a MemberRecord (JSON), attached to the node's lease: it goes when the node
//                  stops keeping the lease alive (a crash: after the lease TTL).
//   drain/<id>     written by `gkv drain <id>` on the node's lease: the node leaves the ring,
//                  hands its keys off, removes its record and this key, and exits. `gkv undrain
//                  <id>` deletes it before the node has begun.
//   handoff/<id>   present (on the node's lease) while node <id> is handing keys off; clients
//                  ask a key's previous owner after a miss while any is present. Its value:
//                  "catch-up" (a node catching up, no scan), {"previous": [ids]} (a scan, and
//                  the ring before its change), or empty.
//
// The ring is built from the members that are neither draining nor asked to drain, sorted by
// id. Its epoch is the etcd revision at which this process saw the ring change (RingNodes():
// ids, addresses, weights; its first read counts as a change at that read's revision; a record
// update that leaves the ring as it was, e.g. new byte counts, keeps the epoch): processes that
// watched the same change agree on its epoch; one that started later may show a higher epoch for
// the same members.
//
// etcd being unreachable changes no view: a watcher keeps its last view (and logs the outage
// once), a registration keeps trying to keep its lease and registers again under a new lease
// when its old one expired meanwhile (its Hold tells the node when to stop serving). An etcd whose
// revision went back (rebuilt from a snapshot or from nothing) is noticed when a watch is
// established: the watcher reads the prefix again and watches on from there (epochs still only
// grow).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "gkv/cluster.h"
#include "gkv/status.h"

namespace gkv {

// What a node publishes about itself.
struct MemberRecord {
  NodeInfo node;  // id, host, port, weight
  uint64_t gpu_bytes = 0;
  uint64_t host_bytes = 0;
  uint64_t disk_bytes = 0;
  bool draining = false;  // set by the node once it starts handing everything off
  // How the node places keys (HashRing::kPlacementVersion); a record without the field was
  // written by a build of placement version 1.
  uint32_t placement = HashRing::kPlacementVersion;
};

std::string EncodeMemberRecord(const MemberRecord& record);
Result<MemberRecord> DecodeMemberRecord(std::string_view json);

// One consistent reading of the prefix.
struct MembershipView {
  uint64_t epoch = 0;                 // see above
  uint64_t revision = 0;              // etcd revision this view is current at
  std::vector<MemberRecord> members;  // every registered node, sorted by id
  std::set<std::string> drain_requested;
  std::set<std::string> handoffs_running;
  // Of those, the nodes whose mark says only that they catch up after a start on an old disk
  // (no scan of theirs runs): another node catching up need not wait for them.
  std::set<std::string> catching_up;
  // For a running scan's mark: the ids of the ring before the change it hands keys off for, so
  // a client that saw no change (opened mid-handoff) knows whom to ask for keys not yet moved
  // (and sends its deletes there too). Absent for a catch-up mark or a build that did not say.
  std::map<std::string, std::vector<std::string>> previous_members;

  // The members that own keys: not draining, not asked to drain, and placing keys as this
  // build does (a member of another placement version is left out: rings of two placements
  // would split the key space), sorted by id.
  std::vector<NodeInfo> RingNodes() const;
  const MemberRecord* Find(std::string_view id) const;
};

// Thread-safety of both classes: every method may be called from any thread.
class MembershipWatcher {
 public:
  using Callback = std::function<void(const MembershipView&)>;
  // Reads the prefix once (an error when etcd cannot be reached: a process needs one ring to
  // start), then watches it from the next revision on a thread of its own, resuming from the
  // last revision seen after a broken stream (and reading the prefix again when etcd compacted
  // that revision away). `on_change` runs on that thread whenever the view changed (members,
  // their records, drain or handoff keys), once per etcd revision that changed it, never
  // concurrently with itself; it is not called for the initial view (see Current()). It may
  // call Current() but must not destroy the watcher.
  static Result<std::unique_ptr<MembershipWatcher>> Start(const EtcdConfig& etcd,
                                                          Callback on_change);
  // Stops the watch; no callback runs after it returns. Prompt: at worst one etcd request's
  // timeout (3 s) against an etcd that accepts connections but does not answer.
  ~MembershipWatcher();
  MembershipView Current() const;
  // Whether the watch stream is connected now.
  bool connected() const;

 private:
  struct Impl;
  explicit MembershipWatcher(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

class MemberRegistration {
 public:
  // Grants a lease of etcd.lease_ttl_s and writes members/<id> on it; a thread keeps it alive
  // (every third of the TTL) and registers again, under a new lease, if it expired while etcd was
  // unreachable. Fails with Unavailable when etcd cannot be reached, InvalidArgument when
  // another live node holds the same id (also a node of this id that crashed less than a TTL
  // ago: its lease still holds the record), NotSupported when a registered member places keys
  // by another placement version (HashRing::kPlacementVersion: an upgrade restarts every node).
  static Result<std::unique_ptr<MemberRegistration>> Register(const EtcdConfig& etcd,
                                                              const MemberRecord& record);
  // Stops the keepalive (the record then expires with the lease); as prompt as the watcher's.
  ~MemberRegistration();

  // Rewrites the record (e.g. draining = true), on the same lease (a new one if it expired).
  // The id must stay the same. Aborted after Deregister().
  Status Update(const MemberRecord& record);
  // handoff/<id> on this node's lease: present while `running`; `catch_up_only` marks it as
  // a node catching up with no scan of its own running (MembershipView::catching_up);
  // `previous_members`: a scan's ring before its change (MembershipView::previous_members).
  Status SetHandoffRunning(bool running, bool catch_up_only = false,
                           std::vector<std::string> previous_members = {});
  // Deletes members/<id>, drain/<id> and handoff/<id> and revokes the lease; the keepalive stops.
  Status Deregister();
  int64_t lease_id() const;

  // What the node may rely on (its fence, docs/ARCHITECTURE.md "Fencing"): which registration
  // holds its record (1 for the first, one more for each registration under a new lease after
  // the old one was lost) and until when, by this process's steady clock, etcd cannot have let
  // that lease expire. `until` is the send time of the last keepalive etcd answered (or of the
  // grant) plus the TTL it granted, less LeaseMargin(TTL): etcd starts a lease's TTL when it
  // handles the request, after the send, so only a clock running slower than etcd's by more
  // than the margin (a fifth, >= 10^4 times NTP's 500 ppm bound) could make it late. Stays put
  // while etcd is unreachable; {generation, epoch} after Deregister().
  // A registration under a new lease writes handoff/<id> as a catch-up mark along with the
  // record (unless a scan's mark is set): the node missed what the cluster did meanwhile.
  struct Hold {
    uint32_t generation = 0;
    std::chrono::steady_clock::time_point until{};
  };
  Hold hold() const;
  static std::chrono::milliseconds LeaseMargin(int64_t ttl_s);

 private:
  struct Impl;
  explicit MemberRegistration(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// `gkv drain <id>`: writes drain/<id> on the member's lease (idempotent), so the request goes
// with the node. NotFound when no such member is registered.
Status RequestDrain(const EtcdConfig& etcd, std::string_view node_id);
// `gkv undrain <id>`: deletes drain/<id> (also one left by a build whose drain keys had no
// lease). NotFound when there is none; Aborted when the node is handing off already (a drain
// that started runs to its end).
Status CancelDrain(const EtcdConfig& etcd, std::string_view node_id);
// `gkv ring`: one reading of the prefix (no watch).
Result<MembershipView> ReadMembership(const EtcdConfig& etcd);

}  // namespace gkv
