#include "gkv/storage/disk_tier.h"

#include <rocksdb/db.h>
#include <rocksdb/env.h>
#include <rocksdb/options.h>
#include <rocksdb/write_batch.h>

#include <algorithm>
#include <filesystem>

#include "crash_fs_internal.h"
#include "gkv/bytes.h"
#include "gkv/log.h"

namespace gkv {
namespace {

constexpr size_t kData = 1, kMeta = 2, kOrder = 3, kChunks = 4;
constexpr uint8_t kMetaFormat = 2;
// Format 3: format 2 and the stream id of a value stored in chunks (written only for those).
constexpr uint8_t kMetaFormatChunked = 3;

// The rocksdb::Status boundary.
Status FromRocks(const rocksdb::Status& s, std::string_view what) {
  if (s.ok()) return Status::OK();
  std::string m(what);
  m += ": ";
  m += s.ToString();
  if (s.IsNotFound()) return Status::NotFound(m);
  if (s.IsCorruption()) return Status::Corruption(m);
  if (s.IsNoSpace()) return Status::NoSpace(m);
  return Status::IOError(m);
}

struct MetaRecord {
  StoredObjectMeta meta;
  uint64_t sequence = 0;
};

// Format 1: {version, sequence, size, tensor}; durability was not recorded, so such records
// read as durable (never evicted: the safe side). Format 2 adds a flags byte (bit 0: durable).
constexpr uint8_t kMetaFormatV1 = 1;

std::string EncodeMeta(const MetaRecord& r) {
  std::string out;
  ByteWriter w(&out);
  w.U8(r.meta.chunks != 0 ? kMetaFormatChunked : kMetaFormat);
  w.U64(r.meta.version);
  w.U64(r.sequence);
  w.U8(r.meta.durable ? 1 : 0);
  w.U64(r.meta.size);
  w.Tensor(r.meta.tensor);
  if (r.meta.chunks != 0) w.U64(r.meta.chunks);
  return out;
}

Status DecodeMeta(std::string_view in, MetaRecord* r) {
  ByteReader rd(in);
  uint8_t format = 0, flags = 1;
  rd.U8(&format);
  rd.U64(&r->meta.version);
  rd.U64(&r->sequence);
  if (format != kMetaFormatV1) rd.U8(&flags);
  rd.U64(&r->meta.size);
  rd.Tensor(&r->meta.tensor);
  r->meta.chunks = 0;
  if (format == kMetaFormatChunked) rd.U64(&r->meta.chunks);
  if (rd.failed() ||
      (format != kMetaFormat && format != kMetaFormatV1 && format != kMetaFormatChunked) ||
      (format == kMetaFormatChunked && r->meta.chunks == 0) || rd.remaining() != 0) {
    return Status::Corruption("bad metadata record in the disk tier");
  }
  r->meta.durable = (flags & 1) != 0;
  return Status::OK();
}

void PutBigEndian(std::string* out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out->push_back(static_cast<char>((v >> (56 - 8 * i)) & 0xff));
}

uint64_t GetBigEndian(const char* p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v = (v << 8) | static_cast<uint8_t>(p[i]);
  return v;
}

std::string OrderKey(uint64_t sequence) {
  std::string k;
  PutBigEndian(&k, sequence);
  return k;
}

// A chunk's key: its stream, then its offset, so one stream's chunks are one range in offset
// order.
std::string ChunkKey(uint64_t stream, uint64_t offset) {
  std::string k;
  k.reserve(16);
  PutBigEndian(&k, stream);
  PutBigEndian(&k, offset);
  return k;
}

uint64_t DecodeOrderKey(const rocksdb::Slice& k) {
  uint64_t v = 0;
  for (size_t i = 0; i < 8 && i < k.size(); ++i) v = (v << 8) | static_cast<uint8_t>(k[i]);
  return v;
}

constexpr const char* kVersionMarkKey = "version_mark";

}  // namespace

// Every RocksDB write goes through this one function, which tests/tsan.supp names: Debian's
// RocksDB is not TSan-instrumented, and its group commit (a leader thread writes the batches of
// the threads waiting behind it, synchronized by atomics TSan cannot see) shows up as races on
// RocksDB's own buffers once writes run concurrently. Nothing of gkv's happens in here. Two
// levels, because a TSan stack names the functions that contain each call site: the call into
// RocksDB is made from RocksDbWriteCall, whose own call site is in RocksDbWrite, so that name is
// on the stack of every such race (and of nothing else).
[[gnu::noinline]] rocksdb::Status RocksDbWriteCall(rocksdb::DB* db, const rocksdb::WriteOptions& wo,
                                                   rocksdb::WriteBatch* batch) {
  return db->Write(wo, batch);
}
[[gnu::noinline]] rocksdb::Status RocksDbWrite(rocksdb::DB* db, const rocksdb::WriteOptions& wo,
                                               rocksdb::WriteBatch* batch) {
  rocksdb::Status s = RocksDbWriteCall(db, wo, batch);
  return s;
}

Result<std::unique_ptr<DiskTier>> DiskTier::Open(const Options& options) {
  if (options.capacity == 0) return Status::InvalidArgument("disk tier capacity is zero");
  std::error_code ec;
  std::filesystem::create_directories(options.path, ec);
  if (ec) {
    return Status::IOError("cannot create disk tier directory '" + options.path +
                           "': " + ec.message());
  }
  if (!(options.durable_share > 0 && options.durable_share <= 1)) {
    return Status::InvalidArgument("disk tier durable share must be in (0, 1]");
  }
  std::unique_ptr<DiskTier> tier(new DiskTier(options));

  rocksdb::DBOptions db_options;
  db_options.create_if_missing = true;
  db_options.create_missing_column_families = true;
  db_options.max_background_jobs = 2;
  db_options.info_log_level = rocksdb::InfoLogLevel::WARN_LEVEL;
  db_options.keep_log_file_num = 2;
  if (options.crash_fs) {
    tier->env_ = rocksdb::NewCompositeEnv(CrashFsFileSystem(*options.crash_fs));
    db_options.env = tier->env_.get();
  }

  rocksdb::ColumnFamilyOptions data_options;
  data_options.enable_blob_files = true;
  data_options.min_blob_size = options.min_blob_size;
  data_options.enable_blob_garbage_collection = true;
  data_options.blob_compression_type = rocksdb::kNoCompression;  // tensors rarely compress
  data_options.write_buffer_size = 64 << 20;
  rocksdb::ColumnFamilyOptions small_options;
  // Chunks of streamed values arrive at network speed, many MiB at a time: small memtables,
  // flushed (into blob files) often, so that what a stream holds in memory stays a few MiB
  // rather than growing with the value.
  rocksdb::ColumnFamilyOptions chunk_options = data_options;
  chunk_options.write_buffer_size = 16 << 20;

  std::vector<rocksdb::ColumnFamilyDescriptor> families = {
      {rocksdb::kDefaultColumnFamilyName, small_options},
      {"data", data_options},
      {"meta", small_options},
      {"order", small_options},
      {"chunks", chunk_options},
  };
  GKV_RETURN_IF_ERROR(
      FromRocks(rocksdb::DB::Open(db_options, options.path, families, &tier->handles_, &tier->db_),
                "opening the disk tier at '" + options.path + "'"));

  // Warm restart: rebuild the byte counts and the write sequence from the metadata, and the
  // eviction cursor from the oldest order entry.
  std::unique_ptr<rocksdb::Iterator> it(
      tier->db_->NewIterator(rocksdb::ReadOptions(), tier->handles_[kMeta]));
  std::set<uint64_t> referenced;  // streams whose chunks are an object's value
  for (it->SeekToFirst(); it->Valid(); it->Next()) {
    MetaRecord r;
    GKV_RETURN_IF_ERROR(DecodeMeta(std::string_view(it->value().data(), it->value().size()), &r));
    const uint64_t bytes = r.meta.size + it->key().size();
    tier->used_bytes_ += bytes;
    if (r.meta.durable) tier->durable_bytes_ += bytes;
    tier->object_count_++;
    tier->next_sequence_ = std::max(tier->next_sequence_, r.sequence + 1);
    if (r.meta.chunks != 0) referenced.insert(r.meta.chunks);
  }
  GKV_RETURN_IF_ERROR(FromRocks(it->status(), "scanning disk tier metadata"));
  GKV_RETURN_IF_ERROR(tier->DropUnreferencedChunks(referenced));
  std::unique_ptr<rocksdb::Iterator> oit(
      tier->db_->NewIterator(rocksdb::ReadOptions(), tier->handles_[kOrder]));
  oit->SeekToFirst();
  GKV_RETURN_IF_ERROR(FromRocks(oit->status(), "scanning the disk tier eviction order"));
  tier->evict_cursor_ = oit->Valid() ? DecodeOrderKey(oit->key()) : tier->next_sequence_;
  return tier;
}

DiskTier::DiskTier(const Options& options)
    : options_(options),
      durable_capacity_(
          static_cast<uint64_t>(static_cast<double>(options.capacity) * options.durable_share)) {}

DiskTier::~DiskTier() {
  if (!db_) return;
  db_->FlushWAL(true);
  for (auto* h : handles_) db_->DestroyColumnFamilyHandle(h);
  rocksdb::Status s = db_->Close();
  if (!s.ok()) GKV_LOG_WARN("closing the disk tier: {}", s.ToString());
  delete db_;
}

struct DiskTier::Victim {
  std::string key;
  uint64_t version;
  uint64_t bytes;
  uint64_t sequence;
};

Status DiskTier::Put(std::string_view key, const StoredObjectMeta& meta, const void* data,
                     bool sync, std::vector<DiskEviction>* evicted, bool* written) {
  std::vector<DiskWrite> w(1);
  w[0].key = key;
  w[0].meta = meta;
  w[0].data = data;
  Status s = PutBatch(&w, sync, evicted);
  if (written) *written = s.ok() && w[0].written;
  GKV_RETURN_IF_ERROR(s);
  return w[0].status;
}

void DiskTier::ClaimLocked(std::unique_lock<std::mutex>& lock,
                           const std::vector<std::string_view>& keys) {
  auto any_busy = [&] {
    for (std::string_view k : keys) {
      if (busy_.find(k) != busy_.end()) return true;
    }
    return false;
  };
  while (any_busy()) key_released_.wait(lock);
}

void DiskTier::ReleaseLocked(const std::vector<std::string>& keys) {
  for (const std::string& k : keys) busy_.erase(k);
  key_released_.notify_all();
}

Status DiskTier::WriteClaimedLocked(std::unique_lock<std::mutex>& lock, void* batch_ptr, bool sync,
                                    const std::vector<std::string>& claimed, const char* what) {
  for (const std::string& k : claimed) busy_.insert(k);
  lock.unlock();
  rocksdb::WriteOptions wo;
  wo.sync = sync;
  rocksdb::Status ws = RocksDbWrite(db_, wo, static_cast<rocksdb::WriteBatch*>(batch_ptr));
  lock.lock();
  ReleaseLocked(claimed);
  return FromRocks(ws, what);
}

bool DiskTier::ChooseVictimsLocked(const std::vector<std::string_view>& keep, void* batch_ptr,
                                   std::vector<Victim>* victims) {
  auto* batch = static_cast<rocksdb::WriteBatch*>(batch_ptr);
  if (used_bytes_ <= options_.capacity) return true;
  const uint64_t over = used_bytes_ - options_.capacity;
  const std::string lower = OrderKey(evict_cursor_);
  std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(rocksdb::ReadOptions(), handles_[kOrder]));
  uint64_t freed = 0, cursor = evict_cursor_;
  bool contiguous = true;  // the cursor moves only over a prefix with nothing left behind
  for (it->Seek(lower); it->Valid() && freed < over; it->Next()) {
    const uint64_t seq = DecodeOrderKey(it->key());
    std::string key = it->value().ToString();
    const bool kept = busy_.count(key) > 0 ||
                      std::find(keep.begin(), keep.end(), std::string_view(key)) != keep.end();
    if (kept) {
      contiguous = false;
      continue;
    }
    std::string raw;
    MetaRecord r;
    rocksdb::Status gs = db_->Get(rocksdb::ReadOptions(), handles_[kMeta], key, &raw);
    Status ds = gs.ok() ? DecodeMeta(raw, &r) : Status::OK();
    if (!gs.ok() && !gs.IsNotFound()) ds = FromRocks(gs, "eviction read");
    if (!ds.ok()) {
      GKV_LOG_WARN("disk tier eviction skips '{}': {}", key, ds.ToString());
      contiguous = false;
      continue;
    }
    if (gs.IsNotFound() || r.sequence != seq || r.meta.durable) {
      // An order entry with no cache-only object behind it (a format 1 durable record): drop it.
      batch->Delete(handles_[kOrder], it->key());
      if (contiguous) cursor = seq + 1;
      continue;
    }
    const uint64_t bytes = r.meta.size + key.size();
    batch->Delete(handles_[kOrder], it->key());
    batch->Delete(handles_[kMeta], key);
    DeleteValueTo(batch, key, r.meta);
    freed += bytes;
    victims->push_back({std::move(key), r.meta.version, bytes, seq});
    if (contiguous) cursor = seq + 1;
  }
  if (!it->status().ok()) {
    GKV_LOG_WARN("disk tier eviction scan: {}", it->status().ToString());
  }
  if (freed < over) return false;
  used_bytes_ -= freed;
  object_count_ -= victims->size();
  evict_cursor_ = cursor;
  return true;
}

