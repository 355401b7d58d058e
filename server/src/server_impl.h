// Server::Impl, shared by the files of server/ (private to this module). Each file holds one
// role of a node:
//   server.cc       start and stop, dispatch of requests, admission control, replies, metrics
//   data_path.cc    the request handlers of the data path: put, get, delete, stat, batches, stats
//   replication.cc  adaptive replication of hot keys, as primary and as replica, and the load
//                   exchange between nodes (hotness.h: when a key is hot; hot_keys.h: the sketch)
//   peers.cc        calls to other nodes (peer connections, matching replies, deadlines, timers)
//   membership.cc   the ring and its changes (etcd: registration, the watched view, leaving)
//   handoff.cc      moving keys to their new owners when the ring changes, and repair of copies
// Threading: everything here runs on the transport's worker 0 (the I/O thread, or control
// thread) unless a comment says "executor" (executors hand results back with PostReply) or
// "any I/O worker". With --io-threads N > 1 the other workers serve the GETs, PUTs, batches,
// deletes and stats of their own connections (ServeHere), handing to worker 0 what needs its
// state, and hand every other message to worker 0 (docs/ARCHITECTURE.md, "Threads");
// the per-connection state they touch is in IoWorker, one per worker.
#pragma once

#include <httplib.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <queue>
#include <set>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "gkv/free_list.h"
#include "gkv/hash.h"
#include "gkv/membership.h"
#include "gkv/pinned_pool.h"
#include "gkv/ring_view.h"
#include "gkv/transport/hello_proof.h"
#include "gkv/transport/protocol.h"
#include "gkv/transport/ucx_transport.h"
#include "hot_keys.h"
#include "hotness.h"
#include "server.h"
#include "server_stats.h"
#include "thread_pool.h"

namespace gkv {

namespace w = wire;

using Clock = std::chrono::steady_clock;

inline w::ObjectMeta ToWire(const ObjectInfo& info) {
  return w::ObjectMeta{info.size, info.version, info.tensor, static_cast<uint8_t>(info.tier),
                       info.on_disk};
}

// The payload transfers of one connection in flight, oldest first, each with its deadline and a
// token (increasing); done ones leave from the front. A vector used as a queue keeps its
// capacity, so tracking a transfer allocates nothing in steady state.
class TransferQueue {
 public:
  struct Entry {
    Clock::time_point deadline;
    uint64_t token = 0;
    bool done = false;
  };
  bool empty() const { return head_ == entries_.size(); }
  const Entry& front() const { return entries_[head_]; }
  void Push(Clock::time_point deadline, uint64_t token) {
    entries_.push_back({deadline, token, false});
  }
  void Done(uint64_t token) {
    auto it = std::lower_bound(entries_.begin() + static_cast<ptrdiff_t>(head_), entries_.end(),
                               token, [](const Entry& e, uint64_t t) { return e.token < t; });
    if (it != entries_.end() && it->token == token) it->done = true;
    while (head_ < entries_.size() && entries_[head_].done) ++head_;
    if (head_ == entries_.size()) {
      entries_.clear();
      head_ = 0;
    } else if (head_ >= 64 && head_ * 2 >= entries_.size()) {
      entries_.erase(entries_.begin(), entries_.begin() + static_cast<ptrdiff_t>(head_));
      head_ = 0;
    }
  }

 private:
  std::vector<Entry> entries_;
  size_t head_ = 0;
};

// One request as it travels between the I/O thread and the executors.
struct Req {
  ConnId conn = 0;
  w::Header h;
  Clock::time_point start;
  Clock::time_point deadline = Clock::time_point::max();  // from the header's budget
  uint64_t charged = 0;   // payload bytes admitted against the in-flight limits
  bool admitted = false;  // counted in its connection's load until its reply is sent
  int worker = 0;         // the I/O worker whose tables admitted it: its reply is sent there
  bool counted = false;   // counted in in_flight (what a graceful stop waits for)
  // Under etcd: the registration (MemberRegistration::Hold::generation) it was admitted under;
  // a write commits only under the same one, unfenced (Server::Impl::FencedSince).
  uint32_t generation = 0;
  bool Expired() const { return Clock::now() > deadline; }
};

// A batch payload read into memory that is not zero-filled first (it is overwritten at once).
struct PayloadBuffer {
  explicit PayloadBuffer(size_t n) : bytes(new char[n ? n : 1]), size(n) {}
  std::unique_ptr<char[]> bytes;
  size_t size;
  char* data() { return bytes.get(); }
  std::string_view view() const { return {bytes.get(), size}; }
};

// One MultiGet row on its way through the I/O thread (routing, counting, replica copies) and an
// executor.
struct BatchRow {
  std::string key;
  uint64_t replica_version = 0;  // a replica row: the version its hint named
  std::string replica_key;       // a replica row: the copy's key here ("" if none)
  bool misrouted = false;        // not this node's key in its ring: answered wrong_node
  bool held_back = false;        // recovered, not yet confirmed (catching up): answered not_found
};

struct Server::Impl {
  // A Start that failed after the transport came up lands here with it still set: it goes
  // first, the executors joined in between (as in Server::Stop), because its worker thread calls
  // into the members below and the caches' arenas must outlive its memory registrations.
  ~Impl();
  ServerOptions options;
  NodeInfo self;
  std::unique_ptr<TieredCache> cache;
  std::unique_ptr<UcxTransport> transport;
  std::unique_ptr<ThreadPool> executors;
  std::unique_ptr<httplib::Server> metrics_http;
  std::thread metrics_thread;
  int metrics_bound_port = 0;
  std::atomic<bool> stopping{false};
  std::atomic<bool> ticking{false};  // set once `transport` is: OnTick may use it
  std::atomic<int64_t> in_flight{0};
  ServerCounters counters;
  std::once_flag stop_once;

  // Whether GPU-tier bytes go to and from UCX as they are (no staging through host memory):
  // the transport can move device memory and every GPU arena registered with it. Set at start
  // (CheckArenaRegistrations, before requests are served), read on the I/O thread.
  std::atomic<bool> gpu_zero_copy{false};
  bool device_zero_copy() const { return gpu_zero_copy.load(std::memory_order_relaxed); }
  // Every memory arena of both caches, for the transport to register once before its listener
  // opens (the host pool, each GPU arena UCX can move), so their sends and receives skip
  // per-operation registration. Remembered in arena_regions for the check below.
  struct ArenaRegion {
    MemoryRegion region;
    bool replica;
  };
  std::vector<ArenaRegion> arena_regions;
  std::vector<UcxTransport::Options::Region> ArenaRegions();
  // After the transport started: a GPU arena whose registration failed turns gpu_zero_copy off
  // with one log line; a host pool that failed is used unregistered (UCX registers per
  // operation), also with one line.
  void CheckArenaRegistrations();
  // Copies the transport's registration figures into `counters` (before rendering stats).
  void RefreshTransportCounters();

