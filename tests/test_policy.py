"""The client policy alone (worker/inprocess/policy.py): driven with
scripted answers, as httpx's tests drive its auth flows, with no server and
no client. Each test lists the steps the policy takes and what each is
answered; the script fails a test that takes another step."""

from __future__ import annotations

import asyncio
import hashlib

import pytest

from compilecast import validate
from compilecast.deadline import Deadline
from compilecast.errors import (
    AlreadyPublished,
    CorruptBlob,
    NotFound,
    TooMany,
    Unavailable,
)
from compilecast.v1 import cache_pb2 as pb
from compilecast.worker.inprocess import policy
from compilecast.worker.inprocess.identity import Identity

KEY = "cc1-step"
DATA = b"a serialized executable"
INFO = pb.ArtifactInfo(key=KEY, digest=hashlib.sha256(DATA).hexdigest(), size=len(DATA))
LEASE = pb.Lease(id=7, ttl_seconds=30)
ME = Identity()
WITHIN = Deadline.after_s(60.0)  # the door's share-binary deadline, made once


class Script:
    """A shell that expects the steps of `script` in order, each a pair
    (the step's op, its answer: a value to send, or an exception to throw
    in), and records the steps it was given."""

    def __init__(self, *script: tuple[str, object]) -> None:
        self.script = list(script)
        self.steps: list[policy.Step] = []

    def _take(self, step: policy.Step) -> object:
        self.steps.append(step)
        assert self.script, f"an unexpected step: {step}"
        op, answer = self.script.pop(0)
        assert step.op == op, f"expected {op}, the policy took {step}"
        if isinstance(answer, BaseException):
            raise answer
        return answer

    ask = await_ = fetch = publish = release = describe = _take

    def done(self) -> bool:
        return not self.script


class AsyncScript:
    """The same script as an asynchronous shell (the gate's)."""

    def __init__(self, *script: tuple[str, object]) -> None:
        self.sync = Script(*script)

    async def _take(self, step: policy.Step) -> object:
        return self.sync._take(step)

    ask = await_ = fetch = publish = release = describe = _take


def hit(info: pb.ArtifactInfo = INFO) -> pb.AcquireResponse:
    return pb.AcquireResponse(decision=pb.HIT, artifact=info)


def decide(shell: Script, *, may_publish: bool = True) -> policy.Decision:
    got = policy.drive(policy.decide(policy.acquire_request(KEY, ME), ME, WITHIN,
                                     may_publish=may_publish), shell)
    assert shell.done(), f"steps left untaken: {shell.script}"
    return got


def test_a_hit_is_fetched_and_its_bytes_returned():
    shell = Script(("ask", hit()), ("fetch", DATA))
    got = decide(shell)
    assert (got.kind, got.data, got.waited) == ("HIT", DATA, False)
    assert shell.steps[1] == policy.Fetch(KEY, INFO.digest)


def test_a_wait_that_ends_with_the_bytes_needs_no_fetch():
    shell = Script(("ask", pb.AcquireResponse(decision=pb.WAIT)),
                   ("await_", (pb.WaitEvent(decision=pb.HIT, artifact=INFO), DATA)))
    got = decide(shell)
    assert (got.kind, got.data, got.waited) == ("HIT", DATA, True)
    assert shell.steps[1] == policy.Await(KEY, ME, WITHIN)


def test_a_wait_that_ends_as_the_holder_publishes_fetches_what_it_publishes():
    # WAIT with an artifact: its upload began; fetched as a HIT's.
    shell = Script(("ask", pb.AcquireResponse(decision=pb.WAIT)),
                   ("await_", (pb.WaitEvent(decision=pb.WAIT, artifact=INFO), None)),
                   ("fetch", DATA))
    assert decide(shell).kind == "HIT"


def test_a_waiter_promoted_when_the_holder_died_compiles():
    shell = Script(("ask", pb.AcquireResponse(decision=pb.WAIT)),
                   ("await_", (pb.WaitEvent(decision=pb.COMPILE, lease=LEASE), None)))
    got = decide(shell)
    assert (got.kind, got.lease, got.promoted, got.waited) == ("COMPILE", LEASE, True, True)


def test_a_wait_past_the_share_binary_timeout_compiles_locally_and_says_why():
    why = "share-binary timeout of 60.0s passed; compile locally"
    shell = Script(("ask", pb.AcquireResponse(decision=pb.WAIT)),
                   ("await_", (pb.WaitEvent(decision=pb.COMPILE_LOCALLY, reason=why), None)))
    got = decide(shell)
    assert (got.kind, got.reason, got.waited) == ("LOCAL", why, True)


@pytest.mark.parametrize("bad", [CorruptBlob("the host cache's copy hashes otherwise"),
                                 NotFound("purged")])
def test_a_corrupt_or_gone_copy_is_asked_for_again(bad):
    shell = Script(("ask", hit()), ("fetch", bad), ("ask", hit()), ("fetch", DATA))
    got = decide(shell)
    assert (got.kind, got.data) == ("HIT", DATA)


def test_a_copy_corrupt_at_every_ask_raises_to_the_door_which_compiles():
    bad = CorruptBlob("corrupt")
    shell = Script(*[step for _ in range(policy.CORRUPT_ASKS)
                     for step in (("ask", hit()), ("fetch", bad))])
    with pytest.raises(CorruptBlob):
        decide(shell)
    assert shell.done()


