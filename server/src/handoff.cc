// Handoff: when the ring changes, keys go to their new owners (see server_impl.h for the map of
// server/; docs/ARCHITECTURE.md, "Membership").
//
// One scan per ring change, on a thread of its own (it reads values from every tier, disk
// included): for each key this node holds, with P_old and P_new its owners in the ring before
// and after (the first `replicas` nodes), the new owners it lacks are P_new - P_old.
//  - This node is not in P_new: it sends the key to those new owners (or to P_new's first when
//    all of them owned it before) and deletes its copy once every one of them acknowledged,
//    and only if the key still has the version it sent (DeleteVersion).
//  - This node is in P_new: the first node of P_old still in the ring sends it (a repair of a
//    copy lost with a dead node, or the copy a joining node now holds); the others leave it.
// The receiver keeps the version the object had (CommitHandedOff) unless it holds a newer one
// or deleted the key since; a write that reached the new owner first therefore wins.
// A new ring change restarts the scan. A scan whose sends failed is run again a second later,
// so a key is deleted here only after its new owner has it. A write admitted under the old
// ring that commits after the scan may have read the key starts one more pass over such keys
// (NoteCommitted), so a leaving node does not exit holding it and a new owner does not keep
// the older version. The rate is bounded
// (ServerOptions::handoff_bytes_per_s).
#include <condition_variable>
#include <future>

#include "gkv/log.h"
#include "gkv/size.h"
#include "server_impl.h"

