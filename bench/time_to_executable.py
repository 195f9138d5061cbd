"""Time to executable on N processes: compilecast (cold) against every
process compiling on its own, side by side in one run.

    python bench/time_to_executable.py [--n 4 16] [--layers 160] [--width 512]

For each N it starts N JAX processes that begin the same training step at the
same moment and reports XLA compiles per program and the wall time from the
common start until the last process holds its executable (its first step
done). Then the same for a real 4-process jax.distributed job.
On CPU a compile of this step is a small part of its first step's time, so
these runs show the protocol's overhead and compile counts, not TPU savings.

    python bench/time_to_executable.py --tpu v5e:4x4 [--n 4 16] [--layers 64] [--width 1024]
                                       [--tpu-weights] [--tpu-after] [--tpu-pairs K]
                                       [--tpu-one-host] [--drop-caches]
                                       [--hold-page-reporting] [--host-cpus C]

does the same with a real TPU program: each of N processes (one jax.distributed
job, as the hosts of a pod) lowers the training step for TOPOLOGY with libtpu's
compile-only client; after a common start (once all have started and lowered)
one compiles and publishes, the others wait and then fetch and verify the
bytes (a compile-only client cannot load an executable). Reported against one
process compiling the program alone, from the same kind of common start: with
--tpu-pairs, process 0 of the same N-process job compiling while the others
idle (a job of one process, --tpu-alone-job, compiles the same program ~10 %
faster here; BENCHMARKS.md, "Time to executable on N processes"). With
--tpu-weights the weights are baked in (default 16 layers: an ~80 MB executable
that every waiter fetches). With --tpu-one-host the N processes are those of
one host (a GPU host's 8) and go through one worker, as a host's processes do;
COMPILECAST_LOCAL_FILES=0 makes them take the bytes over its socket instead of
reading its host cache's file. With --tpu-host-workers each process goes
through a worker of its own, as on a pod's hosts: the holder publishes through
its worker, and each waiter's worker downloads the executable while the
process follows its host cache's file. --drop-caches (root) drops the page
cache before each run, so that runs start alike (each run's JSON records the
page cache at its start). --hold-page-reporting (root, a VM whose balloon
reports free pages) stops the guest's free page reporting for the runs and
backs its free memory again first: fresh memory then costs what it costs on a
host without it (BENCHMARKS.md, "Time to executable on N processes"). --host-cpus C (root,
cgroup v1) gives every process C cores of its own from the common start on (a
CPU quota each, bench/_netem.py), as each host of a pod has its own cores,
scaled down so that N hosts fit in this machine's: the compile alone runs on
one such host too, and the compile lease's TTL (10 s) grows by as much as the
cores shrink. The coordinator and etcd take what is left.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from _servers import HOLD_PAGE_REPORTING_HELP, page_reporting_held, page_reporting_order

from compilecast.launch import SHARE_ANY_COMPILE, Up, collect, start_wave


def wave(n: int, target: str, layers: int, width: int, *, baseline: bool,
         distributed: bool = False) -> dict:
    # Every process imports JAX before the common start (2 cores: ~1.5 s of import each).
    reports = collect(start_wave(n, target, layers, width, baseline=baseline,
                                 distributed=distributed, delay_s=max(8.0, 1.5 * n),
                                 env=SHARE_ANY_COMPILE, phases=not baseline),
                      timeout_s=1800)
    # Each process measured from the common start moment to its executable.
    return {
        "n": n,
        "mode": "baseline" if baseline else "compilecast",
        "xla_compiles": sum(r["xla_compiles"] for r in reports),
        "wall_s": max(r["seconds"] for r in reports),
        "median_s": sorted(r["seconds"] for r in reports)[n // 2],
        "latest_start_s": max(r.get("late_s", 0.0) for r in reports),
        **({} if baseline else {"timeline": timeline([r["phases"] for r in reports])}),
    }


def timeline(phases: list[dict[str, float]]) -> str:
    """Where a compilecast run's time went, from its processes' call times
    (seconds from the common start): the holder's compile and publish, then
    when the last waiter was woken and when the last one held the bytes."""
    holder = next((p for p in phases if "publish began" in p), {})
    # A waiter holds the bytes when its fetch ends, or its wait, when they
    # came over the wait's connection (a data plane wait: no fetch).
    waiters = [p for p in phases if p is not holder and
               ("fetch ended" in p or "wait_and_fetch ended" in p)]
    if not holder or not waiters:
        return "(no holder and waiters to time)"
    compiled, published = holder["publish began"], holder["publish ended"]
    fetched = [p for p in waiters if "fetch began" in p]
    woken = (f"last woken {max(p['fetch began'] for p in fetched):.2f}s, " if fetched else
             "woken with the bytes (data plane waits), ")
    held = sorted(max(p.get("fetch ended", 0.0), p.get("wait_and_fetch ended", 0.0))
                  for p in waiters)
    done = held[-1]
    compiling = ""
    # The holder's compile: JAX's compile and its serialization (--tpu), or the
    # compile under the lease (the demo step's processes).
    entry = next((n for n in ("compile_entry", "compile") if f"{n} began" in holder), None)
    if entry is not None:
        began, ended = holder[f"{entry} began"], holder[f"{entry} ended"]
        compiling = f"compile {began:.2f}-{ended:.2f}s ({ended - began:.2f}), "
    cpu = ""
    if fetched and len(fetched) == len(waiters):  # each waiter process's CPU while it fetched
        spent = sorted(p["fetch cpu"] for p in waiters)
        cpu = (f"; a fetch's process CPU {spent[0]:.2f}-{spent[-1]:.2f}s, median "
               f"{statistics.median(spent):.2f}s")
    elif all("wait_and_fetch cpu" in p for p in waiters):  # data plane waits: one call
        spent = sorted(p["wait_and_fetch cpu"] for p in waiters)
        cpu = (f"; a waiter's process CPU, waiting and fetching, {spent[0]:.2f}-{spent[-1]:.2f}s, "
               f"{sum(spent):.1f} CPU-s for all {len(spent)}")
    return (f"holder: {compiling}compiled {compiled:.2f}s, published {published:.2f}s "
            f"(+{published - compiled:.2f}); waiters: {woken}the first holds the bytes "
            f"+{held[0] - published:.2f}, the median +{statistics.median(held) - published:.2f}, "
            f"the last {done:.2f}s (+{done - published:.2f} after the publish; "
            f"{done / compiled:.2f}x the holder's own time to its executable){cpu}")


def page_cache_mb() -> int:
    """The page cache's size now (Cached in /proc/meminfo), in MB."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("Cached:"):
                return int(line.split()[1]) // 1024
    return 0


