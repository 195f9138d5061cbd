#!/bin/bash
# The checks that need a TPU, for a TPU VM without network access (the
# project's lent TPU v5e machine, where no process may open a TCP or UDP
# socket): run from the repository root there after scripts/tpu_prepare.sh
# filled .tpu/ here (carry .tpu). One command, under 10 minutes; every log
# (each step's, each process's JSON report, `compilecast up`'s log) goes into
# one archive, $OUT/tpu-logs.tgz, and the figures into $OUT/tpu-summary.json
# (OUT default: .tpu/out), written however the script ends.
#
#   1. the JAX adapter's check against that machine's JAX;
#   2. `compilecast up --no-tcp`: etcd, coordinator and worker on unix sockets,
#      and no process of it holding a TCP or UDP socket;
#   3. bench/tpu_step.py (a transformer's train step whose TPU compile takes
#      15 s or more) in fresh processes: plain JAX; JAX's own cache cold and
#      warm; compilecast (COMPILECAST_ENABLE=1) cold, warm, and warm again
#      after `up` restarted (the host cache); losses bitwise equal;
#   4. libtpu's names on this libtpu: v5e:1x1 and v5litepod-1 made by the
#      compile-only client;
#   5. `compilecast precompile --topology v5litepod-1` on this host's CPU, then
#      a real TPU process runs the same programs: every one a hit, none
#      compiled; scripts/pod_key_check.py agrees;
#   6. the PJRT interposer on libtpu (`compilecast run --interpose-tpu`), twice:
#      the second run compiles nothing (XLA's own dump), equal losses;
#   7. PGLE on the one chip (JAX's jax_enable_pgle), twice: the profile is
#      shared and the second process compiles nothing;
#   8. the preload (STEPS=preload, with up): JAX's own cache against
#      compilecast's preload at 8 and 24 layers (PRELOAD_LAYERS), alternated.
#
# STEPS (default "adapter up train names precompile interposer pgle") picks
# steps; TPU_STEP_LAYERS sizes the transformer (default 8).
set -u
OUT=${OUT:-.tpu/out}
LOGS=$(mktemp -d /tmp/tpu-logs.XXXX)
mkdir -p "$OUT"
PY=${PY:-python3}
trap '$PY scripts/tpu_summary.py "$LOGS" > "$LOGS/summary.txt" 2>&1; cat "$LOGS/summary.txt";
      cp "$LOGS/summary.json" "$OUT/tpu-summary.json" 2>/dev/null;
      tar -czf "$OUT/tpu-logs.tgz" -C "$LOGS" .' EXIT
STEPS=${STEPS:-adapter up train names precompile interposer pgle preload}
CC_HOME=/tmp/cc-home
WORKER=unix://$CC_HOME/worker.sock
COORD=unix://$CC_HOME/sock/coordinator.sock
ENTRY=compilecast.demo.step:aot_programs
step() { echo "== $(date +%T) $*"; }
want() { [[ " $STEPS " == *" $1 "* ]]; }

