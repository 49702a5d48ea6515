"""Hugging Face checkpoints in and out: config.json + safetensors, no torch.

Each family describes its weights as one table of ``Tensor`` rows (the HF name, the
redray parameter path, and how the layout changes), and ``Fused`` rows for arrays that
hold several HF tensors (a fused QKV kernel). Loading builds the model
abstractly (``nnx.eval_shape``), derives every parameter's sharding with the automatic
rules, and builds each parameter on its sharding, every device's shard read from the
bytes of the checkpoint it is made of (``redray/models/slices.py``): a host reads its
share of the model, through bounded buffers, and holds nothing else.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import sys
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from redray.models import fp8, mxfp4, slices, writing
from redray.models.families import lookup, supported
from redray.rngs import rngs as fast_rngs
from redray.sharding import Parallelism, flatten
from redray.sharding.on_mesh import model_specs
from redray.sharding.parallelism import KEYWORDS as AXIS_KEYWORDS

class Buffer(nnx.Variable):
    """A checkpoint's tensor kept beside the parameters (a router's correction bias):
    loaded and exported as they are, but not an ``nnx.Param``, so no optimizer or
    weight decay updates it (it is a Trainer's extra state)."""


SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


@dataclasses.dataclass(frozen=True)
class Tensor:
    """One weight: its Hugging Face name, its redray path, and the layout change.

    ``load(array, shape)`` turns the HF array into redray's layout of ``shape``;
    ``save(array)`` turns it back. ``fallback`` names a tensor to read when ``hf`` is
    absent (a head that a checkpoint stored only as the tied embedding). ``view(stored
    shape, shape)``: the same change as a ``slices.View`` (so a shard reads only the
    bytes it is made of), or None where the stored shape does not fit; a row without
    one reads its tensor whole and converts it with ``load``.
    """
    hf: str
    path: str
    load: Callable[[np.ndarray, tuple], np.ndarray]
    save: Callable[[np.ndarray], np.ndarray]
    fallback: str | None = None
    view: Callable[[tuple, tuple], slices.View | None] | None = None
    buffer: bool = False  # a ``Buffer``'s row: the model's state, not a parameter

    @property
    def parts(self) -> tuple[Tensor, ...]:
        """The Hugging Face tensors this array holds: itself."""
        return (self,)

    def part_shapes(self, shape: tuple) -> list[tuple]:
        """The shape each part takes in redray's layout, for the array's ``shape``."""
        return [shape]

    def offsets(self, shape: tuple) -> list[tuple]:
        """Where each part starts in redray's array of ``shape``."""
        return [(0,) * len(shape)]

    def write(self, array: np.ndarray) -> list[np.ndarray]:
        """The HF arrays of ``parts`` from redray's array."""
        return [self.save(array)]


@dataclasses.dataclass(frozen=True)
class Fused:
    """Several Hugging Face tensors held side by side in one redray array.

    A fused projection (Q, K and V in one kernel, so their input gradients add up before
    the one all-reduce tensor parallelism needs) stores its parts along ``axis``:
    part i takes ``sizes[i]`` entries there and converts as its own ``Tensor`` row.
    """
    parts: tuple[Tensor, ...]
    axis: int
    sizes: tuple[int, ...]

    @property
    def path(self) -> str:
        return self.parts[0].path

    def part_shapes(self, shape: tuple) -> list[tuple]:
        return [shape[:self.axis] + (size,) + shape[self.axis + 1:] for size in self.sizes]

    def offsets(self, shape: tuple) -> list[tuple]:
        starts = np.cumsum((0,) + self.sizes[:-1])
        return [(0,) * self.axis + (int(s),) + (0,) * (len(shape) - self.axis - 1)
                for s in starts]

    def write(self, array: np.ndarray) -> list[np.ndarray]:
        bounds = np.cumsum(self.sizes)[:-1]
        return [part.save(piece) for part, piece in
                zip(self.parts, np.split(array, bounds, self.axis))]


def fused(path: str, axis: int, sizes: tuple[int, ...], *parts: Tensor) -> Fused:
    """One array at ``path`` holding ``parts`` (rows made by ``linear``/``plain`` with
    the same ``path``) along ``axis``, ``sizes[i]`` entries each."""
    if len(parts) != len(sizes) or any(p.path != path for p in parts):
        raise ValueError(f"fused {path}: give one size per part, every part at {path}")
    return Fused(tuple(parts), axis, tuple(sizes))


def linear(hf: str, path: str, in_dims: int = 1, fallback: str | None = None) -> Tensor:
    """A torch ``nn.Linear`` weight (out, in) as a kernel (in..., out...)."""
    return Tensor(hf, path, lambda w, shape: w.T.reshape(shape),
                  lambda k: k.reshape(math.prod(k.shape[:in_dims]), -1).T, fallback,
                  lambda stored, shape: slices.linear_view(stored, shape, in_dims))


def conv1d(hf: str, path: str, in_dims: int = 1) -> Tensor:
    """A GPT-2 style ``Conv1D`` weight (in, out) as a kernel (in..., out...)."""
    return Tensor(hf, path, lambda w, shape: w.reshape(shape),
                  lambda k: k.reshape(math.prod(k.shape[:in_dims]), -1), view=slices.reshape_view)


def plain(hf: str, path: str, flat: bool = False) -> Tensor:
    """Same values, maybe reshaped (``flat``: HF stores it 1-D, e.g. a per-head bias)."""
    return Tensor(hf, path, lambda w, shape: w.reshape(shape),
                  lambda k: k.reshape(-1) if flat else k, view=slices.reshape_view)


def buffer(hf: str, path: str) -> Tensor:
    """A checkpoint's buffer (a ``Buffer`` at ``path``), same values: loaded and
    exported with the parameters; a tree of gradients has none."""
    return dataclasses.replace(plain(hf, path), buffer=True)


def qkv(modules: tuple[str, str, str], path: str, heads: int, kv_heads: int,
        bias: bool = False) -> list[Fused]:
    """Hugging Face's separate Q, K and V ``nn.Linear`` modules (their names, without
    ``.weight``) as the kernel, and with ``bias`` the bias, of one
    ``layers.qkv_projection`` at ``path`` (e.g. ".../self_attn/qkv_proj")."""
    sizes = (heads // kv_heads, 1, 1)
    rows = [fused(f"{path}/kernel", 2, sizes, *(linear(f"{m}.weight", f"{path}/kernel")
                                                for m in modules))]
    if bias:
        rows.append(fused(f"{path}/bias", 1, sizes, *(plain(f"{m}.bias", f"{path}/bias", flat=True)
                                                      for m in modules)))
    return rows


def gated(modules: tuple[str, str], path: str, bias: bool = False) -> list[Fused]:
    """Hugging Face's separate gate and up ``nn.Linear`` modules as one
    ``layers.gated_projection`` at ``path`` (kernel, and bias with ``bias``)."""
    rows = [fused(f"{path}/kernel", 1, (1, 1), *(linear(f"{m}.weight", f"{path}/kernel")
                                                 for m in modules))]
    if bias:
        rows.append(fused(f"{path}/bias", 0, (1, 1), *(plain(f"{m}.bias", f"{path}/bias", flat=True)
                                                       for m in modules)))
    return rows


def family(model_type: str):
    """The module implementing a Hugging Face ``model_type`` (``families.FAMILIES``)."""
    return lookup(model_type).code


def load_config(path: str):
    """The ``transformers`` config of a local checkpoint folder (or a config.json path).
    A ``model_type`` that is an alias of a family (``kimi_k2``: DeepSeek-V3's architecture,
    whose folder names remote code in ``auto_map``) is read as that family's config, with
    its fields: no remote code runs."""
    from transformers import AutoConfig

    folder = os.path.dirname(path) if path.endswith(".json") else path
    file = os.path.join(folder, "config.json")
    if not os.path.exists(file):
        raise FileNotFoundError(f"no config.json in {folder!r}: from_pretrained needs a local "
                                "folder written by save_pretrained (the Hub is not reachable)")
    content = _read_json(file)
    if not isinstance(content, dict) or not isinstance(content.get("model_type"), str):
        raise ValueError(f"{file} has no 'model_type' (e.g. \"gpt2\", \"llama\"): it is not a "
                         "transformers model config; redray reads "
                         f"{', '.join(supported())}")
    try:
        record = lookup(content["model_type"])
        if content["model_type"] != record.model_type:  # an alias (Kimi-K2's kimi_k2)
            return AutoConfig.for_model(record.model_type, **{
                k: v for k, v in content.items()
                if k not in ("model_type", "auto_map", "transformers_version")})
        return AutoConfig.from_pretrained(folder, local_files_only=True)
    except Exception as error:  # noqa: BLE001 - transformers' errors vary by version
        raise ValueError(f"{file} cannot be read as a transformers config "
                         f"({_first_line(error)})") from None


def build(config, *, rngs: nnx.Rngs | None = None, dtype=jnp.float32, remat=False,
          seed: int = 0, scan: bool | None = None, generation: dict | None = None):
    """A randomly initialized redray model for a ``transformers`` config; ``scan``: its
    layers stacked and scanned (one compiled block, whatever the depth), or a list of
    layers (False); None (the default): stacked where the config allows it.
    ``generation``: what a checkpoint's ``generation_config.json`` would hold (an
    instruct model's end-of-turn ``eos_token_id``s, which the Sampler stops on, and
    ``save_pretrained`` writes)."""
    if generation is not None:
        config = HFConfig(config.hf if isinstance(config, HFConfig) else config, generation)
    fam = family(config.model_type)
    return fam.Model(config, rngs=rngs or fast_rngs(seed), dtype=dtype, remat=remat, scan=scan)


class _Weights:
    """Tensors of a checkpoint folder, known from their files' headers and read by
    regions (``slices.Source``): nothing is mapped or held for the load.

    ``renames``: (prefix in the checkpoint, prefix it is read under) pairs (a wrapped
    language model's ``language_model.model.`` as ``model.``); ``left_out``: prefixes of
    tensors not read at all (a multimodal checkpoint's vision tower); ``quantization``:
    the config's ``quantization_config``. A tensor stored in MXFP4 (``X_blocks`` and
    ``X_scales``, gpt-oss's experts) reads as ``X``, and one stored in FP8 with a scale
    per block (``X.weight`` and ``X.weight_scale_inv``, DeepSeek-V3's and Kimi-K2's
    releases) as ``X.weight``: dequantized to float32 region by region
    (``redray/models/mxfp4.py``, ``redray/models/fp8.py``).

    Every failure names the file (and the tensor) it comes from: a damaged or
    half-downloaded ``.safetensors`` file, an index that is not JSON or whose
    ``weight_map`` is not a name -> file mapping, a shard the index names but the
    folder lacks, a tensor a file does not hold.
    """

    def __init__(self, folder: str, renames=(), left_out=(), quantization=None):
        index = os.path.join(folder, INDEX_FILE)
        if os.path.exists(index):
            weight_map = _weight_map(index)
            files = sorted(set(weight_map.values()))
            for name in files:
                if not os.path.exists(os.path.join(folder, name)):
                    raise FileNotFoundError(
                        f"{index} maps tensors to {name!r}, which is not in {folder!r}: the "
                        "download or copy is incomplete; fetch every shard the index names")
        elif os.path.exists(os.path.join(folder, SINGLE_FILE)):
            files = [SINGLE_FILE]
            weight_map = None
        else:
            raise FileNotFoundError(f"no {SINGLE_FILE} or {INDEX_FILE} in {folder!r}")
        self.folder = folder
        self.headers = {f: _read_header(os.path.join(folder, f)) for f in files}
        self.where = weight_map or {k: SINGLE_FILE for k in self.headers[SINGLE_FILE]}
        self.left_out = sorted(n for n in self.where if n.startswith(tuple(left_out)))
        self.stored = {}  # name read under -> name in the checkpoint
        for name in self.where:
            if name.startswith(tuple(left_out)):
                continue
            theirs = next((p for p, _ in renames if name.startswith(p)), None)
            ours = name if theirs is None else dict(renames)[theirs] + name[len(theirs):]
            self.stored[ours] = name
        self.quantized = mxfp4.quantized_names(self.stored)
        self.fp8 = fp8.quantized_names(self.stored)
        self.block = self._fp8_block(quantization)

    def _fp8_block(self, quantization) -> tuple | None:
        """The FP8 weights' block size, once every one of them agrees with it and with
        its scales (a ValueError listing those that do not)."""
        config = os.path.join(self.folder, "config.json")
        block = fp8.block_size(quantization, config)
        if self.fp8 and block is None:
            example = self.stored[min(self.fp8)[:-len(fp8.WEIGHT)] + fp8.SCALE]
            raise ValueError(
                f"{self.folder} holds {len(self.fp8)} FP8 weights with a scale per block "
                f"({example}), but {config} has no quantization_config with quant_method "
                "\"fp8\": add the release's ({\"quant_method\": \"fp8\", \"fmt\": \"e4m3\", "
                "\"weight_block_size\": [128, 128]}) to config.json")
        if block is None:
            return None
        weights = {self.stored[w]: (self._stored(w), self._stored(s))
                   for w, s in self.fp8.values()}
        bare = {}
        for name, stored in self.stored.items():
            entry = self.headers[self.where[stored]].get(stored)
            if name not in self.fp8 and entry is not None and entry.dtype in fp8.FLOAT8:
                bare[stored] = entry.dtype
        fp8.refuse_unreadable(weights, bare, block, self.folder)
        return block

    @property
    def files(self) -> int:
        return len(self.headers)

    def names(self) -> set[str]:
        parts = {n for pairs in (self.quantized, self.fp8) for pair in pairs.values()
                 for n in pair}
        return (set(self.stored) - parts) | set(self.quantized) | set(self.fp8)

    def source(self, name: str):
        """The tensor read under ``name``, unread: a ``slices.Source`` (or, for MXFP4,
        a ``slices.Mxfp4Source``; for FP8, a ``slices.Fp8Source``)."""
        if name in self.quantized:
            return slices.Mxfp4Source(*(self._stored(n) for n in self.quantized[name]))
        if name in self.fp8:
            return slices.Fp8Source(*(self._stored(n) for n in self.fp8[name]), self.block)
        return slices.Source(self._stored(name))

    def _stored(self, name: str) -> slices.Stored:
        stored = self.stored[name]
        entry = self.headers[self.where[stored]].get(stored)
        if entry is None:
            file = os.path.join(self.folder, self.where[stored])
            raise ValueError(
                f"tensor {stored!r} cannot be read from {file} (KeyError: the file's header "
                "does not list it): the index maps it to this file, which does not hold it; "
                "fix the index's weight_map or re-save the checkpoint")
        return entry


def _read_header(file: str) -> dict:
    try:
        return slices.read_header(file)
    except (slices.Unreadable, OSError) as error:
        raise ValueError(f"{file} cannot be read as safetensors ({_first_line(error)}): the "
                         "file is damaged or incomplete (a download or copy cut short); "
                         "download or save it again") from None


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:300]}" if text else type(error).__name__


