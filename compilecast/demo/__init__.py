"""`make demo`: `compilecast up`, then JAX processes that start the same
training step at the same moment, twice; prints what compiled, what was
shared, and the metrics.

    python -m compilecast.demo [--processes 4] [--layers 160] [--width 512]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

from compilecast.launch import SHARE_ANY_COMPILE, Up, collect, start_wave


def role(r: dict) -> str:
    """What a process of a wave did."""
    cc = r["compilecast"]
    if not cc:
        return "compiled itself"
    if cc.get("published"):
        return "compiled and published"
    if cc.get("hits") and cc.get("waits"):
        return "waited, loaded the shared executable"
    if cc.get("hits"):
        return "hit the cache"
    return "compiled locally"


def scrape(port: int, prefix: str) -> list[str]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return [line for line in text.splitlines()
            if line.startswith(prefix) and "_bucket" not in line
            and "_created" not in line and not line.endswith(" 0.0")]


def run_wave(label: str, n: int, target: str, args, ref: dict | None, **kw) -> list[dict]:
    """`n` processes that start the step together; prints each and the total."""
    print(f"\n[{label}] {n} JAX processes start the {args.layers}-layer width-{args.width} "
          f"training step at once" + (" without compilecast" if kw.get("baseline") else ""))
    reports = collect(start_wave(n, target, args.layers, args.width, **kw))
    ref = ref or reports[0]
    for i, r in enumerate(reports):
        same = "identical" if r["digest"] == ref["digest"] else "DIFFERENT"
        print(f"  process {i}: {role(r):40s} {r['seconds']:6.2f}s  XLA compiles: "
              f"{r['xla_compiles']}  result {same}")
    compiles = sum(r["xla_compiles"] for r in reports)
    shared = sum(r["compilecast"].get("hits", 0) for r in reports)
    alike = all(r["digest"] == ref["digest"] for r in reports)
    print(f"  => {compiles} XLA compile(s), {shared} process(es) loaded a shared executable, "
          f"slowest process {max(r['seconds'] for r in reports):.2f}s, results "
          f"{'all identical' if alike else 'DIFFER'}")
    return reports


def compared(label: str, seconds: float, base: float) -> str:
    """What one run's time was against the run without compilecast, in words
    that follow from the two figures."""
    ratio = seconds / base
    if ratio < 0.95:
        return f"{label}: {ratio:.2f}x the time without compilecast ({base - seconds:.2f}s less)"
    if ratio > 1.05:
        return f"{label}: {ratio:.2f}x the time without compilecast ({seconds - base:.2f}s more)"
    return f"{label}: about the time without compilecast ({ratio:.2f}x)"


def summary(rounds: list[tuple[str, list[dict]]]) -> None:
    print("\n[summary] the same measurement each time: from the common start to the first "
          "step's result, slowest process")
    slowest = {label: max(r["seconds"] for r in reports) for label, reports in rounds}
    compiles = {label: sum(r["xla_compiles"] for r in reports) for label, reports in rounds}
    for label, _ in rounds:
        print(f"  {label:28s} {compiles[label]} XLA compile(s)  {slowest[label]:6.2f}s")
    (base_label, _), *others = rounds
    base = slowest[base_label]
    for label, _ in others:
        print("  " + compared(label, slowest[label], base))
    saved = compiles[base_label] - min(compiles[label] for label, _ in others)
    print(f"compilecast saved up to {saved} of {compiles[base_label]} XLA compiles a run. A "
          "compile of this step takes seconds on CPU; on TPU and GPU it takes minutes, and "
          "each\ncompile saved is that time saved on every host (BENCHMARKS.md).")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--processes", type=int, default=4)
    ap.add_argument("--layers", type=int, default=160)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--home", help="data directory for `compilecast up` (default: a temp dir)")
    args = ap.parse_args(argv)

    home = Path(args.home or tempfile.mkdtemp(prefix="compilecast-demo-"))
    home.mkdir(parents=True, exist_ok=True)
    print(f"$ compilecast up --home {home}")
    up = Up(home)
    ports, target = up.ports, up.target
    n = args.processes
    try:
        up.start()
        base = run_wave("baseline", n, target, args, None, baseline=True)
        cold = run_wave("wave 1", n, target, args, base[0], env=SHARE_ANY_COMPILE)
        warm = run_wave("wave 2", n, target, args, base[0], env=SHARE_ANY_COMPILE)
        print("\n[status] compilecast status")
        subprocess.run([sys.executable, "-m", "compilecast.cli", "status", "--worker", target],
                       check=False)
        print("\n[metrics] coordinator")
        for line in scrape(ports["coordinator-metrics-port"], "compilecast_coordinator_"):
            print("  " + line)
        print("[metrics] worker")
        for line in scrape(ports["worker-metrics-port"], "compilecast_worker_"):
            print("  " + line)
        summary([("without compilecast", base), ("compilecast, first run", cold),
                 ("compilecast, a restart", warm)])
    finally:
        if up.proc is not None:
            up.stop()
        print("compilecast up stopped")
    return 0

