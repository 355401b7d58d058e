// The gkv wire protocol, version 2. docs/PROTOCOL.md describes it byte by byte.
//
// Every message is one UCX active message. Requests use AM id kAmRequest, replies kAmReply.
//   AM header = fixed header (24 bytes) + body (body_len bytes, op-specific fields)
//   AM data   = payload (value bytes; for batch ops: a metadata block, then the values)
// Fixed header, little-endian:
//   u32 magic 'GKV1' | u8 version | u8 opcode | u16 flags | u64 request_id | u32 body_len |
//   u32 budget_ms (requests: what is left of the caller's deadline when sent, 0 = none)
// Decoders check every length against what arrived and refuse trailing bytes; they never
// allocate more than the input justifies. All functions are pure and thread-safe.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "gkv/status.h"
#include "gkv/tensor.h"

namespace gkv::wire {

inline constexpr uint32_t kMagic = 0x31564B47;  // "GKV1" read as little-endian
inline constexpr uint8_t kVersion = 5;
inline constexpr size_t kFixedHeaderSize = 24;
inline constexpr unsigned kAmRequest = 0x6b1;
inline constexpr unsigned kAmReply = 0x6b2;

// Hard limits of the format (servers apply their own, smaller, configured limits on top).
inline constexpr size_t kMaxKeySize = 64 * 1024;
inline constexpr size_t kMaxMessageText = 4096;
inline constexpr size_t kMaxBatch = 1 << 20;

enum class Opcode : uint8_t {
  kPing = 1,
  kPut = 2,
  kGet = 3,
  kDelete = 4,
  kStat = 5,
  kMultiGet = 6,
  kMultiPut = 7,
  kStats = 8,
  kHello = 9,        // first message on a connection when the cluster has a secret
  kReplicaPut = 10,  // primary -> replica node: install a copy of a hot key's version
  kInvalidate = 11,  // primary -> replica node: drop copies of a key up to a version
  kPeerHello = 12,   // first message on a node -> node connection: the caller's node id
  kLoadReport = 13,  // node -> node, once a second: the sender's read rate (replication)
  kHandoffPut = 14,  // node -> new owner: a key that moved with the ring (membership)
  kRepair = 15,      // client -> a key's node: push your copy to a replica that lags (read repair)
  kPutChunk = 16,    // client -> node: one piece of a streamed put (kFlagStreamed)
};
std::string_view OpcodeName(Opcode op);

// Header flags.
inline constexpr uint16_t kFlagDurable = 1 << 0;  // put/multiput: write through to disk
inline constexpr uint16_t kFlagReplicaRead =
    1 << 1;  // get: read a replica copy (body adds u64 version)
// mget: every key of the list carries a u64 version; 0 reads the node's own object, any other
// value reads the replica copy of exactly that version (as kFlagReplicaRead does for a get).
inline constexpr uint16_t kFlagVersionedKeys = 1 << 2;
// invalidate: every copy the receiver holds of keys the sender owns (a node that just started
// has no record of the copies its previous run made); key, version and attempt are ignored.
inline constexpr uint16_t kFlagAllKeys = 1 << 3;
// get, stat, mget: asked of the key's owner in the previous ring while a handoff runs, so the
// node serves the key although the current ring gives it to another node.
inline constexpr uint16_t kFlagPreviousOwner = 1 << 4;
// get, stat: a client's last ask of the key's owner, after every owner and previous owner
// missed while keys may be moving: a node catching up after a restart on its old disk serves a
// recovered key it otherwise holds back (docs/ARCHITECTURE.md, "Membership").
inline constexpr uint16_t kFlagLastResort = 1 << 5;
// put, delete, mput: the client assigned the write's version (a hybrid clock of its own), so
// every replica of the write gives it the same version and read repair can compare them. PUT
// and DELETE bodies end with the u64 version; each MPUT block item carries one after its size.
// The node commits a put at that version, or just above the key's version if the key already
// holds a newer one (docs/ARCHITECTURE.md, "Failures").
inline constexpr uint16_t kFlagClientVersion = 1 << 6;
// handoff_put (a read repair's push): the body ends with the u64 version the receiver must
// still hold for the key (0: none) for the copy to be installed; otherwise nothing changes.
inline constexpr uint16_t kFlagExpectVersion = 1 << 7;
// put: the value follows in pieces (a streamed put, for values too large to send or stage as
// one). The PUT carries no payload; its size is the whole value's. The reply (StreamReply)
// names a stream and the largest piece and number of pieces in flight the node takes; each
// PUT_CHUNK then carries the stream, an offset and bytes, and is answered with a Put reply
// whose version is 0 except for the one piece that completed the value, answered with the
// version the value was committed at (or the commit's error).
inline constexpr uint16_t kFlagStreamed = 1 << 8;
// get: a range of the value (GetRange): the body is the key followed by u64 offset, u64 length
// and u64 version (0: whichever version the node holds; else the node must hold exactly that
// one, or it answers `aborted`). The reply is a Get reply whose metadata describes the whole
// object (its size is the value's) and whose payload is the value's bytes from `offset`, at
// most `length` of them, or else the whole value (a node may send all of a value that is not
// in memory). A client stages a large value for a device buffer piece by piece with it.
inline constexpr uint16_t kFlagRange = 1 << 9;
// handoff_put: the sender stays an owner of the key and keeps its copy (a copy for a new
// co-owner, a repair), so the receiver never sends this version back to it (the pass over
// recently written keys would otherwise bounce a key between two owners whose previous rings
// differ). Without it the sender may delete its copy once the put is acknowledged.
inline constexpr uint16_t kFlagSenderKeeps = 1 << 10;

struct Header {
  Opcode opcode = Opcode::kPing;
  uint16_t flags = 0;
  uint64_t request_id = 0;
  // Requests: milliseconds left of the caller's deadline when it sent the request (0: none). A
  // node drops work whose budget ran out before it started (the caller has given up).
  uint32_t budget_ms = 0;
};

// Fixed header + body, ready to be the AM header.
std::string EncodeMessage(const Header& h, std::string_view body);
// The same into `out` (replacing what it held): a caller that keeps one buffer allocates nothing
// per message once it has grown.
void EncodeMessageTo(std::string* out, const Header& h, std::string_view body);
// ProtocolError for a short buffer, a wrong magic, an unknown version or opcode, or a body_len
// that disagrees with the buffer. `body` views into `data`.
Status DecodeMessage(const void* data, size_t size, Header* h, std::string_view* body);

// Metadata of a stored object as it travels.
struct ObjectMeta {
  uint64_t size = 0;
  uint64_t version = 0;
  TensorMeta tensor;
  uint8_t tier = 0;  // gkv::Tier as a number
  bool on_disk = false;
};

// --- request bodies ---
struct PutRequest {
  std::string key;
  TensorMeta tensor;
  uint64_t size = 0;  // must equal the payload length
};
std::string EncodePutRequest(const PutRequest& r);
// The same into *out (cleared first): a buffer reused per thread allocates nothing.
void EncodePutRequestTo(std::string* out, const PutRequest& r);
Status DecodePutRequest(std::string_view body, PutRequest* r);

// Get, Delete, Stat.
std::string EncodeKeyRequest(std::string_view key);
void EncodeKeyRequestTo(std::string* out, std::string_view key);
Status DecodeKeyRequest(std::string_view body, std::string* key);

// Hello: a proof of the cluster secret (gkv/transport/hello_proof.h), never the secret.
std::string EncodeHello(std::string_view proof);
Status DecodeHello(std::string_view body, std::string* proof);
// Peer hello: the calling node's id, a proof of the peer secret (empty when the cluster has
// none; gkv/transport/hello_proof.h) and the caller's placement version
// (HashRing::kPlacementVersion; a hello without it, from a build before placement versions, decodes
// as version 1; bytes after it are left for later fields).
std::string EncodePeerHello(std::string_view node_id, std::string_view proof, uint32_t placement);
Status DecodePeerHello(std::string_view body, std::string* node_id, std::string* proof,
                       uint32_t* placement);

// MultiGet: the body is empty; the payload is this block. With `versions` (same length as
// keys; the request then has kFlagVersionedKeys) each key is followed by its u64 version.
std::string EncodeKeyList(const std::vector<std::string>& keys,
                          const std::vector<uint64_t>* versions = nullptr);
Status DecodeKeyList(std::string_view block, std::vector<std::string>* keys,
                     std::vector<uint64_t>* versions = nullptr);

// MultiPut: the payload is this block followed by the values in order; the body is empty.
struct BatchPutItem {
  std::string key;
  TensorMeta tensor;
  uint64_t size = 0;
  uint64_t version = 0;  // on the wire only with kFlagClientVersion (`versioned`)
};
std::string EncodeBatchPutBlock(const std::vector<BatchPutItem>& items, bool versioned = false);
// `block_size` receives the length of the metadata block (values start there).
Status DecodeBatchPutBlock(std::string_view payload, std::vector<BatchPutItem>* items,
                           size_t* block_size, bool versioned = false);

// kFlagClientVersion on PUT and DELETE: the body ends with the client's u64 version.
void AppendVersion(std::string* body, uint64_t version);
// Takes the trailing u64 off `body`; ProtocolError when it is missing or 0 (unless
// `zero_ok`, as for kFlagExpectVersion).
Status TakeVersion(std::string_view* body, uint64_t* version, bool zero_ok = false);

// --- reply bodies: every reply body starts with a status ---
struct ReplyStatus {
  StatusCode code = StatusCode::kOk;
  std::string message;
  Status ToStatus() const { return code == StatusCode::kOk ? Status() : Status(code, message); }
};

std::string EncodeStatusReply(const Status& s);
Status DecodeStatusReply(std::string_view body, ReplyStatus* status);
// Only the status every reply body starts with (the rest is the caller's to decode).
Status DecodeStatusPrefix(std::string_view body, ReplyStatus* status);

// Get and Stat: status, then (when OK) the object's metadata. Get's payload is the value.
// A primary's GET reply for a replicated key adds a hint: u8 count, count x u16 node index (into
// the cluster file's node list) of nodes holding a copy of exactly meta.version.
std::string EncodeObjectReply(const Status& s, const ObjectMeta& meta,
                              const std::vector<uint16_t>& replica_hint = {});
void EncodeObjectReplyTo(std::string* out, const Status& s, const ObjectMeta& meta,
                         const std::vector<uint16_t>& replica_hint = {});
Status DecodeObjectReply(std::string_view body, ReplyStatus* status, ObjectMeta* meta,
                         std::vector<uint16_t>* replica_hint = nullptr);

// GET with kFlagRange: the key, then the range and the version it must come from.
struct GetRange {
  uint64_t offset = 0;
  uint64_t length = 0;
  uint64_t version = 0;  // 0: any
  // The first range of a ranged read, or a whole-value read: the one that counts as the read
  // (admission, hits, promotion, hotness) and the only one that may be served from disk.
  bool IsFirst() const { return offset == 0; }
};
void EncodeRangeGetTo(std::string* out, std::string_view key, const GetRange& range);
Status DecodeRangeGet(std::string_view body, std::string* key, GetRange* range);

// Replica read (GET with kFlagReplicaRead): key and the version the hint named.
std::string EncodeReplicaGet(std::string_view key, uint64_t version);
Status DecodeReplicaGet(std::string_view body, std::string* key, uint64_t* version);

// ReplicaPut: key, tensor, size, then the version (the primary's) and the replication attempt
// it belongs to; the payload is the value. A replica answers OK only when it installed the copy.
// Invalidate: key, version, attempt: copies of versions <= `version` must become unreadable,
// and installs of attempts <= `attempt` still in flight must be refused.
// Attempts are numbered by the primary, increasing (across restarts too: they start from the
// boot time), so a key that cooled and turns hot again is copied under a new attempt.
std::string EncodeReplicaPut(const PutRequest& r, uint64_t version, uint64_t attempt);
// HandoffPut: key, tensor, size, then the version the object has on the sending node (the new
// owner keeps it unless it has a newer one). kFlagDurable when the object is durable.
std::string EncodeHandoffPut(const PutRequest& r, uint64_t version);
// REPAIR: the key, the id of the node to push the copy to, and the version the client saw
// that node hold (0: none), which the push must still find there.
std::string EncodeRepair(std::string_view key, std::string_view target_id, uint64_t seen);
Status DecodeRepair(std::string_view body, std::string* key, std::string* target_id,
                    uint64_t* seen);
Status DecodeHandoffPut(std::string_view body, PutRequest* r, uint64_t* version);
Status DecodeReplicaPut(std::string_view body, PutRequest* r, uint64_t* version, uint64_t* attempt);
std::string EncodeInvalidate(std::string_view key, uint64_t version, uint64_t attempt);
Status DecodeInvalidate(std::string_view body, std::string* key, uint64_t* version,
                        uint64_t* attempt);

// LoadReport: the sender's reads per second (rows served, all kinds), rounded. The reply is a
// status and the receiver's own reads per second (u64), encoded as a Put reply.
std::string EncodeLoadReport(uint64_t reads_per_s);
Status DecodeLoadReport(std::string_view body, uint64_t* reads_per_s);

// Streamed put (PUT with kFlagStreamed): status, then (when OK) the stream id, the largest
// piece the node accepts (u32 bytes) and the pieces a client may have in flight (u16).
struct StreamGrant {
  uint64_t stream = 0;
  uint32_t chunk_size = 0;
  uint16_t window = 0;
};
std::string EncodeStreamReply(const Status& s, const StreamGrant& grant);
Status DecodeStreamReply(std::string_view body, ReplyStatus* status, StreamGrant* grant);
// PUT_CHUNK body: the stream and the piece's offset in the value; the payload is the piece.
std::string EncodePutChunk(uint64_t stream, uint64_t offset);
Status DecodePutChunk(std::string_view body, uint64_t* stream, uint64_t* offset);

// Put: status, then (when OK) the new version.
std::string EncodePutReply(const Status& s, uint64_t version);
Status DecodePutReply(std::string_view body, ReplyStatus* status, uint64_t* version);

// Ping: status, node id.
std::string EncodePingReply(const Status& s, std::string_view node_id);
Status DecodePingReply(std::string_view body, ReplyStatus* status, std::string* node_id);

// MultiGet reply: body = status. Payload = block of per-key results, then the values of the
// found keys in request order. A found row carries a replica hint as a GET reply does (u8
// count, count x u16 node index; count 0 when the key has no readable copies).
struct BatchGetResult {
  StatusCode code = StatusCode::kOk;
  ObjectMeta meta;             // when code is OK
  std::vector<uint16_t> hint;  // when code is OK: nodes holding a copy of meta.version
};
std::string EncodeBatchGetBlock(const std::vector<BatchGetResult>& results);
Status DecodeBatchGetBlock(std::string_view payload, std::vector<BatchGetResult>* results,
                           size_t* block_size);

// MultiPut reply: body = status; payload = count, then per item a status code and version.
struct BatchPutResult {
  StatusCode code = StatusCode::kOk;
  uint64_t version = 0;
};
std::string EncodeBatchPutResults(const std::vector<BatchPutResult>& results);
Status DecodeBatchPutResults(std::string_view payload, std::vector<BatchPutResult>* results);

// Stats reply: body = status; payload = a JSON document (docs/STATS.md).

}  // namespace gkv::wire
