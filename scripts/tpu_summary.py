#!/usr/bin/env python3
"""The figures of one scripts/tpu_checks.sh run, from its log folder: a table
on stdout and summary.json beside the logs (the script copies it to
$OUT/tpu-summary.json).

    python3 scripts/tpu_summary.py LOGS
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

TRAIN = ("plain", "jax_cold", "cc_cold", "jax_warm", "cc_warm", "cc_restarted", "jax_warm2",
         "cc_warm2")


def load(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text().strip().splitlines()[-1])
    except (OSError, ValueError, IndexError):
        return None
    return data if isinstance(data, dict) else None


def ratio(a: dict | None, b: dict | None, field: str = "first_step_s") -> float | None:
    if not a or not b or not b.get(field):
        return None
    return round(a[field] / b[field], 3)


def main(logs: Path) -> int:
    runs = {name: load(logs / f"{name}.json") for name in TRAIN}
    runs = {k: v for k, v in runs.items() if v}
    plain = runs.get("plain")
    summary: dict = {"versions": (logs / "versions.txt").read_text().strip()
                     if (logs / "versions.txt").exists() else ""}
    if plain:
        summary["train"] = {
            name: {"open_s": round(r["open_s"], 2), "first_step_s": round(r["first_step_s"], 2),
                   "wall_s": round(r["wall_s"], 2), "xla_compiles": r["xla_compiles"],
                   "losses_equal_plain": r.get("losses") == plain.get("losses"),
                   "compilecast": {k: v for k, v in (r.get("compilecast") or {}).items()
                                   if v and k != "reasons"}}
            for name, r in runs.items()}
        summary["compile_s"] = round(plain["compile_or_load_s"], 2)
        summary["ratios_first_step"] = {
            "cc_warm/jax_warm": ratio(runs.get("cc_warm"), runs.get("jax_warm")),
            "cc_warm2/jax_warm2": ratio(runs.get("cc_warm2"), runs.get("jax_warm2")),
            "cc_restarted/jax_warm": ratio(runs.get("cc_restarted"), runs.get("jax_warm")),
            "cc_cold/plain": ratio(runs.get("cc_cold"), plain),
            "jax_warm/plain": ratio(runs.get("jax_warm"), plain),
            "cc_warm/plain": ratio(runs.get("cc_warm"), plain),
        }
        summary["ratios_wall"] = {
            "cc_warm/jax_warm": ratio(runs.get("cc_warm"), runs.get("jax_warm"), "wall_s"),
            "cc_warm2/jax_warm2": ratio(runs.get("cc_warm2"), runs.get("jax_warm2"), "wall_s"),
            "cc_warm/plain": ratio(runs.get("cc_warm"), plain, "wall_s"),
        }
    if (no_tcp := load(logs / "no_tcp.json")) is not None:
        summary["up_no_tcp_inet_sockets"] = no_tcp["inet_sockets"]
        summary["up_processes"] = len(no_tcp["processes"])
    if (names := load(logs / "names.json")) is not None:
        summary["names"] = names
    if (entry := load(logs / "entry.json")) is not None:
        summary["precompiled_then_run"] = {
            "programs": entry.get("programs"), "xla_compiles": entry.get("xla_compiles"),
            "hits": (entry.get("compilecast") or {}).get("hits")}
    if (logs / "pod_key_check.json").exists():
        text = (logs / "pod_key_check.json").read_text()
        summary["pod_key_check"] = text.strip()[-400:]
    for i in (1, 2):
        run = load(logs / f"interposed{i}.json")
        dumped = logs / f"interposed{i}.dumped"
        if run is not None or dumped.exists():
            summary[f"interposed{i}"] = {
                "dumped_programs": int(dumped.read_text().strip() or 0) if dumped.exists() else None,
                "losses_equal_plain": bool(run and plain and run.get("losses") == plain.get("losses")),
                "first_step_s": run and round(run["first_step_s"], 2),
                "wall_s": run and round(run["wall_s"], 2)}
        pgle = load(logs / f"pgle{i}.json")
        if pgle is not None:
            summary[f"pgle{i}"] = {"xla_compiles": pgle["xla_compiles"],
                                   "first_step_s": round(pgle["first_step_s"], 2),
                                   "compilecast": pgle.get("compilecast")}
    (logs / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
