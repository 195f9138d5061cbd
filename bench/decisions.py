"""Decision throughput: C concurrent clients send Acquire to one coordinator
(a real process over a real etcd), half for published keys (HIT) and half
for new keys (COMPILE: a lease grant and a txn in etcd).

    python bench/decisions.py [--clients 1000] [--seconds 15] [--hit-ratio 0.5]
    python bench/decisions.py --ceiling   # the same load on a trivial grpc.aio server
    python bench/decisions.py --loadgen go --rate 5000 --hit-ratio 0.9 --pin
    python bench/decisions.py --loadgen go ... --components 11 [--components-hits-every 8]

Prints decisions per second, latency percentiles and where the CPU went
(cores used by the load generator, the coordinator(s) and etcd). The load
generator is one grpc.aio process sharing the machine's 2 cores with the
coordinator and etcd. With `--loadgen go` the load comes from bench/loadgen
(Go, built here with `go build`), which offers the same open-loop Decide load
as `--streams N --rate R` for a fraction of the CPU: the Python load
generator takes most of the core it shares with etcd under `--pin`, and its
own queueing then shows in the latencies.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).parent))
from _servers import (
    Stack,
    cpu_seconds,
    free_port,
    go_built,
    histogram,
    histogram_quantile,
    metrics_text,
    own_cpu_seconds,
    wait_port,
)

from compilecast.config import CoordinatorConfig
from compilecast.decide import GAP_S, Decider
from compilecast.errors import UpstreamError
from compilecast.v1 import cache_pb2 as pb
from compilecast.v1 import cache_pb2_grpc as rpc
from compilecast.worker.inprocess.client import CacheClient


def stolen_seconds() -> float:
    """CPU time the hypervisor gave to others while this VM wanted it (the
    steal column of /proc/stat, all CPUs), in seconds."""
    with open("/proc/stat") as f:
        fields = f.readline().split()
    return int(fields[8]) / os.sysconf("SC_CLK_TCK") if len(fields) > 8 else 0.0


def wal_fsyncs(etcd: str) -> dict[float, float]:
    """etcd's WAL fsync histogram (upper bound in seconds -> count so far)."""
    import urllib.request
    with urllib.request.urlopen(f"http://{etcd}/metrics", timeout=5) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("etcd_disk_wal_fsync_duration_seconds_bucket"):
            le = line.split('le="', 1)[1].split('"', 1)[0]
            out[float(le)] = float(line.rsplit(" ", 1)[1])
    return out


def fsync_summary(before: dict[float, float], after: dict[float, float]) -> dict:
    """The WAL fsyncs between two histograms: how many, the share within 1
    and 8 ms, and the bucket bound p99 falls under. A claim waits for at
    least one, so this VM's disk sets a floor under a miss's latency."""
    d = {le: after[le] - before.get(le, 0) for le in sorted(after)}
    n = d.get(float("inf"), 0)
    if not n:
        return {"fsyncs": 0}
    p99 = next(le for le, c in d.items() if c >= 0.99 * n)
    return {"fsyncs": int(n), "within_1ms": d.get(0.001, 0) / n, "within_8ms": d.get(0.008, 0) / n,
            "p99_under_ms": p99 * 1000}


def fmt_fsyncs(f: dict) -> str:
    if not f.get("fsyncs"):
        return "etcd WAL fsyncs: none"
    return (f"etcd WAL fsyncs: {f['fsyncs']}, {f['within_1ms']:.0%} within 1 ms, "
            f"{f['within_8ms']:.0%} within 8 ms, p99 under {f['p99_under_ms']:g} ms")


def cores(pids: dict[str, int], run):
    """Run `run()`; return its result and the cores each process (and this
    one, the load generator) used meanwhile, and the cores stolen from this
    VM (a busy neighbour shows there, not in our processes)."""
    before = {n: cpu_seconds(p) for n, p in pids.items()}
    c0, s0, t0 = own_cpu_seconds(), stolen_seconds(), time.monotonic()
    result = run()
    wall = time.monotonic() - t0
    used = {n: (cpu_seconds(p) - before[n]) / wall for n, p in pids.items()}
    used["load generator"] = (own_cpu_seconds() - c0) / wall
    used["stolen"] = (stolen_seconds() - s0) / wall
    return result, used


