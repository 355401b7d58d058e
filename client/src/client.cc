#include "gkv/client.h"

#include "client_impl.h"

namespace gkv {

Client::Client(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Client::~Client() {
  Impl* I = impl_.get();
  I->watcher.reset();  // no view is posted after this
  std::promise<void> drained;
  I->transport->Post([I, &drained] {
    I->closing = true;
    for (size_t n = 0; n < I->nodes.size(); ++n) {
      I->FailNode(static_cast<int>(n), Status::Aborted("client closed"), true);
    }
    // Calls waiting to be asked again (a WrongNode or failed-node retry, a batch's hedge) are
    // asked now: every request fails at once, so each gets its answer and adds no timer.
    I->RunTimers(Clock::time_point::max());
    drained.set_value();
  });
  drained.get_future().wait();
  // Every put has ended (failed, if nothing else), so each staging thread stops at its next
  // piece. What they posted last runs on the I/O thread before the transport goes (and may run
  // a caller's callback, which must still find the transport).
  I->JoinStagingThreads();
  std::promise<void> flushed;
  I->transport->Post([&flushed] { flushed.set_value(); });
  flushed.get_future().wait();
  // Transfers still in flight (a streamed piece, a payload on the caller's memory) complete
  // while the transport stops, and so do the calls they held: their callbacks run on the I/O
  // thread and still find `transport` (OnIoThread asks it), so it is stopped before it goes.
  I->transport->Stop();
  I->transport.reset();
}

Result<std::unique_ptr<Client>> Client::Open(const ClientOptions& options) {
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  if (!options.cluster_file.empty()) {
    GKV_ASSIGN_OR_RETURN(impl->cluster, LoadClusterFile(options.cluster_file));
  } else {
    impl->cluster = options.cluster;
  }
  if (options.replicas < 1) return Status::InvalidArgument("replicas must be at least 1");
  // The cluster file's `replicas:` unless the caller chose (ClientOptions::replicas != 1).
  if (options.replicas == 1) impl->options.replicas = std::max(1, impl->cluster.replicas);
  const bool elastic = impl->cluster.membership == ClusterConfig::Membership::kEtcd;
  MembershipView first;
  if (elastic) {
    // One reading now (a client needs a ring to start), then the watch keeps it current.
    Impl* raw = impl.get();
    auto w = MembershipWatcher::Start(impl->cluster.etcd, [raw](const MembershipView& v) {
      std::lock_guard<std::mutex> lock(raw->transport_mu);
      if (raw->transport) raw->transport->Post([raw, v] { raw->ApplyView(v); });
    });
    if (!w.ok()) return w.status().WithContext("reading the cluster's members from etcd");
    impl->watcher = std::move(*w);
    first = impl->watcher->Current();
    impl->nodes = first.RingNodes();
  } else {
    if (impl->cluster.nodes.empty()) return Status::InvalidArgument("the cluster has no nodes");
    impl->nodes = impl->cluster.nodes;
  }
  impl->node_conn.assign(impl->nodes.size(), 0);
  impl->health.assign(impl->nodes.size(), {});
  impl->copies_avoided_until.assign(impl->nodes.size(), {});
  {
    std::vector<int> slots(impl->nodes.size());
    for (size_t i = 0; i < slots.size(); ++i) slots[i] = static_cast<int>(i);
    auto route = std::make_shared<Impl::Routing>();
    route->ring = std::make_shared<RingView>(elastic ? first.epoch : 0, impl->nodes,
                                             std::move(slots), impl->nodes.size());
    route->handoff = !first.handoffs_running.empty();
    impl->routing = std::move(route);
  }
  Impl* raw = impl.get();
  UcxTransport::Handlers handlers;
  handlers.on_message = [raw](std::unique_ptr<Incoming> m) { raw->OnMessage(std::move(m)); };
  handlers.on_disconnect = [raw](ConnId c, const Status& s) { raw->OnDisconnect(c, s); };
  handlers.on_tick = [raw] { raw->OnTick(); };
  // With no request awaiting its reply, the loop may leave the worker's events to synchronous
  // callers that drive it (see Impl::Await).
  handlers.idle = [raw] { return raw->pending.empty(); };
  UcxTransport::Options topts;
  topts.poll_interval = std::chrono::milliseconds(1);
  // A static cluster all on this host: no UCX interface of this client listens elsewhere.
  topts.loopback_only = !elastic && !impl->nodes.empty() &&
                        std::all_of(impl->nodes.begin(), impl->nodes.end(), [](const NodeInfo& n) {
                          return UcxTransport::IsLoopbackHost(n.host);
                        });
  {
    auto t = UcxTransport::Create(topts, std::move(handlers));
    if (!t.ok()) return t.status();
    std::lock_guard<std::mutex> lock(impl->transport_mu);
    impl->transport = std::move(*t);
  }
  if (elastic) {
    // Changes seen while the transport was starting.
    MembershipView now = impl->watcher->Current();
    Impl* raw = impl.get();
    impl->transport->Post([raw, now] { raw->ApplyView(now); });
  }
  GKV_LOG_INFO("client of {} nodes ready{} ({})", impl->nodes.size(),
               elastic ? fmt::format(" (etcd, ring epoch {})", first.epoch) : std::string(),
               impl->transport->Describe());
  return std::unique_ptr<Client>(new Client(std::move(impl)));
}

const ClusterConfig& Client::cluster() const { return impl_->cluster; }
int Client::NodeFor(std::string_view key) const { return impl_->Route()->ring->Owner(key); }

std::vector<int> Client::RingMembers() const {
  const RingPtr ring = impl_->Route()->ring;
  std::vector<int> members;
  for (size_t p = 0; p < ring->size(); ++p) members.push_back(ring->slot(p));
  return members;
}

std::vector<NodeInfo> Client::Nodes() const {
  std::lock_guard<std::mutex> lock(impl_->nodes_mu);
  return impl_->nodes;
}

uint64_t Client::RingEpoch() const { return impl_->Route()->ring->epoch(); }

// Queues the get of `key` into a buffer of its own: for the I/O thread (Post), or for a
// synchronous caller that drives the transport itself (Submit and Await).
void Client::Impl::QueueGet(std::string_view key, const GetOptions& o,
                            std::function<void(Result<Value>)> callback, bool synchronous) {
  const auto deadline = DeadlineFrom(o.timeout);
  const bool fail_open = o.fail_open;
  Enqueue(Pooled([this, key = std::string(key), deadline, fail_open,
                  cb = std::move(callback)]() mutable {
            DoGet(std::move(key), nullptr, 0, MemoryKind::kHost, deadline, fail_open,
                  std::move(cb));
          }),
          synchronous);
}

void Client::GetAsync(std::string_view key, const GetOptions& o,
                      std::function<void(Result<Value>)> callback) {
  impl_->QueueGet(key, o, impl_->OnIoThread(std::move(callback)), false);
}

std::future<Result<Value>> Client::GetAsync(std::string_view key, const GetOptions& o) {
  auto promise = std::make_shared<std::promise<Result<Value>>>();
  auto future = promise->get_future();
  impl_->QueueGet(
      key, o, [promise](Result<Value> r) { promise->set_value(std::move(r)); }, false);
  return future;
}

Result<Value> Client::Get(std::string_view key, const GetOptions& o) {
  SyncSlot<Result<Value>> outcome;
  impl_->QueueGet(
      key, o, [&outcome](Result<Value> r) { outcome.Set(std::move(r)); }, true);
  return impl_->Await(outcome);
}

Result<ValueInfo> Client::GetInto(std::string_view key, void* dst, size_t capacity,
                                  const GetOptions& o) {
  Impl* I = impl_.get();
  // A null buffer holds no bytes: it receives a 0-byte value, anything larger is refused as too
  // small (a null destination means "allocate" only inside Get).
  static std::byte no_buffer;
  if (dst == nullptr) {
    if (capacity != 0) return Status::InvalidArgument("null buffer with a nonzero capacity");
    dst = &no_buffer;
  }
  const MemoryKind kind = Resolve(o.memory, dst);
  // Nothing still reading the destination when the bytes land (see PutOptions).
  if (kind == MemoryKind::kDevice) GKV_RETURN_IF_ERROR(CudaSyncStream(o.cuda_stream, dst));
  auto deadline = I->DeadlineFrom(o.timeout);
  if (I->NeedsStaging(kind) && capacity > I->options.pipeline_threshold) {
    auto piped = I->PipelinedGetInto(std::string(key), dst, capacity, o, deadline);
    if (piped) return std::move(*piped);
  }
  SyncSlot<Result<Value>> outcome;
  I->Submit(Pooled([&, key = std::string(key)]() mutable {
    I->DoGet(
        std::move(key), dst, capacity, kind, deadline, o.fail_open,
        [&outcome](Result<Value> r) { outcome.Set(std::move(r)); }, o.accept);
  }));
  Result<Value> r = I->Await(outcome);
  if (!r.ok()) return r.status();
  // Staged through a pinned buffer (a device buffer this UCX cannot receive into): the copy to
  // the device runs here, on the caller's thread, on this client's stream for that device.
  if (r->data() != nullptr && r->size() > 0) {
    GKV_RETURN_IF_ERROR(I->DeviceCopy(dst, r->data(), r->size(), dst));
    // Staged through ordinary memory (the pool had no buffer to spare on the I/O thread): one
    // for this size goes into the pool now, off that thread.
    if (!r->staged_) I->staging_pool->Warm(r->size());
  }
  return r->info();
}

// Stages a device buffer where needed and queues the put: for the I/O thread, or for a
// synchronous caller (see QueueGet). An error found here is the callback's, on this thread.
void Client::Impl::QueuePut(std::string_view key, const void* data, size_t size,
                            const PutOptions& o, std::function<void(Result<uint64_t>)> callback,
                            bool synchronous) {
  Impl* I = this;
  // Refused here, with the reason, rather than sent and answered protocol_error.
  if (Status vs = o.tensor.Validate(size); !vs.ok()) return callback(vs);
  MemoryKind kind = Resolve(o.memory, data);
  std::shared_ptr<std::byte[]> staging;
  if (kind == MemoryKind::kDevice) {
    // The producer's work on the buffer is done before anything reads it (see PutOptions).
    if (Status ss = CudaSyncStream(o.cuda_stream, data); !ss.ok()) return callback(ss);
  }
  // Stage device bytes through pinned memory (this UCX can't read device memory): a large value
  // with one replica piece by piece, pipelined (a streamed put: StreamPutOnNode), anything else
  // whole, here, once for all its replicas.
  const bool pipelined = size > I->options.pipeline_threshold && I->options.replicas == 1;
  if (I->NeedsStaging(kind) && !pipelined) {
    auto staged = I->staging_pool->Acquire(size);
    if (!staged.ok()) return callback(staged.status());
    staging = std::move(*staged);
    Status s = I->DeviceCopy(staging.get(), data, size, data);
    if (!s.ok()) return callback(s);
    data = staging.get();
    kind = MemoryKind::kHost;
  }
  auto deadline = I->DeadlineFrom(o.timeout);
  Enqueue(Pooled([I, key = std::string(key), data, size, kind, staging, o, deadline,
                  cb = std::move(callback)]() mutable {
            I->DoPut(std::move(key), data, size, kind, staging, o, deadline, std::move(cb));
          }),
          synchronous);
}

void Client::PutAsync(std::string_view key, const void* data, size_t size, const PutOptions& o,
                      std::function<void(Result<uint64_t>)> callback) {
  impl_->QueuePut(key, data, size, o, impl_->OnIoThread(std::move(callback)), false);
}

std::future<Result<uint64_t>> Client::PutAsync(std::string_view key, const void* data, size_t size,
                                               const PutOptions& o) {
  auto promise = std::make_shared<std::promise<Result<uint64_t>>>();
  auto future = promise->get_future();
  impl_->QueuePut(
      key, data, size, o, [promise](Result<uint64_t> r) { promise->set_value(std::move(r)); },
      false);
  return future;
}

Result<uint64_t> Client::Put(std::string_view key, const void* data, size_t size,
                             const PutOptions& o) {
  SyncSlot<Result<uint64_t>> outcome;
  impl_->QueuePut(
      key, data, size, o, [&outcome](Result<uint64_t> r) { outcome.Set(std::move(r)); }, true);
  return impl_->Await(outcome);
}

Status Client::Delete(std::string_view key, std::chrono::milliseconds timeout) {
  Impl* I = impl_.get();
  const auto deadline = I->DeadlineFrom(timeout);
  // A previous owner that deleted the key (on this attempt, or on one the owner refused as
  // misrouted) makes the owner's NotFound an OK: the key existed, and this call deleted it.
  bool deleted_before = false;
  for (;;) {
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    Status s = DeleteOnce(key, std::max(left, std::chrono::milliseconds(1)), &deleted_before);
    if (s.code() == StatusCode::kNotFound && deleted_before) return Status::OK();
    if (!Impl::Misrouted(s) || Clock::now() + Impl::kWrongNodeRetry >= deadline) return s;
    std::this_thread::sleep_for(Impl::kWrongNodeRetry);
  }
}

Status Client::DeleteOnce(std::string_view key, std::chrono::milliseconds timeout,
                          bool* deleted_before) {
  Impl* I = impl_.get();
  // Shared with the I/O thread, which may finish every replica's request (a node that is down
  // fails at once) before its loop over them is done: nothing it touches may live on this
  // caller's stack.
  struct Call {
    std::vector<int> nodes;
    std::vector<Status> results;
    size_t remaining = 0;
    SyncSlot<bool> all;  // set when every node has answered or failed
  };
  auto call = std::make_shared<Call>();
  auto route = I->Route();
  call->nodes = route->ring->Owners(key, I->options.replicas);
  if (call->nodes.empty()) return Status::Unavailable("the ring has no members");
  // Keys may be moving: the previous owners delete their copies too, or a read's fallback to
  // them (and their handoff) could bring the deleted value back.
  const size_t first_previous = call->nodes.size();
  if (route->Moving()) {
    for (int n : route->PreviousOwners(key, I->options.replicas, call->nodes)) {
      call->nodes.push_back(n);
    }
  }
  call->results.resize(call->nodes.size());
  call->remaining = call->nodes.size();
  // Replicated: the delete's version, so that no node takes a repair or handoff of an older
  // version of the key after it (each remembers the delete a while).
  const uint64_t version = call->nodes.size() > 1 ? I->write_clock.Take() : 0;
  std::string body = w::EncodeKeyRequest(key);
  if (version != 0) w::AppendVersion(&body, version);
  I->Submit([I, call, first_previous, body = std::move(body), version,
             deadline = I->DeadlineFrom(timeout)] {
    const uint16_t versioned = version != 0 ? w::kFlagClientVersion : uint16_t{0};
    for (size_t i = 0; i < call->nodes.size(); ++i) {
      auto finish = [call, i](Status s) {
        call->results[i] = s;
        if (--call->remaining == 0) call->all.Set(true);
      };
      auto on_reply = [I, finish](const Impl::PendingPtr& p, std::unique_ptr<Incoming> msg) {
        Status s = ParseReply(*msg, [&](std::string_view body, w::ReplyStatus* rs) {
          return w::DecodeStatusReply(body, rs);
        });
        I->Complete(p, [finish, s] { finish(s); });
      };
      I->Issue(call->nodes[i], w::Opcode::kDelete,
               versioned | (i >= first_previous ? w::kFlagPreviousOwner : uint16_t{0}), body,
               nullptr, 0, MemoryKind::kHost, deadline, on_reply, finish);
    }
  });
  I->Await(call->all);
  // Sent to every replica; the primary's answer is the outcome (as for Put), unless another
  // current owner did not confirm it (a miss there confirms it): the delete is acknowledged
  // only when no current owner may still serve the value. A key not yet handed to its new
  // owner was deleted where it still was.
  for (size_t i = first_previous; i < call->nodes.size(); ++i) {
    if (call->results[i].ok()) *deleted_before = true;
  }
  const Status& primary = call->results[0];
  if (primary.ok() || primary.code() == StatusCode::kNotFound) {
    Status decided;
    for (size_t i = 1; i < first_previous; ++i) {
      const Status& r = call->results[i];
      if (r.code() == StatusCode::kNotFound) continue;  // a miss confirms a delete
      decided = Impl::Deciding(decided, I->ReplicaFailed(call->nodes[i], r));
    }
    if (!decided.ok()) {
      // Asked again (misrouted), the primary will miss the key this call deleted.
      if (primary.ok()) *deleted_before = true;
      return decided;
    }
  }
  return primary;
}

Result<ValueInfo> Client::Stat(std::string_view key, std::chrono::milliseconds timeout) {
  Impl* I = impl_.get();
  const auto deadline = I->DeadlineFrom(timeout);
  auto left_now = [&] { return TimeLeft(deadline); };
  for (;;) {
    auto route = I->Route();
    auto r = StatOnce(key, route->ring->Owner(key), 0, left_now());
    const bool owner_failed = !r.ok() && Impl::NodeFailure(r.status());
    // A failed owner is failed over as a get is (OnGetAnswer): the key's next owners are
    // asked in order, and the first answer that is not itself a node failure stands.
    if (owner_failed && I->options.replicas > 1) {
      const std::vector<int> owners = route->ring->Owners(key, I->options.replicas);
      for (size_t i = 1; i < owners.size() && Clock::now() < deadline; ++i) {
        auto next = StatOnce(key, owners[i], 0, left_now());
        if (!next.ok() && Impl::NodeFailure(next.status())) continue;
        r = std::move(next);
        break;
      }
    }
    // Keys may be moving: a miss is asked of the previous owners too, and then of the owner
    // once more (the key may have moved between the questions: see GetFrom).
    if (!r.ok() && r.status().code() == StatusCode::kNotFound && route->Moving()) {
      const int owner = route->ring->Owner(key);
      std::vector<int> others;  // the key's other owners, then its previous owners
      for (int n : route->ring->Owners(key, I->options.replicas)) {
        if (n != owner) others.push_back(n);
      }
      const size_t first_previous = others.size();
      for (int n : route->PreviousOwners(key, 1, {owner})) others.push_back(n);
      for (size_t i = 0; i < others.size(); ++i) {
        auto p =
            StatOnce(key, others[i], i >= first_previous ? w::kFlagPreviousOwner : 0, left_now());
        if (p.ok()) return p;
      }
      // The owner once more, unless it just failed (asked again, it would turn a miss into
      // its failure and spend what is left of the deadline).
      if (!owner_failed) r = StatOnce(key, owner, w::kFlagLastResort, left_now());
    }
    if (r.ok() || !Impl::Misrouted(r.status()) ||
        Clock::now() + Impl::kWrongNodeRetry >= deadline) {
      return r;
    }
    std::this_thread::sleep_for(Impl::kWrongNodeRetry);
  }
}

Result<ValueInfo> Client::StatOnce(std::string_view key, int node, uint16_t flags,
                                   std::chrono::milliseconds timeout) {
  Impl* I = impl_.get();
  auto deadline = I->DeadlineFrom(timeout);
  SyncSlot<Result<ValueInfo>> outcome;
  I->Submit([&, key = std::string(key)] {
    auto on_reply = [I, &outcome](const Impl::PendingPtr& p, std::unique_ptr<Incoming> msg) {
      w::ObjectMeta meta;
      Status s = ParseReply(*msg, [&](std::string_view body, w::ReplyStatus* rs) {
        return w::DecodeObjectReply(body, rs, &meta);
      });
      if (!s.ok()) return I->Fail(p, s);
      I->Complete(p, [&outcome, meta] { outcome.Set(ToInfo(meta)); });
    };
    I->Issue(node, w::Opcode::kStat, flags, w::EncodeKeyRequest(key), nullptr, 0, MemoryKind::kHost,
             deadline, on_reply, [&outcome](Status s) { outcome.Set(s); });
  });
  return I->Await(outcome);
}

std::vector<Result<Value>> Client::MultiGet(const std::vector<std::string>& keys,
                                            const GetOptions& o) {
  Impl* I = impl_.get();
  std::vector<Result<Value>> results;
  results.reserve(keys.size());
  for (size_t i = 0; i < keys.size(); ++i) results.emplace_back(Status::Aborted("not sent"));
  if (keys.empty()) return results;
  // The caller waits in ReadBatch, so the batch may point at its keys and results.
  auto batch = std::make_shared<Impl::BatchRead>();
  batch->keys = &keys;
  batch->deadline = I->DeadlineFrom(o.timeout);
  batch->row = [&results](size_t i, const Status& s, const w::ObjectMeta* meta, const char* bytes) {
    if (!s.ok()) {
      results[i] = s;
      return;
    }
    Value v;
    v.info_ = ToInfo(*meta);
    v.bytes_.reset(new std::byte[v.info_.size ? v.info_.size : 1]);
    std::memcpy(v.bytes_.get(), bytes, v.info_.size);
    results[i] = std::move(v);
  };
  // Rows whose node failed, or that a node refused as misrouted, or that missed while keys may
  // be moving, go on to their other places in batches (ReadBatch).
  I->ReadBatch(batch, o.fail_open);
  return results;
}

std::vector<Result<uint64_t>> Client::MultiPut(const std::vector<PutItem>& items,
                                               const PutOptions& o) {
  Impl* I = impl_.get();
  // Shared with the I/O thread (see Delete).
  struct Batch {
    std::vector<Result<uint64_t>> results;
    std::vector<bool> failed_here;             // refused before sending (staging failed)
    std::vector<int> primary;                  // the node whose answer is the item's outcome
    std::vector<Status> replica_failure;       // the first other owner that did not take it
    std::vector<std::vector<size_t>> by_node;  // indices into items, grouped by node
    std::vector<std::shared_ptr<std::string>> payloads;
    int remaining = 0;
    std::promise<void> all_done;
  };
  auto batch = std::make_shared<Batch>();
  batch->results.assign(items.size(), Status::Aborted("not sent"));
  batch->failed_here.assign(items.size(), false);
  if (items.empty()) return std::move(batch->results);
  batch->primary.resize(items.size());
  batch->replica_failure.resize(items.size());
  const RingPtr ring = I->Route()->ring;
  for (size_t i = 0; i < items.size(); ++i) {
    batch->primary[i] = ring->Owner(items[i].key);
    if (batch->primary[i] < 0) {
      batch->results[i] = Status::Unavailable("the ring has no members");
      batch->failed_here[i] = true;
      continue;
    }
    if (Status vs = items[i].tensor.Validate(items[i].size); !vs.ok()) {
      batch->results[i] = vs;
      batch->failed_here[i] = true;
    }
  }
  // Device items are staged once, before grouping: an item whose copy fails is not sent to any
  // node (a zero-filled stand-in must never be stored, and no node's success may hide the error).
  // All device items share one staging block (one pool buffer, not one per item), and a run of
  // items whose bytes follow on in device memory (the rows of one tensor) is one copy: a
  // multi_put_rows of 4,096 rows stages with one copy, not 4,096.
  std::vector<std::shared_ptr<std::byte[]>> staged(items.size());
  std::vector<char> is_staged(items.size());
  size_t device_bytes = 0;
  for (size_t i = 0; i < items.size(); ++i) {
    is_staged[i] = !batch->failed_here[i] && items[i].size > 0 &&
                   Resolve(o.memory, items[i].data) == MemoryKind::kDevice;
    if (is_staged[i]) device_bytes += items[i].size;
  }
  if (device_bytes > 0) {
    auto block = I->staging_pool->Acquire(device_bytes);
    std::vector<int> synced_devices;    // the producers' work is done before anything reads
    auto synced = [&](const void* p) {  // once per device
      const int device = CudaPointerDevice(p);
      if (std::find(synced_devices.begin(), synced_devices.end(), device) != synced_devices.end()) {
        return Status::OK();
      }
      Status ss = CudaSyncStream(o.cuda_stream, p);
      if (ss.ok()) synced_devices.push_back(device);
      return ss;
    };
    size_t offset = 0;
    for (size_t i = 0; i < items.size();) {
      if (!is_staged[i]) {
        ++i;
        continue;
      }
      const auto* first = static_cast<const std::byte*>(items[i].data);
      size_t end = i + 1, run_bytes = items[i].size;
      while (end < items.size() && is_staged[end] && items[end].data == first + run_bytes) {
        run_bytes += items[end].size;
        ++end;
      }
      Status s = block.status();
      if (s.ok()) s = synced(first);
      bool one_by_one = false;
      if (s.ok()) {
        s = I->DeviceCopy(block->get() + offset, first, run_bytes, first);
        // A run over two allocations that merely abut (on two devices, even) may be refused as
        // one copy: item by item, each after its own device's work.
        one_by_one = !s.ok() && end - i > 1;
      }
      for (size_t k = i; k < end; ++k) {
        Status sk = s;
        if (one_by_one) {
          sk = synced(items[k].data);
          if (sk.ok()) {
            sk = I->DeviceCopy(block->get() + offset, items[k].data, items[k].size, items[k].data);
          }
        }
        if (sk.ok()) {
          staged[k] = std::shared_ptr<std::byte[]>(*block, block->get() + offset);  // aliasing
          offset += items[k].size;
        } else {
          batch->results[k] = sk;
          batch->failed_here[k] = true;
        }
      }
      i = end;
    }
  }
  // Every replica of every item: one message per node.
  batch->by_node.resize(ring->table_size());
  batch->payloads.resize(ring->table_size());
  for (size_t i = 0; i < items.size(); ++i) {
    if (batch->failed_here[i]) continue;
    for (int n : ring->Owners(items[i].key, I->options.replicas)) {
      batch->by_node[n].push_back(i);
    }
  }
  // Replicated: item i's version is first_version + i * kStep on every node it goes to.
  const bool versioned = I->options.replicas > 1;
  const uint64_t first_version = versioned ? I->write_clock.Take(items.size()) : 0;
  // Each node's message: metadata block, then the values (gathered here, in the caller).
  for (size_t n = 0; n < batch->by_node.size(); ++n) {
    if (batch->by_node[n].empty()) continue;
    std::vector<w::BatchPutItem> meta;
    size_t total = 0;
    for (size_t i : batch->by_node[n]) {
      meta.push_back({items[i].key, items[i].tensor, items[i].size,
                      versioned ? first_version + i * HybridClock::kStep : 0});
      total += items[i].size;
    }
    auto p = std::make_shared<std::string>(w::EncodeBatchPutBlock(meta, versioned));
    p->reserve(p->size() + total);
    for (size_t i : batch->by_node[n]) {
      const char* src = staged[i] ? reinterpret_cast<const char*>(staged[i].get())
                                  : static_cast<const char*>(items[i].data);
      if (items[i].size) p->append(src, items[i].size);
    }
    batch->payloads[n] = p;
    batch->remaining++;
  }
  if (batch->remaining == 0) return std::move(batch->results);
  auto done = batch->all_done.get_future();
  I->Submit([I, batch, deadline = I->DeadlineFrom(o.timeout),
             flags = static_cast<uint16_t>((o.durable ? w::kFlagDurable : 0) |
                                           (versioned ? w::kFlagClientVersion : 0))] {
    for (size_t n = 0; n < batch->by_node.size(); ++n) {
      if (batch->by_node[n].empty()) continue;
      I->IssueWithPayloadReply(
          static_cast<int>(n), w::Opcode::kMultiPut, flags, "", batch->payloads[n], deadline, {},
          [I, batch, n](Result<std::shared_ptr<std::string>> r) {
            const std::vector<size_t>& idx = batch->by_node[n];
            std::vector<w::BatchPutResult> res;
            Status s = r.status();
            if (s.ok()) s = w::DecodeBatchPutResults(**r, &res);
            if (s.ok() && res.size() != idx.size()) {
              s = Status::ProtocolError("batch reply has the wrong number of results");
            }
            // The node's failure as the outcome of the items it is a replica of.
            const Status as_replica =
                s.ok() ? Status::OK() : I->ReplicaFailed(static_cast<int>(n), s);
            for (size_t j = 0; j < idx.size(); ++j) {
              // As for Put: the primary's answer is the item's outcome, unless another owner
              // did not take the item (then that failure is, once every node answered).
              if (batch->primary[idx[j]] != static_cast<int>(n)) {
                Status& failed = batch->replica_failure[idx[j]];
                if (!s.ok()) {
                  failed = Impl::Deciding(failed, as_replica);
                } else if (res[j].code != StatusCode::kOk) {
                  failed = Impl::Deciding(
                      failed, I->ReplicaFailed(static_cast<int>(n),
                                               Status(res[j].code, "batch put failed")));
                }
                continue;
              }
              Result<uint64_t>& out = batch->results[idx[j]];
              if (!s.ok())
                out = s;
              else if (res[j].code != StatusCode::kOk)
                out = Status(res[j].code, "batch put failed");
              else
                out = res[j].version;
              if (out.ok()) I->write_clock.Observe(*out);
            }
            if (--batch->remaining > 0) return;
            for (size_t i = 0; i < batch->results.size(); ++i) {
              if (batch->results[i].ok() && !batch->replica_failure[i].ok()) {
                batch->results[i] = batch->replica_failure[i];
              }
            }
            batch->all_done.set_value();
          });
    }
  });
  I->Await(done);
  // Items a node refused as misrouted (the rings differed): one by one through Put, which
  // waits for the rings to agree.
  for (size_t i = 0; i < items.size(); ++i) {
    const Result<uint64_t>& r = batch->results[i];
    if (r.ok() || !Impl::Misrouted(r.status())) continue;
    PutOptions one = o;
    one.tensor = items[i].tensor;
    batch->results[i] = Put(items[i].key, items[i].data, items[i].size, one);
  }
  return std::move(batch->results);
}

std::vector<Status> Client::MultiGetInto(const std::vector<std::string>& keys, void* dst,
                                         size_t row_stride, size_t row_bytes, const GetOptions& o) {
  Impl* I = impl_.get();
  std::vector<Status> results(keys.size(), Status::Aborted("not sent"));
  if (keys.empty()) return results;
  if (row_bytes > row_stride) {
    results.assign(keys.size(), Status::InvalidArgument("row_bytes exceeds row_stride"));
    return results;
  }
  const MemoryKind kind = Resolve(o.memory, dst);
  // Device rows without a UCX that moves device memory (the reply block lands in host memory
  // anyway): rows are assembled in host memory, then copied in runs of consecutive hits.
  std::shared_ptr<std::byte[]> staging;
  std::byte* rows = static_cast<std::byte*>(dst);
  if (kind == MemoryKind::kDevice) {
    Status ss = CudaSyncStream(o.cuda_stream, dst);  // nothing still reads the rows (PutOptions)
    auto buffer = ss.ok() ? I->staging_pool->Acquire(keys.size() * row_stride)
                          : Result<std::shared_ptr<std::byte[]>>(ss);
    if (!buffer.ok()) return std::vector<Status>(keys.size(), buffer.status());
    staging = std::move(*buffer);
    rows = staging.get();
  }
  // One NotFound shared by every miss: a miss costs no allocation.
  const Status miss = Status::NotFound("key not found");
  auto check = [&](const ValueInfo& info) -> Status {
    if (info.size != row_bytes) {
      return Status::InvalidArgument("value of " + std::to_string(info.size) +
                                     " bytes does not fit a row of " + std::to_string(row_bytes) +
                                     " bytes");
    }
    return o.accept ? o.accept(info) : Status::OK();
  };
  // The caller waits in ReadBatch, so the batch may point at its keys, rows and results.
  auto batch = std::make_shared<Impl::BatchRead>();
  batch->keys = &keys;
  batch->deadline = I->DeadlineFrom(o.timeout);
  batch->row = [&](size_t i, const Status& s, const w::ObjectMeta* meta, const char* bytes) {
    if (!s.ok()) {
      results[i] = s;
      return;
    }
    results[i] = check(ToInfo(*meta));
    if (results[i].ok()) std::memcpy(rows + i * row_stride, bytes, meta->size);
  };
  I->ReadBatch(batch, o.fail_open);  // with its fallback rounds (see MultiGet)
  if (staging) {
    // Runs of consecutive hits, one copy each (all rows at once when everything hit).
    for (size_t i = 0; i < keys.size();) {
      if (!results[i].ok()) {
        ++i;
        continue;
      }
      size_t end = i + 1;
      // Padded rows go one by one so the caller's padding is never overwritten.
      while (row_stride == row_bytes && end < keys.size() && results[end].ok()) ++end;
      const size_t bytes = (end - i - 1) * row_stride + row_bytes;
      Status s = I->DeviceCopy(static_cast<std::byte*>(dst) + i * row_stride,
                               staging.get() + i * row_stride, bytes, dst);
      for (size_t k = i; !s.ok() && k < end; ++k) results[k] = s;
      i = end;
    }
  }
  return results;
}

Result<std::string> Client::Ping(int node, std::chrono::milliseconds timeout) {
  Impl* I = impl_.get();
  if (node < 0 || node >= static_cast<int>(I->NodeCount())) {
    return Status::InvalidArgument("no such node");
  }
  auto deadline = I->DeadlineFrom(timeout);
  std::promise<Result<std::string>> promise;
  auto future = promise.get_future();
  I->Submit([&] {
    auto on_reply = [I, &promise](const Impl::PendingPtr& p, std::unique_ptr<Incoming> msg) {
      std::string id;
      Status s = ParseReply(*msg, [&](std::string_view body, w::ReplyStatus* rs) {
        return w::DecodePingReply(body, rs, &id);
      });
      if (!s.ok()) return I->Fail(p, s);
      I->Complete(p, [&promise, id] { promise.set_value(id); });
    };
    I->Issue(node, w::Opcode::kPing, 0, "", nullptr, 0, MemoryKind::kHost, deadline, on_reply,
             [&promise](Status s) { promise.set_value(s); });
  });
  return I->Await(future);
}

Result<std::string> Client::NodeTransports(int node) {
  Impl* I = impl_.get();
  if (node < 0 || node >= static_cast<int>(I->NodeCount())) {
    return Status::InvalidArgument("no such node");
  }
  std::promise<Result<std::string>> promise;
  auto future = promise.get_future();
  I->transport->Post([&] {
    const ConnId conn = static_cast<size_t>(node) < I->node_conn.size() ? I->node_conn[node] : 0;
    std::string t = conn ? I->transport->Transports(conn) : "";
    if (t.empty()) {
      promise.set_value(Status::Unavailable("not connected to that node"));
    } else {
      promise.set_value(std::move(t));
    }
  });
  return future.get();
}

Result<std::string> Client::NodeStats(int node, std::chrono::milliseconds timeout) {
  Impl* I = impl_.get();
  if (node < 0 || node >= static_cast<int>(I->NodeCount())) {
    return Status::InvalidArgument("no such node");
  }
  auto deadline = I->DeadlineFrom(timeout);
  std::promise<Result<std::string>> promise;
  auto future = promise.get_future();
  I->transport->Post([&] {
    I->IssueWithPayloadReply(node, w::Opcode::kStats, 0, "", nullptr, deadline, {},
                             [&promise](Result<std::shared_ptr<std::string>> r) {
                               if (r.ok())
                                 promise.set_value(**r);
                               else
                                 promise.set_value(r.status());
                             });
  });
  return future.get();
}

}  // namespace gkv
