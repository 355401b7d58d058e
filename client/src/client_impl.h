// Client::Impl: the client's state and its I/O-thread logic, shared by the client's
// implementation files (client.cc: the public calls; staging.cc: streamed puts and the
// pipelined staging of device values). Private to client/src.
#pragma once

#include "gkv/client.h"

#include <algorithm>
#include <atomic>
#include <cassert>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <future>
#include <map>
#include <mutex>
#include <optional>
#include <queue>
#include <random>
#include <set>
#include <span>
#include <thread>
#include <unordered_map>

#include "gkv/block_pool.h"
#include "gkv/cuda.h"
#include "gkv/hash.h"
#include "gkv/hybrid_clock.h"
#include "gkv/log.h"
#include "gkv/membership.h"
#include "gkv/pinned_pool.h"
#include "gkv/ring_view.h"
#include "gkv/transport/hello_proof.h"
#include "gkv/transport/protocol.h"
#include "gkv/transport/ucx_transport.h"

namespace gkv {

namespace w = wire;

// Helpers of the client's implementation files (not part of the client's API).
namespace client_internal {

using Clock = std::chrono::steady_clock;

inline std::string_view TierNameOf(uint8_t tier) {
  static constexpr std::string_view kNames[] = {"gpu", "host", "disk"};
  return tier < 3 ? kNames[tier] : "unknown";
}

// What is left until `deadline` as a call's timeout: at least 1 ms (0 means the default).
inline std::chrono::milliseconds TimeLeft(Clock::time_point deadline) {
  return std::max(std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()),
                  std::chrono::milliseconds(1));
}

inline ValueInfo ToInfo(const w::ObjectMeta& m) {
  return ValueInfo{m.size, m.version, m.tensor, std::string(TierNameOf(m.tier)), m.on_disk};
}

inline MemoryKind Resolve(BufferMemory m, const void* ptr) {
  if (m == BufferMemory::kHost) return MemoryKind::kHost;
  if (m == BufferMemory::kDevice) return MemoryKind::kDevice;
  return IsDevicePointer(ptr) ? MemoryKind::kDevice : MemoryKind::kHost;
}

// Moves a move-only value into a copyable std::function.
template <typename T>
std::shared_ptr<T> Share(T value) {
  return std::make_shared<T>(std::move(value));
}

// Decodes a reply: its header, then its body with `decode` (which fills the reply status and
// its own outputs); returns the first failure, else the status the node replied with.
template <typename Decode>
Status ParseReply(const Incoming& msg, Decode&& decode) {
  w::Header h;
  std::string_view body;
  w::ReplyStatus rs;
  GKV_RETURN_IF_ERROR(w::DecodeMessage(msg.header().data(), msg.header().size(), &h, &body));
  GKV_RETURN_IF_ERROR(decode(body, &rs));
  return rs.ToStatus();
}

// The outcome of one synchronous call, handed from the thread that ends the call to the caller
// waiting in Impl::Await. Unlike a std::promise, whose set_value makes a futex system call every
// time (it runs std::call_once, and glibc's pthread_once wakes waiters unconditionally), Set
// costs two atomic operations when the caller is not asleep on the slot, which is the case
// whenever the caller drives the transport itself and polls ready().
// Lifetime: the caller owns the slot and may destroy it as soon as it has seen the value; Set
// touches nothing after the step that makes the value visible, except under the mutex a
// sleeping caller needs to return.
template <class T>
class SyncSlot {
 public:
  SyncSlot() = default;
  SyncSlot(const SyncSlot&) = delete;
  SyncSlot& operator=(const SyncSlot&) = delete;

  // Once. Any thread.
  void Set(T value) {
    value_.emplace(std::move(value));
    int expected = kEmpty;
    if (state_.compare_exchange_strong(expected, kReady, std::memory_order_acq_rel)) return;
    assert(expected == kSleeping && "SyncSlot::Set called twice");
    // The caller sleeps in Wait (kSleeping): it sees kReady only under the mutex, so the
    // notify is made holding it (made after the unlock, a caller woken spuriously meanwhile
    // could destroy the condition variable first).
    std::lock_guard<std::mutex> lock(mu_);
    state_.store(kReady, std::memory_order_release);
    cv_.notify_one();
  }
  // The caller's thread.
  bool ready() const { return state_.load(std::memory_order_acquire) == kReady; }
  T Wait() {
    int expected = kEmpty;
    if (state_.compare_exchange_strong(expected, kSleeping, std::memory_order_acq_rel)) {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [this] { return state_.load(std::memory_order_acquire) == kReady; });
    }
    return std::move(*value_);
  }

 private:
  static constexpr int kEmpty = 0, kSleeping = 1, kReady = 2;
  std::atomic<int> state_{kEmpty};
  std::optional<T> value_;
  std::mutex mu_;
  std::condition_variable cv_;
};

}  // namespace client_internal

using namespace client_internal;  // NOLINT: a private header of the client's own files

struct Client::Impl {
  struct Pending {
    uint64_t id = 0;
    int node = 0;
    ConnId conn = 0;
    Clock::time_point deadline;
    Clock::time_point sent_at;  // for the timeout's message: how long this node was waited for
    // Set for replica reads: once the reply has arrived, the transfer of its payload runs
    // against this (the caller's) deadline instead of the short one the request had, so a
    // large copy is not given up mid-transfer for a budget meant for a copy's first answer.
    Clock::time_point transfer_deadline{};
    int io = 0;  // transport operations still holding our buffers
    // Of those, the ones on the caller's memory (a put's value, GetInto's destination). The
    // others move bytes through buffers the client made and their completion holds (a value or
    // batch reply received, a batch block or staged device value sent) and may finish after the
    // call has returned: see Abandon.
    int io_on_callers_memory = 0;
    size_t own_buffer_bytes = 0;  // the bytes of those client-made buffers (Abandon's bound)
    bool finished = false;
    std::function<void()> ready;  // the outcome, run once io == 0
    std::function<void(const std::shared_ptr<Pending>&, std::unique_ptr<Incoming>)> on_reply;
    std::function<void(Status)> on_error;
  };
  using PendingPtr = std::shared_ptr<Pending>;
  using Accept = std::function<Status(const ValueInfo&)>;

  ClientOptions options;
  ClusterConfig cluster;  // as configured (under etcd its `nodes` stay empty)
  // The node table (gkv/ring_view.h): stable indices, appended on the I/O thread only (under
  // nodes_mu, which other threads take to read it).
  std::vector<NodeInfo> nodes;
  mutable std::mutex nodes_mu;
  size_t NodeCount() const {
    std::lock_guard<std::mutex> lock(nodes_mu);
    return nodes.size();
  }
  // Where keys live now, and where they lived before the recent changes while keys may still
  // be moving (a handoff is running, or the last change is recent): a miss on a key's owners is
  // then asked of its previous owners before it is reported.
  struct Routing {
    RingPtr ring;
    // The rings before `ring`, newest first, kept while keys may be moving: changes in quick
    // succession leave keys on any of them (a handoff superseded by the next change).
    std::vector<RingPtr> previous;
    // The rings before the changes the running scans hand off for, as their marks name them
    // (MembershipView::previous_members): a client opened mid-handoff saw no change itself.
    std::vector<RingPtr> marked;
    // Under etcd: the table indices (sorted) of nodes this client saw draining that are no
    // longer registered: they handed every key off before they went, so as previous owners they
    // are not asked (their failure would fail reads the owner's last-resort ask serves). A node
    // that vanished otherwise (dead, lease lapsed) is still asked: it may hold the newest copy,
    // and its failure is then the read's answer.
    std::vector<int> drained_away;
    bool handoff = false;
    Clock::time_point changed_at{};
    static constexpr auto kSettle = std::chrono::seconds(3);
    static constexpr size_t kMaxPrevious = 4;
    // A node with a handoff running (or catching up after a restart on its old disk) makes
    // every miss worth a second look, even for a client that saw no change itself.
    bool Moving() const {
      return handoff || (!previous.empty() && Clock::now() - changed_at < kSettle);
    }
    // The key's owners in the previous rings that are not in `exclude` (and not repeated).
    std::vector<int> PreviousOwners(std::string_view key, int replicas,
                                    std::vector<int> exclude) const {
      std::vector<int> out;
      for (const auto* rings : {&previous, &marked}) {
        for (const RingPtr& r : *rings) {
          for (int n : r->Owners(key, replicas)) {
            if (std::find(exclude.begin(), exclude.end(), n) != exclude.end()) continue;
            if (std::binary_search(drained_away.begin(), drained_away.end(), n)) continue;
            exclude.push_back(n);
            out.push_back(n);
          }
        }
      }
      return out;
    }
  };
  mutable std::mutex routing_mu;
  std::shared_ptr<const Routing> routing;
  std::shared_ptr<const Routing> Route() const {
    std::lock_guard<std::mutex> lock(routing_mu);
    return routing;
  }
  std::unique_ptr<MembershipWatcher> watcher;
  // A client call refused with WrongNode (the node's ring and ours differ) is sent again after
  // this, with the ring as it is then, until its deadline.
  static constexpr auto kWrongNodeRetry = std::chrono::milliseconds(5);
  // A read that found one of the key's current owners failed while keys move, every other node
  // having missed: how many times it is asked again before it fails, the first after
  // kFailedNodeRetryDelay (or the node's reconnect backoff, if later), each next one after twice
  // as long.
  static constexpr int kFailedNodeRetries = 3;
  static constexpr auto kFailedNodeRetryDelay = std::chrono::milliseconds(20);
  static bool Misrouted(const Status& s) { return s.code() == StatusCode::kWrongNode; }
  std::unique_ptr<UcxTransport> transport;
  std::atomic<uint64_t> next_id{1};

