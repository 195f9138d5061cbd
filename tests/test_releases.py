"""A JAX process releases the lease of a program under JAX's caching
thresholds behind the compile (worker/jaxdoor/releases.py): the
compile returns to JAX at once, the release reaches a real coordinator
after, and the process's waiters are told why. Flushes are bounded; a
forked child serves its own queue."""

from __future__ import annotations

import os
import threading
import warnings

from compilecast.v1 import cache_pb2 as pb
from compilecast.worker.inprocess.client import CacheClient, Identity
from compilecast.worker.jaxdoor.jax_integration import CompilecastCache
from compilecast.worker.jaxdoor.releases import Releases


def test_a_program_under_the_thresholds_is_released_behind_the_compile(coordinator):
    cache = CompilecastCache(coordinator.cfg.listen, job="j")
    waiter = CacheClient(coordinator.cfg.listen, identity=Identity(job="j", process_id=1))
    with cache.acquiring("k"):
        assert cache.get("k") is None  # a miss: the lease is this process's
    assert waiter.acquire("k").decision == pb.WAIT

    go, sent = threading.Event(), threading.Event()
    real = cache.client.release

    def held_back(*args, **kwargs):
        assert go.wait(10), "the test never let the release go"
        real(*args, **kwargs)
        sent.set()

    cache.client.release = held_back
    # An instant compile: under JAX's min_compile_time, so not shared.
    out = cache.compile("k", "jit_small", False, run=lambda: "executable",
                        serialize=lambda executable, seconds: b"entry")
    assert out == "executable"
    assert not sent.is_set() and cache.stats.released == 0  # the compile did not wait for it
    go.set()
    assert cache._releases.flush(10)
    assert sent.is_set() and cache.stats.released == 1
    event = waiter.wait("k", 10)
    assert event.decision == pb.COMPILE_LOCALLY, event
    assert event.local_cause == pb.LOCAL_CAUSE_BELOW_THRESHOLD, event
    cache.client.close()
    waiter.close()


def test_a_flush_is_bounded_and_the_releases_go_in_order():
    releases = Releases()
    assert releases.flush(0.01)  # nothing queued
    block, order = threading.Event(), []
    releases.submit(lambda: block.wait(10))
    for i in range(3):
        releases.submit(lambda i=i: order.append(i))
    assert releases.flush(0.2) is False  # the first is still being sent
    assert order == []
    block.set()
    assert releases.flush(10)
    assert order == [0, 1, 2]


def test_a_forked_child_sends_its_own_releases_not_its_parents():
    releases = Releases()
    block = threading.Event()
    parents = []
    releases.submit(lambda: block.wait(10))
    releases.submit(lambda: parents.append(os.getpid()))  # queued behind the block at the fork
    read, write = os.pipe()
    with warnings.catch_warnings():  # JAX warns any fork, once its backends are up
        warnings.filterwarnings("ignore", "os.fork", RuntimeWarning)
        pid = os.fork()
    if pid == 0:  # the child: a thread of its own, and none of the parent's releases
        try:
            releases.submit(lambda: os.write(write, b"child"))
            ok = releases.flush(10) and not parents
            os.write(write, b" ok" if ok else b" bad")
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        said = f.read()
    os.waitpid(pid, 0)
    assert said == b"child ok", said
    block.set()
    assert releases.flush(10) and parents == [os.getpid()]
