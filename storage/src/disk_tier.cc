#include "gkv/storage/disk_tier.h"

#include <rocksdb/db.h>
#include <rocksdb/options.h>
#include <rocksdb/write_batch.h>

#include <filesystem>

#include "gkv/bytes.h"
#include "gkv/log.h"

namespace gkv {
namespace {

constexpr size_t kData = 1, kMeta = 2, kOrder = 3;
constexpr uint8_t kMetaFormat = 1;

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

std::string EncodeMeta(const MetaRecord& r) {
  std::string out;
  ByteWriter w(&out);
  w.U8(kMetaFormat);
  w.U64(r.meta.version);
  w.U64(r.sequence);
  w.U64(r.meta.size);
  w.Tensor(r.meta.tensor);
  return out;
}

Status DecodeMeta(std::string_view in, MetaRecord* r) {
  ByteReader rd(in);
  uint8_t format = 0;
  rd.U8(&format);
  rd.U64(&r->meta.version);
  rd.U64(&r->sequence);
  rd.U64(&r->meta.size);
  rd.Tensor(&r->meta.tensor);
  if (rd.failed() || format != kMetaFormat || rd.remaining() != 0) {
    return Status::Corruption("bad metadata record in the disk tier");
  }
  return Status::OK();
}

std::string OrderKey(uint64_t sequence) {
  std::string k(8, '\0');
  for (int i = 0; i < 8; ++i) k[i] = static_cast<char>((sequence >> (56 - 8 * i)) & 0xff);
  return k;
}

}  // namespace

Result<std::unique_ptr<DiskTier>> DiskTier::Open(const Options& options) {
  if (options.capacity == 0) return Status::InvalidArgument("disk tier capacity is zero");
  std::error_code ec;
  std::filesystem::create_directories(options.path, ec);
  if (ec) {
    return Status::IOError("cannot create disk tier directory '" + options.path +
                           "': " + ec.message());
  }
  std::unique_ptr<DiskTier> tier(new DiskTier(options));

  rocksdb::DBOptions db_options;
  db_options.create_if_missing = true;
  db_options.create_missing_column_families = true;
  db_options.max_background_jobs = 2;
  db_options.info_log_level = rocksdb::InfoLogLevel::WARN_LEVEL;
  db_options.keep_log_file_num = 2;

  rocksdb::ColumnFamilyOptions data_options;
  data_options.enable_blob_files = true;
  data_options.min_blob_size = options.min_blob_size;
  data_options.enable_blob_garbage_collection = true;
  data_options.blob_compression_type = rocksdb::kNoCompression;  // tensors rarely compress
  data_options.write_buffer_size = 64 << 20;
  rocksdb::ColumnFamilyOptions small_options;

  std::vector<rocksdb::ColumnFamilyDescriptor> families = {
      {rocksdb::kDefaultColumnFamilyName, small_options},
      {"data", data_options},
      {"meta", small_options},
      {"order", small_options},
  };
  GKV_RETURN_IF_ERROR(
      FromRocks(rocksdb::DB::Open(db_options, options.path, families, &tier->handles_, &tier->db_),
                "opening the disk tier at '" + options.path + "'"));

  // Warm restart: rebuild the byte count and the write sequence from the metadata.
  std::unique_ptr<rocksdb::Iterator> it(
      tier->db_->NewIterator(rocksdb::ReadOptions(), tier->handles_[kMeta]));
  for (it->SeekToFirst(); it->Valid(); it->Next()) {
    MetaRecord r;
    GKV_RETURN_IF_ERROR(DecodeMeta(std::string_view(it->value().data(), it->value().size()), &r));
    tier->used_bytes_ += r.meta.size + it->key().size();
    tier->object_count_++;
    tier->next_sequence_ = std::max(tier->next_sequence_, r.sequence + 1);
  }
  GKV_RETURN_IF_ERROR(FromRocks(it->status(), "scanning disk tier metadata"));
  return tier;
}

DiskTier::~DiskTier() {
  if (!db_) return;
  db_->FlushWAL(true);
  for (auto* h : handles_) db_->DestroyColumnFamilyHandle(h);
  rocksdb::Status s = db_->Close();
  if (!s.ok()) GKV_LOG_WARN("closing the disk tier: {}", s.ToString());
  delete db_;
}

Status DiskTier::Put(std::string_view key, const StoredObjectMeta& meta, const void* data,
                     bool sync, std::vector<DiskEviction>* evicted, bool* written) {
  if (written) *written = false;
  const uint64_t bytes = meta.size + key.size();
  if (bytes > options_.capacity) {
    return Status::NoSpace("object of " + std::to_string(meta.size) +
                           " bytes exceeds the disk tier capacity");
  }
  std::lock_guard<std::mutex> lock(write_mu_);
  rocksdb::WriteBatch batch;
  std::string old;
  uint64_t old_bytes = 0;
  bool existed = false;
  rocksdb::Status s = db_->Get(rocksdb::ReadOptions(), handles_[kMeta], key, &old);
  if (s.ok()) {
    MetaRecord r;
    GKV_RETURN_IF_ERROR(DecodeMeta(old, &r));
    if (r.meta.version > meta.version) return Status::OK();
    batch.Delete(handles_[kOrder], OrderKey(r.sequence));
    old_bytes = r.meta.size + key.size();
    existed = true;
  } else if (!s.IsNotFound()) {
    return FromRocks(s, "disk tier metadata read");
  }
  MetaRecord r{meta, next_sequence_++};
  batch.Put(handles_[kData], key,
            rocksdb::Slice(static_cast<const char*>(data), static_cast<size_t>(meta.size)));
  batch.Put(handles_[kMeta], key, EncodeMeta(r));
  batch.Put(handles_[kOrder], OrderKey(r.sequence), key);
  rocksdb::WriteOptions wo;
  wo.sync = sync;
  GKV_RETURN_IF_ERROR(FromRocks(db_->Write(wo, &batch), "disk tier write"));
  if (written) *written = true;
  used_bytes_ = used_bytes_ - old_bytes + bytes;
  if (!existed) object_count_++;
  if (used_bytes_ > options_.capacity) return EvictOldestLocked(key, evicted);
  return Status::OK();
}

Status DiskTier::EvictOldestLocked(std::string_view keep_key, std::vector<DiskEviction>* evicted) {
  std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(rocksdb::ReadOptions(), handles_[kOrder]));
  rocksdb::WriteBatch batch;
  uint64_t freed = 0, removed = 0;
  for (it->SeekToFirst(); it->Valid() && used_bytes_ - freed > options_.capacity; it->Next()) {
    std::string key = it->value().ToString();
    if (key == keep_key) continue;
    std::string raw;
    MetaRecord r;
    GKV_RETURN_IF_ERROR(
        FromRocks(db_->Get(rocksdb::ReadOptions(), handles_[kMeta], key, &raw), "eviction read"));
    GKV_RETURN_IF_ERROR(DecodeMeta(raw, &r));
    batch.Delete(handles_[kOrder], it->key());
    batch.Delete(handles_[kMeta], key);
    batch.Delete(handles_[kData], key);
    freed += r.meta.size + key.size();
    removed++;
    if (evicted) evicted->push_back({key, r.meta.version});
  }
  GKV_RETURN_IF_ERROR(FromRocks(it->status(), "disk tier eviction scan"));
  GKV_RETURN_IF_ERROR(FromRocks(db_->Write(rocksdb::WriteOptions(), &batch), "disk eviction"));
  used_bytes_ -= freed;
  object_count_ -= removed;
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

Status DiskTier::Get(std::string_view key, StoredObjectMeta* meta, std::string* value) const {
  // A snapshot makes the metadata and the value agree even if a writer replaces the key.
  const rocksdb::Snapshot* snap = db_->GetSnapshot();
  rocksdb::ReadOptions ro;
  ro.snapshot = snap;
  std::string raw;
  rocksdb::Status s = db_->Get(ro, handles_[kMeta], key, &raw);
  if (s.ok()) s = db_->Get(ro, handles_[kData], key, value);
  db_->ReleaseSnapshot(snap);
  if (s.IsNotFound()) return Status::NotFound("key not on disk");
  GKV_RETURN_IF_ERROR(FromRocks(s, "disk tier read"));
  MetaRecord r;
  GKV_RETURN_IF_ERROR(DecodeMeta(raw, &r));
  if (value->size() != r.meta.size) {
    return Status::Corruption("disk tier value size does not match its metadata");
  }
  *meta = r.meta;
  return Status::OK();
}

Status DiskTier::Delete(std::string_view key) {
  std::lock_guard<std::mutex> lock(write_mu_);
  return DeleteLocked(key, nullptr);
}

Status DiskTier::DeleteIfVersion(std::string_view key, uint64_t version) {
  std::lock_guard<std::mutex> lock(write_mu_);
  return DeleteLocked(key, &version);
}

Status DiskTier::DeleteLocked(std::string_view key, const uint64_t* only_version) {
  std::string raw;
  rocksdb::Status s = db_->Get(rocksdb::ReadOptions(), handles_[kMeta], key, &raw);
  if (s.IsNotFound()) return Status::OK();
  GKV_RETURN_IF_ERROR(FromRocks(s, "disk tier metadata read"));
  MetaRecord r;
  GKV_RETURN_IF_ERROR(DecodeMeta(raw, &r));
  if (only_version && r.meta.version != *only_version) return Status::OK();
  rocksdb::WriteBatch batch;
  batch.Delete(handles_[kOrder], OrderKey(r.sequence));
  batch.Delete(handles_[kMeta], key);
  batch.Delete(handles_[kData], key);
  GKV_RETURN_IF_ERROR(FromRocks(db_->Write(rocksdb::WriteOptions(), &batch), "disk tier delete"));
  used_bytes_ -= r.meta.size + key.size();
  object_count_--;
  return Status::OK();
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

uint64_t DiskTier::object_count() const {
  std::lock_guard<std::mutex> lock(write_mu_);
  return object_count_;
}

}  // namespace gkv
