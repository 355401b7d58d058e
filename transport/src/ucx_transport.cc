#include "gkv/transport/ucx_transport.h"

#include <dirent.h>
#include <linux/filter.h>
#include <netdb.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <ucp/api/ucp.h>
#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <vector>

#include "gkv/free_list.h"
#include "gkv/log.h"
#include "gkv/sanitizers.h"
#include "gkv/size.h"
#include "gkv/transport/protocol.h"

namespace gkv {
namespace {

// The transport whose worker the calling thread drives now: its worker thread's own, for good;
// a caller inside UcxTransport::TryDrive, for that call. What OnWorkerThread() asks.
thread_local const void* tls_driving = nullptr;
// The transport a caller drives now inside TryDrive (never set on a transport's own thread).
thread_local const void* tls_caller_driving = nullptr;

// The ucs_status_t boundary.
Status FromUcs(ucs_status_t s, std::string_view what) {
  if (s == UCS_OK || s == UCS_INPROGRESS) return Status::OK();
  std::string m(what);
  m += ": ";
  m += ucs_status_string(s);
  switch (s) {
    case UCS_ERR_CONNECTION_RESET:
    case UCS_ERR_ENDPOINT_TIMEOUT:
    case UCS_ERR_UNREACHABLE:
    case UCS_ERR_REJECTED:
    case UCS_ERR_NOT_CONNECTED:
    case UCS_ERR_BUSY:
    case UCS_ERR_IO_ERROR:
      return Status::Unavailable(m);
    case UCS_ERR_CANCELED:
      return Status::Aborted(m);
    case UCS_ERR_TIMED_OUT:
      return Status::Timeout(m);
    case UCS_ERR_NO_MEMORY:
    case UCS_ERR_NO_RESOURCE:
      return Status::NoSpace(m);
    case UCS_ERR_MESSAGE_TRUNCATED:
      return Status::ProtocolError(m);
    case UCS_ERR_INVALID_PARAM:
      return Status::InvalidArgument(m);
    case UCS_ERR_UNSUPPORTED:
      return Status::NotSupported(m);
    default:
      return Status::IOError(m);
  }
}

Status ResolveAddress(const std::string& host, uint16_t port, sockaddr_storage* out,
                      socklen_t* len) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  int rc = getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res);
  if (rc != 0 || !res) {
    return Status::InvalidArgument("cannot resolve '" + host + "': " + gai_strerror(rc));
  }
  std::memcpy(out, res->ai_addr, res->ai_addrlen);
  *len = res->ai_addrlen;
  freeaddrinfo(res);
  return Status::OK();
}

}  // namespace

struct UcxTransport::Impl {
  struct Conn;
  struct ErrorArg {
    Impl* impl;
    ConnId id;
  };
  struct Conn {
    ucp_ep_h ep = nullptr;
    bool failed = false;
    std::unique_ptr<ErrorArg> err_arg;
  };
  struct AmArg {
    Impl* impl;
    unsigned am_id;
  };
  static constexpr int kWorkerBits = 6;  // Options::workers is at most 1 << kWorkerBits
  // SendGather over a network transport: payloads up to this size are joined on the worker's
  // thread, larger ones on the copy thread.
  static constexpr size_t kInlineJoin = 256 << 10;
  // SendGather gathers with UCX's iov only when its segments average at least this much.
  static constexpr size_t kMinGatherAverage = 16 << 10;
  // One send or receive in flight: UCX's user data. Made and freed on the worker thread (under
  // drive_mu) and recycled (ops_free) so that steady traffic allocates none. A send's header is
  // copied by UCX (UCP_AM_SEND_FLAG_COPY_HEADER, UCX >= 1.14), so the operation does not keep it.
  struct Op {
    Impl* impl = nullptr;
    std::function<void(Status)> done;
    std::vector<ucp_dt_iov_t> iov;  // SendGather's segments (kept, with its capacity)
  };
  FreeList<Op> ops_free{256};  // worker-thread state
  Op* NewOp(std::function<void(Status)> done) {
    Op* op = ops_free.Take();
    op->impl = this;
    op->done = std::move(done);
    return op;
  }
  // The parameters of an active-message send completing `op`. COPY_HEADER: UCX keeps its own
  // copy of the header while the send is in flight.
  static ucp_request_param_t SendParams(Op* op) {
    ucp_request_param_t p{};
    p.op_attr_mask =
        UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
    p.flags = UCP_AM_SEND_FLAG_REPLY | UCP_AM_SEND_FLAG_COPY_HEADER;
    p.cb.send = &OnSendDone;
    p.user_data = op;
    return p;
  }
  // What a UCX call that started `op` returned: done at once (completed now), failed at once,
  // or in flight until its callback's completion runs.
  void Started(Op* op, void* req, const char* what) {
    if (req == nullptr) {
      FinishOp(op, Status::OK());
    } else if (UCS_PTR_IS_ERR(req)) {
      FinishOp(op, FromUcs(UCS_PTR_STATUS(req), what));
    } else {
      ops_in_flight++;
    }
  }
  // Runs an operation's completion and recycles it (emptied first: what its captures hold goes).
  void FinishOp(Op* op, const Status& s) {
    std::function<void(Status)> done = std::move(op->done);
    op->done = nullptr;
    op->iov.clear();
    ops_free.Give(op);
    done(s);
  }

  Options options;
  Handlers handlers;
  // This worker's place among the transport's workers (Options::workers): worker 0 owns the
  // UCP context, the listener and the memory registrations; the others share the context.
  int index = 0;
  std::vector<Impl*> siblings;  // every worker of the transport, by index (set before threads)
  bool owns_context() const { return index == 0; }
  ucp_context_h context = nullptr;
  ucp_worker_h worker = nullptr;
  ucp_listener_h listener = nullptr;
  bool cuda_supported = false;
  bool fake_device_memory = false;  // kDevice buffers are host memory (fake-device mode "ucx")
  size_t max_header = 0;
  uint16_t bound_port = 0;
  int epoll_fd = -1;
  int event_fd = -1;
  int worker_fd = -1;
  std::thread thread;
  std::atomic<bool> stopping{false};
  AmArg am_args[2];

  // Held by whichever thread drives the worker: the worker thread for each pass of its loop
  // (never while it sleeps), or a caller in TryDrive. Every UCP call and all worker-thread state
  // below is under it, so "the worker thread" in this file means "the holder of drive_mu".
  std::timed_mutex drive_mu;
  bool shut_down = false;  // guarded by drive_mu: Shutdown began, nothing more may drive
  // The transport's own thread has waited kLoopPatience for drive_mu: callers let it in (a
  // caller's slice ends, TryDrive refuses), so timers, deadlines and on_tick are never starved.
  // Not at once: the loop is woken by the events a driving caller's own requests bring, and
  // taking over then would hand that caller's reply to this thread after all.
  static constexpr auto kLoopPatience = std::chrono::milliseconds(1);
  std::atomic<bool> loop_wants_drive{false};
  // Callers waiting in TryDrive for the loop to let go of drive_mu (at most kCallerPatience):
  // the loop then does not busy-poll, which would hold drive_mu for most of its window and
  // keep a caller that comes back within it handing its calls to this thread, call after call.
  static constexpr auto kCallerPatience = std::chrono::microseconds(100);
  // Shutdown: how long closes of connections with nothing in flight may wait for the peer's
  // side of the disconnect (see Shutdown).
  static constexpr auto kIdleCloseGrace = std::chrono::milliseconds(250);
  std::atomic<int> callers_waiting{0};
  // A caller drove since the loop's last pass, and nobody has Posted or woken the loop since:
  // synchronous callers progress the worker for their own replies. The loop then neither
  // busy-polls (it would only fight them for drive_mu) nor listens to the worker's fd (the
  // events their requests bring would wake it for nothing, once per call): it takes the fd out
  // of its epoll set (worker_fd_muted) and sleeps on the eventfd and its poll interval only.
  // Post and Wake clear the flag, so work handed to the loop gets the fd back, armed.
  // The loop mutes only while nothing else waits for the worker's events: no send, receive or
  // device copy of this transport in flight (ops_in_flight) and the user idle (Handlers::idle,
  // e.g. a client with no request awaiting its reply). Otherwise a reply to work the driving
  // caller does not own would wait for the poll interval once that caller left.
  std::atomic<bool> caller_drove{false};
  bool worker_fd_muted = false;  // the loop's own
  int64_t ops_in_flight = 0;     // worker-thread state
  bool MayMute() const { return ops_in_flight == 0 && handlers.idle != nullptr && handlers.idle(); }

  std::mutex post_mu;
  std::vector<std::function<void()>> posted;  // guarded by post_mu
  // PostToOwnThread's: run by the transport's own thread only, never by a driving caller.
  std::vector<std::function<void()>> own_posted;  // guarded by post_mu
  bool post_closed = false;  // guarded by post_mu: the loop has ended, Post drops its task

  // Worker 0: accepted connections go to the workers in turn (next_accept). An accept handed
  // to another worker is counted in pending_accepts until it ran there; once keep_new_conns
  // is set (Stop) worker 0 keeps every new connection itself.
  size_t next_accept = 0;  // worker 0's thread
  std::atomic<int> pending_accepts{0};
  std::atomic<bool> keep_new_conns{false};