def fmt_cores(used: dict[str, float]) -> str:
    return "cores: " + ", ".join(f"{n} {v:.2f}" for n, v in used.items())


def coordinator_us_per_decision(used: dict[str, float], per_second: float) -> float:
    """The coordinators' CPU per decision, a measure of the code's cost that
    latency is not. Read it with the messages per request: a coordinator that
    falls behind gets fuller messages, and each decision then costs less."""
    busy = sum(v for n, v in used.items() if n.startswith("coordinator"))
    return 1e6 * busy / per_second if per_second else float("nan")


class _Load:
    """The requests of one `load` run and what they got."""

    def __init__(self, clients: int, deadline: float, hit_ratio: float, hit_keys: list[str],
                 batch: int, pod: bool, stubs: list, deciders: list) -> None:
        self.clients, self.deadline, self.hit_ratio = clients, deadline, hit_ratio
        self.hit_keys, self.batch, self.pod = hit_keys, batch, pod
        self.stubs, self.deciders = stubs, deciders
        self.latencies: list[float] = []
        self.decisions: dict[str, int] = {}
        self.by_decision: dict[str, list[float]] = {}
        self.errors = 0
        self.counter = 0
        self.asked = [0] * clients
        self.sent: set[asyncio.Task] = set()

    def keys_for(self, rng: random.Random, i: int) -> list[str]:
        if self.pod:
            self.asked[i] += self.batch
            return [f"pod-{j}" for j in range(self.asked[i] - self.batch, self.asked[i])]
        keys = []
        for _ in range(self.batch):
            if rng.random() < self.hit_ratio:
                keys.append(rng.choice(self.hit_keys))
            else:
                self.counter += 1
                keys.append(f"miss-{i}-{self.counter}")
        return keys

    async def one(self, i: int, keys: list[str]) -> None:
        # Each client is one process and names itself, as every worker's
        # requests do (host:pid).
        who = (pb.Requester(job="pod", process_id=i, designated_process=0, client=f"bench:{i}")
               if self.pod else pb.Requester(client=f"bench:{i}"))
        requests = [pb.AcquireRequest(key=k, requester=who) for k in keys]
        t0 = time.perf_counter()
        stub = self.stubs[i % len(self.stubs)]
        try:
            if self.deciders:
                got = await self.deciders[i % len(self.deciders)].decide(requests)
            elif self.batch == 1:
                got = [await stub.Acquire(requests[0], timeout=60)]
            else:
                resp = await stub.AcquireMany(pb.AcquireManyRequest(requests=requests),
                                              timeout=60)
                got = list(resp.responses)
        except (grpc.aio.AioRpcError, UpstreamError):  # a call's, or a Decider's
            self.errors += 1
            return
        self.latencies.append(time.perf_counter() - t0)
        for r in got:
            name = pb.Decision.Name(r.decision)
            self.decisions[name] = self.decisions.get(name, 0) + 1
        if len(got) == 1:  # a single-key request: its latency by its decision
            self.by_decision.setdefault(name, []).append(self.latencies[-1])

    async def client(self, i: int) -> None:
        rng = random.Random(i)
        while time.monotonic() < self.deadline:
            await self.one(i, self.keys_for(rng, i))

    async def arrivals(self, rate: float) -> None:
        """One Poisson schedule for all clients (1,000 sleeping coroutines would
        cost the load generator more than the requests): each arrival goes to
        a random client; arrivals due within a millisecond leave together."""
        rng = random.Random(0)
        due = time.monotonic()
        while due < self.deadline:
            due += rng.expovariate(rate)
            if due - time.monotonic() > 1e-3:
                await asyncio.sleep(due - time.monotonic())
            i = rng.randrange(self.clients)
            task = asyncio.create_task(self.one(i, self.keys_for(rng, i)))
            self.sent.add(task)
            task.add_done_callback(self.sent.discard)


