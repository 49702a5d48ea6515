"""Collectives of a compiled program, read from its HLO text: what a step communicates.

``jax.jit(f).lower(...).compile().as_text()`` is the program after SPMD partitioning:
every all-reduce, all-gather, reduce-scatter, all-to-all and collective-permute that a
sharding costs is written there, in every computation (fusions, loop bodies and called
computations included). Each is counted once where it is written (a collective inside
a loop body runs once per iteration but is listed once) with the bytes of its result:
an all-gather counts the gathered size, a tuple all-reduce every operand, an
asynchronous ``*-start`` its output buffer only.
"""

from __future__ import annotations

import dataclasses
import math
import re

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")

# "%name = TYPE kind(" or "ROOT %name = TYPE kind-start(": TYPE may be a tuple with
# /*index=N*/ comments, so it is everything between "= " and the op name.
_OP = re.compile(r"=\s*(?P<type>.*?)\s(?P<kind>" + "|".join(KINDS) + r")(?P<start>-start)?\(")
_ARRAY = re.compile(r"\b(?P<dtype>pred|[a-z]+\d+[a-z0-9]*)\[(?P<dims>[\d,]*)\]")


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective operation of the HLO.

    Attributes:
      kind: one of ``KINDS``.
      shapes: (dtype, dims) of each result buffer it counts.
      bytes: total bytes of those buffers.
      line: the HLO instruction, for reading which values it moves.
    """
    kind: str
    shapes: tuple[tuple[str, tuple[int, ...]], ...]
    bytes: int
    line: str


def _itemsize(dtype: str) -> int:
    if dtype == "pred":
        return 1
    bits = int(re.match(r"[a-z]+(\d+)", dtype).group(1))
    return max(1, bits // 8)


def _arrays(text: str) -> list[tuple[str, tuple[int, ...]]]:
    return [(m["dtype"], tuple(int(d) for d in m["dims"].split(",") if d))
            for m in _ARRAY.finditer(text)]


def collectives(hlo: str) -> list[Collective]:
    """Every collective instruction of a compiled HLO text, in order.

    Args:
      hlo: ``compiled.as_text()`` of a jitted function.
    """
    found = []
    for line in hlo.splitlines():
        match = _OP.search(line)
        if match is None:
            continue
        shapes = _arrays(match["type"])
        if match["start"] and match["kind"] in ("all-gather", "collective-permute"):
            # (operands..., outputs...[, sync flags]): the outputs are what moved
            arrays = [s for s in shapes if s[1]] or shapes
            shapes = arrays[len(arrays) // 2:] if match["kind"] == "all-gather" else arrays[1:2]
        size = sum(math.prod(dims) * _itemsize(dtype) for dtype, dims in shapes)
        found.append(Collective(match["kind"], tuple(shapes), size, line.strip()))
    return found


def summarize(found: list[Collective]) -> dict[str, dict[str, int]]:
    """kind -> {"count": instructions, "operands": buffers, "bytes": total} for every kind."""
    out = {kind: {"count": 0, "operands": 0, "bytes": 0} for kind in KINDS}
    for c in found:
        out[c.kind]["count"] += 1
        out[c.kind]["operands"] += len(c.shapes)
        out[c.kind]["bytes"] += c.bytes
    return out


def total_bytes(found: list[Collective]) -> int:
    """Bytes of every collective together."""
    return sum(c.bytes for c in found)


def describe(found: list[Collective], width: int = 240) -> str:
    """A readable list: counts and bytes per kind, then each instruction (cut at ``width``)."""
    lines = []
    for kind, s in summarize(found).items():
        lines.append(f"{kind}: {s['count']} ({s['operands']} buffers, {s['bytes']:,} bytes)")
        lines.extend(f"    {c.line[:width]}" for c in found if c.kind == kind)
    return "\n".join(lines)