Status DiskTier::PutBatch(std::vector<DiskWrite>* writes, bool sync,
                          std::vector<DiskEviction>* evicted) {
  // The item that is written for each key: the one with the highest version.
  std::vector<size_t> chosen;
  std::vector<std::string_view> keys;
  for (size_t i = 0; i < writes->size(); ++i) {
    DiskWrite& w = (*writes)[i];
    w.status = Status::OK();
    w.written = false;
    const uint64_t bytes = w.meta.size + w.key.size();
    if (bytes > (w.meta.durable ? durable_capacity_ : options_.capacity)) {
      w.status =
          Status::NoSpace("object of " + std::to_string(w.meta.size) + " bytes exceeds the " +
                          (w.meta.durable ? "durable budget" : "capacity") + " of the disk tier");
      continue;
    }
    auto k = std::find(keys.begin(), keys.end(), w.key);
    if (k == keys.end()) {
      keys.push_back(w.key);
      chosen.push_back(i);
    } else if ((*writes)[chosen[k - keys.begin()]].meta.version < w.meta.version) {
      chosen[k - keys.begin()] = i;
    }
  }
  if (chosen.empty()) return Status::OK();

  std::unique_lock<std::mutex> lock(write_mu_);
  rocksdb::WriteBatch batch;
  std::vector<size_t> included;
  std::vector<Victim> victims;
  // This round's starting point, taken after every wait (which releases the lock, so other
  // writers, streams and deletes change the counts meanwhile): an undo takes back only what the
  // round itself changed.
  uint64_t used0 = 0, durable0 = 0, count0 = 0, cursor0 = 0;
  for (;;) {
    ClaimLocked(lock, keys);
    used0 = used_bytes_;
    durable0 = durable_bytes_;
    count0 = object_count_;
    cursor0 = evict_cursor_;
    batch.Clear();
    included.clear();
    victims.clear();
    uint64_t batch_cache_only = 0;
    for (size_t i : chosen) {
      DiskWrite& w = (*writes)[i];
      w.status = Status::OK();
      std::string old;
      MetaRecord r;
      bool existed = false;
      rocksdb::Status gs = db_->Get(rocksdb::ReadOptions(), handles_[kMeta], w.key, &old);
      if (gs.ok()) {
        w.status = DecodeMeta(old, &r);
        if (!w.status.ok()) continue;
        if (r.meta.version > w.meta.version) continue;  // a newer version is kept
        existed = true;
      } else if (!gs.IsNotFound()) {
        w.status = FromRocks(gs, "disk tier metadata read");
        continue;
      }
      const uint64_t bytes = w.meta.size + w.key.size();
      const uint64_t old_bytes = existed ? r.meta.size + w.key.size() : 0;
      const uint64_t durable_after = durable_bytes_ - (existed && r.meta.durable ? old_bytes : 0) +
                                     (w.meta.durable ? bytes : 0);
      if (w.meta.durable && durable_after > durable_capacity_) {
        w.status = Status::NoSpace("the disk tier's durable budget (" +
                                   std::to_string(durable_capacity_) + " bytes) is full");
        continue;
      }
      if (!w.meta.durable && durable_after + batch_cache_only + bytes > options_.capacity) {
        w.status = Status::NoSpace("durable objects leave no room in the disk tier");
        continue;
      }
      if (!w.meta.durable) batch_cache_only += bytes;
      if (existed && !r.meta.durable) batch.Delete(handles_[kOrder], OrderKey(r.sequence));
      // The old value goes unless the new one overwrites its record in place (both in `data`).
      if (existed && (r.meta.chunks != 0 || w.meta.chunks != 0)) {
        DeleteValueTo(&batch, w.key, r.meta);
      }
      used_bytes_ = used_bytes_ - old_bytes + bytes;
      // A stream's reservation becomes the object's bytes (erased once the write is done).
      if (w.meta.chunks != 0) {
        auto open = open_chunks_.find(w.meta.chunks);
        if (open != open_chunks_.end()) used_bytes_ -= open->second;
      }
      durable_bytes_ = durable_after;
      if (!existed) object_count_++;
      MetaRecord nr{w.meta, next_sequence_++};
      if (w.meta.chunks == 0) {
        batch.Put(
            handles_[kData], w.key,
            rocksdb::Slice(static_cast<const char*>(w.data), static_cast<size_t>(w.meta.size)));
      }
      batch.Put(handles_[kMeta], w.key, EncodeMeta(nr));
      if (!w.meta.durable) batch.Put(handles_[kOrder], OrderKey(nr.sequence), w.key);
      included.push_back(i);
    }
    if (included.empty()) return Status::OK();
    const bool any_busy = !busy_.empty();
    if (ChooseVictimsLocked(keys, &batch, &victims)) break;
    // Not enough evictable bytes: undo this round. Keys in flight may free some; else refuse.
    used_bytes_ = used0;
    durable_bytes_ = durable0;
    object_count_ = count0;
    evict_cursor_ = cursor0;
    if (!any_busy) {
      for (size_t i : included) {
        (*writes)[i].status = Status::NoSpace("no room in the disk tier");
      }
      return Status::OK();
    }
    key_released_.wait(lock);
  }
  // Claim the keys written and evicted; the RocksDB write (and its fsync) runs unlocked.
  std::vector<std::string> claimed;
  for (size_t i : included) claimed.emplace_back((*writes)[i].key);
  for (const Victim& v : victims) claimed.push_back(v.key);
  const int64_t d_used = static_cast<int64_t>(used_bytes_) - static_cast<int64_t>(used0);
  const int64_t d_durable = static_cast<int64_t>(durable_bytes_) - static_cast<int64_t>(durable0);
  const int64_t d_count = static_cast<int64_t>(object_count_) - static_cast<int64_t>(count0);
  Status ws = WriteClaimedLocked(lock, &batch, sync, claimed, "disk tier write");
  if (!ws.ok()) {
    used_bytes_ -= d_used;
    durable_bytes_ -= d_durable;
    object_count_ -= d_count;
    evict_cursor_ = std::min(evict_cursor_, cursor0);
    return ws;
  }
  for (size_t i : included) {
    (*writes)[i].written = true;
    if ((*writes)[i].meta.chunks != 0) open_chunks_.erase((*writes)[i].meta.chunks);
  }
  if (evicted) {
    for (const Victim& v : victims) evicted->push_back({v.key, v.version});
  }
  return Status::OK();
}

