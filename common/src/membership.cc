#include "gkv/membership.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <thread>

#include "etcd_http.h"
#include "gkv/log.h"

namespace gkv {
namespace {

using nlohmann::json;
using namespace std::chrono_literals;

// Key kinds under the cluster's prefix (gkv/membership.h).
constexpr std::string_view kMembersDir = "members/";
constexpr std::string_view kDrainDir = "drain/";
constexpr std::string_view kHandoffDir = "handoff/";
// The value of handoff/<id> for a node that only catches up (a running scan's mark is empty).
constexpr std::string_view kCatchUpMark = "catch-up";

// An idle watch stream carries no bytes at all (the JSON gateway sends no progress messages),
// so a read timeout cannot tell an idle etcd from a vanished one: the stream is re-opened
// after this long without a message, resuming at the next revision (cheap, and it bounds how
// long a silently partitioned etcd goes unnoticed).
constexpr auto kWatchIdleTimeout = 10s;
// Between attempts to reach etcd again after a watch could not be established.
constexpr auto kMinRetryDelay = 100ms;
constexpr auto kMaxRetryDelay = 2s;
// The shortest keepalive period, whatever the TTL.
constexpr auto kMinKeepAlivePeriod = 100ms;
// The keepalive's next try after a failed one (unless the period is shorter).
constexpr auto kKeepAliveRetry = 200ms;

etcd::Credentials Credentials(const EtcdConfig& etcd) { return {etcd.username, etcd.password}; }

Status CheckEtcdConfig(const EtcdConfig& etcd) {
  if (etcd.endpoints.empty()) return Status::InvalidArgument("etcd: no endpoints configured");
  if (etcd.cluster.empty()) return Status::InvalidArgument("etcd: empty cluster name");
  return Status::OK();
}

Status CheckNodeId(std::string_view id) {
  if (id.empty() || id.find('/') != std::string_view::npos) {
    return Status::InvalidArgument("node id '" + std::string(id) + "' is empty or has a '/'");
  }
  return Status::OK();
}

std::string ForeignPlacementMessage(const MemberRecord& m) {
  return "member '" + LogKey(m.node.id) + "' places keys by placement version " +
         std::to_string(m.placement) + ", this build by version " +
         std::to_string(HashRing::kPlacementVersion) +
         ": nodes of two placements would split the key space (README, 'Upgrading')";
}

bool SameNode(const NodeInfo& a, const NodeInfo& b) {
  return a.id == b.id && a.host == b.host && a.port == b.port && a.weight == b.weight;
}

bool SameRing(const std::vector<NodeInfo>& a, const std::vector<NodeInfo>& b) {
  return std::equal(a.begin(), a.end(), b.begin(), b.end(), SameNode);
}

bool SameRecord(const MemberRecord& a, const MemberRecord& b) {
  return SameNode(a.node, b.node) && a.gpu_bytes == b.gpu_bytes && a.host_bytes == b.host_bytes &&
         a.disk_bytes == b.disk_bytes && a.draining == b.draining && a.placement == b.placement;
}

// Whether two views differ in anything a callback should hear of (not the revision or epoch).
bool SameContent(const MembershipView& a, const MembershipView& b) {
  return std::equal(a.members.begin(), a.members.end(), b.members.begin(), b.members.end(),
                    SameRecord) &&
         a.drain_requested == b.drain_requested && a.handoffs_running == b.handoffs_running &&
         a.catching_up == b.catching_up && a.previous_members == b.previous_members;
}

// handoff/<id>'s value: "" (a scan; builds before previous_members), kCatchUpMark, or
// {"previous": [ids]} (a scan, with the ring before its change).
std::string EncodeHandoffMark(bool catch_up_only, const std::vector<std::string>& previous) {
  if (catch_up_only) return std::string(kCatchUpMark);
  if (previous.empty()) return "";
  return json{{"previous", previous}}.dump();
}

std::vector<std::string> DecodePreviousMembers(std::string_view value) {
  if (!value.starts_with("{")) return {};
  json j = json::parse(value, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object()) return {};
  auto it = j.find("previous");
  if (it == j.end() || !it->is_array() || it->size() > 4096) return {};
  std::vector<std::string> ids;
  for (const json& id : *it) {
    if (!id.is_string()) return {};
    const std::string& s = id.get_ref<const std::string&>();
    if (s.empty() || s.size() > 255 || s.find('/') != std::string::npos) return {};
    ids.push_back(s);
  }
  return ids;
}

// The prefix's keys, relative to the prefix, with their values: the state a view is made of.
using KeyMap = std::map<std::string, std::string>;

// Builds the view of `keys`; a member record that does not decode is left out (and logged
// where it arrives, not here, so that rebuilding a view does not repeat the warning).
MembershipView BuildView(const KeyMap& keys, uint64_t revision, uint64_t epoch) {
  MembershipView view;
  view.revision = revision;
  view.epoch = epoch;
  for (const auto& [key, value] : keys) {
    std::string_view k = key;
    if (k.starts_with(kMembersDir)) {
      const std::string_view id = k.substr(kMembersDir.size());
      auto record = DecodeMemberRecord(value);
      if (record.ok() && record->node.id == id) view.members.push_back(std::move(*record));
    } else if (k.starts_with(kDrainDir)) {
      view.drain_requested.insert(std::string(k.substr(kDrainDir.size())));
    } else if (k.starts_with(kHandoffDir)) {
      const std::string id(k.substr(kHandoffDir.size()));
      view.handoffs_running.insert(id);
      if (value == kCatchUpMark) view.catching_up.insert(id);
      if (auto previous = DecodePreviousMembers(value); !previous.empty()) {
        view.previous_members[id] = std::move(previous);
      }
    }
  }
  // Keys come sorted, so members are sorted by id already. A member of another placement
  // version is out of the ring; its handoff mark says nothing about this ring's keys (and
  // would keep clients asking previous owners, and catching-up nodes waiting, for nothing).
  for (const MemberRecord& m : view.members) {
    if (m.placement == HashRing::kPlacementVersion) continue;
    view.handoffs_running.erase(m.node.id);
    view.catching_up.erase(m.node.id);
    view.previous_members.erase(m.node.id);
  }
  return view;
}

// Warns about a member record that will be left out of every view.
void CheckArrivingRecord(std::string_view key, std::string_view value) {
  if (!key.starts_with(kMembersDir)) return;
  const std::string_view id = key.substr(kMembersDir.size());
  auto record = DecodeMemberRecord(value);
  if (!record.ok()) {
    GKV_LOG_WARN("membership: ignoring the record of '{}': {}", LogKey(id),
                 record.status().ToString());
  } else if (record->node.id != id) {
    GKV_LOG_WARN("membership: ignoring members/{}: it holds the record of '{}'", LogKey(id),
                 LogKey(record->node.id));
  } else if (record->placement != HashRing::kPlacementVersion) {
    GKV_LOG_WARN("membership: leaving '{}' out of the ring: {}", LogKey(id),
                 ForeignPlacementMessage(*record));
  }
}

Result<KeyMap> ReadPrefix(etcd::EtcdClient& client, const std::string& prefix, int64_t* revision) {
  GKV_ASSIGN_OR_RETURN(etcd::RangeResult range, client.Range(prefix, etcd::PrefixEnd(prefix)));
  KeyMap keys;
  for (auto& kv : range.kvs) {
    if (!kv.key.starts_with(prefix)) continue;
    keys[kv.key.substr(prefix.size())] = std::move(kv.value);
  }
  *revision = range.revision;
  return keys;
}

std::string EncodeAddress(const NodeInfo& node) {
  // An IPv6 literal needs brackets to be told from its port (ParseAddress strips them).
  if (node.host.find(':') != std::string::npos) {
    return "[" + node.host + "]:" + std::to_string(node.port);
  }
  return node.address();
}

}  // namespace

std::string EncodeMemberRecord(const MemberRecord& record) {
  json j = {{"id", record.node.id},
            {"address", EncodeAddress(record.node)},
            {"weight", record.node.weight},
            {"gpu_bytes", record.gpu_bytes},
            {"host_bytes", record.host_bytes},
            {"disk_bytes", record.disk_bytes},
            {"draining", record.draining},
            {"placement", record.placement}};
  return j.dump();
}

Result<MemberRecord> DecodeMemberRecord(std::string_view text) {
  json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object()) return Status::Corruption("member record: not a JSON object");
  // Only type_error can come from the checked accesses below; it stops here.
  try {
    MemberRecord record;
    auto id = j.find("id");
    auto address = j.find("address");
    if (id == j.end() || !id->is_string() || address == j.end() || !address->is_string()) {
      return Status::Corruption("member record: needs string fields 'id' and 'address'");
    }
    record.node.id = id->get<std::string>();
    GKV_RETURN_IF_ERROR(CheckNodeId(record.node.id));
    GKV_RETURN_IF_ERROR(
        ParseAddress(address->get<std::string>(), &record.node.host, &record.node.port)
            .WithContext("member record of '" + record.node.id + "'"));
    if (auto w = j.find("weight"); w != j.end()) {
      if (!w->is_number()) return Status::Corruption("member record: 'weight' is not a number");
      record.node.weight = w->get<double>();
    }
    if (!IsValidNodeWeight(record.node.weight)) {
      return Status::Corruption("member record of '" + LogKey(record.node.id) +
                                "': weight must be in (0, " +
                                std::to_string(static_cast<int>(kMaxNodeWeight)) + "]");
    }
    for (auto [name, field] :
         {std::pair{"gpu_bytes", &record.gpu_bytes}, std::pair{"host_bytes", &record.host_bytes},
          std::pair{"disk_bytes", &record.disk_bytes}}) {
      auto it = j.find(name);
      if (it == j.end()) continue;
      if (!it->is_number_unsigned()) {
        return Status::Corruption(std::string("member record: '") + name +
                                  "' is not a non-negative integer");
      }
      *field = it->get<uint64_t>();
    }
    if (auto d = j.find("draining"); d != j.end()) {
      if (!d->is_boolean()) return Status::Corruption("member record: 'draining' is not a bool");
      record.draining = d->get<bool>();
    }
    record.placement = 1;  // written before records said it
    if (auto p = j.find("placement"); p != j.end()) {
      if (!p->is_number_unsigned() || p->get<uint64_t>() == 0 || p->get<uint64_t>() > UINT32_MAX) {
        return Status::Corruption("member record: 'placement' is not a positive integer");
      }
      record.placement = static_cast<uint32_t>(p->get<uint64_t>());
    }
    return record;
  } catch (const json::exception& e) {
    return Status::Corruption(std::string("member record: ") + e.what());
  }
}

