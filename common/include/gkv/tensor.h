// Tensor metadata carried with every cached object: element type and shape.
//
// An object without tensor metadata is plain bytes (DType::kRaw, empty shape). A typed object's
// byte size must equal the element count times the item size; Validate() enforces that.
// Values: copy freely; no shared state.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "gkv/status.h"

namespace gkv {

// The numbers are part of the wire protocol and of the on-disk format: never renumber.
enum class DType : uint8_t {
  kRaw = 0,  // untyped bytes
  kF64 = 1,
  kF32 = 2,
  kF16 = 3,
  kBF16 = 4,
  kF8E4M3 = 5,
  kF8E5M2 = 6,
  kI64 = 7,
  kI32 = 8,
  kI16 = 9,
  kI8 = 10,
  kU8 = 11,
  kBool = 12,
};

inline constexpr int kMaxTensorRank = 8;

// Bytes per element; 1 for kRaw.
size_t ItemSize(DType dtype);
// "f32", "bf16", "raw", ... (the same names ParseDType accepts).
std::string_view DTypeName(DType dtype);
Result<DType> ParseDType(std::string_view name);

struct TensorMeta {
  DType dtype = DType::kRaw;
  std::vector<int64_t> shape;  // rank 0..8; rank 0 with a dtype is a scalar

  bool is_tensor() const { return dtype != DType::kRaw; }
  // Element count (1 for a scalar). REQUIRES: Validate passed or dims known non-negative.
  uint64_t ElementCount() const;
  // InvalidArgument unless: rank <= 8, dims >= 0, kRaw has no shape, and for a tensor
  // ElementCount() * ItemSize(dtype) == byte_size (computed without overflow).
  Status Validate(uint64_t byte_size) const;
  // "f32[2,3]" or "raw".
  std::string ToString() const;

  friend bool operator==(const TensorMeta&, const TensorMeta&) = default;
};

// Parses "2,3,4" into a shape; "" is rank 0.
Result<std::vector<int64_t>> ParseShape(std::string_view text);

}  // namespace gkv