def _read_json(file: str):
    """``file``'s JSON, or a ValueError naming the file."""
    try:
        with open(file) as f:
            return json.load(f)
    except ValueError as error:
        raise ValueError(f"{file} is not valid JSON ({_first_line(error)}): the file is "
                         "damaged or incomplete; download or save the checkpoint again") from None


def _weight_map(index: str) -> dict:
    """The index's ``weight_map`` (tensor name -> file), or a clear error."""
    content = _read_json(index)
    weight_map = content.get("weight_map") if isinstance(content, dict) else None
    if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
        found = "missing" if weight_map is None else f"a {type(weight_map).__name__}"
        raise ValueError(f"{index}: its 'weight_map' must map every tensor name to its "
                         f".safetensors file ({{\"name\": \"model-00001-of-00002.safetensors\", "
                         f"...}}); it is {found}. Fix the index or save the checkpoint again "
                         "with save_pretrained")
    return weight_map


@dataclasses.dataclass(frozen=True)
class _Part:
    """One checkpoint tensor's place in a parameter: the table's part, where it starts
    and its shape in redray's array (a layer's, for a stacked one), the tensor, and the
    view that reads a box of it (None: read whole and converted by ``part.load``)."""
    part: Tensor
    offset: tuple
    shape: tuple
    source: object
    view: slices.View | None

    def fill(self, box: tuple, out: np.ndarray) -> None:
        """Writes the part's values inside ``box`` (of the array the part is in) into
        ``out`` (that box's values)."""
        local = slices.intersect(box, self.offset, self.shape)
        if local is None:
            return
        target = out[tuple(slice(a + o - s, b + o - s)
                           for (a, b), o, (s, _) in zip(local, self.offset, box))]
        if self.view is None:
            whole = self.source.read(tuple((0, n) for n in self.source.shape))
            target[...] = self.part.load(whole, self.shape)[slices.slices(local)]
            return
        origin = tuple(a for a, _ in local)
        for grouped, split, sub in self.view.pieces(local):
            block = self.source.read(grouped, self.view.grouped)
            target[slices.slices(sub, origin)] = block.reshape(split).transpose(self.view.perm)


