"""Fan-out: N workers fetch the same artifact at once.

    python bench/fanout.py [--mb 256] [--workers 16] [--compressible]

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
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _servers import Stack, compressible_file, free_port, random_file, wait_port
from fetch import fetch, publish_file


def egress(metrics_port: int) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics").read().decode()
    m = re.search(r'compilecast_coordinator_artifact_bytes_total\{direction="out"\} (\S+)', text)
    return float(m.group(1)) if m else 0.0


def run(fanout: int, mb: int, n: int, compressible: bool = False) -> dict:
    root = Path(tempfile.mkdtemp(prefix="cc-fanout-"))
    stack = Stack(root)
    try:
        mport = free_port()
        coord, _ = stack.coordinator(extra=("--relay-fanout", str(fanout),
                                            "--metrics-port", str(mport)))
        wait_port(mport)
        path = root / "art.bin"
        (compressible_file if compressible else random_file)(path, mb << 20)
        digest = publish_file(coord, "art", path)
        path.unlink()
        alone, _ = stack.worker(coord, "alone")
        single = fetch(alone, "art", digest, zstd=compressible)
        workers = []
        for i in range(n):
            port = free_port()
            target, _ = stack.worker(coord, f"w{i}", extra=(
                "--relay-listen", f"127.0.0.1:{port}", "--relay-advertise", f"127.0.0.1:{port}"))
            workers.append(target)
        before = egress(mport)
        errors: list = []

        def one(t: str) -> None:
            try:
                fetch(t, "art", digest, zstd=compressible)
            except Exception as exc:  # reported below
                errors.append(exc)

        threads = [threading.Thread(target=one, args=(t,)) for t in workers]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        if errors:
            raise RuntimeError(errors[0])
        return {"single_s": single, "all_s": wall,
                "egress_x": (egress(mport) - before) / (mb << 20)}
    finally:
        stack.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=256)
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument("--compressible", action="store_true",
                    help="an artifact that compresses ~10x (as executables do), not random bytes")
    args = ap.parse_args()
    print(f"# {args.workers} workers fetch one {args.mb} MB "
          f"{'compressible ' if args.compressible else ''}artifact at once")
    for fanout in (0, 2):
        r = run(fanout, args.mb, args.workers, args.compressible)
        print(f"relay fan-out {fanout}: all {args.workers} hold it in {r['all_s']:6.1f}s "
              f"({r['all_s'] / r['single_s']:.1f}x one fetch alone, {r['single_s']:.2f}s); "
              f"coordinator egress {r['egress_x']:.1f}x the artifact", flush=True)


if __name__ == "__main__":
    main()
