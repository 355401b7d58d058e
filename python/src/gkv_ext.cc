// gkv._gkv: the compiled half of the gkv Python package (nanobind).
//
// A thin layer over gkv::Client. Arrays arrive as nb::ndarray (DLPack or the buffer protocol:
// numpy, PyTorch, CuPy, JAX, bytes) and are read or written in place: no copy is made here.
// Every call that waits on the network releases the GIL (nb::gil_scoped_release); a failed call
// raises gkv.Error's subclass for its status code (gkv/_errors.py). The pure-Python layer
// (gkv/__init__.py) maps framework dtypes that DLPack can't carry (fp8) and builds the
// result tensors of get().
//
// Thread-safety: a _Client may be used from many Python threads at once; close() waits for
// nothing, the C++ client goes when the last call using it returns.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <charconv>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "gkv/client.h"

namespace nb = nanobind;

namespace gkv::python {
namespace {

using Ms = std::chrono::milliseconds;

// Carries a non-OK Status out of a binding; translated into gkv.Error's subclass.
struct StatusError {
  Status status;
};

[[noreturn]] void Raise(const Status& s) { throw StatusError{s}; }

// Keys in messages: at most a short prefix of each.
std::string ShortKey(std::string_view key) {
  constexpr size_t kMax = 40;
  if (key.size() <= kMax) return std::string(key);
  return std::string(key.substr(0, kMax)) + "...(" + std::to_string(key.size()) + " bytes)";
}

[[noreturn]] void RaiseFor(std::string_view op, std::string_view key, const Status& s) {
  Raise(s.WithContext(std::string(op) + " '" + ShortKey(key) + "'"));
}

// DLPack element type -> gkv dtype; nullopt for types gkv has no name for.
std::optional<DType> DTypeOf(const nb::dlpack::dtype& t) {
  if (t.lanes != 1) return std::nullopt;
  using C = nb::dlpack::dtype_code;
  switch (static_cast<C>(t.code)) {
    case C::Float:
      if (t.bits == 64) return DType::kF64;
      if (t.bits == 32) return DType::kF32;
      if (t.bits == 16) return DType::kF16;
      break;
    case C::Bfloat:
      if (t.bits == 16) return DType::kBF16;
      break;
    case C::Int:
      if (t.bits == 64) return DType::kI64;
      if (t.bits == 32) return DType::kI32;
      if (t.bits == 16) return DType::kI16;
      if (t.bits == 8) return DType::kI8;
      break;
    case C::UInt:
      if (t.bits == 8) return DType::kU8;
      break;
    case C::Bool:
      if (t.bits == 8) return DType::kBool;
      break;
    default:
      break;
  }
  return std::nullopt;
}

std::string DescribeDLType(const nb::dlpack::dtype& t) {
  static constexpr const char* kCodes[] = {"int",    "uint",    "float", "opaque",
                                           "bfloat", "complex", "bool"};
  const char* code = t.code < 7 ? kCodes[t.code] : "code";
  return std::string(code) + std::to_string(t.bits) +
         (t.lanes != 1 ? "x" + std::to_string(t.lanes) : "");
}

// An array's gkv dtype: `override_name` (a gkv dtype name, e.g. "f8e4m3" for a uint8 view of
// an fp8 tensor; same item size required) or the array's own.
DType ArrayDType(const nb::dlpack::dtype& t, const std::string& override_name) {
  if (!override_name.empty()) {
    auto d = ParseDType(override_name);
    if (!d.ok()) Raise(d.status());
    if (*d != DType::kRaw && ItemSize(*d) * 8 != t.bits) {
      Raise(Status::InvalidArgument("dtype " + override_name + " has " +
                                    std::to_string(ItemSize(*d)) + "-byte items, the array " +
                                    std::to_string(t.bits / 8)));
    }
    return *d;
  }
  auto d = DTypeOf(t);
  if (!d) {
    Raise(Status::InvalidArgument("arrays of " + DescribeDLType(t) +
                                  " have no gkv dtype (gkv stores f64 f32 f16 bf16 f8e4m3 "
                                  "f8e5m2 i64 i32 i16 i8 u8 bool)"));
  }
  return *d;
}

// True when the array's elements are laid out in C order without gaps (dims of size 1 and
// empty arrays are contiguous whatever their strides say).
template <typename A>
bool CContiguous(const A& a) {
  if (a.size() == 0) return true;
  int64_t expect = 1;
  for (size_t i = a.ndim(); i-- > 0;) {
    if (a.shape(i) != 1 && a.stride(i) != expect) return false;
    expect *= static_cast<int64_t>(a.shape(i));
  }
  return true;
}

BufferMemory MemoryOf(int device_type) {
  switch (device_type) {
    case nb::device::cpu::value:
    case nb::device::cuda_host::value:
      return BufferMemory::kHost;
    case nb::device::cuda::value:
    case nb::device::cuda_managed::value:
      return BufferMemory::kDevice;
    default:
      Raise(Status::NotSupported("arrays on DLPack device type " + std::to_string(device_type) +
                                 " (only CPU and CUDA memory)"));
  }
}

using InArray = nb::ndarray<nb::ro>;
using OutArray = nb::ndarray<>;

struct PutArgs {
  const void* data;
  size_t size;
  PutOptions options;
};

PutArgs PreparePut(const InArray& a, const std::string& dtype_override) {
  if (!CContiguous(a)) {
    Raise(Status::InvalidArgument(
        "non-contiguous array (gkv.Client.put makes a contiguous copy; this call does not)"));
  }
  PutArgs p{a.data(), a.nbytes(), {}};
  p.options.memory = MemoryOf(a.device_type());
  DType d = ArrayDType(a.dtype(), dtype_override);
  if (a.ndim() > static_cast<size_t>(kMaxTensorRank)) {
    Raise(Status::InvalidArgument("rank " + std::to_string(a.ndim()) + " exceeds gkv's " +
                                  std::to_string(kMaxTensorRank)));
  }
  p.options.tensor.dtype = d;
  if (d != DType::kRaw) {
    for (size_t i = 0; i < a.ndim(); ++i) p.options.tensor.shape.push_back(a.shape(i));
  }
  return p;
}

// What a destination of dtype `out` (or a uint8 byte view) may receive: a value of exactly
// `nbytes` bytes that is raw, of the same dtype, or anything when `out` is u8.
std::function<Status(const ValueInfo&)> AcceptInto(DType out, size_t nbytes) {
  return [out, nbytes](const ValueInfo& info) -> Status {
    if (info.size != nbytes) {
      return Status::InvalidArgument("the value is " + std::to_string(info.size) +
                                     " bytes, the destination holds " + std::to_string(nbytes));
    }
    const DType d = info.tensor.dtype;
    if (d == DType::kRaw || d == out || out == DType::kU8) return Status::OK();
    return Status::InvalidArgument("the value is " + info.tensor.ToString() +
                                   ", the destination is " + std::string(DTypeName(out)));
  };
}

std::vector<std::string> KeysFromIds(const std::string& prefix,
                                     const nb::ndarray<const int64_t, nb::ndim<1>>& ids) {
  if (ids.device_type() != nb::device::cpu::value) {
    Raise(Status::InvalidArgument("ids must be in CPU memory"));
  }
  std::vector<std::string> keys(ids.shape(0));
  char buf[24];
  for (size_t i = 0; i < keys.size(); ++i) {
    auto [end, ec] = std::to_chars(buf, buf + sizeof buf, ids(i));
    keys[i].reserve(prefix.size() + (end - buf));
    keys[i].append(prefix).append(buf, end);
  }
  return keys;
}

class PyClient {
 public:
  PyClient(const std::string& cluster, int64_t timeout_ms, int replicas) {
    ClientOptions o;
    o.cluster_file = cluster;
    o.default_timeout = Ms(timeout_ms > 0 ? timeout_ms : 500);
    o.replicas = replicas;
    std::optional<Result<std::unique_ptr<Client>>> r;
    {
      nb::gil_scoped_release unlocked;
      r.emplace(Client::Open(o));
    }
    if (!r->ok()) Raise(r->status().WithContext("opening a client of " + cluster));
    client_ = std::shared_ptr<Client>(std::move(**r));
  }

