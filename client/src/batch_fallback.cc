// Batch reads after their first round (issue 38 item 9): the rows the first round left open go
// on in rounds of one MGET per node, within the batch's deadline. Before, each such row became
// a single get with a timeout of its own: a 4,096-row batch took 4,096 round trips, and a
// batch could take twice its timeout.
#include <algorithm>
#include <future>
#include <map>
#include <thread>
#include <utility>

#include "client_impl.h"

namespace gkv {

// One row left open by the first round: the places it is asked next, in order.
struct FallbackRow {
  size_t i = 0;             // index into the batch's keys
  std::vector<int> places;  // nodes
  std::vector<uint16_t> flags;
  size_t next = 0;  // the place asked now
  Status failure;   // the first node failure (that node may hold the newest version)
  Status refused;   // the first refusal as misrouted
};

// Shared by the caller (waiting in ReadBatch) and the I/O thread, which alone touches it
// between Submit and `done`.
struct Client::Impl::BatchFallback {
  std::shared_ptr<BatchRead> batch;
  bool moving = false;
  bool fail_open = false;
  std::vector<FallbackRow> rows;
  std::vector<size_t> misrouted;  // rows every place refused: asked again under a newer ring
  int remaining = 0;              // messages in flight, plus one per round still issuing
  std::function<void()> done;
};

void Client::Impl::ReadBatch(const std::shared_ptr<BatchRead>& b, bool fail_open) {
  const auto row = b->row;  // the caller's; it outlives this call
  std::vector<size_t> rows(b->keys->size());
  for (size_t i = 0; i < rows.size(); ++i) rows[i] = i;
  // With replicas, the first round keeps half the time for the others of a node that hangs:
  // half until the first byte of a node's reply (the transfer then runs to the deadline).
  const auto now = Clock::now();
  const bool others = options.replicas > 1 && Route()->ring->size() > 1;
  b->first_deadline = others && b->deadline > now ? now + (b->deadline - now) / 2 : b->deadline;
  for (;;) {
    const std::shared_ptr<const Routing> route = Route();
    const bool moving = route->Moving();
    std::vector<std::pair<size_t, Status>> open;  // filled by the first round (I/O thread)
    b->row = [&open, &row, moving](size_t i, const Status& s, const w::ObjectMeta* meta,
                                   const char* bytes) {
      // A first-round outcome that is not the row's answer yet.
      if (Misrouted(s) || NodeFailure(s) || (moving && s.code() == StatusCode::kNotFound)) {
        open.emplace_back(i, s);
      } else {
        row(i, s, meta, bytes);
      }
    };
    RunBatchRead(b, std::move(rows));
    b->row = row;
    b->first_deadline = b->deadline;
    if (open.empty()) break;
    auto f = std::make_shared<BatchFallback>();
    f->batch = b;
    f->fail_open = fail_open;
    f->moving = moving;
    // Each open row's places: its other owners, then (keys may be moving) its previous owners,
    // then, after a miss everywhere, its owner once more as the last resort (a handoff installs
    // a key at its new owner before it deletes the old copy, and a node catching up serves a
    // held-back key only then), unless the owner failed.
    for (auto& [i, s] : open) {
      const std::string& key = (*b->keys)[i];
      FallbackRow r;
      r.i = i;
      if (NodeFailure(s)) r.failure = s;
      if (Misrouted(s)) r.refused = s;
      std::vector<int> owners = route->ring->Owners(key, options.replicas);
      for (size_t k = 1; k < owners.size(); ++k) {
        r.places.push_back(owners[k]);
        r.flags.push_back(0);
      }
      if (moving) {
        for (int n : route->PreviousOwners(key, options.replicas, owners)) {
          r.places.push_back(n);
          r.flags.push_back(w::kFlagPreviousOwner);
        }
        if (s.code() == StatusCode::kNotFound && !owners.empty()) {
          r.places.push_back(owners[0]);
          r.flags.push_back(w::kFlagLastResort);
        }
      }
      f->rows.push_back(std::move(r));
    }
    std::promise<void> all_done;
    auto finished = all_done.get_future();
    f->done = [&all_done] { all_done.set_value(); };
    Submit([this, f] {
      std::vector<size_t> all(f->rows.size());
      for (size_t j = 0; j < all.size(); ++j) all[j] = j;
      IssueFallbackRound(f, all);
    });
    Await(finished);
    // Refused everywhere: the rings differ (ours or theirs is behind); again shortly, under the
    // ring then, as a single get is (RetryOrEndGet).
    if (f->misrouted.empty() || Clock::now() + kWrongNodeRetry >= b->deadline) break;
    std::this_thread::sleep_for(kWrongNodeRetry);
    rows = std::move(f->misrouted);
  }
  b->row = nullptr;  // it points into the caller's frame
}

void Client::Impl::IssueFallbackRound(const std::shared_ptr<BatchFallback>& f,
                                      const std::vector<size_t>& rows) {
  BatchRead& b = *f->batch;
  f->remaining++;  // this round's own count: a node that fails at once answers inside it
  // A row out of places gets what it met: a node failure first, then a refusal, else a miss
  // (a miss after a refusal while keys stay put: the refusal, so it is asked again).
  auto settle = [f](FallbackRow& r, bool refusal_first = false) {
    Status s = refusal_first && !r.refused.ok() ? r.refused
               : !r.failure.ok()                ? r.failure
               : !r.refused.ok()                ? r.refused
                                                : Status::NotFound("key not found");
    if (Misrouted(s)) f->misrouted.push_back(r.i);
    if (f->fail_open && NodeFailure(s)) {
      s = Status::NotFound("no live node answered (fail-open): " + s.ToString());
    }
    f->batch->row(r.i, s, nullptr, nullptr);
  };
  const bool late = Clock::now() >= b.deadline;  // nothing more is asked: each has its answer
  std::map<std::pair<int, uint16_t>, std::vector<size_t>> by_place;
  for (size_t j : rows) {
    FallbackRow& r = f->rows[j];
    if (r.next == r.places.size() || late) {
      settle(r);
    } else {
      by_place[{r.places[r.next], r.flags[r.next]}].push_back(j);
    }
  }
  for (auto& [place, part] : by_place) {
    const auto [node, flags] = place;
    std::vector<std::string> keys;
    keys.reserve(part.size());
    for (size_t j : part) keys.push_back((*b.keys)[f->rows[j].i]);
    auto payload = std::make_shared<std::string>(w::EncodeKeyList(keys, nullptr));
    f->remaining++;
    IssueWithPayloadReply(
        node, w::Opcode::kMultiGet, flags, "", payload, b.deadline, {},
        [this, f, part = std::move(part), settle](Result<std::shared_ptr<std::string>> reply) {
          BatchRead& b = *f->batch;
          std::vector<w::BatchGetResult> res;
          size_t block = 0;
          Status s = reply.status();
          if (s.ok()) s = w::DecodeBatchGetBlock(**reply, &res, &block);
          if (s.ok() && res.size() != part.size()) {
            s = Status::ProtocolError("batch reply has the wrong number of results");
          }
          size_t off = block;
          std::vector<size_t> again;  // rows asked of their next place now
          for (size_t k = 0; k < part.size(); ++k) {
            FallbackRow& r = f->rows[part[k]];
            const Status row_status = !s.ok()                          ? s
                                      : res[k].code == StatusCode::kOk ? Status::OK()
                                      : res[k].code == StatusCode::kNotFound
                                          ? Status::NotFound("key not found")
                                          : Status(res[k].code, "batch get failed");
            if (row_status.ok()) {
              b.row(r.i, row_status, &res[k].meta, (*reply)->data() + off);
              off += res[k].meta.size;
              continue;
            }
            // A node failure, a refusal, or a miss while keys may be moving: the next place.
            // Any other answer (a miss while keys stay put, busy, ...) is the row's.
            if (NodeFailure(row_status)) {
              if (r.failure.ok()) r.failure = row_status;
            } else if (Misrouted(row_status)) {
              if (r.refused.ok()) r.refused = row_status;
            } else if (!(f->moving && row_status.code() == StatusCode::kNotFound)) {
              // A miss while keys stay put is the answer, unless a place refused the key as
              // misrouted (it may hold the key: asked again under the ring then).
              if (row_status.code() == StatusCode::kNotFound && !r.refused.ok()) {
                settle(r, /*refusal_first=*/true);
                continue;
              }
              b.row(r.i, row_status, nullptr, nullptr);
              continue;
            }
            r.next++;
            again.push_back(part[k]);
          }
          // At once, not after the slowest node answered.
          if (!again.empty()) IssueFallbackRound(f, again);  // settles them once late
          FinishFallbackPart(f);
        });
  }
  FinishFallbackPart(f);
}

void Client::Impl::FinishFallbackPart(const std::shared_ptr<BatchFallback>& f) {
  if (--f->remaining > 0) return;
  auto done = std::move(f->done);
  done();
}

}  // namespace gkv
