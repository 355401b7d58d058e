// Explicit little-endian encoding with bounds checks, used for the disk tier's metadata records
// and the wire protocol. Internal to gkv (not part of the client API).
//
// ByteReader never reads past its input: every getter returns false once the input is short, and
// the reader stays failed from then on, so a decoder can check once at the end.
#pragma once

#include <bit>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

#include "gkv/tensor.h"

namespace gkv {

class ByteWriter {
 public:
  explicit ByteWriter(std::string* out) : out_(out) {}
  void U8(uint8_t v) { out_->push_back(static_cast<char>(v)); }
  void U16(uint16_t v) { PutLE<2>(v); }
  void U32(uint32_t v) { PutLE<4>(v); }
  void U64(uint64_t v) { PutLE<8>(v); }
  void I64(int64_t v) { PutLE<8>(static_cast<uint64_t>(v)); }
  void Bytes(const void* p, size_t n) { out_->append(static_cast<const char*>(p), n); }
  // u32 length + bytes.
  void String(std::string_view s) {
    U32(static_cast<uint32_t>(s.size()));
    Bytes(s.data(), s.size());
  }
  // dtype u8, rank u8, rank x i64.
  void Tensor(const TensorMeta& m);

 private:
  // One append of the N low bytes, least significant first (a push_back per byte cost about ten
  // instructions a byte on the request path).
  template <int N>
  void PutLE(uint64_t v) {
    char bytes[8];
    if constexpr (std::endian::native == std::endian::little) {
      std::memcpy(bytes, &v, sizeof v);
    } else {
      for (int i = 0; i < N; ++i) bytes[i] = static_cast<char>((v >> (8 * i)) & 0xff);
    }
    out_->append(bytes, N);
  }
  std::string* out_;
};

class ByteReader {
 public:
  ByteReader(const void* data, size_t size) : p_(static_cast<const uint8_t*>(data)), left_(size) {}
  explicit ByteReader(std::string_view s) : ByteReader(s.data(), s.size()) {}

  bool U8(uint8_t* v) { return GetLE<1>(v); }
  bool U16(uint16_t* v) { return GetLE<2>(v); }
  bool U32(uint32_t* v) { return GetLE<4>(v); }
  bool U64(uint64_t* v) { return GetLE<8>(v); }
  bool I64(int64_t* v) {
    uint64_t u;
    if (!GetLE<8>(&u)) return false;
    *v = static_cast<int64_t>(u);
    return true;
  }
  // A view into the input; valid as long as the input is.
  bool Bytes(size_t n, std::string_view* out) {
    if (failed_ || left_ < n) return Fail();
    *out = std::string_view(reinterpret_cast<const char*>(p_), n);
    p_ += n;
    left_ -= n;
    return true;
  }
  // Refuses strings longer than max_len (a corrupt length must not cause a huge allocation).
  bool String(std::string* out, size_t max_len) {
    uint32_t n;
    std::string_view v;
    if (!U32(&n) || n > max_len || !Bytes(n, &v)) return Fail();
    out->assign(v);
    return true;
  }
  // Checks rank <= 8 and a known dtype; does not check the byte size.
  bool Tensor(TensorMeta* m);

  bool failed() const { return failed_; }
  size_t remaining() const { return left_; }

 private:
  template <int N, typename T>
  bool GetLE(T* v) {
    static_assert(N <= 8 && sizeof(T) >= static_cast<size_t>(N));
    if (failed_ || left_ < static_cast<size_t>(N)) return Fail();
    uint64_t r = 0;
    if constexpr (std::endian::native == std::endian::little) {
      std::memcpy(&r, p_, N);  // the N low bytes; the rest stay zero
    } else {
      for (int i = 0; i < N; ++i) r |= static_cast<uint64_t>(p_[i]) << (8 * i);
    }
    *v = static_cast<T>(r);
    p_ += N;
    left_ -= N;
    return true;
  }
  bool Fail() {
    failed_ = true;
    return false;
  }
  const uint8_t* p_;
  size_t left_;
  bool failed_ = false;
};

}  // namespace gkv