  // --- adaptive replication (replication.cc; the rule is in hotness.h) ---
  std::unique_ptr<TieredCache> replica_cache;  // copies held for other primaries (memory only)
  std::vector<double> ring_shares;  // of each node (table index), for the load comparison
  int self_index = 0;
  HotKeySketch sketch;
  // As primary, one entry per key with copies (or copies on the way or going away):
  //   copying -> serving -> withdrawing -> (erased)
  // copying: REPLICA_PUTs in flight, no hints yet; a write meanwhile marks it cancelled and is
  //   acknowledged at once (no client can read those copies), they are dropped when they land.
  // serving: `nodes` hold `version`; GET replies hint them.
  // withdrawing: INVALIDATEs sent (a write, or the key cooled); no hints. Ends when every node
  //   confirmed, or when kWithdrawWait has passed (every hint a client holds has expired by
  //   then); writes of the key wait for that before they are acknowledged.
  enum class CopyState { kCopying, kServing, kWithdrawing };
  struct ReplicaSet {
    CopyState state = CopyState::kCopying;
    uint64_t attempt = 0;
    uint64_t version = 0;
    std::vector<int> nodes;  // nodes holding a copy of `version` (serving, withdrawing)
    bool cancelled = false;  // copying: written meanwhile
    size_t unconfirmed = 0;  // withdrawing: INVALIDATEs not yet confirmed
    std::vector<std::function<void()>> waiters;  // withdrawing: writes to acknowledge after
  };
  // Client hints live kHintTtl (1 s) from the send time of the request that brought them, and
  // the primary stops hinting before a withdrawal begins: half a second more is margin.
  static constexpr auto kWithdrawWait = std::chrono::milliseconds(1500);
  std::unordered_map<std::string, ReplicaSet> registry;  // as primary
  // Replication attempts are numbered from the boot time (microseconds), so they increase across
  // restarts too and a replica's floor from before a restart never refuses a new attempt.
  uint64_t next_attempt = 0;
  // Keys whose copies a write just invalidated: not copied again until then, so a key that is
  // written often does not churn copies on every write.
  std::unordered_map<std::string, Clock::time_point> copy_again_after;
  // The node's read load: every row served, decayed like the sketch (about 2x the rate).
  double node_read_count = 0;
  bool node_overloaded = false;
  int copy_tokens = 0;   // replications this node may still start this second
  double shed_left = 0;  // relative mode: load (decayed count) still to move off this second
  std::deque<std::pair<Clock::time_point, double>> recent_relief;  // copies started lately
  static constexpr auto kReliefShowsAfter = std::chrono::seconds(3);
  // Boot: peers are asked to drop the copies a previous run of this node made (StartBootSync,
  // on the first tick).
  bool boot_sync_started = false;
  void StartBootSync();
  Clock::time_point last_copy_sweep = Clock::now();
  struct PeerLoad {
    uint64_t reads_per_s = 0;
    Clock::time_point at;  // when it was reported; reports older than 3 s are not counted
  };
  std::vector<PeerLoad> peer_load;
  uint64_t last_reported_reads = 0;
  std::vector<Clock::time_point> report_again_after;  // a peer that did not answer: back off
  // As replica: the copy held of each key (one attempt of one version).
  struct HeldCopy {
    uint64_t version = 0;
    uint64_t attempt = 0;
    bool operator==(const HeldCopy&) const = default;
  };
  // The copies this node holds for others, readable by every I/O worker: each one serves the
  // replica reads (GETs with kFlagReplicaRead, MGET rows with a version) of its own connections.
  // Worker 0 is the only writer (installs, invalidations, sweeps), so its check-then-set
  // sequences need no lock across calls; each call takes one shard's mutex. An INVALIDATE
  // erases the entry before it is answered, so a replica read that begins after the primary
  // has its answer finds no entry (one already past its lookup was concurrent with the write).
  class HeldCopies {
   public:
    // Any thread.
    bool Find(std::string_view key, HeldCopy* copy) const {
      if (size_.load(std::memory_order_acquire) == 0) return false;
      const Shard& s = ShardOf(key);
      std::lock_guard<std::mutex> lock(s.mu);
      auto it = s.copies.find(key);
      if (it == s.copies.end()) return false;
      *copy = it->second;
      return true;
    }
    bool empty() const { return size_.load(std::memory_order_acquire) == 0; }
    // Worker 0 only.
    void Set(const std::string& key, const HeldCopy& copy) {
      Shard& s = ShardOf(key);
      std::lock_guard<std::mutex> lock(s.mu);
      auto [it, added] = s.copies.insert_or_assign(key, copy);
      if (added) size_.fetch_add(1, std::memory_order_acq_rel);
    }
    // Erases `key`'s entry when `erase(copy)` says so; the erased copy goes to *erased.
    template <class Pred>
    bool EraseIf(const std::string& key, Pred erase, HeldCopy* erased = nullptr) {
      Shard& s = ShardOf(key);
      std::lock_guard<std::mutex> lock(s.mu);
      auto it = s.copies.find(key);
      if (it == s.copies.end() || !erase(it->second)) return false;
      if (erased) *erased = it->second;
      s.copies.erase(it);
      size_.fetch_sub(1, std::memory_order_acq_rel);
      return true;
    }
    std::vector<std::pair<std::string, HeldCopy>> Snapshot() const {
      std::vector<std::pair<std::string, HeldCopy>> out;
      for (const Shard& s : shards_) {
        std::lock_guard<std::mutex> lock(s.mu);
        out.insert(out.end(), s.copies.begin(), s.copies.end());
      }
      return out;
    }

   private:
    static constexpr size_t kShards = 16;
    struct alignas(64) Shard {
      mutable std::mutex mu;
      std::unordered_map<std::string, HeldCopy, StringKeyHash, std::equal_to<>> copies;
    };
    const Shard& ShardOf(std::string_view key) const { return shards_[HashKey(key) % kShards]; }
    Shard& ShardOf(std::string_view key) { return shards_[HashKey(key) % kShards]; }
    Shard shards_[kShards];
    std::atomic<size_t> size_{0};
  };
  HeldCopies held_copies;
  // As replica: installs of attempts up to `attempt` are refused (that attempt was invalidated).
  // A floor only has to outlive the installs in flight that could name such an attempt (they
  // are sent with a 500 ms budget and dropped past it), so floors expire after kFloorLifetime:
  // the table is bounded by the invalidation rate, not by the number of keys ever invalidated.
  struct Floor {
    uint64_t attempt = 0;
    Clock::time_point set_at;
  };
  static constexpr auto kFloorLifetime = std::chrono::seconds(10);
  std::unordered_map<std::string, Floor> replica_floor;
  bool CoveredByFloor(const std::string& key, uint64_t attempt) const;
  struct PeerCall {
    int node;
    ConnId conn;  // a reply counts only on the connection the call went out on
    Clock::time_point deadline;
    std::function<void(Status, std::string_view body)> done;
  };
  std::vector<ConnId> peer_conn;
  // A peer whose connection was lost: calls to it fail at once until then (no redial per call),
  // and it is not chosen for new copies.
  std::vector<Clock::time_point> peer_down_until;
  static constexpr auto kPeerDownFor = std::chrono::milliseconds(250);
  // A peer that refused this node's PEER_HELLO for its placement version: not dialled again,
  // nor the refusal logged again, for this long.
  static constexpr auto kPeerRefusedFor = std::chrono::seconds(5);
  std::unordered_set<ConnId> answered_conns;  // peer connections a reply came on
  std::unordered_map<ConnId, int> peer_of_conn;
  std::unordered_map<uint64_t, PeerCall> peer_calls;
  uint64_t next_peer_call = 1;
  // Deadlines of peer calls, earliest first (a min-heap; an entry whose call already ended is
  // skipped when it comes up): a tick looks at the front only, not at every call.
  using Deadline = std::pair<Clock::time_point, uint64_t>;
  std::priority_queue<Deadline, std::vector<Deadline>, std::greater<Deadline>> peer_deadlines;
  // Timers, earliest first (a min-heap on `due`; `seq` keeps equal times in order).
  struct Timer {
    Clock::time_point due;
    uint64_t seq;
    std::function<void()> fn;
    bool operator>(const Timer& o) const { return due != o.due ? due > o.due : seq > o.seq; }
  };
  std::vector<Timer> timers;
  uint64_t next_timer = 0;
  // Runs `fn` on the I/O thread at `due` or soon after (I/O thread).
  void AddTimer(Clock::time_point due, std::function<void()> fn);
  Clock::time_point last_decay = Clock::now();

  bool replication_on() const { return replica_cache != nullptr; }