  // Worker-thread state. A connection id carries its worker's index in its low bits.
  uint64_t next_conn_seq = 1;
  ConnId NewConnId() { return (next_conn_seq++ << kWorkerBits) | static_cast<ConnId>(index); }
  std::unordered_map<ConnId, Conn> conns;
  std::unordered_map<ucp_ep_h, ConnId> conn_by_ep;
  std::vector<std::function<void()>> deferred;  // callbacks to run after progress returns
  std::vector<std::function<void()>> spare_deferred, spare_posted;  // worker thread: see RunPosted
  // Endpoint close requests in flight, each with its error-handler argument, which UCX may
  // still use until the close completes (then both go).
  struct Closing {
    void* request;
    std::unique_ptr<ErrorArg> err_arg;
  };
  std::vector<Closing> closing;
  std::vector<std::unique_ptr<ErrorArg>> retired_at_shutdown;  // freed after the worker
  std::chrono::steady_clock::time_point last_conn_request{};   // worker thread: a refused one

  // Memory registered once with ucp_mem_map (RegisterMemory): few regions (the node's arenas),
  // so a linear scan finds the one holding a buffer. Appended on the worker thread only, read
  // there; unmapped after the worker is destroyed.
  struct Region {
    uintptr_t begin;
    uintptr_t end;
    ucp_mem_h memh;
    ucs_memory_type_t type;
  };
  std::vector<Region> regions;
  std::vector<Status> initial_registrations;  // of Options::register_regions (set in Init)
  std::atomic<uint64_t> registered_regions{0}, registered_bytes{0}, registered_ops{0};

  // The region holding all of [p, p + n), or null. Worker thread.
  const Region* FindRegion(const void* p, size_t n) const {
    const auto b = reinterpret_cast<uintptr_t>(p);
    for (const Region& r : regions) {
      if (b >= r.begin && b < r.end && n <= r.end - b) return &r;
    }
    return nullptr;
  }
  // Passes the registration of the region holding [p, p + n), if any, to an operation.
  void AttachRegistration(const void* p, size_t n, ucp_request_param_t* param) {
    if (n == 0) return;
    const Region* r = FindRegion(p, n);
    if (!r) return;
    param->op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH | UCP_OP_ATTR_FIELD_MEMORY_TYPE;
    param->memh = r->memh;
    param->memory_type = r->type;
    registered_ops.fetch_add(1, std::memory_order_relaxed);
  }
  Status Register(void* base, size_t size, MemoryKind kind) {
    if (size == 0 || base == nullptr) return Status::InvalidArgument("empty memory region");
    if (kind == MemoryKind::kDevice && !cuda_supported) {
      return Status::NotSupported("this UCX cannot move device memory");
    }
    const auto b = reinterpret_cast<uintptr_t>(base);
    for (const Region& r : regions) {
      if (b < r.end && r.begin < b + size) {
        return Status::InvalidArgument("memory region overlaps one already registered");
      }
    }
    // Fake-device "device" memory is host memory: registered as what it is.
    const ucs_memory_type_t type = kind == MemoryKind::kDevice && !fake_device_memory
                                       ? UCS_MEMORY_TYPE_CUDA
                                       : UCS_MEMORY_TYPE_HOST;
    ucp_mem_map_params_t mp{};
    mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                    UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE;
    mp.address = base;
    mp.length = size;
    mp.memory_type = type;
    ucp_mem_h memh = nullptr;
    GKV_RETURN_IF_ERROR(FromUcs(ucp_mem_map(context, &mp, &memh), "ucp_mem_map"));
    regions.push_back({b, b + size, memh, type});
    registered_regions.fetch_add(1, std::memory_order_relaxed);
    registered_bytes.fetch_add(size, std::memory_order_relaxed);
    return Status::OK();
  }

  // Worker 0: registers in the shared context, and hands the region to the other workers (each
  // keeps its own list, read by its sends without a lock; until a worker has it, its
  // operations on that memory go unregistered, as before the call).
  Status RegisterEverywhere(void* base, size_t size, MemoryKind kind) {
    GKV_RETURN_IF_ERROR(Register(base, size, kind));
    const Region added = regions.back();
    for (Impl* w : siblings) {
      if (w != this) w->PostTask([w, added] { w->regions.push_back(added); });
    }
    return Status::OK();
  }

  // `done`, completed on `current`'s thread (a send or receive handed to another worker): here
  // when that worker has stopped (only at Stop, after its loop ended).
  static std::function<void(Status)> CompleteOn(Impl* current, std::function<void(Status)> done) {
    return [current, done = std::move(done)](Status s) {
      if (!current->PostTask([done, s] { done(s); })) done(s);
    };
  }
  // The endpoint a send on `conn` with this header may use, or null after `done` got why not.
  // Worker thread.
  ucp_ep_h SendableEp(ConnId conn, size_t header_size, const std::function<void(Status)>& done) {
    auto it = conns.find(conn);
    if (it == conns.end() || it->second.failed) {
      done(Status::Unavailable("connection is closed"));
      return nullptr;
    }
    if (header_size > max_header) {
      done(Status::InvalidArgument("message header of " + std::to_string(header_size) +
                                   " bytes exceeds the transport's limit of " +
                                   std::to_string(max_header)));
      return nullptr;
    }
    return it->second.ep;
  }

  // The endpoint's lanes: up to 16 (transport, device) entries; 0 when UCX cannot say.
  static unsigned QueryLanes(ucp_ep_h ep, ucp_transport_entry_t (&entries)[16]) {
    ucp_ep_attr_t attr{};
    attr.field_mask = UCP_EP_ATTR_FIELD_TRANSPORTS;
    attr.transports.entries = entries;
    attr.transports.num_entries = 16;
    attr.transports.entry_size = sizeof(ucp_transport_entry_t);
    return ucp_ep_query(ep, &attr) == UCS_OK ? attr.transports.num_entries : 0;
  }
  // Whether the endpoint's lanes include a shared-memory transport (same host). Worker thread.
  static bool OverSharedMemory(ucp_ep_h ep) {
    ucp_transport_entry_t entries[16];
    const unsigned n = QueryLanes(ep, entries);
    for (unsigned i = 0; i < n; ++i) {
      const std::string_view name = entries[i].transport_name ? entries[i].transport_name : "";
      for (std::string_view shm : {"sysv", "posix", "xpmem", "cma", "knem"}) {
        if (name == shm) return true;
      }
    }
    return false;
  }