def _view(part: Tensor, stored: tuple, shape: tuple):
    """How ``part``'s tensor (``stored``: its shape) reads into ``shape``: a View, None
    (read whole through ``part.load``, which gives ``shape``), or False (misshaped)."""
    view = part.view(stored, shape) if part.view is not None else None
    if view is not None:
        return view
    probe = np.broadcast_to(np.zeros((), np.float32), stored)  # no memory, any shape
    try:
        return None if tuple(part.load(probe, shape).shape) == tuple(shape) else False
    except (ValueError, IndexError, TypeError):
        return False


def _plan_table(fam, config, weights: "_Weights", by_path: dict) -> tuple[dict, tuple]:
    """Where every checkpoint tensor of the family's weight table goes, from the files'
    headers alone (nothing is read): (model path -> layer (None: the whole parameter)
    -> its ``_Part``s, what did not match: the missing tensors, the misshaped ones, the
    unexpected ones and the parameters none fills)."""
    table = fam.weight_table(config)
    available = weights.names()
    missing, misshaped, plans = [], [], {}
    prefix = getattr(fam, "BASE_PREFIX", None)
    for row in table:
        where = _model_path(row.path, by_path, fam, config)
        if where is None:
            raise AssertionError(f"{fam.__name__}: table path {row.path!r} is not a parameter")
        names = [_stored_name(part, available, prefix) for part in row.parts]
        if None in names:
            missing += [part.hf for part, name in zip(row.parts, names) if name is None]
            continue
        model_path, layer = where
        leaf, _ = by_path[model_path]
        shape = tuple(leaf.shape) if layer is None else tuple(leaf.shape[1:])
        parts = []
        for part, name, part_shape, offset in zip(row.parts, names, row.part_shapes(shape),
                                                  row.offsets(shape)):
            source = weights.source(name)
            view = _view(part, tuple(source.shape), tuple(part_shape))
            if view is False:
                misshaped.append(f"{part.hf}: checkpoint {tuple(source.shape)}, model "
                                 f"{row.path} expects {tuple(part_shape)}")
                continue
            parts.append(_Part(part, tuple(offset), tuple(part_shape), source, view))
        covered = sum(math.prod(p.shape) for p in parts)
        if len(parts) == len(row.parts) and covered != math.prod(shape):
            misshaped.append(f"{row.path}: its parts fill {covered} of the model's "
                             f"{math.prod(shape)} values {shape}")
        elif len(parts) == len(row.parts):
            plans.setdefault(model_path, {})[layer] = parts
    ignore = re.compile("|".join(getattr(fam, "IGNORED", ())) or r"(?!)")
    used = {_stored_name(part, available, prefix) for row in table for part in row.parts}
    unexpected = sorted(n for n in available - used if not ignore.search(n))
    in_table = {w[0] for w in (_model_path(r.path, by_path, fam, config) for r in table)
                if w is not None}
    not_loaded = sorted(set(by_path) - in_table)
    return plans, (missing, misshaped, unexpected, not_loaded)