def test_a_corrupt_copy_then_a_lease_compiles_in_its_place():
    shell = Script(("ask", hit()), ("fetch", CorruptBlob("corrupt")),
                   ("ask", pb.AcquireResponse(decision=pb.COMPILE, lease=LEASE)))
    assert decide(shell).kind == "COMPILE"


def test_a_caller_that_may_not_publish_gives_a_lease_back_and_compiles_locally():
    shell = Script(("ask", pb.AcquireResponse(decision=pb.COMPILE, lease=LEASE)),
                   ("release", None))
    got = decide(shell, may_publish=False)
    assert got.kind == "LOCAL" and "no token" in got.reason
    released = shell.steps[1]
    assert isinstance(released, policy.Release) and released.reason == pb.ABANDONED


def test_a_lease_given_back_in_vain_still_compiles_locally():
    shell = Script(("ask", pb.AcquireResponse(decision=pb.COMPILE, lease=LEASE)),
                   ("release", Unavailable("the worker restarts")))
    assert decide(shell, may_publish=False).kind == "LOCAL"


def test_a_local_answer_keeps_its_reason_and_cause():
    shell = Script(("ask", pb.AcquireResponse(decision=pb.COMPILE_LOCALLY,
                                              reason="below the min compile time",
                                              local_cause=pb.LOCAL_CAUSE_UNSPECIFIED)))
    got = decide(shell)
    assert (got.kind, got.reason) == ("LOCAL", "below the min compile time")


def test_an_ask_that_fails_raises_to_the_door():
    shell = Script(("ask", Unavailable("no worker")))
    with pytest.raises(Unavailable):
        decide(shell)


# -- settle ---------------------------------------------------------------------------

PUBLISH = policy.Publish(KEY, LEASE, DATA, 12.5, ME)


def settle(shell: Script, trace: dict | None = None) -> policy.Settled:
    got = policy.drive(policy.settle(PUBLISH, trace=trace), shell)
    assert shell.done(), f"steps left untaken: {shell.script}"
    return got


def test_a_publish_settles_the_lease():
    got = settle(Script(("publish", INFO)))
    assert (got.published, got.artifact) == (True, INFO)


def test_a_publish_taken_already_by_the_same_bytes_is_this_one():
    # An earlier try's answer was lost, or a hedge made the same bytes.
    shell = Script(("publish", AlreadyPublished("taken")),
                   ("describe", pb.DescribeKeyResponse(artifact=INFO)))
    got = settle(shell)
    assert (got.published, got.artifact) == (True, INFO)
    assert shell.steps[1] == policy.Describe(KEY)


@pytest.mark.parametrize("described", [
    pb.DescribeKeyResponse(artifact=pb.ArtifactInfo(key=KEY, digest="0" * 64)),
    Unavailable("cannot describe"),
])
def test_a_publish_taken_by_other_bytes_gives_the_lease_back(described):
    shell = Script(("publish", AlreadyPublished("taken")), ("describe", described),
                   ("release", None))
    got = settle(shell)
    assert (got.published, got.released) == (False, True)
    assert shell.steps[2].reason == pb.ABANDONED


def test_a_publish_refused_for_what_it_is_releases_as_refused_so_waiters_compile_now():
    shell = Script(("publish", TooMany("larger than the store takes")), ("release", None))
    got = settle(shell, trace={"traceparent": "00-ab"})
    assert (got.published, got.released) == (False, True)
    released = shell.steps[1]
    assert released.reason == pb.PUBLISH_REFUSED and released.trace == {"traceparent": "00-ab"}
    assert "larger than the store takes" in got.problem


def test_a_publish_that_fails_otherwise_abandons_the_lease_for_a_waiter():
    shell = Script(("publish", Unavailable("the coordinator went away")), ("release", None))
    got = settle(shell)
    assert shell.steps[1].reason == pb.ABANDONED and not got.published


def test_a_release_that_fails_leaves_the_lease_to_lapse():
    shell = Script(("publish", Unavailable("gone")), ("release", Unavailable("still gone")))
    got = settle(shell)
    assert (got.published, got.released) == (False, False)


def test_a_release_s_detail_is_cut_to_what_the_wire_takes():
    shell = Script(("publish", Unavailable("x" * 5000)), ("release", None))
    settle(shell)
    assert len(shell.steps[1].detail) == validate.MAX_DETAIL_LEN


# -- the rules every door shares ----------------------------------------------------------

def test_only_a_job_s_designated_process_sends_the_key_s_components():
    components = {"program": "abc"}
    designated = Identity(job="j", process_id=0, designated_process=0)
    other = Identity(job="j", process_id=3, designated_process=0)
    alone = Identity()
    assert policy.acquire_request(KEY, designated, components=components).key_components
    assert not policy.acquire_request(KEY, other, components=components).key_components
    assert policy.acquire_request(KEY, alone, components=components).key_components


def test_a_lease_is_renewed_at_a_third_of_its_ttl_and_never_more_often_than_the_floor():
    assert policy.keepalive_every(pb.Lease(ttl_seconds=30)) == 10.0
    assert policy.keepalive_every(pb.Lease(ttl_seconds=0)) == policy.KEEPALIVE_MIN_S


def test_the_async_shell_drives_the_same_policy():
    shell = AsyncScript(("ask", hit()), ("fetch", CorruptBlob("bad")), ("ask", hit()),
                        ("fetch", DATA))
    got = asyncio.run(policy.adrive(
        policy.decide(policy.acquire_request(KEY, ME), ME, WITHIN), shell))
    assert (got.kind, got.data) == ("HIT", DATA) and shell.sync.done()