  // Device copies that must not run on the worker thread (an eager payload into device
  // memory): a synchronous CUDA copy there would stall every request of this transport behind
  // the GPU's queue. One thread, started on first use with the worker's CUDA device bound;
  // jobs own the bytes they copy (never UCX's buffers) and post their completion back to the
  // worker. Shutdown joins it before its last RunPosted, so completions still run there and no
  // job outlives the transport (or the memory it copies into).
  class CopyThread {
   public:
    explicit CopyThread(int cuda_device) : cuda_device_(cuda_device) {}
    ~CopyThread() { Join(); }
    // Runs `job` on the copy thread; once joined, on the calling thread.
    void Submit(std::function<void()> job) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (!stop_) {
          if (!thread_.joinable()) thread_ = std::thread([this] { Run(); });
          jobs_.push_back(std::move(job));
          cv_.notify_one();
          return;
        }
      }
      job();
    }
    // Finishes the queued jobs and ends the thread. Idempotent.
    void Join() {
      {
        std::lock_guard<std::mutex> lock(mu_);
        stop_ = true;
      }
      cv_.notify_all();
      if (thread_.joinable()) thread_.join();
    }

   private:
    void Run() {
      if (Status cs = CudaBindThread(cuda_device_); !cs.ok()) {
        GKV_LOG_WARN("device copy thread: no CUDA context on device {}: {}", cuda_device_,
                     cs.ToString());
      }
      std::unique_lock<std::mutex> lock(mu_);
      for (;;) {
        cv_.wait(lock, [this] { return stop_ || !jobs_.empty(); });
        if (jobs_.empty()) return;  // stopping, nothing left
        auto job = std::move(jobs_.front());
        jobs_.pop_front();
        lock.unlock();
        job();
        job = nullptr;  // what it captured goes outside the lock too
        lock.lock();
      }
    }
    const int cuda_device_;
    std::mutex mu_;
    std::condition_variable cv_;
    std::deque<std::function<void()>> jobs_;
    bool stop_ = false;
    std::thread thread_;
  };

  // From any thread: runs `task` on the worker thread. False (the task destroyed unrun) after
  // the loop ended.
  bool PostTask(std::function<void()> task) {
    {
      std::lock_guard<std::mutex> lock(post_mu);
      if (post_closed) return false;
      posted.push_back(std::move(task));
    }
    caller_drove.store(false, std::memory_order_release);
    uint64_t one = 1;
    (void)!write(event_fd, &one, sizeof one);
    return true;
  }

  // Ends this worker's loop (its Shutdown closes its connections) and drops what was still
  // posted. Any thread but this worker's; idempotent.
  void StopThread() {
    if (!thread.joinable()) return;
    stopping.store(true, std::memory_order_release);
    uint64_t one = 1;
    (void)!write(event_fd, &one, sizeof one);
    thread.join();
    std::vector<std::function<void()>> leftover;
    {
      std::lock_guard<std::mutex> lock(post_mu);
      post_closed = true;
      leftover.swap(posted);
      for (auto& fn : own_posted) leftover.push_back(std::move(fn));
      own_posted.clear();
    }
    // Destroyed outside the lock: the tasks may own messages, whose destructors take it.
    leftover.clear();
  }

  int cuda_device = -1;  // bound on the worker and copy threads (CudaCurrentDevice at Create)
  std::unique_ptr<CopyThread> copy_thread;  // made at Create; joined by Shutdown

  ~Impl() {
    if (copy_thread) copy_thread->Join();  // in case Shutdown never ran
    if (listener) ucp_listener_destroy(listener);
    if (worker) ucp_worker_destroy(worker);
    retired_at_shutdown.clear();
    if (owns_context()) {  // the other workers are destroyed first (~UcxTransport)
      for (const Region& r : regions) ucp_mem_unmap(context, r.memh);
      if (context) ucp_cleanup(context);
    }
    if (epoll_fd >= 0) close(epoll_fd);
    if (event_fd >= 0) close(event_fd);
  }

  // Worker 0 (`owner` null) makes the context; another worker shares `owner`'s, with its
  // memory registrations.
  Status Init(const Impl* owner) {
    if (owner != nullptr) {
      context = owner->context;
      cuda_supported = owner->cuda_supported;
      fake_device_memory = owner->fake_device_memory;
      regions = owner->regions;  // registered in the shared context: valid on every worker
      return InitWorker();
    }
    ucp_config_t* config = nullptr;
    // A restarted node must be able to bind its port again at once, while connections of its
    // previous life sit in TIME_WAIT (UCX leaves SO_REUSEADDR off unless asked). It is a UCT
    // (tcp connection manager) setting, read from the environment, so it is set there; an
    // explicit UCX_TCP_CM_REUSEADDR wins.
    if (options.listen) setenv("UCX_TCP_CM_REUSEADDR", "y", /*overwrite=*/0);
    GKV_RETURN_IF_ERROR(FromUcs(ucp_config_read(nullptr, nullptr, &config), "ucp_config_read"));
    // Same host: shared memory (sysv, posix) claims peer-failure support only when asked
    // (UCX_MM_ERROR_HANDLING; off by default), and every endpoint here uses PEER error handling,
    // so without it a client and a node on one machine talk over tcp/lo. With it, UCX 1.22
    // moves them onto sysv once wireup completes and keeps the connection manager's socket,
    // which still reports a dead peer at once. An explicit UCX setting wins.
    if (!std::getenv("UCX_MM_ERROR_HANDLING") && !std::getenv("UCX_SYSV_ERROR_HANDLING") &&
        !std::getenv("UCX_POSIX_ERROR_HANDLING")) {
      const ucs_status_t ms = ucp_config_modify(config, "MM_ERROR_HANDLING", "y");
      if (ms != UCS_OK) {
        GKV_LOG_DEBUG("UCX: cannot turn on shared-memory error handling: {}",
                      ucs_status_string(ms));
      }
    }
    // (Not when UCX_NET_DEVICES or UCX_TLS names what to use: a one-box RDMA test picks its
    // devices. A setting in ucx.conf is not seen here and is overridden.)
    if (options.loopback_only && !std::getenv("UCX_NET_DEVICES") && !std::getenv("UCX_TLS")) {
      const ucs_status_t ns = ucp_config_modify(config, "NET_DEVICES", "lo");
      if (ns != UCS_OK) {
        GKV_LOG_DEBUG("UCX: cannot limit network devices to lo: {}", ucs_status_string(ns));
      }
    }
    // AddressSanitizer builds only: UCX's CMA transport probes a peer's reachability with
    // process_vm_readv, and ASan's interceptor of that call then checks the shadow of an
    // address outside ASan's ranges and crashes the process (SEGV in write_iovec, inside
    // uct_cma_iface_is_reachable_v2; seen once in a node's start under the ASan suite). CMA is
    // left out there; sysv and posix shared memory remain. (Not when UCX_TLS is set.)
    if (kAddressSanitizer && !std::getenv("UCX_TLS")) {
      const ucs_status_t ts = ucp_config_modify(config, "TLS", "^cma");
      if (ts != UCS_OK) {
        GKV_LOG_DEBUG("UCX: cannot leave out cma: {}", ucs_status_string(ts));
      }
    }
    ucp_params_t params{};
    params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED;
    params.features = UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
    // Several workers on several threads share this context: UCX must lock its shared parts
    // (memory registration and its cache).
    params.mt_workers_shared = options.workers > 1 ? 1 : 0;
    ucs_status_t st = ucp_init(&params, config, &context);
    ucp_config_release(config);
    GKV_RETURN_IF_ERROR(FromUcs(st, "ucp_init"));

    ucp_context_attr_t cattr{};
    cattr.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES;
    GKV_RETURN_IF_ERROR(FromUcs(ucp_context_query(context, &cattr), "ucp_context_query"));
    // A successful ucp_mem_map of CUDA memory proves nothing on a UCX without CUDA; the
    // context's memory types are the reliable signal.
    cuda_supported = (cattr.memory_types & UCS_BIT(UCS_MEMORY_TYPE_CUDA)) != 0;
    // Fake-device mode "ucx" (tests): the "device" memory is host memory, which UCX moves.
    fake_device_memory = FakeDeviceKind() == FakeDevice::kMovedByUcx;
    cuda_supported |= fake_device_memory;
    // Fake-device mode "1": UCX must not move the stand-in memory, even a CUDA-capable UCX.
    if (FakeDeviceKind() == FakeDevice::kStaged) cuda_supported = false;
    GKV_RETURN_IF_ERROR(InitWorker());

    // Before the listener: no request can reach a buffer of these regions unregistered.
    for (const Options::Region& r : options.register_regions) {
      initial_registrations.push_back(Register(r.base, r.size, r.kind));
    }

    if (options.listen) {
      sockaddr_storage addr{};
      socklen_t len = 0;
      GKV_RETURN_IF_ERROR(ResolveAddress(options.listen_host, options.listen_port, &addr, &len));
      ucp_listener_params_t lp{};
      lp.field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR | UCP_LISTENER_PARAM_FIELD_CONN_HANDLER;
      lp.sockaddr.addr = reinterpret_cast<const sockaddr*>(&addr);
      lp.sockaddr.addrlen = len;
      lp.conn_handler.cb = &Impl::OnConnRequest;
      lp.conn_handler.arg = this;
      ucs_status_t ls = ucp_listener_create(worker, &lp, &listener);
      if (ls != UCS_OK) {
        return FromUcs(ls, "cannot listen on " + options.listen_host + ":" +
                               std::to_string(options.listen_port))
            .WithContext("bind");
      }
      ucp_listener_attr_t la{};
      la.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR;
      GKV_RETURN_IF_ERROR(FromUcs(ucp_listener_query(listener, &la), "ucp_listener_query"));
      const sockaddr* sa = reinterpret_cast<const sockaddr*>(&la.sockaddr);
      bound_port =
          ntohs(sa->sa_family == AF_INET6 ? reinterpret_cast<const sockaddr_in6*>(sa)->sin6_port
                                          : reinterpret_cast<const sockaddr_in*>(sa)->sin_port);
    }
    return Status::OK();
  }

  // The UCP worker, its active-message handlers and this worker's epoll set.
  Status InitWorker() {
    ucp_worker_params_t wparams{};
    wparams.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    // Serialized: the worker is progressed by more than one thread, one at a time (the
    // transport's own thread, or a caller in TryDrive, under drive_mu).
    wparams.thread_mode = UCS_THREAD_MODE_SERIALIZED;
    GKV_RETURN_IF_ERROR(
        FromUcs(ucp_worker_create(context, &wparams, &worker), "ucp_worker_create"));

    ucp_worker_attr_t wattr{};
    wattr.field_mask = UCP_WORKER_ATTR_FIELD_MAX_AM_HEADER;
    GKV_RETURN_IF_ERROR(FromUcs(ucp_worker_query(worker, &wattr), "ucp_worker_query"));
    max_header = wattr.max_am_header;

    const unsigned ids[2] = {wire::kAmRequest, wire::kAmReply};
    for (int i = 0; i < 2; ++i) {
      am_args[i] = {this, ids[i]};
      ucp_am_handler_param_t hp{};
      hp.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                      UCP_AM_HANDLER_PARAM_FIELD_ARG | UCP_AM_HANDLER_PARAM_FIELD_FLAGS;
      hp.id = ids[i];
      hp.flags = UCP_AM_FLAG_WHOLE_MSG;
      hp.cb = &Impl::OnAm;
      hp.arg = &am_args[i];
      GKV_RETURN_IF_ERROR(FromUcs(ucp_worker_set_am_recv_handler(worker, &hp), "am handler"));
    }

    GKV_RETURN_IF_ERROR(FromUcs(ucp_worker_get_efd(worker, &worker_fd), "ucp_worker_get_efd"));
    epoll_fd = epoll_create1(EPOLL_CLOEXEC);
    event_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (epoll_fd < 0 || event_fd < 0) return Status::IOError("epoll/eventfd setup failed");
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.fd = worker_fd;
    epoll_ctl(epoll_fd, EPOLL_CTL_ADD, worker_fd, &ev);
    ev.data.fd = event_fd;
    epoll_ctl(epoll_fd, EPOLL_CTL_ADD, event_fd, &ev);
    return Status::OK();
  }

  // --- UCX callbacks (inside progress): record, never call back into UCP here ---

  static void OnConnRequest(ucp_conn_request_h request, void* arg) {
    auto* self = static_cast<Impl*>(arg);
    if (self->stopping.load(std::memory_order_acquire)) {
      self->last_conn_request = std::chrono::steady_clock::now();
      ucp_listener_reject(self->listener, request);
      return;
    }
    // Connections are spread over the workers in turn; the endpoint is created on the chosen
    // worker's thread (UCX accepts a listener's request on any worker of its context).
    // pending_accepts is raised before keep_new_conns is read (both sequentially consistent,
    // as in Stop, which sets the flag and then waits for the count to drop to zero): either Stop
    // waits for this hand-off, or this sees the flag and keeps the connection.
    Impl* target = self;
    if (self->siblings.size() > 1) {
      self->pending_accepts.fetch_add(1);
      if (!self->keep_new_conns.load()) {
        target = self->siblings[self->next_accept++ % self->siblings.size()];
      }
      if (target == self) self->pending_accepts.fetch_sub(1);
    }
    if (target == self) return self->Accept(request);
    const bool posted = target->PostTask([self, target, request] {
      target->Accept(request);
      self->pending_accepts.fetch_sub(1);
    });
    if (!posted) {  // not reached: Stop stops no other worker while a hand-off is pending
      self->pending_accepts.fetch_sub(1);
      self->Accept(request);
    }
  }

  // Creates the endpoint of an accepted connection on this worker. Worker thread.
  void Accept(ucp_conn_request_h request) {
    const ConnId id = NewConnId();
    Conn& c = conns[id];
    c.err_arg.reset(new ErrorArg{this, id});
    ucp_ep_params_t ep{};
    ep.field_mask = UCP_EP_PARAM_FIELD_CONN_REQUEST | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                    UCP_EP_PARAM_FIELD_ERR_HANDLER;
    ep.conn_request = request;
    ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    ep.err_handler.cb = &Impl::OnEpError;
    ep.err_handler.arg = c.err_arg.get();
    ucs_status_t st = ucp_ep_create(worker, &ep, &c.ep);
    if (st != UCS_OK) {
      GKV_LOG_WARN("accepting a connection failed: {}", ucs_status_string(st));
      conns.erase(id);
      return;
    }
    conn_by_ep[c.ep] = id;
    if (handlers.on_accept) {
      deferred.push_back([this, id] { handlers.on_accept(id); });
    }
  }

  static void OnEpError(void* arg, ucp_ep_h, ucs_status_t status) {
    auto* ea = static_cast<ErrorArg*>(arg);
    Impl* self = ea->impl;
    const ConnId id = ea->id;
    auto it = self->conns.find(id);
    if (it == self->conns.end() || it->second.failed) return;
    it->second.failed = true;
    Status s = FromUcs(status, "connection lost");
    self->deferred.push_back([self, id, s] {
      // The endpoint is dead: close it forcibly; its operations have failed already.
      self->CloseInternal(id, /*force=*/true);
      if (self->handlers.on_disconnect) self->handlers.on_disconnect(id, s);
    });
  }

  static ucs_status_t OnAm(void* arg, const void* header, size_t header_length, void* data,
                           size_t length, const ucp_am_recv_param_t* param) {
    auto* a = static_cast<AmArg*>(arg);
    Impl* self = a->impl;
    // No value-initialization: the inline header buffer is not zero-filled per message.
    std::unique_ptr<Incoming> msg(new Incoming);
    msg->transport_ = self;
    msg->am_id_ = a->am_id;
    msg->SetHeader(header, header_length);
    msg->length_ = length;
    if ((param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) && param->reply_ep) {
      auto it = self->conn_by_ep.find(param->reply_ep);
      msg->conn_ = it == self->conn_by_ep.end() ? 0 : it->second;
    }
    ucs_status_t ret = UCS_OK;
    if (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) {
      msg->rndv_ = true;
      msg->ucx_data_ = data;
      ret = UCS_INPROGRESS;  // we own the descriptor: receive or release it later
    } else if (length > 0 && (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_DATA)) {
      msg->ucx_data_ = data;
      ret = UCS_INPROGRESS;  // keep UCX's buffer, released with the message
    } else if (length > 0) {
      msg->copied_.assign(static_cast<const char*>(data), length);
    }
    Incoming* raw = msg.release();
    self->deferred.push_back([self, raw] {
      std::unique_ptr<Incoming> m(raw);
      if (self->handlers.on_message) self->handlers.on_message(std::move(m));
    });
    return ret;
  }

  // UCX completed an operation (inside progress): its completion runs with the deferred ones.
  // A success captures only the op, so the deferred task needs no allocation.
  static void DeferCompletion(Op* op, ucs_status_t status, const char* what) {
    if (status == UCS_OK) {
      op->impl->deferred.push_back([op] {
        op->impl->ops_in_flight--;
        op->impl->FinishOp(op, Status::OK());
      });
      return;
    }
    op->impl->deferred.push_back([op, s = FromUcs(status, what)] {
      op->impl->ops_in_flight--;
      op->impl->FinishOp(op, s);
    });
  }

  static void OnSendDone(void* request, ucs_status_t status, void* user_data) {
    DeferCompletion(static_cast<Op*>(user_data), status, "send");
    ucp_request_free(request);
  }

  static void OnRecvDone(void* request, ucs_status_t status, size_t, void* user_data) {
    DeferCompletion(static_cast<Op*>(user_data), status, "receive");
    ucp_request_free(request);
  }

  // --- worker thread ---

  // The task lists are swapped with a spare vector and the spare is kept, so that in steady
  // state running them allocates nothing (a call made from inside a task finds no spare and
  // allocates, which is still correct).
  void RunDeferred() {
    // Callbacks may add more deferred work; loop until quiet.
    while (!deferred.empty()) {
      std::vector<std::function<void()>> batch = std::move(spare_deferred);
      batch.clear();
      batch.swap(deferred);
      for (auto& fn : batch) fn();
      batch.clear();
      spare_deferred = std::move(batch);
    }
  }

  // `own_thread`: the transport's own thread, which runs PostToOwnThread's tasks too.
  bool RunPosted(bool own_thread = true) {
    std::vector<std::function<void()>> batch = std::move(spare_posted);
    batch.clear();
    {
      std::lock_guard<std::mutex> lock(post_mu);
      batch.swap(posted);
      if (own_thread && !own_posted.empty()) {
        for (auto& fn : own_posted) batch.push_back(std::move(fn));
        own_posted.clear();
      }
    }
    for (auto& fn : batch) fn();
    const bool any = !batch.empty();
    batch.clear();
    spare_posted = std::move(batch);
    return any;
  }

  // Returns true if anything happened.
  bool ProgressAll() {
    bool any = false;
    while (ucp_worker_progress(worker) != 0) any = true;
    any |= !deferred.empty();
    RunDeferred();
    return any;
  }

  void Loop() {
    tls_driving = this;
    MarkProgressThread();
    epoll_event events[4];
    auto last_activity = std::chrono::steady_clock::now();
    std::unique_lock<std::timed_mutex> drive(drive_mu, std::defer_lock);
    while (!stopping.load(std::memory_order_acquire)) {
      // One pass under drive_mu; it is let go between passes and while sleeping, so a caller
      // waiting for its own reply can drive instead (TryDrive).
      if (!drive.owns_lock()) {
        // try_lock_until on the system clock, not try_lock_for: libstdc++ implements the latter
        // with pthread_mutex_clocklock, which GCC 12's ThreadSanitizer does not intercept (it then
        // reports the unlock as one of an unlocked mutex); pthread_mutex_timedlock it does.
        if (!drive.try_lock_until(std::chrono::system_clock::now() + kLoopPatience)) {
          loop_wants_drive.store(true, std::memory_order_relaxed);
          drive.lock();
          loop_wants_drive.store(false, std::memory_order_relaxed);
        }
      }
      bool active = ProgressAll();
      active |= RunPosted();
      RunDeferred();
      if (handlers.on_tick) handlers.on_tick();
      // Busy-poll briefly after activity: a request/reply exchange usually continues within
      // microseconds, and sleeping in epoll would add a wakeup to every hop.
      const auto now = std::chrono::steady_clock::now();
      if (active) last_activity = now;
      const bool callers_drive =
          caller_drove.exchange(false, std::memory_order_acq_rel) && MayMute();
      if (callers_drive != worker_fd_muted) {
        epoll_event ev{};
        ev.events = EPOLLIN;
        ev.data.fd = worker_fd;
        if (epoll_ctl(epoll_fd, callers_drive ? EPOLL_CTL_DEL : EPOLL_CTL_ADD, worker_fd, &ev) ==
            0) {
          worker_fd_muted = callers_drive;
        }
      }
      if (!worker_fd_muted) {
        if (now - last_activity < options.busy_poll &&
            callers_waiting.load(std::memory_order_relaxed) == 0) {
          // Spin politely: on a machine with fewer cores than busy threads the thread we are
          // waiting for may need this core.
          drive.unlock();
          std::this_thread::yield();
          continue;
        }
        ucs_status_t st = ucp_worker_arm(worker);
        if (st == UCS_ERR_BUSY) continue;
      }
      {
        std::lock_guard<std::mutex> lock(post_mu);
        if (!posted.empty() || !own_posted.empty()) continue;
      }
      // Armed (unless muted): an event that arrives while a caller drives wakes this thread,
      // which then waits for drive_mu, progresses and arms again; so nothing is left
      // unprogressed when the caller leaves.
      drive.unlock();
      int n = epoll_wait(epoll_fd, events, 4, static_cast<int>(options.poll_interval.count()));
      for (int i = 0; i < n; ++i) {
        if (events[i].data.fd == event_fd) {
          uint64_t v;
          while (read(event_fd, &v, sizeof v) > 0) {
          }
        }
      }
    }
    if (!drive.owns_lock()) drive.lock();
    shut_down = true;
    Shutdown();
  }

  // One slice of a caller driving the worker (see UcxTransport::TryDrive). REQUIRES: drive_mu.
  void DriveSlice(const std::function<bool()>& done, std::chrono::microseconds slice) {
    caller_drove.store(true, std::memory_order_release);
    const auto end = std::chrono::steady_clock::now() + slice;
    for (;;) {
      bool active = RunPosted(/*own_thread=*/false);
      active |= ProgressAll();
      if (done() || loop_wants_drive.load(std::memory_order_relaxed) ||
          std::chrono::steady_clock::now() >= end) {
        return;
      }
      // Spin politely, as the loop does: the server this caller waits for may need this core.
      if (!active) std::this_thread::yield();
    }
  }

  // Makes the kernel take no new connection for the listener: its own socket, found among this
  // process's sockets as the listening one bound to the listener's address, gets a filter that
  // drops every packet. See Shutdown for why. Returns whether it found the socket.
  static bool SameOrWildcardAddress(const sockaddr* a, const sockaddr* b) {
    if (a->sa_family == AF_INET6) {
      const in6_addr& x = reinterpret_cast<const sockaddr_in6*>(a)->sin6_addr;
      const in6_addr& y = reinterpret_cast<const sockaddr_in6*>(b)->sin6_addr;
      return IN6_IS_ADDR_UNSPECIFIED(&x) || IN6_IS_ADDR_UNSPECIFIED(&y) ||
             std::memcmp(&x, &y, sizeof x) == 0;
    }
    const in_addr_t x = reinterpret_cast<const sockaddr_in*>(a)->sin_addr.s_addr;
    const in_addr_t y = reinterpret_cast<const sockaddr_in*>(b)->sin_addr.s_addr;
    return x == INADDR_ANY || y == INADDR_ANY || x == y;
  }

  bool StopAcceptingConnections() {
    ucp_listener_attr_t la{};
    la.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR;
    if (ucp_listener_query(listener, &la) != UCS_OK) return false;
    const auto* want = reinterpret_cast<const sockaddr*>(&la.sockaddr);
    auto port_of = [](const sockaddr* sa) {
      return sa->sa_family == AF_INET6 ? reinterpret_cast<const sockaddr_in6*>(sa)->sin6_port
                                       : reinterpret_cast<const sockaddr_in*>(sa)->sin_port;
    };
    DIR* dir = opendir("/proc/self/fd");
    if (!dir) return false;
    bool found = false;
    while (dirent* e = readdir(dir)) {
      char* end = nullptr;
      const long fd = std::strtol(e->d_name, &end, 10);
      if (end == e->d_name || *end != '\0' || fd == dirfd(dir)) continue;
      int accepting = 0;
      socklen_t alen = sizeof accepting;
      if (getsockopt(static_cast<int>(fd), SOL_SOCKET, SO_ACCEPTCONN, &accepting, &alen) != 0 ||
          !accepting) {
        continue;
      }
      sockaddr_storage have{};
      socklen_t hlen = sizeof have;
      if (getsockname(static_cast<int>(fd), reinterpret_cast<sockaddr*>(&have), &hlen) != 0) {
        continue;
      }
      const auto* sa = reinterpret_cast<const sockaddr*>(&have);
      if (sa->sa_family != want->sa_family || port_of(sa) != port_of(want)) continue;
      // The same address too (a wildcard on either side matches): another socket of this
      // process may listen on the same port number at another address.
      if (!SameOrWildcardAddress(sa, want)) continue;
      // A socket filter that drops every packet: the listener completes no new handshake (SYNs
      // and handshake ACKs are dropped; a client dialling now times out or is refused once the
      // node is gone), and nothing is made readable, so UCX's accept handler is not woken. (A
      // shutdown() would make accept fail, and UCX's level-triggered handler spin on it.)
      sock_filter drop_all[] = {BPF_STMT(BPF_RET | BPF_K, 0)};
      sock_fprog prog{1, drop_all};
      found =
          setsockopt(static_cast<int>(fd), SOL_SOCKET, SO_ATTACH_FILTER, &prog, sizeof prog) == 0;
      break;
    }
    closedir(dir);
    return found;
  }

  void Shutdown() {
    // Stop accepting first, then let the connections already accepted be rejected, then the
    // listener goes. UCX 1.22 (tcp sockcm) has a race here (openucx/ucx#11087, open; UCX 1.13
    // had it too): a connection accepted whose request data has not been read yet keeps a
    // pointer to the listener, and when the data arrives after ucp_listener_destroy, UCX's
    // async thread runs the request callback on the freed listener (SIGSEGV in
    // ucp_cm_server_conn_request_cb; seen at SIGTERM with clients redialling, about 1 stop in
    // 30 on a loaded machine under ASan, and no amount of waiting for a quiet moment helped).
    // So the listening socket itself stops taking connections first (a drop-all socket filter):
    // the kernel completes no new handshake for it, and what it accepted before sends its request
    // within milliseconds (the client sends it right after connecting). Those are rejected
    // (stopping is set) while progress runs for a grace period: until none came for 200 ms (a
    // client slowed by a loaded machine), at most 2 s. A request delayed longer than that can
    // still meet the destroyed listener: this narrows the race to that, it cannot close it.
    if (listener) {
      const bool stopped_accepting = StopAcceptingConnections();
      if (!stopped_accepting) {
        GKV_LOG_DEBUG("listener socket not found; rejecting connections until the listener goes");
      }
      const auto start = std::chrono::steady_clock::now();
      last_conn_request = start;
      for (;;) {
        ProgressAll();
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
        const auto now = std::chrono::steady_clock::now();
        if (now - start >= std::chrono::seconds(2)) break;
        if (now - last_conn_request >= std::chrono::milliseconds(stopped_accepting ? 200 : 100)) {
          break;
        }
      }
      ucp_listener_destroy(listener);
      listener = nullptr;
    }
    // Device copies in flight finish and post their completions, which run just below.
    if (copy_thread) copy_thread->Join();
    // Finish what was posted, then close every endpoint (flush for a short grace period).
    RunPosted();
    ProgressAll();
    std::vector<ConnId> ids;
    for (auto& [id, c] : conns) ids.push_back(id);
    // Everything sent so far leaves this process first: a worker flush completes once each
    // endpoint's data is in the peer's shared-memory queue, the kernel's socket buffer or the
    // NIC's hands, which needs no answer from the peer's software (over tcp, UCX holds the rest
    // of a message the socket buffer had no room for until then).
    ucp_request_param_t flush_param{};
    void* flush = ucp_worker_flush_nbx(worker, &flush_param);
    bool flushed = !UCS_PTR_IS_PTR(flush);
    if (UCS_PTR_IS_ERR(flush)) {
      GKV_LOG_DEBUG("worker flush at shutdown: {}", ucs_status_string(UCS_PTR_STATUS(flush)));
    }
    for (ConnId id : ids) CloseInternal(id, false);
    // Flushing closes get 2 s; ones still flushing then (a slow peer taking a large reply)
    // get up to 5 s more before they are abandoned: the worker goes right after. Once the
    // worker flush is done and nothing of this worker's is in flight (no send or receive
    // pending), closes still pending after kIdleCloseGrace wait only for the disconnect
    // handshake of peers that cannot answer it: a client stopped in a debugger, one that
    // dropped its endpoint without telling, a dead machine. UCX would see those only at its
    // keepalive (20 s); what they were sent has left already. Live peers answer within
    // milliseconds.
    using SteadyClock = std::chrono::steady_clock;
    auto deadline = SteadyClock::now() + std::chrono::seconds(2);
    // Since when the worker is flushed with nothing in flight; max() while it is not.
    auto quiet_since = SteadyClock::time_point::max();
    bool only_silent_peers_left = false;
    auto settled = [&] { return closing.empty() && flushed; };
    for (int phase = 0; phase < 2 && !settled() && !only_silent_peers_left; ++phase) {
      while (!settled() && SteadyClock::now() < deadline) {
        ucp_worker_progress(worker);
        ReapClosed();
        RunDeferred();
        RunPosted();
        if (!flushed) {
          const ucs_status_t fs = ucp_request_check_status(flush);
          if (fs != UCS_INPROGRESS) {
            if (fs != UCS_OK) {
              GKV_LOG_DEBUG("worker flush at shutdown: {}", ucs_status_string(fs));
            }
            ucp_request_free(flush);
            flushed = true;
          }
        }
        if (!flushed || ops_in_flight != 0) {
          quiet_since = SteadyClock::time_point::max();
        } else if (quiet_since == SteadyClock::time_point::max()) {
          quiet_since = SteadyClock::now();
        } else if (!closing.empty() && SteadyClock::now() - quiet_since >= kIdleCloseGrace) {
          only_silent_peers_left = true;
          break;
        }
      }
      if (only_silent_peers_left) {
        GKV_LOG_INFO(
            "{} endpoint close(s) left at shutdown: everything was sent, their peers did not "
            "answer the disconnect",
            closing.size());
      } else if (phase == 0 && !settled()) {
        GKV_LOG_WARN("{} connection close(s){} still pending at shutdown; waiting up to 5 s more",
                     closing.size(), flushed ? "" : " and the worker flush");
        deadline = SteadyClock::now() + std::chrono::seconds(5);
      }
    }
    if (!flushed) {
      ucp_request_cancel(worker, flush);
      ucp_request_free(flush);
    }
    if (!settled() && !only_silent_peers_left) {
      GKV_LOG_WARN("{} connection close(s){} still pending at shutdown; abandoned", closing.size(),
                   flushed ? "" : " and the worker flush");
    }
    for (Closing& c : closing) {
      ucp_request_cancel(worker, c.request);
      ucp_request_free(c.request);
      // UCX may still call the endpoint's error handler until the worker is destroyed.
      retired_at_shutdown.push_back(std::move(c.err_arg));
    }
    closing.clear();
    RunDeferred();
    // Every task Post accepted runs: the queue is closed only once it is found empty (a task
    // handed over by another worker, a Send or Receive of this worker's connection, then
    // fails cleanly and completes instead of being dropped). Bounded: tasks that keep posting
    // more are dropped after 1000 rounds.
    for (int round = 0;; ++round) {
      {
        std::lock_guard<std::mutex> lock(post_mu);
        if ((posted.empty() && own_posted.empty()) || round == 1000) {
          post_closed = true;
          break;
        }
      }
      RunPosted();
      RunDeferred();
    }
  }

  void ReapClosed() {
    for (auto c = closing.begin(); c != closing.end();) {
      if (ucp_request_check_status(c->request) != UCS_INPROGRESS) {
        ucp_request_free(c->request);
        c = closing.erase(c);
      } else {
        ++c;
      }
    }
  }

  void CloseInternal(ConnId id, bool force) {
    auto it = conns.find(id);
    if (it == conns.end()) return;
    ucp_ep_h ep = it->second.ep;
    force = force || it->second.failed;
    conn_by_ep.erase(ep);
    // The error handler's argument must outlive the endpoint: it goes when the close is done.
    std::unique_ptr<ErrorArg> err_arg = std::move(it->second.err_arg);
    conns.erase(it);
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    p.flags = force ? UCP_EP_CLOSE_FLAG_FORCE : 0;
    void* req = ucp_ep_close_nbx(ep, &p);
    if (UCS_PTR_IS_PTR(req)) closing.push_back({req, std::move(err_arg)});
    // Close requests are reaped here in normal operation too.
    ReapClosed();
  }
};