def _place(plans: dict, by_path: dict, mesh, path: str, weights: "_Weights") -> dict:
    """Every parameter built on its sharding, each device's shard read from the bytes it
    is made of (a stacked parameter's shard, layer by layer) and handed to its device
    before the next is read; model path -> array."""
    loaded, progress = {}, _Progress(path, len(plans), weights)
    for model_path, layers_ in plans.items():
        leaf, spec = by_path[model_path]
        shape, sharding = tuple(leaf.shape), NamedSharding(mesh, spec)
        arrays, read = [], {}  # a box read once for the devices that share it
        for device, index in sharding.addressable_devices_indices_map(shape).items():
            box = slices.box_of(index, shape)
            if box not in read:
                read = {box: _shard(layers_, box, leaf.dtype)}
            arrays.append(_on_device(read[box], device))
        read.clear()
        slices.release_freed()
        loaded[model_path] = jax.make_array_from_single_device_arrays(shape, sharding, arrays)
        progress.placed()
    progress.done()
    return loaded


def _shard(layers_: dict, box: tuple, dtype) -> np.ndarray:
    """The values of ``box`` of a parameter made of ``layers_``' parts."""
    out = _aligned_zeros(tuple(b - a for a, b in box), dtype)
    if None in layers_:
        for part in layers_[None]:
            part.fill(box, out)
        return out
    for layer in range(*box[0]):
        for part in layers_[layer]:
            part.fill(box[1:], out[layer - box[0][0]])
    return out


def _aligned_zeros(shape: tuple, dtype) -> np.ndarray:
    """Zeros whose data starts on a 64-byte boundary (which a CPU device can take as
    its own buffer, with no copy)."""
    dtype = np.dtype(dtype)
    size = math.prod(shape) * dtype.itemsize
    raw = np.zeros(size + 64, np.uint8)
    start = -raw.ctypes.data % 64
    return raw[start:start + size].view(dtype).reshape(shape)


