"""Compile-only TPU topologies as users name them.

`--topology` (precompile, the farm, scripts/pod_key_check.py) takes what a
user of Cloud TPU types:

- an accelerator type: ``v5litepod-N`` or ``v5e-N``, ``v6e-N`` (N chips: 1, 4,
  8, 16, 32, 64, 128, 256), ``v4-N`` or ``v5p-N`` (N TensorCores, two a chip:
  8 to 8192, powers of two);
- or libtpu's own name, FAMILY:SHAPE (``v5e:4x4``, ``v5p:4x4x12``);

then, optionally, comma-separated options as MaxText's ``train_compile``
passes them: ``chips_per_host_bounds=AxBxC``, ``wrap=true.true.false``,
``num_slices=N`` (a multislice job of N such slices).

Each resolves to one canonical spec (the Target's topology, as recipes and
the farm carry it) and the arguments of
``jax.experimental.topologies.get_topology_desc``. A slice smaller than one
host (v5e:1x1, a v5litepod-8's 2x4) gets its own shape as the host's bounds:
older libtpu releases (0.0.42) refuse a v5e:1x1 under their default bounds of
2x2x1. Nothing here imports JAX.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from compilecast.errors import InvalidRequest

# Two-dimensional slices (v5e, v6e), by chips.
PLANE_SHAPES = {1: (1, 1), 4: (2, 2), 8: (2, 4), 16: (4, 4), 32: (4, 8), 64: (8, 8),
                128: (8, 16), 256: (16, 16)}
PLANE_HOST_CHIPS = 8  # a v5e or v6e host's most chips (ct5lp-hightpu-8t)
# Three-dimensional slices (v4, v5p), by chips (the accelerator type counts cores).
CUBE_SHAPES = {4: (2, 2, 1), 8: (2, 2, 2), 16: (2, 2, 4), 32: (2, 4, 4), 64: (4, 4, 4),
               128: (4, 4, 8), 256: (4, 8, 8), 512: (8, 8, 8), 1024: (8, 8, 16),
               2048: (8, 16, 16), 4096: (16, 16, 16)}
DEFAULT_HOST_BOUNDS = (2, 2, 1)  # libtpu's: four chips a host
# Accelerator-type prefix -> libtpu's family name.
PLANE_FAMILIES = {"v5litepod": "v5e", "v5e": "v5e", "v6e": "v6e"}
CUBE_FAMILIES = {"v4": "v4", "v5p": "v5p"}
FAMILY_ALIASES = {"v5": "v5p", "v5litepod": "v5e"}
FAMILIES = ("v4", "v5e", "v5p", "v6e")
MAX_SLICES = 1024
NAME_RE = re.compile(r"([a-z][0-9a-z]*)-([0-9]{1,5})\Z")
SHAPE_RE = re.compile(r"([a-z][0-9a-z]*):([0-9]{1,3}(?:x[0-9]{1,3}){1,2})\Z")
BOUNDS_RE = re.compile(r"[0-9]{1,3}x[0-9]{1,3}x[0-9]{1,3}\Z")


class TopologyError(InvalidRequest):
    """A topology nobody makes: the one line says which names exist."""


def names() -> list[str]:
    """Every accelerator type this module knows, as Cloud TPU spells it."""
    out = [f"{prefix}-{chips}" for prefix in PLANE_FAMILIES for chips in PLANE_SHAPES]
    out += [f"{prefix}-{2 * chips}" for prefix in CUBE_FAMILIES for chips in CUBE_SHAPES]
    return out


NAMES_HELP = ("use an accelerator type (v5litepod-N, v5e-N or v6e-N with N chips: "
              f"{', '.join(map(str, PLANE_SHAPES))}; v4-N or v5p-N with N cores: "
              f"{', '.join(str(2 * c) for c in CUBE_SHAPES)}) or FAMILY:SHAPE "
              f"(families {', '.join(FAMILIES)}; e.g. v5e:4x4, v5p:4x4x12), then options "
              "',chips_per_host_bounds=AxBxC', ',wrap=true.true.false', ',num_slices=N'")


@dataclass(frozen=True)
class Topology:
    name: str  # libtpu's: v5e:4x4
    chips_per_host_bounds: tuple[int, int, int]
    wrap: tuple[bool, bool, bool] | None = None
    num_slices: int = 1

    @property
    def family(self) -> str:
        return self.name.split(":", 1)[0]

    @property
    def chips(self) -> int:
        n = 1
        for d in self.name.split(":", 1)[1].split("x"):
            n *= int(d)
        return n * self.num_slices

    def spec(self) -> str:
        """The canonical spec: the name, then each option that is not
        libtpu's default."""
        parts = [self.name]
        if self.chips_per_host_bounds != DEFAULT_HOST_BOUNDS:
            parts.append("chips_per_host_bounds=" + "x".join(map(str, self.chips_per_host_bounds)))
        if self.wrap is not None:
            parts.append("wrap=" + ".".join("true" if w else "false" for w in self.wrap))
        if self.num_slices != 1:
            parts.append(f"num_slices={self.num_slices}")
        return ",".join(parts)

    def kwargs(self) -> dict[str, object]:
        """get_topology_desc's arguments besides the name and platform."""
        kw: dict[str, object] = {"chips_per_host_bounds": self.chips_per_host_bounds}
        if self.family in CUBE_FAMILIES.values():
            kw["chip_config_name"] = "megacore"  # one device a chip, both cores
        if self.wrap is not None:
            kw["wrap"] = self.wrap
        if self.num_slices != 1:
            kw["num_slices"] = self.num_slices
        return kw


