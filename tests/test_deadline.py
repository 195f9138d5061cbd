"""A wait's share-binary timeout as one value from the door to the wait
(compilecast/deadline.py): made once, asked what is left, said on the wire
as what is left."""

from __future__ import annotations

import time

from compilecast import retry
from compilecast.deadline import Deadline
from compilecast.errors import Unavailable


def test_a_deadline_says_what_is_left_and_the_wire_s_zero_is_unbounded():
    d = Deadline.after_s(60.0)
    assert d.bounded and not d.passed
    assert 59.0 < d.left_s() <= 60.0 and 59_000 < d.left_ms() <= 60_000
    assert d.said() == "60.0s"  # (its length, whatever is left)
    gone = Deadline(time.monotonic() - 1, 5.0)
    assert gone.passed and gone.left_s() == 0.0
    assert gone.left_ms() == 1  # bounded: never 0 on the wire (0 is "the server's own")
    forever = Deadline.after_ms(0)
    assert not forever.bounded and forever.left_ms() == 0 and not forever.passed
    assert Deadline.after_ms(1500).length_s == 1.5
    assert Deadline.of(d) is d and Deadline.of(2.0).length_s == 2.0


def test_a_retry_is_not_tried_past_the_deadline_it_shares():
    tries = []

    def cut_off() -> None:
        tries.append(time.monotonic())
        raise Unavailable("the replica went away")

    policy = retry.Retry("test", (0.01, 0.01, 0.01), lambda exc: True)
    try:
        policy.run(cut_off, what="a wait", deadline=Deadline.after_s(60.0), sleep=lambda s: None)
    except Unavailable:
        pass
    assert len(tries) == 4  # every pause fits before the deadline
    tries.clear()
    try:
        policy.run(cut_off, what="a wait", deadline=Deadline(time.monotonic(), 1.0),
                   sleep=lambda s: None)
    except Unavailable:
        pass
    assert len(tries) == 1  # none fits: no second try
