"""The house's layers (docs/architecture/layout.md, "Layout of the tree"): the core
folder imports neither the worker nor the coordinator, those two import each
other never, and none of them imports an entry point back. Every import
counts, the ones inside functions too."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# compilecast/'s entry points, which may import any layer: the commands and the
# demo (sub-packages of their own, outside the core), `up`, the launcher of
# tests and demos, and the JAX door users import.
ENTRY_POINTS = {"cli", "demo", "up", "launch", "jax"}
FOLDERS = {"compilecast": "compilecast", "coordinator": "compilecast.coordinator",
           "worker": "compilecast.worker"}
# Modules of the core that speak no gRPC at all: the error tree, the store's
# interface, the route negotiator.
NO_GRPC = {"errors", "store", "negotiate"}


def imports(path: Path, package: str) -> set[str]:
    """Every module `path` imports, as absolute names (a name imported from
    a module counts as a possible submodule too)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{node.module}" if node.module else parent
            found.add(base)
            found |= {f"{base}.{alias.name}" for alias in node.names}
    return found


def _entry_point(module: str) -> bool:
    parts = module.split(".")
    return len(parts) >= 2 and parts[0] == "compilecast" and parts[1] in ENTRY_POINTS


def _violations(folder: str, stem: str, found: set[str]) -> list[str]:
    if folder == "compilecast":
        if stem in ENTRY_POINTS:
            return []
        return sorted(m for m in found if m.startswith(("compilecast.worker",
                                                        "compilecast.coordinator"))
                      or _entry_point(m))
    other = "compilecast.worker" if folder == "coordinator" else "compilecast.coordinator"
    return sorted(m for m in found if m.startswith(other) or _entry_point(m))


# (compilecast/'s sub-packages are the entry points, below.)
MODULES = [(folder, path) for folder in FOLDERS
           for path in sorted((ROOT / folder).glob("*.py" if folder == "compilecast" else "**/*.py"))]
ENTRY_MODULES = sorted(p for name in ENTRY_POINTS if (ROOT / "compilecast" / name).is_dir()
                       for p in (ROOT / "compilecast" / name).glob("*.py"))


def test_the_core_holds_no_command_nor_demo():
    """The CLI and the demo are packages of their own beside the core."""
    assert {p.parent.name for p in ENTRY_MODULES} == {"cli", "demo"}
    assert not [p.name for p in (ROOT / "compilecast").glob("*.py")
                if p.stem.startswith(("cli", "demo"))]


@pytest.mark.parametrize("path", ENTRY_MODULES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_the_commands_and_the_demo_import_no_private_name(path):
    """They sit on top of every layer and use what each layer offers."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("compilecast"):
            assert not [a.name for a in node.names if a.name.startswith("_")
                        and a.name != "__version__"], node.module


@pytest.mark.parametrize(("folder", "path"), MODULES,
                         ids=[str(p.relative_to(ROOT)) for _, p in MODULES])
def test_a_module_imports_only_its_own_layer_and_those_below(folder, path):
    inner = path.parent.relative_to(ROOT / folder).parts
    found = imports(path, ".".join([FOLDERS[folder], *inner]))
    assert _violations(folder, path.stem, found) == []
    if folder == "compilecast" and path.stem in NO_GRPC:
        assert not {m for m in found if m == "grpc" or m.startswith("grpc.")}


def test_the_rule_sees_an_import_inside_a_function(tmp_path):
    module = tmp_path / "sample.py"
    module.write_text("def f():\n    from compilecast.worker.inprocess.client import CacheClient\n"
                      "    from ..coordinator import state\n")
    found = imports(module, "compilecast.worker")
    assert "compilecast.worker.inprocess.client" in found and "compilecast.coordinator.state" in found
    assert _violations("compilecast", "blobstore", found) == ["compilecast.coordinator",
                                                              "compilecast.coordinator.state",
                                                              "compilecast.worker.inprocess.client",
                                                              "compilecast.worker.inprocess.client."
                                                              "CacheClient"]
    assert _violations("compilecast", "cli", found) == []


# The worker's runtimes (docs/architecture/components.md, "The worker's runtimes") are its
# sub-packages, and a runtime imports only itself and the runtimes below it.
# The in-process client sits below the daemon (the daemon is a client of the
# coordinator too), never the reverse.
BELOW = {
    "xla": set(),
    "keylib": {"xla"},
    "inprocess": set(),
    "jaxdoor": {"xla", "keylib", "inprocess"},
    "pjrtdoor": {"xla", "keylib", "inprocess"},
    "torchdoor": {"xla", "inprocess"},
    "daemon": {"xla", "keylib", "inprocess", "pjrtdoor"},
}
WORKER_MODULES = sorted(p for p in (ROOT / "worker").glob("*/*.py"))


def test_every_worker_module_is_in_a_runtime():
    """The worker's folder holds only its runtimes' sub-packages."""
    assert [p.name for p in (ROOT / "worker").glob("*.py")] == ["__init__.py"]
    assert {p.parent.name for p in WORKER_MODULES} == set(BELOW)


@pytest.mark.parametrize("path", WORKER_MODULES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_a_worker_runtime_imports_only_itself_and_those_below(path):
    mine = path.parent.name
    allowed = {mine} | BELOW[mine]
    package = f"compilecast.worker.{mine}"
    wrong = set()
    for name in imports(path, package):
        parts = name.split(".")
        if parts[:2] != ["compilecast", "worker"] or len(parts) < 3:
            continue
        if parts[2] not in allowed:
            wrong.add(name)
    assert not wrong, f"{mine}/{path.name} imports {sorted(wrong)}"
