// UcxTransport: one UCX context and one or more workers (Options::workers), each driven by a
// thread of its own, with event-driven progress. Servers and clients both use it; nothing above
// this file sees a UCX type.
//
// Threading: every UCP call of a worker happens on "its worker thread", which means whichever
// thread drives that worker now: its own thread for each pass of its loop, or (worker 0) a
// caller that waits for its own operation inside TryDrive (one at a time, under one mutex, so
// the worker's state never needs another lock). Other threads hand work to a worker with
// Post() / PostTo() (a queue plus an eventfd in the worker's epoll set). Handlers and
// completion callbacks run on a worker thread and must not block: hand slow work (disk I/O,
// cache eviction) to an executor and Post the result back.
//
// Several workers (a node's --io-threads): worker 0 owns the listener; accepted connections
// are spread over the workers in turn, and each connection belongs to one worker for its life
// (WorkerOf), whose thread runs its handlers and completions. Connect makes a connection on the
// calling worker. Send, Receive and Close may be called from any worker thread of the
// transport: for another worker's connection they are handed to that worker, and their `done`
// is handed back to the calling worker, so callers see the same threading as with one worker.
//
// Progress loop: progress until idle -> run posted tasks and deferred callbacks -> on_tick ->
// (busy-poll for a short window after activity) -> ucp_worker_arm -> epoll_wait(worker fd +
// eventfd, poll interval). The short poll interval covers missed wakeups (reported in several
// UCX versions) and drives request deadlines. While callers drive the worker for their own
// replies and nothing else is outstanding (Handlers::idle, no operation of this transport in
// flight), the loop leaves the worker's fd out of its epoll set and sleeps on the eventfd and
// the poll interval only, so the events the callers' requests bring do not wake it for nothing.
//
// Endpoints use PEER error handling: a dead peer fails its outstanding operations and reports
// on_disconnect once. Teardown (destructor): endpoints closed (flushed, forced after a grace
// period) -> listener -> worker -> context.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "gkv/cuda.h"
#include "gkv/status.h"

namespace gkv {

using ConnId = uint64_t;  // 0 is never a valid connection

class UcxTransport;

// One active message as it arrived. Move-only. The payload is either eager (held here, readable
// with payload()) or a rendezvous descriptor (fetch it with UcxTransport::Receive). Destroying the
// message without receiving a rendezvous payload releases it; the sender's operation then fails
// with a cancel, which is how a server refuses a payload it has no room for.
// Memory: a header of up to kInlineHeader bytes is held inline, and the objects themselves are
// recycled through a small free list per thread, so receiving a request allocates nothing in
// steady state.
class Incoming final {
 public:
  ~Incoming();
  Incoming(const Incoming&) = delete;
  Incoming& operator=(const Incoming&) = delete;
  static void* operator new(size_t size);
  static void operator delete(void* p);

  ConnId conn() const { return conn_; }
  unsigned am_id() const { return am_id_; }
  // Valid while this object lives.
  std::string_view header() const {
    return header_size_ <= kInlineHeader ? std::string_view(header_inline_, header_size_)
                                         : std::string_view(header_heap_);
  }
  size_t payload_size() const { return length_; }
  bool payload_is_rendezvous() const { return rndv_; }
  // REQUIRES: !payload_is_rendezvous(). Valid while this object lives.
  std::string_view payload() const;

