#include "gkv/tensor.h"

#include <array>
#include <charconv>

#include "gkv/bytes.h"

namespace gkv {
namespace {

struct DTypeInfo {
  DType dtype;
  std::string_view name;
  size_t item_size;
};

constexpr std::array<DTypeInfo, 13> kDTypes = {{
    {DType::kRaw, "raw", 1},
    {DType::kF64, "f64", 8},
    {DType::kF32, "f32", 4},
    {DType::kF16, "f16", 2},
    {DType::kBF16, "bf16", 2},
    {DType::kF8E4M3, "f8e4m3", 1},
    {DType::kF8E5M2, "f8e5m2", 1},
    {DType::kI64, "i64", 8},
    {DType::kI32, "i32", 4},
    {DType::kI16, "i16", 2},
    {DType::kI8, "i8", 1},
    {DType::kU8, "u8", 1},
    {DType::kBool, "bool", 1},
}};

const DTypeInfo* Find(DType d) {
  auto i = static_cast<size_t>(d);
  return i < kDTypes.size() ? &kDTypes[i] : nullptr;
}

}  // namespace

size_t ItemSize(DType dtype) {
  const DTypeInfo* info = Find(dtype);
  return info ? info->item_size : 0;
}

std::string_view DTypeName(DType dtype) {
  const DTypeInfo* info = Find(dtype);
  return info ? info->name : "invalid";
}

Result<DType> ParseDType(std::string_view name) {
  for (const auto& info : kDTypes) {
    if (info.name == name) return info.dtype;
  }
  // Common aliases as PyTorch and NumPy spell them.
  if (name == "float32" || name == "float") return DType::kF32;
  if (name == "float64" || name == "double") return DType::kF64;
  if (name == "float16" || name == "half") return DType::kF16;
  if (name == "bfloat16") return DType::kBF16;
  if (name == "int64") return DType::kI64;
  if (name == "int32") return DType::kI32;
  if (name == "int16") return DType::kI16;
  if (name == "int8") return DType::kI8;
  if (name == "uint8") return DType::kU8;
  return Status::InvalidArgument("unknown dtype '" + std::string(name) + "'");
}

uint64_t TensorMeta::ElementCount() const {
  uint64_t n = 1;
  for (int64_t d : shape) n *= static_cast<uint64_t>(d);
  return n;
}

Status TensorMeta::Validate(uint64_t byte_size) const {
  if (Find(dtype) == nullptr) return Status::InvalidArgument("unknown dtype code");
  if (shape.size() > static_cast<size_t>(kMaxTensorRank)) {
    return Status::InvalidArgument("tensor rank " + std::to_string(shape.size()) +
                                   " exceeds the maximum of 8");
  }
  if (dtype == DType::kRaw) {
    if (!shape.empty()) return Status::InvalidArgument("raw bytes cannot have a shape");
    return Status::OK();
  }
  unsigned __int128 elements = 1;
  for (int64_t d : shape) {
    if (d < 0) return Status::InvalidArgument("negative dimension in shape " + ToString());
    elements *= static_cast<uint64_t>(d);
    if (elements > (static_cast<unsigned __int128>(1) << 64)) {
      return Status::InvalidArgument("shape " + ToString() + " overflows");
    }
  }
  unsigned __int128 expected = elements * ItemSize(dtype);
  if (expected != byte_size) {
    return Status::InvalidArgument("tensor " + ToString() + " needs " +
                                   std::to_string(static_cast<uint64_t>(expected)) +
                                   " bytes but the value has " + std::to_string(byte_size));
  }
  return Status::OK();
}

std::string TensorMeta::ToString() const {
  std::string out(DTypeName(dtype));
  if (dtype == DType::kRaw) return out;
  out += '[';
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) out += ',';
    out += std::to_string(shape[i]);
  }
  out += ']';
  return out;
}

Result<std::vector<int64_t>> ParseShape(std::string_view text) {
  std::vector<int64_t> shape;
  if (text.empty()) return shape;
  size_t pos = 0;
  while (pos <= text.size()) {
    size_t comma = text.find(',', pos);
    std::string_view part =
        text.substr(pos, comma == std::string_view::npos ? text.npos : comma - pos);
    int64_t d = 0;
    auto [ptr, ec] = std::from_chars(part.data(), part.data() + part.size(), d);
    if (ec != std::errc() || ptr != part.data() + part.size() || part.empty() || d < 0) {
      return Status::InvalidArgument("bad shape '" + std::string(text) + "'");
    }
    shape.push_back(d);
    if (shape.size() > static_cast<size_t>(kMaxTensorRank)) {
      return Status::InvalidArgument("shape has more than 8 dimensions");
    }
    if (comma == std::string_view::npos) break;
    pos = comma + 1;
  }
  return shape;
}

void ByteWriter::Tensor(const TensorMeta& m) {
  U8(static_cast<uint8_t>(m.dtype));
  U8(static_cast<uint8_t>(m.shape.size()));
  for (int64_t d : m.shape) I64(d);
}

bool ByteReader::Tensor(TensorMeta* m) {
  uint8_t dtype, rank;
  if (!U8(&dtype) || !U8(&rank)) return false;
  if (dtype > static_cast<uint8_t>(DType::kBool) || rank > kMaxTensorRank) return Fail();
  m->dtype = static_cast<DType>(dtype);
  m->shape.resize(rank);
  for (auto& d : m->shape) {
    if (!I64(&d)) return false;
  }
  return true;
}

}  // namespace gkv