// ---------------- Incoming ----------------

Incoming::~Incoming() {
  if (!ucx_data_) return;
  auto* impl = static_cast<UcxTransport::Impl*>(transport_);
  void* data = ucx_data_;
  ucx_data_ = nullptr;
  auto release = [impl, data] { ucp_am_data_release(impl->worker, data); };
  if (tls_driving == impl) {
    release();
  } else {
    std::lock_guard<std::mutex> lock(impl->post_mu);
    // After Stop the worker no longer runs; destroying it frees what it still held.
    if (impl->post_closed) return;
    impl->posted.push_back(release);
    uint64_t one = 1;
    (void)!write(impl->event_fd, &one, sizeof one);
  }
}

void Incoming::SetHeader(const void* data, size_t size) {
  header_size_ = size;
  if (size <= kInlineHeader) {
    if (size > 0) std::memcpy(header_inline_, data, size);
  } else {
    header_heap_.assign(static_cast<const char*>(data), size);
  }
}

// Incoming objects come and go once per message, on the worker thread mostly (a server's
// executor or a client's caller may drop one): a free list per thread keeps up to
// kFreeIncoming of them. The list is intrusive (the next pointer lives in the free block) and
// its owner frees it at thread exit; a block dropped after that goes back to the heap. Under
// AddressSanitizer there is no list, so a use after free is still caught.
namespace {
constexpr int kFreeIncoming = kAddressSanitizer ? 0 : 64;
struct FreeIncoming {
  void* head = nullptr;
  int count = 0;
  ~FreeIncoming();
};
thread_local bool tls_free_incoming_gone = false;  // trivially destructible: readable at exit
thread_local FreeIncoming tls_free_incoming;
FreeIncoming::~FreeIncoming() {
  tls_free_incoming_gone = true;
  while (head != nullptr) {
    void* next = *static_cast<void**>(head);
    ::operator delete(head);
    head = next;
  }
  count = 0;
}
}  // namespace

