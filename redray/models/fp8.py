"""FP8 block-scaled weights (the format DeepSeek-V3, DeepSeek-R1 and Kimi-K2 release
their checkpoints in), dequantized in numpy as a checkpoint is read.

A quantized weight ``X.weight`` (..., out, in) is stored as float8 e4m3 beside
``X.weight_scale_inv`` (..., ceil(out / b0), ceil(in / b1)), one float32 scale a block
of b0 x b1 values; the block size is config.json's ``quantization_config``
(``{"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}`` in the
releases), and the last block of an axis is cut short where the block size does not
divide it. A value is its weight times its block's scale, as
``transformers.integrations.finegrained_fp8`` dequantizes them (its
``_dequantize_fp8_weight``).
"""

from __future__ import annotations

import math
import os

import ml_dtypes
import numpy as np

WEIGHT, SCALE = ".weight", ".weight_scale_inv"
FORMAT = "e4m3"
SHOWN = 10  # the refused weights a message lists (a release has tens of thousands)
FLOAT8 = (np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e5m2))


def block_size(quantization, where: str) -> tuple[int, int] | None:
    """The (rows, columns) of a block of a checkpoint quantized as ``quantization``
    says (its config's ``quantization_config``, a dict or None), or None where it is
    not FP8. Raises a ValueError naming the field of ``where`` (the config file) that
    redray cannot read."""
    if hasattr(quantization, "to_dict"):
        quantization = quantization.to_dict()
    if not isinstance(quantization, dict) or quantization.get("quant_method") != "fp8":
        return None
    fmt = quantization.get("fmt", FORMAT)
    if fmt != FORMAT:
        raise ValueError(f"{where}: quantization_config.fmt is {fmt!r}; redray reads FP8 "
                         f"weights stored as {FORMAT!r} (float8_e4m3fn, as DeepSeek-V3 and "
                         "Kimi-K2 release them): dequantize the checkpoint to bfloat16 first")
    block = quantization.get("weight_block_size")
    if not (isinstance(block, (list, tuple)) and len(block) == 2
            and all(isinstance(n, int) and n > 0 for n in block)):
        raise ValueError(f"{where}: quantization_config.weight_block_size is {block!r}; "
                         "redray reads FP8 weights with a scale per block and needs the "
                         "block's [rows, columns] (e.g. [128, 128], as the releases' "
                         "config.json says)")
    return tuple(block)


def quantized_names(names) -> dict[str, tuple[str, str]]:
    """The tensors of ``names`` stored in FP8: name -> (its weight, its scales)."""
    names = set(names)
    return {n: (n, n[:-len(WEIGHT)] + SCALE) for n in names
            if n.endswith(WEIGHT) and n[:-len(WEIGHT)] + SCALE in names}


