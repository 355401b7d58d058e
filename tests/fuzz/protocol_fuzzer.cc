// libFuzzer target for the wire-protocol decoders: whatever arrives, a decoder returns a status
// and never reads out of bounds, allocates without bound, or crashes. The first byte picks the
// decoder so one corpus covers all of them; a full message (header + body) is also decoded as a
// server would, body by opcode.
#include <cstddef>
#include <cstdint>
#include <string_view>
#include <vector>

#include "gkv/transport/protocol.h"

using namespace gkv::wire;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const uint8_t selector = data[0];
  std::string_view in(reinterpret_cast<const char*>(data + 1), size - 1);
  Header h;
  std::string_view body;
  PutRequest put;
  std::string key;
  std::vector<std::string> keys;
  std::vector<BatchPutItem> items;
  std::vector<BatchGetResult> gets;
  std::vector<BatchPutResult> puts;
  ReplyStatus rs;
  ObjectMeta meta;
  uint64_t version, attempt;
  std::vector<uint64_t> key_versions;
  size_t block;
  switch (selector % 8) {
    case 0:
      // As the server does: the header, then the body by opcode.
      if (DecodeMessage(in.data(), in.size(), &h, &body).ok()) {
        switch (h.opcode) {
          case Opcode::kPut:
            if ((h.flags & kFlagClientVersion) && !TakeVersion(&body, &version).ok()) break;
            if (DecodePutRequest(body, &put).ok()) (void)put.tensor.Validate(put.size);
            break;
          case Opcode::kGet:
            if (h.flags & kFlagReplicaRead) {
              (void)DecodeReplicaGet(body, &key, &version);
            } else if (h.flags & kFlagRange) {
              GetRange range;
              (void)DecodeRangeGet(body, &key, &range);
            } else {
              (void)DecodeKeyRequest(body, &key);
            }
            break;
          case Opcode::kDelete:
            if ((h.flags & kFlagClientVersion) && !TakeVersion(&body, &version).ok()) break;
            (void)DecodeKeyRequest(body, &key);
            break;
          case Opcode::kStat:
            (void)DecodeKeyRequest(body, &key);
            break;
          case Opcode::kHello:
            (void)DecodeHello(body, &key);
            break;
          case Opcode::kReplicaPut:
            if (DecodeReplicaPut(body, &put, &version, &attempt).ok()) {
              (void)put.tensor.Validate(put.size);
            }
            break;
          case Opcode::kInvalidate:
            (void)DecodeInvalidate(body, &key, &version, &attempt);
            break;
          case Opcode::kLoadReport:
            (void)DecodeLoadReport(body, &version);
            break;
          case Opcode::kHandoffPut:
            if ((h.flags & kFlagExpectVersion) && !TakeVersion(&body, &attempt, true).ok()) break;
            if (DecodeHandoffPut(body, &put, &version).ok()) (void)put.tensor.Validate(put.size);
            break;
          case Opcode::kPutChunk:
            (void)DecodePutChunk(body, &version, &attempt);
            break;
          case Opcode::kRepair: {
            std::string target;
            (void)DecodeRepair(body, &key, &target, &version);
            break;
          }
          case Opcode::kPeerHello: {
            // Decoded before any authentication: the most exposed decoder.
            std::string secret;
            uint32_t placement = 0;
            (void)DecodePeerHello(body, &key, &secret, &placement);
            break;
          }
          default:
            break;
        }
      }
      break;
    case 1:
      (void)DecodeKeyList(in, &keys);
      (void)DecodeKeyList(in, &keys, &key_versions);
      break;
    case 2:
      (void)DecodeBatchPutBlock(in, &items, &block);
      (void)DecodeBatchPutBlock(in, &items, &block, /*versioned=*/true);
      break;
    case 3:
      (void)DecodeBatchGetBlock(in, &gets, &block);
      break;
    case 4:
      (void)DecodeBatchPutResults(in, &puts);
      break;
    case 5:
      (void)DecodeObjectReply(in, &rs, &meta);
      break;
    case 6: {
      (void)DecodePutReply(in, &rs, &version);
      StreamGrant grant;
      (void)DecodeStreamReply(in, &rs, &grant);
      break;
    }
    case 7:
      (void)DecodePingReply(in, &rs, &key);
      break;
  }
  return 0;
}