  // ---------------- membership (membership.cc) ----------------
  // The node table is options.cluster.nodes: a node's index is stable for the life of this
  // process (gkv/ring_view.h); under etcd it grows (I/O thread only) as nodes join. Per-node
  // vectors (peer_conn, peer_load, ...) grow with it (GrowNodeTables).
  // `ring` is the current ring: the I/O thread reads it freely and replaces it (under ring_mu);
  // other threads take CurrentRing().
  bool elastic() const { return options.cluster.membership == ClusterConfig::Membership::kEtcd; }
  RingPtr ring;
  RingPtr previous_ring;  // the ring before the last change (null: none)
  mutable std::mutex ring_mu;
  RingPtr CurrentRing() const {
    std::lock_guard<std::mutex> lock(ring_mu);
    return ring;
  }
  int replicas = 1;  // the cluster's base replication (every write goes to this many owners)
  std::unique_ptr<MembershipWatcher> watcher;
  std::unique_ptr<MemberRegistration> registration;
  // ---------------- fencing (membership.cc; docs/ARCHITECTURE.md, "Fencing") ----------------
  // Under etcd a node serves and accepts keys only while etcd cannot have given them to anyone
  // else: while the lease of its registration holds (MemberRegistration::Hold), and only for
  // a registration whose catch-up has begun. A node that lost its lease (a stall, a partition
  // from etcd, an etcd outage longer than the hold) refuses as fenced (wrong_node: clients ask
  // the ring again) from the moment its hold ran out, before etcd can expire the lease; when
  // it registers again it catches up as a restarted node does (FenceTick).
  // `registered`: set once RegisterSelf succeeded (the object lives as long as Impl).
  std::atomic<const MemberRegistration*> registered{nullptr};
  // The registration (Hold::generation) whose catch-up has begun: written by worker 0 only.
  std::atomic<uint32_t> serving_generation{0};
  // Any thread, lock-free (every client request asks).
  bool Fenced(Clock::time_point now) const {
    if (!elastic()) return false;
    const MemberRegistration* reg = registered.load(std::memory_order_acquire);
    if (reg == nullptr) return true;
    const MemberRegistration::Hold h = reg->hold();
    return now >= h.until || h.generation != serving_generation.load(std::memory_order_acquire);
  }
  Status FencedStatus(Clock::time_point now) const;
  // At a write's commit (a stall may have come between admission and commit): fenced now, or
  // registered again since `r` was admitted. Any thread.
  bool FencedSince(const Req& r) const {
    return elastic() && (Fenced(Clock::now()) ||
                         r.generation != serving_generation.load(std::memory_order_acquire));
  }
  Status FencedAtCommit() const {
    return Status::WrongNode("node " + self.id +
                             " lost its etcd lease while the write waited; nothing written");
  }
  // Whether a request of `opcode` is served or accepted as the key's owner (or copy holder):
  // refused while fenced. Pings, stats, invalidations and load reports are not.
  static bool FencedOp(w::Opcode opcode);
  // OnTick: a registration under a new lease begins catch-up, then serving under it.
  void FenceTick(Clock::time_point now);
  Clock::time_point fenced_from{};  // worker 0 (FenceTick): when the hold ran out ({}: holds)
  MemberRecord self_record;
  MembershipView view;               // I/O thread: the last one applied
  std::atomic<bool> leaving{false};  // the ring this node applies leaves it out
  // Stopping after it left the cluster, with no key here (Server::Stop): it answers as a node
  // that holds nothing.
  std::atomic<bool> holds_nothing{false};
  // While leaving: a view showed another member leaving too (draining or asked to), so an
  // empty ring means the whole cluster is stopping, not a member between its stop and its
  // return (ApplyMembership sets it; Leave reads it).
  std::atomic<bool> others_leaving_seen{false};
  std::atomic<bool> drained{false};  // left the cluster after a drain request: main exits
  std::mutex leave_mu;               // one Leave at a time
  bool left_cluster = false;         // guarded by leave_mu
  std::thread drain_thread;
  // Whether `ring` gives `key` to this node (one of its first `replicas` owners).
  bool Owns(const RingView& r, std::string_view key) const;
  // A client request for a key this node does not own: WrongNode (static clusters: never).
  bool Misrouted(const Req& r, std::string_view key) const;
  // Whether `conn` said PEER_HELLO (a node of this cluster). Any I/O worker, for its own
  // connections (worker 0: every connection).
  bool FromPeer(ConnId conn) const {
    return OnControlThread() ? peer_node_of_conn.count(conn) > 0 : W().peer_conns.count(conn) > 0;
  }
  Status WrongNode() const;             // (quotes no key bytes)
  int NodeIndex(const NodeInfo& node);  // I/O thread: the table index, added when new
  void GrowNodeTables();
  Status StartMembership();                // Start(), before the transport listens
  Status RegisterSelf(uint16_t port);      // Start(), once the port is known
  void ApplyMembership(MembershipView v);  // I/O thread
  void SetRing(RingPtr next);              // I/O thread
  // Leaves the ring: hands every key off, then removes the registration. Blocks up to
  // `timeout` (then deregisters anyway: what was not handed off stays on this node's disk).
  void Leave(std::chrono::milliseconds timeout);

  // Catch-up after a start on an old disk under etcd (docs/ARCHITECTURE.md, "Membership"): the
  // keys recovered from disk may be older than writes the cluster acknowledged while this node
  // was away. Until the handoffs its joining starts have compared versions (CatchUpTick: every
  // other member's scan seen and none running, and at least kCatchUpMin since joined_at),
  // a read of a recovered key that was neither written nor handed off here since answers
  // not_found, except a client's last-resort ask (kFlagLastResort). This node's handoff/<id>
  // mark stays on meanwhile, so clients keep asking the other owners and previous owners.
  // `unconfirmed` under unconfirmed_mu (taken only while catching_up), so every I/O worker
  // holds keys back and confirms them itself; the rest I/O thread only, except `catching_up`
  // (read by the handoff thread for the mark).
  mutable std::mutex unconfirmed_mu;
  std::unordered_set<std::string> unconfirmed;
  size_t recovered_keys = 0;
  std::atomic<bool> catching_up{false};
  // A ring change gave this node keys it did not own in the ring just before (a member left:
  // e.g. a node that joined and drains again). A copy it kept from earlier may be older than
  // what the leaving owner acknowledged meanwhile, so such keys are held back like recovered
  // ones: a key is, while `regain_now` is set, when regain_now gives it to this node,
  // regain_before did not, and no write, delete or handoff of it reached this node since
  // (`regain_confirmed`). Checked per key (no listing); under unconfirmed_mu. It ends
  // (CatchUpTick) once every member that left is out of etcd (a drained node deregisters when
  // its handoff is done) or kCatchUpQuiet passed, no other node's scan runs, and kRegainMin
  // passed.
  RingPtr regain_before, regain_now;                 // guarded by unconfirmed_mu
  std::unordered_set<std::string> regain_confirmed;  // guarded by unconfirmed_mu
  std::set<std::string> regain_departed;             // I/O thread
  bool restart_catch_up = false;       // I/O thread (Start: before it): BeginCatchUp's kind
  Clock::time_point regain_started{};  // I/O thread
  static constexpr auto kRegainMin = std::chrono::seconds(1);
  void RegainCheck(RingPtr before, RingPtr now);                // I/O thread (ApplyMembership)
  bool RegainedUnconfirmedLocked(std::string_view key) const {  // REQUIRES: unconfirmed_mu
    return regain_now && Owns(*regain_now, key) && !Owns(*regain_before, key) &&
           regain_confirmed.count(std::string(key)) == 0;
  }
  // Set (posted by Start) once this run is registered and its mark is on; before that a held
  // back read answers unavailable (a previous run's record may still route clients here,
  // and they have no mark telling them to look further). Atomic: an executor reads it for a
  // held-back MGET row (HeldBackStatus).
  std::atomic<Clock::time_point> joined_at{Clock::time_point{}};
  // Other nodes seen with a scan running while this node's record is in etcd.
  std::set<std::string> seen_marks;
  static constexpr auto kCatchUpMin = std::chrono::seconds(3);
  // Without having seen every other member's scan (watch lag), catch-up waits this long.
  static constexpr auto kCatchUpQuiet = std::chrono::seconds(10);
  static constexpr auto kCatchUpMax = std::chrono::minutes(10);
  // Start(), before the transport: every key on disk is unconfirmed (and again, on worker 0,
  // when a new registration begins: FenceTick).
  void BeginCatchUp();
  // Whether `key` is unconfirmed (cheap when not catching up); whether a read of it must
  // answer not_found.
  bool Unconfirmed(std::string_view key) const {
    if (!catching_up.load(std::memory_order_acquire)) return false;
    std::lock_guard<std::mutex> lock(unconfirmed_mu);
    return unconfirmed.count(std::string(key)) > 0 || RegainedUnconfirmedLocked(key);
  }
  bool HeldBack(const Req& r, std::string_view key) const {
    return (r.h.flags & w::kFlagLastResort) == 0 && Unconfirmed(key);
  }
  // The answer to a held-back read: not_found (the client looks further), or unavailable
  // before this run registered (its clients may not know to look further).
  Status HeldBackStatus() const {
    if (joined_at.load(std::memory_order_relaxed) == Clock::time_point{}) {
      return Status::Unavailable("node is starting: catching up with the cluster");
    }
    // not_found sends a client on to the previous owners only while it sees a mark: until the
    // catch-up mark is known to be in etcd (a new registration, a regain), ask again.
    if (!mark_on.load(std::memory_order_acquire)) {
      return Status::WrongNode("node " + self.id + " is catching up; its mark is not in etcd yet");
    }
    return Status::NotFound("key not confirmed since this node restarted");
  }
  // A write, delete or handoff of `key` here settled its version.
  void Confirm(const std::string& key) {
    if (!catching_up.load(std::memory_order_acquire)) return;
    std::lock_guard<std::mutex> lock(unconfirmed_mu);
    unconfirmed.erase(key);
    if (regain_now) regain_confirmed.insert(key);
  }
  void CatchUpTick(Clock::time_point now);  // OnTick
  // Not on the I/O thread (it calls etcd): handoff/<id> is present while this node catches up
  // or a handoff scan of its runs.
  // A failed etcd write leaves mark_retry set; OnTick tries again once a second.
  void SyncHandoffMark();
  std::mutex mark_mu;
  // kUnknown: the registration rewrote the mark itself (a registration under a new lease):
  // the next sync writes what is wanted.
  enum class Mark { kOff, kCatchUp, kScan, kUnknown };
  Mark mark = Mark::kOff;                  // guarded by mark_mu
  std::vector<std::string> mark_previous;  // guarded by mark_mu: the scan mark's ring before
  std::atomic<bool> mark_unknown{false};
  // Whether handoff/<id> is known to be in etcd (set by SyncHandoffMark after its write; cleared
  // when a catch-up begins whose mark is not yet confirmed): HeldBackStatus.
  std::atomic<bool> mark_on{false};  // set by FenceTick (worker 0 never takes mark_mu)
  std::atomic<bool> mark_retry{false};
  Clock::time_point last_mark_retry{};

