#include <gtest/gtest.h>

#include "gkv/bytes.h"
#include "gkv/random.h"
#include "gkv/transport/hello_proof.h"
#include "gkv/transport/protocol.h"
#include "test_util.h"

namespace gkv::wire {
namespace {

TEST(ProtocolTest, HeaderRoundTripAndFixedLayout) {
  std::string m = EncodeMessage({Opcode::kGet, kFlagDurable, 0x1122334455667788ULL, 1500}, "body");
  ASSERT_EQ(m.size(), kFixedHeaderSize + 4);
  // Little-endian magic "GKV1" first.
  EXPECT_EQ(m.substr(0, 4), "GKV1");
  Header h;
  std::string_view body;
  ASSERT_TRUE(DecodeMessage(m.data(), m.size(), &h, &body).ok());
  EXPECT_EQ(h.opcode, Opcode::kGet);
  EXPECT_EQ(h.flags, kFlagDurable);
  EXPECT_EQ(h.request_id, 0x1122334455667788ULL);
  EXPECT_EQ(h.budget_ms, 1500u);
  EXPECT_EQ(m[20], static_cast<char>(1500 & 0xff));  // budget_ms at offset 20
  EXPECT_EQ(body, "body");
}

TEST(ProtocolTest, MalformedHeadersAreRefused) {
  std::string m = EncodeMessage({Opcode::kPut, 0, 1}, "abc");
  Header h;
  std::string_view body;
  for (size_t cut = 0; cut < m.size(); ++cut) {
    EXPECT_EQ(DecodeMessage(m.data(), cut, &h, &body).code(), StatusCode::kProtocolError) << cut;
  }
  std::string extra = m + "x";
  EXPECT_FALSE(DecodeMessage(extra.data(), extra.size(), &h, &body).ok());
  std::string bad_magic = m;
  bad_magic[0] = 'X';
  EXPECT_FALSE(DecodeMessage(bad_magic.data(), bad_magic.size(), &h, &body).ok());
  std::string bad_version = m;
  bad_version[4] = 1;
  bad_version.resize(20);  // version 1's header was 20 bytes: refused by its version
  Status s = DecodeMessage(bad_version.data(), bad_version.size(), &h, &body);
  EXPECT_NE(s.message().find("version 1"), std::string_view::npos);
  std::string bad_op = m;
  bad_op[5] = 99;
  EXPECT_FALSE(DecodeMessage(bad_op.data(), bad_op.size(), &h, &body).ok());
}

TEST(ProtocolTest, PutRequestRoundTripAndTruncation) {
  PutRequest p{"emb/1", TensorMeta{DType::kBF16, {128, 64}}, 16384};
  std::string b = EncodePutRequest(p);
  PutRequest q;
  ASSERT_TRUE(DecodePutRequest(b, &q).ok());
  EXPECT_EQ(q.key, p.key);
  EXPECT_EQ(q.tensor, p.tensor);
  EXPECT_EQ(q.size, p.size);
  for (size_t cut = 0; cut < b.size(); ++cut) {
    EXPECT_FALSE(DecodePutRequest(std::string_view(b).substr(0, cut), &q).ok()) << cut;
  }
}

TEST(ProtocolTest, ObjectAndPutRepliesRoundTrip) {
  ObjectMeta m{4096, 42, TensorMeta{DType::kI64, {512}}, 1, true};
  std::string b = EncodeObjectReply(Status::OK(), m);
  ReplyStatus rs;
  ObjectMeta back;
  ASSERT_TRUE(DecodeObjectReply(b, &rs, &back).ok());
  EXPECT_EQ(rs.code, StatusCode::kOk);
  EXPECT_EQ(back.size, 4096u);
  EXPECT_EQ(back.version, 42u);
  EXPECT_EQ(back.tensor, m.tensor);
  EXPECT_TRUE(back.on_disk);
  b = EncodeObjectReply(Status::NotFound("gone"), m);
  ASSERT_TRUE(DecodeObjectReply(b, &rs, &back).ok());
  EXPECT_EQ(rs.ToStatus().ToString(), "not_found: gone");
  uint64_t version = 0;
  ASSERT_TRUE(DecodePutReply(EncodePutReply(Status::OK(), 9), &rs, &version).ok());
  EXPECT_EQ(version, 9u);
}

TEST(ProtocolTest, StreamedPutMessagesRoundTripAndRejectTruncation) {
  std::string grant_body = EncodeStreamReply(Status::OK(), {42, 8 << 20, 4});
  ReplyStatus rs;
  StreamGrant g;
  ASSERT_TRUE(DecodeStreamReply(grant_body, &rs, &g).ok());
  EXPECT_EQ(rs.code, StatusCode::kOk);
  EXPECT_EQ(g.stream, 42u);
  EXPECT_EQ(g.chunk_size, 8u << 20);
  EXPECT_EQ(g.window, 4u);
  for (size_t cut = 0; cut < grant_body.size(); ++cut) {
    EXPECT_FALSE(DecodeStreamReply(grant_body.substr(0, cut), &rs, &g).ok()) << cut;
  }
  // A grant of nothing (no stream, no piece size or no window) is malformed.
  EXPECT_FALSE(DecodeStreamReply(EncodeStreamReply(Status::OK(), {42, 0, 4}), &rs, &g).ok());
  ASSERT_TRUE(DecodeStreamReply(EncodeStreamReply(Status::Busy("full"), {}), &rs, &g).ok());
  EXPECT_EQ(rs.code, StatusCode::kBusy);

  std::string chunk = EncodePutChunk(7, 3 << 20);
  uint64_t stream = 0, offset = 0;
  ASSERT_TRUE(DecodePutChunk(chunk, &stream, &offset).ok());
  EXPECT_EQ(stream, 7u);
  EXPECT_EQ(offset, 3u << 20);
  EXPECT_FALSE(DecodePutChunk(chunk.substr(0, 15), &stream, &offset).ok());
  EXPECT_FALSE(DecodePutChunk(chunk + "x", &stream, &offset).ok());
  EXPECT_FALSE(DecodePutChunk(EncodePutChunk(0, 0), &stream, &offset).ok());
  EXPECT_EQ(OpcodeName(Opcode::kPutChunk), "put_chunk");
}

TEST(ProtocolTest, RangedGetsRoundTripAndRejectTruncation) {
  std::string body;
  EncodeRangeGetTo(&body, "tensor/7", {8 << 20, 4 << 20, 99});
  std::string key;
  GetRange range;
  ASSERT_TRUE(DecodeRangeGet(body, &key, &range).ok());
  EXPECT_EQ(key, "tensor/7");
  EXPECT_EQ(range.offset, 8u << 20);
  EXPECT_EQ(range.length, 4u << 20);
  EXPECT_EQ(range.version, 99u);
  for (size_t cut = 0; cut < body.size(); ++cut) {
    EXPECT_FALSE(DecodeRangeGet(body.substr(0, cut), &key, &range).ok()) << cut;
  }
  EXPECT_FALSE(DecodeRangeGet(body + "x", &key, &range).ok());
  // A plain GET's body is not a ranged one, nor the other way round.
  EXPECT_FALSE(DecodeRangeGet(EncodeKeyRequest("tensor/7"), &key, &range).ok());
  EXPECT_FALSE(DecodeKeyRequest(body, &key).ok());
}

TEST(ProtocolTest, BatchBlocksRoundTripAndRejectLies) {
  std::vector<BatchPutItem> items = {{"a", {}, 3}, {"bb", TensorMeta{DType::kU8, {2}}, 2}};
  std::string payload = EncodeBatchPutBlock(items) + "xyz" + "pq";
  std::vector<BatchPutItem> back;
  size_t block = 0;
  ASSERT_TRUE(DecodeBatchPutBlock(payload, &back, &block).ok());
  ASSERT_EQ(back.size(), 2u);
  EXPECT_EQ(payload.substr(block), "xyzpq");
  // Values shorter than declared.
  EXPECT_FALSE(DecodeBatchPutBlock(payload.substr(0, payload.size() - 1), &back, &block).ok());
  // A count that claims more items than bytes could hold.
  std::string lie = "\xff\xff\xff\x00";
  EXPECT_FALSE(DecodeBatchPutBlock(lie, &back, &block).ok());
  std::vector<std::string> keys;
  EXPECT_FALSE(DecodeKeyList(lie, &keys).ok());
  ASSERT_TRUE(DecodeKeyList(EncodeKeyList({"x", "", "zz"}), &keys).ok());
  EXPECT_EQ(keys, (std::vector<std::string>{"x", "", "zz"}));

  std::vector<BatchGetResult> res(2);
  res[0].code = StatusCode::kOk;
  res[0].meta.size = 4;
  res[1].code = StatusCode::kNotFound;
  std::string g = EncodeBatchGetBlock(res) + "data";
  std::vector<BatchGetResult> gb;
  ASSERT_TRUE(DecodeBatchGetBlock(g, &gb, &block).ok());
  EXPECT_EQ(g.substr(block), "data");
  EXPECT_FALSE(DecodeBatchGetBlock(g + "!", &gb, &block).ok());

  std::vector<BatchPutResult> pr = {{StatusCode::kOk, 5}, {StatusCode::kNoSpace, 0}};
  std::vector<BatchPutResult> pb;
  ASSERT_TRUE(DecodeBatchPutResults(EncodeBatchPutResults(pr), &pb).ok());
  EXPECT_EQ(pb[1].code, StatusCode::kNoSpace);
}

TEST(ProtocolTest, ClientVersionsRoundTripAndAreRequired) {
  // PUT / DELETE: the version trails the body.
  std::string body = EncodePutRequest({"k", {}, 3});
  AppendVersion(&body, 77);
  std::string_view view = body;
  uint64_t version = 0;
  ASSERT_TRUE(TakeVersion(&view, &version).ok());
  EXPECT_EQ(version, 77u);
  PutRequest put;
  ASSERT_TRUE(DecodePutRequest(view, &put).ok());
  EXPECT_EQ(put.key, "k");
  // Missing (too short) or zero: refused.
  std::string_view short_body = std::string_view(body).substr(0, 5);
  EXPECT_FALSE(TakeVersion(&short_body, &version).ok());
  std::string zero = EncodeKeyRequest("k");
  AppendVersion(&zero, 0);
  std::string_view zero_view = zero;
  EXPECT_FALSE(TakeVersion(&zero_view, &version).ok());
  // MPUT: one version per item, after its size.
  std::vector<BatchPutItem> items = {{"a", {}, 1, 10}, {"b", {}, 2, 11}};
  std::string payload = EncodeBatchPutBlock(items, true) + "xyz";
  std::vector<BatchPutItem> back;
  size_t block = 0;
  ASSERT_TRUE(DecodeBatchPutBlock(payload, &back, &block, true).ok());
  ASSERT_EQ(back.size(), 2u);
  EXPECT_EQ(back[0].version, 10u);
  EXPECT_EQ(back[1].version, 11u);
  EXPECT_EQ(payload.substr(block), "xyz");
  // Read without the flag, the versions are taken for values: the sizes no longer add up.
  EXPECT_FALSE(DecodeBatchPutBlock(payload, &back, &block, false).ok());
  items[1].version = 0;
  EXPECT_FALSE(
      DecodeBatchPutBlock(EncodeBatchPutBlock(items, true) + "xyz", &back, &block, true).ok());
}

TEST(ProtocolTest, ReplicationEncodingsRoundTrip) {
  // Versioned key lists (MGET rows that read copies).
  std::vector<std::string> keys = {"a", "bb", ""};
  std::vector<uint64_t> versions = {0, 7, 1ull << 63}, vback;
  std::vector<std::string> kback;
  const std::string list = EncodeKeyList(keys, &versions);
  ASSERT_TRUE(DecodeKeyList(list, &kback, &vback).ok());
  EXPECT_EQ(kback, keys);
  EXPECT_EQ(vback, versions);
  EXPECT_FALSE(DecodeKeyList(list, &kback).ok()) << "unversioned decode of a versioned list";
  EXPECT_FALSE(DecodeKeyList(list.substr(0, list.size() - 1), &kback, &vback).ok());
  EXPECT_FALSE(DecodeKeyList(EncodeKeyList(keys), &kback, &vback).ok());

  // MGET rows carry replica hints.
  std::vector<BatchGetResult> res(3);
  res[0].meta.size = 2;
  res[0].hint = {1, 2};
  res[1].code = StatusCode::kNotFound;
  res[2].meta.size = 1;
  const std::string g = EncodeBatchGetBlock(res) + "xyz";
  std::vector<BatchGetResult> gb;
  size_t block = 0;
  ASSERT_TRUE(DecodeBatchGetBlock(g, &gb, &block).ok());
  EXPECT_EQ(gb[0].hint, (std::vector<uint16_t>{1, 2}));
  EXPECT_TRUE(gb[2].hint.empty());
  EXPECT_EQ(g.substr(block), "xyz");
  // A hint count larger than what follows.
  std::string cut = EncodeBatchGetBlock({res[0]});
  EXPECT_FALSE(DecodeBatchGetBlock(cut.substr(0, cut.size() - 1), &gb, &block).ok());

  // Replica puts and invalidations carry the replication attempt.
  PutRequest put{"key", {}, 9}, pback;
  uint64_t version = 0, attempt = 0;
  ASSERT_TRUE(DecodeReplicaPut(EncodeReplicaPut(put, 5, 77), &pback, &version, &attempt).ok());
  EXPECT_EQ(pback.key, "key");
  EXPECT_EQ(pback.size, 9u);
  EXPECT_EQ(version, 5u);
  EXPECT_EQ(attempt, 77u);
  std::string key;
  ASSERT_TRUE(DecodeInvalidate(EncodeInvalidate("k", 3, 4), &key, &version, &attempt).ok());
  EXPECT_EQ(key, "k");
  EXPECT_EQ(version, 3u);
  EXPECT_EQ(attempt, 4u);
  EXPECT_FALSE(DecodeInvalidate(EncodeReplicaGet("k", 3), &key, &version, &attempt).ok());
  uint64_t rate = 0;
  ASSERT_TRUE(DecodeLoadReport(EncodeLoadReport(12345), &rate).ok());
  EXPECT_EQ(rate, 12345u);
  EXPECT_FALSE(DecodeLoadReport("1234567", &rate).ok());
}

// PEER_HELLO carries the placement version; a hello from a build before it decodes as 1.
TEST(ProtocolTest, PeerHelloCarriesThePlacementVersion) {
  std::string id, secret;
  uint32_t placement = 0;
  ASSERT_TRUE(DecodePeerHello(EncodePeerHello("n3", "s", 2), &id, &secret, &placement).ok());
  EXPECT_EQ(id, "n3");
  EXPECT_EQ(secret, "s");
  EXPECT_EQ(placement, 2u);
  std::string old;
  ByteWriter(&old).String("n4");
  ByteWriter(&old).String("t");
  ASSERT_TRUE(DecodePeerHello(old, &id, &secret, &placement).ok());
  EXPECT_EQ(id, "n4");
  EXPECT_EQ(placement, 1u);
  const std::string hello = EncodePeerHello("n3", "s", 2);
  for (size_t cut = 1; cut < 4; ++cut) {  // a torn version field (4 bytes short: the old form)
    EXPECT_FALSE(
        DecodePeerHello(hello.substr(0, hello.size() - cut), &id, &secret, &placement).ok());
  }
  // Fields a later build appends are left alone.
  ASSERT_TRUE(DecodePeerHello(hello + "more", &id, &secret, &placement).ok());
  EXPECT_EQ(placement, 2u);
}

// Random bytes and random mutations of valid messages never crash a decoder.
TEST(ProtocolTest, RandomInputNeverCrashesDecoders) {
  Random rng(testing::TestSeed());
  std::vector<std::string> seeds = {
      EncodeMessage({Opcode::kPut, 0, 1}, EncodePutRequest({"k", {DType::kF32, {2}}, 8})),
      EncodeBatchPutBlock({{"a", {}, 1}}) + "z", EncodeKeyList({"a", "b"}),
      EncodeObjectReply(Status::OK(), {})};
  for (int i = 0; i < 20000; ++i) {
    std::string m = seeds[i % seeds.size()];
    int flips = static_cast<int>(rng.Uniform(1, 4));
    for (int f = 0; f < flips && !m.empty(); ++f)
      m[rng.Uniform(0, m.size() - 1)] = char(rng.Next());
    if (rng.Uniform(0, 3) == 0) m.resize(rng.Uniform(0, m.size()));
    Header h;
    std::string_view body;
    (void)DecodeMessage(m.data(), m.size(), &h, &body);
    PutRequest p;
    (void)DecodePutRequest(m, &p);
    std::vector<BatchPutItem> items;
    size_t block;
    (void)DecodeBatchPutBlock(m, &items, &block);
    std::vector<BatchGetResult> res;
    (void)DecodeBatchGetBlock(m, &res, &block);
    std::vector<std::string> keys;
    (void)DecodeKeyList(m, &keys);
    ReplyStatus rs;
    ObjectMeta om;
    (void)DecodeObjectReply(m, &rs, &om);
  }
}

// Issue 38 item 11: a hello proves the secret without carrying it, for one node, from one
// caller, within the window, once.
TEST(HelloProofTest, ProvesTheSecretForOneNodeFromOneCallerOnceWithinTheWindow) {
  const std::string secret = "correct horse battery staple";
  const uint64_t now = UnixMillisNow();
  const std::string p = MakeHelloProof(secret, kClientHelloLabel, "n0", "");
  ASSERT_EQ(p.size(), kHelloProofSize);
  EXPECT_EQ(p.find("horse"), std::string::npos);
  EXPECT_TRUE(CheckHelloProof(p, secret, kClientHelloLabel, "n0", "", now).ok());
  const auto refused = [&](const Status& s, const std::string& says) {
    EXPECT_EQ(s.code(), StatusCode::kPermissionDenied) << s.ToString();
    EXPECT_NE(s.ToString().find(says), std::string::npos) << s.ToString();
  };
  refused(CheckHelloProof(p, "wrong", kClientHelloLabel, "n0", "", now), "wrong secret");
  refused(CheckHelloProof(p, secret, kClientHelloLabel, "n1", "", now), "wrong secret");
  refused(CheckHelloProof(p, secret, kPeerHelloLabel, "n0", "", now), "wrong secret");
  refused(CheckHelloProof(p, secret, kClientHelloLabel, "n0", "n2", now), "wrong secret");
  const uint64_t six_minutes = 6 * 60 * 1000;
  refused(CheckHelloProof(p, secret, kClientHelloLabel, "n0", "", now + six_minutes), "off");
  refused(CheckHelloProof(p, secret, kClientHelloLabel, "n0", "", now - six_minutes), "off");
  // A build from before proofs sends the secret itself: told to upgrade.
  refused(CheckHelloProof(secret, secret, kClientHelloLabel, "n0", "", now), "upgrade");
  std::string flipped = p;
  flipped.back() ^= 1;
  refused(CheckHelloProof(flipped, secret, kClientHelloLabel, "n0", "", now), "wrong secret");
  EXPECT_TRUE(MakeHelloProof("", kClientHelloLabel, "n0", "").empty());  // nothing to prove

  HelloReplayGuard guard;
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_TRUE(guard.Admit(p, t0).ok());
  refused(guard.Admit(p, t0 + std::chrono::seconds(1)), "replayed");
  EXPECT_TRUE(guard.Admit(MakeHelloProof(secret, kClientHelloLabel, "n0", ""), t0).ok());
  // Remembered for twice the window and a minute from its arrival, by when its clock is out of
  // the window.
  refused(guard.Admit(p, t0 + 2 * kHelloWindow), "replayed");
  EXPECT_TRUE(guard.Admit(p, t0 + 2 * kHelloWindow + std::chrono::seconds(61)).ok());
  EXPECT_EQ(guard.size(), 1u);
}

}  // namespace
}  // namespace gkv::wire