  void Close() {
    std::shared_ptr<Client> c;
    {
      std::lock_guard lock(mu_);
      c.swap(client_);
    }
    nb::gil_scoped_release unlocked;
    c.reset();  // disconnects unless another thread's call still holds it
  }

  // In a forked child: the client's I/O thread does not exist there, so its destructor would
  // wait forever. The C++ object is leaked on purpose; the child opens its own client.
  void Abandon() {
    std::lock_guard lock(mu_);
    if (client_) new std::shared_ptr<Client>(std::move(client_));
  }

  bool closed() {
    std::lock_guard lock(mu_);
    return client_ == nullptr;
  }

  uint64_t Put(const std::string& key, const InArray& a, const std::string& dtype,
               std::optional<std::vector<int64_t>> shape, bool durable, int64_t timeout_ms) {
    PutArgs p = PreparePut(a, dtype);
    if (shape && p.options.tensor.dtype != DType::kRaw) p.options.tensor.shape = *shape;
    p.options.durable = durable;
    p.options.timeout = Ms(timeout_ms);
    auto c = Use();
    Status check = p.options.tensor.Validate(p.size);
    if (!check.ok()) RaiseFor("put", key, check);
    std::optional<Result<uint64_t>> r;
    {
      nb::gil_scoped_release unlocked;
      r.emplace(c->Put(key, p.data, p.size, p.options));
    }
    if (!r->ok()) RaiseFor("put", key, r->status());
    return **r;
  }

