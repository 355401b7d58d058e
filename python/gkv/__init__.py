"""gkv: the Python client of a gkv cluster (a distributed GPU key-value and tensor cache).

    import gkv, torch
    with gkv.Client("cluster.yaml") as c:
        c.put("emb/7", torch.randn(128))        # dtype and shape are stored with the bytes
        row = c.get("emb/7")                     # a torch tensor (numpy without torch)
        out = torch.empty(4, 128)
        hit = c.multi_get_into(["emb/1", "emb/2", "emb/7", "emb/9"], out)  # rows in place

Values are torch tensors (CPU or CUDA), numpy arrays, bytes, or any object speaking DLPack or
the buffer protocol. Memory rules:

* CPU arrays are read (put) and written (get_into, multi_get_into) in place: no copy.
  ``get`` receives the value into one buffer it allocates and returns a tensor viewing it.
* CUDA tensors go to and from UCX directly when UCX can move device memory, else through one
  host staging copy in the client. ``get(key, device="cuda:0")`` receives into host memory and
  copies to the device once. Before a CUDA tensor is read or written, gkv synchronizes the
  tensor's current stream.
* ``put`` of a non-contiguous tensor makes one contiguous copy first; ``get_into`` and
  ``multi_get_into`` refuse a non-contiguous destination (InvalidArgument).
* Every call that waits releases the GIL; the ``*_async`` forms return
  ``concurrent.futures.Future`` objects so a fetch overlaps compute.

A Client is thread-safe and bound to the process that opened it. A pickled Client (a worker
started by 'spawn' or 'forkserver', e.g. ``DataLoader(multiprocessing_context="forkserver")``)
opens its own connections on first use. UCX does not survive fork: in a process forked after a
gkv.Client was opened, opening or using one raises gkv.NotSupported at once (the parent's
clients keep working). Errors are gkv.Error subclasses carrying gkv's status
code (gkv.NotFound is also a KeyError).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import sys
import threading
import weakref
from typing import Any, Iterable, Mapping, NamedTuple, Sequence

import numpy as np

try:  # UCX from the libucx wheel, when installed (pip); the build tree finds it by RPATH.
    import libucx as _libucx

    _libucx.load_library()
except Exception:  # noqa: BLE001 (absent or unloadable: the extension's RPATH is tried next)
    pass

from . import _gkv
from ._errors import (Aborted, Busy, Corruption, Error, Internal, InvalidArgument, IOError, NoSpace,
                      NotFound, NotSupported, PermissionDenied, ProtocolError, Timeout,
                      Unavailable, WrongNode)

__all__ = [
    "Client", "StatInfo", "DTYPES", "Error", "NotFound", "InvalidArgument", "NoSpace",
    "Unavailable", "Timeout", "IOError", "Corruption", "ProtocolError", "PermissionDenied",
    "NotSupported", "Aborted", "Internal", "Busy", "WrongNode",
]
__version__ = "0.1.0"

#: gkv's dtype names (gkv/tensor.h), "raw" first.
DTYPES: tuple[str, ...] = tuple(_gkv.dtype_names())

_NUMPY_DTYPES = {
    "f64": np.float64, "f32": np.float32, "f16": np.float16, "i64": np.int64, "i32": np.int32,
    "i16": np.int16, "i8": np.int8, "u8": np.uint8, "bool": np.bool_,
}
_TORCH_DTYPE_NAMES = {
    "f64": "float64", "f32": "float32", "f16": "float16", "bf16": "bfloat16",
    "f8e4m3": "float8_e4m3fn", "f8e5m2": "float8_e5m2", "i64": "int64", "i32": "int32",
    "i16": "int16", "i8": "int8", "u8": "uint8", "bool": "bool",
}
# Torch dtypes passed to the extension as a uint8 view with the gkv dtype named explicitly
# (DLPack can't carry fp8, and older torch refuses to export bool).
_TORCH_BYTE_VIEW = ("bool", "f8e4m3", "f8e5m2")


class StatInfo(NamedTuple):
    """What a node knows about a stored value (``Client.stat``)."""
    size: int
    version: int
    dtype: str  # a gkv dtype name: "f32", "bf16", ..., "raw"
    shape: tuple[int, ...]
    tier: str  # "gpu", "host" or "disk"
    on_disk: bool


def _torch():
    return sys.modules.get("torch")


def _is_torch(x: Any) -> bool:
    t = _torch()
    return t is not None and isinstance(x, t.Tensor)


def _torch_dtype(name: str):
    t = _torch()
    attr = _TORCH_DTYPE_NAMES.get(name)
    return getattr(t, attr, None) if (t is not None and attr) else None


def _gkv_name_of_torch(dtype) -> str | None:
    for name, attr in _TORCH_DTYPE_NAMES.items():
        if getattr(_torch(), attr, None) == dtype:
            return name
    return None


def _ms(timeout: float | None) -> int:
    if timeout is None:
        return 0
    if timeout <= 0:
        raise InvalidArgument(f"timeout must be positive, got {timeout}")
    return max(1, round(timeout * 1000))


def _sync_cuda(t) -> None:
    if t.is_cuda:
        _torch().cuda.current_stream(t.device).synchronize()


def _as_source(value: Any, dtype: str | None):
    """(array for the extension, gkv dtype override or "", shape override or None)."""
    if _is_torch(value):
        t = value.detach()
        if not t.is_contiguous():
            t = t.contiguous()  # the one documented copy
        _sync_cuda(t)
        name = _gkv_name_of_torch(t.dtype)
        if name is None:
            raise InvalidArgument(f"torch {t.dtype} has no gkv dtype")
        if name in _TORCH_BYTE_VIEW:
            return t.view(_torch().uint8), dtype or name, list(t.shape)
        return t, dtype or "", None
    if isinstance(value, (bytes, bytearray, memoryview)):
        return np.frombuffer(value, dtype=np.uint8), dtype or "raw", None
    if isinstance(value, np.ndarray) or np.isscalar(value):
        a = np.asarray(value)
        if not a.flags.c_contiguous:
            a = np.ascontiguousarray(a)  # the one documented copy
        return a, dtype or "", None
    if hasattr(value, "__dlpack__"):
        return value, dtype or "", None
    try:
        a = np.asarray(memoryview(value))
    except TypeError:
        raise InvalidArgument(
            f"can't store a {type(value).__name__}: pass a tensor, an array, bytes or an "
            "object with __dlpack__ or the buffer protocol") from None
    return np.ascontiguousarray(a), dtype or "", None


def _as_destination(out: Any):
    """(array the extension writes in place, gkv dtype override or "")."""
    if _is_torch(out):
        t = out.detach()  # same memory
        if not t.is_contiguous():
            raise InvalidArgument("the destination tensor is not contiguous (gkv writes it in "
                                  "place; pass a contiguous tensor)")
        _sync_cuda(t)
        name = _gkv_name_of_torch(t.dtype)
        if name in _TORCH_BYTE_VIEW:
            return t.view(_torch().uint8), name
        return t, ""
    if isinstance(out, np.ndarray):
        if not out.flags.writeable:
            raise InvalidArgument("the destination array is read-only")
        return out, ""
    return out, ""


def _rows_destination(out: Any):
    """Like _as_destination, but rows may be a view into a wider buffer (stride of dim 0)."""
    if _is_torch(out):
        t = out.detach()
        _sync_cuda(t)
        name = _gkv_name_of_torch(t.dtype)
        if name in _TORCH_BYTE_VIEW:
            return t.view(_torch().uint8), name
        return t, ""
    if isinstance(out, np.ndarray) and not out.flags.writeable:
        raise InvalidArgument("the destination array is read-only")
    return out, ""


def _ids_array(ids: Any) -> np.ndarray:
    if _is_torch(ids):
        ids = ids.detach().cpu().numpy()
    a = np.asarray(ids)
    if a.ndim != 1:
        a = a.reshape(-1)
    if a.dtype != np.int64:
        if not np.issubdtype(a.dtype, np.integer) and a.size:
            raise InvalidArgument(f"ids must be integers, got {a.dtype}")
        a = a.astype(np.int64)
    return np.ascontiguousarray(a)


_live_clients: "weakref.WeakSet[Client]" = weakref.WeakSet()
# Set once this process (or the one it was forked from) started UCX. UCX does not survive
# fork: its global async thread stays in the parent, so a child's connections never complete.
_ucx_started = False
_ucx_inherited = False


def _forked_from_ucx() -> bool:
    """Whether this process was forked from one that had started UCX (no gkv.Client works
    here: gkv.torch then reads the dataset or loader directly)."""
    return _ucx_inherited


def _after_fork_in_child() -> None:
    # The parent's I/O thread does not exist in the child: its clients' C++ objects are left
    # alone (destroying one would wait for that thread forever).
    global _ucx_inherited
    _ucx_inherited = _ucx_started
    for c in list(_live_clients):
        c._forget_after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class Client:
    """A client of a gkv cluster.

    Args:
        cluster: the cluster file (YAML listing the nodes; docs in README.md).
        timeout: default deadline of a call, in seconds. A dead or hung node costs at most
            this; raise it for values of tens of MiB.
        replicas: base replication: every put and delete goes to the key's first ``replicas``
            nodes on the ring; reads go to the first live one, and a tenth of them also check
            the other replicas' versions and have a lagging one repaired (read repair).
        async_workers: threads that run the ``*_async`` calls.

    Use as a context manager, or call ``close()``. Thread-safe; bound to its process (pickle
    it to a 'spawn'/'forkserver' worker, which reopens it; after fork it raises NotSupported).
    """

    def __init__(self, cluster: str = "cluster.yaml", timeout: float = 0.5, replicas: int = 1,
                 *, async_workers: int = 4) -> None:
        if replicas < 1:
            raise InvalidArgument(f"replicas must be at least 1, got {replicas}")
        self._args = (os.fspath(cluster), float(timeout), int(replicas), int(async_workers))
        self._lock = threading.Lock()
        self._core_obj = None
        self._pid = None
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._closed = False
        _ms(timeout)
        self._core()  # open now, so a bad cluster file or an unreachable UCX fails here
        _live_clients.add(self)

    # --- lifetime ---

    def _core(self):
        c = self._core_obj
        if c is not None and self._pid == os.getpid():
            return c
        with self._lock:
            if self._closed:
                raise Aborted("the client is closed")
            if self._core_obj is None or self._pid != os.getpid():
                if _ucx_inherited:
                    raise NotSupported(
                        "this process was forked from one that had a gkv.Client open, and UCX "
                        "does not survive fork; start workers with the 'spawn' or 'forkserver' "
                        "method (DataLoader(..., multiprocessing_context='forkserver'))")
                cluster, timeout, replicas, _ = self._args
                global _ucx_started
                self._core_obj = _gkv._Client(cluster, _ms(timeout), replicas)
                _ucx_started = True  # only once UCX really started (a failed open did not)
                self._pid = os.getpid()
                self._executor = None
            return self._core_obj

    def _forget_after_fork(self) -> None:
        c = self._core_obj
        if c is not None:
            c.abandon()
        self._core_obj = None
        self._executor = None
        self._lock = threading.Lock()

    def close(self) -> None:
        """Waits for the async calls in flight, then disconnects. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            ex, self._executor = self._executor, None
            c, self._core_obj = self._core_obj, None
            mine = self._pid == os.getpid()
        if ex is not None and mine:
            ex.shutdown(wait=True)
        if c is not None:
            if mine:
                c.close()
            else:
                c.abandon()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            if self._pid != os.getpid() and self._core_obj is not None:
                self._core_obj.abandon()
        except Exception:  # noqa: BLE001 (interpreter shutdown)
            pass

    def __getstate__(self):
        # A pickled client (a spawned DataLoader worker) carries its arguments only.
        return {"args": self._args}

    def __setstate__(self, state) -> None:
        self._args = state["args"]
        self._lock = threading.Lock()
        self._core_obj = None
        self._pid = None
        self._executor = None
        self._closed = False
        _live_clients.add(self)

    def __repr__(self) -> str:
        return f"gkv.Client(cluster={self._args[0]!r}, timeout={self._args[1]}, " \
               f"replicas={self._args[2]})"

    @property
    def cluster(self) -> str:
        return self._args[0]

    @property
    def nodes(self) -> list[str]:
        """The ids of the nodes in the ring the client routes by now: a static cluster's nodes
        in file order; under etcd the members that own keys, sorted by id (a node that left,
        or is draining, is not listed)."""
        return [nid for _, nid in self._members(self._core())]

    def _members(self, c) -> list[tuple[int, str]]:
        members = c.ring_members()  # first: the node table only grows, so each index is in it
        known = c.nodes()
        return [(i, known[i]) for i in members]

    def node_for(self, key: str) -> str:
        """The id of the node that owns ``key`` in the client's ring. Raises ``Unavailable``
        when the ring has no members (under etcd, every node left)."""
        c = self._core()
        index = c.node_for(key)
        if index < 0:
            raise Unavailable("the ring has no members")
        return c.nodes()[index]

    # --- operations ---

    def put(self, key: str, value: Any, durable: bool = False, *, dtype: str | None = None,
            timeout: float | None = None) -> int:
        """Stores ``value`` under ``key`` and returns its new version.

        ``value``: a torch tensor (CPU or CUDA), numpy array, bytes, or any DLPack/buffer
        object; its dtype and shape are stored as gkv tensor metadata (bytes are stored raw).
        ``dtype`` names a gkv dtype to store instead of the array's own (same item size),
        e.g. ``"f8e4m3"`` for a uint8 view of fp8 data. ``durable`` writes it through to the
        node's disk before returning."""
        arr, dt, shape = _as_source(value, dtype)
        return self._core().put(key, arr, dt, shape, durable, _ms(timeout))

    def get(self, key: str, device: Any = None, *, framework: str | None = None,
            fail_open: bool = False, timeout: float | None = None) -> Any:
        """The value of ``key`` with its stored dtype and shape.

        A torch tensor when torch is imported (``framework="numpy"`` or ``"torch"`` chooses),
        else a numpy array; raw values come back as ``bytes``. ``device`` (e.g. "cuda:0")
        puts the tensor there. Raises NotFound (a KeyError) for a missing key."""
        buf, dtype, shape, _, _ = self._core().get(key, _ms(timeout), fail_open)
        if dtype == "raw":
            return buf.tobytes()
        use_torch = framework == "torch" or (framework is None and _torch() is not None)
        if framework not in (None, "torch", "numpy"):
            raise InvalidArgument(f"framework must be 'torch' or 'numpy', got {framework!r}")
        if use_torch:
            torch = _torch()
            if torch is None:
                raise NotSupported("framework='torch' needs torch imported")
            tdt = _torch_dtype(dtype)
            if tdt is None:
                raise NotSupported(f"{dtype} has no dtype in torch {torch.__version__} (read its "
                                   "bytes with get_into into a uint8 tensor)")
            t = torch.from_numpy(buf).view(tdt).reshape(tuple(shape))
            return t.to(device) if device is not None else t
        if device is not None and str(device) != "cpu":
            raise InvalidArgument("device= other than 'cpu' needs torch")
        npdt = _NUMPY_DTYPES.get(dtype)
        if npdt is None:
            raise NotSupported(f"{dtype} has no numpy dtype: import torch, or read its bytes "
                               "with get_into into a uint8 array")
        return buf.view(npdt).reshape(tuple(shape))

    def get_into(self, key: str, out: Any, *, fail_open: bool = False,
                 timeout: float | None = None) -> int:
        """Receives the value of ``key`` into ``out`` in place and returns its version.

        ``out`` must be contiguous, hold exactly the value's bytes, and have the value's dtype
        (a raw value fits any dtype; a uint8 ``out`` takes any value's bytes). On a mismatch
        InvalidArgument is raised and nothing is written."""
        arr, as_dtype = _as_destination(out)
        return self._core().get_into(key, arr, as_dtype, _ms(timeout), fail_open)

    def multi_get_into(self, keys: Sequence[str] | Any, out: Any, *, prefix: str | None = None,
                       fail_open: bool = False, timeout: float | None = None) -> Any:
        """Writes row i of ``out`` (``out[i]``: contiguous, of the values' dtype and size) from
        key i in one call (one message per node) and returns the hit mask (a bool numpy
        array, or a torch tensor when ``out`` is one; on the CPU).

        ``keys``: strings, or integer ids (array, tensor or sequence) with ``prefix``: key i is
        ``prefix + str(ids[i])``, built in C++. Rows of misses are left untouched. Errors
        other than misses raise (after the rows that hit were written); ``fail_open`` turns
        unreachable nodes into misses."""
        arr, as_dtype = _rows_destination(out)
        c = self._core()
        if prefix is not None:
            ids = _ids_array(keys)
            mask = np.empty(ids.shape[0], dtype=np.bool_)
            c.multi_get_into_ids(prefix, ids, arr, mask, as_dtype, _ms(timeout), fail_open)
        else:
            keys = keys if isinstance(keys, list) else list(keys)
            mask = np.empty(len(keys), dtype=np.bool_)
            c.multi_get_into(keys, arr, mask, as_dtype, _ms(timeout), fail_open)
        return _torch().from_numpy(mask) if _is_torch(out) else mask

    def multi_put(self, items: Mapping[str, Any] | Iterable[tuple[str, Any]],
                  durable: bool = False, *, timeout: float | None = None) -> list[int]:
        """Stores many values (a mapping or (key, value) pairs) in one message per node;
        returns their versions in order. Raises the first failure (naming how many failed)."""
        pairs = list(items.items()) if isinstance(items, Mapping) else list(items)
        keys, arrays, dtypes = [], [], []
        for k, v in pairs:
            arr, dt, _ = _as_source(v, None)  # byte views (bool, fp8) keep their shape
            keys.append(k)
            arrays.append(arr)
            dtypes.append(dt)
        return self._core().multi_put(keys, arrays, dtypes, durable, _ms(timeout))

    def multi_put_rows(self, keys: Sequence[str] | Any, rows: Any, durable: bool = False, *,
                       prefix: str | None = None, timeout: float | None = None) -> list[int]:
        """Stores row i of ``rows`` (a tensor of rank >= 1) under key i, each a tensor of
        ``rows.shape[1:]``; ``keys`` as for multi_get_into (ids with ``prefix``)."""
        arr, dt, _ = _as_source(rows, None)
        c = self._core()
        if prefix is not None:
            return c.multi_put_rows_ids(prefix, _ids_array(keys), arr, dt, durable, _ms(timeout))
        keys = keys if isinstance(keys, list) else list(keys)
        return c.multi_put_rows(keys, arr, dt, durable, _ms(timeout))

    def delete(self, key: str, *, missing_ok: bool = False, timeout: float | None = None) -> bool:
        """Deletes ``key`` (from every replica). Returns False for a missing key when
        ``missing_ok``, else raises NotFound."""
        try:
            self._core().delete(key, _ms(timeout))
            return True
        except NotFound:
            if missing_ok:
                return False
            raise

    def stat(self, key: str, *, timeout: float | None = None) -> StatInfo:
        """Size, version, dtype, shape and tier of ``key``'s value, without its bytes."""
        size, version, dtype, shape, tier, on_disk = self._core().stat(key, _ms(timeout))
        return StatInfo(size, version, dtype, tuple(shape), tier, on_disk)

    def stats(self, *, timeout: float | None = None) -> dict[str, dict]:
        """The statistics (docs/STATS.md) of every node in ``nodes``, keyed by node id."""
        c = self._core()
        return {nid: json.loads(c.node_stats(i, _ms(timeout))) for i, nid in self._members(c)}

    def ping(self, *, timeout: float | None = None) -> dict[str, str]:
        """Pings every node in ``nodes``; maps each node id to "ok" or its error."""
        c = self._core()
        result = {}
        for i, nid in self._members(c):
            try:
                c.ping(i, _ms(timeout))
                result[nid] = "ok"
            except Error as e:
                result[nid] = str(e)
        return result

    # --- async forms: concurrent.futures.Future; the buffers are borrowed until done ---

    def _submit(self, fn, *args, **kwargs) -> concurrent.futures.Future:
        self._core()
        with self._lock:
            if self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(
                    max_workers=self._args[3], thread_name_prefix="gkv")
            ex = self._executor
        return ex.submit(fn, *args, **kwargs)

    def put_async(self, key: str, value: Any, durable: bool = False,
                  **kw) -> concurrent.futures.Future:
        """``put`` in the background; the future's result is the version."""
        return self._submit(self.put, key, value, durable, **kw)

    def get_async(self, key: str, device: Any = None, **kw) -> concurrent.futures.Future:
        """``get`` in the background; the future's result is the value."""
        return self._submit(self.get, key, device, **kw)

    def get_into_async(self, key: str, out: Any, **kw) -> concurrent.futures.Future:
        """``get_into`` in the background; don't touch ``out`` until the future is done."""
        return self._submit(self.get_into, key, out, **kw)

    def multi_get_into_async(self, keys: Any, out: Any, **kw) -> concurrent.futures.Future:
        """``multi_get_into`` in the background; the result is the hit mask."""
        return self._submit(self.multi_get_into, keys, out, **kw)

    def multi_put_async(self, items: Any, durable: bool = False,
                        **kw) -> concurrent.futures.Future:
        """``multi_put`` in the background; the result is the versions."""
        return self._submit(self.multi_put, items, durable, **kw)
