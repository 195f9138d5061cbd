"""The several-program job of bench/aot_farm.py: the example training step
and its evaluation at two batch sizes (four programs), sized by
$BENCH_LAYERS x $BENCH_WIDTH (default 16 x 1024)."""

import os

from compilecast.demo_step import aot_programs


def programs(devices):
    layers = int(os.environ.get("BENCH_LAYERS", "16"))
    width = int(os.environ.get("BENCH_WIDTH", "1024"))
    return (aot_programs(devices, layers, width, batch=8)
            + aot_programs(devices, layers, width, batch=16))