  // (bytes as a 1-D uint8 numpy array owning them, dtype name, shape, version, tier)
  nb::tuple Get(const std::string& key, int64_t timeout_ms, bool fail_open) {
    auto c = Use();
    GetOptions o;
    o.timeout = Ms(timeout_ms);
    o.fail_open = fail_open;
    std::optional<Result<Value>> r;
    {
      nb::gil_scoped_release unlocked;
      r.emplace(c->Get(key, o));
    }
    if (!r->ok()) RaiseFor("get", key, r->status());
    auto* v = new Value(std::move(**r));
    nb::capsule owner(v, [](void* p) noexcept { delete static_cast<Value*>(p); });
    size_t shape[1] = {v->size()};
    nb::ndarray<nb::numpy, uint8_t, nb::ndim<1>> bytes(v->mutable_data(), 1, shape, owner);
    const ValueInfo& info = v->info();
    return nb::make_tuple(bytes, std::string(DTypeName(info.tensor.dtype)), info.tensor.shape,
                          info.version, info.tier);
  }

  uint64_t GetInto(const std::string& key, const OutArray& out, const std::string& as_dtype,
                   int64_t timeout_ms, bool fail_open) {
    if (!CContiguous(out)) {
      Raise(
          Status::InvalidArgument("get_into needs a contiguous destination (it is written "
                                  "in place)"));
    }
    GetOptions o;
    o.timeout = Ms(timeout_ms);
    o.fail_open = fail_open;
    o.memory = MemoryOf(out.device_type());
    o.accept = AcceptInto(ArrayDType(out.dtype(), as_dtype), out.nbytes());
    auto c = Use();
    std::optional<Result<ValueInfo>> r;
    {
      nb::gil_scoped_release unlocked;
      r.emplace(c->GetInto(key, out.data(), out.nbytes(), o));
    }
    if (!r->ok()) RaiseFor("get_into", key, r->status());
    return (*r)->version;
  }