  // Synchronous calls. The caller queues the task that issues its requests without waking the
  // I/O thread, then waits in Await. When it is this client's only synchronous call in flight,
  // it drives the transport itself (a slice of up to kDriveSlice, if no other thread drives):
  // its own request goes out and its reply is handled on its own thread, with no hand-off to
  // the I/O thread and back. With several in flight, or where it cannot drive (the I/O thread
  // is busy, the transport's CUDA device is not the caller's), or when the slice ended first, it
  // wakes the I/O thread and sleeps on its outcome: callers that each spin for their own reply
  // would take the cores the servers need, where one I/O thread serves them all as they come.
  static constexpr auto kDriveSlice = std::chrono::microseconds(200);
  std::atomic<int> sync_calls{0};  // synchronous calls waiting in Await now
  // GKV_CALLER_DRIVES=0 turns it off (every call hands off to the I/O thread): for comparing.
  const bool caller_drives = [] {
    const char* e = getenv("GKV_CALLER_DRIVES");
    return e == nullptr || std::string_view(e) != "0";
  }();
  void Submit(std::function<void()> task) { transport->PostQuietly(std::move(task)); }
  // For a synchronous caller (Submit, then Await) or for the I/O thread (Post).
  void Enqueue(std::function<void()> task, bool synchronous) {
    if (synchronous) return Submit(std::move(task));
    transport->Post(std::move(task));
  }
  // `ready()` says whether the call has ended; `take()` then returns its outcome (and before,
  // waits for it).
  template <class Ready, class Take>
  auto AwaitCall(Ready ready, Take take) {
    struct Count {
      std::atomic<int>& n;
      const bool alone = n.fetch_add(1, std::memory_order_acq_rel) == 0;
      ~Count() { n.fetch_sub(1, std::memory_order_acq_rel); }
    } count{sync_calls};
    if (ready()) return take();  // failed before it was queued (validation, staging)
    if (count.alone && caller_drives) {
      const std::function<bool()> done = std::cref(ready);
      if (transport->TryDrive(done, kDriveSlice) && ready()) return take();
    }
    // Whatever this caller queued runs on the I/O thread now, and its reply is handled there.
    transport->Wake();
    return take();
  }
  template <class T>
  T Await(std::future<T>& f) {
    return AwaitCall(
        [&f] { return f.wait_for(std::chrono::seconds(0)) == std::future_status::ready; },
        [&f] { return f.get(); });
  }
  template <class T>
  T Await(SyncSlot<T>& slot) {
    return AwaitCall([&slot] { return slot.ready(); }, [&slot] { return slot.Wait(); });
  }
  void QueueGet(std::string_view key, const GetOptions& o,
                std::function<void(Result<Value>)> callback, bool synchronous);
  void QueuePut(std::string_view key, const void* data, size_t size, const PutOptions& o,
                std::function<void(Result<uint64_t>)> callback, bool synchronous);
  // A caller's callback (the async forms) runs on the I/O thread itself, never on another
  // caller's thread that drives the transport while it waits: that thread may hold locks the
  // callback takes.
  template <class R>
  std::function<void(R)> OnIoThread(std::function<void(R)> cb) {
    return [this, cb = std::move(cb)](R r) mutable {
      if (!transport->DrivenByCaller()) return cb(std::move(r));
      auto held = std::make_shared<R>(std::move(r));  // a Value is move-only; Post copies
      transport->PostToOwnThread([cb = std::move(cb), held]() mutable { cb(std::move(*held)); });
    };
  }

  // Worker-thread state.
  struct NodeHealth {
    Clock::time_point down_until{};
    std::chrono::milliseconds backoff{0};
  };
  std::vector<NodeHealth> health;
  // Nodes whose copy was too slow to answer a replica read: not picked for copies until then
  // (their primaries answer instead; the node may be fine for its own keys).
  std::vector<Clock::time_point> copies_avoided_until;
  // Worker-thread timers (the batch reads' hedges), run from OnTick: a min-heap on the time, so
  // a loop pass with nothing due costs one comparison.
  using Timer = std::pair<Clock::time_point, std::function<void()>>;
  static bool LaterTimer(const Timer& a, const Timer& b) { return a.first > b.first; }
  std::vector<Timer> timers;
  // Set by ~Client (worker thread): from then on a request fails at once with Aborted instead of
  // connecting, and the timers still waiting (retries) are run at once, so each call they hold
  // gets its answer.
  bool closing = false;

  void AddTimer(Clock::time_point at, std::function<void()> fn) {
    timers.emplace_back(at, std::move(fn));
    std::push_heap(timers.begin(), timers.end(), LaterTimer);
  }
  // Staging of device bytes (a device buffer this UCX cannot move; batch rows): pinned host
  // buffers reused from a pool, and copies on a stream of this client's own for the buffer's
  // device (any thread; never the I/O thread, which must not wait on a GPU).
  std::shared_ptr<PinnedBufferPool> staging_pool = PinnedBufferPool::Create({});
  std::mutex copiers_mu;
  std::map<int, std::unique_ptr<DeviceCopier>> copiers;  // by device; guarded by copiers_mu
  // Copies `size` bytes between a device buffer (`device_ptr`, one of dst and src) and host
  // memory on the copy stream of that buffer's device (cudaMemcpy when none can be made).
  Status DeviceCopy(void* dst, const void* src, size_t size, const void* device_ptr) {
    if (size == 0) return Status::OK();
    const int device = CudaPointerDevice(device_ptr);
    DeviceCopier* copier = nullptr;
    if (device >= 0) {
      std::lock_guard<std::mutex> lock(copiers_mu);
      auto& slot = copiers[device];
      if (!slot) {
        auto made = DeviceCopier::Create(device);
        if (made.ok()) slot = std::move(*made);
      }
      copier = slot.get();
    }
    return copier ? copier->Copy(dst, src, size) : CudaCopySync(dst, src, size);
  }

  std::vector<ConnId> node_conn;
  std::unordered_map<ConnId, int> node_of_conn;
  // Requests in flight by id. Its nodes, the Pending objects and the closures a request's steps
  // keep come from the block pool (gkv/block_pool.h): a get or a put allocates nothing once the
  // pool is warm.
  std::unordered_map<uint64_t, PendingPtr, std::hash<uint64_t>, std::equal_to<uint64_t>,
                     PoolAllocator<std::pair<const uint64_t, PendingPtr>>>
      pending;
  std::priority_queue<std::pair<Clock::time_point, uint64_t>,
                      std::vector<std::pair<Clock::time_point, uint64_t>>, std::greater<>>
      deadlines;

  Clock::time_point DeadlineFrom(std::chrono::milliseconds t) const {
    return Clock::now() + (t.count() > 0 ? t : options.default_timeout);
  }

  // --- completion (worker thread) ---

  // Records the operation's outcome; it runs when no transport operation holds our buffers.
  // The first outcome wins; later replies for the id are dropped.
  // (A closure's copy is kept in a pooled block: see gkv/block_pool.h. A std::function is kept
  // as it is: wrapped, an empty one would become a non-empty one that throws.)
  template <class Outcome>
  void Complete(const PendingPtr& p, Outcome&& outcome) {
    if (p->finished || p->ready) return;
    pending.erase(p->id);
    if constexpr (std::is_convertible_v<std::decay_t<Outcome>*, std::function<void()>*>) {
      p->ready = std::forward<Outcome>(outcome);
    } else {
      p->ready = Pooled(std::forward<Outcome>(outcome));
    }
    Settle(p);
  }

  void Settle(const PendingPtr& p) {
    if (p->io == 0 && p->ready && !p->finished) {
      p->finished = true;
      auto fn = std::move(p->ready);
      p->on_reply = nullptr;
      p->on_error = nullptr;
      fn();
    }
  }

  void Fail(const PendingPtr& p, const Status& s) {
    if (!p->on_error) return;
    auto on_error = p->on_error;
    Complete(p, [on_error, s] { on_error(s); });
  }

  bool IsDown(int node) const { return Clock::now() < health[node].down_until; }

  void MarkDown(int node) {
    NodeHealth& h = health[node];
    h.backoff = h.backoff.count() == 0 ? options.reconnect_backoff_initial
                                       : std::min(h.backoff * 2, options.reconnect_backoff_max);
    h.down_until = Clock::now() + h.backoff;
  }

  void MarkUp(int node) { health[node] = NodeHealth{}; }

  void FailNode(int node, const Status& s, bool force_close, bool mark_down = true) {
    if (mark_down && s.code() != StatusCode::kAborted) MarkDown(node);
    ConnId conn = node_conn[node];
    std::vector<PendingPtr> victims;
    for (auto& [id, p] : pending) {
      if (p->node == node) victims.push_back(p);
    }
    for (auto& p : victims) Fail(p, s);
    if (conn != 0) {
      node_conn[node] = 0;
      node_of_conn.erase(conn);
      // Forcing the close completes (with an error) whatever UCX still holds of our buffers.
      if (force_close) transport->Close(conn, /*force=*/true);
    }
  }

  void OnDisconnect(ConnId conn, const Status& s) {
    auto it = node_of_conn.find(conn);
    if (it == node_of_conn.end()) return;
    const int node = it->second;
    GKV_LOG_WARN("lost node {} ({}): {}", nodes[node].id, nodes[node].address(), s.ToString());
    FailNode(node,
             Status::Unavailable("node " + nodes[node].id + " (" + nodes[node].address() +
                                 "): " + std::string(s.message())),
             false);
  }

  void OnTick() {
    const auto now = Clock::now();
    if (!timers.empty()) RunTimers(now);
    while (!deadlines.empty() && deadlines.top().first <= now) {
      const uint64_t id = deadlines.top().second;
      deadlines.pop();
      auto it = pending.find(id);
      if (it == pending.end()) continue;
      PendingPtr p = it->second;
      if (p->deadline > now) continue;  // extended (see transfer_deadline): a later entry is due
      // The wait on this node, not the call's: a call that spent its deadline elsewhere first
      // (other owners, a ring refresh) says so by a short wait here.
      char waited[32];
      std::snprintf(waited, sizeof waited, "%.2f",
                    std::chrono::duration<double>(now - p->sent_at).count());
      Status timeout = Status::Timeout("no reply from node " + nodes[p->node].id +
                                       " within the deadline (waited " + waited + " s for it)");
      if (p->io > 0 && p->io_on_callers_memory == 0 &&
          abandoned_bytes + p->own_buffer_bytes <= kMaxAbandonedBytes) {
        Abandon(p, timeout);
        continue;
      }
      Fail(p, timeout);
      // Bytes still moving into or out of the caller's buffer: UCX 1.22 cannot cancel an
      // active-message transfer (openucx/ucx#9584), so the connection goes, which releases the
      // buffer before the caller sees the timeout. The node is not marked down for it: it was
      // the caller's deadline, not the node, that ran out.
      if (p->io > 0 && node_conn[p->node] != p->conn) {
        transport->Close(p->conn, /*force=*/true);  // a connection already replaced: it alone
      } else if (p->io > 0) {
        FailNode(p->node,
                 Status::Unavailable("connection to node " + nodes[p->node].id +
                                     " closed to cut off another call's transfer at its deadline"),
                 /*force_close=*/true, /*mark_down=*/false);
      }
    }
    if (!abandoned.empty()) CheckAbandoned(now);
  }