Status DiskTier::GetMeta(std::string_view key, StoredObjectMeta* meta) const {
  std::string raw;
  rocksdb::Status s = db_->Get(rocksdb::ReadOptions(), handles_[kMeta], key, &raw);
  if (s.IsNotFound()) return Status::NotFound("key not on disk");
  GKV_RETURN_IF_ERROR(FromRocks(s, "disk tier metadata read"));
  MetaRecord r;
  GKV_RETURN_IF_ERROR(DecodeMeta(raw, &r));
  *meta = r.meta;
  return Status::OK();
}

namespace {

// Room for a value of `size` bytes in `value`, or NoSpace: a read of a large value on a node
// short of memory fails that read, not the process (no bad_alloc leaves the disk tier).
Status ReserveValue(std::string* value, uint64_t size) {
  try {
    value->clear();
    value->reserve(size);
  } catch (const std::exception&) {
    return Status::NoSpace("cannot allocate " + std::to_string(size) +
                           " bytes of memory to read a value from the disk tier");
  }
  return Status::OK();
}

}  // namespace

Status DiskTier::Get(std::string_view key, StoredObjectMeta* meta, std::string* value) const {
  // A snapshot makes the metadata and the value agree even if a writer replaces the key.
  const rocksdb::Snapshot* snap = db_->GetSnapshot();
  rocksdb::ReadOptions ro;
  ro.snapshot = snap;
  std::string raw;
  MetaRecord r;
  Status ds;
  rocksdb::Status s = db_->Get(ro, handles_[kMeta], key, &raw);
  if (s.ok()) ds = DecodeMeta(raw, &r);
  if (s.ok() && ds.ok()) ds = ReserveValue(value, r.meta.size);
  if (s.ok() && ds.ok() && r.meta.chunks == 0) s = db_->Get(ro, handles_[kData], key, value);
  if (s.ok() && ds.ok() && r.meta.chunks != 0) ds = ReadChunks(ro, r.meta, value);
  db_->ReleaseSnapshot(snap);
  if (s.IsNotFound()) return Status::NotFound("key not on disk");
  GKV_RETURN_IF_ERROR(FromRocks(s, "disk tier read"));
  GKV_RETURN_IF_ERROR(ds);
  if (value->size() != r.meta.size) {
    return Status::Corruption("disk tier value size does not match its metadata");
  }
  *meta = r.meta;
  return Status::OK();
}

