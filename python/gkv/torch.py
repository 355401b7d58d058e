"""PyTorch training integrations: an embedding-row cache and a caching dataset wrapper.

Importable only where torch is. Both classes are thread-safe and work in DataLoader worker
processes. Workers started by 'spawn' or 'forkserver' unpickle the gkv.Client, which opens its
own connections there, so every worker talks to the cluster on its own. Workers started by
'fork' (DataLoader's default on Linux) cannot use UCX when the parent had a client open: there
every sample comes from the wrapped dataset (or loader), with one RuntimeWarning per process
naming the fix (``multiprocessing_context="forkserver"``), never an exception.
"""

from __future__ import annotations

import collections
import concurrent.futures
import json
import os
import threading
import warnings
from typing import Any, Callable

import numpy as np
import torch

from . import (Busy, Client, InvalidArgument, NoSpace, NotFound, Timeout, Unavailable, WrongNode,
               _forked_from_ucx, _ids_array)

__all__ = ["EmbeddingCache", "CachedDataset"]

# The cache cannot answer (a node down, hung, overloaded, or its ring moving past the call's
# deadline): with fail_open the step goes on from the loader or the dataset. Anything else (a
# wrong shape, a bad argument, a corrupt value, an internal error) is the caller's to see.
_CACHE_DOWN = (Unavailable, Timeout, Busy, WrongNode)
# With fail_open, a write back that did not fit (a full cache) costs a later miss, not the step.
_WRITE_SKIPPED = _CACHE_DOWN + (NoSpace,)

_warned_pids: set[int] = set()


def _cache_unusable_here() -> bool:
    """True in a process forked after UCX started (one warning per process)."""
    if not _forked_from_ucx():
        return False
    if os.getpid() not in _warned_pids:
        _warned_pids.add(os.getpid())
        warnings.warn(
            "gkv: this process was forked from one that had a gkv.Client open and UCX does not "
            "survive fork, so gkv.torch reads the dataset/loader directly here; start DataLoader "
            "workers with multiprocessing_context='forkserver' (or 'spawn') to use the cache",
            RuntimeWarning, stacklevel=3)
    return True