std::vector<NodeInfo> MembershipView::RingNodes() const {
  std::vector<NodeInfo> nodes;
  for (const auto& m : members) {
    if (m.draining || drain_requested.count(m.node.id)) continue;
    if (m.placement != HashRing::kPlacementVersion) continue;
    nodes.push_back(m.node);
  }
  return nodes;
}

const MemberRecord* MembershipView::Find(std::string_view id) const {
  auto it =
      std::lower_bound(members.begin(), members.end(), id,
                       [](const MemberRecord& m, std::string_view v) { return m.node.id < v; });
  return it != members.end() && it->node.id == id ? &*it : nullptr;
}

// ---------------------------------------------------------------------------------------------
// MembershipWatcher
//
// The watch thread alone owns `keys` and `last_revision`; `view` is what Current() returns and
// changes under `mu`. The epoch moves to the revision of the change whenever RingNodes()
// changes, one revision at a time, so that how etcd batched the events into messages does not
// matter: every process that watched the same revisions computes the same epochs.

struct MembershipWatcher::Impl {
  Impl(const EtcdConfig& config, Callback callback)
      : etcd(config),
        prefix(config.prefix()),
        on_change(std::move(callback)),
        client(config.endpoints, {}, Credentials(config)),
        stream(config.endpoints, etcd::Timeouts{}, kWatchIdleTimeout, Credentials(config)) {}