def _fail(spec: str, why: str) -> TopologyError:
    return TopologyError(f"topology {spec[:80]!r}: {why}; {NAMES_HELP}")


def _bounds(shape: tuple[int, ...]) -> tuple[int, int, int]:
    """A slice's shape as the bounds of the one host that holds it all."""
    return (shape[0], shape[1], shape[2] if len(shape) == 3 else 1)


def _base(spec: str, head: str) -> tuple[str, tuple[int, int, int]]:
    """(libtpu name, host bounds) of an accelerator type or FAMILY:SHAPE.
    An accelerator type that one host holds (v5litepod-8: one VM of 8
    chips) is one host; FAMILY:SHAPE has libtpu's four chips a host, unless
    it is smaller than that (v5e:1x1)."""
    if m := NAME_RE.match(head):
        prefix, n = m.group(1), int(m.group(2))
        if prefix in PLANE_FAMILIES:
            if n not in PLANE_SHAPES:
                raise _fail(spec, f"{prefix} slices have {', '.join(map(str, PLANE_SHAPES))} "
                                  f"chips, not {n}")
            plane = PLANE_SHAPES[n]
            return (f"{PLANE_FAMILIES[prefix]}:{plane[0]}x{plane[1]}",
                    _bounds(plane) if n <= PLANE_HOST_CHIPS else DEFAULT_HOST_BOUNDS)
        if prefix in CUBE_FAMILIES:
            if n % 2 or n // 2 not in CUBE_SHAPES:
                raise _fail(spec, f"{prefix}-N counts TensorCores, two a chip: "
                                  f"{', '.join(str(2 * c) for c in CUBE_SHAPES)}, not {n}")
            cube = CUBE_SHAPES[n // 2]
            return f"{CUBE_FAMILIES[prefix]}:{'x'.join(map(str, cube))}", DEFAULT_HOST_BOUNDS
        raise _fail(spec, f"no accelerator type {prefix}")
    if m := SHAPE_RE.match(head):
        family = FAMILY_ALIASES.get(m.group(1), m.group(1))
        dims = tuple(int(d) for d in m.group(2).split("x"))
        if family not in FAMILIES:
            raise _fail(spec, f"no TPU family {m.group(1)}")
        if len(dims) != (2 if family in ("v5e", "v6e") else 3) or 0 in dims:
            raise _fail(spec, f"a {family} shape has {2 if family in ('v5e', 'v6e') else 3} "
                              "dimensions of at least 1")
        chips = 1
        for d in dims:
            chips *= d
        return f"{family}:{m.group(2)}", _bounds(dims) if chips < 4 else DEFAULT_HOST_BOUNDS
    raise _fail(spec, "not a name this knows")


def resolve(spec: str) -> Topology:
    """The topology of a user's spec; TopologyError (one line) when none."""
    head, *options = [p.strip() for p in spec.strip().split(",")]
    name, bounds = _base(spec, head.lower())
    wrap: tuple[bool, bool, bool] | None = None
    slices = 1
    seen: set[str] = set()
    for option in options:
        key, sep, value = option.partition("=")
        if not sep or key in seen:
            raise _fail(spec, f"option {option[:40]!r} is not key=value, once each")
        seen.add(key)
        if key == "chips_per_host_bounds":
            if not BOUNDS_RE.match(value) or "0" in value.split("x"):
                raise _fail(spec, f"chips_per_host_bounds {value[:20]!r} is not AxBxC")
            a, b, c = (int(d) for d in value.split("x"))
            bounds = (a, b, c)
        elif key == "wrap":
            flags = value.lower().split(".")
            if len(flags) != 3 or not set(flags) <= {"true", "false"}:
                raise _fail(spec, f"wrap {value[:30]!r} is not three of true/false, "
                                  "dot-separated")
            wrap = (flags[0] == "true", flags[1] == "true", flags[2] == "true")
        elif key == "num_slices":
            if not value.isdigit() or not 1 <= int(value) <= MAX_SLICES:
                raise _fail(spec, f"num_slices {value[:10]!r} is not 1 to {MAX_SLICES}")
            slices = int(value)
        else:
            raise _fail(spec, f"no option {key[:40]!r}")
    return Topology(name, bounds, wrap, slices)