Status DiskTier::ReadChunks(const rocksdb::ReadOptions& ro, const StoredObjectMeta& meta,
                            std::string* value) const {
  value->clear();  // (its room was reserved by Get)
  const std::string end = ChunkKey(meta.chunks + 1, 0);
  rocksdb::ReadOptions bounded = ro;
  rocksdb::Slice upper(end);
  bounded.iterate_upper_bound = &upper;
  std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(bounded, handles_[kChunks]));
  for (it->Seek(ChunkKey(meta.chunks, 0)); it->Valid(); it->Next()) {
    // Contiguous from 0: a chunk that starts elsewhere means the stream was not what its commit
    // said (never written so by this class).
    if (it->key().size() != 16 || GetBigEndian(it->key().data() + 8) != value->size() ||
        value->size() + it->value().size() > meta.size) {
      return Status::Corruption("disk tier chunks do not match their metadata");
    }
    value->append(it->value().data(), it->value().size());
  }
  return FromRocks(it->status(), "disk tier chunk read");
}

void DiskTier::DeleteValueTo(void* batch_ptr, std::string_view key, const StoredObjectMeta& meta) {
  auto* batch = static_cast<rocksdb::WriteBatch*>(batch_ptr);
  if (meta.chunks == 0) {
    batch->Delete(handles_[kData], key);
  } else {
    batch->DeleteRange(handles_[kChunks], ChunkKey(meta.chunks, 0), ChunkKey(meta.chunks + 1, 0));
  }
}