  void Run();
  // Applies one message's events (in revision order), publishing the view of each revision.
  void Apply(const std::vector<etcd::WatchEvent>& events);
  // Re-reads the whole prefix (after a compaction, or a watch that reported a revision below the
  // last one seen) and publishes it. When the read's revision (linearizable: the cluster's, not
  // one member's) is below the last one seen, etcd was rebuilt (from a snapshot or from
  // nothing): the watch goes on from the revision read, and `*rewound` says so.
  Status Resync(bool* rewound);
  // Makes `next` the current view; calls back when its content differs from the last one.
  void Publish(MembershipView next);
  // Sleeps `delay` unless the watcher stops meanwhile.
  void Pause(std::chrono::milliseconds delay);

  const EtcdConfig etcd;
  const std::string prefix;
  const Callback on_change;
  etcd::EtcdClient client;
  etcd::WatchStream stream;

  // Watch thread only.
  KeyMap keys;
  int64_t last_revision = 0;  // every event up to this revision is applied

  mutable std::mutex mu;
  MembershipView view;  // guarded by mu

  std::atomic<bool> connected{false};
  std::mutex stop_mu;
  std::condition_variable stop_cv;
  bool stopping = false;  // guarded by stop_mu
  bool finished = false;  // guarded by stop_mu: Run() returned
  std::thread thread;
};

void MembershipWatcher::Impl::Pause(std::chrono::milliseconds delay) {
  std::unique_lock<std::mutex> lock(stop_mu);
  stop_cv.wait_for(lock, delay, [&] { return stopping; });
}

void MembershipWatcher::Impl::Publish(MembershipView next) {
  bool changed;
  {
    std::lock_guard<std::mutex> lock(mu);
    changed = !SameContent(view, next);
    view = next;
  }
  if (!changed || !on_change) return;
  {
    std::lock_guard<std::mutex> lock(stop_mu);
    if (stopping) return;  // the destructor is waiting for this thread: nobody listens now
  }
  on_change(next);
}

