"""Fixtures: real gkv-server processes on 127.0.0.1, started per test module (or per test for
the ones that kill or stop nodes) and stopped by process id. A cluster that fails to come up
fails the test (an error, never a skip).

The server binary: $GKV_SERVER_BIN, else build/bin/gkv-server of this checkout.
"""

from __future__ import annotations

import ctypes
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SERVER = os.environ.get("GKV_SERVER_BIN", str(REPO / "build" / "bin" / "gkv-server"))

# scripts/test.sh's Python step has torch (Debian's): there a test may not skip for want of it.
# Its wheel step installs the client wheel where torch is absent, and the torch tests skip.
if os.environ.get("GKV_TEST_REQUIRE_TORCH") == "1":
    import torch  # noqa: F401 (an ImportError here fails the run)


def _free_port(taken: set[int]) -> int:
    # Below the ephemeral range (32768+), so no client connection can take it meanwhile.
    rng = random.Random(os.getpid() ^ time.monotonic_ns())
    for _ in range(1000):
        port = rng.randrange(20000, 32000)
        if port in taken:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        taken.add(port)
        return port
    raise RuntimeError("no free port found")


_TAKEN: set[int] = set()
_libc = ctypes.CDLL(None, use_errno=True)
_PR_SET_PDEATHSIG = 1


def _die_with_pytest() -> None:
    # A node gets SIGTERM when the pytest process dies without its teardown (a crash).
    _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


