#!/usr/bin/env python3
"""Fuzz the C HloModuleProto canonicalizer under AddressSanitizer and UBSan.

    python scripts/fuzz_hlocanon.py [--iterations 5000] [--seed 1]

Builds worker/keylib/_hlocanon.c with -fsanitize=address,undefined into a temporary
folder, re-runs itself with libasan preloaded, mutates real modules (the
PyTorch/XLA dumps in tests/fixtures and a hand-made module with a schedule and
shardings and frontend attributes: flipped bytes, cut, inserted and truncated
runs; with and without configured drops) and checks on each
that the C code neither crashes nor trips a sanitizer, and gives the same bytes,
digest or refusal as the Python reference. Run it after touching the C code
(tests/test_hlocanon.py does a short sanitizer-free version in CI).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import os
import random
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def build(out: Path) -> Path:
    so = out / ("_hlocanon" + sysconfig.get_config_var("EXT_SUFFIX"))
    subprocess.run(["gcc", "-O1", "-g", "-std=c99", "-fsanitize=address,undefined",
                    "-fno-omit-frame-pointer", "-fno-sanitize-recover=undefined",
                    "-shared", "-fPIC", f"-I{sysconfig.get_paths()['include']}",
                    str(ROOT / "worker" / "keylib" / "_hlocanon.c"), "-o", str(so)], check=True)
    return so


def seeds() -> list[bytes]:
    sys.path.insert(0, str(ROOT / "tests"))
    import test_hlocanon as t  # pyright: ignore[reportMissingImports] (tests/, put on the path above)

    from compilecast.worker.keylib.keys import hlo_module_bytes
    out = [hlo_module_bytes(p.read_bytes())
           for p in sorted((ROOT / "tests" / "fixtures" / "torch_xla").glob("*.pb"))]
    out.append(t.module(t.IDS, frontend=(("_scope", "a"), ("_xla_compute_type", "host")),
                        stats=t.ln(1, b"s")))
    out.append(t.module({k: v * 1000 + 5 for k, v in t.IDS.items()}, schedule_order=(1, 0)))
    return out


def mutate(rng: random.Random, data: bytes) -> bytes:
    d = bytearray(data)
    for _ in range(rng.randint(1, 6)):
        if not d:
            break
        i, op = rng.randrange(len(d)), rng.random()
        if op < 0.5:
            d[i] = rng.randrange(256)
        elif op < 0.7:
            del d[i:i + rng.randint(1, 50)]
        elif op < 0.85:
            d[i:i] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
        else:
            del d[i:]
    return bytes(d)


def fuzz(so: Path, iterations: int, seed: int) -> None:
    spec = importlib.util.spec_from_file_location("_hlocanon", so)
    assert spec is not None and spec.loader is not None, so
    native = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(native)
    from compilecast.worker.keylib import hlocanon

    rng, inputs = random.Random(seed), seeds()
    configs = [((), ()), (hlocanon.field_drops(["instruction.statistics_viz",
                                                "instruction.frontend_attributes"]), ()),
               ((), (b"_scope", b"_xla_compute_type", b""))]
    accepted = refused = 0
    for i in range(iterations):
        data = mutate(rng, rng.choice(inputs))
        config = rng.choice(configs)
        try:
            want = hlocanon.canonical_hlo_py(data, *config)
        except (ValueError, RecursionError):
            want = None
        try:
            got = native.canonical_hlo(data, *config)
            digest = native.canonical_hlo_sha256(data, *config)
        except ValueError:
            got = digest = None
        if got != want or digest != (want and hashlib.sha256(want).hexdigest()):
            sys.exit(f"iteration {i}: the C and Python canonicalizers disagree")
        accepted, refused = accepted + (want is not None), refused + (want is None)
    print(f"{iterations} mutated modules: {accepted} canonicalized, {refused} refused, "
          "C and Python agree, no sanitizer report")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iterations", type=int, default=5000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--so", type=Path, help=argparse.SUPPRESS)  # set by the outer run
    args = ap.parse_args()
    if args.so:
        fuzz(args.so, args.iterations, args.seed)
        return
    with tempfile.TemporaryDirectory() as tmp:
        so = build(Path(tmp))
        asan = subprocess.run(["gcc", "-print-file-name=libasan.so"], check=True,
                              capture_output=True, text=True).stdout.strip()
        env = dict(os.environ, LD_PRELOAD=asan, ASAN_OPTIONS="detect_leaks=0")
        rc = subprocess.run([sys.executable, __file__, "--so", str(so), "--iterations",
                             str(args.iterations), "--seed", str(args.seed)], env=env).returncode
    sys.exit(rc)


if __name__ == "__main__":
    main()
