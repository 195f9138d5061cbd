"""How long an OpenTelemetry collector that never answers holds a traced
process at its exit, and a stop (tracing.shutdown) in process.

    python bench/tracing_exit.py [--repeat 3] [--against REV]

A collector of the bench's own takes each connection and never answers. A
fresh process traces one span to it and exits; the bench times the whole
process, and in a second process the stop alone. With --against REV the
same runs go through compilecast/tracing.py as it was at REV (git show),
side by side. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CHILD = r"""
import importlib.util, sys, time
spec = importlib.util.spec_from_file_location("cc_tracing", sys.argv[1])
tracing = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tracing)
assert tracing.configure(sys.argv[2], "bench-exit")
with tracing.span("one"):
    pass
if sys.argv[3] == "stop":
    start = time.perf_counter()
    tracing.shutdown()
    print(time.perf_counter() - start, flush=True)
"""


def run(module: Path, endpoint: str, what: str) -> float:
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", CHILD, str(module), endpoint, what],
                         capture_output=True, text=True, timeout=120, check=True)
    took = time.perf_counter() - start
    return float(out.stdout.strip().splitlines()[-1]) if what == "stop" else took


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--against", default="", help="a git revision to run side by side")
    args = ap.parse_args()
    modules = {"now": ROOT / "compilecast" / "tracing.py"}
    tmp = Path(tempfile.mkdtemp(prefix="cc-tracing-"))
    if args.against:
        old = tmp / "tracing_old.py"
        old.write_text(subprocess.run(["git", "-C", str(ROOT), "show",
                                       f"{args.against}:compilecast/tracing.py"],
                                      capture_output=True, text=True, check=True).stdout)
        modules[args.against[:10]] = old
    with socket.socket() as server:  # connections wait in its backlog, never answered
        server.bind(("127.0.0.1", 0))
        server.listen(64)
        endpoint = f"http://127.0.0.1:{server.getsockname()[1]}"
        result = {}
        for name, module in modules.items():
            exits = sorted(run(module, endpoint, "exit") for _ in range(args.repeat))
            stops = sorted(run(module, endpoint, "stop") for _ in range(args.repeat))
            result[name] = {"process_exit_s": [round(t, 2) for t in exits],
                            "stop_s": [round(t, 2) for t in stops]}
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