void MembershipWatcher::Impl::Apply(const std::vector<etcd::WatchEvent>& events) {
  MembershipView current;
  {
    std::lock_guard<std::mutex> lock(mu);
    current = view;
  }
  std::vector<NodeInfo> ring = current.RingNodes();
  for (size_t i = 0; i < events.size();) {
    // One revision at a time (a transaction's events share one), each published on its own:
    // how etcd batches revisions into messages then changes neither the views nor the epochs.
    const int64_t revision = events[i].kv.mod_revision;
    const bool seen = revision <= last_revision;  // replayed: applying it again would undo later
    for (; i < events.size() && events[i].kv.mod_revision == revision; ++i) {
      const etcd::WatchEvent& e = events[i];
      if (seen || !e.kv.key.starts_with(prefix)) continue;
      const std::string key = e.kv.key.substr(prefix.size());
      if (e.is_delete) {
        keys.erase(key);
      } else {
        CheckArrivingRecord(key, e.kv.value);
        keys[key] = e.kv.value;
      }
    }
    if (seen) continue;
    last_revision = revision;
    MembershipView next = BuildView(keys, static_cast<uint64_t>(revision), current.epoch);
    std::vector<NodeInfo> next_ring = next.RingNodes();
    if (!SameRing(ring, next_ring)) {
      // The revision; after etcd's revision went back, on from this process's last epoch.
      next.epoch = std::max(static_cast<uint64_t>(revision), current.epoch + 1);
      ring = std::move(next_ring);
    }
    current = next;
    Publish(std::move(next));
  }
}

Status MembershipWatcher::Impl::Resync(bool* rewound) {
  int64_t revision = 0;
  auto fresh = ReadPrefix(client, prefix, &revision);
  if (!fresh.ok()) return fresh.status();
  *rewound = revision < last_revision;
  if (*rewound) {
    GKV_LOG_WARN(
        "membership: etcd is at revision {}, below the {} seen before (rebuilt?); watching on "
        "from there",
        revision, last_revision);
  }
  MembershipView current;
  {
    std::lock_guard<std::mutex> lock(mu);
    current = view;
  }
  keys = std::move(*fresh);
  for (const auto& [key, value] : keys) CheckArrivingRecord(key, value);
  last_revision = revision;  // linearizable: at least every revision seen, unless rebuilt
  MembershipView next = BuildView(keys, static_cast<uint64_t>(last_revision), current.epoch);
  // The changes in between are lost to compaction (or to the rebuild): they count as one, at
  // this read. Epochs never go back: after a rebuild this process numbers on from its last.
  if (!SameRing(current.RingNodes(), next.RingNodes())) {
    next.epoch = std::max(next.revision, current.epoch + 1);
  }
  Publish(std::move(next));
  return Status::OK();
}

void MembershipWatcher::Impl::Run() {
  const std::string range_end = etcd::PrefixEnd(prefix);
  bool outage_logged = false;  // "unreachable" logged; "reachable again" not yet
  bool need_resync = false;
  // A watch's first message carried a revision below the last one seen: etcd rebuilt, or only
  // a member behind the others (a follower catching up); Resync tells them apart.
  bool behind = false;
  bool trust_next_watch = false;  // Resync found etcd current: a member behind catches up
  size_t failed_attempts = 0;     // watches in a row that were never established
  std::chrono::milliseconds retry_delay = kMinRetryDelay;
  auto stop_requested = [&] {
    std::lock_guard<std::mutex> lock(stop_mu);
    return stopping;
  };
  auto note_outage = [&](const Status& why) {
    if (!outage_logged) {
      uint64_t epoch;
      {
        std::lock_guard<std::mutex> lock(mu);
        epoch = view.epoch;
      }
      GKV_LOG_WARN("membership: etcd unreachable ({}); keeping the last view (epoch {})",
                   why.ToString(), epoch);
      outage_logged = true;
    }
  };
  while (!stop_requested()) {
    if (need_resync) {
      bool rewound = false;
      Status read = Resync(&rewound);
      if (!read.ok()) {
        note_outage(read);
        Pause(retry_delay);
        retry_delay = std::min<std::chrono::milliseconds>(retry_delay * 2, kMaxRetryDelay);
        continue;
      }
      // Only a member behind the others: its watch is held until it catches up, as etcd does.
      trust_next_watch = behind && !rewound;
      need_resync = false;
      behind = false;
    }
    bool established = false;
    bool compacted = false;
    Status ended =
        stream.Run(prefix, range_end, last_revision + 1, [&](const etcd::WatchMessage& m) {
          if (m.created && m.header_revision > 0 && m.header_revision < last_revision &&
              !trust_next_watch) {
            // etcd's revision may have gone back (rebuilt from a snapshot, or from nothing):
            // a watch from the last revision seen would show nothing until etcd caught up with
            // it. Resync reads the cluster's revision to tell a rebuild from a member behind.
            behind = true;
            return false;
          }
          if (m.created) {
            trust_next_watch = false;
            established = true;
            connected.store(true);
            if (outage_logged) {
              GKV_LOG_INFO("membership: etcd reachable again; watching from revision {}",
                           last_revision + 1);
              outage_logged = false;
            }
            retry_delay = kMinRetryDelay;
          }
          if (m.compact_revision > 0) compacted = true;
          if (!m.events.empty()) Apply(m.events);
          return true;
        });
    connected.store(false);
    if (stop_requested()) break;
    if (behind) {
      need_resync = true;
      continue;
    }
    if (compacted) {
      GKV_LOG_INFO("membership: revision {} was compacted; reading the membership again",
                   last_revision + 1);
      need_resync = true;
      continue;
    }
    if (established) {
      failed_attempts = 0;
      // Even a stream that was up (and ended, e.g. idle) waits a little: an etcd that accepts
      // watches and drops them at once must not make this a busy loop.
      Pause(kMinRetryDelay);
      continue;
    }
    // Each attempt takes the next endpoint; etcd is unreachable once all of them failed.
    if (++failed_attempts % etcd.endpoints.size() != 0) continue;
    note_outage(ended);
    Pause(retry_delay);
    retry_delay = std::min<std::chrono::milliseconds>(retry_delay * 2, kMaxRetryDelay);
  }
}