  // Transfers whose call has already returned Timeout (Abandon), until they end. One still
  // moving after AbandonedTransferGrace() is stuck (a node that stopped sending mid-payload):
  // its connection is closed then, which ends it, frees its buffer and fails what else waits on
  // that node. Their buffers hold at most kMaxAbandonedBytes together: past that, a timed-out
  // transfer is cut off at once, as one into the caller's memory is.
  std::vector<std::pair<Clock::time_point, PendingPtr>> abandoned;
  static constexpr size_t kMaxAbandonedBytes = size_t{256} << 20;
  size_t abandoned_bytes = 0;
  Clock::duration AbandonedTransferGrace() const {
    return std::max<Clock::duration>(options.default_timeout, std::chrono::seconds(1));
  }

  // Ends a call at its deadline while its payload is still moving into a buffer the client
  // owns (kept alive by the transfer's own completion, not by the caller): the caller gets
  // `timeout` now, the transfer runs on and its bytes are dropped when it completes, and the
  // connection and the other calls on it are left alone.
  void Abandon(const PendingPtr& p, const Status& timeout) {
    if (p->finished || !p->on_error) return;
    pending.erase(p->id);
    p->finished = true;
    auto on_error = std::move(p->on_error);
    p->on_error = nullptr;
    p->on_reply = nullptr;
    p->ready = nullptr;
    abandoned.emplace_back(Clock::now() + AbandonedTransferGrace(), p);
    abandoned_bytes += p->own_buffer_bytes;
    on_error(timeout);
  }

  void CheckAbandoned(Clock::time_point now) {
    std::vector<PendingPtr> stuck;
    std::erase_if(abandoned, [&](const auto& entry) {
      const PendingPtr& p = entry.second;
      if (p->io > 0 && entry.first > now) return false;
      abandoned_bytes -= p->own_buffer_bytes;
      if (p->io > 0) stuck.push_back(p);
      return true;
    });
    const auto ms =
        std::chrono::duration_cast<std::chrono::milliseconds>(AbandonedTransferGrace()).count();
    for (const PendingPtr& p : stuck) {
      if (p->io == 0) continue;  // ended by closing an earlier one's connection
      if (node_conn[p->node] != p->conn) {
        // Its connection was replaced already (closed or forgotten): close it, nothing else.
        transport->Close(p->conn, /*force=*/true);
        continue;
      }
      GKV_LOG_WARN(
          "closing the connection to node {}: the transfer of a call that timed out is still "
          "unfinished {} ms later",
          nodes[p->node].id, ms);
      FailNode(p->node,
               Status::Unavailable("node " + nodes[p->node].id + " stalled mid-transfer for " +
                                   std::to_string(ms) + " ms"),
               /*force_close=*/true);
    }
  }

  void RunTimers(Clock::time_point now) {
    while (!timers.empty() && timers.front().first <= now) {
      std::pop_heap(timers.begin(), timers.end(), LaterTimer);
      std::function<void()> fn = std::move(timers.back().second);
      timers.pop_back();
      fn();  // may add timers
    }
  }

  void OnMessage(std::unique_ptr<Incoming> msg) {
    if (msg->am_id() != w::kAmReply) return;
    w::Header h;
    std::string_view body;
    if (!w::DecodeMessage(msg->header().data(), msg->header().size(), &h, &body).ok()) {
      GKV_LOG_WARN("dropping a malformed reply");
      return;
    }
    auto it = pending.find(h.request_id);
    if (it == pending.end()) return;  // timed out earlier; dropping releases its payload
    PendingPtr p = it->second;
    // Only the connection the request went out on answers it: another node (a stale or
    // hostile one) cannot answer, or fail, a request it never received.
    if (p->conn != 0 && msg->conn() != p->conn) {
      GKV_LOG_DEBUG("dropping a reply to request {} from another connection", h.request_id);
      return;
    }
    MarkUp(p->node);
    if (p->transfer_deadline > p->deadline) {
      p->deadline = p->transfer_deadline;
      deadlines.push({p->deadline, p->id});
    }
    if (p->on_reply) p->on_reply(p, std::move(msg));
  }

  Result<ConnId> EnsureConn(int node) {
    if (node_conn[node] != 0 && transport->IsOpen(node_conn[node])) return node_conn[node];
    const NodeInfo& n = nodes[node];
    GKV_ASSIGN_OR_RETURN(ConnId conn, transport->Connect(n.host, n.port));
    node_conn[node] = conn;
    node_of_conn[conn] = node;
    if (!cluster.secret.empty()) SendHello(node);
    return conn;
  }

  // First message on a connection to a cluster with a secret. Ordered before anything sent
  // after it on the endpoint; a refusal fails everything pending on that node.
  void SendHello(int node) {
    auto on_reply = [this, node](const PendingPtr& p, std::unique_ptr<Incoming> msg) {
      Status s = ParseReply(*msg, [&](std::string_view body, w::ReplyStatus* rs) {
        return w::DecodeStatusReply(body, rs);
      });
      Complete(p, [] {});
      if (!s.ok()) FailNode(node, s, false);
    };
    // A proof of the secret for this node (gkv/transport/hello_proof.h), never the secret.
    Issue(
        node, w::Opcode::kHello, 0,
        w::EncodeHello(w::MakeHelloProof(cluster.secret, w::kClientHelloLabel, nodes[node].id, "")),
        nullptr, 0, MemoryKind::kHost, DeadlineFrom({}), on_reply, [](Status) {});
  }

  // A buffer to encode a request's body into for Issue, one per thread: Issue reads the body
  // (into the message) before it calls anything that could issue again, and its early failures
  // return without reading it.
  static std::string& RequestBody() {
    static thread_local std::string body;
    return body;
  }

  // Sends one request (worker thread). `payload` must stay valid until the pending completes.
  void Issue(int node, w::Opcode op, uint16_t flags, std::string_view body, const void* payload,
             size_t size, MemoryKind kind, Clock::time_point deadline,
             std::function<void(const PendingPtr&, std::unique_ptr<Incoming>)> on_reply,
             std::function<void(Status)> on_error, Clock::time_point transfer_deadline = {},
             std::shared_ptr<const void> payload_owner = {}) {
    if (closing) return on_error(Status::Aborted("client closed"));
    if (node < 0 || static_cast<size_t>(node) >= nodes.size()) {
      return on_error(Status::Unavailable("no node owns the key: the ring has no members"));
    }
    if (IsDown(node)) {
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(health[node].down_until -
                                                                        Clock::now());
      return on_error(Status::Unavailable("node " + nodes[node].id + " is down; reconnecting in " +
                                          std::to_string(left.count()) + " ms"));
    }
    auto conn = EnsureConn(node);
    if (!conn.ok()) return on_error(conn.status());
    auto p = MakePooledShared<Pending>();
    p->id = next_id.fetch_add(1, std::memory_order_relaxed);
    p->node = node;
    p->conn = *conn;
    p->deadline = deadline;
    p->sent_at = Clock::now();
    p->transfer_deadline = transfer_deadline;
    p->on_reply = std::move(on_reply);
    p->on_error = std::move(on_error);
    pending[p->id] = p;
    deadlines.push({deadline, p->id});
    p->io++;
    // `payload_owner` holds a payload the client made (a staged copy, a batch's block): the send
    // keeps it alive, so the call may end before it is sent (Abandon).
    const bool sends_callers_memory = payload != nullptr && size > 0 && !payload_owner;
    if (sends_callers_memory) p->io_on_callers_memory++;
    if (payload_owner) p->own_buffer_bytes += size;
    // The node learns what is left of the deadline and drops the work if it starts too late.
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    const uint32_t budget = static_cast<uint32_t>(std::clamp<int64_t>(left, 1, UINT32_MAX));
    w::Header h{op, flags, p->id, budget};
    // The transport copies the header before Send returns: one buffer per thread serves all.
    static thread_local std::string message;
    w::EncodeMessageTo(&message, h, body);
    transport->Send(
        *conn, w::kAmRequest, message, payload, size, kind,
        Pooled([this, p, sends_callers_memory, payload_owner = std::move(payload_owner)](Status s) {
          p->io--;
          if (sends_callers_memory) p->io_on_callers_memory--;
          // Aborted: the server refused the payload; its reply says why.
          if (!s.ok() && s.code() != StatusCode::kAborted) Fail(p, s);
          Settle(p);
        }));
  }

  // Receives a reply's payload into `dst`, then runs `then` (worker thread). `dst_is_ours`:
  // `dst` is a buffer the client allocated and `then` keeps alive, so the call may end before
  // the bytes have landed (Abandon); otherwise it is the caller's memory.
  void ReceivePayload(const PendingPtr& p, std::unique_ptr<Incoming> msg, void* dst,
                      MemoryKind kind, bool dst_is_ours, std::function<void(Status)> then) {
    p->io++;
    if (!dst_is_ours) p->io_on_callers_memory++;
    if (dst_is_ours) p->own_buffer_bytes += msg->payload_size();
    transport->Receive(std::move(msg), dst, kind,
                       Pooled([this, p, dst_is_ours, then = std::move(then)](Status s) {
                         p->io--;
                         if (!dst_is_ours) p->io_on_callers_memory--;
                         then(s);
                         Settle(p);
                       }));
  }

  // --- membership (worker thread) ---
  std::mutex transport_mu;  // the watch thread posts through `transport` once it exists

