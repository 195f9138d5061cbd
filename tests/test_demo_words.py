"""`make demo`'s summary says what its figures show, whatever they are."""

from __future__ import annotations

from compilecast.demo import compared, summary


def reports(seconds: list[float], compiles: list[int]) -> list[dict]:
    return [{"seconds": s, "xla_compiles": c} for s, c in zip(seconds, compiles, strict=True)]


def test_each_run_is_compared_with_the_run_without_compilecast_as_measured(capsys):
    # The figures of a busy machine: the first run as slow as without, a restart far faster.
    summary([("without compilecast", reports([27.0, 26.0], [1, 1])),
             ("compilecast, first run", reports([26.75, 26.0], [1, 0])),
             ("compilecast, a restart", reports([9.75, 9.0], [0, 0]))])
    out = capsys.readouterr().out
    assert "compilecast, first run: about the time without compilecast (0.99x)" in out
    assert "compilecast, a restart: 0.36x the time without compilecast (17.25s less)" in out
    assert "saved up to 2 of 2 XLA compiles" in out
    assert "nearly as much" not in out


def test_a_slower_run_is_called_slower():
    assert compared("x", 12.0, 10.0) == "x: 1.20x the time without compilecast (2.00s more)"
    assert compared("x", 10.2, 10.0) == "x: about the time without compilecast (1.02x)"