async def load(target: str, clients: int, seconds: float, hit_ratio: float,
               hit_keys: list[str], batch: int, streams: int = 0, rate: float = 0.0,
               pod: bool = False, gap_s: float = GAP_S
               ) -> tuple[list[float], dict[str, int], int, float, dict[str, list[float]], int]:
    """Closed loop (rate 0): every client asks again as soon as it is answered.
    Open loop (rate > 0): the clients together ask `rate` times a second
    (Poisson arrivals), whether or not earlier requests were answered.
    streams > 0: requests go over that many Decide streams (compilecast's
    Decider, as a worker sends them), else one unary call each.
    pod: the clients are the processes of one job (process 0 designated), and
    each asks the programs pod-0, pod-1, ... in turn, as the hosts of a pod do
    at job start: one COMPILE per program, WAIT for everyone else.
    Returns latencies, decisions by kind, errors, the wall time, and the
    latencies of single-key requests by their decision, and the Decide
    messages written (requests coalesce into fewer under load)."""
    opts = [("grpc.lb_policy_name", "round_robin"), ("grpc.use_local_subchannel_pool", 1)]
    channels = [grpc.aio.insecure_channel(target, options=opts) for _ in range(8)]
    stubs = [rpc.CompileCacheStub(c) for c in channels]
    deciders = [Decider(stubs[i % len(stubs)], timeout_s=60, gap_s=gap_s) for i in range(streams)]
    # Workers keep their streams open: open them before the clock starts.
    await asyncio.gather(*(d.decide([pb.AcquireRequest(key=hit_keys[0])]) for d in deciders))
    t_start = time.monotonic()
    run = _Load(clients, t_start + seconds, hit_ratio, hit_keys, batch, pod, stubs, deciders)
    if rate > 0:
        await run.arrivals(rate)
    else:
        await asyncio.gather(*(run.client(i) for i in range(clients)))
    if run.sent:
        await asyncio.wait(set(run.sent), timeout=60)
    wall = time.monotonic() - t_start
    messages = sum(d.messages for d in deciders)
    for d in deciders:
        await d.close()
    for c in channels:
        await c.close()
    return run.latencies, run.decisions, run.errors, wall, run.by_decision, messages


def go_load(binary: Path, targets: list[str], args, hit_keys: list[str]) -> dict:
    """One run of the Go load generator (on CPU 1 with --pin); its JSON row."""
    cmd = [str(binary), "-target", ",".join(targets), "-clients", str(args.clients),
           "-streams", str(args.streams or 8), "-rate", str(args.rate),
           "-seconds", str(args.seconds), "-hit-ratio", str(args.hit_ratio),
           "-hit-keys", ",".join(hit_keys), f"-bundles={str(not args.no_bundles).lower()}",
           f"-gap={args.gap_ms}ms", "-components", str(args.components),
           "-components-hits-every", str(args.components_hits_every)]
    pinned = (lambda: os.sched_setaffinity(0, {1})) if args.pin else None
    done = subprocess.run(cmd, capture_output=True, text=True, preexec_fn=pinned)
    if done.returncode != 0:
        sys.exit(f"the Go load generator failed ({done.returncode}): {done.stderr.strip()}")
    return json.loads(done.stdout)