  // Row i of `out` from keys[i]; mask[i] = hit. Returns the hit count; raises the first error
  // that is not a miss (after every row that hit was written).
  size_t MultiGetInto(const std::vector<std::string>& keys, const OutArray& out,
                      const nb::ndarray<bool, nb::ndim<1>, nb::device::cpu>& mask,
                      const std::string& as_dtype, int64_t timeout_ms, bool fail_open) {
    if (out.ndim() < 1 || out.shape(0) != keys.size()) {
      Raise(Status::InvalidArgument("multi_get_into needs one row of `out` per key (" +
                                    std::to_string(keys.size()) + " keys, " +
                                    (out.ndim() ? std::to_string(out.shape(0)) : "no") + " rows)"));
    }
    if (mask.shape(0) != keys.size()) Raise(Status::Internal("mask of the wrong length"));
    // Rows: each one contiguous; rows may be further apart (a view of a wider buffer).
    size_t row_elems = 1;
    int64_t expect = 1;
    for (size_t i = out.ndim(); i-- > 1;) {
      if (out.shape(i) != 1 && out.stride(i) != expect) {
        Raise(Status::InvalidArgument("multi_get_into needs each row of `out` contiguous"));
      }
      expect *= static_cast<int64_t>(out.shape(i));
      row_elems *= out.shape(i);
    }
    const size_t item = out.itemsize();
    const size_t row_bytes = row_elems * item;
    if (keys.size() > 1 && out.stride(0) < static_cast<int64_t>(row_elems)) {
      Raise(Status::InvalidArgument("rows of `out` overlap"));
    }
    const size_t stride = keys.size() > 1 ? out.stride(0) * item : row_bytes;
    GetOptions o;
    o.timeout = Ms(timeout_ms);
    o.fail_open = fail_open;
    o.memory = MemoryOf(out.device_type());
    o.accept = AcceptInto(ArrayDType(out.dtype(), as_dtype), row_bytes);
    auto c = Use();
    std::vector<Status> res;
    {
      nb::gil_scoped_release unlocked;
      res = c->MultiGetInto(keys, out.data(), stride, row_bytes, o);
    }
    size_t hits = 0;
    const Status* first = nullptr;
    size_t first_at = 0;
    bool* m = mask.data();
    for (size_t i = 0; i < res.size(); ++i) {
      m[i] = res[i].ok();
      hits += m[i];
      if (!first && !res[i].ok() && !res[i].IsNotFound()) {
        first = &res[i];
        first_at = i;
      }
    }
    if (first) {
      RaiseFor("multi_get_into", keys[first_at],
               first->WithContext("key " + std::to_string(first_at) + " of " +
                                  std::to_string(keys.size())));
    }
    return hits;
  }

  size_t MultiGetIntoIds(const std::string& prefix,
                         const nb::ndarray<const int64_t, nb::ndim<1>>& ids, const OutArray& out,
                         const nb::ndarray<bool, nb::ndim<1>, nb::device::cpu>& mask,
                         const std::string& as_dtype, int64_t timeout_ms, bool fail_open) {
    return MultiGetInto(KeysFromIds(prefix, ids), out, mask, as_dtype, timeout_ms, fail_open);
  }

  // items: (key, array, dtype override); returns the versions; raises the first failure.
  std::vector<uint64_t> MultiPut(const std::vector<std::string>& keys,
                                 const std::vector<InArray>& arrays,
                                 const std::vector<std::string>& dtypes, bool durable,
                                 int64_t timeout_ms) {
    if (arrays.size() != keys.size() || dtypes.size() != keys.size()) {
      Raise(Status::Internal("multi_put: lists of different lengths"));
    }
    std::vector<PutItem> items(keys.size());
    BufferMemory memory = BufferMemory::kHost;
    for (size_t i = 0; i < keys.size(); ++i) {
      PutArgs p = PreparePut(arrays[i], dtypes[i]);
      if (p.options.memory == BufferMemory::kDevice) memory = BufferMemory::kAuto;
      Status check = p.options.tensor.Validate(p.size);
      if (!check.ok()) RaiseFor("multi_put", keys[i], check);
      items[i] = PutItem{keys[i], p.data, p.size, std::move(p.options.tensor)};
    }
    return RunMultiPut(items, memory, durable, timeout_ms);
  }

  // Row i of `rows` (rank >= 1, C-contiguous) under keys[i], each a tensor of rows.shape[1:].
  std::vector<uint64_t> MultiPutRows(const std::vector<std::string>& keys, const InArray& rows,
                                     const std::string& dtype, bool durable, int64_t timeout_ms) {
    if (rows.ndim() < 1 || rows.shape(0) != keys.size()) {
      Raise(Status::InvalidArgument("multi_put_rows needs one row per key"));
    }
    if (!CContiguous(rows)) Raise(Status::InvalidArgument("multi_put_rows needs contiguous rows"));
    const DType d = ArrayDType(rows.dtype(), dtype);
    TensorMeta meta{d, {}};
    size_t row_elems = 1;
    for (size_t i = 1; i < rows.ndim(); ++i) {
      if (d != DType::kRaw) meta.shape.push_back(rows.shape(i));
      row_elems *= rows.shape(i);
    }
    const size_t row_bytes = row_elems * rows.itemsize();
    std::vector<PutItem> items(keys.size());
    const auto* base = static_cast<const std::byte*>(rows.data());
    for (size_t i = 0; i < keys.size(); ++i) {
      items[i] = PutItem{keys[i], base + i * row_bytes, row_bytes, meta};
    }
    return RunMultiPut(items, MemoryOf(rows.device_type()), durable, timeout_ms);
  }