Result<uint64_t> DiskTier::BeginChunks(uint64_t size, bool durable,
                                       std::vector<DiskEviction>* evicted) {
  std::unique_lock<std::mutex> lock(write_mu_);
  if (size > (durable ? durable_capacity_ : options_.capacity)) {
    return Status::NoSpace("object of " + std::to_string(size) + " bytes exceeds the " +
                           (durable ? "durable budget" : "capacity") + " of the disk tier");
  }
  if (durable && durable_bytes_ + size > durable_capacity_) {
    return Status::NoSpace("the disk tier's durable budget (" + std::to_string(durable_capacity_) +
                           " bytes) is full");
  }
  const uint64_t stream = next_sequence_++;
  // Every change below is undone by its own amount, never by restoring a snapshot: the waits
  // release the lock, and other writers change the counts meanwhile.
  rocksdb::WriteBatch batch;
  std::vector<Victim> victims;
  uint64_t cursor_before = 0;
  for (;;) {
    const bool any_busy = !busy_.empty();
    used_bytes_ += size;
    cursor_before = evict_cursor_;
    // (Changes nothing when it fails.)
    if (ChooseVictimsLocked({}, &batch, &victims)) break;
    batch.Clear();
    victims.clear();
    // Not held while waiting: other writers must not see room taken that is not taken yet.
    used_bytes_ -= size;
    if (!any_busy) {
      return Status::NoSpace("no room in the disk tier for a streamed value of " +
                             std::to_string(size) + " bytes");
    }
    // Keys in flight may free some.
    key_released_.wait(lock);
  }
  if (!victims.empty()) {
    std::vector<std::string> claimed;
    uint64_t freed = 0;
    for (const Victim& v : victims) {
      claimed.push_back(v.key);
      freed += v.bytes;
    }
    Status ws = WriteClaimedLocked(lock, &batch, /*sync=*/false, claimed, "disk tier eviction");
    if (!ws.ok()) {
      used_bytes_ += freed;
      used_bytes_ -= size;
      object_count_ += victims.size();
      evict_cursor_ = std::min(evict_cursor_, cursor_before);
      return ws;
    }
    if (evicted) {
      for (const Victim& v : victims) evicted->push_back({v.key, v.version});
    }
  }
  open_chunks_[stream] = size;
  return stream;
}

