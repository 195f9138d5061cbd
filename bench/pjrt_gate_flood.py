"""The PJRT gate under a flood: does it keep serving the host's real jobs?

One etcd, coordinator and worker. An attacker process on the host opens
`--idle` connections to the worker's PJRT gate and sends nothing, `--slow`
connections that send a byte every 5 s, and `--huge` requests that announce
an 8 GiB program and then stop. Meanwhile a JAX training step runs on XLA's
CPU PJRT plugin through the interposer (tests/pjrt_proc.py), and the
worker's Status is asked every 0.5 s.

Printed: how many of the attacker's connections the gate took, how the JAX
process's compiles were answered (HIT/COMPILE, or LOCAL and why), whether
its loss equals the plain plugin's, the Status calls (answered, failed with
which code), and the worker's peak RSS before and during the flood.

    python bench/pjrt_gate_flood.py --idle 10000 --slow 50 --huge 4
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from _servers import Stack, line_of, peak_rss_mb

from compilecast.cli.run import interposer_path
from compilecast.worker.inprocess.client import CacheClient

PROC = Path(__file__).resolve().parent.parent / "tests" / "pjrt_proc.py"

ATTACKER = r"""
import resource, socket, sys, time
path, idle, slow, huge = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
held, opened = [], 0
for i in range(idle + slow + huge):
    s = socket.socket(socket.AF_UNIX)
    try:
        s.connect(path)
    except OSError:
        continue
    opened += 1
    if i >= idle + slow:  # a header, then an 8 GiB program announced, then nothing
        head = b'{"op":"compile","format":"mlir","platform":"cpu"}'
        s.sendall(b"CCP2" + len(head).to_bytes(4, "little") + head + bytes([6])
                  + (8 << 30).to_bytes(8, "little"))
    held.append((s, idle <= i < idle + slow))
print(opened, flush=True)
end = time.monotonic() + float(sys.argv[5])
while time.monotonic() < end:
    for s, is_slow in held:
        if is_slow:
            try:
                s.send(b"C")
            except OSError:
                pass
    time.sleep(5)
"""


def env(worker: str | None, plugin: str) -> dict:
    e = {k: v for k, v in os.environ.items() if not k.startswith(("COMPILECAST_", "JAX_"))}
    e.update(PJRT_PLUGIN_PATH=interposer_path() if worker else plugin,
             COMPILECAST_PJRT_PLUGIN=plugin, COMPILECAST_PJRT_LOG="1")
    if worker:
        e["COMPILECAST_WORKER"] = worker
    return e


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--idle", type=int, default=10_000)
    ap.add_argument("--slow", type=int, default=50)
    ap.add_argument("--huge", type=int, default=4)
    args = ap.parse_args()
    import lammps_jax_pjrt_cpu

    plugin = str(Path(lammps_jax_pjrt_cpu.__file__).with_name("pjrt_c_api_cpu_plugin.so"))
    root = Path(tempfile.mkdtemp(prefix="cc-gate-flood-"))
    stack = Stack(root)
    try:
        coordinator, _ = stack.coordinator()
        worker, worker_proc = stack.worker(coordinator, "w")
        gate = worker.removeprefix("unix://") + ".pjrt"
        plain = subprocess.run([sys.executable, str(PROC)], env=env(None, plugin),
                               capture_output=True, text=True, timeout=300)
        loss = json.loads(plain.stdout.strip().splitlines()[-1])["loss"]
        rss_before = peak_rss_mb(worker_proc.pid)
        attacker = subprocess.Popen(
            [sys.executable, "-c", ATTACKER, gate, str(args.idle), str(args.slow),
             str(args.huge), "120"], stdout=subprocess.PIPE, text=True)
        opened = int(line_of(attacker) or 0)
        statuses: dict[str, int] = {}
        stop = threading.Event()

        def ask_status() -> None:
            client = CacheClient(worker, timeout_s=10)
            while not stop.is_set():
                try:
                    client.status()
                    how = "OK"
                except Exception as exc:  # the code is the figure
                    code = getattr(exc, "code", None)
                    how = getattr(code(), "name", "?") if callable(code) else type(exc).__name__
                statuses[how] = statuses.get(how, 0) + 1
                stop.wait(0.5)

        poller = threading.Thread(target=ask_status, daemon=True)
        poller.start()
        job = subprocess.run([sys.executable, str(PROC)], env=env(worker, plugin),
                             capture_output=True, text=True, timeout=600)
        stop.set()
        poller.join()
        rss_during = peak_rss_mb(worker_proc.pid)
        attacker.kill()
        attacker.wait()
        answers = re.findall(r"compilecast-pjrt\[\d+\]: worker: (\w+)", job.stderr)
        local = re.findall(r"real compile \((LOCAL [^)]*)\)", job.stderr)
        got = json.loads(job.stdout.strip().splitlines()[-1])["loss"] if job.returncode == 0 \
            else None
        print(f"pjrt_gate_flood: attacker opened {opened} connections ({args.idle} idle, "
              f"{args.slow} slow, {args.huge} announcing 8 GiB)")
        print(f"  the JAX job's compiles: {len(answers)} answered "
              f"{ {a: answers.count(a) for a in sorted(set(answers))} }, "
              f"{len(local)} compiled locally {sorted(set(local))[:3]}; "
              f"loss equal to the plain plugin's: {got == loss}")
        print(f"  worker Status during the flood: {statuses}")
        print(f"  worker peak RSS: {rss_before:.0f} MB before, {rss_during:.0f} MB after")
    finally:
        stack.close()


if __name__ == "__main__":
    main()
