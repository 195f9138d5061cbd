"""Whether tools beyond mypy read the tree: Pyright (what editors' language
servers run) resolves every import of compilecast's own modules, as
pyrightconfig.json points it at the tree of links `make typecheck` lays out
(build/typecheck: compilecast.worker.* is worker/*, compilecast.coordinator.*
is coordinator/*). One line per unresolved import of ours, and the exit
status 1, where one is not; other packages a checkout may lack (torch_xla
outside its own virtualenv) are not ours to check.

    python scripts/resolve_check.py PYRIGHT     (make resolve)
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

OURS = re.compile(r'Import "(compilecast(\.[\w.]+)?|\.[\w.]*)" could not be resolved')


def main(pyright: str) -> int:
    run = subprocess.run([pyright, "--outputjson"], capture_output=True, text=True)
    try:
        report = json.loads(run.stdout)
    except json.JSONDecodeError:
        print(f"pyright gave no report (exit {run.returncode}): {run.stderr.strip()[:500]}",
              file=sys.stderr)
        return 1
    unresolved = [d for d in report["generalDiagnostics"]
                  if d.get("rule") == "reportMissingImports" and OURS.search(d["message"])]
    for d in unresolved:
        line = d["range"]["start"]["line"] + 1
        print(f"{d['file']}:{line}: {d['message']}", file=sys.stderr)
    files = report["summary"]["filesAnalyzed"]
    print(f"pyright read {files} files: {len(unresolved)} imports of compilecast unresolved")
    return 1 if unresolved or not files else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