MembershipView MembershipWatcher::Current() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->view;
}

Result<std::unique_ptr<MembershipWatcher>> MembershipWatcher::Start(const EtcdConfig& etcd,
                                                                    Callback on_change) {
  GKV_RETURN_IF_ERROR(CheckEtcdConfig(etcd));
  auto impl = std::make_unique<Impl>(etcd, std::move(on_change));
  int64_t revision = 0;
  GKV_ASSIGN_OR_RETURN(impl->keys, ReadPrefix(impl->client, impl->prefix, &revision));
  impl->last_revision = revision;
  impl->view = BuildView(impl->keys, revision, revision);
  for (const auto& [key, value] : impl->keys) CheckArrivingRecord(key, value);
  Impl* raw = impl.get();
  impl->thread = std::thread([raw] {
    raw->Run();
    std::lock_guard<std::mutex> lock(raw->stop_mu);
    raw->finished = true;
    raw->stop_cv.notify_all();
  });
  return std::unique_ptr<MembershipWatcher>(new MembershipWatcher(std::move(impl)));
}

MembershipWatcher::MembershipWatcher(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

MembershipWatcher::~MembershipWatcher() {
  std::unique_lock<std::mutex> lock(impl_->stop_mu);
  impl_->stopping = true;
  impl_->stop_cv.notify_all();
  // Cancel() cannot interrupt a request that is still connecting, so it is repeated until the
  // thread is out (at most a connect timeout; usually the first one does it).
  while (!impl_->finished) {
    lock.unlock();
    impl_->stream.Cancel();
    lock.lock();
    impl_->stop_cv.wait_for(lock, 50ms, [&] { return impl_->finished; });
  }
  lock.unlock();
  impl_->thread.join();
}

bool MembershipWatcher::connected() const { return impl_->connected.load(); }

// ---------------------------------------------------------------------------------------------
// MemberRegistration
//
// `mu` serializes every etcd operation of the registration (the keepalive thread's and the
// callers'), so that a re-registration under a new lease never interleaves with an Update on the
// old one; each operation is bounded by the HTTP timeouts.

struct MemberRegistration::Impl {
  Impl(const EtcdConfig& config, const MemberRecord& initial)
      : etcd(config),
        client(config.endpoints, {}, Credentials(config)),
        member_key(config.prefix() + std::string(kMembersDir) + initial.node.id),
        drain_key(config.prefix() + std::string(kDrainDir) + initial.node.id),
        handoff_key(config.prefix() + std::string(kHandoffDir) + initial.node.id),
        record(initial) {}

  // REQUIRES: mu held. Writes the record (and handoff/<id> while running) on `lease`, taking
  // members/<id> only when it is ours already or free.
  Status WriteRecordLocked();
  // REQUIRES: mu held. Grants a new lease and writes the record on it. `again`: the previous
  // lease was lost (the record goes with a catch-up mark, see Hold).
  Status RegisterLocked(bool again);
  // REQUIRES: mu held. Publishes the hold of the lease etcd renewed (or granted) with `ttl_s`
  // in answer to a request sent at `sent`.
  void PublishHoldLocked(std::chrono::steady_clock::time_point sent, int64_t ttl_s);
  // REQUIRES: mu held. For a write that failed: registers again when the lease is gone.
  Status RecoverLocked(Status failed);
  void KeepAliveLoop();

  const EtcdConfig etcd;
  etcd::EtcdClient client;
  const std::string member_key, drain_key, handoff_key;

  std::mutex mu;
  std::condition_variable cv;                 // wakes the keepalive thread to stop
  MemberRecord record;                        // guarded by mu
  int64_t lease = 0;                          // guarded by mu
  int64_t lease_ttl_s = 0;                    // guarded by mu: as granted
  bool handoff_running = false;               // guarded by mu
  bool catch_up_only = false;                 // guarded by mu
  std::vector<std::string> previous_members;  // guarded by mu: the scan mark's (see the view)
  bool deregistered = false;                  // guarded by mu
  bool stopping = false;                      // guarded by mu
  std::atomic<int64_t> published_lease{0};    // lease, for lease_id() without the lock
  uint32_t generation = 0;                    // guarded by mu: registrations so far
  // Hold, packed so that a reader never pairs one registration's generation with another's
  // time: steady-clock milliseconds << 16 | generation & 0xffff.
  std::atomic<uint64_t> hold{0};
  std::thread keepalive;
};

void MemberRegistration::Impl::PublishHoldLocked(std::chrono::steady_clock::time_point sent,
                                                 int64_t ttl_s) {
  const auto until = sent + std::chrono::seconds(ttl_s) - LeaseMargin(ttl_s);
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(until.time_since_epoch());
  hold.store(
      (static_cast<uint64_t>(std::max<int64_t>(0, ms.count())) << 16) | (generation & 0xffff),
      std::memory_order_release);
}

Status MemberRegistration::Impl::WriteRecordLocked() {
  std::vector<etcd::TxnOp> writes = {etcd::PutOp(member_key, EncodeMemberRecord(record), lease)};
  if (handoff_running) {
    writes.push_back(
        etcd::PutOp(handoff_key, EncodeHandoffMark(catch_up_only, previous_members), lease));
  }
  GKV_ASSIGN_OR_RETURN(auto ours, client.Txn({etcd::KeyOnLease(member_key, lease)}, writes));
  if (ours.succeeded) return Status::OK();
  GKV_ASSIGN_OR_RETURN(auto fresh, client.Txn({etcd::KeyMissing(member_key)}, writes));
  if (fresh.succeeded) return Status::OK();
  // Someone else's: say whose.
  std::string holder = "another node";
  int64_t holder_lease = 0;
  if (auto r = client.Range(member_key); r.ok() && !r->kvs.empty()) {
    holder_lease = r->kvs[0].lease;
    if (auto other = DecodeMemberRecord(r->kvs[0].value); other.ok()) {
      holder = "the node at " + EncodeAddress(other->node);
    }
  }
  return Status::InvalidArgument(
      "node id '" + record.node.id + "' is registered already, by " + holder + " (lease " +
      std::to_string(holder_lease) + "); a node that stopped without deregistering holds its id " +
      "until its lease expires (" + std::to_string(etcd.lease_ttl_s) + " s)");
}

Status MemberRegistration::Impl::RegisterLocked(bool again) {
  const auto sent = std::chrono::steady_clock::now();
  GKV_ASSIGN_OR_RETURN(auto granted, client.LeaseGrant(etcd.lease_ttl_s));
  const int64_t old_lease = lease;
  const bool old_running = handoff_running, old_catch_up = catch_up_only;
  lease = granted.id;
  lease_ttl_s = granted.ttl_s;
  if (again && !handoff_running) handoff_running = catch_up_only = true;
  Status s = WriteRecordLocked();
  if (!s.ok()) {
    (void)client.LeaseRevoke(granted.id);  // best effort: it expires anyway
    lease = old_lease;
    handoff_running = old_running;
    catch_up_only = old_catch_up;
    return s;
  }
  published_lease.store(lease);
  ++generation;
  PublishHoldLocked(sent, granted.ttl_s);
  return Status::OK();
}

Status MemberRegistration::Impl::RecoverLocked(Status failed) {
  // A put on a lease etcd no longer has fails with "requested lease not found".
  if (!failed.IsNotFound()) return failed;
  GKV_LOG_WARN("membership: lease {} of '{}' is gone; registering again", lease, record.node.id);
  return RegisterLocked(/*again=*/true);
}

void MemberRegistration::Impl::KeepAliveLoop() {
  std::unique_lock<std::mutex> lock(mu);
  bool trouble_logged = false;  // a failure logged; its recovery not yet
  while (!stopping && !deregistered) {
    const auto period = std::max<std::chrono::milliseconds>(
        kMinKeepAlivePeriod, std::chrono::milliseconds(lease_ttl_s * 1000 / 3));
    // After a failure, sooner: the hold runs out meanwhile (the node fences itself), and every
    // moment etcd is back but not yet told is a moment the node refuses for nothing.
    cv.wait_for(lock, trouble_logged ? std::min(period, kKeepAliveRetry) : period,
                [&] { return stopping || deregistered; });
    if (stopping || deregistered) break;
    Status s;
    const auto sent = std::chrono::steady_clock::now();
    auto ttl = client.LeaseKeepAlive(lease);
    if (ttl.ok() && *ttl > 0) {
      s = Status::OK();
      PublishHoldLocked(sent, *ttl);
    } else if (ttl.ok() || ttl.status().IsNotFound()) {
      // Expired (etcd was unreachable for longer than the TTL, or lost its data).
      GKV_LOG_WARN("membership: lease {} of '{}' expired; registering again", lease,
                   record.node.id);
      s = RegisterLocked(/*again=*/true);
    } else {
      s = ttl.status();
    }
    if (!s.ok() && !trouble_logged) {
      GKV_LOG_WARN("membership: cannot keep '{}' registered: {}; retrying every {} ms",
                   record.node.id, s.ToString(), std::min(period, kKeepAliveRetry).count());
      trouble_logged = true;
    } else if (s.ok() && trouble_logged) {
      GKV_LOG_INFO("membership: etcd reachable again; '{}' is registered (lease {})",
                   record.node.id, lease);
      trouble_logged = false;
    }
  }
}

Result<std::unique_ptr<MemberRegistration>> MemberRegistration::Register(
    const EtcdConfig& etcd, const MemberRecord& record) {
  GKV_RETURN_IF_ERROR(CheckEtcdConfig(etcd));
  GKV_RETURN_IF_ERROR(CheckNodeId(record.node.id));
  if (record.node.port == 0 || record.node.host.empty()) {
    return Status::InvalidArgument("member '" + record.node.id + "' needs a host and a port");
  }
  auto impl = std::make_unique<Impl>(etcd, record);
  {
    // A ring of two placements splits the key space: refuse to join one. (Two nodes of
    // different versions registering at the same instant can both pass; every watcher leaves
    // the foreign one out of its ring, RingNodes.)
    int64_t revision = 0;
    GKV_ASSIGN_OR_RETURN(KeyMap keys, ReadPrefix(impl->client, etcd.prefix(), &revision));
    for (const MemberRecord& m : BuildView(keys, revision, 0).members) {
      if (m.node.id != record.node.id && m.placement != HashRing::kPlacementVersion) {
        return Status::NotSupported("not joining: " + ForeignPlacementMessage(m));
      }
    }
    std::lock_guard<std::mutex> lock(impl->mu);
    GKV_RETURN_IF_ERROR(impl->RegisterLocked(/*again=*/false));
  }
  GKV_LOG_INFO("membership: registered '{}' at {} (lease {}, TTL {} s)", record.node.id,
               EncodeAddress(record.node), impl->lease, impl->lease_ttl_s);
  Impl* raw = impl.get();
  impl->keepalive = std::thread([raw] { raw->KeepAliveLoop(); });
  return std::unique_ptr<MemberRegistration>(new MemberRegistration(std::move(impl)));
}

MemberRegistration::MemberRegistration(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

MemberRegistration::~MemberRegistration() {
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    impl_->stopping = true;
  }
  impl_->cv.notify_all();
  impl_->keepalive.join();
}

Status MemberRegistration::Update(const MemberRecord& record) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  if (impl_->deregistered) return Status::Aborted("membership: deregistered");
  if (record.node.id != impl_->record.node.id) {
    return Status::InvalidArgument("membership: Update cannot change the node id");
  }
  impl_->record = record;
  Status s = impl_->WriteRecordLocked();
  return s.ok() ? s : impl_->RecoverLocked(s);
}