def refuse_unreadable(weights: dict, bare: dict, block: tuple, folder: str) -> None:
    """Raises one ValueError naming every FP8 weight of the checkpoint in ``folder``
    that cannot be read in blocks of ``block`` (its config.json's), and the fix; nothing
    where all can. ``weights``: name -> (the weight's, its scales' stored tensor, each
    with a ``dtype`` and a ``shape``); ``bare``: name -> dtype of the float8 tensors
    without scales beside them."""
    where = os.path.join(folder, "config.json")
    wrong, misshaped = [], False
    for name, (weight, scales) in sorted(weights.items()):
        scale_name = name[:-len(WEIGHT)] + SCALE
        if np.dtype(weight.dtype) != np.dtype(ml_dtypes.float8_e4m3fn):
            wrong.append(f"{name} is stored as {np.dtype(weight.dtype).name}, not "
                         f"float8_e4m3fn as {where}'s quantization_config.fmt {FORMAT!r} "
                         "says: the files and config.json disagree; fetch the checkpoint's "
                         "own config.json")
        elif not np.issubdtype(np.dtype(scales.dtype), np.floating):
            wrong.append(f"{scale_name} is stored as {np.dtype(scales.dtype).name}: redray "
                         "reads FP8 scales stored as floats (float32, as DeepSeek-V3 and "
                         "Kimi-K2 release them)")
        elif tuple(scales.shape) != grid(weight.shape, block):
            misshaped = True
            wrong.append(f"{scale_name} is {tuple(scales.shape)}, but {name} "
                         f"{tuple(weight.shape)} in blocks of {list(block)} has "
                         f"{grid(weight.shape, block)} blocks")
    wrong += [f"{name} is stored as {np.dtype(dtype).name} without its scales beside it "
              f"({name.removesuffix(WEIGHT)}{SCALE}): fetch the checkpoint's files again"
              for name, dtype in sorted(bare.items())]
    if not wrong:
        return
    fix = ""
    if misshaped:
        fits = fitting_block([(tuple(w.shape), tuple(s.shape)) for w, s in weights.values()])
        fits = f"the scales fit blocks of {list(fits)}: " if fits else ""
        fix = (f"\n{fits}set {where}'s quantization_config.weight_block_size (now "
               f"{list(block)}) to the block size the checkpoint was quantized with (the "
               "release's config.json says it), or fetch the tensors' files again")
    shown = wrong[:SHOWN] + ([f"... and {len(wrong) - SHOWN} more"] if len(wrong) > SHOWN else [])
    raise ValueError(f"cannot read {len(wrong)} FP8 weights of {folder!r}:\n  "
                     + "\n  ".join(shown) + fix)


def fitting_block(shapes) -> tuple | None:
    """The smallest block in which every weight of ``shapes`` (its shape, its scales')
    has its scales, or None where no block gives them all (a scale tensor damaged,
    not a block size mistaken)."""
    out = []
    for axis in (-2, -1):
        low, high = 1, math.inf
        for shape, scales in shapes:
            if len(scales) != len(shape) or len(shape) < 2:
                return None
            n, s = shape[axis], scales[axis]
            if s < 1 or s > n:
                return None
            # the blocks b with ceil(n / b) == s: ceil(n / s) to ceil(n / (s - 1)) - 1
            low = max(low, -(-n // s))
            high = min(high, -(-n // (s - 1)) - 1 if s > 1 else math.inf)
        if low > high:
            return None
        out.append(low)
    return tuple(out)


def grid(shape: tuple, block: tuple) -> tuple:
    """The shape of the scales of a weight of ``shape`` in blocks of ``block``."""
    *lead, rows, cols = shape
    return (*lead, -(-rows // block[0]), -(-cols // block[1]))


def dequantize(weight: np.ndarray, scale_inv: np.ndarray, block: tuple) -> np.ndarray:
    """The float32 tensor of an FP8 ``weight`` (..., out, in) and its ``scale_inv`` per
    ``block`` (see the module)."""
    weight, scale_inv = np.asarray(weight), np.asarray(scale_inv)
    if scale_inv.shape != grid(weight.shape, block):
        raise ValueError(f"FP8 weight {weight.shape} in blocks of {list(block)} has "
                         f"{grid(weight.shape, block)} blocks, but its scales are "
                         f"{scale_inv.shape}: the block size must be the one it was "
                         "quantized with")
    return scale(weight.astype(np.float32), scale_inv, block, (0, 0))


def scale(values: np.ndarray, scales: np.ndarray, block: tuple, start: tuple) -> np.ndarray:
    """``values`` (float32, a box of a weight starting at row and column ``start``)
    times their blocks' ``scales`` (those of the blocks the box meets), in place."""
    rows, cols = values.shape[-2:]
    (r0, c0), (b0, b1) = start, block
    columns = (np.arange(c0, c0 + cols) // b1) - c0 // b1
    scales = np.asarray(scales, np.float32)
    # a row of blocks at a time: no second box-sized array of scales
    for k in range(r0 // b0, -(-(r0 + rows) // b0)):
        a, b = max(r0, k * b0) - r0, min(r0 + rows, (k + 1) * b0) - r0
        values[..., a:b, :] *= scales[..., k - r0 // b0, columns][..., None, :]
    return values
