"""Fan-out: N workers fetch the same artifact at once.

    python bench/fanout.py [--mb 256] [--workers 16] [--compressible]
    python bench/fanout.py --fanouts 2 --relay-data-plane on off --repeat 2 [--hold-page-reporting]
    sudo python bench/fanout.py --link-mbps 200 --fanouts 0 1 2   # hosts with NICs of their own

For relay fan-out 0 (every worker fetches from the coordinator) and 2 (the
coordinator streams to the first worker and points the others at earlier
ones, which pass chunks on as they arrive): the time until all N workers hold
the verified artifact, against one worker fetching alone from the same
coordinator, and the coordinator's egress in multiples of the artifact
(its metric compilecast_coordinator_artifact_bytes_total{direction="out"}).
All processes share this machine's cores. With --compressible the artifact
compresses ~10x (stored as zstd): the coordinator sends its stored stream,
workers relay that stream to each other, and the fetching clients take it as
compilecast's do.

With --link-mbps R (Linux, root, iproute2) the coordinator (with its etcd)
and every worker run on hosts of their own, each with an R Mbit/s full-duplex
link to a shared switch (bench/_netem.py), as on a pod: then the links, not
this machine's 2 cores, bound what moves, and the time target (all N within
2x one fetch) can be read. The clients reach their worker over its unix
socket, as a host's JAX processes do. The cores every process used meanwhile
are printed, to show the CPU was not the limit.

With --host-cpus C each host's processes share C cores of this machine's (a
CFS quota; --host-cpu-period-ms sets its period), and each host's client is a
process of its own there (--clients thread puts them in threads of this
process instead, which then share one GIL across the hosts' quotas).

With --relay-data-plane on off, each fan-out runs with the workers' relay
data plane (peers take what a worker relays over plain TCP with sendfile,
worker/daemon/relayplane.py; the default) and without it (relays over gRPC), in
turn, --repeat times: the workers' CPU for the whole fan-out is printed too.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _netem import Network, available
from _servers import (
    HOLD_PAGE_REPORTING_HELP,
    Stack,
    compressible_file,
    cpu_seconds,
    free_port,
    own_cpu_seconds,
    page_reporting_held,
    random_file,
    scraped,
    wait_port,
)
from fetch import fetch, publish_file

# A host's client as a process of its own: started (and its imports done)
# before the clock starts, it fetches when told to on stdin.
CLIENT = """
import sys
sys.path.insert(0, sys.argv[1])
from fetch import fetch
print("ready", flush=True)
sys.stdin.readline()
fetch(sys.argv[2], "art", sys.argv[3], zstd=sys.argv[4] == "1")
print("done", flush=True)
"""


class Clients:
    """The clients of (worker target, host) pairs, each fetching the artifact
    in its host's CPU quota; `timed` runs them all and returns the seconds."""

    def __init__(self, workers: list, digest: str, zstd: bool) -> None:
        raise NotImplementedError

    def go(self) -> None:
        raise NotImplementedError

    def wait(self, spare: str | None = None) -> None:
        """All done; raises for a client that failed, but the one of `spare`."""
        raise NotImplementedError

    def timed(self, spare: str | None = None, at_start=None) -> float:
        t0 = time.perf_counter()
        if at_start is not None:
            at_start()
        self.go()
        self.wait(spare)
        return time.perf_counter() - t0


class ThreadClients(Clients):
    """Each client a thread of this process: on hosts with CPU quotas they
    share one GIL, and a thread throttled while it holds it stops every other
    host's client until its next period."""

    def __init__(self, workers: list, digest: str, zstd: bool) -> None:
        self.errors: list = []

        def one(target: str, h) -> None:
            try:
                if h:
                    h.enter()  # the client is a process of that host
                fetch(target, "art", digest, zstd=zstd)
            except Exception as exc:  # reported by wait()
                self.errors.append((target, exc))

        self.threads = [threading.Thread(target=one, args=w) for w in workers]

    def go(self) -> None:
        for t in self.threads:
            t.start()

    def wait(self, spare: str | None = None) -> None:
        for t in self.threads:
            t.join()
        for target, exc in self.errors:
            if target != spare:
                raise RuntimeError(f"a client failed: {exc}") from exc