  std::vector<uint64_t> MultiPutRowsIds(const std::string& prefix,
                                        const nb::ndarray<const int64_t, nb::ndim<1>>& ids,
                                        const InArray& rows, const std::string& dtype, bool durable,
                                        int64_t timeout_ms) {
    return MultiPutRows(KeysFromIds(prefix, ids), rows, dtype, durable, timeout_ms);
  }

  void Delete(const std::string& key, int64_t timeout_ms) {
    auto c = Use();
    Status s;
    {
      nb::gil_scoped_release unlocked;
      s = c->Delete(key, Ms(timeout_ms));
    }
    if (!s.ok()) RaiseFor("delete", key, s);
  }

  // (size, version, dtype name, shape, tier, on_disk)
  nb::tuple Stat(const std::string& key, int64_t timeout_ms) {
    auto c = Use();
    std::optional<Result<ValueInfo>> r;
    {
      nb::gil_scoped_release unlocked;
      r.emplace(c->Stat(key, Ms(timeout_ms)));
    }
    if (!r->ok()) RaiseFor("stat", key, r->status());
    const ValueInfo& i = **r;
    return nb::make_tuple(i.size, i.version, std::string(DTypeName(i.tensor.dtype)), i.tensor.shape,
                          i.tier, i.on_disk);
  }

  // One node's statistics as JSON (docs/STATS.md).
  std::string NodeStats(int node, int64_t timeout_ms) {
    auto c = Use();
    std::optional<Result<std::string>> r;
    {
      nb::gil_scoped_release unlocked;
      r.emplace(c->NodeStats(node, Ms(timeout_ms)));
    }
    if (!r->ok()) Raise(r->status().WithContext("stats of node " + NodeId(node)));
    return **r;
  }

  std::string Ping(int node, int64_t timeout_ms) {
    auto c = Use();
    std::optional<Result<std::string>> r;
    {
      nb::gil_scoped_release unlocked;
      r.emplace(c->Ping(node, Ms(timeout_ms)));
    }
    if (!r->ok()) Raise(r->status().WithContext("ping of node " + NodeId(node)));
    return **r;
  }

  // Every node the client knows of, by the index Ping, NodeStats and NodeFor use (under etcd
  // the members as the client learnt of them; the cluster file lists none).
  std::vector<std::string> Nodes() {
    std::vector<std::string> ids;
    for (const auto& n : Use()->Nodes()) ids.push_back(n.id);
    return ids;
  }

  int NodeFor(const std::string& key) { return Use()->NodeFor(key); }
  std::vector<int> RingMembers() { return Use()->RingMembers(); }

 private:
  std::shared_ptr<Client> Use() {
    std::lock_guard lock(mu_);
    if (!client_) Raise(Status::Aborted("the client is closed"));
    return client_;
  }

  std::string NodeId(int node) {
    const std::vector<NodeInfo> nodes = Use()->Nodes();
    if (node < 0 || node >= static_cast<int>(nodes.size())) return std::to_string(node);
    return nodes[node].id;
  }

  std::vector<uint64_t> RunMultiPut(const std::vector<PutItem>& items, BufferMemory memory,
                                    bool durable, int64_t timeout_ms) {
    PutOptions o;
    o.durable = durable;
    o.timeout = Ms(timeout_ms);
    o.memory = memory;
    auto c = Use();
    std::vector<Result<uint64_t>> res;
    {
      nb::gil_scoped_release unlocked;
      res = c->MultiPut(items, o);
    }
    std::vector<uint64_t> versions(res.size());
    size_t failed = 0;
    const Result<uint64_t>* first = nullptr;
    size_t first_at = 0;
    for (size_t i = 0; i < res.size(); ++i) {
      if (res[i].ok()) {
        versions[i] = *res[i];
        continue;
      }
      if (!first) {
        first = &res[i];
        first_at = i;
      }
      ++failed;
    }
    if (first) {
      RaiseFor("multi_put", items[first_at].key,
               first->status().WithContext(std::to_string(failed) + " of " +
                                           std::to_string(res.size()) + " items failed"));
    }
    return versions;
  }