step setup
$PY -m pip install -q --isolated --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/cc-site .tpu/whl/*.whl || exit 1
# The package's import namespace over the top-level folders (as pyproject maps
# it), made in this copy of the tree, and the extensions built by tpu_prepare.sh.
for d in coordinator worker; do [ -e "compilecast/$d" ] || ln -s "../$d" "compilecast/$d"; done
[ -e compilecast/v1 ] || ln -s ../protos/compilecast/v1 compilecast/v1
cp .tpu/ext/_hlocanon.* .tpu/ext/_mlircanon.* worker/keylib/
cp .tpu/ext/_pjrt_interposer.* worker/pjrtdoor/
# (then the machine's own PYTHONPATH, where its JAX may live)
export PYTHONPATH=$PWD:/tmp/cc-site${PYTHONPATH:+:$PYTHONPATH} PATH="$PWD/.tpu/bin:$PATH" PYTHONUNBUFFERED=1
$PY -c "import sys, importlib.metadata as m, jax, jaxlib, grpc
print(sys.version.split()[0], 'jax', jax.__version__, 'jaxlib', jaxlib.__version__,
      'libtpu', m.version('libtpu'), 'grpcio', grpc.__version__)" 2>&1 | tee "$LOGS/versions.txt"
nproc >> "$LOGS/versions.txt"

if want adapter; then
  step adapter
  $PY -c "from compilecast.worker.xla import jax_adapter as a; a.check(); a.check_optional()
print('jax adapter: ok')" > "$LOGS/adapter.log" 2>&1
  echo "rc=$?" >> "$LOGS/adapter.log"; tail -3 "$LOGS/adapter.log"
fi

up_start() {
  $PY -m compilecast.cli --log-level "${UP_LOG_LEVEL:-info}" up --no-tcp --home "$CC_HOME" >> "$LOGS/up.log" 2>&1 &
  UP_PID=$!
  for _ in $(seq 120); do
    $PY -m compilecast.cli status --worker "$WORKER" --timeout 1 > "$LOGS/status.txt" 2>&1 && return 0
    kill -0 $UP_PID 2>/dev/null || { echo "up exited"; tail -20 "$LOGS/up.log"; return 1; }
    sleep 0.5
  done
  echo "up was not healthy in 60 s"; tail -20 "$LOGS/up.log"; return 1
}
up_stop() { kill -TERM "$UP_PID" 2>/dev/null; wait "$UP_PID" 2>/dev/null; }

if want up; then
  step up --no-tcp
  rm -rf "$CC_HOME"
  up_start || exit 1
  # Every process of `up` (it and its etcd): its sockets, against the
  # namespace's TCP and UDP tables.
  $PY -c "import json, sys; from compilecast.launch import sockets_held
held = sockets_held(int(sys.argv[1]))
print(json.dumps({'processes': held, 'inet_sockets': sum(h['inet'] for h in held.values())}))" \
    "$UP_PID" > "$LOGS/no_tcp.json"
  cat "$LOGS/no_tcp.json"; echo
  ls -la "$CC_HOME" "$CC_HOME/sock" >> "$LOGS/no_tcp.txt"
  cat "$LOGS/status.txt"
fi

run_step() {  # NAME [ENV=VALUE...]: one fresh process of bench/tpu_step.py
  local name=$1; shift
  env "$@" timeout 300 $PY bench/tpu_step.py > "$LOGS/$name.out" 2> "$LOGS/$name.err"
  echo "rc=$?" >> "$LOGS/$name.err"
  tail -1 "$LOGS/$name.out" > "$LOGS/$name.json"
  $PY -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[2].ljust(16),
  'open %.1fs first step %.1fs first call %.2fs wall %.1fs xla compiles %d' % (d['open_s'],
  d['first_step_s'], d.get('compile_or_load_s', 0), d['wall_s'], d['xla_compiles']),
  (d.get('compilecast') or {}).get('preloads') or '')" "$LOGS/$name.json" "$name" \
    2>/dev/null || { echo "$name failed:"; tail -5 "$LOGS/$name.err"; }
}
JAXC=(JAX_COMPILATION_CACHE_DIR=/tmp/jax-cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
      JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=0)
CC=(COMPILECAST_ENABLE=1 COMPILECAST_WORKER=$WORKER)

if want train; then
  step train step: plain JAX, JAX\'s cache, compilecast
  rm -rf /tmp/jax-cache
  run_step plain
  run_step jax_cold "${JAXC[@]}"
  run_step cc_cold "${CC[@]}"
  run_step jax_warm "${JAXC[@]}"
  run_step cc_warm "${CC[@]}"
  step restart up
  up_stop; up_start || exit 1
  run_step cc_restarted "${CC[@]}"
  run_step jax_warm2 "${JAXC[@]}"
  run_step cc_warm2 "${CC[@]}"
fi

if want preload; then
  # A restart against JAX's own cache: each way's cold run fills its cache
  # (compilecast's names the job, so its recipe says what a restart loads),
  # then warm runs alternate. The bench's start-up (its parameters made with
  # NumPy) is what the preload overlaps.
  for layers in ${PRELOAD_LAYERS:-8 24}; do
    step preload at $layers layers: JAX\'s cache against compilecast\'s preload
    JAXL=(JAX_COMPILATION_CACHE_DIR=/tmp/jax-cache-$layers JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
          JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=0 TPU_STEP_LAYERS=$layers)
    PRE=("${CC[@]}" COMPILECAST_JOB=tpu-preload-$layers TPU_STEP_LAYERS=$layers)
    rm -rf /tmp/jax-cache-$layers
    run_step "pre_cold_$layers" "${PRE[@]}"
    run_step "jaxc_cold_$layers" "${JAXL[@]}"
    for i in 1 2; do
      run_step "jaxc_warm_${layers}_$i" "${JAXL[@]}"
      run_step "pre_warm_${layers}_$i" "${PRE[@]}"
    done
  done
fi

if want names; then
  step libtpu names on this libtpu
  JAX_PLATFORMS=cpu ALLOW_MULTIPLE_LIBTPU_LOAD=1 $PY -c "
import json
from compilecast.worker.jaxdoor import aot
out = {}
for spec in ('v5e:1x1', 'v5litepod-1', 'v5e-1', 'v5litepod-4', 'v5litepod-16', 'v5e:2x2,chips_per_host_bounds=2x2x1'):
    try:
        d = aot.target_devices(aot.parse_target(spec))
        out[spec] = [len(d), d[0].device_kind]
    except Exception as exc:
        out[spec] = str(exc)[:400]
print(json.dumps(out))" > "$LOGS/names.json" 2> "$LOGS/names.err"
  cat "$LOGS/names.json"
fi

if want precompile; then
  step precompile for v5litepod-1 on this host\'s CPU
  JAX_PLATFORMS=cpu ALLOW_MULTIPLE_LIBTPU_LOAD=1 timeout 240 $PY -m compilecast.cli precompile \
    --entry $ENTRY --topology v5litepod-1 --job tpu-check --coordinator "$COORD" \
    > "$LOGS/precompile.log" 2>&1
  echo "rc=$?" >> "$LOGS/precompile.log"; cat "$LOGS/precompile.log" | tail -4
  step a real TPU process runs the precompiled programs
  env "${CC[@]}" timeout 240 $PY bench/tpu_step.py --entry > "$LOGS/entry.out" 2> "$LOGS/entry.err"
  tail -1 "$LOGS/entry.out" | tee "$LOGS/entry.json"
  step pod_key_check
  timeout 240 $PY scripts/pod_key_check.py --entry $ENTRY --topology v5litepod-1 \
    --no-distributed --json > "$LOGS/pod_key_check.json" 2> "$LOGS/pod_key_check.err"
  echo "rc=$?" >> "$LOGS/pod_key_check.err"; tail -c 600 "$LOGS/pod_key_check.json"; echo
fi

if want interposer; then
  step PJRT interposer on libtpu, twice
  for i in 1 2; do
    rm -rf "/tmp/dump$i"
    # (COMPILECAST_PJRT_LOG=1: the interposer's every decision on stderr, in the archive)
    COMPILECAST_PJRT_LOG=1 timeout 300 $PY -m compilecast.cli run --interpose-tpu \
      --worker "$WORKER" -- env XLA_FLAGS="--xla_dump_to=/tmp/dump$i" $PY bench/tpu_step.py \
      > "$LOGS/interposed$i.out" 2> "$LOGS/interposed$i.err"
    echo "rc=$?" >> "$LOGS/interposed$i.err"
    grep "compilecast-pjrt" "$LOGS/interposed$i.err" | tail -4
    $PY -m compilecast.cli status --worker "$WORKER" > "$LOGS/interposed$i.status" 2>&1
    tail -1 "$LOGS/interposed$i.out" > "$LOGS/interposed$i.json"
    find "/tmp/dump$i" -name '*after_optimizations.txt' 2>/dev/null | wc -l > "$LOGS/interposed$i.dumped"
    echo "interposed run $i: $(cat "$LOGS/interposed$i.dumped") programs compiled (XLA's dump)"
  done
  # The keys each run asked under; where the second asked under another, which
  # of the interposed compile's components differ.
  k1=$(grep -o "worker: [A-Z]* cc1-[0-9a-f]*" "$LOGS/interposed1.err" | tail -1 | awk '{print $3}')
  k2=$(grep -o "worker: [A-Z]* cc1-[0-9a-f]*" "$LOGS/interposed2.err" | tail -1 | awk '{print $3}')
  echo "interposed keys: ${k1:-?} ${k2:-?}" | tee "$LOGS/interposed.keys"
  if [ -n "$k1" ] && [ -n "$k2" ] && [ "$k1" != "$k2" ]; then
    $PY -m compilecast.cli explain "$k1" "$k2" --worker "$WORKER" 2>&1 | tee -a "$LOGS/interposed.keys"
  fi
fi

if want pgle; then
  step PGLE on one chip, twice
  for i in 1 2; do
    env "${CC[@]}" JAX_ENABLE_PGLE=1 JAX_PGLE_PROFILING_RUNS=1 timeout 300 $PY bench/tpu_step.py \
      --steps 4 > "$LOGS/pgle$i.out" 2> "$LOGS/pgle$i.err"
    echo "rc=$?" >> "$LOGS/pgle$i.err"
    tail -1 "$LOGS/pgle$i.out" > "$LOGS/pgle$i.json"
    $PY -c "import json,sys; d=json.load(open(sys.argv[1])); print('pgle', sys.argv[2],
    'xla compiles', d['xla_compiles'], d.get('compilecast'))" "$LOGS/pgle$i.json" "$i" \
      2>/dev/null || tail -5 "$LOGS/pgle$i.err"
  done
fi

want up && up_stop
cp "$CC_HOME/etcd.log" "$LOGS/" 2>/dev/null
step done
