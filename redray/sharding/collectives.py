"""Collectives of a compiled program, read from its HLO text: what a step communicates.

``jax.jit(f).lower(...).compile().as_text()`` is the program after SPMD partitioning:
every all-reduce, all-gather, reduce-scatter, all-to-all and collective-permute that a
sharding costs is written there, in every computation (fusions, loop bodies and called
computations included). ``collectives`` lists each once where it is written (a
collective inside a loop body runs once per iteration but is listed once; ``counted``
weighs each by how often it runs) with the bytes of its result:
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



_HEADER = re.compile(r"^(?P<entry>ENTRY\s+)?%?(?P<name>[\w.\-]+)\s.*\{\s*$")
_CALLED = re.compile(r"(?:calls|to_apply|branch_computations)=\{?(?P<names>[%\w.\-, ]+)")
_BODY = re.compile(r"body=%?(?P<name>[\w.\-]+)")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(?P<n>\d+)"')


def _computations(hlo: str) -> tuple[str | None, dict[str, list[str]]]:
    """(the entry's name, each computation's name -> its instruction lines)."""
    body: dict[str, list[str]] = {}
    entry = current = None
    for line in hlo.splitlines():
        header = _HEADER.match(line) if line[:1] not in (" ", "\t", "") else None
        if header:
            current = header["name"]
            body[current] = []
            entry = current if header["entry"] else entry
        elif current is not None:
            body[current].append(line)
    return entry, body


def runs(hlo: str) -> dict[str, float]:
    """How often each computation of a compiled HLO text runs in one call of it: the
    entry once, a loop's body as often as its known trip count says (times the runs of
    the computation holding the loop), a called computation or a fusion's as often as
    its caller. A computation nothing reaches is left out."""
    return _runs(*_computations(hlo))


def _runs(entry: str | None, body: dict[str, list[str]]) -> dict[str, float]:
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    out: dict[str, float] = {}
    stack = [(entry, 1.0)]
    while stack:
        name, times = stack.pop()
        out[name] = out.get(name, 0.0) + times
        for line in body.get(name, ()):
            loop = _BODY.search(line)
            if loop and " while(" in line:
                trip = _TRIP.search(line)
                stack.append((loop["name"], times * (float(trip["n"]) if trip else 1.0)))
            for group in _CALLED.findall(line):
                stack += [(c.strip().lstrip("%"), times) for c in group.split(",")
                          if c.strip()]
    return out


def counted(hlo: str) -> list[tuple[Collective, float]]:
    """Every collective of a compiled HLO text with how often one call runs it: its
    computation's ``runs`` (a collective inside the gradient accumulation's loop, once
    per micro-batch)."""
    entry, body = _computations(hlo)
    times = _runs(entry, body)
    return [(c, times.get(name, 0.0)) for name, lines in body.items()
            for c in collectives("\n".join(lines))]


def weighed_bytes(hlo: str) -> dict[str, float]:
    """kind -> bytes one call of a compiled HLO text moves in collectives of that kind,
    each weighed by how often it runs (``counted``)."""
    out: dict[str, float] = {}
    for c, times in counted(hlo):
        out[c.kind] = out.get(c.kind, 0.0) + c.bytes * times
    return out

_GROUPS = re.compile(r"replica_groups=\{(\{[\d,]*\}(?:,\{[\d,]*\})*)\}")
_PAIRS = re.compile(r"source_target_pairs=\{(\{[\d,]*\}(?:,\{[\d,]*\})*)\}")
_IOTA = re.compile(r"replica_groups=\[(?P<shape>[\d,]+)\]<=\[(?P<dims>[\d,]+)\]"
                   r"(?:T\((?P<perm>[\d,]+)\))?")
_MESH = re.compile(r"replica_groups=mesh\[(?P<axes>[^\]]*)\]"
                   r"(?:,\s*device_ids=\(\[(?P<ids>[\d,]+)\](?:T\((?P<perm>[\d,]+)\))?\))?"
                   r"\s*\{(?P<over>[^}]*)\}")


def device_groups(c: Collective, devices: int) -> list[list[int]]:
    """The groups of (logical) devices a collective runs over: its replica groups
    (listed, iota, or mesh form with its device order), a collective-permute's
    (source, target) pairs, or every device (an empty replica group list)."""
    import numpy as np

    line = c.line
    for pattern in (_PAIRS, _GROUPS):
        m = pattern.search(line)
        if m:
            return [[int(x) for x in g.split(",") if x] for g in m.group(1)[1:-1].split("},{")]
    m = _IOTA.search(line)
    if m:
        shape = [int(x) for x in m["shape"].split(",")]
        ids = np.arange(math.prod(int(x) for x in m["dims"].split(","))).reshape(
            [int(x) for x in m["dims"].split(",")])
        if m["perm"]:
            ids = ids.transpose([int(x) for x in m["perm"].split(",")])
        return ids.reshape(shape).tolist()
    m = _MESH.search(line)
    if m:
        axes = re.findall(r"'([^']+)'=(\d+)", m["axes"])
        names = [a for a, _ in axes]
        ids = np.arange(math.prod(int(n) for _, n in axes))
        if m["ids"]:  # the mesh's devices in the order of an iota (transposed)
            ids = ids.reshape([int(x) for x in m["ids"].split(",")])
            if m["perm"]:
                ids = ids.transpose([int(x) for x in m["perm"].split(",")])
        ids = ids.reshape([int(n) for _, n in axes])
        over = [names.index(a) for a in re.findall(r"'([^']+)'", m["over"])]
        rest = [k for k in range(len(names)) if k not in over]
        moved = ids.transpose(rest + over)
        return moved.reshape(-1, math.prod(ids.shape[k] for k in over)).tolist()
    return [list(range(devices))]


def spans(c: Collective, host_of: list[int]) -> bool:
    """Whether a collective moves data between hosts: a group (or pair) of its devices
    on more than one host. ``host_of``: each logical device's host (the compiled
    program's device order: its mesh's devices, flattened)."""
    return any(len({host_of[d] for d in g}) > 1 for g in device_groups(c, len(host_of)))


def across_hosts(c: Collective, host_of: list[int]) -> list[int]:
    """Each (logical) device's bytes of ``c`` that cross hosts: a collective-permute's
    buffer for a device that sends it to another host; for the others, the result's
    bytes on every device of a group that spans hosts (the convention of
    ``redray.planning.cost``'s ``Traffic.bytes``)."""
    out = [0] * len(host_of)
    for g in device_groups(c, len(host_of)):
        if c.kind == "collective-permute":
            source, target = g
            if host_of[source] != host_of[target]:
                out[source] += c.bytes
        elif len({host_of[d] for d in g}) > 1:
            for d in g:
                out[d] += c.bytes
    return out


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
