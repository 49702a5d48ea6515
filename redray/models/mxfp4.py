"""MXFP4 weights (the OCP microscaling format gpt-oss's released checkpoints use for
their experts), dequantized in numpy as a checkpoint is read.

A quantized tensor ``X`` is stored as ``X_blocks`` (..., rows, groups, 16) uint8, two
4-bit E2M1 values a byte (the low nibble first), 32 values a group, and ``X_scales``
(..., rows, groups) uint8, each group's power-of-two scale biased by 127. Its values,
(..., rows, groups x 32), are laid out transposed against the model's tensor: the
dequantized tensor is (..., groups x 32, rows), as ``transformers.integrations.mxfp4``
turns them back (its ``convert_moe_packed_tensors``).
"""

from __future__ import annotations

import numpy as np

# The 16 values of an E2M1 nibble: sign, two exponent bits, one mantissa bit.
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                       -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)
BLOCKS, SCALES = "_blocks", "_scales"


def dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """The float32 tensor of MXFP4 ``blocks`` and ``scales`` (see the module)."""
    blocks = np.asarray(blocks, np.uint8)
    scales = np.asarray(scales)
    if blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {blocks.shape} and scales {scales.shape} disagree: "
                         "the blocks' shape is the scales' and 16 bytes a group")
    values = np.empty((*blocks.shape[:-1], blocks.shape[-1] * 2), np.float32)
    values[..., 0::2] = FP4_VALUES[blocks & 0x0F]
    values[..., 1::2] = FP4_VALUES[blocks >> 4]
    values = np.ldexp(values, scales.astype(np.int32)[..., None] - 127)
    return np.swapaxes(values.reshape(*blocks.shape[:-2], -1), -1, -2)


def quantized_names(names) -> dict[str, tuple[str, str]]:
    """The tensors of ``names`` stored in MXFP4: name -> (its blocks, its scales)."""
    names = set(names)
    return {n[:-len(BLOCKS)]: (n, n[:-len(BLOCKS)] + SCALES) for n in names
            if n.endswith(BLOCKS) and n[:-len(BLOCKS)] + SCALES in names}