 private:
  friend class UcxTransport;
  Incoming() = default;
  void SetHeader(const void* data, size_t size);
  static constexpr size_t kInlineHeader = 224;
  void* transport_ = nullptr;  // UcxTransport::Impl
  ConnId conn_ = 0;
  unsigned am_id_ = 0;
  size_t header_size_ = 0;
  char header_inline_[kInlineHeader];  // the header when it fits
  std::string header_heap_;            // else here
  std::string copied_;                 // eager payload copied during the callback
  void* ucx_data_ = nullptr;           // eager payload kept by UCX, or the rendezvous descriptor
  size_t length_ = 0;
  bool rndv_ = false;
};

class UcxTransport {
 public:
  struct Options {
    bool listen = false;
    std::string listen_host = "0.0.0.0";
    uint16_t listen_port = 0;  // 0: any free port (see listen_port())
    std::chrono::milliseconds poll_interval{2};
    // After any activity, keep polling without sleeping for this long (0: always sleep).
    std::chrono::microseconds busy_poll{50};
    // Every peer is on this host (a node listening on a loopback address, a client whose
    // nodes all are): UCX's network transports use the loopback device only (UCX_NET_DEVICES
    // "lo", unless UCX_NET_DEVICES or UCX_TLS is set), so no UCX interface listens on another
    // address; shared memory is unaffected.
    bool loopback_only = false;
    // Memory registered (RegisterMemory) before the listener opens, so no request is served
    // before its buffers carry their registration: a node's arenas. Their outcomes, in order,
    // are initial_registrations().
    struct Region {
      void* base = nullptr;
      size_t size = 0;
      MemoryKind kind = MemoryKind::kHost;
    };
    std::vector<Region> register_regions;
    // UCX workers, each with its own thread (1 to kMaxWorkers). TryDrive drives worker 0 only.
    int workers = 1;
  };
  static constexpr int kMaxWorkers = 64;
  // Whether `host` names the loopback interface ("localhost", 127.0.0.0/8, "::1").
  static bool IsLoopbackHost(const std::string& host);
  struct Handlers {
    // A message on AM id wire::kAmRequest or wire::kAmReply. Worker thread.
    std::function<void(std::unique_ptr<Incoming>)> on_message;
    // A connection failed or was closed by the peer. Called once per connection. Worker thread.
    std::function<void(ConnId, const Status&)> on_disconnect;
    // A connection was accepted (servers). Worker thread.
    std::function<void(ConnId)> on_accept;
    // Every loop iteration of every worker (at least every poll interval). Worker thread
    // (CurrentWorker() says which).
    std::function<void()> on_tick;
    // Whether the user has nothing outstanding that waits for the worker's events (a client:
    // no request awaiting its reply). Only then may the loop leave those events to callers that
    // drive the worker (TryDrive); unset, it never does. Worker thread.
    std::function<bool()> idle;
  };

  // Starts the worker thread. Unavailable when UCX can't start or the address can't be bound.
  static Result<std::unique_ptr<UcxTransport>> Create(const Options& options, Handlers handlers);
  ~UcxTransport();
  UcxTransport(const UcxTransport&) = delete;
  UcxTransport& operator=(const UcxTransport&) = delete;

  // --- any thread but the worker ---
  // Stops the worker thread: the listener goes, every endpoint is closed (flushed for a grace
  // period, then forced), and the callbacks that completes run on the worker thread as usual,
  // so whatever they hand to other threads must still be alive during this call. Afterwards
  // Post() drops its task. Idempotent; the destructor calls it. Not concurrently with itself.
  void Stop();

  // --- any thread ---
  // Runs `task` on worker 0's thread; after Stop() the task is destroyed unrun.
  void Post(std::function<void()> task);
  // Runs `task` on the thread of worker `worker` (0 <= worker < workers()). A task a worker
  // accepted runs even while it stops (its last pass runs what is queued); after that it is
  // destroyed unrun.
  void PostTo(int worker, std::function<void()> task);
  int workers() const;
  // The worker a connection belongs to.
  static int WorkerOf(ConnId conn) { return static_cast<int>(conn % kMaxWorkers); }
  // Post without waking the transport's own thread: for a caller that will run the task itself
  // through TryDrive, and calls Wake() if it gives up before the task ran.
  void PostQuietly(std::function<void()> task);
  void Wake();
  // Post for the transport's own thread only: a caller driving in TryDrive never runs it (for
  // a third party's callback, which must not run on a thread that may hold its own locks).
  void PostToOwnThread(std::function<void()> task);
  // Drives the worker from the calling thread (runs posted tasks, progresses UCX, runs the
  // completions that brings) until `done()` or `slice` has passed, so that a synchronous caller
  // completes its own operation without a hand-off to the transport's thread and back.
  // Returns false at once, having done nothing, when another thread drives now, on the worker
  // thread itself (a callback), after Stop() began, or when the worker uses a CUDA device that
  // is not the caller's current one (UCX's CUDA transports need that context current). While
  // it drives, this thread is the worker thread: OnWorkerThread() and DrivenByCaller() are true.
  bool TryDrive(const std::function<bool()>& done, std::chrono::microseconds slice);
  // True inside TryDrive: the worker thread is a caller's, which may hold its own locks, so
  // code that runs a third party's callback should hand it to PostToOwnThread instead.
  bool DrivenByCaller() const;
  // True when this UCX build can move CUDA device memory itself (context memory types).
  bool device_memory_supported() const;
  // The UCX library's version string ("1.22.0"), as loaded at run time.
  static std::string ucx_version();
  // Whether a transport created now could move CUDA device memory (a UCX context is made,
  // asked and dropped): what a node decides its GPU tier's placement by before it has one.
  static bool CanMoveDeviceMemory();
  // One phrase for start lines: "UCX 1.22.0, moves CUDA memory: yes" (and, once memory is
  // registered, "; registered: 2 regions, 72.0MiB").
  std::string Describe() const;

