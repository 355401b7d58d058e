"""gkv.Client against real gkv-server processes: round trips, in-place reads, errors."""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import signal
import threading
import time

import numpy as np
import pytest

try:
    import torch
except ImportError:  # the client wheel's clean venv (scripts/test.sh's wheel step) has no torch
    torch = None

import gkv

# With GKV_TEST_REQUIRE_TORCH=1 (scripts/test.sh's Python step) a missing torch is an error
# (conftest.py), so these skip only where torch is truly absent.
needs_torch = pytest.mark.skipif(
    torch is None, reason="torch is not installed (PyPI's torch brings GBs of CUDA libraries)")

NUMPY_DTYPES = {
    "f64": np.float64, "f32": np.float32, "f16": np.float16, "i64": np.int64, "i32": np.int32,
    "i16": np.int16, "i8": np.int8, "u8": np.uint8, "bool": np.bool_,
}
TORCH_DTYPE_NAMES = ("f64", "f32", "f16", "bf16", "i64", "i32", "i16", "i8", "u8", "bool")
TORCH_DTYPES = {
    "f64": torch.float64, "f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16,
    "i64": torch.int64, "i32": torch.int32, "i16": torch.int16, "i8": torch.int8,
    "u8": torch.uint8, "bool": torch.bool,
} if torch is not None else {}
FP8 = {"f8e4m3": "float8_e4m3fn", "f8e5m2": "float8_e5m2"}


def rand_np(dtype, shape, seed=0):
    rng = np.random.default_rng(seed)
    if dtype == np.bool_:
        return rng.integers(0, 2, size=shape).astype(np.bool_)
    if np.issubdtype(dtype, np.integer):
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, size=shape, dtype=dtype, endpoint=True)
    return rng.standard_normal(size=shape).astype(dtype)


def test_every_gkv_dtype_is_covered():
    assert set(gkv.DTYPES) == {"raw"} | set(TORCH_DTYPE_NAMES) | set(FP8)
    assert torch is None or set(TORCH_DTYPES) == set(TORCH_DTYPE_NAMES)


@pytest.mark.parametrize("name", sorted(NUMPY_DTYPES))
def test_numpy_round_trip_keeps_dtype_and_shape(client, name):
    a = rand_np(NUMPY_DTYPES[name], (3, 5, 2), seed=len(name))
    v = client.put(f"np/{name}", a)
    assert v > 0
    got = client.get(f"np/{name}", framework="numpy")
    assert isinstance(got, np.ndarray)
    assert got.dtype == a.dtype and got.shape == a.shape
    assert np.array_equal(got, a)
    st = client.stat(f"np/{name}")
    assert (st.dtype, st.shape, st.size, st.version) == (name, (3, 5, 2), a.nbytes, v)


@needs_torch
@pytest.mark.parametrize("name", sorted(TORCH_DTYPE_NAMES))
def test_torch_round_trip_keeps_dtype_and_shape(client, name):
    t = torch.from_numpy(rand_np(np.float32, (4, 7), seed=3)).to(TORCH_DTYPES[name]) \
        if name not in ("bool",) else torch.rand(4, 7) > 0.5
    client.put(f"t/{name}", t)
    got = client.get(f"t/{name}")  # torch is imported: a tensor
    assert isinstance(got, torch.Tensor)
    assert got.dtype == t.dtype and got.shape == t.shape
    assert torch.equal(got, t)
    out = torch.zeros_like(t)
    client.get_into(f"t/{name}", out)
    assert torch.equal(out, t)


@needs_torch
@pytest.mark.parametrize("name", sorted(FP8))
def test_fp8_round_trip_through_torch(client, name):
    tdt = getattr(torch, FP8[name], None)
    if tdt is None:
        pytest.skip(f"torch {torch.__version__} has no {FP8[name]} (needs torch >= 2.1)")
    t = torch.randn(8, 3).to(tdt)
    client.put(f"fp8/{name}", t)
    got = client.get(f"fp8/{name}")
    assert got.dtype == tdt and torch.equal(got.view(torch.uint8), t.view(torch.uint8))


@pytest.mark.parametrize("name", sorted(FP8))
def test_fp8_bytes_stored_with_an_explicit_dtype(client, name):
    raw = np.arange(24, dtype=np.uint8).reshape(4, 6)
    client.put(f"fp8b/{name}", raw, dtype=name)
    st = client.stat(f"fp8b/{name}")
    assert (st.dtype, st.shape) == (name, (4, 6))
    out = np.zeros((4, 6), np.uint8)  # a uint8 destination takes any value's bytes
    client.get_into(f"fp8b/{name}", out)
    assert np.array_equal(out, raw)
    if getattr(torch, FP8[name], None) is None:
        with pytest.raises(gkv.NotSupported, match="get_into"):
            client.get(f"fp8b/{name}")