class Etcd:
    """A single-member etcd on free 127.0.0.1 ports ($GKV_ETCD_BIN, else etcd from PATH), in
    `directory`, stopped by process id. One that does not answer within 10 s raises."""

    def __init__(self, directory: Path) -> None:
        binary = os.environ.get("GKV_ETCD_BIN") or shutil.which("etcd")
        if not binary:
            raise RuntimeError("no etcd binary: install etcd-server (scripts/deps.sh)")
        client, peer = _free_port(_TAKEN), _free_port(_TAKEN)
        self.endpoint = f"http://127.0.0.1:{client}"
        peer_url = f"http://127.0.0.1:{peer}"
        self.log_path = directory / "etcd.log"
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [binary, "--name=gkv-pytest", f"--data-dir={directory / 'etcd-data'}",
             f"--listen-client-urls={self.endpoint}", f"--advertise-client-urls={self.endpoint}",
             f"--listen-peer-urls={peer_url}", f"--initial-advertise-peer-urls={peer_url}",
             f"--initial-cluster=gkv-pytest={peer_url}", "--initial-cluster-state=new",
             "--heartbeat-interval=50", "--election-timeout=500"],
            stdout=log, stderr=log, preexec_fn=_die_with_pytest)
        log.close()
        deadline = time.monotonic() + 10
        import urllib.request
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited ({self.proc.returncode}):\n{self.log()}")
            try:
                with urllib.request.urlopen(self.endpoint + "/health", timeout=0.5) as r:
                    if b'"true"' in r.read():
                        return
            except OSError:
                pass
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"etcd did not answer within 10 s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class Cluster:
    """n gkv-server nodes; cluster_file is the YAML to open clients with. With etcd=True the
    members come from an etcd of the cluster's own (``membership: etcd``), as in production."""

    def __init__(self, n: int, host_mem: str = "256MiB", disk: str | None = "1GiB",
                 secret: str | None = None, extra: list[str] | None = None,
                 etcd: bool = False) -> None:
        if not os.access(SERVER, os.X_OK):
            raise RuntimeError(f"no gkv-server at {SERVER}: build first (scripts/build.sh)")
        self.dir = Path(tempfile.mkdtemp(prefix="gkv-pytest-"))
        self.ports = [_free_port(_TAKEN) for _ in range(n)]
        self.cluster_file = str(self.dir / "cluster.yaml")
        self.etcd = None
        self.host_mem, self.disk, self.extra = host_mem, disk, extra or []
        self.procs: list[subprocess.Popen | None] = [None] * n
        self.killed: set[int] = set()  # nodes the test SIGKILLed (any exit is theirs)
        try:
            if etcd:
                self.etcd = Etcd(self.dir)
            with open(self.cluster_file, "w") as f:
                if self.etcd:
                    f.write("membership: etcd\n"
                            f"etcd: {{endpoints: [{self.etcd.endpoint}], lease_ttl_s: 2}}\n")
                else:
                    f.write("nodes:\n")
                    for i, p in enumerate(self.ports):
                        f.write(f"  - {{id: n{i}, address: 127.0.0.1:{p}}}\n")
                if secret:
                    f.write(f'secret: "{secret}"\n')
            for i in range(n):
                self.start(i)
            for i in range(n):
                self.wait_up(i)
        except BaseException:
            self.stop()
            raise

    def start(self, i: int) -> None:
        args = [SERVER, "--cluster", self.cluster_file, "--node", f"n{i}",
                "--host-mem", self.host_mem, "--threads", "2",
                "--io-threads", "2"]
        if self.etcd:
            args += ["--listen", f"127.0.0.1:{self.ports[i]}"]
        if self.disk:
            args += ["--disk", str(self.dir / f"disk{i}"), "--disk-capacity", self.disk]
        args += self.extra
        self.killed.discard(i)  # a restarted node answers for its own exit again
        log = open(self.dir / f"node{i}.log", "ab")
        self.procs[i] = subprocess.Popen(args, stdout=log, stderr=log,
                                         preexec_fn=_die_with_pytest)
        log.close()

    def log(self, i: int) -> str:
        return (self.dir / f"node{i}.log").read_text(errors="replace")

    def wait_up(self, i: int, timeout: float = 15.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if f"node n{i} up" in self.log(i):
                return
            if self.procs[i].poll() is not None:
                raise RuntimeError(f"node n{i} exited ({self.procs[i].returncode}):\n{self.log(i)}")
            time.sleep(0.05)
        raise RuntimeError(f"node n{i} did not come up within {timeout} s:\n{self.log(i)}")

    def kill(self, i: int, sig: int = signal.SIGKILL) -> None:
        p = self.procs[i]
        if p is not None and p.poll() is None:
            if sig == signal.SIGKILL:
                self.killed.add(i)
            p.send_signal(sig)
            if sig in (signal.SIGKILL, signal.SIGTERM):
                p.wait(timeout=20)

    def stop(self) -> None:
        # Every node the test did not SIGKILL must have exited 0 (on its own SIGTERM or on this
        # one): a crash while writing a tier back, or a hang, fails the test's teardown.
        bad: list[str] = []
        sent: list[int] = []
        for i, p in enumerate(self.procs):
            if p is None:
                continue
            if p.poll() is not None:
                if i not in self.killed and p.returncode != 0:
                    bad.append(f"node n{i} exited {p.returncode} before the stop")
                continue
            p.send_signal(signal.SIGCONT)  # a stopped node must see its SIGTERM
            p.terminate()
            sent.append(i)
        for i in sent:
            p = self.procs[i]
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
                bad.append(f"node n{i} did not exit within 20 s of SIGTERM")
                continue
            if p.returncode != 0:
                bad.append(f"node n{i} exited {p.returncode} on SIGTERM")
        logs = "".join(f"\n--- {b}:\n{self.log(int(b.split()[1][1:]))[-3000:]}" for b in bad)
        if self.etcd:
            self.etcd.stop()
        shutil.rmtree(self.dir, ignore_errors=True)
        if bad:
            raise AssertionError("; ".join(bad) + logs)


@pytest.fixture(scope="module")
def cluster():
    c = Cluster(3)
    yield c
    c.stop()


@pytest.fixture
def own_cluster():
    """A factory of clusters that live for one test (for tests that kill or stop nodes)."""
    made: list[Cluster] = []

    def make(n: int = 2, **kw) -> Cluster:
        c = Cluster(n, **kw)
        made.append(c)
        return c

    yield make
    for c in made:
        c.stop()


@pytest.fixture
def client(cluster):
    import gkv

    with gkv.Client(cluster.cluster_file, timeout=5.0) as c:
        yield c
