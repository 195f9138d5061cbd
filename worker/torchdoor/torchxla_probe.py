"""What `compilecast run` asks a PyTorch/XLA interpreter, run by that
interpreter (it imports nothing of compilecast, which need not be installed
there). Prints one JSON object.

    python torchxla_probe.py versions   torch, torch_xla and libtpu releases
                                        (from package metadata: nothing imported)
    python torchxla_probe.py loads      whether this build loads its own
                                        persistent cache: one tiny graph compiled
                                        on the CPU in one process, then looked
                                        up from a second
    python torchxla_probe.py step DIR   (the two processes of `loads`)
    python torchxla_probe.py libtpu     the libtpu this interpreter would load
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from importlib import metadata

COUNTERS = ("PersistentCacheHit", "PersistentCacheMiss", "PersistentCacheDeserializeFailure",
            "UncachedCompile")


def versions() -> dict:
    out = {}
    for name in ("torch", "torch_xla", "libtpu"):
        try:
            out[name] = metadata.version(name.replace("_", "-"))
        except metadata.PackageNotFoundError:
            try:
                out[name] = metadata.version(name)
            except metadata.PackageNotFoundError:
                out[name] = ""
    return out


def step() -> dict:
    # (it runs in the virtualenv that has torch_xla: not this one)
    import torch  # pyright: ignore[reportMissingImports]
    import torch_xla.core.xla_model as xm  # pyright: ignore[reportMissingImports]
    import torch_xla.debug.metrics as met  # pyright: ignore[reportMissingImports]

    dev = xm.xla_device()
    x = torch.arange(16, dtype=torch.float32, device=dev).reshape(4, 4)
    y = (x @ x + 1).sum()
    xm.mark_step()
    assert float(y.cpu()) > 0
    return {name: met.counter_value(name) or 0 for name in COUNTERS}


def loads() -> dict:
    with tempfile.TemporaryDirectory(prefix="compilecast-probe-") as cache:
        env = {**os.environ, "PJRT_DEVICE": "CPU", "XLA_PERSISTENT_CACHE_PATH": cache}
        env.pop("XLA_PERSISTENT_CACHE_READ_ONLY", None)
        runs = []
        for _ in range(2):
            done = subprocess.run([sys.executable, __file__, "step", cache], env=env,
                                  capture_output=True, text=True, timeout=300)
            if done.returncode != 0:
                last = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
                return {"loads": False, "why": f"the probe's graph failed: {last[:300]}"}
            runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    second = runs[1]
    if second["PersistentCacheHit"] > 0 and second["UncachedCompile"] == 0:
        return {"loads": True, "why": ""}
    if second["PersistentCacheDeserializeFailure"] > 0:
        why = "it cannot load the executables it wrote (deserializing fails)"
    else:
        why = f"a second process did not hit its cache ({second})"
    return {"loads": False, "why": why}


if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else ""
    if what == "versions":
        print(json.dumps(versions()))
    elif what == "loads":
        print(json.dumps(loads()))
    elif what == "step":
        print(json.dumps(step()))
    elif what == "libtpu":
        import libtpu

        print(json.dumps({"path": libtpu.get_library_path()}))
    else:
        sys.exit(f"usage: {sys.argv[0]} versions|loads|libtpu|step DIR")
