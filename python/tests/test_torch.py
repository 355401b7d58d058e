"""gkv.torch: EmbeddingCache and CachedDataset against real gkv-server processes."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

import gkv
from gkv.torch import CachedDataset, EmbeddingCache

DIM = 16


class ReferenceTable:
    """The embedding table the cache stands in front of; counts what it was asked for."""

    def __init__(self, rows: int = 1000, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.weight = torch.randn(rows, DIM, generator=g)
        self.calls: list[list[int]] = []
        self.lock = threading.Lock()

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        assert ids.dtype == torch.int64 and ids.dim() == 1
        with self.lock:
            self.calls.append(ids.tolist())
        return self.weight[ids]


def test_lookup_misses_fill_from_the_loader_then_hit(client):
    ref = ReferenceTable()
    cache = EmbeddingCache(client, "emb-a", DIM, torch.float32, ref)
    ids = torch.tensor([3, 17, 3, 999, 0])
    out = cache.lookup(ids)
    assert out.shape == (5, DIM) and out.dtype == torch.float32
    assert torch.equal(out, ref.weight[ids])
    assert ref.calls == [[0, 3, 17, 999]]  # each missing id loaded once, sorted
    assert (cache.hits, cache.misses, cache.loaded) == (0, 5, 4)
    # Written back: the second lookup is served from gkv alone.
    out2 = cache.lookup(torch.tensor([999, 0, 17]))
    assert torch.equal(out2, ref.weight[[999, 0, 17]])
    assert len(ref.calls) == 1 and cache.hits == 3
    # A mix: only the new ids reach the loader.
    out3 = cache.lookup(np.array([17, 500, 3, 501]))
    assert torch.equal(out3, ref.weight[[17, 500, 3, 501]])
    assert ref.calls[-1] == [500, 501]
    st = client.stat("emb-a/500")
    assert (st.dtype, st.shape) == ("f32", (DIM,))


def test_random_batches_match_the_reference_table(client):
    ref = ReferenceTable(rows=5000, seed=1)
    cache = EmbeddingCache(client, "emb-b", DIM, torch.float32, ref)
    rng = np.random.default_rng(7)
    for _ in range(20):
        ids = rng.zipf(1.3, size=256) % 5000
        assert torch.equal(cache.lookup(ids), ref.weight[ids])
    assert cache.hits > cache.misses  # power-law ids: most rows repeat
    assert cache.loaded == len({i for c in ref.calls for i in c})  # no id loaded twice


def test_prefetch_returns_the_same_rows_in_the_background(client):
    ref = ReferenceTable(seed=2)
    cache = EmbeddingCache(client, "emb-c", DIM, torch.float32, ref)
    ids = torch.arange(100, 300)
    fut = cache.prefetch(ids)
    out = cache.lookup(ids)  # the prefetched result
    assert fut.done() and out is fut.result()
    assert torch.equal(out, ref.weight[ids])
    assert len(ref.calls) == 1
    cache.close()


def test_bf16_rows_and_a_loader_of_the_wrong_shape(client):
    ref = ReferenceTable(seed=3)
    cache = EmbeddingCache(client, "emb-d", DIM, torch.bfloat16, ref)
    out = cache.lookup([1, 2])
    assert out.dtype == torch.bfloat16 and torch.equal(out, ref.weight[[1, 2]].bfloat16())
    assert torch.equal(cache.lookup([1, 2]), out)
    bad = EmbeddingCache(client, "emb-e", DIM, torch.float32, lambda ids: torch.zeros(1, 3))
    with pytest.raises(gkv.InvalidArgument, match="shape"):
        bad.lookup([1, 2])


def test_a_row_of_another_dim_is_refused(client):
    client.multi_put_rows(["emb-f/1"], torch.ones(1, DIM + 1))
    cache = EmbeddingCache(client, "emb-f", DIM, torch.float32, ReferenceTable())
    with pytest.raises(gkv.InvalidArgument):
        cache.lookup([1])


def test_without_a_loader_misses_raise_not_found(client):
    cache = EmbeddingCache(client, "emb-g", DIM)
    with pytest.raises(KeyError):
        cache.lookup([1])


def test_threads_share_one_cache(client):
    ref = ReferenceTable(rows=2000, seed=4)
    cache = EmbeddingCache(client, "emb-h", DIM, torch.float32, ref)
    errors = []

    def work(seed):
        rng = np.random.default_rng(seed)
        for _ in range(10):
            ids = rng.integers(0, 2000, size=128)
            if not torch.equal(cache.lookup(ids), ref.weight[ids]):
                errors.append(seed)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert cache.hits + cache.misses == 4 * 10 * 128


def test_cache_down_falls_back_to_the_loader(own_cluster):
    c = own_cluster(1)
    ref = ReferenceTable(seed=5)
    with gkv.Client(c.cluster_file, timeout=0.5) as cl:
        cache = EmbeddingCache(cl, "emb-i", DIM, torch.float32, ref)
        cache.lookup([1, 2])
        c.kill(0)
        assert torch.equal(cache.lookup([1, 2, 3]), ref.weight[[1, 2, 3]])


class SquaresDataset(torch.utils.data.Dataset):
    """Sample i: (a tensor derived from i, the label i % 3); counts computed samples in a
    file per process so the test sees what the workers computed."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.computed = 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        self.computed += 1
        return torch.full((4,), float(i * i)), i % 3