Status DiskTier::WriteChunk(uint64_t stream, uint64_t offset, const void* data, uint64_t size) {
  if (stream == 0) return Status::InvalidArgument("no chunk stream");
  rocksdb::WriteBatch batch;
  batch.Put(handles_[kChunks], ChunkKey(stream, offset),
            rocksdb::Slice(static_cast<const char*>(data), static_cast<size_t>(size)));
  return FromRocks(RocksDbWrite(db_, rocksdb::WriteOptions(), &batch), "disk tier chunk write");
}

void DiskTier::AbortChunks(uint64_t stream) {
  if (stream == 0) return;
  {
    std::lock_guard<std::mutex> lock(write_mu_);
    auto it = open_chunks_.find(stream);
    if (it != open_chunks_.end()) {
      used_bytes_ -= it->second;
      open_chunks_.erase(it);
      key_released_.notify_all();  // writers waiting for room may find it now
    }
  }
  rocksdb::WriteBatch batch;
  batch.DeleteRange(handles_[kChunks], ChunkKey(stream, 0), ChunkKey(stream + 1, 0));
  // Unsynced: chunks a crash brings back are unreferenced, and the next Open deletes them.
  Status s = FromRocks(RocksDbWrite(db_, rocksdb::WriteOptions(), &batch), "deleting chunks");
  if (!s.ok()) GKV_LOG_WARN("disk tier: {} (the next start deletes them)", s.ToString());
}