  // The table index of `n`, added when new; a node back on another address is reconnected.
  int NodeIndex(const NodeInfo& n) {
    for (size_t i = 0; i < nodes.size(); ++i) {
      if (nodes[i].id != n.id) continue;
      if (nodes[i].host != n.host || nodes[i].port != n.port) {
        FailNode(static_cast<int>(i), Status::Unavailable("node moved to " + n.address()), true);
        MarkUp(static_cast<int>(i));
        std::lock_guard<std::mutex> lock(nodes_mu);
        nodes[i] = n;
      }
      return static_cast<int>(i);
    }
    {
      std::lock_guard<std::mutex> lock(nodes_mu);
      nodes.push_back(n);
    }
    node_conn.push_back(0);
    health.emplace_back();
    copies_avoided_until.emplace_back();
    return static_cast<int>(nodes.size()) - 1;
  }

  std::set<int> seen_draining;  // I/O thread: nodes last seen draining (Routing::drained_away)
  // The distinct rings the view's scan marks name as "before" (members still registered; at
  // most Routing::kMaxPrevious). I/O thread (it may add nodes to the table).
  std::vector<RingPtr> MarkedRings(const MembershipView& v) {
    std::vector<RingPtr> out;
    std::set<std::vector<int>> seen;
    for (const auto& [marker, ids] : v.previous_members) {
      std::vector<NodeInfo> members;
      std::vector<int> slots;
      for (const std::string& id : ids) {
        const MemberRecord* m = v.Find(id);
        if (m == nullptr) continue;  // gone: nobody to ask
        members.push_back(m->node);
        slots.push_back(NodeIndex(m->node));
      }
      if (members.empty() || !seen.insert(slots).second) continue;
      out.push_back(std::make_shared<RingView>(0, members, slots, nodes.size()));
      if (out.size() == Routing::kMaxPrevious) break;
    }
    return out;
  }

  void ApplyView(const MembershipView& v) {
    auto cur = Route();
    std::vector<NodeInfo> members = v.RingNodes();
    std::vector<int> slots;
    for (const NodeInfo& n : members) slots.push_back(NodeIndex(n));
    auto next = std::make_shared<Routing>(*cur);
    next->handoff = !v.handoffs_running.empty();
    next->marked = MarkedRings(v);
    std::set<int> registered;
    for (const MemberRecord& m : v.members) {
      const int n = NodeIndex(m.node);
      registered.insert(n);
      if (m.draining || v.drain_requested.count(m.node.id)) {
        seen_draining.insert(n);
      } else {
        seen_draining.erase(n);  // back in the ring
      }
    }
    next->drained_away.clear();
    for (int n : seen_draining) {
      if (registered.count(n) == 0) next->drained_away.push_back(n);
    }
    bool same = cur->ring->size() == slots.size();
    for (size_t p = 0; same && p < slots.size(); ++p) same = cur->ring->slot(p) == slots[p];
    if (!same) {
      if (!cur->Moving()) next->previous.clear();
      next->previous.insert(next->previous.begin(), cur->ring);
      if (next->previous.size() > Routing::kMaxPrevious) {
        next->previous.resize(Routing::kMaxPrevious);
      }
      next->ring = std::make_shared<RingView>(v.epoch, members, slots, nodes.size());
      next->changed_at = Clock::now();
      // Copies were made by the old owners, and nobody withdraws them when a key moves: a
      // copy could hold v1 after the new owner acknowledged v2. Hints go, and replies to
      // requests sent before the change bring none.
      hints.clear();
      hints_valid_from = next->changed_at;
      std::string list;
      for (const NodeInfo& n : members) list += (list.empty() ? "" : ",") + n.id;
      GKV_LOG_INFO("client: ring epoch {}: {} members [{}]", v.epoch, members.size(), list);
    } else if (!next->previous.empty() && !next->Moving()) {
      next->previous.clear();  // settled
    }
    std::lock_guard<std::mutex> lock(routing_mu);
    routing = std::move(next);
  }

  // --- operations (worker thread) ---

  static bool NodeFailure(const Status& s) {
    return s.code() == StatusCode::kUnavailable || s.code() == StatusCode::kTimeout;
  }

  // Replica `node`'s outcome `s` of a replicated write, as the write's: OK and a refusal as
  // misrouted stay as they are (the caller sends the write again), any other failure keeps its
  // code and says the write is not acknowledged. Any thread.
  Status ReplicaFailed(int node, const Status& s) const {
    if (s.ok() || Misrouted(s)) return s;
    std::string id;
    {
      std::lock_guard<std::mutex> lock(nodes_mu);
      id = nodes[node].id;
    }
    return s.WithContext("replica " + id + " did not take it (not acknowledged)");
  }
  // Folds the other owners' outcomes of a replicated write the primary took (start from OK):
  // a refusal as misrouted decides (the whole write goes again), else the first failure.
  static Status Deciding(const Status& kept, const Status& next) {
    if (Misrouted(kept) || next.ok() || (!kept.ok() && !Misrouted(next))) return kept;
    return next;
  }

  // Reads from the key's first live replica, moving on to the next one when a node fails.
  // One get, from the caller's request to its answer: what every step needs, shared by the
  // steps (each callback captures this one pointer, not copies of the caller's callbacks).
  struct GetCall {
    std::string key;
    void* user_dst = nullptr;
    size_t capacity = 0;
    MemoryKind dst_kind = MemoryKind::kHost;
    Clock::time_point deadline;
    bool fail_open = false;
    std::function<void(Result<Value>)> done;
    Accept accept;
    // The nodes asked, in order, and what was learnt on the way (reset by each attempt).
    std::vector<int, PoolAllocator<int>> nodes;
    size_t first_previous = 0;  // nodes from here on are previous rings' owners (asked as such)
    bool moving = false;        // keys may be moving (Routing::Moving): a miss asks the next node
    Status failure;             // the first node failure (unavailable, timeout) so far
    int failed_node = -1;       // the node of `failure`
    bool failed_owner = false;  // ... one of the key's owners under the current ring
    Status refused;             // the first wrong_node so far (that node may hold the key)
    // Attempts made again because an owner failed while every other node missed (kept across
    // attempts).
    int failed_node_retries = 0;
  };
  using GetCallPtr = std::shared_ptr<GetCall>;

  void DoGet(std::string key, void* user_dst, size_t capacity, MemoryKind dst_kind,
             Clock::time_point deadline, bool fail_open, std::function<void(Result<Value>)> done,
             Accept accept = {}) {
    auto call = MakePooledShared<GetCall>();
    call->key = std::move(key);
    call->user_dst = user_dst;
    call->capacity = capacity;
    call->dst_kind = dst_kind;
    call->deadline = deadline;
    call->fail_open = fail_open;
    call->done = std::move(done);
    call->accept = std::move(accept);
    StartGet(call);
  }

  // One attempt of `call` under the current ring (again after every node refused it as
  // misrouted).
  void StartGet(const GetCallPtr& call) {
    auto route = Route();
    route->ring->Owners(call->key, options.replicas, &call->nodes);
    // While keys may be moving, the previous rings' owners are asked after the current ones.
    call->first_previous = call->nodes.size();
    call->moving = route->Moving();
    call->failure = Status::OK();
    call->failed_node = -1;
    call->failed_owner = false;
    call->refused = Status::OK();
    if (call->moving) {
      for (int n :
           route->PreviousOwners(call->key, options.replicas,
                                 std::vector<int>(call->nodes.begin(), call->nodes.end()))) {
        call->nodes.push_back(n);
      }
    }
    if (call->nodes.empty()) return call->done(Status::Unavailable("the ring has no members"));
    if (!hints.empty() &&
        TryReplicaRead(call->key, call->user_dst, call->capacity, call->dst_kind, call->deadline,
                       Pooled([this, call](Result<Value> r) { EndGet(*call, std::move(r)); }),
                       Pooled([this, call] { GetFrom(call, 0); }), call->accept)) {
      return;
    }
    GetFrom(call, 0);
  }

  void EndGet(GetCall& call, Result<Value> r) {
    if (!r.ok() && call.fail_open && NodeFailure(r.status())) {
      return call.done(
          Status::NotFound("no live node answered (fail-open): " + r.status().ToString()));
    }
    call.done(std::move(r));
  }

  // Refused as misrouted by every node asked: our ring is behind (or theirs is); again soon.
  void RetryOrEndGet(const GetCallPtr& call, Result<Value> r) {
    if (!r.ok() && Misrouted(r.status()) && Clock::now() + kWrongNodeRetry < call->deadline) {
      return AddTimer(Clock::now() + kWrongNodeRetry, [this, call] { StartGet(call); });
    }
    EndGet(*call, std::move(r));
  }

  void GetFrom(const GetCallPtr& call, size_t i) {
    GetOnNode(call->nodes[i], call->key, call->user_dst, call->capacity, call->dst_kind,
              call->deadline,
              Pooled([this, call, i](Result<Value> r) { OnGetAnswer(call, i, std::move(r)); }), 0,
              call->accept, {}, i >= call->first_previous ? w::kFlagPreviousOwner : uint16_t{0});
  }

