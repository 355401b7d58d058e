// Adaptive replication of hot keys (docs/ARCHITECTURE.md, "Hot keys"): as primary, counting
// reads, copying hot keys, invalidating copies before a write is acknowledged, cooling; as
// replica, installing, serving and dropping copies; between nodes, the load exchange the
// relative rule needs. See server_impl.h for the map of server/ and hotness.h for the rule.
#include "gkv/hash.h"
#include "gkv/log.h"
#include "gkv/size.h"
#include "server_impl.h"

namespace gkv {

namespace {
constexpr auto kLoadReportFresh = std::chrono::seconds(3);
constexpr auto kReportBackoff = std::chrono::seconds(5);
}  // namespace

bool Server::Impl::CoveredByFloor(const std::string& key, uint64_t attempt) const {
  auto fl = replica_floor.find(key);
  return fl != replica_floor.end() && fl->second.attempt >= attempt;
}

std::vector<uint16_t> Server::Impl::HintFor(std::string_view key, uint64_t version,
                                            const RingView& ring) const {
  std::vector<uint16_t> hint;
  if (!replication_on()) return hint;
  thread_local std::vector<int> nodes;
  if (!replicated_keys.ServingCopies(key, version, &nodes)) return hint;
  // On the wire a node is its position in the ring (the cluster file's order for a static
  // cluster; under etcd, members sorted by id), which clients map to their own node tables.
  for (int n : nodes) {
    const int p = ring.position(n);
    if (p >= 0) hint.push_back(static_cast<uint16_t>(p));
  }
  return hint;
}

void Server::Impl::CountRead(const std::string& key) {
  // Only the keys this node owns: a read served here for another primary (a client's failover
  // with ClientOptions::replicas > 1) is not this node's to copy, and its versions are not the
  // primary's.
  const uint64_t hash = HashKey(key);  // once: for the ring and the sketch
  if (RingHere()->OwnerForHash(hash) != self_index) return;
  const uint32_t est = sketch.Add(hash);
  if (OnControlThread()) return ConsiderCopying(key, est);
  // Another I/O worker: worker 0 decides. Only a key it could start copying now (copy_floor) is
  // handed to it, at most one every 200 us from each worker.
  if (est < copy_floor.load(std::memory_order_relaxed)) return;
  IoWorker& ws = W();
  const auto now = Clock::now();
  if (now < ws.next_copy_handoff) return;
  ws.next_copy_handoff = now + std::chrono::microseconds(200);
  transport->Post([this, key, est] { ConsiderCopying(key, est); });
}

void Server::Impl::ConsiderCopying(const std::string& key, uint32_t est) {
  if (!options.replication.IsHot(est, node_read_count, node_overloaded)) return;
  const bool relative = options.replication.mode == HotnessRule::Mode::kRelative;
  if (copy_tokens <= 0 || (relative && shed_left <= 0)) return;
  if (registry.find(key) != registry.end()) return;
  auto wait = copy_again_after.find(key);
  if (wait != copy_again_after.end()) {
    if (Clock::now() < wait->second) return;
    copy_again_after.erase(wait);
  }
  if (executors->queued() >= options.max_queued_tasks / 2) return;  // requests come first
  --copy_tokens;
  // The copies will take about hot_replicas / (hot_replicas + 1) of the key's reads off this
  // node: enough keys to cover the excess are copied, not every key above the share.
  const double relief =
      est * static_cast<double>(options.hot_replicas) / (options.hot_replicas + 1);
  shed_left -= relief;
  recent_relief.emplace_back(Clock::now(), relief);
  StartReplication(key);
}

void Server::Impl::PublishCopyFloor() {
  // IsHot grows with the key's count: the least count it accepts, by bisection.
  const bool relative = options.replication.mode == HotnessRule::Mode::kRelative;
  uint32_t floor = UINT32_MAX;
  if (copy_tokens > 0 && !(relative && shed_left <= 0) &&
      options.replication.IsHot(UINT32_MAX - 1, node_read_count, node_overloaded)) {
    uint32_t lo = 0, hi = UINT32_MAX - 1;  // IsHot(hi) holds
    while (lo < hi) {
      const uint32_t mid = lo + (hi - lo) / 2;
      if (options.replication.IsHot(mid, node_read_count, node_overloaded)) {
        hi = mid;
      } else {
        lo = mid + 1;
      }
    }
    floor = hi;
  }
  copy_floor.store(floor, std::memory_order_relaxed);
}

std::vector<int> Server::Impl::ReplicaTargets(const std::string& key) const {
  // The next nodes on the ring, passing over ones that are down (a hot key then still gets its
  // copies from the live ones).
  std::vector<int> out;
  const auto now = Clock::now();
  for (int n : ring->Owners(key, static_cast<int>(ring->size()))) {
    if (static_cast<int>(out.size()) == options.hot_replicas) break;
    if (n != self_index && now >= peer_down_until[n]) out.push_back(n);
  }
  return out;
}

void Server::Impl::StartReplication(const std::string& key) {
  std::vector<int> targets = ReplicaTargets(key);
  if (targets.empty()) return;
  const uint64_t attempt = ++next_attempt;
  // Listed for the other I/O workers before the copy reads the value (a put they publish after
  // this then goes through AfterWrite); no hints until the copies serve (SetServing).
  replicated_keys.Add(key);
  ReplicaSet& set = registry[key];
  set = ReplicaSet{};
  set.attempt = attempt;
  executors->Submit([this, key, targets, attempt] {
    auto got = cache->Acquire(key);
    // A value no replica budget can hold (peers have the same share) is not copied.
    if (!got.ok() || got->size() > replica_cache->max_object_size()) {
      return PostReply([this, key, attempt] { ReplicationDone(key, attempt, 0, {}); });
    }
    auto bytes = std::make_shared<std::string>(got->size(), '\0');
    Status cs = cache->CopyBytes(bytes->data(), MemoryKind::kHost, got->data(), got->memory_kind(),
                                 got->size());
    const ObjectInfo info = got->info();
    *got = ReadHandle();
    PostReply([this, key, targets, bytes, info, cs, attempt] {
      if (!cs.ok()) return ReplicationDone(key, attempt, 0, {});
      auto installed = std::make_shared<std::vector<int>>();
      auto remaining = std::make_shared<size_t>(targets.size());
      for (int node : targets) {
        std::string body =
            w::EncodeReplicaPut({key, info.tensor, info.size}, info.version, attempt);
        // Only a real install counts: a replica that refused (its floor covers this attempt, or
        // it holds a newer copy) answers an error and is never hinted.
        CallPeer(node, w::Opcode::kReplicaPut, std::move(body), bytes,
                 [this, key, node, info, installed, remaining, bytes, attempt](Status s,
                                                                               std::string_view) {
                   if (s.ok()) installed->push_back(node);
                   if (--*remaining == 0) ReplicationDone(key, attempt, info.version, *installed);
                 });
      }
    });
  });
}

void Server::Impl::ReplicationDone(const std::string& key, uint64_t attempt, uint64_t version,
                                   const std::vector<int>& nodes) {
  auto it = registry.find(key);
  const bool ours = it != registry.end() && it->second.attempt == attempt &&
                    it->second.state == CopyState::kCopying;
  // Targets that did not confirm may still install late (their call timed out here): tell them
  // the attempt is over, so a late copy is refused or dropped instead of lingering. (Version 0:
  // nothing was sent.)
  for (int n : version == 0 ? std::vector<int>{} : ReplicaTargets(key)) {
    if (std::find(nodes.begin(), nodes.end(), n) != nodes.end()) continue;
    CallPeer(n, w::Opcode::kInvalidate, w::EncodeInvalidate(key, version, attempt), nullptr,
             [](Status, std::string_view) {});
  }
  if (!ours || it->second.cancelled || nodes.empty()) {
    // Written while the copies were made: they are of an old version and never hinted; drop
    // them anyway so they do not take replica room.
    for (int n : nodes) {
      CallPeer(n, w::Opcode::kInvalidate, w::EncodeInvalidate(key, version, attempt), nullptr,
               [](Status, std::string_view) {});
    }
    if (!ours) return;
    // Nothing was installed (the key is gone, too large, or every replica refused): wait before
    // trying again, so a key that cannot be copied does not start an attempt on every read.
    if (nodes.empty() && !it->second.cancelled) {
      copy_again_after[key] = Clock::now() + std::chrono::seconds(5);
    }
    registry.erase(it);
    replicated_keys.Remove(key);
    return;
  }
  ReplicaSet& set = it->second;
  set.state = CopyState::kServing;
  set.nodes = nodes;
  set.version = version;
  replicated_keys.SetServing(key, version, nodes);  // hinted from now on, by every I/O worker
  counters.replicas_created.fetch_add(nodes.size(), std::memory_order_relaxed);
  std::string list;
  for (int n : nodes) list += (list.empty() ? "" : ",") + options.cluster.nodes[n].id;
  GKV_LOG_INFO("replicating hot key '{}' (version {}) to {}", LogKey(key), version, list);
}

void Server::Impl::Withdraw(const std::string& key, const char* why) {
  auto it = registry.find(key);
  if (it == registry.end() || it->second.state != CopyState::kServing) return;
  ReplicaSet& set = it->second;
  set.state = CopyState::kWithdrawing;
  set.unconfirmed = set.nodes.size();
  // Hinted by no I/O worker from here on, before the first INVALIDATE goes out.
  replicated_keys.SetServing(key, set.version, {});
  // No new attempt while a hint of this one can still be alive (kWithdrawWait covers every
  // hint, whether or not the holders confirm early): a new attempt may copy the same version to
  // the same node, and an old hint must never find that copy after a later write was
  // acknowledged (writes during a new attempt's copying are acknowledged at once).
  Clock::time_point& again = copy_again_after[key];
  again = std::max(again, Clock::now() + kWithdrawWait);
  counters.replicas_dropped.fetch_add(set.nodes.size(), std::memory_order_relaxed);
  GKV_LOG_DEBUG("withdrawing the copies of key '{}' (version {}): {}", LogKey(key), set.version,
                why);
  const uint64_t attempt = set.attempt;
  // Whichever comes first: every holder confirmed, or every hint has expired.
  AddTimer(Clock::now() + kWithdrawWait, [this, key, attempt] { FinishWithdraw(key, attempt); });
  for (int n : set.nodes) {
    CallPeer(n, w::Opcode::kInvalidate, w::EncodeInvalidate(key, set.version, attempt), nullptr,
             [this, key, attempt](Status s, std::string_view) {
               if (!s.ok()) return;  // unconfirmed: the timer ends the withdrawal
               auto at = registry.find(key);
               if (at == registry.end() || at->second.attempt != attempt) return;
               if (at->second.unconfirmed > 0 && --at->second.unconfirmed == 0) {
                 FinishWithdraw(key, attempt);
               }
             });
  }
}

void Server::Impl::FinishWithdraw(const std::string& key, uint64_t attempt) {
  auto it = registry.find(key);
  if (it == registry.end() || it->second.attempt != attempt ||
      it->second.state != CopyState::kWithdrawing) {
    return;
  }
  std::vector<std::function<void()>> waiters = std::move(it->second.waiters);
  registry.erase(it);
  replicated_keys.Remove(key);
  for (auto& w : waiters) w();
}

void Server::Impl::AfterWrite(const std::vector<std::string>& keys, std::function<void()> reply) {
  if (registry.empty()) return reply();
  auto remaining = std::make_shared<size_t>(1);
  auto finish = [remaining, reply] {
    if (--*remaining == 0) reply();
  };
  for (const std::string& key : keys) {
    auto it = registry.find(key);
    if (it == registry.end()) continue;
    Clock::time_point& again = copy_again_after[key];
    again = std::max(again, Clock::now() + std::chrono::seconds(2));
    if (it->second.state == CopyState::kCopying) {
      it->second.cancelled = true;  // never hinted: nothing to wait for
      continue;
    }
    Withdraw(key, "written");  // serving -> withdrawing; a withdrawing one is joined
    ++*remaining;
    it->second.waiters.push_back(finish);
  }
  finish();
}

void Server::Impl::StartBootSync() {
  boot_sync_started = true;
  if (!replication_on()) return;
  // Peers may hold copies this node's previous run made, and clients may hold hints naming them
  // (up to 1 s old): they are told to drop them at once. Best effort: writes are not held for
  // the answers (a slow or absent peer would stall every first write after a start), so a write
  // acknowledged in the moment before a peer processed this can still be read old through such
  // a hint (docs/ARCHITECTURE.md, "Hot keys").
  for (int n = 0; n < static_cast<int>(peer_conn.size()); ++n) {
    if (n == self_index) continue;
    CallPeer(
        n, w::Opcode::kInvalidate, w::EncodeInvalidate("", 0, next_attempt), nullptr,
        [](Status, std::string_view) {}, w::kFlagAllKeys);
  }
}

void Server::Impl::ReplicationTick(Clock::time_point now) {
  const uint64_t reads_per_s = static_cast<uint64_t>(node_read_count / 2);
  counters.reads_per_s.store(reads_per_s, std::memory_order_relaxed);
  // The relative rule compares this node's load with the others' (their reports, fresh ones).
  std::vector<double> rates{static_cast<double>(reads_per_s)};
  std::vector<double> shares{ring_shares[self_index]};
  for (size_t n = 0; n < peer_load.size(); ++n) {
    if (static_cast<int>(n) == self_index || ring_shares[n] <= 0 ||  // not in the ring now
        peer_load[n].at == Clock::time_point{} || now - peer_load[n].at > kLoadReportFresh) {
      continue;
    }
    rates.push_back(static_cast<double>(peer_load[n].reads_per_s));
    shares.push_back(ring_shares[n]);
  }
  const bool was = node_overloaded;
  const HotnessRule& rule = options.replication;
  node_overloaded =
      rule.mode == HotnessRule::Mode::kRelative && ring_shares[self_index] > 0 &&
      rule.Overloaded(static_cast<double>(reads_per_s), ring_shares[self_index], rates, shares);
  shed_left = node_overloaded ? 2 * rule.Excess(static_cast<double>(reads_per_s),
                                                ring_shares[self_index], rates, shares)
                              : 0;
  // Copies started in the last few seconds have not shown in the decayed load yet: their
  // expected relief still counts against the excess, or a node would copy 2-3x the keys it needs.
  while (!recent_relief.empty() && now - recent_relief.front().first > kReliefShowsAfter) {
    recent_relief.pop_front();
  }
  for (const auto& [at, relief] : recent_relief) shed_left -= relief;
  counters.overloaded.store(node_overloaded, std::memory_order_relaxed);
  if (node_overloaded != was) {
    GKV_LOG_DEBUG("read load {} reads/s: {} the cluster's mean", reads_per_s,
                  node_overloaded ? "above" : "back within");
  }
  // An idle node does not report by itself (busy peers learn its rate from their reports'
  // replies): no peer traffic, nor peer connections, on a cluster nobody reads from.
  if (options.replication.mode == HotnessRule::Mode::kRelative &&
      (reads_per_s > 0 || last_reported_reads > 0)) {
    ReportLoad(now, reads_per_s);
  }
  last_reported_reads = reads_per_s;
  copy_tokens = options.replication.max_copy_starts_per_s;
  // Cooling compares counts before they are halved: right after a decay a steady R reads as R,
  // not 2R, which would halve the hysteresis.
  CoolDown();
  sketch.Decay();
  node_read_count /= 2;
  PruneFloors(now);
  if (now - last_copy_sweep >= std::chrono::seconds(10)) {
    last_copy_sweep = now;
    SweepHeldCopies();
  }
}

void Server::Impl::SweepHeldCopies() {
  // A copy the replica budget evicted, or one whose invalidation never arrived, leaves its
  // entry behind: drop the entries whose copy is gone, so the table stays as large as the copies.
  // The lookups run on an executor; an entry is dropped only if it still names the same copy.
  if (held_copies.empty()) return;
  auto held =
      std::make_shared<std::vector<std::pair<std::string, HeldCopy>>>(held_copies.Snapshot());
  executors->Submit([this, held] {
    auto gone = std::make_shared<std::vector<std::pair<std::string, HeldCopy>>>();
    for (auto& [key, copy] : *held) {
      if (!replica_cache->Stat(ReplicaKey(key, copy)).ok()) gone->emplace_back(key, copy);
    }
    PostReply([this, gone] {
      for (auto& [key, copy] : *gone) {
        held_copies.EraseIf(key, [&copy](const HeldCopy& now) { return now == copy; });
      }
    });
  });
}

void Server::Impl::ReportLoad(Clock::time_point now, uint64_t reads_per_s) {
  for (int n = 0; n < static_cast<int>(peer_load.size()); ++n) {
    if (n == self_index || !ring->contains(n) || now < report_again_after[n]) continue;
    // The reply carries the peer's own rate: an idle peer never has to report by itself.
    CallPeer(n, w::Opcode::kLoadReport, w::EncodeLoadReport(reads_per_s), nullptr,
             [this, n](Status s, std::string_view body) {
               w::ReplyStatus rs;
               uint64_t rate = 0;
               if (s.ok() && w::DecodePutReply(body, &rs, &rate).ok()) {
                 peer_load[n] = PeerLoad{rate, Clock::now()};
               }
               if (!s.ok()) report_again_after[n] = Clock::now() + kReportBackoff;
             });
  }
}

void Server::Impl::HandleLoadReport(const Req& r, std::string_view body) {
  uint64_t rate = 0;
  Status s = w::DecodeLoadReport(body, &rate);
  if (s.ok()) {
    const int node = peer_node_of_conn[r.conn];  // PeerOnly checked it is there
    peer_load[node] = PeerLoad{rate, Clock::now()};
  }
  if (!s.ok()) return ReplyStatus(r, s);
  // Answered with this node's own rate (status + u64, the PUT reply's shape).
  Reply(r, s, w::EncodePutReply(s, counters.reads_per_s.load(std::memory_order_relaxed)), nullptr,
        0, MemoryKind::kHost, nullptr);
}

void Server::Impl::CoolDown() {
  const auto now = Clock::now();
  for (auto it = copy_again_after.begin(); it != copy_again_after.end();) {
    it = it->second <= now ? copy_again_after.erase(it) : std::next(it);
  }
  std::vector<std::string> cold;
  for (auto& [key, set] : registry) {
    if (set.state != CopyState::kServing) continue;
    // This node sees only its share of the key's reads: clients spread a hinted key evenly
    // over the primary and its copies.
    const double total = static_cast<double>(sketch.Estimate(HashKey(key))) *
                         static_cast<double>(set.nodes.size() + 1);
    if (options.replication.IsCold(total, node_read_count)) cold.push_back(key);
  }
  for (const std::string& key : cold) {
    GKV_LOG_INFO("dropping the copies of cooled key '{}' (version {})", LogKey(key),
                 registry[key].version);
    Withdraw(key, "cooled");
  }
}

void Server::Impl::PruneFloors(Clock::time_point now) {
  for (auto it = replica_floor.begin(); it != replica_floor.end();) {
    it = now - it->second.set_at > kFloorLifetime ? replica_floor.erase(it) : std::next(it);
  }
}

std::string Server::Impl::ReplicaKey(const std::string& key, const HeldCopy& copy) {
  std::string k = key;
  k.push_back('\0');
  k.append(reinterpret_cast<const char*>(&copy.version), sizeof copy.version);
  k.append(reinterpret_cast<const char*>(&copy.attempt), sizeof copy.attempt);
  return k;
}

void Server::Impl::HandleReplicaPut(const Req& r, std::string_view body,
                                    std::unique_ptr<Incoming> msg) {
  w::PutRequest put;
  HeldCopy copy;
  Status s = w::DecodeReplicaPut(body, &put, &copy.version, &copy.attempt);
  if (s.ok() && put.size != msg->payload_size()) s = Status::ProtocolError("replica size mismatch");
  if (s.ok()) s = CheckValueSize(put.size);
  // Within the replica budget: a copy larger than the largest replica tier can never fit.
  if (s.ok() && put.size > replica_cache->max_object_size()) {
    s = Status::NoSpace("replica of " + FormatSize(put.size) + " exceeds the replica budget");
  }
  if (s.ok() && CoveredByFloor(put.key, copy.attempt)) {
    counters.replica_refused.fetch_add(1, std::memory_order_relaxed);
    s = Status::Aborted("copy refused: its replication attempt was already invalidated");
  }
  if (!s.ok()) return ReplyStatus(r, s);
  auto buf = std::make_shared<std::string>(put.size, '\0');
  ReceivePayload(
      r.conn, std::move(msg), buf->data(), MemoryKind::kHost, [this, r, put, copy, buf](Status rs) {
        if (!rs.ok()) return ReplyStatus(r, rs);
        if (r.Expired()) return ReplyStatus(r, DeadlinePassed());  // its floor may be gone
        if (CoveredByFloor(put.key, copy.attempt)) {
          counters.replica_refused.fetch_add(1, std::memory_order_relaxed);
          return ReplyStatus(r, Status::Aborted("copy refused: invalidated meanwhile"));
        }
        executors->Submit([this, r, put, copy, buf] {
          auto p = replica_cache->Put(ReplicaKey(put.key, copy), buf->data(), put.size, put.tensor);
          Status ps = p.status();
          PostReply([this, r, put, copy, ps] {
            if (!ps.ok()) return ReplyStatus(r, ps);
            if (FencedSince(r)) {  // registered again since: FenceTick dropped the copies
              DropReplicaCopy(put.key, copy);
              return ReplyStatus(r, FencedAtCommit());
            }
            if (!InstallReplica(put.key, copy)) {
              counters.replica_refused.fetch_add(1, std::memory_order_relaxed);
              return ReplyStatus(r, Status::Aborted("copy refused: superseded"));
            }
            ReplyStatus(r, Status::OK());
          });
        });
      });
}

bool Server::Impl::InstallReplica(const std::string& key, const HeldCopy& copy) {
  HeldCopy held;
  const bool holds = held_copies.Find(key, &held);
  if (CoveredByFloor(key, copy.attempt) || (holds && held.attempt > copy.attempt)) {
    DropReplicaCopy(key, copy);  // landed after its invalidation, or older than what we hold
    return false;
  }
  if (holds && held == copy) return true;  // a duplicate message: the same cache key
  held_copies.Set(key, copy);
  if (holds) DropReplicaCopy(key, held);
  counters.replica_installs.fetch_add(1, std::memory_order_relaxed);
  return true;
}

void Server::Impl::DropReplicaCopy(const std::string& key, const HeldCopy& copy) {
  executors->Submit([this, rk = ReplicaKey(key, copy)] { (void)replica_cache->Delete(rk); });
}

void Server::Impl::HandleInvalidate(const Req& r, std::string_view body) {
  std::string key;
  uint64_t version = 0, attempt = 0;
  Status s = w::DecodeInvalidate(body, &key, &version, &attempt);
  if (!s.ok()) return ReplyStatus(r, s);
  if (r.h.flags & w::kFlagAllKeys) {
    // The sender restarted: its previous run's copies here go (PeerOnly checked the sender).
    const int sender = peer_node_of_conn[r.conn];
    for (const auto& [held_key, copy] : held_copies.Snapshot()) {
      if (ring->Owner(held_key) != sender) continue;
      HeldCopy erased;
      if (held_copies.EraseIf(
              held_key, [](const HeldCopy&) { return true; }, &erased)) {
        DropReplicaCopy(held_key, erased);
      }
    }
    return ReplyStatus(r, Status::OK());
  }
  Floor& floor = replica_floor[key];
  floor.attempt = std::max(floor.attempt, attempt);
  floor.set_at = Clock::now();
  HeldCopy erased;
  if (held_copies.EraseIf(
          key, [&floor](const HeldCopy& held) { return held.attempt <= floor.attempt; }, &erased)) {
    DropReplicaCopy(key, erased);
  }
  ReplyStatus(r, Status::OK());
}

std::string Server::Impl::ReplicaRowKey(const std::string& key, uint64_t version) const {
  HeldCopy held;
  if (!held_copies.Find(key, &held) || held.version != version) return {};
  return ReplicaKey(key, held);
}

void Server::Impl::HandleReplicaGet(const Req& r, std::string_view body) {
  std::string key;
  uint64_t version = 0;
  Status s = w::DecodeReplicaGet(body, &key, &version);
  if (!s.ok()) return ReplyStatus(r, s);
  const Status miss = Status::NotFound("no replica of that version here");
  const std::string rk = ReplicaRowKey(key, version);
  if (rk.empty()) {
    return Reply(r, miss, w::EncodeObjectReply(miss, {}), nullptr, 0, MemoryKind::kHost, nullptr);
  }
  auto send = [this, r, version](std::shared_ptr<ReadHandle> handle, const void* data,
                                 uint64_t size, MemoryKind kind,
                                 std::shared_ptr<std::string> staging) {
    counters.CountReplicaRead(r.worker);
    CountRow();  // a miss costs the node little; it is read again from the primary
    w::ObjectMeta meta = ToWire(handle->info());
    meta.version = version;  // the primary's version, not this cache's own counter
    Reply(r, Status::OK(), w::EncodeObjectReply(Status::OK(), meta), data, size, kind,
          [handle, staging] {});
  };
  ReadHandle h;
  const auto fp = replica_cache->TryAcquireFromMemory(rk, &h, device_zero_copy());
  if (fp == TieredCache::FastPath::kMiss) {
    return Reply(r, miss, w::EncodeObjectReply(miss, {}), nullptr, 0, MemoryKind::kHost, nullptr);
  }
  if (fp == TieredCache::FastPath::kServed &&
      (h.memory_kind() == MemoryKind::kHost || device_zero_copy())) {
    auto handle = std::make_shared<ReadHandle>(std::move(h));
    return send(handle, handle->data(), handle->size(), handle->memory_kind(), nullptr);
  }
  // A copy in GPU memory that UCX cannot send from: staged through host memory on an executor,
  // as the primary's own slow path does (promotion is off in the replica cache).
  h = ReadHandle();
  ReadOnExecutor(r, replica_cache.get(), rk, miss, send);
}

}  // namespace gkv
