"""One process of tests/test_aot.py's entry check: compile a CPU program
through compilecast's ahead-of-time path, print what it got as JSON.

Usage: aot_entry_proc.py MIN_COMPILE_TIME_S
"""

import json
import sys

import jax
import jax.numpy as jnp
from jax._src import compilation_cache

from compilecast.worker.jaxdoor import aot
from compilecast.worker.xla import jax_adapter

jax.config.update("jax_persistent_cache_min_compile_time_secs", float(sys.argv[1]))
serialized = []
serialize = jax_adapter.serialize


def counting(executable, compile_time_s):
    serialized.append(compile_time_s)
    return serialize(executable, compile_time_s)


jax_adapter.serialize = counting  # what the compile hook calls when JAX wrote no entry
f = jax.jit(lambda x: jnp.sin(x) @ x.T + 1.0)
x = jnp.ones((64, 64), jnp.float32)
key, entry, seconds = aot.compile_entry(lambda: f.lower(x).compile())
executable, compile_time = compilation_cache.extract_executable_and_time(
    compilation_cache.decompress_executable(entry))
print(json.dumps({"key": key, "serialized_by_compilecast": len(serialized),
                  "executable_bytes": len(executable), "compile_time": compile_time}))