def _on_device(array: np.ndarray, device) -> jax.Array:
    """``array`` on ``device``: on a CPU device the array itself where it can be (no
    second copy of the shard on the host), else a copy."""
    if device.platform == "cpu":
        try:
            return jax.dlpack.from_dlpack(array, device=device, copy=None)
        except (ValueError, TypeError, RuntimeError):
            pass
    return jax.device_put(array, device)


class _Progress:
    """A load's or save's progress on process 0's console: a line every ``EVERY``
    seconds once it runs longer than that (parameters placed or tensors written, bytes
    read or written, files), and its end."""
    EVERY = 5.0

    def __init__(self, path: str, total: int, weights: "_Weights | None", doing="loading",
                 unit="parameters placed"):
        import time

        self.clock, self.path, self.total = time.monotonic, path, total
        self.doing, self.unit = doing, unit
        self.files = weights.files if weights is not None else None
        self.start = self.last = self.clock()
        self.count, self.read = 0, slices.METER.bytes
        self.said = False
        self.show = jax.process_index() == 0

    def _say(self, count: str, done: int | None) -> None:
        if done is None:
            gb = (slices.METER.bytes - self.read) / 1e9
            moved = f"{gb:.2f} GB read from {self.files} file(s) on this host"
        else:
            moved = f"{done / 1e9:.2f} GB written"
        print(f"redray: {self.doing} {self.path}: {count} {self.unit}, {moved}, "
              f"{self.clock() - self.start:.0f} s", file=sys.stderr, flush=True)

    def placed(self, done: int | None = None) -> None:
        self.count += 1
        if self.show and self.clock() - self.last > self.EVERY:
            self.last, self.said = self.clock(), True
            self._say(f"{self.count}/{self.total}", done)

    def done(self, done: int | None = None) -> None:
        if self.show and self.said:
            self._say(f"all {self.total}", done)


def _refuse_incomplete(path: str, model_type: str, missing, misshaped, unexpected,
                       not_loaded) -> None:
    """Raises one ValueError listing every tensor a load could not match, if any."""
    if not (missing or misshaped or unexpected or not_loaded):
        return
    parts = []
    if missing:
        parts.append(f"missing from the checkpoint ({len(missing)}): {', '.join(missing)}")
    if misshaped:
        parts.append(f"wrong shape ({len(misshaped)}): " + "; ".join(misshaped))
    if unexpected:
        parts.append(f"unexpected in the checkpoint ({len(unexpected)}): "
                     f"{', '.join(unexpected)}")
    if not_loaded:
        parts.append(f"model parameters no tensor fills: {', '.join(not_loaded)}")
    raise ValueError(f"cannot load {path!r} into a {model_type} model:\n  "
                     + "\n  ".join(parts)
                     + "\nCheck that config.json matches the weights (layers, sizes, "
                       "tie_word_embeddings).")