Result<uint64_t> DiskTier::ChunkBytes() const {
  std::unique_ptr<rocksdb::Iterator> it(
      db_->NewIterator(rocksdb::ReadOptions(), handles_[kChunks]));
  uint64_t bytes = 0;
  for (it->SeekToFirst(); it->Valid(); it->Next()) bytes += it->value().size();
  GKV_RETURN_IF_ERROR(FromRocks(it->status(), "scanning disk tier chunks"));
  return bytes;
}

Status DiskTier::DropUnreferencedChunks(const std::set<uint64_t>& referenced) {
  std::unique_ptr<rocksdb::Iterator> it(
      db_->NewIterator(rocksdb::ReadOptions(), handles_[kChunks]));
  rocksdb::WriteBatch batch;
  uint64_t dropped = 0;
  for (it->SeekToFirst(); it->Valid();) {
    if (it->key().size() != 16) return Status::Corruption("bad chunk key in the disk tier");
    const uint64_t stream = GetBigEndian(it->key().data());
    next_sequence_ = std::max(next_sequence_, stream + 1);
    if (referenced.count(stream) == 0) {
      batch.DeleteRange(handles_[kChunks], ChunkKey(stream, 0), ChunkKey(stream + 1, 0));
      dropped++;
    }
    it->Seek(ChunkKey(stream + 1, 0));
  }
  GKV_RETURN_IF_ERROR(FromRocks(it->status(), "scanning disk tier chunks"));
  if (dropped == 0) return Status::OK();
  GKV_LOG_INFO("disk tier: deleting the chunks of {} streamed writes that were never committed",
               dropped);
  return FromRocks(RocksDbWrite(db_, rocksdb::WriteOptions(), &batch), "deleting chunks");
}

