#!/bin/bash
# The checks that need a GPU, for a GPU machine without network access (the
# project's lent device machine): run from the repository root there after
# scripts/gpu_prepare.sh has filled .gpu/ here (wheels for that machine's
# Python, and etcd). Every log (each step's, each test process's, the
# `compilecast up` log) goes into one archive, $OUT/gpu-logs.tgz (OUT default:
# .gpu/out), written however the script ends.
#
#   1. the JAX adapter's check against that machine's JAX release;
#   2. tests/test_gpu_pgle.py: PGLE end to end on two processes (issue 4);
#   3. bench/time_to_executable.py and bench/warm_start.py on the GPU (issue 6);
#   4. bench/autotune_share.py: a changed program compiled on a second host with
#      and without the first host's autotune results (docs/directories.md);
#   5. bench/pjrt_wave.py --plugin cuda: JAX on jax-cuda*-pjrt through the PJRT
#      interposer, two processes: each program compiled once, none locally, no
#      autotuning deadlock (docs/pjrt.md).
#
# CHECKS=pgle (or adapter) runs only the first steps; CHECKS=all-anyway runs the
# benches even when the PGLE check failed.
set -u
OUT=${OUT:-.gpu/out}
LOGS=$(mktemp -d /tmp/gpu-logs.XXXX)
mkdir -p "$OUT"
trap 'tar -czf "$OUT/gpu-logs.tgz" -C "$LOGS" .' EXIT
PY=${PY:-python3}
CHECKS=${CHECKS:-all}
step() { echo "== $(date +%T) $*"; }

step setup
if [ -d .gpu/whl ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/cc-site .gpu/whl/*.whl || exit 1
fi
# The package's import namespace over the top-level folders (as pyproject maps
# it), made in this copy of the tree: Python and pytest put the tree's root
# first on sys.path, so its compilecast/ is the one imported.
for d in coordinator worker; do [ -e "compilecast/$d" ] || ln -s "../$d" "compilecast/$d"; done
[ -e compilecast/v1 ] || ln -s ../protos/compilecast/v1 compilecast/v1
# The C extensions and the PJRT interposer, built in place where this machine's
# gcc and Python headers allow (else the Python paths run: same keys, slower).
INC=$($PY -c "import sysconfig; print(sysconfig.get_paths()['include'])")
EXT=$($PY -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))")
if command -v gcc >/dev/null && [ -f "$INC/Python.h" ]; then
  gcc -O2 -std=c99 -shared -fPIC -I"$INC" worker/keylib/_hlocanon.c -o "worker/keylib/_hlocanon$EXT" &&
  gcc -O2 -std=gnu99 -shared -fPIC -I"$INC" worker/keylib/_mlircanon.c -o "worker/keylib/_mlircanon$EXT" ||
    echo "C extensions not built: the Python paths run"
else
  echo "no gcc or no Python headers: the C extensions are not built"
fi
command -v gcc >/dev/null && gcc -O2 -std=gnu99 -shared -fPIC -fvisibility=hidden \
  worker/pjrtdoor/_pjrt_interposer.c -o "worker/pjrtdoor/_pjrt_interposer$EXT" -ldl -lpthread
export PYTHONPATH=$PWD:/tmp/cc-site PATH="$PWD/.gpu/bin:$PATH" PYTHONUNBUFFERED=1
# Several processes share the one GPU: none takes most of its memory up front.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi -L
$PY -c "import sys, jax, jaxlib, grpc, google.protobuf as p
print(sys.version.split()[0], 'jax', jax.__version__, 'jaxlib', jaxlib.__version__,
      'grpcio', grpc.__version__, 'protobuf', p.__version__, jax.devices())"

step adapter
$PY -c "from compilecast.worker.xla import jax_adapter as a; a.check(); a.check_optional()
print('jax adapter: ok')" 2>&1 | tee "$LOGS/adapter.log"
if [ "${PIPESTATUS[0]}" != 0 ]; then
  timeout 120 $PY -m pytest -p no:cacheprovider -q tests/test_jax_adapter.py 2>&1 \
    | tail -40 | tee -a "$LOGS/adapter.log"
fi
[ "$CHECKS" = adapter ] && exit 0

step pgle
PGLE_LOG_DIR="$LOGS" timeout ${PGLE_TIMEOUT:-330} $PY -m pytest -p no:cacheprovider -v -s -x tests/test_gpu_pgle.py ${PGLE_SELECT:+-k "$PGLE_SELECT"} \
  2>&1 | tee "$LOGS/pgle.log" | tail -60
pgle=${PIPESTATUS[0]}
[ "$CHECKS" = pgle ] && exit "$pgle"
[ "$pgle" = 0 ] || [ "$CHECKS" = all-anyway ] || { echo "PGLE check failed: benches skipped"; exit "$pgle"; }

step time-to-executable
JAX_PLATFORMS=cuda timeout ${TTE_TIMEOUT:-200} $PY bench/time_to_executable.py --n 4 8 --distributed 0 \
  2>&1 | tee "$LOGS/time_to_executable.log" | grep -v "^\[" | tail -12
step warm-start
JAX_PLATFORMS=cuda timeout ${WARM_TIMEOUT:-150} $PY bench/warm_start.py --layers 96 --repeat 2 \
  2>&1 | tee "$LOGS/warm_start.log" | tail -8
step autotune-share
JAX_PLATFORMS=cuda timeout ${AUTOTUNE_TIMEOUT:-240} $PY bench/autotune_share.py --layers 24 --width 2048 --pairs 2 \
  2>&1 | tee "$LOGS/autotune_share.log" | tail -10
step pjrt-interposer
timeout ${PJRT_TIMEOUT:-240} $PY bench/pjrt_wave.py --n 2 --plugin cuda \
  2>&1 | tee "$LOGS/pjrt_wave.log" | tail -8
step done