  // The answer of call->nodes[i]: the get's outcome, or ask the next node.
  void OnGetAnswer(const GetCallPtr& call, size_t i, Result<Value> r) {
    GetCall& c = *call;
    const StatusCode code = r.status().code();
    if (NodeFailure(r.status()) && c.failure.ok()) {
      c.failure = r.status();
      c.failed_node = c.nodes[i];
      c.failed_owner = i < c.first_previous;
    }
    // wrong_node from one owner (its ring differs, or it is fenced: its lease may have lapsed)
    // asks the next owner at once; after the last, the whole read is asked again shortly. A
    // miss elsewhere then is no answer: the refusing node may hold the key.
    if (code == StatusCode::kWrongNode && c.refused.ok()) c.refused = r.status();
    if (code == StatusCode::kNotFound && !c.moving && !c.refused.ok()) {
      return RetryOrEndGet(call, c.refused);
    }
    const bool move_on = NodeFailure(r.status()) || code == StatusCode::kWrongNode ||
                         (c.moving && code == StatusCode::kNotFound);
    if (r.ok() && i == 0 && !c.moving && options.replicas > 1) {
      MaybeReadRepair(c.key, c.nodes, r->info().version);
    }
    if (r.ok() || !move_on || Clock::now() >= c.deadline) return RetryOrEndGet(call, std::move(r));
    if (i + 1 == c.nodes.size()) {
      if (!c.moving || code != StatusCode::kNotFound) return RetryOrEndGet(call, std::move(r));
      // A node that failed may hold the newest version: no copy elsewhere stands in for it.
      // An owner under the current ring may be on its way back (a node that restarted on its
      // old disk and joined again, whose first connection can fail): the read is asked again,
      // a few times while the deadline leaves room, before it fails. Not a previous owner (one
      // that left; it is not coming back for this key) and not a fail-open read (its caller
      // would rather load the value itself at once).
      if (!c.failure.ok()) {
        const auto now = Clock::now();
        const auto again = std::max(now + kFailedNodeRetryDelay * (1 << c.failed_node_retries),
                                    health[c.failed_node].down_until + kWrongNodeRetry);
        if (c.failed_owner && !c.fail_open && c.failed_node_retries < kFailedNodeRetries &&
            again + kFailedNodeRetryDelay < c.deadline) {
          c.failed_node_retries++;
          return AddTimer(again, [this, call] { StartGet(call); });
        }
        return RetryOrEndGet(call, c.failure);
      }
      // Every node missed while keys may be moving. The key may have moved between the
      // questions: a handoff installs a key at its new owner before it deletes the old copy,
      // so the owner, asked once more, now has it if it moved at all. That last ask also gets
      // a copy the owner held back while catching up after a restart (nobody else had it).
      return GetOnNode(
          c.nodes[0], c.key, c.user_dst, c.capacity, c.dst_kind, c.deadline,
          [this, call](Result<Value> last) { RetryOrEndGet(call, std::move(last)); }, 0, c.accept,
          {}, w::kFlagLastResort);
    }
    GetFrom(call, i + 1);
  }

  // Read repair (I/O thread), for read_repair_chance of the reads `owners[0]` served at
  // `version`: asks the key's other owners for their version. One that lags behind (older, or
  // missing) gets owners[0]'s copy; one that holds a newer version (owners[0] lost a write in a
  // crash, or failed it) pushes its copy to owners[0]. Replicated writes carry the version
  // this client assigned, so replicas that took a write agree on its version and only a lagging
  // one differs. A push is REPAIR to the node holding the newer copy, which sends it with
  // HANDOFF_PUT (the receiver keeps the newer version, and refuses one older than a delete it
  // remembers). Nothing here waits or reports to the caller.
  void MaybeReadRepair(const std::string& key, std::span<const int> owners, uint64_t version) {
    if (options.read_repair_chance <= 0 || owners.size() < 2) return;
    if (std::uniform_real_distribution<double>(0, 1)(hint_rng) >= options.read_repair_chance) {
      return;
    }
    const auto deadline = Clock::now() + options.default_timeout;
    const int first = owners[0];
    const size_t replicas = std::min(owners.size(), static_cast<size_t>(options.replicas));
    for (size_t i = 1; i < replicas; ++i) {
      const int replica = owners[i];
      auto on_reply = [this, key, first, replica, version, deadline](
                          const PendingPtr& p, std::unique_ptr<Incoming> msg) {
        w::ObjectMeta meta;
        Status s = ParseReply(*msg, [&](std::string_view body, w::ReplyStatus* rs) {
          return w::DecodeObjectReply(body, rs, &meta);
        });
        const bool lags = s.ok() ? meta.version < version : s.code() == StatusCode::kNotFound;
        const bool ahead = s.ok() && meta.version > version;
        const int from = lags ? first : replica;
        const int to = lags ? replica : first;
        if ((lags || ahead) && NoteRepair(key, to, std::max(version, s.ok() ? meta.version : 0))) {
          // The push lands only while the target still holds what was seen here (a write that
          // reaches it meanwhile is newer than this comparison knew).
          const uint64_t seen_at_target = lags ? (s.ok() ? meta.version : 0) : version;
          Issue(
              from, w::Opcode::kRepair, 0, w::EncodeRepair(key, nodes[to].id, seen_at_target),
              nullptr, 0, MemoryKind::kHost, deadline,
              [this](const PendingPtr& rp, std::unique_ptr<Incoming>) { Complete(rp, [] {}); },
              [](Status) {});
        }
        // Last: completing drops this callback (and what it captured).
        if (s.ok()) {
          Complete(p, [] {});
        } else {
          Fail(p, s);
        }
      };
      Issue(replica, w::Opcode::kStat, 0, w::EncodeKeyRequest(key), nullptr, 0, MemoryKind::kHost,
            deadline, on_reply, [](Status) {});
    }
  }

  // Read repairs asked recently, by key and target in a direct-mapped table: one (key, target,
  // version) is repaired at most once per kRepairQuiet, however often reads sample it (a target
  // that keeps refusing the push costs one copy per period, not one per read).
  static constexpr size_t kRepairSlots = 1024;
  static constexpr auto kRepairQuiet = std::chrono::seconds(10);
  struct RepairAsked {
    uint64_t key_hash = 0, version = 0;
    Clock::time_point at;
  };
  std::vector<RepairAsked> repairs_asked = std::vector<RepairAsked>(kRepairSlots);
  bool NoteRepair(const std::string& key, int target, uint64_t version) {
    const uint64_t h = HashKey(key) ^ (static_cast<uint64_t>(target + 1) * 0x9e3779b97f4a7c15ULL);
    RepairAsked& slot = repairs_asked[h % kRepairSlots];
    const auto now = Clock::now();
    if (slot.key_hash == h && slot.version == version && now - slot.at < kRepairQuiet) {
      return false;
    }
    slot = {h, version, now};
    return true;
  }

  // The get's own checks of a value about to be received: the caller's buffer holds it, and
  // GetOptions::accept takes it.
  static Status CheckAnswer(const w::ObjectMeta& meta, uint64_t capacity, const Accept& accept) {
    if (capacity < meta.size) {
      return Status::InvalidArgument("buffer of " + std::to_string(capacity) +
                                     " bytes is smaller than the value (" +
                                     std::to_string(meta.size) + " bytes)");
    }
    return accept ? accept(ToInfo(meta)) : Status::OK();
  }

  // replica_version != 0: read the copy of exactly that version a replica node holds.
  void GetOnNode(int node, const std::string& key, void* user_dst, size_t capacity,
                 MemoryKind dst_kind, Clock::time_point deadline,
                 std::function<void(Result<Value>)> done, uint64_t replica_version = 0,
                 Accept accept = {}, Clock::time_point transfer_deadline = {}, uint16_t flags = 0) {
    const Clock::time_point sent = Clock::now();
    // Held once and shared by the callbacks below: copying the caller's callback into each of
    // them would allocate a copy of it every time.
    auto shared_done = MakePooledShared<std::function<void(Result<Value>)>>(std::move(done));
    auto on_reply =
        Pooled([this, node, key, replica_version, user_dst, capacity, dst_kind, shared_done, accept,
                sent](const PendingPtr& p, std::unique_ptr<Incoming> msg) {
          w::ObjectMeta meta;
          std::vector<uint16_t> hint;
          Status s = ParseReply(*msg, [&](std::string_view body, w::ReplyStatus* rs) {
            return w::DecodeObjectReply(body, rs, &meta, &hint);
          });
          // Versions are per node: only the key's own node's count (a failover read is not).
          // One look at the ring and one hash of the key serve the test and the hint.
          if (s.ok() && replica_version == 0) {
            const RingPtr ring = Route()->ring;
            const uint64_t key_hash = HashKey(key);
            if (node == ring->OwnerForHash(key_hash)) {
              RememberHint(key, key_hash, *ring, meta.version, std::move(hint), sent);
            }
          }
          if (s.ok()) write_clock.Observe(meta.version);
          if (s.ok() && meta.size != msg->payload_size()) {
            s = Status::ProtocolError("reply carries a payload of the wrong size");
          }
          if (s.ok()) s = CheckAnswer(meta, user_dst ? capacity : meta.size, accept);
          if (!s.ok()) return Fail(p, s);
          auto value = MakePooledShared<Value>();
          value->info_ = ToInfo(meta);
          void* dst = user_dst;
          MemoryKind kind = dst_kind;
          // No caller buffer, or a device one this UCX cannot receive into: the bytes land in the
          // value's own host buffer. For a device buffer the caller's thread copies them over
          // (GetInto), never this I/O thread: a synchronous CUDA copy here would stall every
          // request of this client behind the GPU's queue.
          if (!user_dst) {
            value->bytes_.reset(new std::byte[meta.size ? meta.size : 1]);
            dst = value->bytes_.get();
            kind = MemoryKind::kHost;
          } else if (kind == MemoryKind::kDevice && !transport->device_memory_supported()) {
            // A pinned buffer when the pool has one cached; allocating one here would be a
            // synchronous CUDA call on this thread, so otherwise ordinary memory, and GetInto puts
            // a pinned buffer of this size in the pool for next time (on the caller's thread).
            value->staged_ = staging_pool->TryAcquireCached(meta.size);
            if (!value->staged_) value->bytes_.reset(new std::byte[meta.size ? meta.size : 1]);
            dst = value->mutable_data();
            kind = MemoryKind::kHost;
          }
          ReceivePayload(p, std::move(msg), dst, kind, /*dst_is_ours=*/dst != user_dst,
                         Pooled([this, p, value, shared_done](Status rs2) {
                           if (!rs2.ok()) return Fail(p, rs2);
                           Complete(p, [value, shared_done] { (*shared_done)(std::move(*value)); });
                         }));
        });
    auto on_fail = Pooled([shared_done](Status s) { (*shared_done)(s); });
    if (replica_version != 0) {
      Issue(node, w::Opcode::kGet, w::kFlagReplicaRead, w::EncodeReplicaGet(key, replica_version),
            nullptr, 0, MemoryKind::kHost, deadline, std::move(on_reply), std::move(on_fail),
            transfer_deadline);
      return;
    }
    std::string& request_body = RequestBody();
    w::EncodeKeyRequestTo(&request_body, key);
    Issue(node, w::Opcode::kGet, flags, request_body, nullptr, 0, MemoryKind::kHost, deadline,
          std::move(on_reply), std::move(on_fail));
  }