@needs_torch
def test_bf16_without_torch_framework_is_not_supported(client):
    client.put("bf16/np", torch.ones(3, dtype=torch.bfloat16))
    with pytest.raises(gkv.NotSupported, match="bf16"):
        client.get("bf16/np", framework="numpy")


@pytest.mark.parametrize("rank", range(9))
def test_ranks_zero_to_eight(client, rank):
    shape = tuple([2] * rank)
    a = rand_np(np.float32, shape, seed=rank)
    client.put(f"rank/{rank}", a)
    got = client.get(f"rank/{rank}", framework="numpy")
    assert got.shape == shape and np.array_equal(got, a)
    t = client.get(f"rank/{rank}")
    assert tuple(t.shape) == shape


def test_rank_nine_is_refused(client):
    with pytest.raises(gkv.InvalidArgument, match="rank 9"):
        client.put("rank/9", np.zeros([1] * 9, np.float32))


@pytest.mark.parametrize("shape", [(0,), (3, 0, 2), (0, 0)])
def test_empty_tensors(client, shape):
    a = np.zeros(shape, np.float32)
    client.put(f"empty/{shape}", a)
    got = client.get(f"empty/{shape}", framework="numpy")
    assert got.shape == shape and got.dtype == np.float32
    t = client.get(f"empty/{shape}")  # a tensor where torch is imported, else an array
    assert tuple(t.shape) == shape and (t.numel() if torch is not None else t.size) == 0
    out = np.zeros(shape, np.float32)
    client.get_into(f"empty/{shape}", out)


def test_empty_and_raw_bytes(client):
    client.put("bytes/empty", b"")
    assert client.get("bytes/empty") == b""
    client.put("bytes/x", bytearray(b"hello gkv"))
    assert client.get("bytes/x") == b"hello gkv"
    assert client.stat("bytes/x").dtype == "raw"


@needs_torch
def test_64_mib_tensor(client):
    t = torch.randn(16, 1024, 1024)  # 64 MiB of f32
    client.put("big/64m", t, timeout=30)
    got = client.get("big/64m", timeout=30)
    assert got.shape == t.shape and torch.equal(got, t)
    out = torch.empty_like(t)
    client.get_into("big/64m", out, timeout=30)
    assert torch.equal(out, t)


def test_get_is_zero_copy_of_the_received_buffer(client):
    client.put("zc", np.arange(1000, dtype=np.int64))
    got = client.get("zc", framework="numpy")
    assert not got.flags.owndata  # a view of the buffer the value was received into
    if torch is not None:
        t = client.get("zc")
        assert isinstance(t, torch.Tensor) and t.numpy().base is not None


@needs_torch
def test_non_contiguous_input_is_stored_by_one_copy(client):
    a = np.arange(60, dtype=np.float32).reshape(6, 10)[:, ::3]
    assert not a.flags.c_contiguous
    client.put("nc/np", a)
    assert np.array_equal(client.get("nc/np", framework="numpy"), a)
    t = torch.arange(60.0).reshape(6, 10).t()
    client.put("nc/t", t)
    assert torch.equal(client.get("nc/t"), t)


@needs_torch
def test_non_contiguous_destination_is_refused(client):
    client.put("nc/dst", np.zeros((4, 4), np.float32))
    out = np.ones((4, 8), np.float32)[:, ::2]
    with pytest.raises(gkv.InvalidArgument, match="contiguous"):
        client.get_into("nc/dst", out)
    assert (out == 1).all()
    with pytest.raises(gkv.InvalidArgument, match="contiguous"):
        client.get_into("nc/dst", torch.ones(4, 4).t())


def test_get_into_writes_in_place(client):
    a = rand_np(np.float32, (32, 16), seed=5)
    v = client.put("into/a", a)
    out = np.zeros_like(a)
    ptr = out.ctypes.data
    assert client.get_into("into/a", out) == v
    assert out.ctypes.data == ptr and np.array_equal(out, a)


@pytest.mark.parametrize("out", [np.full(10, 7, np.float32), np.full(13, 7, np.float32),
                                 np.full(12, 7, np.int32)],
                         ids=["smaller", "larger", "wrong-dtype"])