def from_pretrained(path: str, *, parallelism: Parallelism | None = None,
                    mesh: Mesh | None = None, dtype=jnp.float32, remat=False, rules=(),
                    seed: int = 0, scan: bool | None = None, **overrides):
    """Loads a Hugging Face checkpoint folder into a redray model, sharded on a mesh.

    Args:
      path: a local folder with ``config.json`` and ``model.safetensors`` (or sharded
        ``model-0000x-of-0000y.safetensors`` with ``model.safetensors.index.json``).
      parallelism / mesh: where to place it (a ``redray.Parallelism`` or a mesh; or
        the axis sizes among ``overrides``; default: every device, data parallel).
        Specs come from the automatic rules.
      dtype: compute dtype of the model (parameters stay float32).
      remat: what each block keeps for the backward pass: False/"none", True/"full",
        "dots" or "offload" (``redray.models.layers.REMAT_POLICIES``).
      rules: (regex, PartitionSpec) overrides, as for ``Trainer``.
      seed: seeds what the checkpoint does not hold (dropout RNG state).
      scan: stack the layers and scan over them (one compiled block, whatever the
        depth); each checkpoint tensor of layer i becomes row i of its stacked array.
        None (the default): stacked where the config allows it; False: a list.
      **overrides: the mesh's axis sizes (``model_axis=2``..., as for ``Trainer``), and
        fields set on the config before building (e.g. ``attention_dropout``).

    Returns:
      The ``nnx.Module`` with every parameter placed on its sharding.

    Raises:
      ValueError: listing every missing, unexpected and mis-shaped tensor at once.
    """
    axes = {k: v for k, v in overrides.items() if k in AXIS_KEYWORDS}
    config = load_config(path)
    quantization = getattr(config, "quantization_config", None)
    record = lookup(config.model_type)
    if record.text_config is not None:  # a multimodal checkpoint's language model
        config = getattr(config, record.text_config)
    for key, value in overrides.items():
        if key not in axes:
            setattr(config, key, value)
    fam = family(config.model_type)
    parallelism = Parallelism.resolve(parallelism, mesh, rules, axes, "from_pretrained")
    mesh = parallelism.mesh
    make = lambda: fam.Model(config, rngs=fast_rngs(seed), dtype=dtype, remat=remat,  # noqa: E731
                             scan=scan)
    abstract = nnx.eval_shape(make)
    graphdef, params_abs, extra_abs = nnx.split(abstract, nnx.Param, ...)
    specs = model_specs(graphdef, (params_abs, extra_abs), parallelism,
                        fam.trace_inputs(config))
    param_specs, extra_specs = specs
    is_spec = lambda x: isinstance(x, jax.sharding.PartitionSpec)  # noqa: E731
    paths, leaves, treedef = flatten(params_abs)
    by_path = {p: (leaf, s) for p, leaf, s in zip(paths, leaves,
                                                  jax.tree.leaves(param_specs, is_leaf=is_spec))}
    # the checkpoint's buffers beside the parameters (a router's correction bias)
    buffers = set(flatten(nnx.state(abstract, Buffer))[0])
    extra_paths, extra_leaves, _ = flatten(extra_abs)
    by_path.update({p: (leaf, s) for p, leaf, s in zip(
        extra_paths, extra_leaves, jax.tree.leaves(extra_specs, is_leaf=is_spec)) if p in buffers})

    # the family's own leavings for this config (DeepSeek-V3's multi-token prediction)
    what, dropped = getattr(fam, "left_out", lambda c: ("", ()))(config)
    weights = _Weights(path if not path.endswith(".json") else os.path.dirname(path),
                       record.weight_prefixes, record.left_out + dropped, quantization)
    _tell_reading(path, record, weights, what, dropped)
    plans, problems = _plan_table(fam, config, weights, by_path)
    _refuse_incomplete(path, config.model_type, *problems)
    loaded = _place(plans, by_path, mesh, path, weights)
    params = jax.tree.unflatten(treedef, [loaded[p] for p in paths])
    # What the checkpoint does not hold (RNG state) is created directly on its shards;
    # the parameters' random init is dead code that XLA drops.
    extra_sh = jax.tree.map(lambda s: NamedSharding(mesh, s), extra_specs,
                            is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    extra = jax.jit(lambda: nnx.split(make(), nnx.Param, ...)[2], out_shardings=extra_sh)()
    made, extra_treedef = jax.tree.flatten(extra)
    extra = jax.tree.unflatten(extra_treedef, [loaded[p] if p in buffers else v
                                               for p, v in zip(extra_paths, made)])
    model = nnx.merge(graphdef, params, extra)
    generation = load_generation(path)
    if generation is not None and isinstance(getattr(model, "config", None), HFConfig):
        model.config = HFConfig(model.config.hf, generation)
    return model


def load_generation(path: str) -> dict | None:
    """A checkpoint folder's ``generation_config.json`` as a dict (None without one):
    its ``eos_token_id`` (an int or a list: an instruct model's end-of-turn tokens) is
    where decoding stops by default."""
    folder = os.path.dirname(path) if path.endswith(".json") else path
    file = os.path.join(folder, "generation_config.json")
    if not os.path.exists(file):
        return None
    content = _read_json(file)
    if not isinstance(content, dict):
        raise ValueError(f"{file} is not a JSON object: a generation config holds fields "
                         "such as \"eos_token_id\"; fix or remove the file")
    return content


def generation_for_export(config, tokenizer=None) -> dict:
    """What ``save_pretrained`` writes as ``generation_config.json``: the model's own
    (its checkpoint's), else the config's special tokens, with the tokenizer's EOS
    among the EOS ids (a chat template's end-of-turn token, as a chat fine-tune sets
    it), so a server that reads the folder stops where redray's sampler does."""
    from transformers import GenerationConfig

    own = getattr(config, "generation", None)
    out = dict(own) if own is not None else \
        GenerationConfig.from_model_config(config.hf).to_diff_dict()
    eos = out.get("eos_token_id", getattr(config, "eos_token_id", None))
    eos = [] if eos is None else list(eos) if isinstance(eos, (list, tuple)) else [eos]
    turn = _tokenizer_eos(tokenizer)
    if turn is not None and turn not in eos:
        eos.append(turn)
    if eos:
        out["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    out.pop("transformers_version", None)
    return out


def _tokenizer_eos(tokenizer) -> int | None:
    """A tokenizer's EOS id (a tokenizer object, or a folder of its files), or None."""
    if tokenizer is None:
        return None
    if isinstance(tokenizer, (str, os.PathLike)):
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(os.fspath(tokenizer), local_files_only=True)
        except Exception:  # noqa: BLE001 - a folder transformers cannot read: files only
            return None
    eos = getattr(tokenizer, "eos_token_id", None)
    return eos if isinstance(eos, int) else None


def _tell_reading(path: str, record, weights: _Weights, what: str = "",
                  dropped: tuple = ()) -> None:
    """The console's line on what a load leaves out or converts (nothing otherwise):
    ``dropped``, the prefixes of the family's own leavings, described by ``what``."""
    own = [n for n in weights.left_out if dropped and n.startswith(dropped)]
    wrapped = [n for n in weights.left_out if not (dropped and n.startswith(dropped))]
    if wrapped:
        print(f"redray: {path}: a {record.name} checkpoint; reading its language model, "
              f"leaving out {len(wrapped)} tensors "
              f"({', '.join(sorted({_part(n, record.left_out) for n in wrapped}))})",
              file=sys.stderr, flush=True)
    if own:
        print(f"redray: {path}: leaving out {len(own)} tensors of {what} "
              f"({', '.join(sorted({_part(n, dropped) for n in own}))})",
              file=sys.stderr, flush=True)
    if weights.quantized:
        print(f"redray: {path}: {len(weights.quantized)} tensors stored in MXFP4, "
              "dequantized to float32 region by region as they load", file=sys.stderr, flush=True)
    if weights.fp8:
        rows, cols = weights.block
        print(f"redray: {path}: {len(weights.fp8)} weights stored in FP8 with a scale per "
              f"{rows}x{cols} block, dequantized to float32 region by region as they load",
              file=sys.stderr, flush=True)


def _part(name: str, prefixes) -> str:
    """The part of a checkpoint a left-out tensor is of: the prefix it matched, without
    its dot (``model.visual``, ``vision_model``)."""
    return next(p for p in prefixes if name.startswith(p)).rstrip(".")


_LAYER = re.compile(r"^(.*?)/(\d+)/(.+)$")


def _model_path(table_path: str, params, fam=None, config=None) -> tuple[str, int | None] | None:
    """Where a weight table's path lives in the model: (the path, None) for a model with a
    list of layers; (the stacked path, the row) when ``layers/3/x`` is a row of a stacked
    array (scanned layers: row 3 of ``layers/x``, or with a ``LayerPattern`` of the
    family's model for ``config`` the row of its period's layer, ``layers/period/1/x``,
    or a first layer apart, ``first_layers/0/x``); (the path, None) where the family's
    ``scanned_path`` moves it; None when none exists."""
    if table_path in params:
        return table_path, None
    match = _LAYER.match(table_path)
    pattern = getattr(getattr(fam, "Model", None), "pattern", None)
    if match and pattern is not None and config is not None:
        where, row = pattern(config).place(int(match[2]), match[1])
        if f"{where}/{match[3]}" in params:
            return f"{where}/{match[3]}", row
    if match and f"{match[1]}/{match[3]}" in params:
        return f"{match[1]}/{match[3]}", int(match[2])
    moved = getattr(fam, "scanned_path", lambda _: None)(table_path)
    if moved is not None and moved in params:
        return moved, None
    return None


def _stored_name(row: Tensor, available: set, base_prefix: str | None) -> str | None:
    """The name ``row``'s tensor has in this checkpoint: its own, its fallback, or its
    own without the family's prefix (saved from the base model), else None."""
    candidates = [row.hf, row.fallback]
    if base_prefix and row.hf.startswith(base_prefix):
        candidates.append(row.hf[len(base_prefix):])
    return next((n for n in candidates if n in available), None)


def save_pretrained(model, path: str, max_shard_bytes: int | None = None,
                    tokenizer=None, dtype=None) -> None:
    """Writes ``config.json`` (with ``architectures``, so ``transformers``' Auto classes
    load it) and safetensors, the tokenizer's files when one is given (its chat
    template among them), and ``generation_config.json`` (``generation_for_export``:
    the end-of-turn tokens decoding stops on).

    The tensors are made and written one at a time (a layer of a stacked parameter at a
    time, ``redray/models/writing.py``): no process holds the whole model. A model
    spread over the devices of several processes is saved by calling this on every
    process (each takes part in gathering each tensor); process 0 writes the files.

    Args:
      model: a redray model (from ``from_pretrained`` or ``build``), sharded or not.
      path: output folder (created).
      max_shard_bytes: split the weights into ``model-0000x-of-0000y.safetensors``
        files of at most this size, with an index; None writes one file.
      tokenizer: a ``transformers`` tokenizer (its ``save_pretrained`` writes into
        ``path``), or the path of a folder holding one (its files are copied).
      dtype: the tensors' dtype ("float32", "bfloat16"); None: bfloat16 for a model
        loaded from a bfloat16 or quantized checkpoint (its ``quantization_config``,
        which the export drops: gpt-oss's MXFP4 experts and DeepSeek-V3's FP8
        weights are written dequantized),
        float32 otherwise.
    """
    paths, leaves, _ = flatten(nnx.state(model, nnx.Any(nnx.Param, Buffer)))
    values = dict(zip(paths, leaves))
    write_pretrained(model.config, {p: tuple(v.shape) for p, v in values.items()},
                     lambda dtype: writing.live_fetch(values, dtype), path, max_shard_bytes,
                     tokenizer, dtype)


def write_pretrained(config, shapes: dict, fetch, path: str, max_shard_bytes: int | None = None,
                     tokenizer=None, dtype=None) -> None:
    """``save_pretrained`` from the parameters' shapes (model path -> shape) and a
    ``fetch(dtype)`` giving ``fetch(model path, layer)``, which brings one parameter (or
    one layer of a stacked one) to process 0 in that dtype: from a live model
    (``writing.live_fetch``) or from a checkpoint's files (``redray export``, without
    building the model). ``config``: the model's (``model.config``, or a ``transformers``
    config such as ``load_config`` reads)."""
    import copy

    config = config if isinstance(config, HFConfig) else HFConfig(config)
    hf = copy.deepcopy(config.hf)
    hf.architectures = [lookup(hf.model_type).architecture]
    if getattr(hf, "num_nextn_predict_layers", 0):  # DeepSeek's: not loaded, not written
        hf.num_nextn_predict_layers = 0
    quantized = getattr(hf, "quantization_config", None) is not None
    if quantized:
        del hf.quantization_config
    dtype = dtype or ("bfloat16" if quantized or _stored_bfloat16(hf) else "float32")
    if dtype not in writing.DTYPES:
        raise ValueError(f"save_pretrained dtype={dtype!r}: use 'float32' or 'bfloat16'")
    hf.dtype = dtype
    main = jax.process_index() == 0
    if main:
        os.makedirs(path, exist_ok=True)
        hf.save_pretrained(path)
        if tokenizer is not None:
            save_tokenizer(tokenizer, path)
        with open(os.path.join(path, "generation_config.json"), "w") as f:
            json.dump(generation_for_export(config, tokenizer), f, indent=2, sort_keys=True)
            f.write("\n")
    layout = hf_layout(config, shapes)
    # a checkpoint's buffers (a router's correction bias, which the bias update moves by
    # 0.001) keep float32 whatever the weights' dtype, as DeepSeek's releases store them
    kept = {path for row, path, *_ in layout if getattr(row, "buffer", False)}
    entries = [(name, shape, *((np.float32,) if getattr(row, "buffer", False) else ()))
               for row, *_, parts in layout for name, shape in parts]
    writer = writing.SafetensorsWriter(path, entries, writing.DTYPES[dtype], max_shard_bytes,
                                       SINGLE_FILE, INDEX_FILE) if main else None
    progress = _Progress(path, len(entries), None, "saving", "tensors written")
    weights, buffers = fetch(writing.DTYPES[dtype]), fetch(np.dtype(np.float32)) if kept \
        else None

    def fetching(model_path, layer):
        return (buffers if model_path in kept else weights)(model_path, layer)

    for name, array in writing.hf_stream(layout, fetching):
        writer.write(name, array)
        del array  # held no longer than the writing: the next tensor is being gathered
        progress.placed(writer.total)
    if writer is not None:
        writer.close()
    progress.done(writer.total if writer else 0)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(f"redray save_pretrained {path}")


def hf_layout(config, shapes: dict, gradients: bool = False) -> list:
    """(row, model path, layer or None, [(HF name, HF shape) of each part]) for every
    row of the family's weight table, in its order, from the parameters' shapes alone
    (``shapes``: model path -> shape): what ``writing.hf_stream`` makes and a
    ``writing.SafetensorsWriter`` announces. ``gradients``: ``shapes`` are a tree of
    gradients, which has no buffers (their rows are left out)."""
    fam = family(config.model_type)
    out = []
    for row in fam.weight_table(config):
        where = _model_path(row.path, shapes, fam, config)
        if where is None and gradients and getattr(row, "buffer", False):
            continue
        if where is None:
            raise AssertionError(f"{fam.__name__}: table path {row.path!r} is not a parameter")
        model_path, layer = where
        shape = tuple(shapes[model_path])
        shape = shape if layer is None else shape[1:]
        probe = np.broadcast_to(np.zeros((), np.float32), shape)  # shapes only, no memory
        parts = [(part.hf, tuple(np.shape(a))) for part, a in zip(row.parts, row.write(probe))]
        out.append((row, model_path, layer, parts))
    return out


def _stored_bfloat16(config) -> bool:
    """Whether a config says its checkpoint holds bfloat16 tensors."""
    stored = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    return str(stored).endswith("bfloat16")


def hf_tensors(config, params) -> dict[str, np.ndarray]:
    """The Hugging Face tensors (name -> float32 numpy array, in ``transformers``' layout)
    of a redray model's parameters, or of a tree shaped as them (their gradients): a
    buffer's tensor only where the tree holds it.

    Args:
      config: the model's ``config``.
      params: ``nnx.state(model, nnx.Param)``, or a tree of the same structure.
    """
    paths, leaves, _ = flatten(params)
    values = dict(zip(paths, leaves))
    layout = hf_layout(config, {p: tuple(np.shape(v)) for p, v in values.items()},
                       gradients=True)
    return {name: np.ascontiguousarray(array, np.float32) for name, array in
            writing.hf_stream(layout, writing.live_fetch(values, np.float32))}


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "tokenizer.model", "spiece.model",
                   "added_tokens.json", "chat_template.jinja")


def save_tokenizer(tokenizer, path: str) -> list[str]:
    """Writes a tokenizer into ``path``: a ``transformers`` tokenizer through its
    ``save_pretrained``, or a folder's tokenizer files copied. Returns the files."""
    import shutil

    os.makedirs(path, exist_ok=True)
    if not isinstance(tokenizer, (str, os.PathLike)):
        return [os.path.basename(f) for f in tokenizer.save_pretrained(path)]
    folder = os.fspath(tokenizer)
    found = [n for n in TOKENIZER_FILES if os.path.isfile(os.path.join(folder, n))]
    if not found:
        raise FileNotFoundError(f"no tokenizer files in {folder!r} (expected one of "
                                f"{', '.join(TOKENIZER_FILES[:5])}, ...)")
    for name in found:
        shutil.copyfile(os.path.join(folder, name), os.path.join(path, name))
    return found


class HFConfig:
    """A ``transformers`` config kept on a model: read-through, hashable, comparable.

    NNX keeps non-array attributes in the (hashed) graph definition; ``transformers``
    configs are not hashable, so the model holds this wrapper, keyed by the JSON. It
    also keeps the checkpoint's ``generation_config.json`` (``generation``: its dict,
    or None), which ``transformers`` keeps apart from the config: an instruct model's
    end-of-turn tokens are listed there, not in ``config.json``.
    """

    def __init__(self, config, generation: dict | None = None):
        object.__setattr__(self, "_config", config)
        object.__setattr__(self, "_generation", None if generation is None else dict(generation))
        object.__setattr__(self, "_key", config.to_json_string(use_diff=False)
                           + json.dumps(generation, sort_keys=True))

    @property
    def generation(self) -> dict | None:
        """The checkpoint's generation config (``generation_config.json``), or None."""
        return None if self._generation is None else dict(self._generation)

    def __getattr__(self, name):
        return getattr(self._config, name)

    def __setattr__(self, name, value):
        raise AttributeError("a model's config is frozen: set fields before building the model")

    def __hash__(self):
        return hash(self._key)

    def __eq__(self, other):
        return isinstance(other, HFConfig) and other._key == self._key

    def save_pretrained(self, path):
        self._config.save_pretrained(path)

    @property
    def hf(self):
        """The underlying ``transformers`` config."""
        return self._config

    def __getstate__(self):
        return {"config": self._config, "generation": self._generation}

    def __setstate__(self, state):
        self.__init__(state["config"], state.get("generation"))
