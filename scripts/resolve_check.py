"""Whether tools beyond mypy read the tree, as editors' language servers do
(Pyright):

- the product's code (compilecast, coordinator, worker), bench/ and
  scripts/ type-check in Pyright's basic mode (pyrightconfig.json): one line
  per error, and the exit status 1 where there is one;
- every import of compilecast's own modules resolves, in those and in
  tests/ too (read with types off: their imports only),
  as pyrightconfig.json points Pyright at the tree of links `make typecheck`
  lays out (build/typecheck: compilecast.worker.* is worker/*,
  compilecast.coordinator.* is coordinator/*). Other packages a checkout may
  lack (torch_xla outside its own virtualenv) are not ours to check.

    python scripts/resolve_check.py PYRIGHT     (make resolve)
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

OURS = re.compile(r'Import "(compilecast(\.[\w.]+)?|\.[\w.]*)" could not be resolved')
ROOT = Path(__file__).resolve().parent.parent
AROUND = ["tests"]  # read for its imports alone


def report(pyright: str, config: Path) -> dict | None:
    run = subprocess.run([pyright, "--outputjson", "-p", str(config)], capture_output=True,
                         text=True, cwd=ROOT)
    try:
        return json.loads(run.stdout)
    except json.JSONDecodeError:
        print(f"pyright gave no report (exit {run.returncode}): {run.stderr.strip()[:500]}",
              file=sys.stderr)
        return None


def where(d: dict) -> str:
    return f"{d['file']}:{d['range']['start']['line'] + 1}"


def main(pyright: str) -> int:
    project = ROOT / "pyrightconfig.json"
    settings = json.loads(project.read_text())
    with tempfile.NamedTemporaryFile("w", suffix=".json", dir=ROOT, prefix=".pyright-") as f:
        json.dump({**settings, "include": AROUND, "typeCheckingMode": "off"}, f)
        f.flush()
        reports = [report(pyright, project), report(pyright, Path(f.name))]
    if None in reports:
        return 1
    typed, around = reports
    assert typed is not None and around is not None
    errors = [d for d in typed["generalDiagnostics"] if d["severity"] == "error"]
    unresolved = [d for r in (typed, around) for d in r["generalDiagnostics"]
                  if d.get("rule") == "reportMissingImports" and OURS.search(d["message"])]
    for d in errors:
        print(f"{where(d)}: {d['message'].splitlines()[0]} ({d.get('rule')})", file=sys.stderr)
    for d in unresolved:
        if d not in errors:
            print(f"{where(d)}: {d['message']}", file=sys.stderr)
    files = typed["summary"]["filesAnalyzed"] + around["summary"]["filesAnalyzed"]
    print(f"pyright read {files} files: the product's, bench's and scripts' "
          f"{typed['summary']['filesAnalyzed']} in basic mode, {len(errors)} errors; "
          f"{len(unresolved)} imports of compilecast unresolved")
    return 1 if errors or unresolved or not files else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