Status MemberRegistration::SetHandoffRunning(bool running, bool catch_up_only,
                                             std::vector<std::string> previous_members) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  if (impl_->deregistered) return Status::Aborted("membership: deregistered");
  impl_->handoff_running = running;
  impl_->catch_up_only = running && catch_up_only;
  impl_->previous_members = std::move(previous_members);
  if (!running) return impl_->client.Delete(impl_->handoff_key).status();
  Status s =
      impl_->client
          .Put(impl_->handoff_key, EncodeHandoffMark(impl_->catch_up_only, impl_->previous_members),
               impl_->lease)
          .status();
  return s.ok() ? s : impl_->RecoverLocked(s);
}

Status MemberRegistration::Deregister() {
  std::unique_lock<std::mutex> lock(impl_->mu);
  if (impl_->deregistered) return Status::OK();
  // One transaction, so watchers see the member leave in one revision; only while the record
  // is ours (after an expiry another node may have taken the id).
  auto txn = impl_->client.Txn({etcd::KeyOnLease(impl_->member_key, impl_->lease)},
                               {etcd::DeleteOp(impl_->member_key), etcd::DeleteOp(impl_->drain_key),
                                etcd::DeleteOp(impl_->handoff_key)});
  if (!txn.ok()) return txn.status();
  Status revoked = impl_->client.LeaseRevoke(impl_->lease);
  if (!revoked.ok() && !revoked.IsNotFound()) return revoked;
  impl_->deregistered = true;
  impl_->hold.store(impl_->generation & 0xffff, std::memory_order_release);  // holds nothing
  GKV_LOG_INFO("membership: deregistered '{}'", impl_->record.node.id);
  lock.unlock();
  impl_->cv.notify_all();
  return Status::OK();
}

