#!/usr/bin/env python3
"""The embeddings workload from Python (gkv.Client.multi_get_into) next to the C++ load tester
(gkv-bench --workload embeddings) in the same run, on the same cluster and keys.

Both sides: 200,000 keys "bench/<i>" of 512-byte rows (written once by gkv-bench), zipf 0.99
popularity (the same CDF as gkv-bench, popular ranks scattered over the key space), batches of
256-4096 keys, THREADS threads with their own client each and one request in flight per
thread. Python writes each batch into one preallocated [batch, 512] uint8 array. Batches are
drawn before timing (a pool cycled through) so the figure is the binding's and not numpy's
random number generator. Each round runs gkv-bench twice (its preset's MultiGet, which
allocates a Value per key, and --multiget-into, the C++ call the binding makes) and then
Python; the report gives rows/s of each and the ratios (goal: Python >= 0.9x C++).

    bench/python_bench.py [--cluster FILE] [--seconds 10] [--rounds 2] [--threads 2]

Without --cluster it starts 3 local nodes (scripts/cluster.sh) and stops them afterwards.
Run with the build's package: PYTHONPATH=build/python .venv/bin/python bench/python_bench.py
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "build" / "python"))
import gkv  # noqa: E402

KEYS, ROW, BMIN, BMAX, THETA = 200_000, 512, 256, 4096, 0.99


def run_cpp(cluster: str, seconds: float, threads: int, load: bool, out: Path,
            into: bool = False) -> float:
    cmd = [str(REPO / "build" / "bin" / "gkv-bench"), "--cluster", cluster,
           "--workload", "embeddings", "--threads", str(threads), "--connections", "1",
           "--duration", str(seconds), "--warmup", "1", "--json", str(out)]
    if not load:
        cmd.append("--no-load")
    if into:
        cmd.append("--multiget-into")
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"gkv-bench failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
    rep = json.loads(out.read_text())
    if rep["misses"] or rep["errors"]:
        print(f"  note: gkv-bench saw {rep['misses']} misses, errors {rep['errors']}")
    return rep["keys_per_s"]


def batches(seed: int, count: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    cdf = np.cumsum(1.0 / np.arange(1, KEYS + 1, dtype=np.float64) ** THETA)
    cdf /= cdf[-1]
    perm = rng.permutation(KEYS)
    out = []
    for _ in range(count):
        n = int(rng.integers(BMIN, BMAX, endpoint=True))
        ranks = np.minimum(np.searchsorted(cdf, rng.random(n)), KEYS - 1)
        out.append(perm[ranks].astype(np.int64))
    return out


def run_python(cluster: str, seconds: float, threads: int) -> float:
    pools = [batches(1000 + t, 256) for t in range(threads)]
    rows = [0] * threads
    misses = [0] * threads
    start = threading.Barrier(threads + 1)
    stop = threading.Event()

    def worker(t: int) -> None:
        with gkv.Client(cluster, timeout=5) as c:
            bufs = np.empty((BMAX, ROW), np.uint8)
            pool = pools[t]
            c.multi_get_into(pool[0], bufs[:len(pool[0])], prefix="bench/")  # connect
            start.wait()
            i = 0
            while not stop.is_set():
                ids = pool[i % len(pool)]
                hit = c.multi_get_into(ids, bufs[:len(ids)], prefix="bench/")
                rows[t] += len(ids)
                misses[t] += len(ids) - int(np.count_nonzero(hit))
                i += 1

    ths = [threading.Thread(target=worker, args=(t,)) for t in range(threads)]
    for th in ths:
        th.start()
    start.wait()
    time.sleep(1.0)  # warm-up, as gkv-bench's
    base = sum(rows)
    t0 = time.perf_counter()
    time.sleep(seconds)
    done = sum(rows)
    elapsed = time.perf_counter() - t0
    stop.set()
    for th in ths:
        th.join()
    if sum(misses):
        print(f"  note: python saw {sum(misses)} misses")
    return (done - base) / elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cluster")
    ap.add_argument("--seconds", type=float, default=10)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="gkv-pybench-"))
    own = a.cluster is None
    cluster = a.cluster
    if own:
        subprocess.run([str(REPO / "scripts" / "cluster.sh"), "start", str(tmp / "c"), "3"],
                       check=True)
        cluster = str(tmp / "c" / "cluster.yaml")
    try:
        cpp, cpp_into, py = [], [], []
        for r in range(a.rounds):
            cpp.append(run_cpp(cluster, a.seconds, a.threads, load=(r == 0),
                               out=tmp / f"cpp{r}.json"))
            print(f"round {r}: C++ gkv-bench MultiGet      {cpp[-1]:12,.0f} rows/s", flush=True)
            cpp_into.append(run_cpp(cluster, a.seconds, a.threads, load=False,
                                    out=tmp / f"cppi{r}.json", into=True))
            print(f"round {r}: C++ gkv-bench MultiGetInto  {cpp_into[-1]:12,.0f} rows/s",
                  flush=True)
            py.append(run_python(cluster, a.seconds, a.threads))
            print(f"round {r}: Python multi_get_into       {py[-1]:12,.0f} rows/s", flush=True)
        c, ci, p = float(np.mean(cpp)), float(np.mean(cpp_into)), float(np.mean(py))
        print(f"embeddings workload, {a.threads} threads x 1 connection, batches {BMIN}-{BMAX} "
              f"of {ROW}-byte rows, {a.rounds} rounds of {a.seconds:.0f} s each")
        print(f"C++ gkv-bench --workload embeddings (MultiGet):  {c:12,.0f} rows/s")
        print(f"C++ gkv-bench ... --multiget-into:               {ci:12,.0f} rows/s")
        print(f"Python gkv.Client.multi_get_into:                {p:12,.0f} rows/s")
        print(f"ratio Python / C++ MultiGet: {p / c:.2f}x; Python / C++ MultiGetInto: "
              f"{p / ci:.2f}x (goal 0.9x)")
    finally:
        if own:
            subprocess.run([str(REPO / "scripts" / "cluster.sh"), "stop", str(tmp / "c")])


if __name__ == "__main__":
    main()
