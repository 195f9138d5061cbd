#!/bin/bash
# Fills .tpu/ (ignored by git) with what scripts/tpu_checks.sh needs on a TPU
# VM that reaches no package index: wheels of compilecast's dependencies for
# that machine's Python (PY_VERSION, default 3.11; its image brings JAX,
# jaxlib, libtpu and numpy), this machine's etcd binary, and the C extensions
# and PJRT interposer built here by `make install` (the same Python and glibc
# there import them). Carry `.tpu` to the machine; about 30 MB.
set -eu
cd "$(dirname "$0")/.."
PY_VERSION=${PY_VERSION:-3.11}
PY=${PY:-.venv/bin/python}
rm -rf .tpu/whl .tpu/ext
mkdir -p .tpu/whl .tpu/bin .tpu/ext
cp "$(command -v etcd || echo /usr/bin/etcd)" .tpu/bin/etcd
version() { $PY -c "import importlib.metadata as m; print(m.version('$1'))"; }
$PY -m pip download -q --no-deps --only-binary=:all: --python-version "$PY_VERSION" \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .tpu/whl \
  "grpcio==$(version grpcio)" "protobuf==$(version protobuf)" \
  "grpcio-health-checking==$(version grpcio-health-checking)" \
  "grpcio-reflection==$(version grpcio-reflection)" "cslab-etcd3==$(version cslab-etcd3)" six \
  "zstandard==$(version zstandard)" "prometheus-client==$(version prometheus-client)" \
  "pyyaml==$(version pyyaml)" typing-extensions
# compilecast itself as pip installs it: its jax_plugins entry point is what
# COMPILECAST_ENABLE=1 turns on through JAX's plugin discovery.
$PY -m pip wheel -q --no-deps -w .tpu/whl .
# The extensions, by the paths they have in the tree (tpu_checks.sh puts them back).
for so in worker/keylib/_hlocanon worker/keylib/_mlircanon worker/pjrtdoor/_pjrt_interposer; do
  f=$(ls $so.cpython-*.so 2>/dev/null | head -1)
  [ -n "$f" ] || { echo "$so is not built: run make install first" >&2; exit 1; }
  cp "$f" .tpu/ext/
done
du -sh .tpu