def drop_page_cache() -> None:
    """Write back and drop the clean page cache, so that every run starts
    with the machine's memory free. Needs root."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
    except OSError as exc:
        raise SystemExit(f"--drop-caches: cannot write /proc/sys/vm/drop_caches ({exc}); "
                         "run as root or leave the option out") from None


def tpu(topology: str, ns: list[int], layers: int, width: int, baseline_max: int,
        weights: bool, after: bool = False, pairs: int = 1, one_host: bool = False,
        alone_job: bool = False, host_workers: bool = False, drop_caches: bool = False,
        cgroups: list[Path] | None = None, host_cpus: float = 0.0) -> None:
    import aot_farm

    aot_farm.ENV.update(BENCH_LAYERS=str(layers), BENCH_WIDTH=str(width))
    entry = "aot_job:step_with_weights" if weights else "aot_job:step"
    what = "with its weights as constants" if weights else "weights as arguments"
    print(f"# the training step of {layers} layers x {width} ({what}) for {topology} "
          f"(compile-only), {os.cpu_count()} cores, page cache "
          f"{'dropped before each run' if drop_caches else f'{page_cache_mb()} MB at the start'}",
          flush=True)
    if cgroups:
        print(f"# every process a host of {host_cpus:g} cores of its own from the common start "
              f"(N = {max(ns)}: {host_cpus * max(ns):g} of this machine's {os.cpu_count()} cores; the "
              "coordinator and etcd take the rest)", flush=True)
    rows = []

    def run(mode: str, n: int) -> dict:
        # "share" streams uploads to the waiters (publish_stream_readers, off by default).
        flags = ("--publish-stream-readers", "4") if mode == "share" and after else ()
        if cgroups:
            # Time on a host of a fraction of a core runs slower by that
            # fraction: so does the lease's TTL (10 s on a whole core), or a
            # holder whose JAX holds the GIL for a second (serializing a big
            # executable) loses its lease midway.
            flags += ("--lease-ttl-s", str(round(10 / min(1.0, host_cpus))))
        if drop_caches:
            drop_page_cache()
        cache_at_start = page_cache_mb()
        with aot_farm.fresh_coordinator(*flags, one_host=one_host,
                                        host_workers=n if host_workers else 0) as coordinator:
            # Start-up, JAX import and lowering take ~2 s a process on 2 cores.
            r = aot_farm.pod(mode, coordinator, topology, n, entry=entry,
                             go_after_s=10.0 + 2.5 * n, cgroups=cgroups and cgroups[:n])
        rows.append(dict(r, mode=mode, n=n, page_cache_mb_at_start=cache_at_start,
                         page_reporting_order=page_reporting_order()))
        return r

    if pairs > 1:
        _tpu_pairs(run, ns, pairs, alone_job)
    else:
        _tpu_waves(run, rows, ns, after, baseline_max)
    print(json.dumps(rows))


def _tpu_pairs(run, ns: list[int], pairs: int, alone_job: bool) -> None:
    """A compile's time swings by 20 % from run to run here: each ratio from
    a compile alone and a compilecast run next to it, the order alternating."""
    for n in ns:
        ratios = []
        for k in range(pairs):
            # One compile: process 0 of the same N-process job compiling while the
            # others idle ("one"), or with alone_job a job of one process ("local").
            base = "local" if alone_job else "one"
            order = (base, "share") if k % 2 == 0 else ("share", base)
            got = {mode: run(mode, 1 if mode == "local" else n) for mode in order}
            got["local"] = got[base]
            ratios.append(got["share"]["ready"] / got["local"]["ready"])
            print(f"N={n:3d} pair {k + 1}: one compile alone "
                  f"({'a one-process job' if alone_job else 'in the job'}) "
                  f"{got['local']['ready']:.2f}s, "
                  f"compilecast {got['share']['compiles']} compile(s), all hold the verified "
                  f"bytes {got['share']['ready']:.2f}s = {ratios[-1]:.2f}x "
                  f"({'alone' if order[0] == base else 'compilecast'} ran first)",
                  flush=True)
            alone = next((p for p in got["local"]["phases"] if "compile_entry began" in p), {})
            if "compile_entry began" in alone:
                print(f"         alone: compile {alone['compile_entry began']:.2f}-"
                      f"{alone['compile_entry ended']:.2f}s", flush=True)
            print(f"         {timeline(got['share']['phases'])}", flush=True)
        print(f"N={n:3d}: {pairs} pairs, ratio median {statistics.median(ratios):.2f}x, "
              f"range {min(ratios):.2f}-{max(ratios):.2f}x", flush=True)


def _tpu_waves(run, rows: list[dict], ns: list[int], after: bool, baseline_max: int) -> None:
    one = run("local", 1)
    print(f"one process compiling alone: {one['ready']:.2f}s, "
          f"{one['bytes'] / 1e6:.0f} MB executable", flush=True)
    for i, n in enumerate(ns):
        # With --tpu-after, the two ways alternate which goes first (order effects).
        first_after = after and i % 2 == 0
        late_fetch = run("share-after", n) if first_after else None
        cc = run("share", n)
        if after and late_fetch is None:
            late_fetch = run("share-after", n)
        line = (f"N={n:3d}  compilecast: {cc['compiles']} compile(s), all hold the verified "
                f"bytes {cc['ready']:.2f}s = {cc['ready'] / one['ready']:.2f}x one compile alone")
        if late_fetch is not None:
            line += (f" | waiters fetching after the publish: {late_fetch['ready']:.2f}s = "
                     f"{late_fetch['ready'] / one['ready']:.2f}x"
                     f" ({'ran first' if first_after else 'ran second'})")
        if n <= baseline_max:
            base = run("local", n)
            line += (f" | every process compiles: {base['compiles']} compiles, "
                     f"{base['ready']:.2f}s ({cc['ready'] / base['ready']:.2f})")
        late = max(r["late"] for r in rows)
        print(f"{line} | latest process late for the common start by {late:.1f}s", flush=True)
        print(f"         {timeline(cc['phases'])}", flush=True)


def host_quotas(stack: contextlib.ExitStack, cpus: float, n: int) -> list[Path]:
    """n CPU quotas of `cpus` cores each, removed when `stack` closes."""
    from _netem import Quotas, quotas_available

    if why := quotas_available():
        raise SystemExit(f"--host-cpus: {why}")
    quotas = Quotas(cpus)
    stack.callback(quotas.close)
    return [quotas.quota(f"tte-{i}") for i in range(n)]


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, nargs="+", default=[4, 16])
    ap.add_argument("--layers", type=int, default=None,
                    help="default 160 on CPU, 64 with --tpu")
    ap.add_argument("--width", type=int, default=None, help="default 512 on CPU, 1024 with --tpu")
    ap.add_argument("--distributed", type=int, default=4)
    ap.add_argument("--tpu", metavar="TOPOLOGY",
                    help="a real TPU program for TOPOLOGY (e.g. v5e:4x4), compile-only")
    ap.add_argument("--tpu-baseline-max", type=int, default=4,
                    help="with --tpu, also run every-process-compiles up to this N (memory)")
    ap.add_argument("--tpu-after", action="store_true",
                    help="with --tpu, run the coordinator streaming uploads to 4 waiters "
                         "(--publish-stream-readers 4) and, side by side, waiters fetching "
                         "only after the publish (the default)")
    ap.add_argument("--tpu-pairs", type=int, default=1,
                    help="with --tpu, this many pairs per N of a compile alone and a compilecast "
                         "run next to it (order alternating), each pair's ratio and the median")
    ap.add_argument("--tpu-alone-job", action="store_true",
                    help="with --tpu-pairs, the compile alone is a job of one process; by "
                         "default it is process 0 of the same N-process job compiling while "
                         "the others idle")
    ap.add_argument("--tpu-one-host", action="store_true",
                    help="with --tpu, the N processes share one worker (one host's processes)")
    ap.add_argument("--tpu-host-workers", action="store_true",
                    help="with --tpu, each process goes through a worker of its own (a pod's "
                         "hosts)")
    ap.add_argument("--tpu-weights", action="store_true",
                    help="with --tpu, bake the weights into the program (a large executable)")
    ap.add_argument("--hold-page-reporting", action="store_true",
                    help="with --tpu, " + HOLD_PAGE_REPORTING_HELP)
    ap.add_argument("--host-cpus", type=float, default=0, metavar="C",
                    help="with --tpu, every process a host of C cores of its own from the "
                         "common start on (a CPU quota each; root, cgroup v1)")
    ap.add_argument("--drop-caches", action="store_true",
                    help="with --tpu, drop the page cache before each run (root), so that "
                         "runs start alike (BENCHMARKS.md, \"Time to executable on N processes\")")
    return ap


def _cpu_waves(args: argparse.Namespace) -> None:
    """Waves of JAX processes on CPU through `compilecast up`, against each
    process compiling."""
    args.layers, args.width = args.layers or 160, args.width or 512
    home = Path(tempfile.mkdtemp(prefix="cc-bench-")) / "up"
    home.mkdir()
    up = Up(home)
    up.start()
    target = up.target
    results = []
    try:
        (one,) = [wave(1, target, args.layers, args.width, baseline=True)]
        print(f"one compile alone: {one['wall_s']:.2f}s", flush=True)
        results.append(one)
        for i, n in enumerate(args.n):
            layers = args.layers + i + 1  # a fresh program per N: cold cache
            base = wave(n, target, layers, args.width, baseline=True)
            cc = wave(n, target, layers, args.width, baseline=False)
            results += [base, cc]
            print(f"N={n:3d}  baseline: {base['xla_compiles']} compiles, all ready "
                  f"{base['wall_s']:.2f}s | compilecast: {cc['xla_compiles']} compile(s), all "
                  f"ready {cc['wall_s']:.2f}s | ratio {cc['wall_s'] / base['wall_s']:.2f} | "
                  f"vs one compile alone {cc['wall_s'] / one['wall_s']:.2f}x | last process "
                  f"late by {max(base['latest_start_s'], cc['latest_start_s']):.1f}s",
                  flush=True)
            print(f"       compilecast's {cc['timeline']}; every step done "
                  f"{cc['wall_s']:.2f}s", flush=True)
        if args.distributed:
            n, layers = args.distributed, args.layers + 50
            base = wave(n, target, layers, args.width, baseline=True, distributed=True)
            cc = wave(n, target, layers, args.width, baseline=False, distributed=True)
            results += [dict(base, mode="baseline-distributed"),
                        dict(cc, mode="compilecast-distributed")]
            print(f"jax.distributed N={n}: baseline {base['xla_compiles']} compiles "
                  f"{base['wall_s']:.2f}s | compilecast {cc['xla_compiles']} compile(s) "
                  f"{cc['wall_s']:.2f}s | ratio {cc['wall_s'] / base['wall_s']:.2f}", flush=True)
    finally:
        up.stop()
        shutil.rmtree(home.parent, ignore_errors=True)
    print(json.dumps(results))



def main() -> None:
    args = _parser().parse_args()
    if args.tpu:
        held = page_reporting_held() if args.hold_page_reporting else contextlib.nullcontext()
        with held, contextlib.ExitStack() as quotas:
            cgroups = host_quotas(quotas, args.host_cpus, max(args.n)) if args.host_cpus else None
            tpu(args.tpu, args.n, args.layers or (16 if args.tpu_weights else 64),
                args.width or 1024, args.tpu_baseline_max, args.tpu_weights, args.tpu_after,
                args.tpu_pairs, args.tpu_one_host, args.tpu_alone_job, args.tpu_host_workers,
                args.drop_caches, cgroups, args.host_cpus)
        return
    _cpu_waves(args)


if __name__ == "__main__":
    main()