def go_report(what: str, row: dict, used: dict[str, float], args) -> None:
    """Print a Go load generator's row (the cores each process used in it)."""
    used["load generator"] = row.pop("load_generator_cores")
    row.update({"clients": args.clients, "offered_rate": args.rate, "cores": used,
                "load_generator": "go",
                "coordinator_us_per_decision": coordinator_us_per_decision(
                    used, row["per_second"])})
    print(f"{args.clients} clients, {what}, Go load generator, {args.streams or 8} Decide "
          f"stream(s), offered {args.rate:.0f}/s: {row['per_second']:.0f} decisions/s, request "
          f"latency p50 {row['p50_ms']:.1f} ms, p99 {row['p99_ms']:.1f} ms, errors "
          f"{row['errors']}, {row['by_decision']}; {fmt_cores(used)} "
          f"(coordinator {row['coordinator_us_per_decision']:.0f} us CPU a decision); "
          f"{row['stream_messages'] / max(row['requests'], 1):.2f} stream messages and "
          f"{row['answer_messages'] / max(row['requests'], 1):.2f} answer messages per request"
          + (f"; the coordinator asked for gaps up to {row['advised_gap_ms_max']:.0f} ms"
             if row.get("advised_gap_ms_max") else ""))
    print_by_decision(row["p50_p99_ms_by_decision"])
    print_side(row.get("coordinator_side_ms", {}))
    if "etcd_wal_fsync" in row:
        print("  " + fmt_fsyncs(row["etcd_wal_fsync"]))
    print(json.dumps(row))


# The coordinator's own histograms (docs/operations.md): decisions it could
# not answer from memory, and its etcd requests by method.
# The coordinators' own histograms the report reads (and how it names them).
_COORDINATOR_SIDE = (("compilecast_coordinator_etcd_decision_seconds", "decided via etcd"),
                     ("compilecast_coordinator_etcd_request_seconds", "etcd"),
                     ("compilecast_coordinator_gc_pause_seconds", "GC pause, generation"))


def side_scrape(ports: list[int]) -> dict:
    """The coordinators' histograms of _COORDINATOR_SIDE now (bucket counts
    summed over the replicas), for coordinator_side."""
    out: dict = {name: {} for name, _ in _COORDINATOR_SIDE}
    for text in map(metrics_text, ports):  # each replica's page, once
        for name, summed in out.items():
            for k, v in histogram(text, name).items():
                summed[k] = summed.get(k, 0.0) + v
    return out


def coordinator_side(before: dict, after: dict) -> dict[str, list[float | None]]:
    """p50 and p99 (ms, as fine as the buckets) of what the coordinators'
    histograms counted between two scrapes: 'decided via etcd compile',
    'etcd Txn', 'GC pause, generation 2' and so on, with how many they counted."""
    out = {}
    for name, what in _COORDINATOR_SIDE:
        series = sorted({rest for rest, _ in after[name]})
        for rest in series:
            inf = (rest, float("inf"))
            n = after[name].get(inf, 0.0) - before[name].get(inf, 0.0)
            if n <= 0:
                continue
            value = rest.split("=", 1)[1].strip('"')
            qs = [histogram_quantile(q, before[name], after[name], rest) for q in (0.5, 0.99)]
            out[f"{what} {value}"] = [*(None if v is None else v * 1e3 for v in qs), n]
    return out


def print_side(side: dict[str, list[float | None]]) -> None:
    if side:
        print("  coordinator side, p50 / p99 from its histograms (bucket-interpolated): " +
              ", ".join(f"{k} {a:.1f} / {b:.1f} ms ({n:.0f})" for k, (a, b, n) in side.items()))


def print_by_decision(quantiles: dict[str, tuple[float, float]]) -> None:
    print("  p50 / p99 by decision: " + ", ".join(
        f"{k} {a:.1f} / {b:.1f} ms" for k, (a, b) in quantiles.items()))


