"""Helpers shared by the benchmarks: etcd, coordinator and worker as real
processes on free ports, peak RSS of a process."""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from compilecast.blobstore import blob_path
from compilecast.launch import free_port
from compilecast.worker.inprocess.client import wait_until_healthy
from compilecast.worker.inprocess.handoff import memory_headroom

__all__ = ["HOLD_PAGE_REPORTING_HELP", "Stack", "bucket_stack", "free_port", "page_reporting_held", "page_reporting_order", "peak_rss_mb",
           "random_file", "wait_port"]


@contextlib.contextmanager
def bucket_stack(root: Path):
    """etcd (a Stack under `root`) and a SeaweedFS server with a bucket
    "bench", its credentials in the environment: (stack, s3 server, the
    coordinator flags of a replica over the bucket). Both stop after."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from tests.s3server import S3Server

    (root / "s3").mkdir()
    s3 = S3Server(root / "s3")
    stack = Stack(root / "stack")
    try:
        s3.bucket("bench")
        os.environ.update(s3.env())
        yield stack, s3, ("--store-type", "s3", "--s3-bucket", "bench", "--s3-endpoint",
                          s3.endpoint, "--store-max-bytes", "8Gi")
    finally:
        stack.close()
        s3.stop()


def wait_port(port: int, timeout: float = 20, host: str = "127.0.0.1") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex((host, port)) == 0:
                return
        time.sleep(0.05)
    raise RuntimeError(f"port {port} did not open")


def _on(host) -> list[str]:
    """The command prefix that runs a process on `host` (a _netem.Host), or
    none: on this machine."""
    return list(host.prefix) if host else []


class Stack:
    """etcd + coordinator (+ workers) as subprocesses under `root`, which
    close() removes. `host` (a _netem.Host) runs etcd and the coordinators on
    a host of an emulated network, listening on its address, instead of on
    this one's loopback."""

    def __init__(self, root: Path, host=None) -> None:
        self.root = root
        self.procs: list[subprocess.Popen] = []
        self.ip = host.ip if host else "127.0.0.1"
        self._prefix = _on(host)
        client, peer = free_port(), free_port()
        self.etcd = f"{self.ip}:{client}"
        self._spawn([shutil.which("etcd") or "/usr/bin/etcd", "--data-dir", str(root / "etcd"),
                     "--listen-client-urls", f"http://{self.etcd}",
                     "--advertise-client-urls", f"http://{self.etcd}",
                     "--listen-peer-urls", f"http://{self.ip}:{peer}",
                     "--initial-advertise-peer-urls", f"http://{self.ip}:{peer}",
                     "--initial-cluster", f"default=http://{self.ip}:{peer}"], self._prefix)
        wait_port(client, host=self.ip)

    def _spawn(self, args: list[str], prefix: Sequence[str] = ()) -> subprocess.Popen:
        p = subprocess.Popen([*prefix, *args], stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
        self.procs.append(p)
        return p

    def stored_bytes(self, digest: str, name: str = "c") -> int:
        """What coordinator `name`'s store holds for `digest` (zstd or raw)."""
        return self.blob_path(digest, name).stat().st_size

    def blob_path(self, digest: str, name: str = "c") -> Path:
        """Where coordinator `name`'s store keeps the blob of `digest`."""
        return blob_path(self.root / f"store-{name}", digest)

    def coordinator(self, name: str = "c", store: Path | None = None,
                    extra: tuple[str, ...] = ()) -> tuple[str, subprocess.Popen]:
        port = free_port()
        p = self._spawn([sys.executable, "-m", "compilecast.cli", "--log-level", "warning",
                         "coordinator", "--listen", f"{self.ip}:{port}",
                         "--metrics-host", self.ip, "--etcd-endpoints", self.etcd,
                         "--store-dir", str(store or self.root / f"store-{name}"),
                         "--metrics-port", "0", "--allow-unauthenticated", "true", *extra],
                        self._prefix)
        target = f"{self.ip}:{port}"
        wait_until_healthy(target, 30)
        return target, p

    def worker(self, coordinator: str, name: str, extra: tuple[str, ...] = (),
               host=None) -> tuple[str, subprocess.Popen]:
        """A worker; on `host` (a _netem.Host) when given. Its unix socket is
        in the file system, which every network namespace shares."""
        sock = self.root / f"{name}.sock"
        p = self._spawn([sys.executable, "-m", "compilecast.cli", "--log-level", "warning",
                         "worker", "--listen", f"unix://{sock}", "--coordinator", coordinator,
                         "--cache-dir", str(self.root / f"cache-{name}"), "--metrics-port", "0",
                         *extra], _on(host))
        target = f"unix://{sock}"
        wait_until_healthy(target, 30)
        return target, p

    def close(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(15)
        # Stores and host caches of GB-sized artifacts: never leave them behind.
        shutil.rmtree(self.root, ignore_errors=True)


def go_built(command: str = ".") -> Path:
    """A command of bench/loadgen (its package, "." or "./leaves") built (go
    build caches: fast after the first time)."""
    name = "loadgen" if command == "." else Path(command).name
    out = Path(tempfile.gettempdir()) / f"compilecast-bench-{name}"
    try:
        subprocess.run(["go", "build", "-o", str(out), command],
                       cwd=Path(__file__).parent / "loadgen", check=True)
    except (OSError, subprocess.CalledProcessError) as exc:
        sys.exit(f"this bench needs Go to build bench/loadgen/{command}: {exc}")
    return out


def peak_rss_mb(pid: int) -> float:
    """Peak resident set size (VmHWM) of a live process."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time a live process has used so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def metrics_text(port: int, host: str = "127.0.0.1") -> str:
    """A server's /metrics page."""
    return urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10).read().decode()


def scraped(port: int, name: str, host: str = "127.0.0.1", labels: str = "") -> float:
    """The sum of a metric's samples on a server's /metrics (those whose
    label set contains `labels`, e.g. 'direction="out"'); 0 when none."""
    text = metrics_text(port, host)
    total = 0.0
    for m in re.finditer(rf"^{re.escape(name)}(?:{{([^}}]*)}})? (\S+)$", text, re.M):
        if labels in (m.group(1) or ""):
            total += float(m.group(2))
    return total


def line_of(proc: subprocess.Popen) -> str:
    """The next line a child started with stdout=PIPE (text) printed."""
    assert proc.stdout is not None
    return proc.stdout.readline()


def say(proc: subprocess.Popen, text: str) -> None:
    """Write `text` to a child started with stdin=PIPE (text), now."""
    assert proc.stdin is not None
    proc.stdin.write(text)
    proc.stdin.flush()


def histogram(text: str, name: str) -> dict[tuple[str, float], float]:
    """A histogram's cumulative bucket counts on a /metrics page (metrics_text):
    {(its other labels, le): count}."""
    out: dict[tuple[str, float], float] = {}
    for m in re.finditer(rf"^{re.escape(name)}_bucket{{([^}}]*)}} (\S+)$", text, re.M):
        labels = m.group(1)
        le = re.search(r'(?:^|,)le="([^"]+)"', labels)
        if le is None:
            continue
        rest = re.sub(r'(?:^|,)le="[^"]+"', "", labels).strip(",")
        out[(rest, float(le.group(1)))] = float(m.group(2))
    return out


def histogram_quantile(q: float, before: dict, after: dict, labels: str) -> float | None:
    """Prometheus' histogram_quantile over what the series `labels` (e.g.
    'method="Txn"') counted between two `histogram` scrapes: linear within
    its bucket, so only as fine as the buckets. None when it counted nothing."""
    les = sorted(le for (rest, le) in after if rest == labels)
    counts = [after[(labels, le)] - before.get((labels, le), 0.0) for le in les]
    if not counts or counts[-1] <= 0:
        return None
    rank = q * counts[-1]
    lower, below = 0.0, 0.0
    for le, count in zip(les, counts, strict=True):
        if count >= rank:
            if le == float("inf"):
                return lower
            return lower + (le - lower) * (rank - below) / max(count - below, 1e-12)
        lower, below = le, count
    return None


def own_cpu_seconds() -> float:
    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_utime + u.ru_stime


def compressible_file(path: Path, size: int) -> None:
    """Bytes that zstd (level 3) compresses ~10x: in every KiB, 96 random
    bytes and then zeros. XLA executables without large constants compress
    about as well (a CPU executable of a 100-layer step: 12x)."""
    with open(path, "wb") as f:
        left = size
        while left:
            n = min(left, 64 << 20)
            noise = os.urandom(n // 1024 * 96)
            f.write(b"".join(noise[i:i + 96] + bytes(928) for i in range(0, len(noise), 96))
                    + bytes(n % 1024))
            left -= n


def random_file(path: Path, size: int) -> None:
    """Incompressible bytes (the worst case for the zstd store)."""
    with open(path, "wb") as f:
        left = size
        while left:
            n = min(left, 64 << 20)
            f.write(os.urandom(n))
            left -= n


# Free page reporting (virtio-balloon): the guest hands free blocks of at least
# 2^order pages to the host, which takes their memory back; the next touch of
# each page faults to the host (~2.7 s a GB here, against ~0.4 s a GB for
# memory the host still backs). Orders run up to 10 (MAX_PAGE_ORDER): 11 reports
# nothing.
PAGE_REPORTING = "/sys/module/page_reporting/parameters/page_reporting_order"
_MADV_POPULATE_WRITE = 23


def page_reporting_order() -> int | None:
    """The guest's free page reporting order now (None: it reports none)."""
    try:
        with open(PAGE_REPORTING) as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


HOLD_PAGE_REPORTING_HELP = (
    "stop this VM's free page reporting for the runs and back its free memory first (root; "
    "restored after): fresh memory then costs what it does on a host without it "
    "(BENCHMARKS.md, \"Machines\")")


@contextlib.contextmanager
def page_reporting_held(margin: int = 2 << 30):
    """While it is open, this VM's guest reports no free pages to its host,
    and the memory it had reported (all but `margin` of what is available)
    has been touched once, so that the host backs it again. The setting is
    restored at the end. Needs root."""
    try:
        with open(PAGE_REPORTING) as f:
            was = f.read().strip()
        with open(PAGE_REPORTING, "w") as f:
            f.write("11\n")
    except OSError as exc:
        raise SystemExit(f"--hold-page-reporting: cannot set {PAGE_REPORTING} ({exc}); run as "
                         "root on a VM that reports free pages, or leave the option out") from None
    try:
        size = max(0, (memory_headroom() or 0) - margin) // (1 << 21) * (1 << 21)
        madvise = ctypes.CDLL(None, use_errno=True).madvise
        madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        began = time.perf_counter()
        if size:
            with mmap.mmap(-1, size) as m:  # touched once, then freed (not reported now)
                base = ctypes.addressof(ctypes.c_char.from_buffer(m))
                if madvise(base, size, _MADV_POPULATE_WRITE) != 0:
                    raise SystemExit("--hold-page-reporting: madvise(MADV_POPULATE_WRITE) "
                                     f"failed (errno {ctypes.get_errno()})")
        took = time.perf_counter() - began
        rate = f" ({took / (size / 2**30):.2f} s a GB)" if size else ""
        print(f"# free page reporting held (order {was} -> 11); {size / 2**30:.1f} GB of free "
              f"memory backed again in {took:.1f}s{rate}", flush=True)
        yield
    finally:
        with open(PAGE_REPORTING, "w") as f:
            f.write(was + "\n")


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """(base, slope) of y = base + slope x, by least squares (slope 0 for one x)."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var else 0.0
    return my - slope * mx, slope