class EmbeddingCache:
    """Rows of an embedding table kept in gkv, keyed ``f"{table}/{id}"``, each a
    ``dtype[dim]`` tensor.

    ``lookup(ids)`` returns a ``[len(ids), dim]`` tensor on ``device``: rows that hit come from
    one ``multi_get_into`` straight into the result; misses come from ``loader(missing_ids)``
    (a 1-D int64 CPU tensor of distinct ids -> a ``[n, dim]`` tensor), are written back
    (``write_back``) and filled in. ``prefetch(ids)`` starts that in the background; the
    ``lookup`` of the same ids then returns the prefetched result.

    When the cache cannot answer (``fail_open``, default: a node down or hung, busy, or its ring
    moving past the call's deadline) every row comes from the loader; other gkv errors raise.
    Thread-safe; ``loader`` is called from the calling thread or the prefetch thread.
    Counters: ``hits``, ``misses``, ``loaded`` (rows the loader produced).
    """

    def __init__(self, client: Client, table: str, dim: int, dtype: torch.dtype = torch.float32,
                 loader: Callable[[torch.Tensor], torch.Tensor] | None = None, *,
                 device: Any = "cpu", write_back: bool = True, fail_open: bool = True,
                 prefetch_depth: int = 2) -> None:
        if dim <= 0:
            raise InvalidArgument(f"dim must be positive, got {dim}")
        self.client = client
        self.table = table
        self.prefix = f"{table}/"
        self.dim = int(dim)
        self.dtype = dtype
        self.loader = loader
        self.device = torch.device(device)
        self.write_back = write_back
        self.fail_open = fail_open
        self.prefetch_depth = prefetch_depth
        self.hits = 0
        self.misses = 0
        self.loaded = 0
        self._lock = threading.Lock()
        self._executor_lock = threading.Lock()
        self._pending: collections.deque[tuple[np.ndarray, concurrent.futures.Future]] = \
            collections.deque()
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None

    def lookup(self, ids: Any) -> torch.Tensor:
        """The rows of ``ids`` (a 1-D integer tensor, array or sequence), ``[len(ids), dim]``
        on this cache's device. Raises what the loader raises; raises gkv errors other than
        a cache that cannot answer (e.g. a stored row of the wrong size: InvalidArgument)."""
        ids_np = _ids_array(ids)
        fut = self._take_prefetched(ids_np)
        if fut is not None:
            return fut.result()
        return self._lookup(ids_np)

    def prefetch(self, ids: Any) -> concurrent.futures.Future:
        """Starts fetching the rows of ``ids`` in the background (the next step's batch);
        ``lookup`` of the same ids returns them. The future's result is the tensor."""
        ids_np = _ids_array(ids).copy()
        with self._lock:
            fut = self._background(self._lookup, ids_np)
            self._pending.append((ids_np, fut))
            while len(self._pending) > self.prefetch_depth:
                self._pending.popleft()  # never asked for; it completes unobserved
        return fut

    def put(self, ids: Any, rows: torch.Tensor, *,
            background: bool = False) -> concurrent.futures.Future | None:
        """Writes ``rows`` (``[len(ids), dim]``) as the rows of ``ids`` (e.g. after an update).

        ``background``: on the prefetch thread, after the prefetches already started and
        before later ones (so a later prefetch sees these rows); returns the Future."""
        ids_np = _ids_array(ids).copy()
        rows = self._check_rows(rows, len(ids_np)).cpu()
        if not background:
            self.client.multi_put_rows(ids_np, rows, prefix=self.prefix)
            return None
        return self._background(self.client.multi_put_rows, ids_np, rows, prefix=self.prefix)

    def invalidate(self, ids: Any) -> None:
        """Deletes the rows of ``ids`` from the cache."""
        for i in _ids_array(ids):
            self.client.delete(f"{self.prefix}{int(i)}", missing_ok=True)

    def close(self) -> None:
        """Waits for the background work (prefetches, background puts), then stops its thread."""
        with self._lock, self._executor_lock:
            ex, self._executor = self._executor, None
            self._pending.clear()
        if ex is not None:
            ex.shutdown(wait=True)

    # --- internals ---

    def _background(self, fn, *args, **kwargs) -> concurrent.futures.Future:
        # One thread: background work runs in the order it was asked for.
        with self._executor_lock:
            if self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(
                    max_workers=1, thread_name_prefix="gkv-prefetch")
            return self._executor.submit(fn, *args, **kwargs)

    def _take_prefetched(self, ids_np: np.ndarray) -> concurrent.futures.Future | None:
        with self._lock:
            for k, (pids, fut) in enumerate(self._pending):
                if pids.shape == ids_np.shape and np.array_equal(pids, ids_np):
                    del self._pending[k]
                    return fut
        return None

    def _check_rows(self, rows: Any, n: int) -> torch.Tensor:
        if not isinstance(rows, torch.Tensor):
            rows = torch.as_tensor(np.asarray(rows))
        if tuple(rows.shape) != (n, self.dim):
            raise InvalidArgument(f"the loader returned rows of shape {tuple(rows.shape)}, "
                                  f"expected {(n, self.dim)}")
        return rows.to(self.dtype).contiguous()

    def _lookup(self, ids_np: np.ndarray) -> torch.Tensor:
        n = len(ids_np)
        out = torch.empty((n, self.dim), dtype=self.dtype, device=self.device)
        forked = _cache_unusable_here()
        if forked:
            hit = np.zeros(n, dtype=np.bool_)
        else:
            try:
                hit = self.client.multi_get_into(ids_np, out, prefix=self.prefix,
                                                 fail_open=self.fail_open).numpy()
            except _CACHE_DOWN:
                if not self.fail_open:
                    raise
                hit = np.zeros(n, dtype=np.bool_)
        nhit = int(hit.sum())
        with self._lock:
            self.hits += nhit
            self.misses += n - nhit
        if nhit == n:
            return out
        if self.loader is None:
            raise NotFound(f"{n - nhit} of {n} rows of table '{self.table[:40]}' are not "
                           "cached and the cache has no loader")
        miss = np.flatnonzero(~hit)
        uniq, inverse = np.unique(ids_np[miss], return_inverse=True)
        rows = self._check_rows(self.loader(torch.from_numpy(uniq)), len(uniq))
        with self._lock:
            self.loaded += len(uniq)
        out[torch.from_numpy(miss).to(self.device)] = \
            rows.to(self.device)[torch.from_numpy(inverse).to(self.device)]
        if self.write_back and not forked:
            try:
                self.client.multi_put_rows(uniq, rows.cpu(), prefix=self.prefix)
            except _WRITE_SKIPPED:
                if not self.fail_open:
                    raise
        return out