int64_t MemberRegistration::lease_id() const { return impl_->published_lease.load(); }

MemberRegistration::Hold MemberRegistration::hold() const {
  const uint64_t packed = impl_->hold.load(std::memory_order_acquire);
  Hold h;
  h.generation = static_cast<uint32_t>(packed & 0xffff);
  h.until = std::chrono::steady_clock::time_point(std::chrono::milliseconds(packed >> 16));
  return h;
}

std::chrono::milliseconds MemberRegistration::LeaseMargin(int64_t ttl_s) {
  return std::max<std::chrono::milliseconds>(200ms, std::chrono::milliseconds(ttl_s * 200));
}

// ---------------------------------------------------------------------------------------------

Status RequestDrain(const EtcdConfig& etcd, std::string_view node_id) {
  GKV_RETURN_IF_ERROR(CheckEtcdConfig(etcd));
  GKV_RETURN_IF_ERROR(CheckNodeId(node_id));
  etcd::EtcdClient client(etcd.endpoints, {}, Credentials(etcd));
  const std::string prefix = etcd.prefix();
  const std::string id(node_id);
  const std::string member_key = prefix + std::string(kMembersDir) + id;
  // On the member's own lease, checked in the same transaction as the write: the request goes
  // with the node (a node that dies mid-drain leaves no key that would drain the next process
  // of its id at its start).
  GKV_ASSIGN_OR_RETURN(auto member, client.Range(member_key));
  if (member.kvs.empty()) return Status::NotFound("no member '" + LogKey(id) + "' is registered");
  const int64_t lease = member.kvs[0].lease;
  GKV_ASSIGN_OR_RETURN(auto txn,
                       client.Txn({etcd::KeyOnLease(member_key, lease)},
                                  {etcd::PutOp(prefix + std::string(kDrainDir) + id, "", lease)}));
  if (!txn.succeeded) {
    return Status::NotFound("member '" + LogKey(id) + "' left or registered again meanwhile");
  }
  return Status::OK();
}

