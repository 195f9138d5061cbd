"""Compile-only TPU topologies as users name them (worker/jaxdoor/tputopology.py):
every accelerator type resolves, and libtpu's compile-only client (the
release the tests install) makes each with the devices it names."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from compilecast.worker.jaxdoor import aot, tputopology
from compilecast.worker.jaxdoor.aot import AotError

ENV = {**os.environ, "JAX_PLATFORMS": "cpu", "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
       "TPU_WORKER_HOSTNAMES": "localhost"}

# Made in one child process (libtpu loads once), each as name, devices, processes.
MAKE_ALL = """
import json, sys
from compilecast.worker.jaxdoor import aot
out = {}
for spec in sys.argv[1:]:
    try:
        devices = aot.target_devices(aot.parse_target(spec))
        out[spec] = [len(devices), len({d.process_index for d in devices}),
                     sorted({d.device_kind for d in devices})]
    except aot.AotError as exc:
        out[spec] = str(exc)
print(json.dumps(out))
"""


def make_all(specs: list[str]) -> dict:
    import json

    done = subprocess.run([sys.executable, "-c", MAKE_ALL, *specs], env=ENV,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_every_accelerator_type_is_made_by_the_compile_only_client():
    names = tputopology.names()
    assert {"v5litepod-1", "v5litepod-256", "v5e-16", "v6e-8", "v4-8", "v5p-8192"} <= set(names)
    made = make_all([*names, "v5e:4x4,num_slices=2", "v5e:2x2,wrap=false.false.false",
                     "v5litepod-16,chips_per_host_bounds=2x4x1"])
    kinds = {"v5e": "TPU v5 lite", "v5litepod": "TPU v5 lite", "v6e": "TPU v6 lite",
             "v4": "TPU v4", "v5p": "TPU v5"}
    for name in names:
        topo = tputopology.resolve(name)
        assert isinstance(made[name], list), made[name]
        devices, processes, kind = made[name]
        assert devices == topo.chips, (name, made[name])
        assert processes == max(1, topo.chips // (
            topo.chips_per_host_bounds[0] * topo.chips_per_host_bounds[1]
            * topo.chips_per_host_bounds[2])), (name, made[name])
        assert kind == [kinds[name.rsplit("-", 1)[0]]], (name, kind)
    # Hosts as Cloud TPU makes them: a v5litepod-8 is one VM of 8 chips, a v5litepod-16 four.
    assert made["v5litepod-8"][:2] == [8, 1] and made["v5litepod-16"][:2] == [16, 4]
    assert made["v5litepod-1"][:2] == [1, 1]
    assert made["v5e:4x4,num_slices=2"][:2] == [32, 8]
    assert made["v5e:2x2,wrap=false.false.false"][:2] == [4, 1]
    assert made["v5litepod-16,chips_per_host_bounds=2x4x1"][:2] == [16, 2]


def test_names_and_libtpu_names_resolve_to_one_spec():
    assert tputopology.resolve("v5litepod-1").spec() == tputopology.resolve("v5e:1x1").spec() \
        == tputopology.resolve("v5e-1").spec() == "v5e:1x1,chips_per_host_bounds=1x1x1"
    assert tputopology.resolve("v5litepod-16").spec() == "v5e:4x4"
    assert tputopology.resolve("v5p-8").spec() == tputopology.resolve("v5:2x2x1").spec()
    assert tputopology.resolve("v5e:4x4,num_slices=2").kwargs()["num_slices"] == 2
    assert tputopology.resolve(" V5E-16 ").name == "v5e:4x4"


@pytest.mark.parametrize("spec, said", [
    ("v5e-3", "have 1, 4, 8"), ("v4-6", "two a chip"), ("v9-8", "no accelerator type v9"),
    ("v5e:2x2x2", "2 dimensions"), ("tpu7:2x2", "no TPU family"),
    ("v5e:2x2,num_slices=0", "num_slices"), ("v5e:2x2,wrap=true", "three of true/false"),
    ("v5e:2x2,chips_per_host_bounds=2x2", "AxBxC"), ("v5e:2x2,color=red", "no option"),
    ("v5e:2x2,num_slices=2,num_slices=3", "once each"),
])
def test_a_name_nobody_makes_gets_one_line_listing_those_that_exist(spec, said):
    with pytest.raises(AotError) as err:
        aot.parse_target(spec)
    message = str(err.value)
    assert said in message and "\n" not in message
    assert "v5litepod-N" in message and "v5e:4x4" in message


def test_the_cli_refuses_an_unknown_topology_in_one_line():
    out = subprocess.run([sys.executable, "-m", "compilecast.cli", "precompile", "--entry",
                          "compilecast.demo.step:aot_programs", "--topology", "v5litepod-3",
                          "--coordinator", "unix:///nonexistent/c.sock"],
                         env=ENV, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "v5litepod-N" in lines[0], out.stderr