  // ---------------- handoff (handoff.cc) ----------------
  struct Handoff {
    std::thread thread;
    mutable std::mutex mu;
    std::condition_variable cv;
    RingPtr now, before;                  // the latest change
    std::vector<std::string> before_ids;  // the ids of `before`'s members (for the mark)
    uint64_t generation = 0;  // bumped by every change: a running scan for an older one stops
    bool pending = false;     // a scan is due
    // Keys to look at again (a pass over just these is due): a write admitted under the ring
    // before a change committed after the scan may have listed them (NoteCommitted).
    // Each with the node that handed it here (-1: written here, or by several senders).
    std::unordered_map<std::string, int> recheck;
    bool scanning = false;
    bool stop = false;
    static constexpr auto kMarkLinger = std::chrono::seconds(1);  // see StartHandoffThread
    // Handoffs received here, by key: the sequence number (`sequence`) of the last one. The
    // scan deletes a key it sent away only if none came in since the send (under `back_mu`,
    // with the delete): a receiver whose ring differs can hand the very version straight
    // back while the scan paces between the send and the delete, and then delete its own
    // copy, so deleting here too lost the key on both (issue 38 item 4).
    std::mutex back_mu;
    std::unordered_map<std::string, uint64_t> received;  // guarded by back_mu
    uint64_t sequence = 0;                               // guarded by back_mu
    // Past this many, `received` starts again; a send before that (cleared_at) keeps its copy.
    static constexpr size_t kMaxReceived = 1 << 16;
    uint64_t cleared_at = 0;  // guarded by back_mu
  };
  std::unique_ptr<Handoff> handoff;
  void StartHandoffThread();
  void StopHandoffThread();
  // I/O thread: the ring changed from `before` to `now`; (re)start the scan.
  void ScheduleHandoff(RingPtr now, RingPtr before);
  bool HandoffIdle() const;
  // I/O thread, after keys were written here under a write admitted with the ring of
  // `admitted_epoch` (kNotRouted: never checked against this node's ring): when the ring
  // changed since, the keys this node no longer owns or whose owners moved (the scan may have
  // sent an older version) get another pass.
  // `handed_by`: the node a handoff of the keys came from (it is not sent them back).
  void NoteCommitted(const std::vector<std::string>& keys, uint64_t admitted_epoch,
                     int handed_by = -1);
  void NoteRecheckLocked(const std::string& key, int handed_by);  // REQUIRES: handoff->mu
  // Whether keys admitted under ring `admitted_epoch` may have moved since (NoteCommitted
  // looks at them again).
  // (Any I/O worker: the epoch is read from ring_epoch_now.)
  bool RingMovedSince(uint64_t admitted_epoch) const {
    return handoff && elastic() && ring_epoch_now.load(std::memory_order_acquire) != admitted_epoch;
  }
  std::atomic<uint64_t> ring_epoch_now{0};  // `ring`'s epoch (SetRing), for every I/O worker
  // One key, without building a list when NoteCommitted would do nothing (the common case).
  // Any I/O worker (NoteCommitted itself runs on worker 0).
  void NoteCommittedKey(const std::string& key, uint64_t admitted_epoch) {
    Confirm(key);  // any worker (unconfirmed_mu): a read right after the write is not held back
    if (!RingMovedSince(admitted_epoch)) return;
    if (!OnControlThread()) {
      return transport->Post([this, key, admitted_epoch] {
        NoteCommitted(std::vector<std::string>{key}, admitted_epoch);
      });
    }
    NoteCommitted(std::vector<std::string>{key}, admitted_epoch);
  }
  static constexpr uint64_t kNotRouted = ~uint64_t{0};
  void HandleHandoffPut(const Req& r, std::string_view body, std::unique_ptr<Incoming> msg);
  // Read repair: a client saw a replica of the key lag behind this node's copy; push the copy
  // there with HANDOFF_PUT (the replica keeps whichever version is newer).
  void HandleRepair(const Req& r, std::string_view body);
  std::atomic<uint64_t> repair_bytes{0};  // copies held for REPAIR pushes in flight
  // Handoff thread: one HANDOFF_PUT, waited for. `keeps`: this node stays an owner and keeps
  // its copy (w::kFlagSenderKeeps).
  Status SendHandoff(int target, const std::string& key, const ObjectInfo& info, bool durable,
                     const std::string& bytes, bool keeps);
  // Handoff thread: sleeps as long as keeps the scan at options.handoff_bytes_per_s.
  void PaceHandoff(Clock::time_point started, uint64_t bytes_sent);
  // Deletes under etcd, and deletes a client versioned (replicas > 1), are remembered a while,
  // so a handed-off or repaired older version of a key deleted meanwhile does not come back.
  // The delete happens at the newer of `client_version` and this node's version clock.
  void RememberDelete(const std::string& key, uint64_t client_version);
  bool DeletedSince(const std::string& key, uint64_t version);
  std::mutex tombstone_mu;
  std::unordered_map<std::string, std::pair<uint64_t, Clock::time_point>> tombstones;
  size_t tombstone_bytes = 0;  // keys + overhead of `tombstones` (tombstone_mu)
  Clock::time_point last_tombstone_prune = Clock::now();