  // Busy answers (a node's stream slots or buffers taken, its queues full) to a streamed put's
  // open or piece, or a ranged get's range: asked again after `backoff` (2 ms, doubling to
  // 64 ms) while the deadline leaves room. Returns whether `again` (given the next backoff) was
  // scheduled; otherwise `s` is the request's outcome.
  static constexpr auto kPieceRetryFirst = std::chrono::milliseconds(2);
  static constexpr auto kPieceRetryMax = std::chrono::milliseconds(64);
  bool RetryIfBusy(const Status& s, Clock::time_point deadline, std::chrono::milliseconds backoff,
                   std::function<void(std::chrono::milliseconds)> again);

  // --- pipelined gets into device buffers (docs/ARCHITECTURE.md, "Pipelined staging") ---
  // A GetInto of a device buffer this UCX cannot receive into, with room for more than
  // pipeline_threshold, reads the value in ranges (GET with kFlagRange) of kRangePiece bytes,
  // kRangeWindow of them in flight, into pinned buffers, and the caller's thread copies each to
  // the device while the next ones are on the wire. The first range learns the value's size
  // and version; the others must come from that version.
  static constexpr uint64_t kRangePiece = uint64_t{8} << 20;
  static constexpr size_t kRangeWindow = 2;
  struct RangePiece {
    w::GetRange range;
    std::shared_ptr<std::byte[]> buffer;  // pinned, kRangePiece bytes
    struct Got {
      w::ObjectMeta meta;  // the whole value's
      uint64_t bytes = 0;  // received
      // The node sent the whole value, larger than a piece (not in its memory): it is here,
      // in a pinned buffer from the pool or (none cached) in ordinary memory.
      std::shared_ptr<std::byte[]> whole;
      bool whole_pinned = false;
    };
    SyncSlot<Result<Got>> got;
    // Set before `got` when its error is the get's own answer (the caller's buffer is too
    // small, or GetOptions::accept refused the value), not a reason to read it whole instead.
    bool final_error = false;
  };
  // I/O thread: asks `node` for the range of `rp`; `capacity` and `accept` check the first one.
  // A later range the node answers Busy is asked again after a backoff, as a streamed put's
  // piece is.
  void GetRangeOnNode(int node, const std::string& key, const std::shared_ptr<RangePiece>& rp,
                      size_t capacity, Clock::time_point deadline, const Accept& accept,
                      std::chrono::milliseconds backoff = kPieceRetryFirst);
  // The caller's thread. The outcome, or nothing when the value is to be read whole instead
  // (the first range failed, or missed while keys move; a later one failed or found the value
  // changed; no pinned buffer): that read then finds the key wherever the whole-value path
  // would. The owner's miss (keys not moving), a buffer too small and `accept`'s refusal are
  // the outcome.
  std::optional<Result<ValueInfo>> PipelinedGetInto(const std::string& key, void* dst,
                                                    size_t capacity, const GetOptions& o,
                                                    Clock::time_point deadline);

  // --- hot-key hints: which nodes hold a copy of which version (worker thread) ---
  // A hint is good for kHintTtl from when the request that brought it was sent: the primary
  // stopped hinting before it began withdrawing the copies and waits kWithdrawWait (1.5 s) for
  // unconfirmed ones, so no hint outlives a withdrawal, however late its reply arrived.
  static constexpr auto kHintTtl = std::chrono::seconds(1);
  // A read of a copy gets at most this much of the caller's budget (and at most half of what is
  // left), so a slow copy leaves the primary time to answer.
  static constexpr auto kReplicaReadBudget = std::chrono::milliseconds(250);
  struct Hint {
    std::vector<uint16_t> nodes;  // empty: no copies; the entry only records `version`
    uint64_t version = 0;
    Clock::time_point expires;
    // Copies of `version` that missed here (evicted from a replica budget, say): not picked
    // again while the primary keeps hinting the same version.
    std::vector<uint16_t> missed;
  };
  std::unordered_map<std::string, Hint> hints;
  Clock::time_point hints_valid_from{};  // the last ring change (ApplyView)
  std::mt19937_64 hint_rng{0x9e3779b97f4a7c15ULL};
  // Versions of this client's replicated writes (replicas > 1, kFlagClientVersion): every
  // replica of a write gets the same one, so read repair can tell which replica lags. It
  // observes the versions replies carry, so a write is above every version this client saw.
  HybridClock write_clock{std::random_device{}()};
  // The newest version this client was answered for recently read keys, by key hash in a
  // direct-mapped table (a slot holds the last key that hashed there): a hint older than it is
  // refused even when the key has no hint entry (two reads of one key in flight at once).
  static constexpr size_t kSeenSlots = 4096;
  std::vector<std::pair<uint64_t, uint64_t>> seen_version =
      std::vector<std::pair<uint64_t, uint64_t>>(kSeenSlots);

  // Hints only move forward: a reply of an older version than this client already knows for
  // the key never takes its place, so this client never reads v2 and then v1 from a copy.
  void RememberHint(const std::string& key, uint64_t version, std::vector<uint16_t> nodes,
                    Clock::time_point sent) {
    RememberHint(key, HashKey(key), *Route()->ring, version, std::move(nodes), sent);
  }
  // The same with the key's hash and the ring at hand (`ring`: the current one).
  void RememberHint(const std::string& key, uint64_t h, const RingView& ring, uint64_t version,
                    std::vector<uint16_t> nodes, Clock::time_point sent) {
    // On the wire a copy's node is its position in the ring; ours maps it to the node table
    // (rings that differ for a moment name the wrong node, whose exact-version check then
    // misses: harmless).
    for (uint16_t& n : nodes) {
      if (n >= ring.size()) return;  // a hint from a node with another cluster file
      n = static_cast<uint16_t>(ring.slot(n));
    }
    if (sent < hints_valid_from) nodes.clear();  // named by a ring before the last change
    auto& slot = seen_version[h % kSeenSlots];
    if (slot.first == h && slot.second > version) return;
    slot = {h, version};
    auto it = hints.find(key);
    if (it != hints.end()) {
      Hint& old = it->second;
      if (old.version > version) return;
      if (old.version == version) {
        std::erase_if(nodes, [&](uint16_t n) {
          return std::find(old.missed.begin(), old.missed.end(), n) != old.missed.end();
        });
      } else {
        old.missed.clear();
      }
      old.nodes = std::move(nodes);
      old.version = version;
      old.expires = sent + kHintTtl;
      return;
    }
    if (nodes.empty()) return;  // nothing known of this key: keep the table to the hot few
    if (hints.size() > 65536) hints.clear();  // bounded (the seen table still holds versions)
    hints.emplace(key, Hint{std::move(nodes), version, sent + kHintTtl, {}});
  }

  // The copy of `key` on `node` missed or was late: not read there again for this version.
  void DropCopies(const std::string& key, int node) {
    auto it = hints.find(key);
    if (it == hints.end()) return;
    Hint& h = it->second;
    std::erase(h.nodes, static_cast<uint16_t>(node));
    if (std::find(h.missed.begin(), h.missed.end(), node) == h.missed.end()) {
      h.missed.push_back(static_cast<uint16_t>(node));
    }
  }

  // Chooses where to read `key`: its primary (false), or a copy a fresh hint names (true, with
  // the node and the version to ask for). Reads spread evenly over the primary and the copies.
  bool PickCopy(const std::string& key, int* node, uint64_t* version) {
    if (hints.empty()) return false;
    auto it = hints.find(key);
    if (it == hints.end()) return false;
    const auto now = Clock::now();
    if (now >= it->second.expires) {
      hints.erase(it);  // the seen table keeps its version
      return false;
    }
    const Hint& h = it->second;
    if (h.nodes.empty()) return false;
    const size_t pick = hint_rng() % (h.nodes.size() + 1);
    if (pick == 0) return false;  // the primary's turn
    const int n = h.nodes[pick - 1];
    if (IsDown(n) || now < copies_avoided_until[n]) return false;
    *node = h.nodes[pick - 1];
    *version = h.version;
    return true;
  }

  // Whether a fresh hint names copies of `key`.
  bool HasCopies(const std::string& key) const {
    if (hints.empty()) return false;
    auto it = hints.find(key);
    return it != hints.end() && Clock::now() < it->second.expires && !it->second.nodes.empty();
  }

  void AvoidCopiesOn(int node) { copies_avoided_until[node] = Clock::now() + kAvoidSlowCopies; }
  static constexpr auto kAvoidSlowCopies = std::chrono::seconds(2);

  Clock::time_point ReplicaDeadline(Clock::time_point deadline) const {
    const auto now = Clock::now();
    if (deadline <= now) return deadline;
    return std::min(deadline,
                    now + std::min<Clock::duration>((deadline - now) / 2, kReplicaReadBudget));
  }

  // A copy that misses, has gone or is slow falls back to the normal path without the caller
  // seeing an error.
  bool TryReplicaRead(const std::string& key, void* user_dst, size_t capacity, MemoryKind dst_kind,
                      Clock::time_point deadline, const std::function<void(Result<Value>)>& done,
                      const std::function<void()>& fallback, const Accept& accept) {
    int node = 0;
    uint64_t version = 0;
    if (!PickCopy(key, &node, &version)) return false;
    GetOnNode(
        node, key, user_dst, capacity, dst_kind, ReplicaDeadline(deadline),
        [this, key, node, done, fallback](Result<Value> r) {
          if (r.ok()) return done(std::move(r));
          // Not the caller's error: a copy missing or late. A wrong-sized buffer or a refused
          // value is the caller's, and the primary would say the same.
          if (r.status().code() == StatusCode::kInvalidArgument) return done(std::move(r));
          if (r.status().code() == StatusCode::kTimeout) AvoidCopiesOn(node);
          DropCopies(key, node);
          fallback();
        },
        version, accept, deadline);
    return true;
  }

