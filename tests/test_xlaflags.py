"""The xla_flags key component: XLA's flags as XLA reads them.

The parser is checked against XLA itself: a JAX process started with a
repeated flag, or with XLA_FLAGS naming a file, shows which value XLA used.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from compilecast.worker.keylib import keys
from compilecast.worker.xla import xlaflags

DEVICES = "import jax; print(jax.device_count())"


def _xla_device_count(xla_flags: str) -> int:
    env = dict(os.environ, XLA_FLAGS=xla_flags, JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", DEVICES], env=env, capture_output=True,
                         text=True, timeout=120, check=True)
    return int(out.stdout.split()[-1])


def _component(monkeypatch: pytest.MonkeyPatch, **env: str) -> str:
    for var in xlaflags.ENV_VARS:
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    return "\n".join(keys.xla_flags())


def test_split_follows_xla_quoting_rules():
    flags, rest = xlaflags.split_flags(
        ' --a=1\t--b="x y" --c=\'p "q"\' --d="e\\"f" -e  stop --f=2 ')
    assert flags == ["--a=1", "--b=x y", '--c=p "q"', '--d=e"f', "-e"]
    assert rest == "stop --f=2"


def test_an_unterminated_quote_runs_to_the_end():
    assert xlaflags.split_flags('--a="x y') == (["--a=x y"], "")


def test_xla_applies_the_last_of_a_repeated_flag():
    # The model the key relies on, checked against XLA itself.
    assert _xla_device_count("--xla_force_host_platform_device_count=2 "
                             "--xla_force_host_platform_device_count=3") == 3


def test_xla_reads_flags_from_a_file_named_by_the_variable(tmp_path):
    flag_file = tmp_path / "flags"
    flag_file.write_text("--xla_force_host_platform_device_count=5\n")
    assert _xla_device_count(str(flag_file)) == 5


def test_the_order_of_a_repeated_flag_changes_the_key(monkeypatch):
    a = _component(monkeypatch, XLA_FLAGS="--xla_cpu_enable_fast_math=true "
                                          "--xla_cpu_enable_fast_math=false")
    b = _component(monkeypatch, XLA_FLAGS="--xla_cpu_enable_fast_math=false "
                                          "--xla_cpu_enable_fast_math=true")
    assert a != b
    assert a == _component(monkeypatch, XLA_FLAGS="--xla_cpu_enable_fast_math=false")


def test_the_order_of_different_flags_does_not(monkeypatch):
    assert _component(monkeypatch, XLA_FLAGS="--xla_a=1 --xla_b=2") == \
        _component(monkeypatch, XLA_FLAGS=" --xla_b=2\n--xla_a=1")


def test_words_of_quoted_values_cannot_be_reshuffled(monkeypatch):
    one, other = '--xla_a="x y" --xla_b="z w"', '--xla_a="x w" --xla_b="z y"'
    assert sorted(one.split()) == sorted(other.split())  # sorting raw words made these one key
    assert _component(monkeypatch, XLA_FLAGS=one) != _component(monkeypatch, XLA_FLAGS=other)


def test_a_flag_file_is_keyed_by_what_it_holds(monkeypatch, tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    one.write_text("--xla_cpu_enable_fast_math=true\n")
    two.write_text("--xla_cpu_enable_fast_math=false\n")
    in_file = _component(monkeypatch, XLA_FLAGS=str(one))
    assert in_file != _component(monkeypatch, XLA_FLAGS=str(two))
    assert in_file == _component(monkeypatch, XLA_FLAGS="--xla_cpu_enable_fast_math=true")


def test_an_unreadable_flag_file_is_its_own_key(monkeypatch, tmp_path):
    missing = _component(monkeypatch, XLA_FLAGS=str(tmp_path / "missing"))
    assert "unreadable flag file" in missing
    assert missing != _component(monkeypatch)


def test_dump_flags_never_change_the_key(monkeypatch, tmp_path):
    plain = _component(monkeypatch, XLA_FLAGS="--xla_cpu_enable_fast_math=false")
    dumped = _component(monkeypatch, XLA_FLAGS=f"--xla_dump_to={tmp_path} --xla_dump_hlo_as_proto "
                                               "--xla_cpu_enable_fast_math=false")
    assert plain == dumped


def test_each_variable_is_its_own_namespace(monkeypatch):
    assert _component(monkeypatch, XLA_FLAGS="--xla_a=1") != \
        _component(monkeypatch, LIBTPU_INIT_ARGS="--xla_a=1")


def test_words_xla_ignores_still_count(monkeypatch):
    # XLA stops at `stop`; a parser that disagreed with XLA's must cost a miss.
    assert _component(monkeypatch, XLA_FLAGS="--xla_a=1 stop --xla_b=2") != \
        _component(monkeypatch, XLA_FLAGS="--xla_a=1 stop")


def test_xla_words_on_the_command_line_count_as_in_jax():
    assert xlaflags.describe(environ={}, argv=["train.py", "--xla_a=1", "--steps=3"]) == \
        ["argv: --xla_a=1"]


def test_a_fifo_named_as_flag_file_never_hangs_the_process(monkeypatch, tmp_path):
    fifo = tmp_path / "flags.fifo"
    os.mkfifo(fifo)
    assert "not a regular file" in _component(monkeypatch, XLA_FLAGS=str(fifo))