void* Incoming::operator new(size_t size) {
  if (size == sizeof(Incoming) && !tls_free_incoming_gone) {
    FreeIncoming& fl = tls_free_incoming;
    if (fl.head != nullptr) {
      void* block = fl.head;
      fl.head = *static_cast<void**>(block);
      fl.count--;
      return block;
    }
  }
  return ::operator new(size);
}

void Incoming::operator delete(void* p) {
  if (p == nullptr) return;
  if (!tls_free_incoming_gone) {
    FreeIncoming& fl = tls_free_incoming;
    if (fl.count < kFreeIncoming) {
      *static_cast<void**>(p) = fl.head;
      fl.head = p;
      fl.count++;
      return;
    }
  }
  ::operator delete(p);
}

std::string_view Incoming::payload() const {
  if (ucx_data_ && !rndv_) return {static_cast<const char*>(ucx_data_), length_};
  return copied_;
}

// ---------------- UcxTransport ----------------

UcxTransport::UcxTransport(std::vector<std::unique_ptr<Impl>> workers)
    : workers_(std::move(workers)), impl_(workers_[0].get()) {}

Result<std::unique_ptr<UcxTransport>> UcxTransport::Create(const Options& options,
                                                           Handlers handlers) {
  if (options.workers < 1 || options.workers > kMaxWorkers) {
    return Status::InvalidArgument("workers must be between 1 and " + std::to_string(kMaxWorkers));
  }
  std::vector<std::unique_ptr<Impl>> workers;
  for (int i = 0; i < options.workers; ++i) {
    auto impl = std::make_unique<Impl>();
    impl->index = i;
    impl->options = options;
    // Tuning knob for measurements on shared machines: GKV_BUSY_POLL_US=0 never spins.
    if (const char* env = std::getenv("GKV_BUSY_POLL_US")) {
      impl->options.busy_poll = std::chrono::microseconds(std::strtol(env, nullptr, 10));
    }
    impl->handlers = handlers;
    Status s = impl->Init(i == 0 ? nullptr : workers[0].get());
    workers.push_back(std::move(impl));
    if (!s.ok()) {
      while (workers.size() > 1) workers.pop_back();  // the context's owner goes last
      return s.code() == StatusCode::kInvalidArgument ? s : Status::Unavailable(s.message());
    }
  }
  std::vector<Impl*> all;
  for (auto& w : workers) all.push_back(w.get());
  for (auto& w : workers) w->siblings = all;
  std::unique_ptr<UcxTransport> t(new UcxTransport(std::move(workers)));
  // Each worker thread gets the CUDA device current on the creating thread (the server sets its
  // first GPU before; a client the device its caller uses), with a context: UCX's CUDA
  // transports need one on every thread that progresses a worker, and a process working on
  // GPU 5 should create none on GPU 0.
  const int cuda_device = CudaCurrentDevice();
  for (auto& w : t->workers_) {
    Impl* raw = w.get();
    std::atomic<bool> started{false};
    raw->cuda_device = cuda_device;
    raw->copy_thread = std::make_unique<Impl::CopyThread>(cuda_device);
    raw->thread = std::thread([raw, &started, cuda_device] {
      if (Status cs = CudaBindThread(cuda_device); !cs.ok()) {
        GKV_LOG_WARN("UCX worker thread: no CUDA context on device {}: {}", cuda_device,
                     cs.ToString());
      }
      started.store(true, std::memory_order_release);
      raw->Loop();
    });
    while (!started.load(std::memory_order_acquire)) std::this_thread::yield();
  }
  return t;
}