  // Admission control (ServerOptions): what each connection and the node have in flight.
  // Room a request refused for its size holds back, so that requests smaller than it stop
  // filling the gap it needs: on a node (or connection) that is never idle a value near the
  // limit would otherwise be refused every time it is tried. A claim lasts kClaimHold from
  // its first refusal (retries do not extend it); a request at least as large is admitted
  // into it and ends it. After a claim ends none starts for kClaimHold, so smaller requests
  // have the room at least half the time however many large ones keep trying. Only a request
  // of more than a quarter of the limit claims (one over the limit claims it all: it gets in
  // once nothing is in flight); a larger request refused during a claim takes it over without
  // extending it.
  struct BytesClaim {
    uint64_t bytes = 0;
    Clock::time_point until;       // the claim's end
    Clock::time_point next_claim;  // no new claim before this
  };
  static constexpr auto kClaimHold = std::chrono::seconds(2);
  // Whether `charge` may join `used` bytes in flight under `limit` (always, when nothing is in
  // flight), given `claim`. No side effects: Admit applies the outcome to the claims.
  static bool BytesFit(uint64_t used, uint64_t charge, uint64_t limit, const BytesClaim& claim,
                       Clock::time_point now);
  // After the admission decision: a refused request too large for the room left claims it; an
  // admitted claimant ends the claim.
  static void UpdateClaim(BytesClaim* claim, uint64_t used, uint64_t charge, uint64_t limit,
                          bool admitted, Clock::time_point now);
  BytesClaim node_claim;

  struct ConnLoad {
    uint32_t requests = 0;
    uint64_t bytes = 0;
    BytesClaim claim;
    // Payload transfers the peer must complete (reply payloads going out, rendezvous request
    // payloads coming in), oldest first, each with its deadline and a done flag; done ones are
    // popped from the front, so a hung or stalled peer leaves its oldest one at the front.
    TransferQueue transfers;
  };
  // (Each I/O worker's connections: IoWorker::conn_load.) Node-wide, worker 0 only: what is
  // admitted with payload bytes (a data worker serves only requests without a payload).
  // (Worker 0 admits against it with the claims below; another worker admits a payload only
  // while no node claim is live and the node is under half its limit, else worker 0 decides.)
  std::atomic<uint64_t> inflight_bytes{0};
  std::atomic<bool> node_claim_live{false};  // node_claim.bytes > 0, for the other workers
  // Bytes of MGET replies held for sending (values pinned, or copied out of GPU memory), and of
  // GET replies read from disk, not yet sent (any thread): held to options.max_inflight_bytes
  // like request payloads, released
  // when the reply's token goes (with the reply's parts, once its send is done). Shared, so a
  // token freed late (at transport stop) never touches a dead Impl.
  std::shared_ptr<std::atomic<uint64_t>> batch_reply_bytes =
      std::make_shared<std::atomic<uint64_t>>(0);
  // A token (an empty string) whose `values` bytes count against batch_reply_bytes until it is
  // freed, or null (Busy) when the node has other replies in flight and these would pass the
  // limit. A reply alone is always allowed (max_batch_bytes bounds it).
  std::shared_ptr<std::string> ReserveBatchReply(uint64_t values);
  // Accepted connections whose peer said PEER_HELLO (with the peer secret, where the cluster has
  // one): the only ones allowed REPLICA_PUT and INVALIDATE. Value: the node's index.
  std::unordered_map<ConnId, int> peer_node_of_conn;
  Clock::time_point last_pressure_check = Clock::now();
  uint64_t last_spills = 0, last_drops = 0;

  // --- replies (I/O thread) ---
  // Sends the reply to `r`: `body` is encoded at once (a caller may reuse its buffer); `payload`
  // must stay valid until the send completes, when `after` runs and `pinned` (the read handle
  // whose bytes the payload is, if any) is released. Allocates nothing in steady state when
  // `after` is empty (see OutgoingReply).
  void Reply(const Req& r, const Status& status, std::string_view body, const void* payload,
             size_t size, MemoryKind kind, std::function<void()> after, ReadHandle pinned = {});
  // Reply with a successful status whose payload UCX gathers from `segments` (host memory,
  // valid until `after` runs): the values of an MGET go out from where they are.
  void ReplyGather(const Req& r, std::string_view body, std::vector<UcxTransport::Segment> segments,
                   std::function<void()> after);
  // What a reply's send completion needs, recycled (I/O thread) instead of captured in a fresh
  // closure per reply.
  struct IoWorker;
  struct OutgoingReply {
    IoWorker* worker = nullptr;  // whose free list it goes back to
    Req req;
    uint64_t transfer = 0;  // TrackTransfer's token (0: none)
    std::function<void()> after;
    ReadHandle pinned;
  };
  // A reply's state (counted, its transfer watched) on the calling worker, and its header
  // (this thread's buffer: valid until the next call); FinishReply when its send is done: what
  // it held goes, its request's share of the limits goes back.
  OutgoingReply* StartReply(const Req& r, uint64_t size, std::function<void()> after);
  static std::string_view EncodeReplyHeader(const Req& r, std::string_view body);
  void FinishReply(OutgoingReply* out, const Status& s);

  // Admits a request against the in-flight limits, or says Busy. A request that brings `charge`
  // payload bytes is admitted anyway when its connection (or the node) has no bytes in flight,
  // so a single value up to max_value_size always gets through on an idle node.
  Status Admit(Req* r, uint64_t charge);
  // The calling worker's load of `r`'s connection, or null and why not (closed, or at its
  // request limit).
  ConnLoad* LoadOf(const Req& r, Status* refused);
  // An I/O worker other than 0: admits a request into its own table when that needs no
  // decision of worker 0's (no node claim live, the node under half its byte limit, this
  // connection under its limits here); false (nothing changed) hands the request to worker 0.
  // A refusal for this connection's limits is returned here (Busy); *to_worker0 (nothing
  // changed) when worker 0 must decide.
  Status AdmitHere(Req* r, uint64_t charge, bool* to_worker0);

  // The reply to `r` is sent (or failed): its share of the limits goes back.
  void Release(const Req& r);

  // Transfers watched against send_timeout (see ConnLoad::transfers). TrackTransfer returns a
  // token for TransferDone, 0 when the connection is gone.
  uint64_t TrackTransfer(ConnId conn);
  void TransferDone(ConnId conn, uint64_t token);
  // Receives a request's payload, watched like a reply's payload: a sender that stalls
  // mid-transfer is disconnected after send_timeout, which releases what it held.
  void ReceivePayload(ConnId conn, std::unique_ptr<Incoming> msg, void* dst, MemoryKind kind,
                      std::function<void(Status)> done);
  // Drops the calling I/O worker's per-connection table entries (on disconnect, and when this
  // node closes it).
  void ForgetConnection(ConnId conn);
  // Closes a connection and makes every I/O worker forget it.
  void CloseConnection(ConnId conn, bool force);

  // I/O thread, a few times a second: a connection whose oldest reply payload has not been
  // taken within send_timeout is closed, which completes its sends and releases their pins.
  void CloseStuckConnections(Clock::time_point now);

  // Hands request work to the executors, or answers Busy when their queue is full.
  bool SubmitRequestWork(const Req& r, std::function<void()> work);

  static Status DeadlinePassed();

  void ReplyStatus(const Req& r, const Status& s);

  // From an executor thread: hand the reply to the I/O thread.
  void PostReply(std::function<void()> fn) { transport->Post(std::move(fn)); }
  // From an executor thread: answer `r` with `s` from the request's own I/O worker.
  void PostReplyStatus(const Req& r, Status s) {
    transport->PostTo(r.worker, [this, r, s = std::move(s)] { ReplyStatus(r, s); });
  }

