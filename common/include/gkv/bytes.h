// Explicit little-endian encoding with bounds checks, used for the disk tier's metadata records
// and the wire protocol. Internal to gkv (not part of the client API).
//
// ByteReader never reads past its input: every getter returns false once the input is short, and
// the reader stays failed from then on, so a decoder can check once at the end.
#pragma once

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
  void U16(uint16_t v) { PutLE(v, 2); }
  void U32(uint32_t v) { PutLE(v, 4); }
  void U64(uint64_t v) { PutLE(v, 8); }
  void I64(int64_t v) { PutLE(static_cast<uint64_t>(v), 8); }
  void Bytes(const void* p, size_t n) { out_->append(static_cast<const char*>(p), n); }
  // u32 length + bytes.
  void String(std::string_view s) {
    U32(static_cast<uint32_t>(s.size()));
    Bytes(s.data(), s.size());
  }
  // dtype u8, rank u8, rank x i64.
  void Tensor(const TensorMeta& m);

 private:
  void PutLE(uint64_t v, int n) {
    for (int i = 0; i < n; ++i) out_->push_back(static_cast<char>((v >> (8 * i)) & 0xff));
  }
  std::string* out_;
};

class ByteReader {
 public:
  ByteReader(const void* data, size_t size) : p_(static_cast<const uint8_t*>(data)), left_(size) {}
  explicit ByteReader(std::string_view s) : ByteReader(s.data(), s.size()) {}

  bool U8(uint8_t* v) { return GetLE(v, 1); }
  bool U16(uint16_t* v) { return GetLE(v, 2); }
  bool U32(uint32_t* v) { return GetLE(v, 4); }
  bool U64(uint64_t* v) { return GetLE(v, 8); }
  bool I64(int64_t* v) {
    uint64_t u;
    if (!GetLE(&u, 8)) return false;
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
  template <typename T>
  bool GetLE(T* v, int n) {
    if (failed_ || left_ < static_cast<size_t>(n)) return Fail();
    uint64_t r = 0;
    for (int i = 0; i < n; ++i) r |= static_cast<uint64_t>(p_[i]) << (8 * i);
    *v = static_cast<T>(r);
    p_ += n;
    left_ -= n;
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