_TUPLE_TAG = b"gkv-sample:"


class _Single(tuple):
    """A sample that is not a tensor, stored like a one-element tuple."""


class CachedDataset(torch.utils.data.Dataset):
    """A map-style dataset whose samples are served from gkv, keyed ``f"{prefix}{index}"``.

    A sample found in the cache is returned from it; a missing one is computed by
    ``dataset[index]`` and stored. Samples may be tensors, numpy arrays, bytes, Python numbers,
    or tuples/lists of those (a tuple is stored as one key per element plus a small header).
    When the cache cannot answer (``fail_open``, default: a node down or hung, busy, or its ring
    moving past the call's deadline) samples come from ``dataset``; other gkv errors raise.
    Counters (per process): ``hits``, ``misses``.
    """

    def __init__(self, dataset: Any, client: Client, prefix: str, *, fail_open: bool = True,
                 timeout: float | None = None) -> None:
        self.dataset = dataset
        self.client = client
        self.prefix = prefix
        self.fail_open = fail_open
        self.timeout = timeout
        self.hits = 0
        self.misses = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        if _cache_unusable_here():
            return self.dataset[index]
        key = f"{self.prefix}{int(index)}"
        try:
            sample = self._read(key)
            with self._lock:
                self.hits += 1
            return sample
        except NotFound:
            pass
        except _CACHE_DOWN:
            if not self.fail_open:
                raise
            return self.dataset[index]
        sample = self.dataset[index]
        with self._lock:
            self.misses += 1
        try:
            self._write(key, sample)
        except _WRITE_SKIPPED:
            if not self.fail_open:
                raise
        return sample

    def __getstate__(self):
        state = self.__dict__.copy()
        del state["_lock"]
        return state

    def __setstate__(self, state) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def _read(self, key: str) -> Any:
        v = self.client.get(key, framework="torch", timeout=self.timeout)
        if isinstance(v, bytes) and v.startswith(_TUPLE_TAG):
            header = json.loads(v[len(_TUPLE_TAG):])
            parts = [self._decode(kind, self.client.get(f"{key}/{j}", framework="torch",
                                                        timeout=self.timeout))
                     for j, kind in enumerate(header["kinds"])]
            if header["type"] == "single":
                return parts[0]
            return tuple(parts) if header["type"] == "tuple" else parts
        return v

    def _write(self, key: str, sample: Any) -> None:
        if isinstance(sample, torch.Tensor):
            self.client.put(key, sample, timeout=self.timeout)
            return
        if not isinstance(sample, (tuple, list)):
            sample = _Single((sample,))
        if isinstance(sample, (tuple, list)):
            kinds, items = [], []
            for j, part in enumerate(sample):
                kind, value = self._encode(part)
                kinds.append(kind)
                items.append((f"{key}/{j}", value))
            self.client.multi_put(items, timeout=self.timeout)
            kind_of = "single" if isinstance(sample, _Single) else \
                "tuple" if isinstance(sample, tuple) else "list"
            header = {"type": kind_of, "kinds": kinds}
            # The header last: a reader that finds it finds every part.
            self.client.put(key, _TUPLE_TAG + json.dumps(header).encode(), timeout=self.timeout)
            return

    @staticmethod
    def _encode(part: Any) -> tuple[str, Any]:
        if isinstance(part, bool):
            return "bool", torch.tensor(part)
        if isinstance(part, int):
            return "int", torch.tensor(part, dtype=torch.int64)
        if isinstance(part, float):
            return "float", torch.tensor(part, dtype=torch.float64)
        if isinstance(part, np.ndarray):
            return "numpy", part
        if isinstance(part, (bytes, bytearray)):
            if bytes(part).startswith(_TUPLE_TAG):
                raise InvalidArgument("a bytes sample can't start with gkv's tuple tag")
            return "bytes", bytes(part)
        if isinstance(part, torch.Tensor):
            return "tensor", part
        raise InvalidArgument(f"CachedDataset stores tensors, arrays, bytes, numbers and "
                              f"tuples or lists of those, not {type(part).__name__}")

    @staticmethod
    def _decode(kind: str, value: Any) -> Any:
        if kind in ("bool", "int", "float"):
            return {"bool": bool, "int": int, "float": float}[kind](value.item())
        if kind == "numpy":
            return value.numpy()
        return value