  // --- batch reads (worker thread) ---
  // Rows are grouped by the node each is read from (its primary, or a copy a fresh hint names),
  // one MGET per node. Rows whose copy missed (or whose copy's node failed) are asked again of
  // their primaries as soon as that node's reply is in; rows whose primary failed are reported
  // with that failure.
  struct BatchRead {
    const std::vector<std::string>* keys = nullptr;
    Clock::time_point deadline;
    // The first round's (ReadBatch): earlier than `deadline` with replicas, so that rows of a
    // node that hangs can still be read from their other owners.
    Clock::time_point first_deadline;
    // One row's outcome; `bytes` (the value) is valid during the call only.
    std::function<void(size_t i, const Status& s, const w::ObjectMeta* meta, const char* bytes)>
        row;
    std::function<void()> done;
    int remaining = 0;  // parts in flight, plus one per IssueBatchRead loop still running
  };
  // One node's message of a batch read.
  struct BatchPart {
    std::vector<size_t> idx;     // rows (indices into keys)
    std::vector<uint64_t> vers;  // per row: 0 the node's own, else the copy's version
    bool answered = false;
    bool hedged = false;  // its copy rows went to their primaries: ignore them here
  };

  void IssueBatchRead(const std::shared_ptr<BatchRead>& b, const std::vector<size_t>& rows,
                      bool use_copies) {
    const RingPtr ring = Route()->ring;
    const size_t n_nodes = nodes.size();
    std::vector<std::vector<size_t>> by_node(n_nodes);
    std::vector<std::vector<uint64_t>> versions(n_nodes);
    std::vector<bool> primary_rows(n_nodes, false);
    // A key that is in the batch more than once is read from one place, so its rows agree.
    std::unordered_map<std::string_view, std::pair<int, uint64_t>> chosen;
    for (size_t i : rows) {
      const std::string& key = (*b->keys)[i];
      int node = 0;
      uint64_t version = 0;
      if (use_copies && !hints.empty()) {
        auto [at, fresh] = chosen.try_emplace(key, 0, 0);
        if (fresh && !PickCopy(key, &at->second.first, &at->second.second)) {
          at->second.first = ring->Owner(key);
        }
        std::tie(node, version) = at->second;
      } else {
        node = ring->Owner(key);
      }
      if (node < 0) {
        b->row(i, Status::Unavailable("the ring has no members"), nullptr, nullptr);
        continue;
      }
      by_node[node].push_back(i);
      versions[node].push_back(version);
      if (version == 0) primary_rows[node] = true;
    }
    const Clock::time_point sent = Clock::now();
    b->remaining++;  // the loop's own count: a node that fails at once answers inside it
    for (size_t n = 0; n < n_nodes; ++n) {
      if (by_node[n].empty()) continue;
      std::vector<std::string> node_keys;
      node_keys.reserve(by_node[n].size());
      for (size_t i : by_node[n]) node_keys.push_back((*b->keys)[i]);
      const bool any_copy =
          std::any_of(versions[n].begin(), versions[n].end(), [](uint64_t v) { return v != 0; });
      auto payload = std::make_shared<std::string>(
          w::EncodeKeyList(node_keys, any_copy ? &versions[n] : nullptr));
      // A message of copies only gets the short budget of a replica read. One that also holds
      // rows this node owns keeps the caller's deadline; should it not have answered within a
      // replica read's budget, its copy rows are asked of their primaries meanwhile (a hedge),
      // so a stalled node holding copies never turns healthy primaries' rows into timeouts.
      const Clock::time_point deadline =
          primary_rows[n] ? b->first_deadline : ReplicaDeadline(b->first_deadline);
      auto part = std::make_shared<BatchPart>();
      part->idx = std::move(by_node[n]);
      part->vers = std::move(versions[n]);
      if (primary_rows[n] && any_copy) {
        AddTimer(ReplicaDeadline(b->first_deadline), [this, b, part, n] {
          if (part->answered) return;
          part->hedged = true;
          AvoidCopiesOn(static_cast<int>(n));
          std::vector<size_t> copy_rows;
          for (size_t j = 0; j < part->idx.size(); ++j) {
            if (part->vers[j] != 0) copy_rows.push_back(part->idx[j]);
          }
          IssueBatchRead(b, copy_rows, /*use_copies=*/false);
        });
      }
      b->remaining++;
      IssueWithPayloadReply(
          static_cast<int>(n), w::Opcode::kMultiGet, any_copy ? w::kFlagVersionedKeys : 0, "",
          payload, deadline, b->deadline,
          [this, b, part, n, primary = static_cast<bool>(primary_rows[n]),
           sent](Result<std::shared_ptr<std::string>> r) {
            part->answered = true;
            const std::vector<size_t>& idx = part->idx;
            const std::vector<uint64_t>& vers = part->vers;
            std::vector<w::BatchGetResult> res;
            size_t block = 0;
            Status s = r.status();
            if (!primary && s.code() == StatusCode::kTimeout) AvoidCopiesOn(static_cast<int>(n));
            if (s.ok()) s = w::DecodeBatchGetBlock(**r, &res, &block);
            if (s.ok() && res.size() != idx.size()) {
              s = Status::ProtocolError("batch reply has the wrong number of results");
            }
            size_t off = block;
            std::vector<size_t> again;  // copy rows that missed: asked of their primaries now
            for (size_t j = 0; j < idx.size(); ++j) {
              const size_t i = idx[j];
              const bool copy = vers[j] != 0;
              if (copy && part->hedged) {  // asked of its primary already
                if (s.ok() && res[j].code == StatusCode::kOk) off += res[j].meta.size;
                continue;
              }
              if (copy && (!s.ok() || res[j].code != StatusCode::kOk)) {
                again.push_back(i);  // not the caller's miss: ask the primary
                DropCopies((*b->keys)[i], static_cast<int>(n));
                continue;
              }
              if (!s.ok()) {
                b->row(i, s, nullptr, nullptr);
                continue;
              }
              if (res[j].code != StatusCode::kOk) {
                static const Status kMiss = Status::NotFound("key not found");
                b->row(i,
                       res[j].code == StatusCode::kNotFound
                           ? kMiss
                           : Status(res[j].code, "batch get failed"),
                       nullptr, nullptr);
                continue;
              }
              if (!copy) {
                RememberHint((*b->keys)[i], res[j].meta.version, std::move(res[j].hint), sent);
              }
              b->row(i, Status::OK(), &res[j].meta, (*r)->data() + off);
              off += res[j].meta.size;
            }
            // At once, not after the slowest node answered: a stalled node elsewhere in the
            // batch must not use up these rows' time.
            if (!again.empty()) IssueBatchRead(b, again, /*use_copies=*/false);
            FinishBatchPart(b);
          });
    }
    FinishBatchPart(b);
  }

  // Caller's thread: the first round of a batch read of `rows` of `b`; returns when each of
  // them has its outcome from that round.
  void RunBatchRead(const std::shared_ptr<BatchRead>& b, std::vector<size_t> rows) {
    std::promise<void> all_done;
    auto finished = all_done.get_future();
    b->done = [&all_done] { all_done.set_value(); };
    Submit([this, b, rows = std::move(rows)] { IssueBatchRead(b, rows, /*use_copies=*/true); });
    Await(finished);
  }

  // --- batch reads after the first round (batch_fallback.cc) ---
  struct BatchFallback;
  // Caller's thread: reads every key of `b` and returns when every row has its outcome,
  // within b->deadline: the first round (RunBatchRead), then rows it left open (their owner
  // failed or refused them as misrouted, or missed them while keys may be moving) in fallback
  // rounds of one MGET per node (their other owners, their previous owners, the owner as last
  // resort), then rows every place refused as misrouted again under the ring then.
  void ReadBatch(const std::shared_ptr<BatchRead>& b, bool fail_open);
  void IssueFallbackRound(const std::shared_ptr<BatchFallback>& f, const std::vector<size_t>& rows);
  void FinishFallbackPart(const std::shared_ptr<BatchFallback>& f);

  void FinishBatchPart(const std::shared_ptr<BatchRead>& b) {
    if (--b->remaining > 0) return;
    auto done = std::move(b->done);
    b->row = nullptr;
    done();
  }

  // Writes to every replica of the key and answers once every replica has answered (or
  // failed): acknowledged means every current owner stored it, so the next read sees it whichever
  // owner serves it. A primary or replica that fails (down, NoSpace, late) fails the put even
  // where others stored it (see docs/ARCHITECTURE.md, "Failures"); a node failure after which
  // the ring dropped the node sends the put again under the new ring.
  void DoPut(std::string key, const void* data, size_t size, MemoryKind kind,
             std::shared_ptr<std::byte[]> keepalive, const PutOptions& o,
             Clock::time_point deadline, std::function<void(Result<uint64_t>)> done) {
    // Refused as misrouted by the key's primary: the rings differ; again soon, with ours then.
    // Failed by a node that the ring has dropped since (its lease lapsed): again under the new
    // ring, whose owners took its keys.
    RingPtr ring = Route()->ring;
    const RingView& owners_from = *ring;  // `retry` keeps it alive
    auto retry = Pooled([this, key, data, size, kind, keepalive, o, deadline, done,
                         ring = std::move(ring)](Result<uint64_t> r) mutable {
      const bool moved_on = !r.ok() && NodeFailure(r.status()) && Route()->ring != ring;
      if (!r.ok() && (Misrouted(r.status()) || moved_on) &&
          Clock::now() + kWrongNodeRetry < deadline) {
        return AddTimer(Clock::now() + kWrongNodeRetry,
                        [this, key, data, size, kind, keepalive, o, deadline, done] {
                          DoPut(key, data, size, kind, keepalive, o, deadline, done);
                        });
      }
      done(std::move(r));
    });
    DoPutOnce(owners_from, std::move(key), data, size, kind, std::move(keepalive), o, deadline,
              std::move(retry));
  }

