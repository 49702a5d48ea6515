"""Safetensors read by regions: a host reads the bytes its shards come from, no more.

A checkpoint tensor is read through bounded buffers (``CHUNK`` bytes at a time, released
after each), converted to the dtype asked for as it is read; nothing is memory-mapped, so
the pages a load touched never stay resident.

A weight-table row's layout change (a torch ``nn.Linear`` weight transposed into a
kernel, a head axis split out, gate and up interleaved) is a ``View``: the stored tensor
regrouped (axes merged, row-major, which costs nothing) into ``grouped``, split into
``split`` and transposed by ``perm`` into redray's array. A box of redray's array then
pulls back through the view into boxes of the stored tensor (``View.pieces``): a shard
of a kernel reads only the rows and columns it is made of.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import struct

import ml_dtypes
import numpy as np

CHUNK = 16 << 20  # the most bytes one read holds
MAX_HEADER = 100 << 20

DTYPES = {"BF16": ml_dtypes.bfloat16, "F16": np.float16, "F32": np.float32,
          "F64": np.float64, "I8": np.int8, "U8": np.uint8, "I16": np.int16,
          "U16": np.uint16, "I32": np.int32, "U32": np.uint32, "I64": np.int64,
          "U64": np.uint64, "BOOL": np.bool_, "F8_E4M3": ml_dtypes.float8_e4m3fn,
          "F8_E5M2": ml_dtypes.float8_e5m2}
NAMES = {np.dtype(v): k for k, v in DTYPES.items()}

Box = tuple  # ((start, stop), ...) per axis


@dataclasses.dataclass(frozen=True)
class Stored:
    """Where one tensor's bytes lie: its file, the offset of its first byte, its dtype
    and shape (row-major)."""
    file: str
    offset: int
    dtype: np.dtype
    shape: tuple

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


class Unreadable(ValueError):
    """A safetensors file whose header cannot be read or whose tensors run past its end."""


def read_header(file: str) -> dict[str, Stored]:
    """Every tensor of a safetensors ``file`` (name -> ``Stored``), from its header only.

    Raises ``Unreadable`` (its message says what is wrong) for a header that is not one,
    an unknown dtype, or bytes past the file's end (a file cut short)."""
    size = os.path.getsize(file)
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise Unreadable(f"the file has {size} bytes, fewer than a header's length")
        (length,) = struct.unpack("<Q", head)
        if length > min(MAX_HEADER, size - 8):
            raise Unreadable(f"its header length {length} exceeds the file ({size} bytes)")
        try:
            header = json.loads(f.read(length))
        except ValueError as error:
            raise Unreadable(f"its header is not JSON ({error})") from None
    if not isinstance(header, dict):
        raise Unreadable("its header is not a JSON object")
    start, out = 8 + length, {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = np.dtype(DTYPES[entry["dtype"]]), \
                tuple(int(n) for n in entry["shape"]), entry["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise Unreadable(f"tensor {name!r} has an unreadable entry {entry!r}") from None
        stored = Stored(file, start + begin, dtype, shape)
        if end - begin != stored.nbytes:
            raise Unreadable(f"tensor {name!r} spans {end - begin} bytes, not the "
                             f"{stored.nbytes} of {entry['dtype']} {list(shape)}")
        if start + end > size:
            raise Unreadable(f"tensor {name!r} ends at byte {start + end}, past the "
                             f"file's end at {size}")
        out[name] = stored
    return out


class Meter:
    """Bytes read so far (for a load's progress line)."""

    def __init__(self):
        self.bytes = 0


METER = Meter()


def read_box(stored: Stored, box: Box, dtype=np.float32, shape: tuple | None = None) -> np.ndarray:
    """The values of ``box`` of ``stored`` seen as ``shape`` (a regrouping of its shape,
    same row-major bytes; default its own shape), as ``dtype``.

    Reads through one buffer of at most ``CHUNK`` bytes (or one row of the innermost
    axis, if larger); a box across minor axes reads the rows it spans, a chunk at a time.
    """
    shape = stored.shape if shape is None else tuple(shape)
    if math.prod(shape) != math.prod(stored.shape) or len(box) != len(shape):
        raise ValueError(f"read_box: {shape} and box {box} do not fit {stored.shape}")
    out = np.empty(tuple(b - a for a, b in box), dtype)
    if out.size == 0:
        return out
    with open(stored.file, "rb", buffering=0) as f:
        _fill(f, stored.offset, shape, stored.dtype, box, out, bytearray())
    return out


def _fill(f, offset: int, shape: tuple, src: np.dtype, box: Box, out: np.ndarray,
          buffer: bytearray) -> None:
    if not shape:
        out[...] = _read(f, offset, src.itemsize, buffer, src, ())
        return
    row = math.prod(shape[1:]) * src.itemsize  # bytes of one index of axis 0
    (a, b), rest = box[0], box[1:]
    whole = all(r == (0, n) for r, n in zip(rest, shape[1:]))
    if whole or row <= CHUNK:
        per = max(1, CHUNK // max(row, 1))
        inner = tuple(slice(s, e) for s, e in rest)
        for i in range(a, b, per):
            j = min(b, i + per)
            block = _read(f, offset + i * row, (j - i) * row, buffer, src, (j - i, *shape[1:]))
            out[i - a:j - a] = block[(slice(None), *inner)]
        return
    for i in range(a, b):
        _fill(f, offset + i * row, shape[1:], src, rest, out[i - a], buffer)


def _read(f, offset: int, size: int, buffer: bytearray, src: np.dtype, shape: tuple) -> np.ndarray:
    if len(buffer) < size:
        buffer.extend(bytes(size - len(buffer)))
    view = memoryview(buffer)[:size]
    f.seek(offset)
    got = f.readinto(view)
    if got != size:
        raise Unreadable(f"the file ended {size - got} bytes early at byte {offset + got}")
    METER.bytes += size
    return np.frombuffer(view, src).reshape(shape)


def unmap_large_buffers(threshold: int = 1 << 20) -> None:
    """For a process that streams tensors through other threads' buffers (``redray
    export``: TensorStore decodes each chunk in its pool): glibc maps every allocation
    above ``threshold`` bytes on its own and unmaps it when freed. By default glibc
    raises that threshold to the largest block freed (up to 32 MB), and blocks under it
    stay in the freeing thread's arena after they are freed: at a 16 MB chunk a time,
    about 50 MB more resident than the tensor being written. A no-op off glibc."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt(-3, int(threshold))  # M_MMAP_THRESHOLD: fixed from now on
    except (OSError, AttributeError):
        pass


def release_freed() -> None:
    """Hands the C heap's free pages back to the system (glibc's ``malloc_trim``): the
    previous tensor's buffers and a compile's scratch would otherwise stay resident in
    the allocator's per-thread arenas, and a load's or an export's footprint would grow
    with the tensors it has handled, not with the one it holds. A no-op off glibc."""
    global _TRIM
    if _TRIM is None:
        import ctypes
        import ctypes.util

        try:
            _TRIM = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _TRIM = False
    if _TRIM:
        _TRIM(0)


_TRIM = None


# ------------------------------------------------------------------------ views
def regroup(stored: tuple, split: tuple) -> list[tuple[list[int], list[int]]] | None:
    """How ``split`` comes from ``stored`` by merging and splitting consecutive axes:
    (stored axes, split axes) groups of equal size, in order; None where no reshape
    without reordering maps one onto the other."""
    groups, i, j = [], 0, 0
    while i < len(stored) or j < len(split):
        hs, ss, ph, ps = [], [], 1, 1
        if i < len(stored):
            hs.append(i)
            ph *= stored[i]
            i += 1
        if j < len(split):
            ss.append(j)
            ps *= split[j]
            j += 1
        while ph != ps:
            if ph < ps and i < len(stored):
                hs.append(i)
                ph *= stored[i]
                i += 1
            elif ps < ph and j < len(split):
                ss.append(j)
                ps *= split[j]
                j += 1
            else:
                return None
        groups.append((hs, ss))
    return groups


@dataclasses.dataclass(frozen=True)
class View:
    """redray's array as the stored tensor regrouped into ``grouped``, reshaped into
    ``split`` and transposed by ``perm`` (redray's axis k is ``split``'s ``perm[k]``)."""
    grouped: tuple
    split: tuple
    groups: tuple  # for each grouped axis, the split axes it becomes
    perm: tuple

    @classmethod
    def of(cls, stored: tuple, split: tuple, perm: tuple, shape: tuple) -> View | None:
        """The view making ``shape`` from a stored tensor of shape ``stored``, or None
        where ``split`` and ``perm`` do not make ``shape`` from it."""
        groups = regroup(tuple(stored), tuple(split))
        if groups is None or tuple(split[p] for p in perm) != tuple(shape):
            return None
        grouped = tuple(math.prod(stored[h] for h in hs) for hs, _ in groups)
        return cls(grouped, tuple(split), tuple(tuple(ss) for _, ss in groups), tuple(perm))

    def pieces(self, box: Box):
        """(box of ``grouped``, its shape in ``split``, the box of redray's array it
        fills) for every contiguous piece of redray's ``box``."""
        sbox = [None] * len(self.split)
        for k, s in enumerate(self.perm):
            sbox[s] = box[k]
        per_group = [list(_aligned([sbox[s] for s in ss], [self.split[s] for s in ss]))
                     for ss in self.groups]
        for combo in itertools.product(*per_group):
            grouped = tuple(flat for flat, _ in combo)
            sub = [r for _, ranges in combo for r in ranges]
            yield grouped, tuple(b - a for a, b in sub), tuple(sub[p] for p in self.perm)


def _aligned(ranges: list, sizes: list):
    """A box of axes ``sizes`` (split from one, row-major) as boxes each contiguous in
    the merged axis: (their (start, stop) there, their ranges)."""
    partial = [k for k, (r, n) in enumerate(zip(ranges, sizes)) if r != (0, n)]
    if not partial:
        yield (0, math.prod(sizes)), list(ranges)
        return
    k = partial[-1]
    strides = [math.prod(sizes[i + 1:]) for i in range(len(sizes))]
    for lead in itertools.product(*(range(a, b) for a, b in ranges[:k])):
        base = sum(i * s for i, s in zip(lead, strides))
        start = base + ranges[k][0] * strides[k]
        stop = base + ranges[k][1] * strides[k]
        yield (start, stop), [(i, i + 1) for i in lead] + list(ranges[k:])


def linear_view(stored: tuple, shape: tuple, in_dims: int) -> View | None:
    """A torch ``nn.Linear`` weight (out, in) as a kernel (in..., out...)."""
    if len(stored) != 2:
        return None
    ins, outs = tuple(shape[:in_dims]), tuple(shape[in_dims:])
    perm = tuple(range(len(outs), len(outs) + len(ins))) + tuple(range(len(outs)))
    if math.prod(ins) != stored[1] or math.prod(outs) != stored[0]:
        return None
    return View.of(stored, outs + ins, perm, shape)


def reshape_view(stored: tuple, shape: tuple) -> View | None:
    """The same values in another shape (row-major)."""
    return View.of(stored, tuple(shape), tuple(range(len(shape))), shape)


def interleaved_view(stored: tuple, shape: tuple) -> View | None:
    """A last axis holding two things in turn (``a0 b0 a1 b1 ...``) as (..., 2, n)."""
    if not stored or stored[-1] % 2:
        return None
    split = (*stored[:-1], stored[-1] // 2, 2)
    n = len(split)
    return View.of(stored, split, (*range(n - 2), n - 1, n - 2), shape)


# ------------------------------------------------------------------------ boxes
def box_of(index: tuple, shape: tuple) -> Box:
    """A ``make_array_from_callback`` index (slices) as a box of ``shape``."""
    index = tuple(index) + (slice(None),) * (len(shape) - len(index))
    return tuple(s.indices(n)[:2] for s, n in zip(index, shape))


def intersect(box: Box, offset: tuple, shape: tuple) -> Box | None:
    """``box`` within the block at ``offset`` of ``shape``, in the block's coordinates;
    None where they do not meet."""
    out = []
    for (a, b), o, n in zip(box, offset, shape):
        lo, hi = max(a, o), min(b, o + n)
        if lo >= hi:
            return None
        out.append((lo - o, hi - o))
    return tuple(out)


def slices(box: Box, origin: tuple | None = None) -> tuple:
    origin = origin or (0,) * len(box)
    return tuple(slice(a - o, b - o) for (a, b), o in zip(box, origin))


# ------------------------------------------------------------------------ sources
@dataclasses.dataclass(frozen=True)
class Source:
    """One checkpoint tensor as stored: ``read(box, grouped)`` gives a box of it seen as
    ``grouped`` (a regrouping of ``shape``), as float32."""
    stored: Stored

    @property
    def shape(self) -> tuple:
        return self.stored.shape

    @property
    def nbytes(self) -> int:
        return self.stored.nbytes

    def read(self, box: Box, grouped: tuple | None = None) -> np.ndarray:
        return read_box(self.stored, box, np.float32, grouped)


def _regrouped(source, box: Box, grouped: tuple) -> np.ndarray:
    """A box of a quantized ``source`` laid out as ``grouped`` (a layout merging its
    axes): the tensor dequantized whole, reshaped, the box cut from it."""
    whole = source.read(tuple((0, n) for n in source.shape)).reshape(grouped)
    return np.ascontiguousarray(whole[slices(box)])


@dataclasses.dataclass(frozen=True)
class Mxfp4Source:
    """A tensor stored in MXFP4 (``redray/models/mxfp4.py``): (..., groups x 32, rows)
    from blocks (..., rows, groups, 16) and scales (..., rows, groups), a box of it
    dequantized from the blocks and scales that hold it."""
    blocks: Stored
    scales: Stored

    @property
    def shape(self) -> tuple:
        *lead, rows, groups, _ = self.blocks.shape
        return (*lead, groups * 32, rows)

    @property
    def nbytes(self) -> int:
        return self.blocks.nbytes + self.scales.nbytes

    def read(self, box: Box, grouped: tuple | None = None) -> np.ndarray:
        from redray.models import mxfp4

        if grouped is not None and tuple(grouped) != self.shape:
            return _regrouped(self, box, grouped)
        *lead, (c0, c1), rows = box
        g0, g1 = c0 // 32, -(-c1 // 32)
        blocks = read_box(self.blocks, (*lead, rows, (g0, g1), (0, 16)), np.uint8)
        scales = read_box(self.scales, (*lead, rows, (g0, g1)), np.uint8)
        values = mxfp4.dequantize(blocks, scales)
        return np.ascontiguousarray(values[..., c0 - g0 * 32:c1 - g0 * 32, :])


@dataclasses.dataclass(frozen=True)
class Fp8Source:
    """A weight stored in FP8 with a scale per ``block`` (``redray/models/fp8.py``): a
    box of it reads those values and the scales of the blocks they lie in, dequantized
    to float32."""
    weight: Stored
    scales: Stored
    block: tuple

    @property
    def shape(self) -> tuple:
        return self.weight.shape

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes + self.scales.nbytes

    def read(self, box: Box, grouped: tuple | None = None) -> np.ndarray:
        from redray.models import fp8

        if grouped is not None and tuple(grouped) != self.shape:
            return _regrouped(self, box, grouped)
        *lead, (r0, r1), (c0, c1) = box
        (b0, b1) = self.block
        values = read_box(self.weight, box, np.float32)
        scales = read_box(self.scales, (*lead, (r0 // b0, -(-r1 // b0)), (c0 // b1, -(-c1 // b1))),
                          np.float32)
        return fp8.scale(values, scales, self.block, (r0, c0))
