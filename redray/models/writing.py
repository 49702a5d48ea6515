"""Hugging Face checkpoints written a tensor at a time: no process holds the whole model.

``hub.hf_layout`` lists the tensors a model's weight table writes (names and shapes,
from the parameters' shapes alone); ``hf_stream`` makes them one table row at a time from a
``fetch(model path, layer)`` that brings one parameter (or one layer of a stacked one)
to the host; ``SafetensorsWriter`` writes each file's header first (every offset is
known from the shapes) and then streams the tensors into it, in order.

``live_fetch`` gathers from a model's arrays, wherever they lie: on the devices of many
processes, each process takes part in the gather and process 0 receives the values.
"""

from __future__ import annotations

import json
import math
import os
import struct

import jax
import ml_dtypes
import numpy as np

from redray.models import slices

WRITE_BLOCK = 16 << 20  # bytes made contiguous at a time while a tensor is written
DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16)}


def hf_stream(layout: list, fetch):
    """(HF name, array) of every tensor of ``layout``, a row at a time: ``fetch(model
    path, layer)`` brings the row's values (None on a process that only helps gather,
    which then yields nothing)."""
    for row, model_path, layer, _ in layout:
        slices.release_freed()  # the tensors written before: their pages handed back
        value = fetch(model_path, layer)
        if value is None:
            continue
        arrays = row.write(value)  # views of ``value``: it lives as long as they do
        del value
        for part in row.parts:  # each let go once written, before the next fetch
            yield part.hf, arrays.pop(0)


def live_fetch(values: dict, dtype) -> callable:
    """``fetch`` for a model's arrays (model path -> array): the parameter, or one layer
    of a stacked one, cast to ``dtype`` on its devices and brought whole to process 0
    (every process must call it in the same order: the gather is a collective); other
    processes get None.

    The cast runs on the shards before the gather (the gather moves ``dtype``'s bytes,
    not float32's), and process 0 reads the gathered buffer in place (DLPack, bfloat16
    as its bits), so a tensor is held once on the host side."""
    dtype = np.dtype(dtype)
    bits = np.dtype(f"uint{8 * dtype.itemsize}")
    cache = {}

    def program(x, stacked: bool):
        sharding = x.sharding
        key = (x.shape, x.dtype, sharding, stacked)
        if key not in cache:
            named = isinstance(sharding, jax.sharding.NamedSharding)
            whole = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec()) \
                if named else None

            def take(a, i):
                a = a[i] if stacked else a
                if named:  # cast where the values lie, before they are gathered
                    spec = jax.sharding.PartitionSpec(*sharding.spec[1:]) if stacked \
                        else sharding.spec
                    a = jax.lax.with_sharding_constraint(
                        a, jax.sharding.NamedSharding(sharding.mesh, spec))
                return jax.lax.bitcast_convert_type(a.astype(dtype), bits)

            cache[key] = jax.jit(take, out_shardings=whole)
        return cache[key]

    def fetch(model_path: str, layer: int | None):
        x = values[model_path]
        if not isinstance(x, jax.Array):
            x = np.asarray(x)
            return (x if layer is None else x[layer]).astype(dtype)
        y = program(x, layer is not None)(x, 0 if layer is None else layer)
        if jax.process_index() != 0:
            return None
        shard = y.addressable_data(0)
        try:
            host = np.from_dlpack(shard)
        except (TypeError, ValueError, RuntimeError, BufferError):  # not a CPU buffer
            host = np.asarray(shard)
        return host.view(dtype)

    return fetch


class SafetensorsWriter:
    """Writes ``entries`` ((name, shape), or (name, shape, its own dtype), in order, the
    others of ``dtype``) into ``model.safetensors``, or with ``max_shard_bytes`` into
    ``model-0000x-of-0000y.safetensors`` files of at most that size (a tensor larger
    than that alone in its file) and the index; ``write(name, array)`` takes them in
    order, each file's header written when it opens."""

    def __init__(self, folder: str, entries: list, dtype, max_shard_bytes: int | None = None,
                 single: str = "model.safetensors", index: str = "model.safetensors.index.json"):
        self.folder, self.dtype, self.index = folder, np.dtype(dtype), index
        # a tensor's own dtype where its entry names one (a router's float32 bias)
        self.dtypes = {e[0]: np.dtype(e[2]) for e in entries if len(e) > 2}
        self.sharded = max_shard_bytes is not None
        groups, current, size = [], [], 0
        for name, shape, *_ in entries:
            nbytes = math.prod(shape) * self.dtype_of(name).itemsize
            if current and self.sharded and size + nbytes > max_shard_bytes:
                groups.append(current)
                current, size = [], 0
            current.append((name, tuple(shape)))
            size += nbytes
        groups.append(current)
        names = [single] if not self.sharded else \
            [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
        self.files = list(zip(names, groups))
        self.order = [(i, name, shape) for i, (_, group) in enumerate(self.files)
                      for name, shape in group]
        self.at, self.handle, self.total = 0, None, 0

    def dtype_of(self, name: str) -> np.dtype:
        return self.dtypes.get(name, self.dtype)

    def write(self, name: str, array: np.ndarray) -> None:
        if self.at >= len(self.order):
            raise ValueError(f"SafetensorsWriter: {name!r} is more than the tensors announced")
        file, expected, shape = self.order[self.at]
        if name != expected or tuple(np.shape(array)) != shape:
            raise ValueError(f"SafetensorsWriter: got {name!r} {np.shape(array)}, expected "
                             f"{expected!r} {shape} next")
        if self.at == 0 or self.order[self.at - 1][0] != file:
            self._open(file)
        array = np.asarray(array)
        if array.ndim == 0:
            array = array.reshape(1)
        # a block of rows at a time: a transposed view (a kernel written as HF's weight)
        # is made contiguous a few MB at a time, not as a second copy of the tensor
        dtype = self.dtype_of(name)
        rows = max(1, WRITE_BLOCK // max(1, array[0].size * dtype.itemsize))
        for start in range(0, array.shape[0], rows):
            block = np.ascontiguousarray(array[start:start + rows], dtype)
            self.handle.write(block.reshape(-1).view(np.uint8).data)
            self.total += block.nbytes
        self.at += 1

    def _open(self, file: int) -> None:
        if self.handle is not None:
            self.handle.close()
        name, group = self.files[file]
        header, offset = {}, 0
        for tensor, shape in group:
            dtype = self.dtype_of(tensor)
            nbytes = math.prod(shape) * dtype.itemsize
            header[tensor] = {"dtype": slices.NAMES[dtype], "shape": list(shape),
                              "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        header["__metadata__"] = {"format": "pt"}
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        self.handle = open(os.path.join(self.folder, name), "wb")
        self.handle.write(struct.pack("<Q", len(text)) + text)

    def close(self) -> None:
        if self.handle is not None:
            self.handle.close()
            self.handle = None
        if self.at != len(self.order):
            raise ValueError(f"SafetensorsWriter: {len(self.order) - self.at} tensors announced "
                             f"were not written (the next: {self.order[self.at][1]!r})")
        if self.sharded:
            weight_map = {name: self.files[i][0] for i, name, _ in self.order}
            with open(os.path.join(self.folder, self.index), "w") as f:
                json.dump({"metadata": {"total_size": self.total}, "weight_map": weight_map},
                          f, indent=2)
