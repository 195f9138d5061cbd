"""A storm of misses carrying key components: what recording them costs the
coordinator, and how long it goes on after the storm.

    python bench/miss_storm.py [--rate 1000] [--seconds 10] [--components 0 11]

For each component count in turn (0: requests carry none, so nothing is
recorded), on a fresh etcd and coordinator: the Go load generator
(bench/loadgen) asks `rate` new keys a second for `seconds`, every one a
miss (a compile lease). Then the coordinator's metrics are read until its
key records stop growing (misses_by_component, key_records_skipped). Prints
the coordinator's CPU seconds during the storm and in all, how long the
records went on after it, and how many keys went unrecorded.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _servers import Stack, cpu_seconds, free_port, go_built, scraped


def storm(binary: Path, components: int, rate: float, seconds: float) -> dict:
    root = Path(tempfile.mkdtemp(prefix="cc-storm-"))
    stack = Stack(root)
    try:
        port = free_port()
        target, proc = stack.coordinator("c", extra=("--metrics-port", str(port)))
        cpu0, t0 = cpu_seconds(proc.pid), time.monotonic()
        out = subprocess.run(
            [str(binary), "-target", target, "-rate", str(rate), "-seconds", str(seconds),
             "-hit-ratio", "0", "-hit-keys", "none", "-components", str(components)],
            capture_output=True, text=True, check=True)
        load = json.loads(out.stdout.strip().splitlines()[-1])
        storm_s, storm_cpu = time.monotonic() - t0, cpu_seconds(proc.pid) - cpu0

        def counted() -> tuple[float, float]:
            return (scraped(port, "compilecast_coordinator_misses_by_component_total"),
                    scraped(port, "compilecast_coordinator_key_records_skipped_total"))

        last, last_change = counted(), time.monotonic()
        while time.monotonic() - last_change < 3.0:  # records still growing: wait
            time.sleep(0.5)
            now = counted()
            if now != last:
                last, last_change = now, time.monotonic()
        after_s = max(last_change - t0 - storm_s, 0.0)
        return {"components": components, "misses": load["by_decision"].get("COMPILE", 0),
                "storm_s": storm_s, "coordinator_cpu_storm_s": storm_cpu,
                "coordinator_cpu_total_s": cpu_seconds(proc.pid) - cpu0,
                "records_went_on_s": after_s, "component_counts": last[0], "skipped": last[1],
                "p99_ms": load["p99_ms"]}
    finally:
        stack.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--rate", type=float, default=1000)
    ap.add_argument("--seconds", type=float, default=10)
    ap.add_argument("--components", type=int, nargs="+", default=[0, 11])
    args = ap.parse_args()
    binary = go_built()
    for n in args.components:
        row = storm(binary, n, args.rate, args.seconds)
        print(f"{row['misses']} misses at {args.rate:.0f}/s with {n} components: storm "
              f"{row['storm_s']:.1f} s (p99 {row['p99_ms']:.0f} ms); coordinator CPU "
              f"{row['coordinator_cpu_storm_s']:.1f} s during it, "
              f"{row['coordinator_cpu_total_s']:.1f} s in all; records went on "
              f"{row['records_went_on_s']:.1f} s after it; {row['skipped']:.0f} keys unrecorded",
              flush=True)
        print(json.dumps(row))


if __name__ == "__main__":
    main()
