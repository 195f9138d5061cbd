#!/usr/bin/env python3
"""Do the farm's keys match the pod's? Run on every host of a real TPU pod.

    python scripts/pod_key_check.py --entry pkg.module:programs --topology v5e:4x4

Computes the compilecast key of every program of the entry point twice, in
this process: once for the real devices this process sees (after
jax.distributed.initialize(), as the training job does) and once for a
compile-only client of --topology (what `compilecast precompile` and the farm
compute). Prints, per program, whether the keys agree and, if not, which key
components differ. Exit status 0 when every key agrees on this host.

docs/aot.md lists which component equalities this settles; run it on each
host (or at least on process 0 and one other) of each slice type you
precompile for. With --against TOPOLOGY both sides are compile-only
(a self-test that runs anywhere libtpu is installed).
"""

from __future__ import annotations

import argparse
import json
import sys


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--entry", required=True, help="package.module:function")
    ap.add_argument("--topology", required=True, help="the farm's target, e.g. v5litepod-16 or v5e:4x4")
    ap.add_argument("--platform", default="tpu")
    ap.add_argument("--against", default="",
                    help="compare with this compile-only topology instead of the real devices")
    ap.add_argument("--no-distributed", action="store_true",
                    help="do not call jax.distributed.initialize() first")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    import jax

    from compilecast.worker.jaxdoor import aot
    from compilecast.worker.keylib import keys

    if not args.against and not args.no_distributed:
        jax.distributed.initialize()
    farm = aot.entry_programs(args.entry, aot.parse_target(args.topology, args.platform))
    here = aot.entry_programs(args.entry, aot.parse_target(args.against or "local", args.platform))
    if len(farm) != len(here):
        print(f"the entry point returned {len(here)} programs here, {len(farm)} for "
              f"{args.topology}", file=sys.stderr)
        return 1
    report, agree = [], True
    for f, h in zip(farm, here, strict=True):
        kf, kh = aot.probe(f.trigger).key, aot.probe(h.trigger).key
        diff = keys.explain(kh, kf)
        agree &= kf.value == kh.value
        report.append({"program": f.name, "agree": kf.value == kh.value, "farm": kf.value,
                       "here": kh.value, "differences": diff})
    if args.json:
        print(json.dumps({"process_index": jax.process_index(), "programs": report}))
    else:
        for r in report:
            print(f"{'agree' if r['agree'] else 'DIFFER':6}  {r['program']}  here {r['here']}")
            for line in r["differences"]:
                print(f"        {line}")
    return 0 if agree else 1


if __name__ == "__main__":
    sys.exit(main())
