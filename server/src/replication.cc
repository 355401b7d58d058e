// Adaptive replication of hot keys (docs/ARCHITECTURE.md, "Hot keys"): as primary, counting
// reads, copying hot keys, invalidating copies before a write is acknowledged, cooling; as
// replica, installing, serving and dropping copies. See server_impl.h for the map of server/.
#include "gkv/hash.h"
#include "gkv/log.h"
#include "gkv/size.h"
#include "server_impl.h"

namespace gkv {

bool Server::Impl::CoveredByFloor(const std::string& key, uint64_t version) const {
  auto fl = replica_floor.find(key);
  return fl != replica_floor.end() && fl->second.version >= version;
}

std::vector<uint16_t> Server::Impl::HintFor(const std::string& key, uint64_t version) const {
  std::vector<uint16_t> hint;
  auto it = registry.find(key);
  if (it == registry.end() || it->second.pending || it->second.cancelled ||
      it->second.version != version) {
    return hint;
  }
  for (int n : it->second.nodes) hint.push_back(static_cast<uint16_t>(n));
  return hint;
}

void Server::Impl::CountRead(const std::string& key) {
  const uint32_t est = sketch.Add(HashKey(key));
  // Decay halves the counts every second: a steady R reads/s settles near 2R.
  if (est < 2 * options.hot_reads_per_s || registry.find(key) != registry.end()) return;
  auto wait = copy_again_after.find(key);
  if (wait != copy_again_after.end()) {
    if (Clock::now() < wait->second) return;
    copy_again_after.erase(wait);
  }
  StartReplication(key);
}

std::vector<int> Server::Impl::ReplicaTargets(const std::string& key) const {
  std::vector<int> out;
  for (int n : ring->NodesFor(key, options.hot_replicas + 1)) {
    if (n != self_index && static_cast<int>(out.size()) < options.hot_replicas) out.push_back(n);
  }
  return out;
}

void Server::Impl::StartReplication(const std::string& key) {
  std::vector<int> targets = ReplicaTargets(key);
  if (targets.empty()) return;
  registry[key] = ReplicaSet{};
  executors->Submit([this, key, targets] {
    auto got = cache->Acquire(key);
    if (!got.ok()) {
      return PostReply([this, key] { registry.erase(key); });
    }
    auto bytes = std::make_shared<std::string>(got->size(), '\0');
    Status cs = cache->CopyBytes(bytes->data(), MemoryKind::kHost, got->data(), got->memory_kind(),
                                 got->size());
    const ObjectInfo info = got->info();
    *got = ReadHandle();
    PostReply([this, key, targets, bytes, info, cs] {
      if (!cs.ok()) {
        registry.erase(key);
        return;
      }
      auto results = std::make_shared<std::vector<int>>();
      auto remaining = std::make_shared<size_t>(targets.size());
      for (int node : targets) {
        std::string body = w::EncodeReplicaPut({key, info.tensor, info.size}, info.version);
        CallPeer(node, w::Opcode::kReplicaPut, std::move(body), bytes,
                 [this, key, node, info, results, remaining, bytes](Status s, std::string_view) {
                   if (s.ok()) results->push_back(node);
                   if (--*remaining == 0) ReplicationDone(key, info.version, *results);
                 });
      }
    });
  });
}

void Server::Impl::ReplicationDone(const std::string& key, uint64_t version,
                                   const std::vector<int>& nodes) {
  auto it = registry.find(key);
  if (it == registry.end()) return;
  if (it->second.cancelled || nodes.empty()) {
    // Written while the copies were made: they are of an old version and never hinted;
    // drop them anyway so they do not take replica room.
    for (int n : nodes)
      CallPeer(n, w::Opcode::kInvalidate, w::EncodeInvalidate(key, version), nullptr,
               [](Status, std::string_view) {});
    registry.erase(it);
    return;
  }
  it->second.pending = false;
  it->second.nodes = nodes;
  it->second.version = version;
  counters.replicas_created.fetch_add(nodes.size(), std::memory_order_relaxed);
  std::string list;
  for (int n : nodes) list += (list.empty() ? "" : ",") + options.cluster.nodes[n].id;
  GKV_LOG_INFO("replicating hot key '{}' (version {}) to {}", key, version, list);
}

void Server::Impl::AfterWrite(const std::vector<std::string>& keys, std::function<void()> reply) {
  if (registry.empty()) return reply();
  auto remaining = std::make_shared<size_t>(1);
  auto any_failed = std::make_shared<bool>(false);
  auto finish = [this, remaining, any_failed, reply] {
    if (--*remaining > 0) return;
    if (!*any_failed) return reply();
    // A replica node that did not confirm may still serve clients holding a hint; hints live
    // kHintTtl on the client, so wait that out (plus a deadline's margin) before acknowledging.
    timers.push_back({Clock::now() + std::chrono::milliseconds(1500), reply});
  };
  for (const std::string& key : keys) {
    auto it = registry.find(key);
    if (it == registry.end()) continue;
    copy_again_after[key] = Clock::now() + std::chrono::seconds(2);
    if (it->second.pending) {
      it->second.cancelled = true;
      continue;
    }
    const ReplicaSet set = it->second;
    registry.erase(it);
    counters.replicas_dropped.fetch_add(set.nodes.size(), std::memory_order_relaxed);
    for (int n : set.nodes) {
      ++*remaining;
      CallPeer(n, w::Opcode::kInvalidate, w::EncodeInvalidate(key, set.version), nullptr,
               [finish, any_failed](Status s, std::string_view) {
                 if (!s.ok()) *any_failed = true;
                 finish();
               });
    }
  }
  finish();
}

void Server::Impl::CoolDown() {
  const double cool =
      options.cool_reads_per_s > 0 ? options.cool_reads_per_s : options.hot_reads_per_s / 4;
  const auto now = Clock::now();
  for (auto it = copy_again_after.begin(); it != copy_again_after.end();) {
    it = it->second <= now ? copy_again_after.erase(it) : std::next(it);
  }
  std::vector<std::string> cold;
  for (auto& [key, set] : registry) {
    if (!set.pending && sketch.Estimate(HashKey(key)) < 2 * cool) cold.push_back(key);
  }
  for (const std::string& key : cold) {
    ReplicaSet set = registry[key];
    registry.erase(key);
    counters.replicas_dropped.fetch_add(set.nodes.size(), std::memory_order_relaxed);
    GKV_LOG_INFO("dropping the copies of cooled key '{}' (version {})", key, set.version);
    for (int n : set.nodes) {
      CallPeer(n, w::Opcode::kInvalidate, w::EncodeInvalidate(key, set.version), nullptr,
               [](Status, std::string_view) {});
    }
  }
}

void Server::Impl::PruneFloors(Clock::time_point now) {
  for (auto it = replica_floor.begin(); it != replica_floor.end();) {
    it = now - it->second.set_at > kFloorLifetime ? replica_floor.erase(it) : std::next(it);
  }
}

std::string Server::Impl::ReplicaKey(const std::string& key, uint64_t version) {
  std::string k = key;
  k.push_back('\0');
  k.append(reinterpret_cast<const char*>(&version), sizeof version);
  return k;
}

void Server::Impl::HandleReplicaPut(const Req& r, std::string_view body,
                                    std::unique_ptr<Incoming> msg) {
  w::PutRequest put;
  uint64_t version = 0;
  Status s = w::DecodeReplicaPut(body, &put, &version);
  if (s.ok() && put.size != msg->payload_size()) s = Status::ProtocolError("replica size mismatch");
  if (s.ok() && !replica_cache) s = Status::NotSupported("replication is off on this node");
  if (s.ok()) s = CheckValueSize(put.size);
  // Within the replica budget: a copy larger than the largest replica tier can never fit.
  if (s.ok() && put.size > replica_cache->max_object_size()) {
    s = Status::NoSpace("replica of " + FormatSize(put.size) + " exceeds the replica budget");
  }
  if (!s.ok()) return ReplyStatus(r, s);
  auto buf = std::make_shared<std::string>(put.size, '\0');
  ReceivePayload(r.conn, std::move(msg), buf->data(), MemoryKind::kHost,
                 [this, r, put, version, buf](Status rs) {
                   if (!rs.ok()) return ReplyStatus(r, rs);
                   if (r.Expired())
                     return ReplyStatus(r, DeadlinePassed());  // its floor may be gone
                   if (CoveredByFloor(put.key, version)) {
                     return ReplyStatus(r, Status::OK());  // already invalidated
                   }
                   executors->Submit([this, r, put, version, buf] {
                     auto p = replica_cache->Put(ReplicaKey(put.key, version), buf->data(),
                                                 put.size, put.tensor);
                     Status ps = p.status();
                     PostReply([this, r, put, version, ps] {
                       if (ps.ok()) InstallReplica(put.key, version);
                       ReplyStatus(r, ps);
                     });
                   });
                 });
}

void Server::Impl::InstallReplica(const std::string& key, uint64_t version) {
  const bool covered = CoveredByFloor(key, version);
  uint64_t& current = replica_version[key];
  if (covered || current > version) {
    DropReplicaCopy(key, version);  // landed after its invalidation, or older than what we hold
    return;
  }
  if (current != 0 && current != version) DropReplicaCopy(key, current);
  current = version;
  counters.replica_installs.fetch_add(1, std::memory_order_relaxed);
}

void Server::Impl::DropReplicaCopy(const std::string& key, uint64_t version) {
  executors->Submit([this, rk = ReplicaKey(key, version)] { (void)replica_cache->Delete(rk); });
}

void Server::Impl::HandleInvalidate(const Req& r, std::string_view body) {
  std::string key;
  uint64_t version = 0;
  Status s = w::DecodeInvalidate(body, &key, &version);
  if (!s.ok()) return ReplyStatus(r, s);
  Floor& floor = replica_floor[key];
  floor.version = std::max(floor.version, version);
  floor.set_at = Clock::now();
  auto it = replica_version.find(key);
  if (it != replica_version.end() && it->second <= floor.version) {
    if (replica_cache) DropReplicaCopy(key, it->second);
    replica_version.erase(it);
  }
  ReplyStatus(r, Status::OK());
}

void Server::Impl::HandleReplicaGet(const Req& r, std::string_view body) {
  std::string key;
  uint64_t version = 0;
  Status s = w::DecodeReplicaGet(body, &key, &version);
  if (!s.ok()) return ReplyStatus(r, s);
  Status miss = Status::NotFound("no replica of that version here");
  auto it = replica_version.find(key);
  ReadHandle h;
  if (!replica_cache || it == replica_version.end() || it->second != version ||
      CoveredByFloor(key, version) ||
      replica_cache->TryAcquireFromMemory(ReplicaKey(key, version), &h) !=
          TieredCache::FastPath::kServed ||
      (h.memory_kind() == MemoryKind::kDevice && !transport->device_memory_supported())) {
    return Reply(r, miss, w::EncodeObjectReply(miss, {}), nullptr, 0, MemoryKind::kHost, nullptr);
  }
  counters.replica_reads.fetch_add(1, std::memory_order_relaxed);
  auto handle = std::make_shared<ReadHandle>(std::move(h));
  w::ObjectMeta meta = ToWire(handle->info());
  meta.version = version;  // the primary's version, not this cache's own counter
  Reply(r, Status::OK(), w::EncodeObjectReply(Status::OK(), meta), handle->data(), handle->size(),
        handle->memory_kind(), [handle] {});
}

}  // namespace gkv