UcxTransport::~UcxTransport() {
  Stop();
  while (workers_.size() > 1) workers_.pop_back();  // the context's owner goes last
}

void UcxTransport::Stop() {
  if (!impl_->thread.joinable()) return;
  if (workers_.size() > 1) {
    // New connections stay on worker 0 from now on; the hand-offs already made run before the
    // other workers stop (their endpoints are closed by those workers' shutdowns), so no
    // connection request is left unanswered. See Impl::OnConnRequest for the ordering.
    impl_->keep_new_conns.store(true);
    const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(2);
    while (impl_->pending_accepts.load() > 0 && std::chrono::steady_clock::now() < give_up) {
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
    // The other workers first: worker 0 (a node's control thread) outlives them, so what
    // they hand to it during their shutdown still runs.
    for (size_t i = workers_.size() - 1; i >= 1; --i) workers_[i]->StopThread();
  }
  impl_->StopThread();
}

void UcxTransport::Post(std::function<void()> task) {
  PostQuietly(std::move(task));
  Wake();
}

void UcxTransport::PostTo(int worker, std::function<void()> task) {
  if (worker == 0) return Post(std::move(task));
  workers_.at(static_cast<size_t>(worker))->PostTask(std::move(task));
}

int UcxTransport::workers() const { return static_cast<int>(workers_.size()); }

UcxTransport::Impl* UcxTransport::Current() const {
  // The worker this thread drives is alive while it does; it is ours if its first sibling is.
  auto* w = static_cast<Impl*>(const_cast<void*>(tls_driving));
  return w != nullptr && !w->siblings.empty() && w->siblings[0] == impl_ ? w : nullptr;
}

int UcxTransport::CurrentWorker() const {
  const Impl* w = Current();
  return w ? w->index : -1;
}

UcxTransport::Impl* UcxTransport::Owner(ConnId conn) const {
  const size_t i = static_cast<size_t>(WorkerOf(conn));
  return i < workers_.size() ? workers_[i].get() : nullptr;
}

void UcxTransport::PostQuietly(std::function<void()> task) {
  std::lock_guard<std::mutex> lock(impl_->post_mu);
  // After Stop the task is dropped: destroyed when this function returns, outside the lock.
  if (impl_->post_closed) return;
  impl_->posted.push_back(std::move(task));
}

void UcxTransport::PostToOwnThread(std::function<void()> task) {
  {
    std::lock_guard<std::mutex> lock(impl_->post_mu);
    if (impl_->post_closed) return;  // destroyed unrun, as Post's
    impl_->own_posted.push_back(std::move(task));
  }
  Wake();
}

void UcxTransport::Wake() {
  // The loop is responsible now: it listens to the worker's fd again (see caller_drove).
  impl_->caller_drove.store(false, std::memory_order_release);
  uint64_t one = 1;
  (void)!write(impl_->event_fd, &one, sizeof one);
}

bool UcxTransport::TryDrive(const std::function<bool()>& done, std::chrono::microseconds slice) {
  Impl& I = *impl_;
  if (tls_driving == &I) return false;  // the worker thread, or a callback inside a drive
  // UCX's CUDA transports need the worker's CUDA context current on every thread that
  // progresses it: a caller on another device waits for the worker thread instead.
  const bool cuda = I.cuda_device >= 0 && !FakeDeviceMode() && ProbeCuda().usable;
  if (cuda && CudaCurrentDevice() != I.cuda_device) return false;
  if (I.loop_wants_drive.load(std::memory_order_relaxed)) return false;
  std::unique_lock<std::timed_mutex> drive(I.drive_mu, std::try_to_lock);
  if (!drive.owns_lock()) {
    // The loop is in a pass (or busy-polling, which it stops while a caller waits); another
    // caller's slice is at most as long as it is willing to wait for. System clock: see Loop.
    I.callers_waiting.fetch_add(1, std::memory_order_relaxed);
    drive.try_lock_until(std::chrono::system_clock::now() + Impl::kCallerPatience);
    I.callers_waiting.fetch_sub(1, std::memory_order_relaxed);
  }
  if (!drive.owns_lock() || I.shut_down || I.stopping.load(std::memory_order_acquire)) {
    return false;
  }
  // The device is the caller's current one already; this makes its context current once per
  // thread (cudaFree(nullptr)), changing nothing else for the caller.
  static thread_local int context_device = -1;
  if (cuda && context_device != I.cuda_device) {
    if (!CudaBindThread(I.cuda_device).ok()) return false;
    context_device = I.cuda_device;
  }
  const void* outer = tls_driving;
  const void* outer_caller = tls_caller_driving;
  tls_driving = &I;
  tls_caller_driving = &I;
  const bool was_progress_thread = SetOnProgressThread(true);
  I.DriveSlice(done, slice);
  SetOnProgressThread(was_progress_thread);
  tls_caller_driving = outer_caller;
  tls_driving = outer;
  return true;
}

bool UcxTransport::DrivenByCaller() const { return tls_caller_driving == impl_; }

bool UcxTransport::IsLoopbackHost(const std::string& host) {
  return host == "localhost" || host == "::1" || host == "[::1]" || host.rfind("127.", 0) == 0;
}

std::string UcxTransport::ucx_version() { return ucp_get_version_string(); }

bool UcxTransport::CanMoveDeviceMemory() {
  if (FakeDeviceKind() == FakeDevice::kMovedByUcx) return true;
  ucp_config_t* config = nullptr;
  if (ucp_config_read(nullptr, nullptr, &config) != UCS_OK) return false;
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES;
  params.features = UCP_FEATURE_AM;
  ucp_context_h context = nullptr;
  const ucs_status_t st = ucp_init(&params, config, &context);
  ucp_config_release(config);
  if (st != UCS_OK) return false;
  ucp_context_attr_t attr{};
  attr.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES;
  const bool cuda = ucp_context_query(context, &attr) == UCS_OK &&
                    (attr.memory_types & UCS_BIT(UCS_MEMORY_TYPE_CUDA)) != 0;
  ucp_cleanup(context);
  return cuda;
}

std::string UcxTransport::Describe() const {
  std::string d =
      "UCX " + ucx_version() + ", moves CUDA memory: " + (device_memory_supported() ? "yes" : "no");
  const RegistrationStats r = registration_stats();
  if (r.regions > 0) {
    d += "; registered: " + std::to_string(r.regions) +
         (r.regions == 1 ? " region, " : " regions, ") + FormatSize(r.bytes);
  }
  return d;
}

Status UcxTransport::RegisterMemory(void* base, size_t size, MemoryKind kind) {
  Impl& I = *impl_;
  if (tls_driving == impl_) return I.RegisterEverywhere(base, size, kind);
  // Wait for the worker. The task may be dropped unrun (the transport stopping): the guard it
  // owns answers then, when the task is destroyed.
  struct Waiter {
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
    Status status;
    void Finish(Status s) {
      std::lock_guard<std::mutex> lock(mu);
      if (done) return;
      done = true;
      status = std::move(s);
      cv.notify_all();
    }
  };
  struct Guard {
    std::shared_ptr<Waiter> waiter;
    ~Guard() {
      if (waiter) waiter->Finish(Status::Unavailable("the transport is stopping"));
    }
  };
  auto waiter = std::make_shared<Waiter>();
  auto guard = std::make_shared<Guard>();
  guard->waiter = waiter;
  Post([&I, guard, base, size, kind] {
    guard->waiter->Finish(I.RegisterEverywhere(base, size, kind));
  });
  guard.reset();
  std::unique_lock<std::mutex> lock(waiter->mu);
  waiter->cv.wait(lock, [&] { return waiter->done; });
  return waiter->status;
}

const std::vector<Status>& UcxTransport::initial_registrations() const {
  return impl_->initial_registrations;
}

UcxTransport::RegistrationStats UcxTransport::registration_stats() const {
  RegistrationStats r;
  r.regions = impl_->registered_regions.load(std::memory_order_relaxed);
  r.bytes = impl_->registered_bytes.load(std::memory_order_relaxed);
  for (const auto& w : workers_) {
    r.registered_ops += w->registered_ops.load(std::memory_order_relaxed);
  }
  return r;
}

bool UcxTransport::device_memory_supported() const { return impl_->cuda_supported; }
uint16_t UcxTransport::listen_port() const { return impl_->bound_port; }
size_t UcxTransport::max_header_size() const { return impl_->max_header; }
bool UcxTransport::OnWorkerThread() const { return Current() != nullptr; }

Result<ConnId> UcxTransport::Connect(const std::string& host, uint16_t port) {
  Impl* current = Current();
  Impl& I = current ? *current : *impl_;
  // Stopping: Shutdown closes the connections it found; one opened now (a peer call posted
  // meanwhile) would still be wiring up when the worker goes.
  if (I.stopping.load(std::memory_order_acquire)) {
    return Status::Unavailable("the transport is stopping");
  }
  sockaddr_storage addr{};
  socklen_t len = 0;
  GKV_RETURN_IF_ERROR(ResolveAddress(host, port, &addr, &len));
  const ConnId id = I.NewConnId();
  Impl::Conn& c = I.conns[id];
  c.err_arg.reset(new Impl::ErrorArg{&I, id});
  ucp_ep_params_t ep{};
  ep.field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR |
                  UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER;
  ep.flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
  ep.sockaddr.addr = reinterpret_cast<const sockaddr*>(&addr);
  ep.sockaddr.addrlen = len;
  ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  ep.err_handler.cb = &Impl::OnEpError;
  ep.err_handler.arg = c.err_arg.get();
  ucs_status_t st = ucp_ep_create(I.worker, &ep, &c.ep);
  if (st != UCS_OK) {
    I.conns.erase(id);
    return FromUcs(st, "connecting to " + host + ":" + std::to_string(port));
  }
  I.conn_by_ep[c.ep] = id;
  return id;
}

bool UcxTransport::IsOpen(ConnId conn) const {
  const Impl* owner = Owner(conn);
  if (owner == nullptr) return false;
  if (workers_.size() > 1 && owner != Current()) return true;  // see the header
  auto it = owner->conns.find(conn);
  return it != owner->conns.end() && !it->second.failed;
}

std::string UcxTransport::Transports(ConnId conn) const {
  const Impl* owner = Owner(conn);
  if (owner == nullptr || (workers_.size() > 1 && owner != Current())) return "";
  auto it = owner->conns.find(conn);
  if (it == owner->conns.end() || it->second.failed) return "";
  ucp_transport_entry_t entries[16];
  const unsigned n = Impl::QueryLanes(it->second.ep, entries);
  std::string out;
  for (unsigned i = 0; i < n; ++i) {
    const std::string one =
        std::string(entries[i].transport_name ? entries[i].transport_name : "?") + "/" +
        (entries[i].device_name ? entries[i].device_name : "?");
    // One entry per lane: names repeat. Whole names compared ("tcp/eth1" is not "tcp/eth10").
    if ((" " + out + " ").find(" " + one + " ") != std::string::npos) continue;
    if (!out.empty()) out += ' ';
    out += one;
  }
  return out;
}

void UcxTransport::Send(ConnId conn, unsigned am_id, std::string_view header, const void* payload,
                        size_t size, MemoryKind kind, std::function<void(Status)> done) {
  Impl* owner = Owner(conn);
  Impl* current = Current();
  if (owner == nullptr) {
    done(Status::Unavailable("connection is closed"));
    return;
  }
  if (current != nullptr && current != owner) {
    // Another worker's connection: sent from its thread (the header copied now, as the
    // contract allows its buffer's reuse), completed back on this one.
    auto hop = [this, conn, am_id, h = std::string(header), payload, size, kind, current,
                done]() mutable {
      Send(conn, am_id, h, payload, size, kind, Impl::CompleteOn(current, done));
    };
    if (!owner->PostTask(std::move(hop))) done(Status::Unavailable("the transport is stopping"));
    return;
  }
  Impl& I = *owner;
  ucp_ep_h ep = I.SendableEp(conn, header.size(), done);
  if (ep == nullptr) return;
  if (kind == MemoryKind::kDevice && !I.cuda_supported) {
    done(Status::NotSupported("this UCX cannot send device memory; stage through host memory"));
    return;
  }
  if (Status ks = CheckMemoryKind(payload, size, kind); !ks.ok()) {  // fake-device mode only
    done(ks);
    return;
  }
  Impl::Op* op = I.NewOp(std::move(done));
  ucp_request_param_t p = Impl::SendParams(op);
  if (kind == MemoryKind::kDevice && !I.fake_device_memory) {
    p.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMORY_TYPE;
    p.memory_type = UCS_MEMORY_TYPE_CUDA;
  }
  I.AttachRegistration(payload, size, &p);
  void* req =
      ucp_am_send_nbx(ep, am_id, header.data(), header.size(), size ? payload : nullptr, size, &p);
  I.Started(op, req, "send");
}

void UcxTransport::SendGather(ConnId conn, unsigned am_id, std::string_view header,
                              std::vector<Segment> segments, std::function<void(Status)> done) {
  Impl* owner = Owner(conn);
  Impl* current = Current();
  if (owner == nullptr) {
    done(Status::Unavailable("connection is closed"));
    return;
  }
  if (current != nullptr && current != owner) {  // as Send's
    auto hop = [this, conn, am_id, h = std::string(header), segments = std::move(segments), current,
                done]() mutable {
      SendGather(conn, am_id, h, std::move(segments), Impl::CompleteOn(current, done));
    };
    if (!owner->PostTask(std::move(hop))) done(Status::Unavailable("the transport is stopping"));
    return;
  }
  Impl& I = *owner;
  ucp_ep_h ep = I.SendableEp(conn, header.size(), done);
  if (ep == nullptr) return;
  // Over shared memory UCX gathers the segments itself, and that measured faster than copying
  // them into one buffer first (bench/mget_ab.sh); over a network transport UCX's
  // protocols offer zero-copy rendezvous (tcp's, RDMA's) for one contiguous buffer only, and
  // there the copy measured faster: the segments are copied into one buffer here.
  // Small segments (under kMinGatherAverage on average, e.g. a batch of embeddings) are joined
  // too: UCX's cost per iov entry then outweighs the copy.
  size_t used = 0;
  size_t total = 0;
  for (const Segment& s : segments) {
    used += s.size > 0 ? 1 : 0;
    total += s.size;
  }
  if (used > 1 && (total / used < Impl::kMinGatherAverage || !I.OverSharedMemory(ep))) {
    auto join = [segments = std::move(segments), total] {
      auto whole = std::make_shared<std::string>();
      whole->reserve(total);
      for (const Segment& s : segments) whole->append(static_cast<const char*>(s.data), s.size);
      return whole;
    };
    if (total <= Impl::kInlineJoin) {
      auto whole = join();
      Send(conn, am_id, header, whole->data(), whole->size(), MemoryKind::kHost,
           [whole, done = std::move(done)](Status s) { done(s); });
      return;
    }
    // A large one is joined on the copy thread, not on this worker's.
    I.ops_in_flight++;
    I.copy_thread->Submit([this, &I, conn, am_id, h = std::string(header), join = std::move(join),
                           done = std::move(done)]() mutable {
      auto whole = join();
      I.PostTask([this, &I, conn, am_id, h = std::move(h), whole, done = std::move(done)] {
        I.ops_in_flight--;
        Send(conn, am_id, h, whole->data(), whole->size(), MemoryKind::kHost,
             [whole, done](Status s) { done(s); });
      });
    });
    return;
  }
  Impl::Op* op = I.NewOp(std::move(done));
  for (const Segment& s : segments) {
    if (s.size > 0) op->iov.push_back({const_cast<void*>(s.data), s.size});
  }
  ucp_request_param_t p = Impl::SendParams(op);
  void* buffer = nullptr;
  size_t count = 0;
  if (!op->iov.empty()) {
    p.op_attr_mask |= UCP_OP_ATTR_FIELD_DATATYPE;
    p.datatype = ucp_dt_make_iov();
    buffer = op->iov.data();
    count = op->iov.size();  // with the iov datatype: the number of entries
  }
  void* req = ucp_am_send_nbx(ep, am_id, header.data(), header.size(), buffer, count, &p);
  I.Started(op, req, "send");
}

void UcxTransport::Receive(std::unique_ptr<Incoming> msg, void* dst, MemoryKind kind,
                           std::function<void(Status)> done) {
  Impl* owner = static_cast<Impl*>(msg->transport_);
  Impl* current = Current();
  if (current != nullptr && current != owner) {
    // The message came on another worker: received there, completed back on this one.
    // (A task dropped unrun at Stop frees the message with the holder.)
    auto held = std::make_shared<std::unique_ptr<Incoming>>(std::move(msg));
    auto hop = [this, held, dst, kind, current, done]() mutable {
      Receive(std::move(*held), dst, kind, Impl::CompleteOn(current, done));
    };
    if (!owner->PostTask(std::move(hop))) done(Status::Unavailable("the transport is stopping"));
    return;
  }
  Impl& I = *owner;
  if (Status ks = CheckMemoryKind(dst, msg->length_, kind); !ks.ok()) {  // fake-device mode only
    done(ks);
    return;
  }
  if (!msg->rndv_) {
    if (kind == MemoryKind::kDevice && msg->payload_size() > 0) {
      // Off the worker thread; the message (which may hold UCX's buffer) lives until the copy
      // is done and goes on the worker thread with the completion.
      // The bytes are copied out first (an eager payload is small) and the message goes here,
      // on the worker: the job never touches a buffer UCX owns.
      const std::string_view data = msg->payload();
      auto owned = std::make_shared<std::string>(data.data(), data.size());
      msg.reset();
      I.ops_in_flight++;
      I.copy_thread->Submit([&I, owned, dst, done = std::move(done)]() mutable {
        Status s = CudaCopySync(dst, owned->data(), owned->size());
        I.PostTask([&I, done = std::move(done), s]() {
          I.ops_in_flight--;
          done(s);
        });
      });
      return;
    }
    std::string_view data = msg->payload();
    if (!data.empty()) std::memcpy(dst, data.data(), data.size());
    done(Status::OK());
    return;
  }
  if (kind == MemoryKind::kDevice && !I.cuda_supported) {
    done(Status::NotSupported("this UCX cannot receive into device memory"));
    return;
  }
  void* desc = msg->ucx_data_;
  msg->ucx_data_ = nullptr;  // the descriptor is consumed by the receive
  Impl::Op* op = I.NewOp(std::move(done));
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  p.cb.recv_am = &Impl::OnRecvDone;
  p.user_data = op;
  if (kind == MemoryKind::kDevice && !I.fake_device_memory) {
    p.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMORY_TYPE;
    p.memory_type = UCS_MEMORY_TYPE_CUDA;
  }
  I.AttachRegistration(dst, msg->length_, &p);
  void* req = ucp_am_recv_data_nbx(I.worker, desc, dst, msg->length_, &p);
  I.Started(op, req, "receive");
}

void UcxTransport::Close(ConnId conn, bool force) {
  Impl* owner = Owner(conn);
  if (owner == nullptr) return;
  Impl* current = Current();
  if (current != nullptr && current != owner) {
    owner->PostTask([owner, conn, force] { owner->CloseInternal(conn, force); });
    return;
  }
  owner->CloseInternal(conn, force);
}

}  // namespace gkv
