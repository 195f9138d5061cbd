"""The preload (worker/jaxdoor/preload.py): a restart's executables loaded
while the program starts. The component over fakes of its worker and of
JAX's load; then real JAX processes through `compilecast up`."""

from __future__ import annotations

import threading

import pytest

from compilecast.errors import CorruptBlob, NotFound
from compilecast.v1 import cache_pb2 as pb
from compilecast.worker.jaxdoor.preload import Preloads

from .conftest import eventually
from .e2e import run_procs


def recipe(key: str, devices=(0,), created: float = 0.0, platform: str = "cpu") -> pb.Recipe:
    r = pb.Recipe(key=key, compile_options=b"options of " + key.encode(), created_unix=created)
    r.device_ids.extend(devices)
    r.target.platform = platform
    return r


class Worker:
    """A fake worker: the job's recipes, each key's entry, and faults."""

    def __init__(self, recipes, *, fail: dict | None = None,
                 hold: threading.Event | None = None) -> None:
        self.listed = list(recipes)
        self.fail = fail or {}
        self.hold = hold
        self.fetched: list[str] = []

    def recipes(self, job: str):
        return self.listed

    def fetch(self, key: str) -> bytes:
        self.fetched.append(key)
        if self.hold is not None:
            self.hold.wait(30)
        if key in self.fail:
            raise self.fail[key]
        return b"entry of " + key.encode() * 10


def load(entry: bytes, options: bytes, device_ids: list[int], platform: str):
    if b"bad" in entry:
        raise ValueError("XLA refuses the executable")
    return ("executable", entry, options, tuple(device_ids)), 7


def ours(device_ids: list[int], platform: str) -> bool:
    return platform == "cpu" and 0 in device_ids


def started(worker: Worker, **kw) -> Preloads:
    p = Preloads(worker, load, ours, **kw)
    p.start("train")  # (on this thread: it returns once every preload ended)
    return p


def test_a_preload_is_taken_for_exactly_its_key():
    p = started(Worker([recipe("b", created=2), recipe("a", created=1)]))
    assert p.held() == {"a": "ready", "b": "ready"}
    got = p.take("a")
    assert got is not None and got[0][1] == b"entry of " + b"a" * 10 and got[1] == 7
    assert got[0][2] == b"options of a" and got[0][3] == (0,)  # its options, its devices
    assert p.take("a") is None  # taken once
    assert p.take("another key") is None  # (other options or devices: another key)
    assert p.stats.used == 1 and p.stats.loaded == 2


def test_the_first_published_loads_first_and_only_this_processs_programs():
    worker = Worker([recipe("late", created=3), recipe("early", created=1),
                     recipe("not-here", devices=(4, 5), created=0),
                     recipe("a-gpu-program", platform="cuda", created=0)])
    p = started(worker, threads=1)
    assert worker.fetched == ["early", "late"]
    assert p.stats.listed == 2


@pytest.mark.parametrize("fault", [NotFound("no artifact under this key any more"),
                                   CorruptBlob("sha256 mismatch")])
def test_a_stale_entry_or_a_corrupt_byte_falls_back_to_todays_path(fault):
    p = started(Worker([recipe("gone"), recipe("kept")], fail={"gone": fault}))
    assert p.take("gone") is None and p.stats.dropped == 1
    assert p.take("kept") is not None


def test_a_load_xla_refuses_is_dropped():
    worker = Worker([recipe("bad"), recipe("good")])
    p = started(worker)
    assert p.take("bad") is None and p.take("good") is not None
    assert p.stats.dropped == 1 and p.stats.used == 1


def test_the_bounds_hold():
    many = [recipe(f"k{i:02d}", created=i) for i in range(10)]
    p = started(Worker(many), programs=3)
    assert sorted(p.held()) == ["k07", "k08", "k09"] and p.stats.listed == 10  # the newest
    entry = len(b"entry of " + b"k00" * 10)
    p = started(Worker(many), max_bytes=entry * 4 + 1, threads=1)
    assert p.stats.loaded == 4 and p.stats.dropped == 6


def test_a_preload_never_asked_for_is_freed():
    p = started(Worker([recipe("a"), recipe("b")]), unused_s=0.05)
    assert p.take("a") is not None
    eventually(lambda: p.stats.freed == 1, "the unused one freed", 30)
    assert p.take("b") is None and p.held()["b"] == "done"


def test_a_slow_or_dead_worker_never_delays_the_program():
    hold = threading.Event()
    slow = Preloads(Worker([recipe("a")], hold=hold), load, ours)
    t = threading.Thread(target=slow.start, args=("train",))
    t.start()
    try:
        eventually(lambda: slow.held().get("a") == "fetching", "fetching", 30)
        assert slow.take("a") is None  # at once: JAX reads it itself
    finally:
        hold.set()
        t.join(30)
    assert slow.stats.dropped == 1 and slow.stats.loaded == 0

    class Dead(Worker):
        def recipes(self, job: str):
            raise ConnectionError("no worker")

    dead = started(Dead([]))
    assert dead.listed.is_set() and dead.take("a") is None


# -- real JAX processes ------------------------------------------------------------

JOB = {"COMPILECAST_JOB": "train-preload"}


@pytest.mark.slow
def test_a_restart_takes_its_executable_preloaded_and_other_options_never_do(up):
    (first,) = run_procs(1, up.target, extra_env=JOB)
    assert first["xla_compiles"] == 1 and first["compilecast"]["published"] == 1
    (again,) = run_procs(1, up.target, extra_env=JOB)
    pre = again["compilecast"]["preloads"]
    assert pre["listed"] == 1 and pre["used"] == 1, again["stderr"][-3000:]
    assert again["xla_compiles"] == 0 and again["digest"] == first["digest"]
    (off,) = run_procs(1, up.target, extra_env={**JOB, "COMPILECAST_PRELOAD": "0"})
    assert off["compilecast"]["preloads"] == {} and off["compilecast"]["hits"] == 1
    # Another compile option: another key, which never takes the loaded one.
    (other,) = run_procs(1, up.target, extra_env={
        **JOB, "XLA_FLAGS": "--xla_cpu_enable_fast_math=true"})
    pre = other["compilecast"]["preloads"]
    assert pre["loaded"] >= 1 and pre["used"] == 0, other["stderr"][-3000:]
    assert other["xla_compiles"] == 1