  // Reads a batch payload fully into a buffer, then continues on an executor (or, with
  // on_executor false, on the I/O thread). `limit`: the largest payload taken (0: the batch
  // limit, max_batch_bytes; a handoff takes one value, up to max_value_size).
  void ReadPayloadThen(const Req& r, std::unique_ptr<Incoming> msg,
                       std::function<void(Status, std::shared_ptr<PayloadBuffer>)> next,
                       bool on_executor = true, uint64_t limit = 0);

  // --- dispatch (I/O thread) ---
  void OnMessage(std::unique_ptr<Incoming> msg);
  // An I/O worker other than 0: serves a plain GET of its own connection (from memory, or
  // through an executor; with the hint of a key with copies), or answers false (nothing done,
  // `msg` untouched) when it needs worker 0: a message of any other kind, a connection not yet
  // known to have authenticated, a key that is not this node's, catch-up, a ring copy that is
  // behind, shutdown. Puts, batches and key operations too: a PUT, an MPUT, an MGET of primary
  // rows, a DELETE or a STAT admitted here (AdmitHere) runs its handler on this worker; its slow
  // steps go through the executors (and worker 0 where they need its state) as on worker 0, and the
  // reply comes back here (Reply sends from the request's own worker).
  bool ServeHere(std::unique_ptr<Incoming>& msg);
  // Worker 0, after a connection of another worker authenticated (or said PEER_HELLO): that
  // worker may serve its GETs from now on.
  void TellConnWorker(ConnId conn, bool peer);
  // Any I/O worker: its connection went (worker 0 forgets it too).
  void OnDisconnect(ConnId conn, const Status& s);

  // Replication messages come from nodes of this cluster that identified themselves, and only
  // while replication is on; anything else is refused (and its payload released unreceived).
  bool PeerOnly(const Req& r);

  void AuthenticatePeer(const Req& r, std::string_view body);

  void Authenticate(const Req& r, std::string_view body);
  // The hello proofs taken (client and peer): each is taken once. Any I/O worker.
  w::HelloReplayGuard hello_guard;

  struct PutOp {
    Req req;
    w::PutRequest put;
    std::unique_ptr<Incoming> msg;
    WriteHandle handle;
    std::string staging;          // device-tier target without device-capable UCX
    uint64_t ring_epoch = 0;      // of the ring the put was admitted under (NoteCommitted)
    uint64_t client_version = 0;  // kFlagClientVersion: the version the client assigned
    uint64_t transfer = 0;        // fast path: TrackTransfer's token for its payload
  };

  // What each I/O worker keeps of its own (any I/O worker, its own entry only): the admission
  // and transfer state of the requests it answers, and (workers > 0) what it needs to serve a
  // GET without worker 0: which of its connections authenticated or are peers, and the ring.
  struct IoWorker {
    int index = 0;
    std::unordered_map<ConnId, bool> authenticated;
    std::unordered_map<ConnId, ConnLoad> conn_load;
    FreeList<OutgoingReply> outgoing_free{1024};
    FreeList<PutOp> put_ops_free{256};  // see PutOp
    uint64_t next_transfer_token = 1;
    Clock::time_point last_send_check = Clock::now();
    std::unordered_set<ConnId> peer_conns;  // workers > 0: connections that said PEER_HELLO
    RingPtr ring;                           // workers > 0: posted by worker 0 (SetRing)
    Clock::time_point next_copy_handoff{};  // workers > 0: see CountRead
    // Slow replies (NoteSlowReply): the last one logged, and those not logged since.
    Clock::time_point last_slow_log{};
    uint64_t slow_unlogged = 0;
  };
  // A reply made kSlowReply or more after its request arrived is counted, and logged at most
  // once a second per worker: an operator sees a node that answers late (a disk whose syncs
  // stall, starved threads) before clients report timeouts.
  static constexpr auto kSlowReply = std::chrono::seconds(1);
  void NoteSlowReply(const Req& r, const Status& status);
  std::vector<std::unique_ptr<IoWorker>> io;  // one per transport worker (made before it)
  // The calling I/O worker's state (worker 0's outside the workers: Start, tests).
  // The I/O worker the calling thread drives (0 outside the workers: executors, Start). An I/O
  // thread drives one worker of one node for its life, so the answer is kept per thread.
  int WorkerHere() const {
    thread_local const Impl* cached_for = nullptr;
    thread_local int cached = 0;
    if (cached_for == this) return cached;
    const int i = transport ? transport->CurrentWorker() : -1;
    if (i < 0) return 0;  // not an I/O thread (not kept: it may become none of this node's)
    cached_for = this;
    cached = i;
    return i;
  }
  IoWorker& W() const { return *io[static_cast<size_t>(WorkerHere())]; }
  // The ring as the calling I/O worker knows it (worker 0: `ring`).
  const RingPtr& RingHere() const { return OnControlThread() ? ring : W().ring; }
  bool OnControlThread() const { return WorkerHere() == 0; }
  // Put ops are recycled on the I/O thread: the fast path (memory, non-durable, no eviction)
  // allocates none; every other path moves the op into a shared one (SharePutOp).
  // (Each I/O worker's: IoWorker::put_ops_free.)
  void FreePutOp(PutOp* op);
  std::shared_ptr<PutOp> SharePutOp(PutOp* op);
  void FinishFastPut(PutOp* op, const Status& received);
  void SlowPut(std::shared_ptr<PutOp> op);

  void HandlePut(const Req& r, std::string_view body, std::unique_ptr<Incoming> msg);

  Status CheckValueSize(uint64_t size) const;
  // A client-assigned version (kFlagClientVersion) is taken unless it is more than
  // kMaxClientClockLead ahead of this node's clock: one client with a clock far in the future
  // would otherwise push every version of the key (and this node's clock) there.
  Status CheckClientVersion(uint64_t version) const {
    return CheckVersionLead(version, kMaxClientClockLead, "the client's version",
                            "more than an hour: check the client's clock");
  }
  static constexpr uint64_t kMaxClientClockLead = uint64_t{3600} * 1000000 * 1024;  // 1 hour
  // A handed-off version (HANDOFF_PUT, from a peer) is taken unless it is more than a day ahead
  // of this node's clock: looser than a client's, since a sender's versions may legitimately
  // run ahead (versions it adopted from clients up to an hour ahead of its own clock, skew, the
  // first start after an upgrade from 70-minute version blocks), and a refused handoff is sent
  // again every second; bounded, so no version near UINT64_MAX makes a key un-overwritable.
  Status CheckHandoffVersion(uint64_t version) const {
    return CheckVersionLead(version, kMaxHandoffClockLead, "the handed-off version",
                            "more than a day");
  }
  static constexpr uint64_t kMaxHandoffClockLead = 24 * kMaxClientClockLead;  // 1 day
  // InvalidArgument naming `what` when `version` is more than `max_lead` ahead of this node's
  // version clock (`limit` says the bound in words).
  Status CheckVersionLead(uint64_t version, uint64_t max_lead, std::string_view what,
                          std::string_view limit) const;

  // Executor thread: copy from staging if any, commit (write-through when durable), reply.
  void CommitAndReply(const std::shared_ptr<PutOp>& op);