def test_wrong_get_into_raises_and_writes_nothing(client, out):
    client.put("into/wrong", np.arange(12, dtype=np.float32))
    before = out.copy()
    with pytest.raises(gkv.InvalidArgument):
        client.get_into("into/wrong", out)
    assert np.array_equal(out, before)


def test_read_only_destination_is_refused(client):
    client.put("into/ro", np.zeros(4, np.float32))
    out = np.zeros(4, np.float32)
    out.flags.writeable = False
    with pytest.raises(gkv.InvalidArgument, match="read-only"):
        client.get_into("into/ro", out)


@needs_torch
def test_multi_get_into_rows_hits_and_misses(client):
    rows = rand_np(np.float32, (200, 16), seed=9)
    client.multi_put_rows(np.arange(200), rows, prefix="mg/")
    ids = np.array([5, 199, 1000, 0, 5, 2000])
    out = torch.full((6, 16), -1.0)
    mask = client.multi_get_into(ids, out, prefix="mg/")
    assert mask.dtype == torch.bool and mask.tolist() == [True, True, False, True, True, False]
    for i, k in enumerate(ids):
        if k < 200:
            assert torch.equal(out[i], torch.from_numpy(rows[k]))
        else:
            assert (out[i] == -1).all()  # misses untouched
    # String keys, a numpy destination, and rows that are a view into a wider buffer.
    wide = np.full((3, 20), -2.0, np.float32)
    m = client.multi_get_into(["mg/1", "mg/2", "mg/x"], wide[:, :16])
    assert m.tolist() == [True, True, False]
    assert np.array_equal(wide[0, :16], rows[1]) and (wide[:, 16:] == -2).all()
    assert (wide[2] == -2).all()


def test_multi_get_into_refuses_wrong_rows(client):
    client.multi_put_rows(["mgw/0"], np.ones((1, 8), np.float32))
    out = np.zeros((1, 4), np.float32)
    with pytest.raises(gkv.InvalidArgument, match="key 0 of 1"):
        client.multi_get_into(["mgw/0"], out)
    assert (out == 0).all()
    with pytest.raises(gkv.InvalidArgument, match="one row"):
        client.multi_get_into(["mgw/0", "mgw/1"], np.zeros((3, 8), np.float32))
    with pytest.raises(gkv.InvalidArgument, match="f32"):
        client.multi_get_into(["mgw/0"], np.zeros((1, 8), np.int32))


@needs_torch
def test_multi_put_and_delete(client):
    vs = client.multi_put({"mp/a": np.arange(3), "mp/b": b"xyz", "mp/c": torch.ones(2, 2)})
    assert len(vs) == 3 and all(v > 0 for v in vs)
    assert np.array_equal(client.get("mp/a", framework="numpy"), np.arange(3))
    assert client.get("mp/b") == b"xyz"
    assert client.delete("mp/a") is True
    with pytest.raises(gkv.NotFound):
        client.get("mp/a")
    with pytest.raises(KeyError):
        client.delete("mp/a")
    assert client.delete("mp/a", missing_ok=True) is False


def test_stats_is_a_dict_per_node(client):
    client.put("stats/k", b"v")
    client.get("stats/k")
    s = client.stats()
    assert set(s) == {"n0", "n1", "n2"}
    assert all(s[n]["node"] == n for n in s)
    assert sum(s[n]["ops"]["get"] for n in s) >= 1
    assert client.ping() == {"n0": "ok", "n1": "ok", "n2": "ok"}