namespace {

// Whether `member_key` holds the record of a member that has begun handing its keys off.
Result<bool> MemberDraining(etcd::EtcdClient& client, const std::string& member_key) {
  GKV_ASSIGN_OR_RETURN(auto member, client.Range(member_key));
  if (member.kvs.empty()) return false;
  auto record = DecodeMemberRecord(member.kvs[0].value);
  return record.ok() && record->draining;
}

}  // namespace

Status CancelDrain(const EtcdConfig& etcd, std::string_view node_id) {
  GKV_RETURN_IF_ERROR(CheckEtcdConfig(etcd));
  GKV_RETURN_IF_ERROR(CheckNodeId(node_id));
  etcd::EtcdClient client(etcd.endpoints, {}, Credentials(etcd));
  const std::string prefix = etcd.prefix();
  const std::string id(node_id);
  const std::string drain_key = prefix + std::string(kDrainDir) + id;
  const std::string member_key = prefix + std::string(kMembersDir) + id;
  GKV_ASSIGN_OR_RETURN(bool draining, MemberDraining(client, member_key));
  if (draining) {
    return Status::Aborted("member '" + LogKey(id) +
                           "' is handing its keys off already: it leaves once done (start it "
                           "again to have it rejoin)");
  }
  GKV_ASSIGN_OR_RETURN(auto txn,
                       client.Txn({etcd::KeyExists(drain_key)}, {etcd::DeleteOp(drain_key)}));
  if (!txn.succeeded) return Status::NotFound("no drain of '" + LogKey(id) + "' is requested");
  // The node may have seen the request between the look above and the delete: then its drain
  // runs to its end all the same.
  GKV_ASSIGN_OR_RETURN(draining, MemberDraining(client, member_key));
  if (draining) {
    return Status::Aborted("member '" + LogKey(id) + "' had begun handing its keys off");
  }
  return Status::OK();
}

Result<MembershipView> ReadMembership(const EtcdConfig& etcd) {
  GKV_RETURN_IF_ERROR(CheckEtcdConfig(etcd));
  etcd::EtcdClient client(etcd.endpoints, {}, Credentials(etcd));
  int64_t revision = 0;
  GKV_ASSIGN_OR_RETURN(KeyMap keys, ReadPrefix(client, etcd.prefix(), &revision));
  return BuildView(keys, static_cast<uint64_t>(revision), static_cast<uint64_t>(revision));
}

}  // namespace gkv
