"""LoRA: low-rank adapters on a model's linear layers, and merging them back.

``add_lora`` wraps chosen ``nnx.Linear``/``nnx.LinearGeneral`` layers so they compute
``base(x) + (x A) B * alpha / rank`` with ``A`` (in, rank) random and ``B`` (rank, out)
zero: the adapted model starts out computing exactly what the base model computes.
Train only the adapters with ``Trainer.of(..., trainable=r"lora_")``: optimizer state and
checkpoints then hold ``A`` and ``B`` alone. ``merge_lora`` folds them into the base
kernels (e.g. before ``save_pretrained``).
"""

from __future__ import annotations

import math
import re

import jax.numpy as jnp
from flax import nnx

# The layers computing the attention queries and values in every family of
# redray.models: the fused Q/K/V projections (``qkv_proj``, GPT-2's ``c_attn``, T5's
# ``qkv``), T5's cross-attention ``q`` and ``kv``, and DeepSeek's latent attention's
# query (``q_proj``, or ``q_b_proj`` after its low-rank path) and key/value
# up-projection (``kv_b_proj``). A fused layer's adapter updates the keys too.
DEFAULT_TARGETS = r"(^|/)(qkv_proj|c_attn|qkv|q|kv|q_proj|q_b_proj|kv_b_proj)$"


class LoRA(nnx.Module):
    """A linear layer (``base``) plus a trainable low-rank update of its output.

    Args:
      base: an ``nnx.Linear``, or an ``nnx.LinearGeneral`` contracting its input's last
        axes.
      rank: the adapters' inner dimension.
      alpha: the update is scaled by ``alpha / rank``.
      rngs: initializes ``A``.
    """

    def __init__(self, base: nnx.Module, rank: int, alpha: float, *, rngs: nnx.Rngs):
        ins, outs = _features(base)
        self.base = base
        self.in_dims, self.out_shape = len(ins), outs
        self.scale = alpha / rank
        kernel = base.kernel[...]
        # a layer of stacked blocks (scanned layers) has a kernel per layer: so do its
        # adapters, and the scan hands each step its own
        lead = kernel.shape[:kernel.ndim - len(ins) - len(outs)]
        self.lora_a = nnx.Param(nnx.initializers.he_uniform(in_axis=-2, out_axis=-1)(
            rngs.params(), (*lead, math.prod(ins), rank), kernel.dtype))
        self.lora_b = nnx.Param(jnp.zeros((*lead, rank, math.prod(outs)), kernel.dtype))

    def kernel(self):
        """The base kernel with the adapters' update folded in (what ``merge_lora``
        writes): for a model that uses a layer's weights beyond calling it (DeepSeek's
        latent attention folds its key and value projections into queries and
        outputs while decoding)."""
        kernel = self.base.kernel[...]
        update = (self.lora_a[...] @ self.lora_b[...]) * self.scale
        return kernel + update.reshape(kernel.shape).astype(kernel.dtype)

    def __call__(self, x):
        y = self.base(x)
        lead = x.shape[:x.ndim - self.in_dims]
        update = x.reshape(*lead, -1) @ self.lora_a[...] @ self.lora_b[...]
        return y + (update * self.scale).reshape(*lead, *self.out_shape).astype(y.dtype)


def _features(layer) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(input feature dims, output feature dims) of a linear layer."""
    if isinstance(layer, nnx.Linear):
        return (layer.in_features,), (layer.out_features,)
    ins, outs = tuple(layer.in_features), tuple(layer.out_features)
    if tuple(layer.axis) != tuple(range(-len(ins), 0)):
        raise ValueError(f"LoRA supports LinearGeneral layers that contract their input's last "
                         f"axes; this one contracts axes {layer.axis}")
    return ins, outs


def _linear_layers(model: nnx.Module) -> dict[str, tuple]:
    """"/"-joined path -> (parent, key, layer) for every linear layer of ``model``."""
    found = {}
    for path, module in nnx.iter_modules(model):
        if path and isinstance(module, (nnx.Linear, nnx.LinearGeneral)):
            found["/".join(map(str, path))] = (_parent(model, path), path[-1], module)
    return found


def _parent(model: nnx.Module, path: tuple):
    node = model
    for key in path[:-1]:
        node = node[key] if isinstance(key, int) else getattr(node, key)
    return node


def _replace(parent, key, new) -> None:
    if isinstance(key, int):
        parent[key] = new
    else:
        setattr(parent, key, new)


def add_lora(model: nnx.Module, rank: int = 8, *, alpha: float | None = None,
             targets: str = DEFAULT_TARGETS, seed: int = 0) -> nnx.Module:
    """Adds LoRA adapters to the linear layers of ``model`` whose path matches ``targets``.

    Args:
      model: an NNX model (e.g. from ``redray.models.from_pretrained`` or ``build``);
        changed in place and returned.
      rank: the adapters' rank.
      alpha: scale numerator (the update is scaled by ``alpha / rank``); default ``rank``.
      targets: regex (``re.search``) on the layers' "/"-joined paths, such as
        ``layers/0/self_attn/qkv_proj``; default: the layers computing attention
        queries and values.
      seed: initializes the ``A`` matrices.

    Returns:
      ``model``, its matching layers now ``LoRA`` modules. Their parameter paths end in
      ``lora_a``/``lora_b`` (train them alone with ``trainable=r"lora_"``); the base
      weights move under ``.../base/``.

    Raises:
      ValueError: when ``targets`` matches no linear layer (the message lists them).
    """
    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"rank={rank!r}: give a positive int, e.g. 8")
    layers = _linear_layers(model)
    chosen = {p: v for p, v in layers.items() if re.search(targets, p)}
    if not chosen:
        raise ValueError(f"targets={targets!r} matches no linear layer; the model's are e.g. "
                         f"{sorted(layers)[:8]}: give a regex matching some of them")
    rngs = nnx.Rngs(seed)
    for parent, key, layer in chosen.values():
        _replace(parent, key, LoRA(layer, rank, float(alpha or rank), rngs=rngs))
    return model


def merge_lora(model: nnx.Module) -> nnx.Module:
    """Folds every LoRA update into its base kernel and removes the adapters, in place.

    The merged model computes what the adapted one did (up to rounding) with the
    original architecture, so ``save_pretrained`` writes a regular checkpoint.
    """
    for path, module in list(nnx.iter_modules(model)):
        if not isinstance(module, LoRA):
            continue
        base = module.base
        base.kernel[...] = module.kernel()
        _replace(_parent(model, path), path[-1], base)
    return model