def quantiles_ms(values: list[float]) -> tuple[float, float]:
    values = sorted(values)
    return values[len(values) // 2] * 1e3, values[int(len(values) * 0.99)] * 1e3


def pin(pid: int, cpus: set[int]) -> None:
    """Every thread of `pid` (and the threads they start later) on `cpus`."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except ProcessLookupError:  # a thread that ended since the listing
            pass


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", type=int, default=1000)
    ap.add_argument("--seconds", type=float, default=15)
    ap.add_argument("--hit-ratio", type=float, default=0.5)
    ap.add_argument("--replicas", type=int, default=1)
    ap.add_argument("--batch", type=int, default=1, help="keys per request (AcquireMany)")
    ap.add_argument("--streams", type=int, default=0,
                    help="send over this many Decide streams (0: one unary call per request)")
    ap.add_argument("--pod", action="store_true",
                    help="the clients are one job's processes asking the same programs in turn")
    ap.add_argument("--rate", type=float, default=0.0,
                    help="open loop: requests per second from all clients together "
                         "(0: closed loop, each client asks again when answered)")
    ap.add_argument("--pin", action="store_true",
                    help="the coordinator replicas on CPU 0, etcd and the load generator on "
                         "CPU 1 (as with the load generator on another machine)")
    ap.add_argument("--gap-ms", type=float, default=GAP_S * 1000,
                    help="at least this long between two messages of a Decide stream (what "
                         "arrives meanwhile coalesces; default: the Decider's own, 0: none)")
    ap.add_argument("--busy-gap-ms", type=float, default=CoordinatorConfig.decide_busy_gap_ms,
                    help="the coordinator's decide_busy_gap_ms: the longest gap it asks of "
                         "the streams while busy (0: it never asks)")
    ap.add_argument("--components", type=int, default=0,
                    help="with --loadgen go: key components (and a program name) each request "
                         "carries, as the JAX integration's do (11 there); the coordinator "
                         "records them on a miss")
    ap.add_argument("--components-hits-every", type=int, default=1, metavar="K",
                    help="with --components: a HIT request carries them from one client in K "
                         "(a job's lowest-id process; the JAX integration's other processes "
                         "leave them out); misses always carry them (default 1: every request)")
    ap.add_argument("--loadgen", choices=("python", "go"), default="python",
                    help="go: the open-loop Decide load from bench/loadgen (needs --rate)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="this many runs, each on a fresh etcd and coordinator, and how many "
                         "held p99 under 20 ms")
    ap.add_argument("--no-bundles", action="store_true",
                    help="with --loadgen go: each answer a message of its own (no takes_bundles)")
    ap.add_argument("--ceiling", action="store_true",
                    help="load a trivial grpc.aio server that answers HIT (gRPC's own ceiling)")
    args = ap.parse_args()
    if args.loadgen == "go" and (args.rate <= 0 or args.pod or args.batch != 1):
        ap.error("--loadgen go offers open-loop single-key Decide load: give --rate, "
                 "and no --pod or --batch")
    if args.components_hits_every < 1:
        ap.error("--components-hits-every must be at least 1")
    binary = go_built() if args.loadgen == "go" else None
    if args.ceiling:
        port = free_port()
        server = subprocess.Popen([sys.executable, str(Path(__file__).parent /
                                                       "_trivial_server.py"), str(port)])
        try:
            wait_port(port)
            if args.pin:
                pin(server.pid, {0})
            if binary is not None:
                go_report("trivial grpc.aio server", *cores(
                    {"server": server.pid},
                    lambda: go_load(binary, [f"127.0.0.1:{port}"], args, ["k"])), args)
                return
            (_lat, decisions, errors, wall, _, _), used = cores(
                {"server": server.pid}, lambda: asyncio.run(load(
                    f"127.0.0.1:{port}", args.clients, args.seconds, 1.0, ["k"], 1,
                    args.streams, args.rate, gap_s=args.gap_ms / 1000)))
        finally:
            server.terminate()
            server.wait()
        print(f"{args.clients} clients, trivial grpc.aio server: "
              f"{sum(decisions.values()) / wall:.0f} requests/s, errors {errors}; "
              f"{fmt_cores(used)}")
        return
    rows = [on_a_fresh_stack(args, binary) for _ in range(args.repeat)]
    if args.repeat > 1:
        p99s = [r["p99_ms"] for r in rows]
        print(f"{args.repeat} runs, each on a fresh etcd and coordinator: p99 "
              + ", ".join(f"{p:.1f}" for p in p99s)
              + f" ms; under 20 ms in {sum(p < 20 for p in p99s)} of {args.repeat}; "
              "coordinator CPU a decision "
              + ", ".join(f"{r['coordinator_us_per_decision']:.0f}" for r in rows) + " us")


def on_a_fresh_stack(args, binary: Path | None) -> dict:
    """One run on its own etcd and coordinator replicas; its row."""
    root = Path(tempfile.mkdtemp(prefix="cc-decisions-"))
    stack = Stack(root)
    try:
        store = root / "shared-store"
        extra = ("--decide-busy-gap-ms", str(args.busy_gap_ms))
        mports = [free_port() for _ in range(args.replicas)]
        started = [stack.coordinator(f"c{i}", store=store,
                                     extra=(*extra, "--metrics-port", str(mports[i])))
                   for i in range(args.replicas)]
        targets = [t for t, _ in started]
        pids = {"etcd": stack.procs[0].pid}
        pids.update({f"coordinator {i}": p.pid for i, (_, p) in enumerate(started)})
        if args.pin:
            for name, pid in pids.items():
                pin(pid, {0} if name.startswith("coordinator") else {1})
            pin(os.getpid(), {1})
        c = CacheClient(targets[0])
        hit_keys = []
        for i in range(200):
            key = f"hit-{i}"
            c.publish(key, c.acquire(key).lease, f"artifact {i}".encode() * 100, 1.0)
            hit_keys.append(key)
        c.close()
        fsyncs_before = wal_fsyncs(stack.etcd)
        side_before = side_scrape(mports)
        if binary is not None:
            row, used = cores(pids, lambda: go_load(binary, targets, args, hit_keys))
            row["replicas"] = args.replicas
            row["coordinator_side_ms"] = coordinator_side(side_before, side_scrape(mports))
            row["etcd_wal_fsync"] = fsync_summary(fsyncs_before, wal_fsyncs(stack.etcd))
            go_report(f"{args.replicas} replica(s)", row, used, args)
            return row
        # Several replicas: clients spread over them (one ipv4: target per replica).
        target = "ipv4:" + ",".join(targets) if len(targets) > 1 else targets[0]
        (lat, decisions, errors, wall, by_decision, messages), used = cores(pids, lambda: asyncio.run(
            load(target, args.clients, args.seconds, args.hit_ratio, hit_keys, args.batch,
                 args.streams, args.rate, args.pod, args.gap_ms / 1000)))
        fsyncs = fsync_summary(fsyncs_before, wal_fsyncs(stack.etcd))
        side = coordinator_side(side_before, side_scrape(mports))
        n = len(lat)
        p50, p99 = quantiles_ms(lat)
        total = sum(decisions.values())
        row = {"clients": args.clients, "replicas": args.replicas, "batch": args.batch,
               "streams": args.streams, "offered_rate": args.rate,
               "requests": n, "decisions": total, "stream_messages": messages,
               "per_second": total / wall, "p50_ms": p50, "p99_ms": p99, "errors": errors,
               "by_decision": decisions, "cores": used, "etcd_wal_fsync": fsyncs,
               "coordinator_us_per_decision": coordinator_us_per_decision(used, total / wall),
               "p50_p99_ms_by_decision": {k: quantiles_ms(v) for k, v in by_decision.items()},
               "coordinator_side_ms": side}
        how = ("one job, same programs, " if args.pod else "") + (
            f"{args.streams} Decide stream(s)" if args.streams else "unary calls") + (
            f", offered {args.rate:.0f}/s" if args.rate else ", closed loop")
        print(f"{args.clients} clients, {args.replicas} replica(s), batch {args.batch}, {how}: "
              f"{row['per_second']:.0f} decisions/s, request latency p50 {row['p50_ms']:.1f} ms, "
              f"p99 {row['p99_ms']:.1f} ms, "
              f"errors {errors}, {decisions}; {fmt_cores(used)} (coordinator "
              f"{row['coordinator_us_per_decision']:.0f} us CPU a decision)" +
              (f"; {messages / max(n, 1):.2f} stream messages per request" if messages else ""))
        if by_decision:
            print_by_decision(row["p50_p99_ms_by_decision"])
        print_side(side)
        print("  " + fmt_fsyncs(fsyncs))
        print(json.dumps(row))
        return row
    finally:
        stack.close()


if __name__ == "__main__":
    main()
