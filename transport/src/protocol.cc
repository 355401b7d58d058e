#include "gkv/transport/protocol.h"

#include <algorithm>

#include "gkv/bytes.h"

namespace gkv::wire {
namespace {

Status Malformed(std::string_view what) {
  return Status::ProtocolError("malformed " + std::string(what));
}

bool ValidCode(uint8_t c) { return c <= static_cast<uint8_t>(kLastStatusCode); }

void WriteMeta(ByteWriter& w, const ObjectMeta& m) {
  w.U64(m.size);
  w.U64(m.version);
  w.Tensor(m.tensor);
  w.U8(m.tier);
  w.U8(m.on_disk ? 1 : 0);
}

bool ReadMeta(ByteReader& r, ObjectMeta* m) {
  uint8_t on_disk = 0;
  if (!r.U64(&m->size) || !r.U64(&m->version) || !r.Tensor(&m->tensor) || !r.U8(&m->tier) ||
      !r.U8(&on_disk)) {
    return false;
  }
  m->on_disk = on_disk != 0;
  return m->tier <= 2 && on_disk <= 1;
}

void WriteStatus(ByteWriter& w, const Status& s) {
  w.U8(static_cast<uint8_t>(s.code()));
  std::string_view m = s.message();
  w.String(m.substr(0, kMaxMessageText));
}

bool ReadStatus(ByteReader& r, ReplyStatus* s) {
  uint8_t code;
  if (!r.U8(&code) || !ValidCode(code) || !r.String(&s->message, kMaxMessageText)) return false;
  s->code = static_cast<StatusCode>(code);
  return true;
}

}  // namespace

std::string_view OpcodeName(Opcode op) {
  switch (op) {
    case Opcode::kPing:
      return "ping";
    case Opcode::kPut:
      return "put";
    case Opcode::kGet:
      return "get";
    case Opcode::kDelete:
      return "delete";
    case Opcode::kStat:
      return "stat";
    case Opcode::kMultiGet:
      return "mget";
    case Opcode::kMultiPut:
      return "mput";
    case Opcode::kStats:
      return "stats";
    case Opcode::kHello:
      return "hello";
    case Opcode::kReplicaPut:
      return "replica_put";
    case Opcode::kInvalidate:
      return "invalidate";
    case Opcode::kPeerHello:
      return "peer_hello";
    case Opcode::kLoadReport:
      return "load_report";
    case Opcode::kHandoffPut:
      return "handoff_put";
    case Opcode::kPutChunk:
      return "put_chunk";
    case Opcode::kRepair:
      return "repair";
  }
  return "unknown";
}

std::string EncodeMessage(const Header& h, std::string_view body) {
  std::string out;
  EncodeMessageTo(&out, h, body);
  return out;
}

void EncodeMessageTo(std::string* out, const Header& h, std::string_view body) {
  out->clear();
  out->reserve(kFixedHeaderSize + body.size());
  ByteWriter w(out);
  w.U32(kMagic);
  w.U8(kVersion);
  w.U8(static_cast<uint8_t>(h.opcode));
  w.U16(h.flags);
  w.U64(h.request_id);
  w.U32(static_cast<uint32_t>(body.size()));
  w.U32(h.budget_ms);
  w.Bytes(body.data(), body.size());
}

Status DecodeMessage(const void* data, size_t size, Header* h, std::string_view* body) {
  ByteReader r(data, size);
  uint32_t magic = 0, body_len = 0;
  uint8_t version = 0, opcode = 0;
  // Magic and version first: a message of another version (whose header may be shorter) is
  // refused by name.
  if (!r.U32(&magic) || !r.U8(&version)) {
    return Status::ProtocolError("message shorter than the 24-byte header");
  }
  if (magic != kMagic) return Status::ProtocolError("bad magic: not a gkv message");
  if (version != kVersion) {
    return Status::ProtocolError("protocol version " + std::to_string(version) +
                                 " is not supported (this side speaks " + std::to_string(kVersion) +
                                 ")");
  }
  if (!r.U8(&opcode) || !r.U16(&h->flags) || !r.U64(&h->request_id) || !r.U32(&body_len) ||
      !r.U32(&h->budget_ms)) {
    return Status::ProtocolError("message shorter than the 24-byte header");
  }
  if (opcode < static_cast<uint8_t>(Opcode::kPing) ||
      opcode > static_cast<uint8_t>(Opcode::kPutChunk)) {
    return Status::ProtocolError("unknown opcode " + std::to_string(opcode));
  }
  if (body_len != r.remaining()) {
    return Status::ProtocolError("body length " + std::to_string(body_len) + " but " +
                                 std::to_string(r.remaining()) + " bytes arrived");
  }
  h->opcode = static_cast<Opcode>(opcode);
  r.Bytes(body_len, body);
  return Status::OK();
}

std::string EncodePutRequest(const PutRequest& p) {
  std::string out;
  EncodePutRequestTo(&out, p);
  return out;
}

void EncodePutRequestTo(std::string* out, const PutRequest& p) {
  out->clear();
  ByteWriter w(out);
  w.String(p.key);
  w.Tensor(p.tensor);
  w.U64(p.size);
}

Status DecodePutRequest(std::string_view body, PutRequest* p) {
  ByteReader r(body);
  if (!r.String(&p->key, kMaxKeySize) || !r.Tensor(&p->tensor) || !r.U64(&p->size) ||
      r.remaining() != 0) {
    return Malformed("put request");
  }
  return Status::OK();
}

std::string EncodeKeyRequest(std::string_view key) {
  std::string out;
  EncodeKeyRequestTo(&out, key);
  return out;
}

void EncodeKeyRequestTo(std::string* out, std::string_view key) {
  out->clear();
  ByteWriter(out).String(key);
}

Status DecodeKeyRequest(std::string_view body, std::string* key) {
  ByteReader r(body);
  if (!r.String(key, kMaxKeySize) || r.remaining() != 0) return Malformed("key request");
  return Status::OK();
}

std::string EncodeHello(std::string_view secret) { return EncodeKeyRequest(secret); }

Status DecodeHello(std::string_view body, std::string* secret) {
  ByteReader r(body);
  if (!r.String(secret, kMaxMessageText) || r.remaining() != 0) return Malformed("hello");
  return Status::OK();
}

std::string EncodePeerHello(std::string_view node_id, std::string_view peer_secret,
                            uint32_t placement) {
  std::string out;
  ByteWriter w(&out);
  w.String(node_id);
  w.String(peer_secret);
  w.U32(placement);
  return out;
}

Status DecodePeerHello(std::string_view body, std::string* node_id, std::string* peer_secret,
                       uint32_t* placement) {
  ByteReader r(body);
  if (!r.String(node_id, kMaxMessageText) || !r.String(peer_secret, kMaxMessageText)) {
    return Malformed("peer hello");
  }
  *placement = 1;  // a hello from before placement versions
  // Bytes after the placement are left for fields later builds may add.
  if (r.remaining() != 0 && !r.U32(placement)) return Malformed("peer hello");
  return Status::OK();
}

std::string EncodeKeyList(const std::vector<std::string>& keys,
                          const std::vector<uint64_t>* versions) {
  std::string out;
  ByteWriter w(&out);
  w.U32(static_cast<uint32_t>(keys.size()));
  for (size_t i = 0; i < keys.size(); ++i) {
    w.String(keys[i]);
    if (versions) w.U64((*versions)[i]);
  }
  return out;
}

Status DecodeKeyList(std::string_view block, std::vector<std::string>* keys,
                     std::vector<uint64_t>* versions) {
  ByteReader r(block);
  uint32_t n = 0;
  // Each key needs at least its 4-byte length (and its version): a count beyond that is a lie.
  const size_t min_entry = versions ? 12 : 4;
  if (!r.U32(&n) || n > kMaxBatch || n > r.remaining() / min_entry) return Malformed("key list");
  keys->resize(n);
  if (versions) versions->assign(n, 0);
  for (uint32_t i = 0; i < n; ++i) {
    if (!r.String(&(*keys)[i], kMaxKeySize)) return Malformed("key list");
    if (versions && !r.U64(&(*versions)[i])) return Malformed("key list");
  }
  if (r.remaining() != 0) return Malformed("key list");
  return Status::OK();
}

std::string EncodeBatchPutBlock(const std::vector<BatchPutItem>& items, bool versioned) {
  std::string out;
  ByteWriter w(&out);
  w.U32(static_cast<uint32_t>(items.size()));
  for (const auto& it : items) {
    w.String(it.key);
    w.Tensor(it.tensor);
    w.U64(it.size);
    if (versioned) w.U64(it.version);
  }
  return out;
}

Status DecodeBatchPutBlock(std::string_view payload, std::vector<BatchPutItem>* items,
                           size_t* block_size, bool versioned) {
  ByteReader r(payload);
  uint32_t n = 0;
  // Minimum item: 4 (key length) + 2 (dtype, rank) + 8 (size) (+ 8 version).
  const size_t min_item = versioned ? 22 : 14;
  if (!r.U32(&n) || n > kMaxBatch || n > r.remaining() / min_item) {
    return Malformed("batch put block");
  }
  items->resize(n);
  uint64_t total = 0;
  for (auto& it : *items) {
    if (!r.String(&it.key, kMaxKeySize) || !r.Tensor(&it.tensor) || !r.U64(&it.size)) {
      return Malformed("batch put block");
    }
    it.version = 0;
    if (versioned && (!r.U64(&it.version) || it.version == 0)) {
      return Malformed("batch put block (item version)");
    }
    // Every size and the running total stay within the payload (no overflow).
    if (it.size > payload.size() - total) return Malformed("batch put block (item size)");
    total += it.size;
  }
  *block_size = payload.size() - r.remaining();
  if (total != r.remaining()) {
    return Status::ProtocolError("batch put: item sizes add up to " + std::to_string(total) +
                                 " bytes but " + std::to_string(r.remaining()) + " arrived");
  }
  return Status::OK();
}

void AppendVersion(std::string* body, uint64_t version) {
  ByteWriter w(body);
  w.U64(version);
}

Status TakeVersion(std::string_view* body, uint64_t* version, bool zero_ok) {
  if (body->size() < 8) return Malformed("trailing version");
  ByteReader r(body->substr(body->size() - 8));
  if (!r.U64(version) || (*version == 0 && !zero_ok)) return Malformed("trailing version");
  body->remove_suffix(8);
  return Status::OK();
}

std::string EncodeStatusReply(const Status& s) {
  std::string out;
  ByteWriter w(&out);
  WriteStatus(w, s);
  return out;
}

Status DecodeStatusReply(std::string_view body, ReplyStatus* status) {
  ByteReader r(body);
  if (!ReadStatus(r, status) || r.remaining() != 0) return Malformed("status reply");
  return Status::OK();
}

Status DecodeStatusPrefix(std::string_view body, ReplyStatus* status) {
  ByteReader r(body);
  if (!ReadStatus(r, status)) return Malformed("reply status");
  return Status::OK();
}

std::string EncodeObjectReply(const Status& s, const ObjectMeta& meta,
                              const std::vector<uint16_t>& replica_hint) {
  std::string out;
  EncodeObjectReplyTo(&out, s, meta, replica_hint);
  return out;
}

void EncodeObjectReplyTo(std::string* out, const Status& s, const ObjectMeta& meta,
                         const std::vector<uint16_t>& replica_hint) {
  out->clear();
  ByteWriter w(out);
  WriteStatus(w, s);
  if (s.ok()) {
    WriteMeta(w, meta);
    if (!replica_hint.empty()) {
      w.U8(static_cast<uint8_t>(replica_hint.size()));
      for (uint16_t n : replica_hint) w.U16(n);
    }
  }
}

Status DecodeObjectReply(std::string_view body, ReplyStatus* status, ObjectMeta* meta,
                         std::vector<uint16_t>* replica_hint) {
  ByteReader r(body);
  if (!ReadStatus(r, status)) return Malformed("object reply");
  if (status->code == StatusCode::kOk && !ReadMeta(r, meta)) return Malformed("object reply");
  if (status->code == StatusCode::kOk && r.remaining() > 0) {
    uint8_t n = 0;
    if (!r.U8(&n) || r.remaining() != 2u * n) return Malformed("object reply (replica hint)");
    std::vector<uint16_t> nodes(n);
    for (auto& v : nodes) r.U16(&v);
    if (replica_hint) *replica_hint = std::move(nodes);
  }
  if (r.remaining() != 0) return Malformed("object reply");
  return Status::OK();
}

void EncodeRangeGetTo(std::string* out, std::string_view key, const GetRange& range) {
  out->clear();
  ByteWriter w(out);
  w.String(key);
  w.U64(range.offset);
  w.U64(range.length);
  w.U64(range.version);
}

Status DecodeRangeGet(std::string_view body, std::string* key, GetRange* range) {
  ByteReader r(body);
  if (!r.String(key, kMaxKeySize) || !r.U64(&range->offset) || !r.U64(&range->length) ||
      !r.U64(&range->version) || r.remaining() != 0) {
    return Malformed("range get");
  }
  return Status::OK();
}

std::string EncodeReplicaGet(std::string_view key, uint64_t version) {
  std::string out;
  ByteWriter w(&out);
  w.String(key);
  w.U64(version);
  return out;
}

Status DecodeReplicaGet(std::string_view body, std::string* key, uint64_t* version) {
  ByteReader r(body);
  if (!r.String(key, kMaxKeySize) || !r.U64(version) || r.remaining() != 0) {
    return Malformed("replica get");
  }
  return Status::OK();
}

std::string EncodeReplicaPut(const PutRequest& p, uint64_t version, uint64_t attempt) {
  std::string out = EncodePutRequest(p);
  ByteWriter w(&out);
  w.U64(version);
  w.U64(attempt);
  return out;
}

Status DecodeReplicaPut(std::string_view body, PutRequest* p, uint64_t* version,
                        uint64_t* attempt) {
  if (body.size() < 16) return Malformed("replica put");
  GKV_RETURN_IF_ERROR(DecodePutRequest(body.substr(0, body.size() - 16), p));
  ByteReader r(body.substr(body.size() - 16));
  r.U64(version);
  r.U64(attempt);
  return Status::OK();
}

std::string EncodeHandoffPut(const PutRequest& p, uint64_t version) {
  std::string out = EncodePutRequest(p);
  ByteWriter(&out).U64(version);
  return out;
}

std::string EncodeRepair(std::string_view key, std::string_view target_id, uint64_t seen) {
  std::string out;
  ByteWriter w(&out);
  w.String(key);
  w.String(target_id);
  w.U64(seen);
  return out;
}

Status DecodeRepair(std::string_view body, std::string* key, std::string* target_id,
                    uint64_t* seen) {
  ByteReader r(body);
  if (!r.String(key, kMaxKeySize) || !r.String(target_id, kMaxMessageText) || !r.U64(seen) ||
      r.remaining() != 0) {
    return Malformed("repair");
  }
  return Status::OK();
}

Status DecodeHandoffPut(std::string_view body, PutRequest* p, uint64_t* version) {
  if (body.size() < 8) return Malformed("handoff put");
  GKV_RETURN_IF_ERROR(DecodePutRequest(body.substr(0, body.size() - 8), p));
  ByteReader r(body.substr(body.size() - 8));
  r.U64(version);
  return Status::OK();
}

std::string EncodeInvalidate(std::string_view key, uint64_t version, uint64_t attempt) {
  std::string out = EncodeReplicaGet(key, version);
  ByteWriter(&out).U64(attempt);
  return out;
}

Status DecodeInvalidate(std::string_view body, std::string* key, uint64_t* version,
                        uint64_t* attempt) {
  if (body.size() < 8) return Malformed("invalidate");
  GKV_RETURN_IF_ERROR(DecodeReplicaGet(body.substr(0, body.size() - 8), key, version));
  ByteReader r(body.substr(body.size() - 8));
  r.U64(attempt);
  return Status::OK();
}

std::string EncodeLoadReport(uint64_t reads_per_s) {
  std::string out;
  ByteWriter(&out).U64(reads_per_s);
  return out;
}

Status DecodeLoadReport(std::string_view body, uint64_t* reads_per_s) {
  ByteReader r(body);
  if (!r.U64(reads_per_s) || r.remaining() != 0) return Malformed("load report");
  return Status::OK();
}

std::string EncodePutReply(const Status& s, uint64_t version) {
  std::string out;
  ByteWriter w(&out);
  WriteStatus(w, s);
  if (s.ok()) w.U64(version);
  return out;
}

Status DecodePutReply(std::string_view body, ReplyStatus* status, uint64_t* version) {
  ByteReader r(body);
  if (!ReadStatus(r, status)) return Malformed("put reply");
  if (status->code == StatusCode::kOk && !r.U64(version)) return Malformed("put reply");
  if (r.remaining() != 0) return Malformed("put reply");
  return Status::OK();
}

std::string EncodeStreamReply(const Status& s, const StreamGrant& grant) {
  std::string out;
  ByteWriter w(&out);
  WriteStatus(w, s);
  if (s.ok()) {
    w.U64(grant.stream);
    w.U32(grant.chunk_size);
    w.U16(grant.window);
  }
  return out;
}

Status DecodeStreamReply(std::string_view body, ReplyStatus* status, StreamGrant* grant) {
  ByteReader r(body);
  if (!ReadStatus(r, status)) return Malformed("stream reply");
  if (status->code == StatusCode::kOk &&
      (!r.U64(&grant->stream) || !r.U32(&grant->chunk_size) || !r.U16(&grant->window) ||
       grant->stream == 0 || grant->chunk_size == 0 || grant->window == 0)) {
    return Malformed("stream reply");
  }
  if (r.remaining() != 0) return Malformed("stream reply");
  return Status::OK();
}

std::string EncodePutChunk(uint64_t stream, uint64_t offset) {
  std::string out;
  ByteWriter w(&out);
  w.U64(stream);
  w.U64(offset);
  return out;
}

Status DecodePutChunk(std::string_view body, uint64_t* stream, uint64_t* offset) {
  ByteReader r(body);
  if (!r.U64(stream) || !r.U64(offset) || r.remaining() != 0 || *stream == 0) {
    return Malformed("put_chunk request");
  }
  return Status::OK();
}

std::string EncodePingReply(const Status& s, std::string_view node_id) {
  std::string out;
  ByteWriter w(&out);
  WriteStatus(w, s);
  w.String(node_id);
  return out;
}

Status DecodePingReply(std::string_view body, ReplyStatus* status, std::string* node_id) {
  ByteReader r(body);
  if (!ReadStatus(r, status) || !r.String(node_id, kMaxMessageText) || r.remaining() != 0) {
    return Malformed("ping reply");
  }
  return Status::OK();
}

std::string EncodeBatchGetBlock(const std::vector<BatchGetResult>& results) {
  std::string out;
  ByteWriter w(&out);
  w.U32(static_cast<uint32_t>(results.size()));
  for (const auto& res : results) {
    w.U8(static_cast<uint8_t>(res.code));
    if (res.code != StatusCode::kOk) continue;
    WriteMeta(w, res.meta);
    const size_t n = std::min<size_t>(res.hint.size(), UINT8_MAX);
    w.U8(static_cast<uint8_t>(n));
    for (size_t i = 0; i < n; ++i) w.U16(res.hint[i]);
  }
  return out;
}

Status DecodeBatchGetBlock(std::string_view payload, std::vector<BatchGetResult>* results,
                           size_t* block_size) {
  ByteReader r(payload);
  uint32_t n = 0;
  if (!r.U32(&n) || n > kMaxBatch || n > r.remaining()) return Malformed("batch get block");
  results->resize(n);
  uint64_t total = 0;
  for (auto& res : *results) {
    uint8_t code;
    if (!r.U8(&code) || !ValidCode(code)) return Malformed("batch get block");
    res.code = static_cast<StatusCode>(code);
    if (res.code == StatusCode::kOk) {
      uint8_t hints = 0;
      // Every size and the running total stay within the payload (no overflow).
      if (!ReadMeta(r, &res.meta) || res.meta.size > payload.size() - total || !r.U8(&hints) ||
          r.remaining() < 2u * hints) {
        return Malformed("batch get block");
      }
      res.hint.resize(hints);
      for (auto& h : res.hint) r.U16(&h);
      total += res.meta.size;
    }
  }
  *block_size = payload.size() - r.remaining();
  if (total != r.remaining()) return Malformed("batch get block (value sizes)");
  return Status::OK();
}

std::string EncodeBatchPutResults(const std::vector<BatchPutResult>& results) {
  std::string out;
  ByteWriter w(&out);
  w.U32(static_cast<uint32_t>(results.size()));
  for (const auto& res : results) {
    w.U8(static_cast<uint8_t>(res.code));
    w.U64(res.version);
  }
  return out;
}

Status DecodeBatchPutResults(std::string_view payload, std::vector<BatchPutResult>* results) {
  ByteReader r(payload);
  uint32_t n = 0;
  if (!r.U32(&n) || n > kMaxBatch || n != r.remaining() / 9 || r.remaining() % 9 != 0) {
    return Malformed("batch put results");
  }
  results->resize(n);
  for (auto& res : *results) {
    uint8_t code;
    if (!r.U8(&code) || !ValidCode(code) || !r.U64(&res.version)) {
      return Malformed("batch put results");
    }
    res.code = static_cast<StatusCode>(code);
  }
  return Status::OK();
}

}  // namespace gkv::wire