namespace gkv {

namespace {

bool Has(const std::vector<int>& v, int x) { return std::find(v.begin(), v.end(), x) != v.end(); }

constexpr auto kTombstoneLifetime = std::chrono::seconds(60);
// Past this many bytes of remembered deletes (keys plus a per-entry overhead) some are
// forgotten early (a workload deleting 100k keys a second would otherwise hold 6M): a
// forgotten delete only reopens the window in which a handoff or repair that started before it
// could bring the key back.
constexpr size_t kMaxTombstoneBytes = size_t{64} << 20;
constexpr size_t kTombstoneOverhead = 64;

}  // namespace

void Server::Impl::StartHandoffThread() {
  handoff = std::make_unique<Handoff>();
  handoff->thread = std::thread([this] {
    Handoff& H = *handoff;
    for (;;) {
      RingPtr now, before;
      uint64_t gen;
      bool full;                                  // false: only the keys in `only`
      std::unordered_map<std::string, int> only;  // key -> the node that handed it here
      {
        std::unique_lock<std::mutex> lock(H.mu);
        H.cv.wait(lock, [&] { return H.stop || H.pending || !H.recheck.empty(); });
        if (H.stop) return;
        full = H.pending;
        H.pending = false;
        only.swap(H.recheck);  // a full pass covers them too
        H.scanning = true;
        now = H.now;
        before = H.before;
        gen = H.generation;
      }
      auto superseded = [&] {
        std::lock_guard<std::mutex> lock(H.mu);
        return H.stop || H.generation != gen;
      };
      counters.handoffs_running.store(1, std::memory_order_relaxed);
      SyncHandoffMark();
      const auto started = Clock::now();
      uint64_t keys_out = 0, bytes_out = 0, failed = 0, deleted = 0;
      for (const KeyListing& k : cache->ListKeys()) {
        if (superseded()) break;
        const auto again = only.find(k.key);
        if (!full && again == only.end()) continue;
        const std::vector<int> p_new = now->Owners(k.key, replicas);
        const std::vector<int> p_old =
            before ? before->Owners(k.key, replicas) : std::vector<int>{};
        const bool mine = Has(p_new, self_index);
        std::vector<int> targets;
        // A pass over recently written keys does not send a key back to the owner that just
        // handed it here keeping its own copy (w::kFlagSenderKeeps): two owners whose previous
        // rings differ would each see the other as new to the key and pass every newer write
        // back and forth for as long as writes come. A full pass sends to every new owner.
        const int handed_by = full || again == only.end() ? -1 : again->second;
        for (int n : p_new) {
          if (n != self_index && !Has(p_old, n) && !(mine && n == handed_by)) targets.push_back(n);
        }
        if (mine) {
          if (targets.empty()) continue;
          int sender = -1;
          for (int n : p_old) {
            if (now->contains(n)) {
              sender = n;
              break;
            }
          }
          if (sender != self_index) continue;
        } else if (targets.empty()) {
          if (p_new.empty()) continue;  // an empty ring: nowhere to go
          targets.push_back(p_new.front());
        }
        std::string bytes;
        auto info = cache->Get(k.key, &bytes);
        if (!info.ok()) continue;  // deleted or dropped meanwhile
        uint64_t sent_at = 0;
        {
          std::lock_guard<std::mutex> back(H.back_mu);
          sent_at = H.sequence;
        }
        bool all_ok = true;
        for (int target : targets) {
          Status s = SendHandoff(target, k.key, *info, k.durable, bytes, mine);
          if (!s.ok()) {
            GKV_LOG_DEBUG("handoff of a key to node {} failed: {}", target, s.ToString());
            all_ok = false;
            break;
          }
          ++keys_out;
          bytes_out += bytes.size();
          counters.handoff_keys_out.fetch_add(1, std::memory_order_relaxed);
          counters.handoff_bytes_out.fetch_add(bytes.size(), std::memory_order_relaxed);
          if (mine) counters.repairs.fetch_add(1, std::memory_order_relaxed);
          PaceHandoff(started, bytes_out);
        }
        if (!all_ok) {
          ++failed;
          continue;
        }
        if (!mine) {
          // Kept when it came back since the send (see Handoff::received), or when a newer
          // ring gives it to this node again (the next scan hands it on if need be).
          std::lock_guard<std::mutex> back(H.back_mu);
          if (Owns(*CurrentRing(), k.key)) continue;
          const auto in = H.received.find(k.key);
          if ((in != H.received.end() && in->second > sent_at) || sent_at < H.cleared_at) {
            ++failed;  // came back (or may have): the next scan hands it on again
            continue;
          }
          Status ds = cache->DeleteVersion(k.key, info->version);
          if (ds.ok()) {
            ++deleted;
          } else if (ds.code() != StatusCode::kNotFound) {
            ++failed;  // written meanwhile (a newer version): the next scan looks again
          }
        }
      }
      const bool was_superseded = superseded();
      const double secs = std::chrono::duration<double>(Clock::now() - started).count();
      if (!full && failed == 0) {
        GKV_LOG_DEBUG("handoff: {} keys looked at again, {} sent", only.size(), keys_out);
      } else if (keys_out > 0 || failed > 0) {
        GKV_LOG_INFO(
            "handoff for ring epoch {}: {} keys ({}) sent in {:.2f} s ({:.1f} MB/s), {} deleted "
            "here, {} to retry{}",
            now->epoch(), keys_out, FormatSize(bytes_out), secs,
            secs > 0 ? bytes_out / secs / 1e6 : 0.0, deleted, failed,
            was_superseded ? " (superseded by a newer ring)" : "");
      }
      std::unique_lock<std::mutex> lock(H.mu);
      if (!was_superseded && failed > 0) {
        // Try again in a second (a peer may be restarting), unless a new ring comes first. The
        // scan stays "running" meanwhile: a leaving node must not take this for done.
        H.cv.wait_for(lock, std::chrono::seconds(1), [&] { return H.stop || H.pending; });
        if (!H.stop && !H.pending) {
          if (full) {
            H.pending = true;
          } else {
            for (const auto& [key, from] : only) NoteRecheckLocked(key, from);
          }
        }
      }
      H.scanning = false;
      // Passes over rechecked keys come in bursts after a ring change (writes admitted under
      // the ring before keep committing): the mark stays on kMarkLinger for the next pass, so
      // etcd sees the mark set and cleared once per burst, not once per pass (issue 38 item
      // 4). Clients see moving keys that much longer: a miss is asked of the previous owners.
      if (!H.pending && H.recheck.empty() && !H.stop) {
        H.cv.wait_for(lock, Handoff::kMarkLinger,
                      [&] { return H.stop || H.pending || !H.recheck.empty(); });
      }
      if (!H.pending && H.recheck.empty() && !H.stop) {
        counters.handoffs_running.store(0, std::memory_order_relaxed);
        lock.unlock();
        SyncHandoffMark();  // stays on while this node catches up
      }
    }
  });
}

void Server::Impl::StopHandoffThread() {
  if (!handoff) return;
  {
    std::lock_guard<std::mutex> lock(handoff->mu);
    handoff->stop = true;
  }
  handoff->cv.notify_all();
  if (handoff->thread.joinable()) handoff->thread.join();
}

void Server::Impl::ScheduleHandoff(RingPtr now, RingPtr before) {
  if (!handoff) return;
  // Only rings this node is or was part of: a ring built before it joined moves nothing.
  if (!now->contains(self_index) && !(before && before->contains(self_index))) return;
  {
    std::lock_guard<std::mutex> lock(handoff->mu);
    // Changes in quick succession: the scan compares with the ring it last started from, so
    // nothing between is missed (a key's owners before the first change are its holders).
    const RingPtr compared = handoff->before;
    if (!handoff->pending && !handoff->scanning) handoff->before = before;
    if (!handoff->before) handoff->before = before;
    if (handoff->before != compared || handoff->before_ids.empty()) {
      // For the scan's mark (clients that saw no change ask these nodes too). The node table
      // is the I/O thread's: the ids are taken here.
      handoff->before_ids.clear();
      for (size_t p = 0; handoff->before && p < handoff->before->size(); ++p) {
        handoff->before_ids.push_back(options.cluster.nodes[handoff->before->slot(p)].id);
      }
    }
    handoff->now = now;
    handoff->generation++;
    handoff->pending = true;
  }
  counters.handoffs_running.store(1, std::memory_order_relaxed);
  handoff->cv.notify_all();
}

bool Server::Impl::HandoffIdle() const {
  if (!handoff) return true;
  std::lock_guard<std::mutex> lock(handoff->mu);
  return !handoff->pending && handoff->recheck.empty() && !handoff->scanning;
}

void Server::Impl::NoteRecheckLocked(const std::string& key, int handed_by) {
  auto [at, added] = handoff->recheck.emplace(key, handed_by);
  if (!added && at->second != handed_by) at->second = -1;  // two senders: send to both
}

void Server::Impl::NoteCommitted(const std::vector<std::string>& keys, uint64_t admitted_epoch,
                                 int handed_by) {
  if (catching_up.load(std::memory_order_relaxed)) {
    for (const std::string& key : keys) Confirm(key);
  }
  // Admitted under the current ring: the admission checked ownership, nothing moved since.
  if (!RingMovedSince(admitted_epoch)) return;
  // Keys this node does not own now go; so do keys whose owners the last change moved.
  bool added = false;
  {
    std::lock_guard<std::mutex> lock(handoff->mu);
    const Handoff& H = *handoff;
    if (!H.now) return;  // no ring change yet: nowhere to give keys to
    for (const std::string& key : keys) {
      bool moved = !Owns(*H.now, key);
      if (!moved && H.before)
        moved = H.now->Owners(key, replicas) != H.before->Owners(key, replicas);
      if (!moved) continue;
      const size_t before_size = handoff->recheck.size();
      NoteRecheckLocked(key, handed_by);
      added |= handoff->recheck.size() != before_size;
    }
  }
  if (!added) return;
  counters.handoffs_running.store(1, std::memory_order_relaxed);
  handoff->cv.notify_all();
}

Status Server::Impl::SendHandoff(int target, const std::string& key, const ObjectInfo& info,
                                 bool durable, const std::string& bytes, bool keeps) {
  w::PutRequest put;
  put.key = key;
  put.tensor = info.tensor;
  put.size = bytes.size();
  auto payload = std::make_shared<std::string>(bytes);
  // Long enough for the value at a slow 50 MB/s, and never under 2 s.
  const auto budget = std::chrono::milliseconds(
      std::max<uint64_t>(2000, bytes.size() / (50ull * 1000 * 1000 / 1000)));
  auto done = std::make_shared<std::promise<Status>>();
  std::future<Status> result = done->get_future();
  const uint16_t flags =
      (durable ? w::kFlagDurable : uint16_t{0}) | (keeps ? w::kFlagSenderKeeps : uint16_t{0});
  transport->Post([this, target, body = w::EncodeHandoffPut(put, info.version), payload, done,
                   flags, budget]() mutable {
    CallPeer(
        target, w::Opcode::kHandoffPut, std::move(body), payload,
        [done](Status s, std::string_view) { done->set_value(s); }, flags, budget);
  });
  // The I/O thread may be stopping (a posted task then never runs): bounded wait.
  if (result.wait_for(budget + std::chrono::seconds(1)) != std::future_status::ready) {
    return Status::Timeout("handoff call did not complete");
  }
  return result.get();
}

void Server::Impl::PaceHandoff(Clock::time_point started, uint64_t bytes_sent) {
  if (options.handoff_bytes_per_s == 0) return;
  const auto due =
      started + std::chrono::microseconds(static_cast<int64_t>(
                    bytes_sent * 1e6 / static_cast<double>(options.handoff_bytes_per_s)));
  if (due > Clock::now()) std::this_thread::sleep_until(due);
}

void Server::Impl::HandleHandoffPut(const Req& r, std::string_view body,
                                    std::unique_ptr<Incoming> msg) {
  if (peer_node_of_conn.count(r.conn) == 0) {
    return ReplyStatus(
        r, Status::PermissionDenied("handoffs are accepted from peer nodes only (PEER_HELLO)"));
  }
  w::PutRequest put;
  uint64_t version = 0;
  const bool expect = (r.h.flags & w::kFlagExpectVersion) != 0;
  uint64_t expected = 0;  // with `expect`: the version the key must still have here (0: none)
  Status s = expect ? w::TakeVersion(&body, &expected, /*zero_ok=*/true) : Status::OK();
  if (s.ok()) s = w::DecodeHandoffPut(body, &put, &version);
  if (s.ok() && put.size != msg->payload_size()) s = Status::ProtocolError("handoff size mismatch");
  if (s.ok()) s = CheckValueSize(put.size);
  if (s.ok() && version == 0) s = Status::ProtocolError("handoff without a version");
  // Capped (issue 38 item 11): a version of UINT64_MAX would make the key un-overwritable here.
  if (s.ok()) {
    s = CheckHandoffVersion(version);
    if (!s.ok()) {
      GKV_LOG_WARN("refused a handoff from {}: {}",
                   LogKey(options.cluster.nodes[peer_node_of_conn[r.conn]].id), s.ToString());
    }
  }
  if (!s.ok()) return ReplyStatus(r, s);
  const bool durable = (r.h.flags & w::kFlagDurable) != 0;
  // The sender keeps its copy: this version is not sent back to it (NoteCommitted).
  const int sender = (r.h.flags & w::kFlagSenderKeeps) ? peer_node_of_conn[r.conn] : -1;
  ReadPayloadThen(
      r, std::move(msg),
      [this, r, put, version, durable, expect, expected, sender](
          Status rs, std::shared_ptr<PayloadBuffer> buf) {
        Status st = rs;
        bool changed = false;
        if (handoff) {
          // Before the install, so that a scan here that sent this key away either sees this
          // (and keeps its copy) or deleted it first (and the install puts it back).
          std::lock_guard<std::mutex> back(handoff->back_mu);
          if (handoff->received.size() >= Handoff::kMaxReceived) {
            handoff->received.clear();
            handoff->cleared_at = handoff->sequence + 1;
          }
          handoff->received[put.key] = ++handoff->sequence;
        }
        if (st.ok() && FencedSince(r)) st = FencedAtCommit();
        if (st.ok() && !DeletedSince(put.key, version)) {
          auto h = cache->Reserve(put.key, put.size, put.tensor);
          if (h.ok()) {
            st = cache->CopyBytes(h->data(), h->memory_kind(), buf->data(), MemoryKind::kHost,
                                  put.size);
            if (st.ok()) {
              auto c = expect ? cache->CommitHandedOffIf(std::move(*h), durable, version, expected)
                              : cache->CommitHandedOff(std::move(*h), durable, version);
              if (c.ok()) {
                changed = *c;
                // A delete that came in while this was being installed wins.
                if (changed && DeletedSince(put.key, version)) {
                  (void)cache->DeleteVersion(put.key, version);
                  changed = false;
                }
              } else {
                st = c.status();
              }
            }
          } else {
            st = h.status();
          }
        }
        if (st.ok()) {
          counters.handoff_keys_in.fetch_add(1, std::memory_order_relaxed);
          counters.handoff_bytes_in.fetch_add(put.size, std::memory_order_relaxed);
        }
        PostReply([this, r, st, changed, expect, sender, key = put.key] {
          // Versions compared: whichever this node now holds is the newest.
          if (st.ok()) Confirm(key);
          // A repair's push that did not land (the key moved on meanwhile) says so,
          // so the sender does not count it as a repair.
          if (!changed && expect && st.ok()) {
            return ReplyStatus(r, Status::Aborted("the key changed since it was "
                                                  "compared; nothing installed"));
          }
          if (!changed) return ReplyStatus(r, st);
          // Sent by the sender's ring, never checked against this node's: a key it does
          // not own here (the sender's ring is behind, or this one moved on) goes on.
          NoteCommitted({key}, kNotRouted, sender);
          // A new version of the key here: copies of an older one go first.
          AfterWrite({key}, [this, r, st] { ReplyStatus(r, st); });
        });
      },
      /*on_executor=*/true, /*limit=*/options.max_value_size);
}

void Server::Impl::HandleRepair(const Req& r, std::string_view body) {
  std::string key, target_id;
  uint64_t seen = 0;
  Status s = w::DecodeRepair(body, &key, &target_id, &seen);
  const int target = s.ok() ? options.cluster.FindNode(target_id) : -1;
  if (s.ok() && (target < 0 || target == self_index)) {
    s = Status::InvalidArgument("repair target is not a peer of this node");
  }
  // Under etcd the ring says who holds a key: only its owners take copies.
  if (s.ok() && elastic() && !Has(ring->Owners(key, replicas), target)) {
    s = Status::InvalidArgument("repair target does not own the key in ring epoch " +
                                std::to_string(ring->epoch()));
  }
  if (!s.ok()) return ReplyStatus(r, s);
  SubmitRequestWork(r, [this, r, key = std::move(key), target, seen] {
    if (r.Expired()) return PostReplyStatus(r, DeadlinePassed());
    // The copy is held in memory until the push ends: repairs together hold at most a quarter
    // of the node's in-flight budget (a busy node repairs later; reads sample the key again).
    auto st = cache->Stat(key);
    if (!st.ok()) return PostReplyStatus(r, st.status());
    const uint64_t size = st->size;
    const uint64_t before = repair_bytes.fetch_add(size);
    // One repair always goes (so a value larger than the budget is still repaired).
    if (before > 0 && before + size > options.max_inflight_bytes / 4) {
      repair_bytes.fetch_sub(size);
      return PostReplyStatus(r, Status::Busy("too many repairs in flight"));
    }
    auto bytes = std::shared_ptr<std::string>(new std::string(), [this, size](std::string* b) {
      repair_bytes.fetch_sub(size);
      delete b;
    });
    auto info = cache->Get(key, bytes.get());
    if (!info.ok()) return PostReplyStatus(r, info.status());
    w::PutRequest put;
    put.key = key;
    put.tensor = info->tensor;
    put.size = bytes->size();
    std::string push = w::EncodeHandoffPut(put, info->version);
    w::AppendVersion(&push, seen);
    // 2 s, plus the time the bytes take at 50 MB/s (a slow link still completes large values).
    const auto budget = std::chrono::seconds(2) + std::chrono::milliseconds(put.size / 50'000);
    const uint16_t flags = w::kFlagExpectVersion | w::kFlagSenderKeeps |
                           (info->durable ? w::kFlagDurable : uint16_t{0});
    PostReply([this, r, target, bytes, flags, budget, push = std::move(push)]() mutable {
      CallPeer(
          target, w::Opcode::kHandoffPut, std::move(push), bytes,
          [this, r](Status st, std::string_view) {
            if (st.ok()) counters.read_repairs.fetch_add(1, std::memory_order_relaxed);
            ReplyStatus(r, st);
          },
          flags, budget);
    });
  });
}

void Server::Impl::RememberDelete(const std::string& key, uint64_t client_version) {
  if (!elastic() && client_version == 0) return;
  const auto now = Clock::now();
  const uint64_t at = std::max(client_version, cache->VersionClock());
  std::lock_guard<std::mutex> lock(tombstone_mu);
  auto [slot, added] = tombstones.try_emplace(key, at, now);
  if (added) {
    tombstone_bytes += key.size() + kTombstoneOverhead;
  } else {
    slot->second = {at, now};
  }
  const bool full = tombstone_bytes > kMaxTombstoneBytes;
  if (!full && now - last_tombstone_prune < std::chrono::seconds(10)) return;
  last_tombstone_prune = now;
  auto forget = [this](auto it) {
    tombstone_bytes -= it->first.size() + kTombstoneOverhead;
    return tombstones.erase(it);
  };
  // Full: keep the newest half of the lifetime, then, if still full, whatever order leaves.
  const auto lifetime = full ? kTombstoneLifetime / 2 : kTombstoneLifetime;
  for (auto it = tombstones.begin(); it != tombstones.end();) {
    it = now - it->second.second > lifetime ? forget(it) : std::next(it);
  }
  for (auto it = tombstones.begin();
       full && it != tombstones.end() && tombstone_bytes > kMaxTombstoneBytes / 2;) {
    it = it->first == key ? std::next(it) : forget(it);
  }
}

bool Server::Impl::DeletedSince(const std::string& key, uint64_t version) {
  std::lock_guard<std::mutex> lock(tombstone_mu);
  auto it = tombstones.find(key);
  return it != tombstones.end() && it->second.first >= version;
}

}  // namespace gkv