  // Registers [base, base + size) with UCX once (ucp_mem_map with its memory type), so that
  // every send from and receive into it passes the registration handle and memory type: UCX
  // then neither detects the memory type nor registers per operation (on InfiniBand, the
  // pinning and key exchange of rendezvous). For regions allocated at start and kept: the
  // memory must stay allocated until the transport is destroyed (it is unmapped after the
  // worker goes). Device memory needs device_memory_supported() (NotSupported otherwise); a
  // region overlapping one already registered is InvalidArgument; UCX's refusal is returned
  // as an error and nothing is registered (operations on that memory work as before, and the
  // caller decides what else that turns off). Runs on the worker thread; from another thread it
  // waits for it. Not after Stop().
  Status RegisterMemory(void* base, size_t size, MemoryKind kind);
  struct RegistrationStats {
    uint64_t regions = 0;
    uint64_t bytes = 0;
    // Sends and receives that passed a registration handle (their buffer lay in a region).
    uint64_t registered_ops = 0;
  };
  RegistrationStats registration_stats() const;
  // One status per Options::register_regions entry (NotSupported for device memory this UCX
  // cannot move: not registered, it is staged anyway).
  const std::vector<Status>& initial_registrations() const;
  uint16_t listen_port() const;
  size_t max_header_size() const;
  // The worker the calling thread drives now, or -1 when it drives none of this transport's.
  int CurrentWorker() const;
  // Whether the calling thread drives one of this transport's workers now.
  bool OnWorkerThread() const;

  // --- worker threads only ---
  // Starts connecting, from the calling worker (whose connection it is); sends may be issued at
  // once (UCX queues them). Failure shows up later as on_disconnect.
  Result<ConnId> Connect(const std::string& host, uint16_t port);
  // Whether the connection is open. On its own worker's thread only: from another worker the
  // answer is true (that worker's state is not read here; an operation on a closed connection
  // fails cleanly).
  bool IsOpen(ConnId conn) const;
  // The transports and devices the connection uses now ("sysv/memory tcp/lo"): on one host,
  // shared memory once wireup has completed. Empty for an unknown connection, and from another
  // worker's thread.
  std::string Transports(ConnId conn) const;
  // Sends an active message. `done` runs on the worker thread when UCX no longer needs
  // `payload` (or on failure). The header is copied before Send returns (a caller may reuse
  // its buffer at once). A device payload
  // requires device_memory_supported(). A payload inside a registered region goes with its
  // registration (see RegisterMemory); so does a Receive destination.
  void Send(ConnId conn, unsigned am_id, std::string_view header, const void* payload, size_t size,
            MemoryKind kind, std::function<void(Status)> done);
  // One piece of a gathered payload (SendGather).
  struct Segment {
    const void* data = nullptr;
    size_t size = 0;
  };
  // Send with a payload gathered from `segments` (host memory): the peer receives their
  // concatenation as one payload. Over shared memory, segments of 16 KiB or more on average
  // are gathered by UCX itself (its iov datatype) and nothing copies them into one buffer
  // first; otherwise (a network transport: UCX's zero-copy rendezvous takes contiguous buffers
  // only; small segments: UCX's cost per entry) they are copied into one buffer. Each
  // segment must stay valid until `done` runs; empty ones are skipped. Memory registrations
  // are not passed (UCX registers what a rendezvous needs).
  void SendGather(ConnId conn, unsigned am_id, std::string_view header,
                  std::vector<Segment> segments, std::function<void(Status)> done);
  // Receives the payload of `msg` into `dst` (at least payload_size() bytes). `done` runs on the
  // worker thread; `dst` must stay valid until then.
  void Receive(std::unique_ptr<Incoming> msg, void* dst, MemoryKind kind,
               std::function<void(Status)> done);
  // Closes a connection: flushes it, or with `force` (or a failed peer) drops it at once, which
  // completes its outstanding operations with an error. No on_disconnect for it.
  void Close(ConnId conn, bool force = false);

 private:
  friend class Incoming;
  struct Impl;
  explicit UcxTransport(std::vector<std::unique_ptr<Impl>> workers);
  // The worker driven by the calling thread, or null.
  Impl* Current() const;
  Impl* Owner(ConnId conn) const;
  std::vector<std::unique_ptr<Impl>> workers_;  // [0] owns the context and the listener
  Impl* impl_;                                  // workers_[0]
};

}  // namespace gkv
