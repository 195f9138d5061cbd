"""`compilecast key` and `compilecast explain` on program files: one line
per file like sha256sum, a readable error for what is not a program."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from .conftest import cc


def _fixture(name: str) -> str:
    from pathlib import Path

    return str(Path(__file__).parent / "fixtures" / "torch_xla" / name)


def test_key_prints_one_line_per_file_like_sha256sum(tmp_path):
    from compilecast.worker.keylib.keys import program_key

    files = [_fixture(n) for n in ("mlp.hlo.pb", "mlp_moved_lines.hlo.pb", "mlp_wider.hlo.pb")]
    r = cc("key", *files)
    assert r.returncode == 0, r.stderr
    lines = [line.split("  ") for line in r.stdout.splitlines()]
    assert [path for _, path in lines] == files
    with open(files[0], "rb") as f:
        assert lines[0][0] == program_key(f.read()).value
    assert lines[0][0] == lines[1][0]  # moved source lines: the same key
    assert lines[0][0] != lines[2][0]  # a wider layer: another


def test_key_reads_standard_input_as_dash():
    path = _fixture("mlp.hlo.pb")
    with open(path, "rb") as f:
        data = f.read()
    r = subprocess.run([sys.executable, "-m", "compilecast.cli", "key", "-", path],
                       input=data, capture_output=True, timeout=60)
    assert r.returncode == 0, r.stderr
    (from_stdin, dash), (from_file, named) = (line.split(b"  ") for line in r.stdout.splitlines())
    assert (dash, named) == (b"-", path.encode())
    assert from_stdin == from_file and from_stdin.startswith(b"cc1-")


def test_key_goes_on_past_a_file_it_cannot_read(tmp_path):
    good = _fixture("mlp.hlo.pb")
    missing = tmp_path / "gone.pb"
    r = cc("key", str(missing), str(tmp_path), good)
    assert r.returncode == 1
    assert r.stdout.count("\n") == 1 and r.stdout.rstrip().endswith(f"  {good}")
    assert f"compilecast: cannot read {missing}: No such file or directory" in r.stderr
    assert f"compilecast: cannot read {tmp_path}: Is a directory" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("content", [b"", b"not a program\n", bytes(range(256)) * 4])
def test_key_refuses_a_file_that_is_not_a_program(tmp_path, content):
    junk = tmp_path / "notes.bin"
    junk.write_bytes(content)
    good = _fixture("mlp.hlo.pb")
    r = cc("key", str(junk), good)
    assert r.returncode == 1
    assert r.stdout.count("\n") == 1 and r.stdout.rstrip().endswith(f"  {good}")
    assert r.stderr.startswith(f"compilecast: {junk}: not a program (") and \
        r.stderr.rstrip().endswith("; --raw keys its bytes") and r.stderr.count("\n") == 1
    raw = cc("key", "--raw", str(junk))
    assert raw.returncode == 0 and f"  {junk}  (unparsed, keyed by raw bytes: " in raw.stdout


def test_key_says_why_a_damaged_program_was_not_parsed(tmp_path):
    """A dump cut short is not a program: it says what the parser found
    wrong (with --raw, it is keyed by its raw bytes); the whole dump is
    parsed and says nothing."""
    whole = _fixture("mlp.hlo.pb")
    with open(whole, "rb") as f:
        data = f.read()
    cut = tmp_path / "cut.hlo.pb"
    cut.write_bytes(data[:len(data) // 2])
    r = cc("key", whole, str(cut))
    assert r.returncode == 1
    assert r.stdout.rstrip().endswith(f"  {whole}")
    assert "not valid hlo-proto: field runs past the end of its message" in r.stderr
    r = cc("key", "--raw", whole, str(cut))
    assert r.returncode == 0, r.stderr
    first, second = r.stdout.splitlines()
    assert first.endswith(f"  {whole}")
    assert second.endswith(f"  {cut}  (unparsed, keyed by raw bytes: not valid hlo-proto: "
                           "field runs past the end of its message)"), second


def test_key_of_hlo_text_says_to_dump_protos(tmp_path):
    """XLA's default dump is HLO text, whose printer elides large constants:
    not keyed canonically, and told how to get a canonical key (with --raw,
    keyed by its raw bytes: never two programs on one key)."""
    text = tmp_path / "module_0001.jit_f.before_optimizations.txt"
    text.write_text("HloModule jit_f, entry_computation_layout={(f32[4]{0})->f32[4]{0}}\n\n"
                    "ENTRY main.3 {\n  Arg_0.1 = f32[4]{0} parameter(0)\n"
                    "  ROOT sine.2 = f32[4]{0} sine(Arg_0.1)\n}\n")
    r = cc("key", str(text))
    assert r.returncode == 1 and "--xla_dump_hlo_as_proto" in r.stderr
    r = cc("key", "--raw", str(text))
    assert r.returncode == 0, r.stderr
    assert r.stdout.endswith(f"  {text}  (unparsed, keyed by raw bytes: HLO text is not keyed "
                             "canonically (its printer elides large constants); dump with "
                             "--xla_dump_hlo_as_proto)\n"), r.stdout


def test_explain_two_files(tmp_path):
    same = cc("explain", _fixture("mlp.hlo.pb"), _fixture("mlp_other_file.hlo.pb"))
    assert same.returncode == 0 and same.stdout.startswith("same key cc1-"), same.stderr
    differ = cc("explain", _fixture("mlp.hlo.pb"), _fixture("mlp_gelu.hlo.pb"))
    assert differ.returncode == 1, differ.stderr
    out = differ.stdout
    assert "component program differs" in out
    assert "first differing operation" in out
    # the constant that makes it a GELU, on the two sides
    minus = [line for line in out.splitlines() if line.startswith("  - ")]
    plus = [line for line in out.splitlines() if line.startswith("  + ")]
    assert any("constant dense<0.000000e+00>" in line for line in minus), out
    assert any("constant dense<5.000000e-01>" in line for line in plus), out


def test_explain_an_unreadable_file_is_a_readable_error(tmp_path):
    r = cc("explain", _fixture("mlp.hlo.pb"), str(tmp_path / "gone.pb"))
    assert r.returncode == 2
    assert "cannot read" in r.stderr and "Traceback" not in r.stderr


def test_key_of_a_device_without_end_reads_a_bounded_amount():
    r = subprocess.run([sys.executable, "-m", "compilecast.cli", "key", "/dev/zero"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 1 and "more than 2 GiB from a stream or device" in r.stderr
    assert "Traceback" not in r.stderr


def test_key_refuses_a_native_setting_it_does_not_know():
    r = subprocess.run([sys.executable, "-m", "compilecast.cli", "key", _fixture("mlp.hlo.pb")],
                       capture_output=True, text=True, timeout=120,
                       env={**os.environ, "COMPILECAST_KEY_NATIVE": "maybe"})
    assert r.returncode == 2 and "COMPILECAST_KEY_NATIVE='maybe'" in r.stderr
