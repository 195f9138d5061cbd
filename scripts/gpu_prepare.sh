#!/bin/bash
# Fills .gpu/ (ignored by git) with what scripts/gpu_checks.sh needs on a GPU
# machine that cannot reach a package index: wheels of compilecast's
# dependencies for that machine's Python (PY_VERSION, default 3.12; its image
# brings JAX, numpy and prometheus-client) and this machine's etcd binary.
set -eu
PY_VERSION=${PY_VERSION:-3.12}
mkdir -p .gpu/whl .gpu/bin
cp "$(command -v etcd || echo /usr/bin/etcd)" .gpu/bin/etcd
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PY_VERSION" \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .gpu/whl \
  "grpcio==$(python3 -c 'import grpc; print(grpc.__version__)')" \
  "protobuf==$(python3 -c 'import google.protobuf as p; print(p.__version__)')" \
  grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 cslab-etcd3==0.12.1 six \
  "zstandard==$(python3 -c 'import zstandard; print(zstandard.__version__)')"
du -sh .gpu