  // One attempt of a put under `ring`.
  void DoPutOnce(const RingView& ring, std::string key, const void* data, size_t size,
                 MemoryKind kind, std::shared_ptr<std::byte[]> keepalive, const PutOptions& o,
                 Clock::time_point deadline, std::function<void(Result<uint64_t>)> done) {
    // Reused, so that a put with one owner lists it without allocating. Copied before anything
    // is issued: PutOnNode may fail at once and a retry come back here.
    static thread_local std::vector<int> owners;
    ring.Owners(key, options.replicas, &owners);
    if (owners.empty()) return done(Status::Unavailable("the ring has no members"));
    if (owners.size() == 1) {
      const int node = owners[0];
      return PutOnNode(node, key, data, size, kind, keepalive, o, deadline, 0, done);
    }
    struct Fan {
      std::vector<int> owners;
      std::vector<Result<uint64_t>> results;
      size_t remaining;
    };
    auto fan = std::make_shared<Fan>();
    fan->owners = owners;
    const size_t n = owners.size();
    fan->remaining = n;
    for (size_t i = 0; i < n; ++i) fan->results.emplace_back(Status::Aborted("pending"));
    const uint64_t version = write_clock.Take();  // the same on every replica
    for (size_t i = 0; i < n; ++i) {
      PutOnNode(fan->owners[i], key, data, size, kind, keepalive, o, deadline, version,
                [this, fan, i, done](Result<uint64_t> r) {
                  fan->results[i] = std::move(r);
                  if (--fan->remaining > 0) return;
                  // The primary's answer, unless another owner did not take the write: the
                  // put is acknowledged only when every current owner has it (issue 38 item
                  // 3), since a read whose primary fails goes to the others. One that refused
                  // as misrouted (its ring, or fencing, says the key's owners are moving)
                  // makes the whole put go again (DoPut); one that failed fails the put.
                  if (fan->results[0].ok()) {
                    Status decided;
                    for (size_t k = 1; k < fan->results.size(); ++k) {
                      decided = Deciding(decided,
                                         ReplicaFailed(fan->owners[k], fan->results[k].status()));
                    }
                    if (!decided.ok()) return done(decided);
                  }
                  done(std::move(fan->results[0]));
                });
    }
  }

  // A PUT's body (this thread's buffer, `body`) and header flags; client_version != 0: the
  // version this client assigned the write (kFlagClientVersion).
  static uint16_t EncodePut(const w::PutRequest& req, const PutOptions& o, uint64_t client_version,
                            std::string* body) {
    uint16_t flags = o.durable ? w::kFlagDurable : 0;
    w::EncodePutRequestTo(body, req);
    if (client_version != 0) {
      flags |= w::kFlagClientVersion;
      w::AppendVersion(body, client_version);
    }
    return flags;
  }

  // client_version != 0: the version this client assigned the write (kFlagClientVersion).
  void PutOnNode(int node, const std::string& key, const void* data, size_t size, MemoryKind kind,
                 std::shared_ptr<std::byte[]> keepalive, const PutOptions& o,
                 Clock::time_point deadline, uint64_t client_version,
                 std::function<void(Result<uint64_t>)> done) {
    // A device buffer this UCX cannot send from reaches here only for a pipelined put
    // (QueuePut): it is staged piece by piece.
    if (size > options.stream_threshold || NeedsStaging(kind)) {
      return StreamPutOnNode(node, key, data, size, kind, std::move(keepalive), o, deadline,
                             client_version, std::move(done));
    }
    w::PutRequest req{key, o.tensor, size};
    auto on_reply =
        Pooled([this, done, keepalive](const PendingPtr& p, std::unique_ptr<Incoming> msg) {
          uint64_t version = 0;
          Status s = ParseReply(*msg, [&](std::string_view body, w::ReplyStatus* rs) {
            return w::DecodePutReply(body, rs, &version);
          });
          if (!s.ok()) return Fail(p, s);
          write_clock.Observe(version);
          Complete(p, [done, version] { done(version); });
        });
    std::string& request_body = RequestBody();
    const uint16_t flags = EncodePut(req, o, client_version, &request_body);
    // A staged device value (`keepalive`, which `data` points into) is the client's own copy.
    Issue(node, w::Opcode::kPut, flags, request_body, data, size, kind, deadline,
          std::move(on_reply), Pooled([done](Status s) { done(s); }), {}, keepalive);
  }

  // A streamed put (docs/ARCHITECTURE.md, "Streamed puts"): a PUT with kFlagStreamed opens a
  // stream on the node, whose reply grants a piece size and a window; the pieces then go out
  // with at most that many in flight, and the piece that completes the value is answered with
  // its version. A piece the node answers Busy (its stream buffers all taken) is sent again
  // after a backoff (2 ms, doubling to 64 ms), until the deadline. Any other error ends the
  // put with it once every piece sent has settled (none still reads the caller's buffer); the
  // node drops what it stored.
  //
  // Pipelined staging (a device buffer this UCX cannot send from, see QueuePut): a staging
  // thread of the put's own copies the value piece by piece into pinned buffers (window + 1 of
  // them, so it copies the next piece while the window's pieces are on the wire) and posts each
  // piece to the I/O thread when its bytes are ready; a buffer goes back to the staging thread
  // once the node has stored its piece. The put is reported only after the staging thread has
  // stopped reading the caller's buffer.
  struct Piece {
    uint64_t offset = 0;
    uint64_t len = 0;
    std::shared_ptr<std::byte[]> staged;  // the piece's bytes, when staged; else in `data`
  };
  // Shared by a pipelined put's I/O-thread state and its staging thread.
  struct StagingShare {
    std::mutex mu;
    std::condition_variable cv;
    std::vector<std::shared_ptr<std::byte[]>> free;  // buffers whose pieces the node stored
    bool stop = false;                               // the put has ended: copy nothing more
  };
  struct PutStreamState {
    int node = 0;
    std::string open;  // the PUT that opens the stream: its body and flags
    uint16_t open_flags = 0;
    const std::byte* data = nullptr;
    uint64_t size = 0;
    MemoryKind kind = MemoryKind::kHost;
    std::shared_ptr<std::byte[]> keepalive;  // a staged copy `data` points into, if any
    Clock::time_point deadline;
    w::StreamGrant grant;
    uint64_t next = 0;   // offset of the next piece to send (not pipelined)
    uint64_t acked = 0;  // bytes the node stored
    int in_flight = 0;   // pieces sent (or waiting to be sent again) and not settled
    // Pipelined staging: null when pieces are sent from `data` itself.
    std::shared_ptr<StagingShare> staging;
    std::deque<Piece> ready;     // staged pieces not sent yet
    bool staging_reads = false;  // the staging thread may still read `data`
    // Set once: send nothing more, and report it (the version, or the error) when settled.
    bool ended = false;
    Status end_status;
    uint64_t end_version = 0;
    std::function<void(Result<uint64_t>)> done;  // empty once called
  };

  void StreamPutOnNode(int node, const std::string& key, const void* data, size_t size,
                       MemoryKind kind, std::shared_ptr<std::byte[]> keepalive, const PutOptions& o,
                       Clock::time_point deadline, uint64_t client_version,
                       std::function<void(Result<uint64_t>)> done);

  // Asks the node for the stream; one that has no stream slot free (Busy) is asked again after
  // a backoff, as a piece is, until the deadline.
  void OpenStream(const std::shared_ptr<PutStreamState>& st, std::chrono::milliseconds backoff);

  // Records the put's outcome (the first one counts) and reports it once no piece is in flight
  // and no staging thread reads the caller's buffer.
  void EndStream(const std::shared_ptr<PutStreamState>& st, Result<uint64_t> r);
  void ReportStream(const std::shared_ptr<PutStreamState>& st);

  void PumpStream(const std::shared_ptr<PutStreamState>& st);

  // A piece settled (answered, failed, or not sent again): `r` ends the put when it is an error
  // or the version; otherwise more pieces go.
  void PieceSettled(const std::shared_ptr<PutStreamState>& st, Result<uint64_t> r);

  void SendPiece(const std::shared_ptr<PutStreamState>& st, Piece piece,
                 std::chrono::milliseconds backoff);

  // Pipelined staging. Whether a buffer of this kind must go through host memory to be sent.
  bool NeedsStaging(MemoryKind kind) const {
    return kind == MemoryKind::kDevice && !transport->device_memory_supported();
  }
  // Staging threads, one per pipelined put while it copies (copies of several puts run side by
  // side, as the whole-value copies on their callers' threads do); joined once done, and all of
  // them before the transport goes (~Client).
  struct StagingThread {
    std::thread thread;
    std::shared_ptr<std::atomic<bool>> finished;
  };
  std::mutex staging_threads_mu;
  std::vector<StagingThread> staging_threads;  // guarded by staging_threads_mu
  bool staging_closed = false;                 // guarded by staging_threads_mu

  // I/O thread, once the node granted the stream: starts the put's staging thread (none once
  // the client is closing: the put ends Aborted).
  void StartStaging(const std::shared_ptr<PutStreamState>& st);

  // ~Client, once every put has ended: no staging thread starts after this; each one running
  // stops at its next piece.
  void JoinStagingThreads();

  // The staging thread: copies piece after piece of `st->data` (device memory) into pinned
  // buffers on this client's copy stream for that device, and posts each to the I/O thread. It
  // stops at the first failure (which ends the put) or when the put has ended; its last post
  // lets the put be reported.
  void StagePieces(const std::shared_ptr<PutStreamState>& st);

  // Replies whose payload is a block to read fully (batches, stats).
  void IssueWithPayloadReply(int node, w::Opcode op, uint16_t flags, std::string body,
                             std::shared_ptr<std::string> request_payload,
                             Clock::time_point deadline, Clock::time_point transfer_deadline,
                             std::function<void(Result<std::shared_ptr<std::string>>)> done) {
    auto on_reply = [this, done, request_payload](const PendingPtr& p,
                                                  std::unique_ptr<Incoming> msg) {
      Status s = ParseReply(*msg, [&](std::string_view body, w::ReplyStatus* rs) {
        return w::DecodeStatusReply(body, rs);
      });
      if (!s.ok()) return Fail(p, s);
      auto buf = std::make_shared<std::string>();
      buf->resize(msg->payload_size());
      ReceivePayload(p, std::move(msg), buf->data(), MemoryKind::kHost, /*dst_is_ours=*/true,
                     [this, p, buf, done](Status s2) {
                       if (!s2.ok()) return Fail(p, s2);
                       Complete(p, [buf, done] { done(buf); });
                     });
    };
    const void* data = request_payload ? request_payload->data() : nullptr;
    size_t size = request_payload ? request_payload->size() : 0;
    Issue(
        node, op, flags, std::move(body), data, size, MemoryKind::kHost, deadline, on_reply,
        [done](Status s) { done(s); }, transfer_deadline, request_payload);
  }
};

}  // namespace gkv
