#!/usr/bin/env python3
"""Does PyTorch/XLA on a TPU VM compile once through the PJRT interposer?

    python scripts/torchxla_tpu_check.py [--runs 2] [--worker unix:///path]

Run on a TPU VM with torch_xla and libtpu installed and a compilecast worker
on the host (`compilecast up &` on one VM is enough). It runs a small
training step in a fresh process --runs times, each time with torch_xla on
libtpu wrapped by the interposer, set up by the environment alone as
`compilecast run --interpose-tpu` does (the training code is untouched), and
prints per run what the interposer did
(COMPILE: compiled under the lease and published; HIT: loaded what an earlier
run published) and the loss. It passes (exit 0) when the first run compiled,
every later run compiled nothing, and the losses agree.

It checks one host; on a pod, run the same job on every host against the
pod's coordinator and compare the workers' `compilecast status` (one host
compiles each program). Not run by compilecast's CI: no TPU is there.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import textwrap

STEP = textwrap.dedent("""
    import json
    import torch
    import torch_xla.core.xla_model as xm

    dev = xm.xla_device()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(),
                                torch.nn.Linear(1024, 1)).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(64, 256).to(dev), torch.randn(64, 1).to(dev)
    for _ in range(3):
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        xm.mark_step()
    print(json.dumps({"loss": loss.item()}))
""")


def libtpu_path() -> str:
    import libtpu

    get = getattr(libtpu, "get_library_path", None)
    return get() if get else os.path.join(os.path.dirname(libtpu.__file__), "libtpu.so")


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--worker", default=os.environ.get("COMPILECAST_WORKER", ""))
    args = ap.parse_args()
    from compilecast.cli.run import interposer_path

    # What `compilecast run --interpose-tpu` sets: torch_xla loads its TPU plugin
    # from TPU_LIBRARY_PATH, the interposer, which wraps the real libtpu.
    env = {**os.environ, "PJRT_DEVICE": "TPU", "TPU_LIBRARY_PATH": interposer_path(),
           "COMPILECAST_PJRT_PLUGIN": libtpu_path(), "COMPILECAST_PJRT_LOG": "1"}
    env.pop("XLA_PERSISTENT_CACHE_PATH", None)
    if args.worker:
        env["COMPILECAST_WORKER"] = args.worker
    runs = []
    for i in range(args.runs):
        done = subprocess.run([sys.executable, "-c", STEP], env=env, capture_output=True,
                              text=True, timeout=1800)
        said = re.findall(r"compilecast-pjrt\[\d+\]: (worker: \w+|real compile[^\n]*)",
                          done.stderr)
        loss = json.loads(done.stdout.strip().splitlines()[-1])["loss"] \
            if done.returncode == 0 else None
        runs.append({"run": i, "exit": done.returncode, "loss": loss,
                     "compiled": sum(s.startswith("real compile") for s in said),
                     "hits": said.count("worker: HIT")})
        print(json.dumps(runs[-1]))
        if done.returncode != 0:
            print(done.stderr[-3000:], file=sys.stderr)
            return 1
    ok = (runs[0]["compiled"] >= 1 and all(r["compiled"] == 0 and r["hits"] >= 1
                                          for r in runs[1:])
          and len({r["loss"] for r in runs}) == 1)
    print("PASS" if ok else "FAIL: see the runs above")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
