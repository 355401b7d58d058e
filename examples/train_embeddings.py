#!/usr/bin/env python3
"""A small click-model training loop whose embedding rows live in gkv.

Model: each sample has FEATURES categorical ids drawn from a power-law (zipf) over a table of
ROWS rows; an embedding bag (mean of the sample's rows, dim DIM) feeds an MLP that predicts a
click. Labels come from a hidden per-id score, so the loss falls as the rows and the MLP learn.

Each step fetches the batch's distinct rows, trains on them (the MLP with Adam, the rows with
SGD on their gradients) and writes the updated rows back. Two ways, one after the other:

  cache    rows through gkv.torch.EmbeddingCache: one multi_get_into per step; misses come
           from the slow storage and are written back to gkv; the next step's rows are
           prefetched in the background while this step computes; updated rows go back to
           gkv in the background too (rows the next step shares come from this step's result,
           since its prefetch ran before this step's write).
  storage  rows read from and written to the slow storage directly.

The slow storage is an in-memory table that sleeps 2 ms per 1,000 rows read or written (a
remote parameter store or disk). Run against a local cluster:

    PYTHONPATH=build/python .venv/bin/python examples/train_embeddings.py [--seconds 25]
        [--rows 2000000] [--cluster FILE] [--device cpu|cuda] [--torch-threads N]
        [--storage-ms 2]

Without --cluster it starts 3 local nodes (scripts/cluster.sh) and stops them at the end.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "build" / "python"))
import gkv  # noqa: E402
from gkv.torch import EmbeddingCache  # noqa: E402

DIM, FEATURES, BATCH = 64, 8, 512
ROW_LR = 0.5


class SlowStorage:
    """The embedding table's home: 2 ms (--storage-ms) per 1,000 rows read or written."""

    ms_per_1000 = 2.0

    def __init__(self, rows: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.table = torch.randn(rows, DIM, generator=g) * 0.01
        self.rows_read = 0

    @staticmethod
    def _wait(n: int) -> None:
        time.sleep(SlowStorage.ms_per_1000 * n / 1e6)

    def read(self, ids: torch.Tensor) -> torch.Tensor:
        self._wait(len(ids))
        self.rows_read += len(ids)
        return self.table[ids]

    def write(self, ids: torch.Tensor, rows: torch.Tensor) -> None:
        self._wait(len(ids))
        self.table[ids] = rows


class ClickModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = torch.nn.Sequential(torch.nn.Linear(DIM, 64), torch.nn.ReLU(),
                                       torch.nn.Linear(64, 32), torch.nn.ReLU(),
                                       torch.nn.Linear(32, 1))

    def forward(self, rows: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
        # rows: [distinct ids, DIM]; local: [BATCH, FEATURES] indices into rows.
        bags = F.embedding_bag(local, rows, mode="mean")
        return self.mlp(bags).squeeze(1)


class Batches:
    """Synthetic samples: zipf ids (popular ranks scattered over the table) and clicks."""

    def __init__(self, rows: int, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.rows = rows
        self.perm = self.rng.permutation(rows)
        cdf = np.cumsum(1.0 / np.arange(1, rows + 1, dtype=np.float64) ** 1.05)
        self.cdf = cdf / cdf[-1]

    def score(self, ids: np.ndarray) -> np.ndarray:  # the hidden truth, per id
        return ((ids * 2654435761) % 1000) / 500.0 - 1.0

    def next(self):
        ranks = np.searchsorted(self.cdf, self.rng.random(BATCH * FEATURES))
        ids = self.perm[np.minimum(ranks, self.rows - 1)].reshape(BATCH, FEATURES)
        p = 1 / (1 + np.exp(-3 * self.score(ids).mean(axis=1)))
        clicks = (self.rng.random(BATCH) < p).astype(np.float32)
        uniq, local = np.unique(ids, return_inverse=True)
        return (torch.from_numpy(uniq), torch.from_numpy(local.reshape(BATCH, FEATURES)),
                torch.from_numpy(clicks))


def train(mode: str, seconds: float, rows: int, device: torch.device, client: gkv.Client | None,
          table: str) -> dict:
    torch.manual_seed(0)
    storage = SlowStorage(rows)
    model = ClickModel().to(device)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    batches = Batches(rows, seed=1)
    cache = None
    if mode == "cache":
        cache = EmbeddingCache(client, table, DIM, torch.float32, storage.read, device=device)
    steps = fetched = 0
    losses = []
    nxt = batches.next()
    prev = None
    if cache is not None:
        cache.prefetch(nxt[0])
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        uniq, local, clicks = nxt
        nxt = batches.next()
        if cache is not None:
            emb = cache.lookup(uniq)  # prefetched during the previous step
            cache.prefetch(nxt[0])  # the next step's rows, while this one computes
            if prev is not None:
                # The prefetch ran before the previous step wrote its updates: take the rows
                # both steps share from that step's result, so no update is lost.
                _, here, there = np.intersect1d(uniq.numpy(), prev[0].numpy(),
                                                return_indices=True)
                emb[torch.from_numpy(here)] = prev[1][torch.from_numpy(there)].to(device)
        else:
            emb = storage.read(uniq).to(device)
        emb.requires_grad_(True)
        logits = model(emb, local.to(device))
        loss = F.binary_cross_entropy_with_logits(logits, clicks.to(device))
        opt.zero_grad()
        loss.backward()
        opt.step()
        with torch.no_grad():
            updated = (emb - ROW_LR * emb.grad * len(uniq) / BATCH).detach()
        if cache is not None:
            cache.put(uniq, updated, background=True)  # the rows live in gkv
            prev = (uniq, updated)
        else:
            storage.write(uniq, updated.cpu())
        steps += 1
        fetched += len(uniq)
        losses.append(loss.item())
    elapsed = time.perf_counter() - t0
    if cache is not None:
        cache.close()
    first = float(np.mean(losses[:20]))
    last = float(np.mean(losses[-20:]))
    out = {"mode": mode, "steps": steps, "seconds": elapsed, "steps_per_s": steps / elapsed,
           "rows_per_s": fetched / elapsed, "loss_first": first, "loss_last": last,
           "storage_rows_read": storage.rows_read}
    if cache is not None:
        out["hit_rate"] = cache.hits / max(1, cache.hits + cache.misses)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cluster")
    ap.add_argument("--seconds", type=float, default=25)
    ap.add_argument("--rows", type=int, default=2_000_000)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--torch-threads", type=int, default=0,
                    help="torch intra-op threads (0: torch's default); on a small machine the "
                         "local cluster's processes share the cores with the model")
    ap.add_argument("--storage-ms", type=float, default=2.0,
                    help="the slow storage's cost in ms per 1,000 rows read or written")
    a = ap.parse_args()
    SlowStorage.ms_per_1000 = a.storage_ms
    if a.torch_threads:
        torch.set_num_threads(a.torch_threads)
    device = torch.device(a.device)
    tmp = Path(tempfile.mkdtemp(prefix="gkv-train-"))
    own = a.cluster is None
    cluster = a.cluster
    if own:
        subprocess.run([str(REPO / "scripts" / "cluster.sh"), "start", str(tmp / "c"), "3"],
                       check=True)
        cluster = str(tmp / "c" / "cluster.yaml")
    try:
        with gkv.Client(cluster, timeout=5) as client:
            table = f"train-emb-{int(time.time())}"
            print(f"table of {a.rows:,} rows x {DIM} f32, batches of {BATCH} samples x "
                  f"{FEATURES} zipf ids, device {device}, {a.seconds:.0f} s per mode, slow "
                  f"storage {a.storage_ms:g} ms per 1,000 rows")
            results = [train(m, a.seconds, a.rows, device, client, table)
                       for m in ("cache", "storage")]
        for r in results:
            extra = f", cache hit rate {r['hit_rate']:.1%}" if "hit_rate" in r else ""
            print(f"{r['mode']:>8}: {r['steps_per_s']:7.1f} steps/s, {r['rows_per_s']:10,.0f} "
                  f"rows/s ({r['steps']} steps; loss {r['loss_first']:.3f} -> "
                  f"{r['loss_last']:.3f}; {r['storage_rows_read']:,} rows read from the slow "
                  f"storage{extra})")
        print(f"speed-up with gkv: {results[0]['steps_per_s'] / results[1]['steps_per_s']:.2f}x")
    finally:
        if own:
            subprocess.run([str(REPO / "scripts" / "cluster.sh"), "stop", str(tmp / "c")])


if __name__ == "__main__":
    main()