  // ---------------- streamed puts (streamed_put.cc) ----------------
  // One streamed put between its PUT (kFlagStreamed) and the commit its last piece starts.
  struct PutStream {
    uint64_t id = 0;
    ConnId conn = 0;
    w::PutRequest put;   // key, tensor, the whole value's size
    uint16_t flags = 0;  // the PUT's (kFlagDurable, kFlagClientVersion)
    uint64_t client_version = 0;
    uint64_t ring_epoch = 0;
    // The rest is guarded by streams_mu.
    WriteHandle handle;        // released with the stream (uncommitted: space and chunks go)
    std::vector<bool> pieces;  // piece i (at i * chunk size) arrived, or is arriving
    uint64_t stored = 0;       // bytes of pieces stored
    int in_flight = 0;         // pieces being received or written
    bool closed = false;       // opening, failed, dropped or committing: takes no pieces
    Clock::time_point last_activity;
  };
  // A PUT with kFlagStreamed, decoded and checked (`op` holds no payload): reserves the value's
  // room on an executor and answers with the stream's grant.
  void OpenStream(std::shared_ptr<PutOp> op);
  void HandlePutChunk(const Req& r, std::string_view body, std::unique_ptr<Incoming> msg);
  // A piece of `len` bytes of `stream` was stored (or failed: `s`): the piece's reply, or the
  // commit when it was the last. From the piece's I/O worker or an executor (on_executor).
  void PieceStored(const std::shared_ptr<PutStream>& stream, const Req& r, uint64_t len,
                   const Status& s, bool on_executor);
  // Drops the streams of a connection that went (conn != 0), or those that received nothing
  // for send_timeout (conn == 0, worker 0's tick). Their pieces in flight finish first.
  void DropStreams(ConnId conn, Clock::time_point now = Clock::time_point::max());
  // A stream closed with no piece in flight: its reservation goes, on an executor.
  // REQUIRES: streams_mu.
  void ReleaseStreamLocked(const std::shared_ptr<PutStream>& stream);
  // Open streams one connection may have (then Busy): one client cannot take every slot.
  static constexpr size_t kMaxStreamsPerConn = 8;
  std::mutex streams_mu;
  std::unordered_map<uint64_t, std::shared_ptr<PutStream>> streams;  // guarded by streams_mu
  uint64_t next_stream_id = 1;                                       // guarded by streams_mu
  Clock::time_point next_stream_expiry{};                            // worker 0
  // stream_buffers buffers of stream_chunk_size, made at start; only TryAcquireCached takes
  // from it, so no more are ever made (the bound on streaming memory).
  std::shared_ptr<PinnedBufferPool> stream_pool;

  // Nodes serving a copy of exactly `version` of `key`, for a GET reply's or an MGET row's
  // hint, as positions in `ring`. Any thread (replicated_keys has its own locks).
  std::vector<uint16_t> HintFor(std::string_view key, uint64_t version, const RingView& ring) const;
  // The same with the calling I/O worker's ring (I/O threads only).
  std::vector<uint16_t> HintFor(std::string_view key, uint64_t version) const {
    return HintFor(key, version, *RingHere());
  }

  void SendObject(const Req& r, const std::string& key, std::shared_ptr<ReadHandle> handle,
                  const void* data, uint64_t size, MemoryKind kind,
                  std::shared_ptr<std::string> staging);

  void HandleGet(const Req& r, std::string_view body);
  // A GET's key (and, with kFlagRange, its range: length 0 when none) from its body.
  static Status DecodeGet(const Req& r, std::string_view body, std::string* key,
                          w::GetRange* range);
  // A GET of `key` (decoded, routed, admitted) on the request's own I/O worker: from memory at
  // once, or through an executor (ReadOnExecutor, SendObject). `range`: a ranged GET's.
  void ServeGet(const Req& r, const std::string& key, const w::GetRange& range = {});

  // The bytes of `h` a read answers with: all of them, or a ranged GET's (kFlagRange) within
  // the value. A value read from disk goes whole: each piece would read all of it again.
  struct Slice {
    uint64_t offset = 0;
    uint64_t size = 0;
  };
  static Slice SliceFor(const ReadHandle& h, const w::GetRange& range);
  // Aborted when a ranged GET names a version other than the one `h` holds.
  static Status CheckRangeVersion(const ReadHandle& h, const w::GetRange& range);
  // A ranged read counts (admission, hits, promotion) at its first range only; its later
  // ranges (kContinued) are not read from disk, where SliceFor would send all of the value for
  // one piece: Acquire answers them Aborted and the client reads the value whole.
  static TieredCache::ReadKind ReadKindFor(const w::GetRange& range) {
    return range.IsFirst() ? TieredCache::ReadKind::kRead : TieredCache::ReadKind::kContinued;
  }

  // The slow path of a read: on an executor, Acquire `key` from `from` (errors answered as
  // `error_as` when given), stage its slice (`range`) if needed, then `send` that slice on the
  // request's I/O worker.
  using SendRead = std::function<void(std::shared_ptr<ReadHandle>, const void* data, uint64_t size,
                                      MemoryKind kind, std::shared_ptr<std::string> staging)>;
  void ReadOnExecutor(const Req& r, TieredCache* from, std::string key,
                      std::optional<Status> error_as, SendRead send, const w::GetRange& range = {});

  // Executor: what a reply sends of `h` (of cache `from`), the slice `part`: its own bytes, or
  // a host copy in `*staging` when they are in GPU memory UCX cannot send from.
  Status StageForSend(TieredCache& from, const ReadHandle& h, Slice part, const void** data,
                      MemoryKind* kind, std::shared_ptr<std::string>* staging);

  // DELETE and STAT (on the request's own I/O worker, or on worker 0).
  void HandleKeyOp(const Req& r, std::string_view body);
  // The request's I/O worker, after the delete of `key` (status `ds`): reply at once, or first
  // let worker 0 confirm the key (catching up) and withdraw its copies (AfterWrite).
  void FinishDelete(const Req& r, const Status& ds, const std::string& key);

  void ReplyPayload(const Req& r, std::shared_ptr<std::string> payload);

  // MGET and MPUT run on the request's own I/O worker (ServeHere) or on worker 0, which the
  // steps that need its state go to (catch-up, a ring copy that is behind, copies to withdraw).
  void HandleMultiGet(const Req& r, std::unique_ptr<Incoming> msg);
  // I/O thread (the request's worker, or worker 0): counts every row toward hotness and load,
  // marks misrouted and held-back rows and finds the copies replica rows name, then hands the
  // rows to an executor. On a worker other than 0 it hands itself to worker 0 while the node
  // catches up or the worker's ring copy is behind.
  void MultiGetRows(const Req& r, std::shared_ptr<std::vector<BatchRow>> rows);
  // Executor: reads the rows (own cache or replica cache), gathers the reply (the hints of rows
  // whose key may have copies are looked up on the request's worker as it goes out).
  void ServeMultiGet(const Req& r, std::shared_ptr<std::vector<BatchRow>> rows);

  void HandleMultiPut(const Req& r, std::unique_ptr<Incoming> msg);
  // The request's I/O worker, after a write (a PUT's executor commit, an MPUT) committed `keys`
  // under the ring of `epoch`: `reply` at once, or first let worker 0 note the keys (ring
  // moved, catching up) and withdraw their copies (AfterWrite), which then runs it.
  void FinishWrite(std::vector<std::string> keys, uint64_t epoch, std::function<void()> reply);

  void HandleStats(const Req& r);

  // I/O thread, every loop: one log line when the node is under eviction pressure.
  void OnTick();

  // ---------------- adaptive replication (I/O thread unless noted) ----------------

