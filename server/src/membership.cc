// The ring and its changes (see server_impl.h for the map of server/; docs/ARCHITECTURE.md,
// "Membership"). A static cluster has one ring for the life of the process. Under etcd a node
// registers itself (a record on a lease), watches the cluster's prefix, and on every change of
// the member set builds a new ring and starts a handoff (handoff.cc).
#include <algorithm>

#include "gkv/log.h"
#include "server_impl.h"

namespace gkv {

bool Server::Impl::Owns(const RingView& r, std::string_view key) const {
  if (replicas == 1) return r.Owner(key) == self_index;  // no list to build on the get path
  for (int n : r.Owners(key, replicas)) {
    if (n == self_index) return true;
  }
  return false;
}

bool Server::Impl::Misrouted(const Req& r, std::string_view key) const {
  if (!elastic() || (r.h.flags & w::kFlagPreviousOwner)) return false;
  // Nodes call each other through the client protocol too (a peer forwarding nothing today):
  // only client connections are held to the ring.
  if (FromPeer(r.conn)) return false;
  return !Owns(*RingHere(), key);
}

Status Server::Impl::WrongNode() const {
  return Status::WrongNode("node " + self.id + " does not own this key in ring epoch " +
                           std::to_string(RingHere()->epoch()));
}

int Server::Impl::NodeIndex(const NodeInfo& node) {
  int i = options.cluster.FindNode(node.id);
  if (i >= 0) {
    NodeInfo& known = options.cluster.nodes[i];
    if (known.host != node.host || known.port != node.port) {
      // The node came back on another address: the old connection leads nowhere.
      GKV_LOG_INFO("node {} moved from {} to {}", node.id, known.address(), node.address());
      if (i != self_index && peer_conn[i] != 0) transport->Close(peer_conn[i], /*force=*/true);
      peer_conn[i] = 0;
      peer_down_until[i] = {};
    }
    known = node;
    return i;
  }
  options.cluster.nodes.push_back(node);
  GrowNodeTables();
  return static_cast<int>(options.cluster.nodes.size()) - 1;
}

void Server::Impl::GrowNodeTables() {
  const size_t n = options.cluster.nodes.size();
  peer_conn.resize(n, 0);
  peer_down_until.resize(n, {});
  peer_load.resize(n);
  report_again_after.resize(n);
  ring_shares.resize(n, 0.0);
}

void Server::Impl::SetRing(RingPtr next) {
  {
    std::lock_guard<std::mutex> lock(ring_mu);
    previous_ring = ring;
    ring = std::move(next);
  }
  // The other I/O workers route by their own copy of the ring.
  ring_epoch_now.store(ring->epoch(), std::memory_order_release);
  for (size_t i = 1; i < io.size(); ++i) {
    transport->PostTo(static_cast<int>(i), [this, r = ring] { W().ring = r; });
  }
  ring_shares = ring->SharesByIndex();
  ring_shares.resize(options.cluster.nodes.size(), 0.0);
  counters.ring_epoch.store(ring->epoch(), std::memory_order_relaxed);
}

Status Server::Impl::StartMembership() {
  // The first view, read before anything listens: a node needs one ring to start.
  auto w = MembershipWatcher::Start(options.cluster.etcd, [this](const MembershipView& v) {
    // The watch thread: the view is applied on the I/O thread, in order.
    if (!ticking.load(std::memory_order_acquire) || !transport) return;
    transport->Post([this, v] { ApplyMembership(v); });
  });
  if (!w.ok()) return w.status().WithContext("reading the cluster's members from etcd");
  watcher = std::move(*w);
  view = watcher->Current();
  if (const MemberRecord* old = view.Find(self.id)) {
    // A record of this id on a live lease: another process is this node (or this node's
    // previous run, whose lease has not expired yet; Register says which).
    GKV_LOG_INFO("etcd still holds a record of node {} ({}) from before", self.id,
                 old->node.address());
  }
  // The node table starts with the members (sorted by id), then this node.
  options.cluster.nodes.clear();
  for (const MemberRecord& m : view.members) {
    if (m.node.id != self.id) options.cluster.nodes.push_back(m.node);
  }
  options.cluster.nodes.push_back(self);
  self_index = static_cast<int>(options.cluster.nodes.size()) - 1;
  return Status::OK();
}

Status Server::Impl::RegisterSelf(uint16_t port) {
  self.port = port;
  options.cluster.nodes[self_index].port = port;
  self_record.node = self;
  self_record.gpu_bytes = cache->tier_enabled(Tier::kGpu) ? cache->tier_capacity(Tier::kGpu) : 0;
  self_record.host_bytes = cache->tier_enabled(Tier::kHost) ? cache->tier_capacity(Tier::kHost) : 0;
  self_record.disk_bytes = cache->tier_enabled(Tier::kDisk) ? cache->tier_capacity(Tier::kDisk) : 0;
  // The previous run's record may still be on its lease (a crash less than a TTL ago): wait it
  // out rather than fail, up to twice the TTL.
  const auto give_up =
      Clock::now() + std::chrono::seconds(2 * options.cluster.etcd.lease_ttl_s + 1);
  for (;;) {
    auto reg = MemberRegistration::Register(options.cluster.etcd, self_record);
    if (reg.ok()) {
      std::lock_guard<std::mutex> lock(mark_mu);  // SyncHandoffMark reads it from other threads
      registration = std::move(*reg);
      // The catch-up Start() began covers this first registration (FenceTick, the later ones).
      serving_generation.store(1, std::memory_order_release);
      registered.store(registration.get(), std::memory_order_release);
      return Status::OK();
    }
    // InvalidArgument: this id's previous record; NotSupported: a member of another placement
    // version, e.g. an old build stopped for an upgrade whose lease has yet to expire.
    const StatusCode code = reg.status().code();
    if ((code != StatusCode::kInvalidArgument && code != StatusCode::kNotSupported) ||
        Clock::now() > give_up) {
      return reg.status().WithContext("registering node " + self.id + " in etcd");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
}

void Server::Impl::ApplyMembership(MembershipView v) {
  const bool was_member = ring && ring->contains(self_index);
  view = std::move(v);
  if (leaving.load(std::memory_order_acquire)) {
    for (const MemberRecord& m : view.members) {
      if (m.node.id != self.id && (m.draining || view.drain_requested.count(m.node.id))) {
        others_leaving_seen.store(true, std::memory_order_release);
      }
    }
  }
  std::vector<NodeInfo> members;
  std::vector<int> slots;
  for (const NodeInfo& n : view.RingNodes()) {
    if (n.id == self.id && leaving.load(std::memory_order_acquire)) continue;
    const int idx = n.id == self.id ? self_index : NodeIndex(n);
    members.push_back(n);
    slots.push_back(idx);
  }
  // Nodes that are registered but out of the ring (draining) stay in the table: they still
  // answer handoffs and previous-owner reads.
  for (const MemberRecord& m : view.members) {
    if (m.node.id != self.id) NodeIndex(m.node);
  }
  // The same members as now: only records or handoff keys changed; the ring stays.
  bool same = ring && ring->size() == slots.size();
  for (size_t p = 0; same && p < slots.size(); ++p) same = ring->slot(p) == slots[p];
  if (!same) {
    std::string list;
    for (const NodeInfo& n : members) list += (list.empty() ? "" : ",") + n.id;
    // Every ring this node routes by has an epoch of its own: writes admitted under the ring
    // before are told apart by it (RingMovedSince) and looked at again. A view's epoch can
    // repeat the ring's: Leave() drops this node from the view it already applied, before
    // etcd has the draining record; that ring takes the next number (etcd's revision for the
    // record is at least that, and its view then leaves the ring as it is).
    const uint64_t epoch = ring && view.epoch <= ring->epoch() ? ring->epoch() + 1 : view.epoch;
    auto next = std::make_shared<RingView>(epoch, members, slots, options.cluster.nodes.size());
    RingPtr before = ring;
    // The new epoch first, before the handoff scan can list keys: a put another I/O worker
    // publishes after that listing reads it (both take the cache's locks) and has its key
    // looked at again (NoteCommittedKey); until the new ring reaches it, that worker leaves its
    // requests to this one (ServeHere).
    ring_epoch_now.store(next->epoch(), std::memory_order_release);
    // Before the new epoch is published: no worker serves under the new ring a key this node
    // regains before it is held back.
    if (before && next->contains(self_index)) RegainCheck(before, next);
    // Scheduled before the ring is published: Leave() must never see the ring without this node
    // while the handoff for it looks idle.
    ScheduleHandoff(next, before);
    SetRing(next);
    counters.ring_changes.fetch_add(1, std::memory_order_relaxed);
    GKV_LOG_INFO("ring epoch {}: {} members [{}]{}", next->epoch(), members.size(), list,
                 next->contains(self_index) ? "" : (was_member ? "; this node left" : ""));
  }
  // Scans that run while this node's record is in etcd are those its joining started (a
  // previous run's record that expires first resets the tally).
  if (catching_up.load(std::memory_order_relaxed)) {
    if (view.Find(self.id) == nullptr) {
      seen_marks.clear();
    } else {
      for (const std::string& id : view.handoffs_running) {
        if (id != self.id && view.catching_up.count(id) == 0) seen_marks.insert(id);
      }
    }
  }
  // `gkv drain` named this node: leave (on a thread of its own: it waits for the handoff).
  if (view.drain_requested.count(self.id) && !leaving.load() && !drain_thread.joinable()) {
    GKV_LOG_INFO("node {}: drain requested; handing every key off", self.id);
    drain_thread = std::thread([this] {
      Leave(std::chrono::minutes(10));
      drained.store(true, std::memory_order_release);
    });
  }
}

void Server::Impl::Leave(std::chrono::milliseconds timeout) {
  std::lock_guard<std::mutex> lock(leave_mu);
  if (!registration || left_cluster) return;
  leaving.store(true, std::memory_order_release);
  MemberRecord rec = self_record;
  rec.draining = true;
  Status us = registration->Update(rec);
  if (!us.ok()) GKV_LOG_WARN("marking node {} as draining: {}", self.id, us.ToString());
  // Our own ring drops this node now (others drop it when they see the record).
  transport->Post([this] { ApplyMembership(view); });
  const auto give_up = Clock::now() + timeout;
  // Idle means: the scan for the ring without this node ran to its end with nothing left.
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  while (!HandoffIdle() || CurrentRing()->contains(self_index)) {
    // Every member is leaving (a whole cluster stopped at once, as for an upgrade): no node is
    // left to take the keys, and sends to the others only fail until the timeout. The keys stay
    // on this node's disk (the stop writes memory back), for its next start. Not when the ring
    // is empty only because the other members are between a stop and a start (a rolling
    // restart: they take the keys when they return), nor without a disk to keep them on.
    if (CurrentRing()->empty() && others_leaving_seen.load(std::memory_order_acquire) &&
        cache->tier_enabled(Tier::kDisk)) {
      GKV_LOG_INFO("node {}: every member is leaving; keeping the keys on disk", self.id);
      break;
    }
    if (Clock::now() > give_up) {
      GKV_LOG_WARN("node {}: handoff did not finish within {} ms; leaving anyway", self.id,
                   timeout.count());
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  left_cluster = true;
  Status ds = registration->Deregister();
  if (!ds.ok()) GKV_LOG_WARN("removing node {} from etcd: {}", self.id, ds.ToString());
  GKV_LOG_INFO("node {} left the cluster", self.id);
}

void Server::Impl::BeginCatchUp() {
  std::vector<KeyListing> keys = cache->ListKeys();
  std::lock_guard<std::mutex> lock(unconfirmed_mu);
  for (const KeyListing& k : keys) unconfirmed.insert(k.key);
  recovered_keys = unconfirmed.size();
  restart_catch_up = recovered_keys > 0;
  catching_up.store(restart_catch_up || regain_now != nullptr, std::memory_order_release);
}

void Server::Impl::RegainCheck(RingPtr before, RingPtr now) {
  // Keys move to this node from others only when a member left (a join takes keys away).
  std::vector<std::string> departed;
  for (size_t p = 0; p < before->size(); ++p) {
    if (!now->contains(before->slot(p)))
      departed.push_back(options.cluster.nodes[before->slot(p)].id);
  }
  std::lock_guard<std::mutex> lock(unconfirmed_mu);
  if (departed.empty()) {
    if (regain_now) regain_now = now;  // a hold under way follows the ring
    return;
  }
  if (!regain_now) {
    regain_before = before;  // the earliest ring of an unsettled run of changes
    regain_confirmed.clear();
  }
  regain_now = now;
  regain_departed.insert(departed.begin(), departed.end());
  regain_started = Clock::now();
  if (!catching_up.load(std::memory_order_relaxed)) mark_on.store(false, std::memory_order_release);
  catching_up.store(true, std::memory_order_release);
  executors->Submit([this] { SyncHandoffMark(); });  // catch-up mark: clients look further
}

Status Server::Impl::FencedStatus(Clock::time_point now) const {
  const MemberRegistration* reg = registered.load(std::memory_order_acquire);
  if (reg == nullptr) return Status::WrongNode("node " + self.id + " is not registered yet");
  const MemberRegistration::Hold h = reg->hold();
  if (now < h.until) {
    return Status::WrongNode("node " + self.id +
                             " registered again after losing its etcd lease; it catches up first");
  }
  return Status::WrongNode(fmt::format(
      "node {} is fenced: its etcd lease may have lapsed (held until {} ms ago); ask the ring "
      "again",
      self.id, std::chrono::duration_cast<std::chrono::milliseconds>(now - h.until).count()));
}

bool Server::Impl::FencedOp(w::Opcode opcode) {
  switch (opcode) {
    case w::Opcode::kPut:
    case w::Opcode::kGet:
    case w::Opcode::kDelete:
    case w::Opcode::kStat:
    case w::Opcode::kMultiGet:
    case w::Opcode::kMultiPut:
    case w::Opcode::kPutChunk:
    case w::Opcode::kReplicaPut:
    case w::Opcode::kHandoffPut:
    case w::Opcode::kRepair:
      return true;
    default:
      return false;
  }
}

void Server::Impl::FenceTick(Clock::time_point now) {
  const MemberRegistration* reg = registered.load(std::memory_order_acquire);
  if (reg == nullptr) return;
  const MemberRegistration::Hold h = reg->hold();
  // Operators see when the node refused as fenced and for how long (a keepalive etcd answered
  // late is enough: the node cannot tell that from a lapsed lease).
  // A node that leaves stops renewing on purpose: nothing to say (and no "unfenced" line).
  if (leaving.load(std::memory_order_relaxed) || stopping.load(std::memory_order_relaxed)) {
    fenced_from = Clock::time_point{};
  }
  const bool fenced_now = now >= h.until && !leaving.load(std::memory_order_relaxed) &&
                          !stopping.load(std::memory_order_relaxed);
  if (fenced_now && fenced_from == Clock::time_point{}) {
    fenced_from = now;
    GKV_LOG_WARN(
        "node {} fenced: no keepalive answered in time to hold its etcd lease; "
        "refusing keyed requests",
        self.id);
  } else if (!fenced_now && fenced_from != Clock::time_point{}) {
    GKV_LOG_WARN("node {} unfenced after {} ms ({} refusals so far)", self.id,
                 std::chrono::duration_cast<std::chrono::milliseconds>(now - fenced_from).count(),
                 counters.fenced_refusals.load(std::memory_order_relaxed));
    fenced_from = Clock::time_point{};
  }
  if (h.generation == serving_generation.load(std::memory_order_relaxed) || now >= h.until) {
    return;
  }
  // Registered under a new lease: etcd dropped this node meanwhile, so the cluster may have
  // given its keys to others and acknowledged newer writes and deletes of them. Every key here
  // is held back until the handoffs its return starts have compared versions (as after a
  // restart); the copies held for other nodes may have missed their invalidations: they go.
  // The registration wrote the catch-up mark with the record, so clients look further.
  BeginCatchUp();
  const size_t kept = recovered_keys;
  size_t copies = 0;
  for (const auto& [held_key, copy] : held_copies.Snapshot()) {
    HeldCopy erased;
    if (held_copies.EraseIf(
            held_key, [](const HeldCopy&) { return true; }, &erased)) {
      DropReplicaCopy(held_key, erased);
      ++copies;
    }
  }
  seen_marks.clear();
  joined_at.store(now);
  // The registration wrote its own mark with the record; a sync queued before may have
  // changed it since: the next sync writes the catch-up mark whatever it believes.
  mark_unknown.store(true);
  mark_on.store(false, std::memory_order_release);
  executors->Submit([this] { SyncHandoffMark(); });
  serving_generation.store(h.generation, std::memory_order_release);
  GKV_LOG_WARN(
      "node {}: registered again after its lease lapsed; its {} keys are held back until the "
      "cluster's handoffs compared their versions, {} copies held for other nodes dropped",
      self.id, kept, copies);
}

void Server::Impl::CatchUpTick(Clock::time_point now) {
  if (mark_retry.load(std::memory_order_relaxed) &&
      now - last_mark_retry >= std::chrono::seconds(1)) {
    last_mark_retry = now;
    mark_retry.store(false);
    executors->Submit([this] { SyncHandoffMark(); });
  }
  const Clock::time_point joined = joined_at.load(std::memory_order_relaxed);
  if (!catching_up.load(std::memory_order_relaxed)) return;
  if (!regain_departed.empty() && now - regain_started >= kRegainMin) {
    // Keys that came back (RegainCheck): settled once the members that left are out of etcd
    // (a drained node deregisters when its handoff is done; or kCatchUpQuiet passed) and no
    // other node's scan runs.
    bool settled = true;
    for (const std::string& id : regain_departed) {
      settled &= view.Find(id) == nullptr || now - regain_started >= kCatchUpQuiet;
    }
    for (const std::string& id : view.handoffs_running) {
      settled &= id == self.id || view.catching_up.count(id) > 0;
    }
    if (settled) {
      std::lock_guard<std::mutex> lock(unconfirmed_mu);
      std::string left;
      for (const std::string& id : regain_departed) left += (left.empty() ? "" : ",") + id;
      GKV_LOG_INFO("node {}: the keys that came back to it as {} left are settled", self.id, left);
      regain_before = regain_now = nullptr;
      regain_confirmed.clear();
      regain_departed.clear();
      if (!restart_catch_up) catching_up.store(false, std::memory_order_release);
      executors->Submit([this] { SyncHandoffMark(); });
    }
  }
  if (!restart_catch_up) return;
  if (joined == Clock::time_point{}) return;
  const auto since = now - joined;
  if (since < kCatchUpMin) return;
  // Other nodes' scans: one running keeps this node catching up; one not seen yet (a member
  // whose watch lags) is waited for up to kCatchUpQuiet. Nodes that only catch up don't count.
  bool busy = false, all_seen = true;
  for (const std::string& id : view.handoffs_running) {
    busy |= id != self.id && view.catching_up.count(id) == 0;
  }
  for (const NodeInfo& n : view.RingNodes()) {
    if (n.id != self.id && view.catching_up.count(n.id) == 0 && seen_marks.count(n.id) == 0) {
      all_seen = false;
    }
  }
  const bool overdue = since > kCatchUpMax;
  if (!overdue && (busy || (!all_seen && since < kCatchUpQuiet))) return;
  std::lock_guard<std::mutex> lock(unconfirmed_mu);
  if (overdue) {
    GKV_LOG_WARN(
        "node {}: other nodes' handoffs still run {} s after it joined; serving its {} "
        "unconfirmed recovered keys as they are",
        self.id, std::chrono::duration_cast<std::chrono::seconds>(since).count(),
        unconfirmed.size());
  }
  GKV_LOG_INFO(
      "node {} caught up in {:.1f} s: of {} keys recovered from disk, {} were confirmed "
      "or replaced by the cluster, {} kept as they were",
      self.id, std::chrono::duration<double>(since).count(), recovered_keys,
      recovered_keys - unconfirmed.size(), unconfirmed.size());
  unconfirmed.clear();
  seen_marks.clear();
  restart_catch_up = false;
  if (!regain_now) catching_up.store(false, std::memory_order_release);
  executors->Submit([this] { SyncHandoffMark(); });
}

void Server::Impl::SyncHandoffMark() {
  std::lock_guard<std::mutex> lock(mark_mu);
  if (!registration) return;
  if (mark_unknown.exchange(false)) mark = Mark::kUnknown;
  const bool scanning = !HandoffIdle();
  const Mark want = scanning ? Mark::kScan : (catching_up.load() ? Mark::kCatchUp : Mark::kOff);
  std::vector<std::string> previous;
  if (want == Mark::kScan && handoff) {
    std::lock_guard<std::mutex> h(handoff->mu);
    previous = handoff->before_ids;
  }
  if (want == mark && previous == mark_previous) {
    mark_on.store(want != Mark::kOff, std::memory_order_release);
    return;
  }
  Status s = registration->SetHandoffRunning(want != Mark::kOff, want == Mark::kCatchUp, previous);
  if (s.ok() || s.code() == StatusCode::kAborted) {  // Aborted: deregistered, no mark left
    mark = want;
    mark_previous = std::move(previous);
    mark_on.store(s.ok() && want != Mark::kOff, std::memory_order_release);
    return;
  }
  GKV_LOG_WARN("setting handoff/{} in etcd: {} (trying again)", self.id, s.ToString());
  mark_retry.store(true);
}

}  // namespace gkv