def test_nodes_node_for_ping_and_stats_under_etcd(own_cluster):
    """Under etcd membership the cluster file lists no nodes: the node list, routing, ping and
    stats come from the members the client learnt of (issue 38 (e))."""
    c = own_cluster(3, etcd=True)
    with gkv.Client(c.cluster_file, timeout=5.0) as cl:
        deadline = time.monotonic() + 10
        while set(cl.nodes) != {"n0", "n1", "n2"} and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sorted(cl.nodes) == ["n0", "n1", "n2"]
        owners = {cl.node_for(f"etcd/{k}") for k in range(300)}
        assert owners == {"n0", "n1", "n2"}
        key = "etcd/0"
        owner = cl.node_for(key)
        before = cl.stats()[owner]["ops"]["put"]
        cl.put(key, b"on its owner")
        s = cl.stats()
        assert set(s) == {"n0", "n1", "n2"}
        assert all(s[n]["node"] == n for n in s)
        assert s[owner]["ops"]["put"] == before + 1
        assert cl.get(key) == b"on its owner"
        assert cl.ping() == {"n0": "ok", "n1": "ok", "n2": "ok"}
        # A node that leaves (SIGTERM hands its keys off, exits 0) leaves the list, and stats
        # and ping go on over the others.
        c.kill(2, signal.SIGTERM)
        assert c.procs[2].returncode == 0, c.log(2)
        deadline = time.monotonic() + 10
        while cl.nodes != ["n0", "n1"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert cl.nodes == ["n0", "n1"]
        assert set(cl.stats()) == {"n0", "n1"}
        assert cl.ping() == {"n0": "ok", "n1": "ok"}
        assert {cl.node_for(f"etcd/{k}") for k in range(300)} == {"n0", "n1"}
        assert cl.get(key) == b"on its owner"


def test_async_forms_return_futures(client):
    a = np.arange(100, dtype=np.float32)
    f = client.put_async("async/a", a)
    assert isinstance(f, concurrent.futures.Future) and f.result(5) > 0
    assert np.array_equal(client.get_async("async/a", framework="numpy").result(5), a)
    out = np.zeros_like(a)
    client.get_into_async("async/a", out).result(5)
    assert np.array_equal(out, a)
    rows = np.zeros((2, 100), np.float32)
    assert client.multi_get_into_async(["async/a", "async/none"], rows).result(5).tolist() == \
        [True, False]
    assert len(client.multi_put_async([("async/b", b"1")]).result(5)) == 1
    with pytest.raises(gkv.NotFound):
        client.get_async("async/none").result(5)


# --- errors ---

def test_error_types_carry_the_status_code(client):
    with pytest.raises(gkv.NotFound) as e:
        client.get("err/missing-" + "x" * 200)
    assert isinstance(e.value, KeyError) and isinstance(e.value, gkv.Error)
    assert e.value.code == 1 and e.value.code_name == "not_found"
    assert "x" * 41 not in str(e.value)  # a key is quoted by a short prefix only
    with pytest.raises(gkv.InvalidArgument) as e:
        client.put("err/u16", np.zeros(3, np.uint16))
    assert e.value.code == 2 and "uint16" in str(e.value)
    with pytest.raises(gkv.InvalidArgument):
        client.put("err/bad", np.zeros(3, np.float32), dtype="f16")  # item size differs
    with pytest.raises(gkv.InvalidArgument):
        client.put("err/bad", np.zeros(3, np.float32), dtype="nonsense")
    with pytest.raises(gkv.InvalidArgument):
        client.put("err/obj", object())
    with pytest.raises(gkv.InvalidArgument):
        client.put("k" * 70000, b"v")  # oversize key, refused by the node


def test_every_status_code_has_its_exception_class():
    names = dict(gkv._gkv.status_code_names())
    assert names[13] == "busy"
    for code, name in names.items():
        if code == 0:
            continue
        err = gkv._errors.from_status(code, "m")
        assert type(err) is not gkv.Error, f"no class for status {code} ({name})"
        assert err.code == code and err.code_name == name
    assert isinstance(gkv._errors.from_status(13, "shed"), gkv.Busy)


def test_no_space_and_invalid_cluster(own_cluster, tmp_path):
    c = own_cluster(1, host_mem="8MiB", disk="16MiB")
    with gkv.Client(c.cluster_file, timeout=20) as cl:
        with pytest.raises(gkv.NoSpace) as e:
            cl.put("too-big", np.zeros(32 << 20, np.uint8))
        assert e.value.code == 3
        cl.put("small", b"ok")
    with pytest.raises(gkv.Error, match="cluster"):
        gkv.Client(str(tmp_path / "no-such.yaml"))


def test_permission_denied_with_a_wrong_secret(own_cluster, tmp_path):
    c = own_cluster(1, secret="s3cr3t")
    text = open(c.cluster_file).read()
    none = tmp_path / "none.yaml"
    none.write_text("".join(l for l in text.splitlines(True) if "secret" not in l))
    with gkv.Client(str(none), timeout=2) as cl:
        with pytest.raises(gkv.PermissionDenied) as e:
            cl.get("k")
        assert e.value.code == 9
    wrong = tmp_path / "wrong.yaml"
    wrong.write_text(text.replace("s3cr3t", "wrong"))
    with gkv.Client(str(wrong), timeout=2) as cl:
        # Refused at the handshake; the connection may be gone before the put's reply.
        with pytest.raises((gkv.PermissionDenied, gkv.Unavailable)):
            cl.put("k", b"x")
    with gkv.Client(c.cluster_file, timeout=2) as good:
        with pytest.raises(gkv.NotFound):
            good.get("k")  # the refused client changed nothing


def test_closed_client_is_aborted(cluster):
    cl = gkv.Client(cluster.cluster_file)
    cl.close()
    cl.close()
    with pytest.raises(gkv.Aborted, match="closed"):
        cl.get("x")


def test_dead_node_unavailable_within_the_deadline(own_cluster):
    c = own_cluster(2)
    with gkv.Client(c.cluster_file, timeout=0.8) as cl:
        key = next(f"d{i}" for i in range(1000) if cl.node_for(f"d{i}") == "n1")
        other = next(f"d{i}" for i in range(1000) if cl.node_for(f"d{i}") == "n0")
        cl.put(key, b"v1")
        cl.put(other, b"v0")
        c.kill(1)
        t0 = time.monotonic()
        with pytest.raises((gkv.Unavailable, gkv.Timeout)) as e:
            cl.get(key)
        assert time.monotonic() - t0 < 0.8 + 0.5
        assert isinstance(e.value, gkv.Error)
        assert cl.get(other) == b"v0"  # the live node keeps serving
        out = np.zeros((2, 2), np.uint8)
        mask = cl.multi_get_into([key, other], out, fail_open=True)
        assert mask.tolist() == [False, True]
        with pytest.raises(KeyError):
            cl.get(key, fail_open=True)


def test_hung_node_times_out_and_the_gil_is_released(own_cluster):
    c = own_cluster(1)
    with gkv.Client(c.cluster_file, timeout=0.6) as cl:
        cl.put("h", b"v")
        c.kill(0, signal.SIGSTOP)
        try:
            counted = []
            done = threading.Event()

            def spin():
                n = 0
                while not done.is_set():
                    n += 1
                counted.append(n)

            th = threading.Thread(target=spin)
            th.start()
            t0 = time.monotonic()
            with pytest.raises(gkv.Timeout) as e:
                cl.get("h")
            elapsed = time.monotonic() - t0
            done.set()
            th.join()
            assert 0.5 < elapsed < 1.5
            assert e.value.code == 5
            # The other thread ran Python while get waited: the GIL was released.
            assert counted[0] > 10000
        finally:
            c.kill(0, signal.SIGCONT)


def _child_reads(client, q):
    try:
        q.put(bytes(client.get("fork/k")))
    except BaseException as e:  # noqa: BLE001
        q.put(e)


def test_a_pickled_client_reopens_in_a_forkserver_child(client):
    client.put("fork/k", b"from the parent")
    ctx = multiprocessing.get_context("forkserver")
    q = ctx.Queue()
    p = ctx.Process(target=_child_reads, args=(client, q))
    p.start()
    got = q.get(timeout=60)
    p.join(20)
    assert got == b"from the parent" and p.exitcode == 0


def test_a_forked_child_gets_a_clear_error_at_once(client):
    client.put("fork/k", b"from the parent")
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    t0 = time.monotonic()
    p = ctx.Process(target=_child_reads, args=(client, q))
    p.start()
    got = q.get(timeout=20)
    p.join(20)
    assert isinstance(got, gkv.NotSupported) and "fork" in str(got), got
    assert time.monotonic() - t0 < 5 and p.exitcode == 0
    assert client.get("fork/k") == b"from the parent"  # the parent's connections still work


@pytest.mark.skipif(torch is None or not torch.cuda.is_available(),
                    reason="no CUDA device here; scripts/gpu-check.sh runs these on a GPU")
def test_cuda_tensors_round_trip(client):
    dev = torch.device("cuda:0")
    t = torch.randn(64, 32, device=dev)
    client.put("cuda/t", t)
    got = client.get("cuda/t", device=dev)
    assert got.is_cuda and torch.equal(got, t)
    out = torch.zeros_like(t)
    client.get_into("cuda/t", out)
    assert torch.equal(out, t)
    rows = torch.zeros(3, 32, device=dev)
    client.multi_put_rows(np.arange(3), t[:3], prefix="cuda/r/")
    mask = client.multi_get_into(np.array([0, 9, 2]), rows, prefix="cuda/r/")
    assert mask.tolist() == [True, False, True]
    assert torch.equal(rows[0], t[0]) and torch.equal(rows[2], t[2]) and (rows[1] == 0).all()