  // Counts a read of a key this node serves as primary (replication on); starts copying it when
  // it turns hot. Any I/O worker (the decision is worker 0's).
  void CountRead(const std::string& key);
  // A GET answered from memory (fast path): not found, or the pinned value with `hint`.
  void ReplyFromMemory(const Req& r, TieredCache::FastPath fp, ReadHandle fast,
                       const std::vector<uint16_t>& hint, const w::GetRange& range = {});
  // Counts a row served of any kind (the node's load): every get, batch row and replica read.
  // On another I/O worker the row is added to node_read_count by worker 0's next tick.
  void CountRow() {
    counters.rows_read.fetch_add(1, std::memory_order_relaxed);
    if (OnControlThread()) {
      node_read_count += 1;
    } else {
      rows_elsewhere.fetch_add(1, std::memory_order_relaxed);
    }
  }
  std::atomic<uint64_t> rows_elsewhere{0};
  // The least sketch estimate at which CountRead may start copying a key now (UINT32_MAX: not
  // now), published by worker 0 every tick for the other I/O workers, which count their reads
  // in the sketch and hand only such keys to worker 0 (ConsiderCopying).
  std::atomic<uint32_t> copy_floor{UINT32_MAX};
  void PublishCopyFloor();  // worker 0, at most once a millisecond
  Clock::time_point last_copy_floor{};
  // Worker 0: the part of CountRead after the sketch (est: the key's estimate).
  void ConsiderCopying(const std::string& key, uint32_t est);
  // Keys in `registry` (any state), readable by every I/O worker, with the copies each one
  // serves: every I/O worker answers the GETs and MGET rows of such keys with their hints
  // itself (HintFor), and a worker other than 0 hands a write of one to worker 0 (AfterWrite).
  // Worker 0 adds a key before it starts copying it, publishes its copies when they serve,
  // stops publishing them before it withdraws them (so no hint is made after a withdrawal
  // began: see kWithdrawWait), and removes the key when the registry entry goes.
  // Sharded by key hash. MaybeContains is the read path's question ("may this key have
  // copies?"), asked for every key read: a 64-bit filter per shard (a bit per key hash, set
  // while a key with that bit is in the shard) answers most keys "no" without the shard's
  // mutex. A key's bit is set, under the shard's mutex, before Add returns, and stays set while
  // the key is in the set (Remove recomputes the filter from the keys left).
  class ReplicatedKeys {
   public:
    bool MaybeContains(std::string_view key) const {
      Shard* s = ShardIfMaybe(key);
      if (s == nullptr) return false;
      std::lock_guard<std::mutex> lock(s->mu);
      return s->keys.find(key) != s->keys.end();
    }
    // The nodes (table indices) that serve a copy of exactly `version` of `key`; false when none.
    bool ServingCopies(std::string_view key, uint64_t version, std::vector<int>* nodes) const {
      Shard* s = ShardIfMaybe(key);
      if (s == nullptr) return false;
      std::lock_guard<std::mutex> lock(s->mu);
      auto it = s->keys.find(key);
      if (it == s->keys.end() || it->second.nodes.empty() || it->second.version != version) {
        return false;
      }
      *nodes = it->second.nodes;
      return true;
    }
    // Worker 0 only (as the registry it mirrors).
    void Add(const std::string& key) {
      const uint64_t h = HashKey(key);
      Shard& s = shards_[h % kShards];
      std::lock_guard<std::mutex> lock(s.mu);
      s.filter.fetch_or(BitOf(h), std::memory_order_acq_rel);
      auto [it, added] = s.keys.try_emplace(key);
      if (added) size_.fetch_add(1, std::memory_order_acq_rel);
      it->second = Copies{};
    }
    // `nodes` serve `version` of `key` (which was added); empty `nodes`: none does (any more).
    void SetServing(const std::string& key, uint64_t version, std::vector<int> nodes) {
      Shard& s = shards_[HashKey(key) % kShards];
      std::lock_guard<std::mutex> lock(s.mu);
      auto it = s.keys.find(key);
      if (it == s.keys.end()) return;
      it->second.version = version;
      it->second.nodes = std::move(nodes);
    }
    void Remove(const std::string& key) {
      Shard& s = shards_[HashKey(key) % kShards];
      std::lock_guard<std::mutex> lock(s.mu);
      auto it = s.keys.find(key);
      if (it == s.keys.end()) return;
      s.keys.erase(it);
      size_.fetch_sub(1, std::memory_order_acq_rel);
      uint64_t filter = 0;
      for (const auto& [k, copies] : s.keys) filter |= BitOf(HashKey(k));
      s.filter.store(filter, std::memory_order_release);
    }

   private:
    static constexpr size_t kShards = 16;
    // (The shard index uses the hash's low bits; the filter bit comes from higher ones.)
    static uint64_t BitOf(uint64_t hash) { return uint64_t{1} << ((hash >> 32) & 63); }
    struct Copies {
      uint64_t version = 0;
      std::vector<int> nodes;  // serving `version`; empty: copying or withdrawing
    };
    struct alignas(64) Shard {
      std::mutex mu;
      std::unordered_map<std::string, Copies, StringKeyHash, std::equal_to<>> keys;
      std::atomic<uint64_t> filter{0};
    };
    // The shard that may hold `key`, or null when the set is empty or the shard's filter rules
    // the key out (no lock taken).
    Shard* ShardIfMaybe(std::string_view key) const {
      if (size_.load(std::memory_order_acquire) == 0) return nullptr;
      const uint64_t h = HashKey(key);
      Shard& s = shards_[h % kShards];
      return (s.filter.load(std::memory_order_acquire) & BitOf(h)) == 0 ? nullptr : &s;
    }
    mutable Shard shards_[kShards];
    std::atomic<size_t> size_{0};
  };
  ReplicatedKeys replicated_keys;

  std::vector<int> ReplicaTargets(const std::string& key) const;

  void StartReplication(const std::string& key);

  void ReplicationDone(const std::string& key, uint64_t attempt, uint64_t version,
                       const std::vector<int>& nodes);

  // Before a write or delete of `keys` is acknowledged: every copy of an older version becomes
  // unreadable. Runs `reply` when that holds (at once for keys that are not replicated).
  void AfterWrite(const std::vector<std::string>& keys, std::function<void()> reply);
  // Whether AfterWrite has anything to do for a write of `key` (copies of it to withdraw, or a
  // copy in progress to cancel); when not, the write is acknowledged at once.
  // Any I/O worker (the others read replicated_keys, which lists every registry key).
  bool WriteWaitsForCopies(const std::string& key) const {
    if (!OnControlThread()) return replication_on() && replicated_keys.MaybeContains(key);
    return !registry.empty() && registry.count(key) > 0;
  }

  // serving -> withdrawing: INVALIDATE to every holder; ends as ReplicaSet says.
  void Withdraw(const std::string& key, const char* why);
  void FinishWithdraw(const std::string& key, uint64_t attempt);

  // Once a second: decay, load exchange, cooling, floors.
  void ReplicationTick(Clock::time_point now);
  // As replica, every 10 s: forget the copies the replica cache no longer holds.
  void SweepHeldCopies();
  void ReportLoad(Clock::time_point now, uint64_t reads_per_s);
  void HandleLoadReport(const Req& r, std::string_view body);

  // Once a second, after the decay: copies of keys that cooled down are withdrawn.
  void CoolDown();

  void PruneFloors(Clock::time_point now);

  static std::string ReplicaKey(const std::string& key, const HeldCopy& copy);

  // As a replica node: install a copy (unless an invalidation of its attempt came first).
  void HandleReplicaPut(const Req& r, std::string_view body, std::unique_ptr<Incoming> msg);

  // Whether the copy (now in the replica cache) became the one served; when not, it is dropped.
  bool InstallReplica(const std::string& key, const HeldCopy& copy);

  void DropReplicaCopy(const std::string& key, const HeldCopy& copy);

  void HandleInvalidate(const Req& r, std::string_view body);

  // As a replica node, for a MultiGet row: the replica cache key of the copy of exactly
  // `version`, or "" when this node holds none. Any I/O worker.
  std::string ReplicaRowKey(const std::string& key, uint64_t version) const;

  // As a replica node: serve a copy only for the exact version the client's hint named, and
  // never one an invalidation has covered. Any I/O worker (the reply goes from r.worker).
  void HandleReplicaGet(const Req& r, std::string_view body);

  // --- requests to peer nodes ---
  Result<ConnId> PeerConn(int node);

  // `budget`: how long the peer has to answer (it travels in the header too).
  void CallPeer(int node, w::Opcode op, std::string body, std::shared_ptr<std::string> payload,
                std::function<void(Status, std::string_view)> done, uint16_t flags = 0,
                std::chrono::milliseconds budget = std::chrono::milliseconds(500));

  void OnPeerReply(std::unique_ptr<Incoming> msg);

  void ExpirePeerCalls(Clock::time_point now);

  void RunTimers(Clock::time_point now);

  void OnPeerDisconnect(ConnId conn);

  Status StartMetrics();
};

}  // namespace gkv