class ProcessClients(Clients):
    """Each client a process of its own, in its host's CPU quota from its
    start, as a host's JAX process is; its imports are done before go()."""

    def __init__(self, workers: list, digest: str, zstd: bool) -> None:
        self.procs = []
        for target, h in workers:
            cgroup = getattr(h, "cgroup", None)

            def join_quota(cgroup=cgroup) -> None:
                if cgroup is not None:
                    (cgroup / "tasks").write_text(str(os.getpid()))

            self.procs.append((target, subprocess.Popen(
                [sys.executable, "-c", CLIENT, str(Path(__file__).parent), target, digest,
                 "1" if zstd else "0"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, text=True, preexec_fn=join_quota)))
        for _, proc in self.procs:
            if proc.stdout.readline().strip() != "ready":
                raise RuntimeError(f"a client did not start: {proc.stderr.read()[-2000:]}")

    def go(self) -> None:
        for _, proc in self.procs:
            proc.stdin.write("go\n")
            proc.stdin.flush()

    def wait(self, spare: str | None = None) -> None:
        for target, proc in self.procs:
            _, err = proc.communicate(timeout=1800)
            if proc.returncode and target != spare:
                raise RuntimeError(f"a client failed: {err[-2000:]}")


def _reaped_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def egress(metrics_port: int, host: str = "127.0.0.1") -> float:
    return scraped(metrics_port, "compilecast_coordinator_artifact_bytes_total", host,
                   'direction="out"')


def run(fanout: int, mb: int, n: int, compressible: bool = False, link_mbps: float = 0,
        host_cpus: float = 0, kill_after: float = 0, chain_bytes: str = "",
        relay_plane: str = "on", cpu_period_ms: float = 0,
        clients: type[Clients] = ThreadClients) -> dict:
    root = Path(tempfile.mkdtemp(prefix="cc-fanout-"))
    net = Network(link_mbps, host_cpus, cpu_period_ms) if link_mbps or host_cpus else None
    host = (lambda name: net.host(name)) if net else (lambda name: None)
    stack = None
    try:
        stack = Stack(root, host=host("coordinator"))
        mport = free_port()
        coord, _ = stack.coordinator(extra=("--relay-fanout", str(fanout),
                                            "--metrics-port", str(mport))
                                     + (("--relay-chain-bytes", chain_bytes) if chain_bytes else ()))
        wait_port(mport, host=stack.ip)
        path = root / "art.bin"
        (compressible_file if compressible else random_file)(path, mb << 20)
        digest = publish_file(coord, "art", path)
        path.unlink()
        ahost = host("alone")
        alone, _ = stack.worker(coord, "alone", host=ahost)
        single = clients([(alone, ahost)], digest, compressible).timed()
        workers, procs = [], []
        for i in range(n):
            h = host(f"w{i}")
            addr = f"{h.ip if h else '127.0.0.1'}:{free_port()}"
            target, proc = stack.worker(coord, f"w{i}", host=h, extra=(
                "--relay-listen", addr, "--relay-advertise", addr,
                "--relay-data-listen", "auto" if relay_plane == "on" else "off"))
            workers.append((target, h))
            procs.append(proc)
        # --kill-after: one worker (SIGKILL) while the others relay through it.
        victim = workers[n // 2][0] if kill_after else None
        killer = threading.Timer(kill_after, procs[n // 2].kill) if kill_after else None
        before = egress(mport, stack.ip)
        cpu0 = sum(cpu_seconds(p.pid) for p in stack.procs) + own_cpu_seconds()
        workers_cpu0 = sum(cpu_seconds(p.pid) for p in procs)
        fetchers = clients(workers, digest, compressible)
        reaped0 = _reaped_cpu_seconds()  # the client processes' CPU, once they are waited for
        wall = fetchers.timed(spare=victim, at_start=killer.start if killer else None)
        clients_cpu = _reaped_cpu_seconds() - reaped0
        cores = (sum(cpu_seconds(p.pid) for p in stack.procs) + own_cpu_seconds() + clients_cpu
                 - cpu0) / wall
        workers_cpu = sum(cpu_seconds(p.pid) for p in procs if p.poll() is None) - workers_cpu0
        return {"single_s": single, "all_s": wall, "cores": cores, "workers_cpu_s": workers_cpu,
                "egress_x": (egress(mport, stack.ip) - before) / (mb << 20)}
    finally:
        if stack:
            stack.close()
        if net:
            net.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=256)
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument("--compressible", action="store_true",
                    help="an artifact that compresses ~10x (as executables do), not random bytes")
    ap.add_argument("--fanouts", type=int, nargs="+", default=[0, 2],
                    help="the coordinator's --relay-fanout values to run")
    ap.add_argument("--link-mbps", type=float, default=0,
                    help="every host on a link of this many Mbit/s of its own (0: all on "
                         "this machine's loopback)")
    ap.add_argument("--host-cpus", type=float, default=0,
                    help="every host (its servers and its clients) limited to this many "
                         "cores of its own (0: all share this machine's)")
    ap.add_argument("--host-cpu-period-ms", type=float, default=0,
                    help="the CFS period of each host's quota (0: the kernel's, 100 ms): a host "
                         "of 0.11 cores runs 11 ms of every 100 ms in bursts; a short period "
                         "makes it a slow host rather than a bursty one")
    ap.add_argument("--clients", choices=("thread", "process"), default=None,
                    help="each host's client as a thread of this process or as a process of "
                         "its own (default: a process where hosts have CPU quotas, whose "
                         "threads would share one GIL across hosts; a thread otherwise)")
    ap.add_argument("--relay-chain-bytes", default="",
                    help="the coordinator's --relay-chain-bytes (default: its own default)")
    ap.add_argument("--kill-after", type=float, default=0,
                    help="SIGKILL one worker this many seconds into the fetch: what the others "
                         "pay for a relay that dies (times are then of the other N-1)")
    ap.add_argument("--relay-data-plane", nargs="+", choices=("on", "off"), default=["on"],
                    help="the workers' relay data plane (on: peers take relays over plain TCP "
                         "with sendfile, the default; off: over gRPC), each in turn")
    ap.add_argument("--repeat", type=int, default=1, help="runs of each setting, alternating")
    ap.add_argument("--hold-page-reporting", action="store_true", help=HOLD_PAGE_REPORTING_HELP)
    args = ap.parse_args()
    with page_reporting_held() if args.hold_page_reporting else contextlib.nullcontext():
        fan_out(args)


def fan_out(args: argparse.Namespace) -> None:
    if (args.link_mbps or args.host_cpus) and (why := available(args.host_cpus)):
        sys.exit(f"fanout: emulated hosts: {why}")
    if args.host_cpus * (args.workers + 2) > (os.cpu_count() or 1):
        print(f"# note: {args.workers + 2} hosts x {args.host_cpus:g} cores is more than this "
              f"machine's {os.cpu_count()}: hosts will also wait on each other")
    if args.relay_chain_bytes:
        print(f"# coordinator --relay-chain-bytes {args.relay_chain_bytes}")
    where = ", ".join(w for w in (
        f"each on a {args.link_mbps:g} Mbit/s link of its own" if args.link_mbps else "",
        f"each with {args.host_cpus:g} cores of its own" if args.host_cpus else "",
        f"a CFS period of {args.host_cpu_period_ms:g} ms" if args.host_cpu_period_ms else "")
        if w) \
        or "all on this machine's loopback"
    print(f"# {args.workers} workers fetch one {args.mb} MB "
          f"{'compressible ' if args.compressible else ''}artifact at once, {where}"
          + (f"; one worker killed {args.kill_after:g}s in" if args.kill_after else ""))
    kind = args.clients or ("process" if args.host_cpus else "thread")
    clients = ProcessClients if kind == "process" else ThreadClients
    print(f"# each host's client: a {kind}")
    for fanout in args.fanouts:
        for _ in range(args.repeat):
            for plane in args.relay_data_plane:
                r = run(fanout, args.mb, args.workers, args.compressible, args.link_mbps,
                        args.host_cpus, args.kill_after, args.relay_chain_bytes, plane,
                        args.host_cpu_period_ms, clients)
                ready = f"the other {args.workers - 1}" if args.kill_after \
                    else f"all {args.workers}"
                print(f"relay fan-out {fanout}, relay data plane {plane}: {ready} hold it in "
                      f"{r['all_s']:6.1f}s ({r['all_s'] / r['single_s']:.2f}x one fetch alone, "
                      f"{r['single_s']:.2f}s); coordinator egress {r['egress_x']:.1f}x the "
                      f"artifact; workers' CPU {r['workers_cpu_s']:.1f}s; cores used "
                      f"{r['cores']:.2f} (of {os.cpu_count()})", flush=True)


if __name__ == "__main__":
    main()