def test_cached_dataset_serves_cached_samples(client):
    ds = SquaresDataset(10)
    cached = CachedDataset(ds, client, "ds-a/")
    assert len(cached) == 10
    x, y = cached[4]
    assert torch.equal(x, torch.full((4,), 16.0)) and y == 1 and isinstance(y, int)
    assert ds.computed == 1 and cached.misses == 1
    x2, y2 = cached[4]
    assert torch.equal(x2, x) and y2 == 1
    assert ds.computed == 1 and cached.hits == 1


def test_cached_dataset_kinds_of_samples(client):
    samples = [torch.arange(6).reshape(2, 3), np.ones(3, np.float16), b"raw",
               [1.5, True, torch.zeros(2)]]

    class Fixed(torch.utils.data.Dataset):
        def __len__(self):
            return len(samples)

        def __getitem__(self, i):
            return samples[i]

    cached = CachedDataset(Fixed(), client, "ds-b/")
    for _ in range(2):  # computed, then from the cache
        assert torch.equal(cached[0], samples[0])
        assert np.array_equal(cached[1], samples[1]) and cached[1].dtype == np.float16
        assert cached[2] == b"raw"
        third = cached[3]
        assert isinstance(third, list) and third[0] == 1.5 and third[1] is True
        assert torch.equal(third[2], torch.zeros(2))
    # Round one: 4 computed, the second read of cached[1] a hit; round two: 5 hits.
    assert (cached.misses, cached.hits) == (4, 6)


def test_dataloader_with_two_workers_over_a_cached_dataset(cluster):
    # Workers start by 'forkserver' (UCX does not survive fork); each unpickles the client
    # and opens its own connections.
    with gkv.Client(cluster.cluster_file, timeout=5) as cl:
        cached = CachedDataset(SquaresDataset(64), cl, "ds-c/")

        def puts():
            return sum(s["ops"]["put"] + s["ops"]["mput"] for s in cl.stats().values())

        writes = []
        for epoch in range(2):
            before = puts()
            loader = torch.utils.data.DataLoader(cached, batch_size=8, num_workers=2,
                                                 multiprocessing_context="forkserver")
            seen = []
            for x, y in loader:
                assert x.shape == (8, 4)
                idx = torch.sqrt(x[:, 0]).round().long()
                assert torch.equal(y, idx % 3)
                seen += idx.tolist()
            assert sorted(seen) == list(range(64))
            writes.append(puts() - before)
        # Epoch 0: the workers computed and stored every sample (a header put, and its parts
        # in one batch: a message to each of the one or two nodes holding them); epoch 1 was
        # served from gkv without a single write.
        assert 2 * 64 <= writes[0] <= 3 * 64 and writes[1] == 0, writes
        for i in (0, 17, 63):
            assert cl.get(f"ds-c/{i}/1").item() == i % 3
            assert cl.stat(f"ds-c/{i}").dtype == "raw"


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="no CUDA device here; scripts/gpu-check.sh runs these on a GPU")
def test_embedding_cache_on_cuda(client):
    ref = ReferenceTable(seed=6)
    cache = EmbeddingCache(client, "emb-cuda", DIM, torch.float32, ref, device="cuda:0")
    ids = torch.tensor([5, 6, 5])
    out = cache.lookup(ids)
    assert out.is_cuda and torch.equal(out.cpu(), ref.weight[ids])
    out = cache.lookup(ids)
    assert out.is_cuda and torch.equal(out.cpu(), ref.weight[ids]) and cache.hits == 3


def _forked_worker_reads(client, q):
    # Runs in a child forked from a parent that had a client open (DataLoader's default).
    try:
        import warnings
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ref = ReferenceTable()
            cache = EmbeddingCache(client, "emb-fork", DIM, torch.float32, ref)
            rows = cache.lookup(torch.tensor([1, 2, 3]))
            rows2 = cache.lookup(torch.tensor([4]))
        q.put(("ok", torch.equal(rows, ref.weight[[1, 2, 3]]) and torch.equal(rows2, ref.weight[[4]]),
               [str(w.message) for w in caught]))
    except BaseException as e:  # noqa: BLE001 (reported to the parent)
        q.put(("error", repr(e), []))


def test_dataloader_default_fork_workers_read_the_dataset_with_one_warning(cluster):
    # Linux DataLoader workers fork by default; UCX does not survive fork, so the workers read
    # the dataset directly (correct samples, no exception) and warn once per process.
    import multiprocessing
    import warnings
    with gkv.Client(cluster.cluster_file, timeout=5) as cl:
        cached = CachedDataset(SquaresDataset(32), cl, "ds-fork/")
        assert cached[5] is not None  # the parent uses the cache: UCX started here
        assert cached.misses == 1
        loader = torch.utils.data.DataLoader(cached, batch_size=8, num_workers=2)
        assert multiprocessing.get_start_method() == "fork"
        seen = []
        for x, y in loader:
            idx = torch.sqrt(x[:, 0]).round().long()
            assert torch.equal(y, idx % 3)
            seen += idx.tolist()
        assert sorted(seen) == list(range(32))
        # Nothing the workers read went through the cache (only the parent's one sample).
        assert cl.get("ds-fork/5/1").item() == 5 % 3
        with pytest.raises(gkv.NotFound):
            cl.get("ds-fork/6")
        # EmbeddingCache in a forked child: rows from the loader, one warning naming the fix.
        ctx = multiprocessing.get_context("fork")
        q = ctx.Queue()
        p = ctx.Process(target=_forked_worker_reads, args=(cl, q))  # forked: not pickled
        p.start()
        status, ok, caught = q.get(timeout=60)
        p.join(30)
        assert status == "ok" and ok is True, (status, ok)
        assert len(caught) == 1 and "forkserver" in caught[0], caught
        assert p.exitcode == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert gkv._forked_from_ucx() is False  # the parent itself is not a forked child