Status DiskTier::Delete(std::string_view key, bool sync) { return DeleteImpl(key, nullptr, sync); }

Status DiskTier::DeleteIfVersion(std::string_view key, uint64_t version, bool sync) {
  return DeleteImpl(key, &version, sync);
}

Status DiskTier::DeleteImpl(std::string_view key, const uint64_t* only_version, bool sync) {
  std::unique_lock<std::mutex> lock(write_mu_);
  ClaimLocked(lock, {key});
  std::string raw;
  rocksdb::Status s = db_->Get(rocksdb::ReadOptions(), handles_[kMeta], key, &raw);
  if (s.IsNotFound()) return Status::OK();
  GKV_RETURN_IF_ERROR(FromRocks(s, "disk tier metadata read"));
  MetaRecord r;
  GKV_RETURN_IF_ERROR(DecodeMeta(raw, &r));
  if (only_version && r.meta.version != *only_version) return Status::OK();
  rocksdb::WriteBatch batch;
  if (!r.meta.durable) batch.Delete(handles_[kOrder], OrderKey(r.sequence));
  batch.Delete(handles_[kMeta], key);
  DeleteValueTo(&batch, key, r.meta);
  const uint64_t bytes = r.meta.size + key.size();
  used_bytes_ -= bytes;
  if (r.meta.durable) durable_bytes_ -= bytes;
  object_count_--;
  Status ws = WriteClaimedLocked(lock, &batch, sync, {std::string(key)}, "disk tier delete");
  if (!ws.ok()) {
    used_bytes_ += bytes;
    if (r.meta.durable) durable_bytes_ += bytes;
    object_count_++;
    return ws;
  }
  return Status::OK();
}

Result<uint64_t> DiskTier::ReadVersionMark() const {
  std::string raw;
  rocksdb::Status s = db_->Get(rocksdb::ReadOptions(), handles_[0], kVersionMarkKey, &raw);
  if (s.IsNotFound()) return uint64_t{0};
  GKV_RETURN_IF_ERROR(FromRocks(s, "reading the version mark"));
  ByteReader rd(raw);
  uint64_t mark = 0;
  rd.U64(&mark);
  if (rd.failed() || rd.remaining() != 0) return Status::Corruption("bad version mark record");
  return mark;
}

Status DiskTier::WriteVersionMark(uint64_t mark) {
  std::string raw;
  ByteWriter w(&raw);
  w.U64(mark);
  rocksdb::WriteOptions wo;
  wo.sync = true;
  rocksdb::WriteBatch batch;
  batch.Put(handles_[0], kVersionMarkKey, raw);
  return FromRocks(RocksDbWrite(db_, wo, &batch), "writing the version mark");
}

Status DiskTier::ForEach(
    const std::function<bool(std::string_view, const StoredObjectMeta&)>& fn) const {
  std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(rocksdb::ReadOptions(), handles_[kMeta]));
  for (it->SeekToFirst(); it->Valid(); it->Next()) {
    MetaRecord r;
    GKV_RETURN_IF_ERROR(DecodeMeta(std::string_view(it->value().data(), it->value().size()), &r));
    if (!fn(std::string_view(it->key().data(), it->key().size()), r.meta)) break;
  }
  return FromRocks(it->status(), "disk tier scan");
}

Status DiskTier::Flush() {
  rocksdb::FlushOptions fo;
  for (size_t i = 1; i < handles_.size(); ++i) {
    GKV_RETURN_IF_ERROR(FromRocks(db_->Flush(fo, handles_[i]), "disk tier flush"));
  }
  return FromRocks(db_->FlushWAL(true), "disk tier WAL sync");
}

uint64_t DiskTier::used_bytes() const {
  std::lock_guard<std::mutex> lock(write_mu_);
  return used_bytes_;
}

uint64_t DiskTier::durable_bytes() const {
  std::lock_guard<std::mutex> lock(write_mu_);
  return durable_bytes_;
}

uint64_t DiskTier::object_count() const {
  std::lock_guard<std::mutex> lock(write_mu_);
  return object_count_;
}

}  // namespace gkv