  std::mutex mu_;
  std::shared_ptr<Client> client_;
};

}  // namespace
}  // namespace gkv::python

NB_MODULE(_gkv, m) {
  using namespace gkv;
  using namespace gkv::python;
  m.doc() = "gkv's compiled core; use the gkv package (gkv.Client), not this module.";

  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const StatusError& e) {
      nb::object exc = nb::module_::import_("gkv._errors")
                           .attr("from_status")(static_cast<int>(e.status.code()),
                                                std::string(e.status.message()));
      PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
    }
  });

  m.def("dtype_names", [] {
    std::vector<std::string> names;
    for (int d = 0; d <= static_cast<int>(DType::kBool); ++d) {
      names.emplace_back(DTypeName(static_cast<DType>(d)));
    }
    return names;
  });
  m.def("status_code_names", [] {
    std::vector<std::pair<int, std::string>> codes;
    for (int c = 0; c <= static_cast<int>(kLastStatusCode); ++c) {
      codes.emplace_back(c, std::string(StatusCodeName(static_cast<StatusCode>(c))));
    }
    return codes;
  });

  nb::class_<PyClient>(m, "_Client")
      .def(nb::init<const std::string&, int64_t, int>(), nb::arg("cluster"), nb::arg("timeout_ms"),
           nb::arg("replicas"))
      .def("close", &PyClient::Close)
      .def("abandon", &PyClient::Abandon)
      .def_prop_ro("closed", &PyClient::closed)
      .def("put", &PyClient::Put, nb::arg("key"), nb::arg("array").noconvert(), nb::arg("dtype"),
           nb::arg("shape").none(), nb::arg("durable"), nb::arg("timeout_ms"))
      .def("get", &PyClient::Get, nb::arg("key"), nb::arg("timeout_ms"), nb::arg("fail_open"))
      .def("get_into", &PyClient::GetInto, nb::arg("key"), nb::arg("out").noconvert(),
           nb::arg("as_dtype"), nb::arg("timeout_ms"), nb::arg("fail_open"))
      .def("multi_get_into", &PyClient::MultiGetInto, nb::arg("keys"), nb::arg("out").noconvert(),
           nb::arg("mask").noconvert(), nb::arg("as_dtype"), nb::arg("timeout_ms"),
           nb::arg("fail_open"))
      .def("multi_get_into_ids", &PyClient::MultiGetIntoIds, nb::arg("prefix"),
           nb::arg("ids").noconvert(), nb::arg("out").noconvert(), nb::arg("mask").noconvert(),
           nb::arg("as_dtype"), nb::arg("timeout_ms"), nb::arg("fail_open"))
      .def("multi_put", &PyClient::MultiPut, nb::arg("keys"), nb::arg("arrays"), nb::arg("dtypes"),
           nb::arg("durable"), nb::arg("timeout_ms"))
      .def("multi_put_rows", &PyClient::MultiPutRows, nb::arg("keys"), nb::arg("rows").noconvert(),
           nb::arg("dtype"), nb::arg("durable"), nb::arg("timeout_ms"))
      .def("multi_put_rows_ids", &PyClient::MultiPutRowsIds, nb::arg("prefix"),
           nb::arg("ids").noconvert(), nb::arg("rows").noconvert(), nb::arg("dtype"),
           nb::arg("durable"), nb::arg("timeout_ms"))
      .def("delete", &PyClient::Delete, nb::arg("key"), nb::arg("timeout_ms"))
      .def("stat", &PyClient::Stat, nb::arg("key"), nb::arg("timeout_ms"))
      .def("node_stats", &PyClient::NodeStats, nb::arg("node"), nb::arg("timeout_ms"))
      .def("ping", &PyClient::Ping, nb::arg("node"), nb::arg("timeout_ms"))
      .def("nodes", &PyClient::Nodes)
      .def("node_for", &PyClient::NodeFor, nb::arg("key"))
      .def("ring_members", &PyClient::RingMembers);
}
