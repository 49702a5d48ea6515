"""The three-function contract, checked early with errors that say what to fix.

* ``collate(examples) -> dict[str, np.ndarray]``: a list of raw examples to a batch,
  every array batch-major with the same leading size.
* ``loss(model, batch, rng, train) -> scalar | (scalar, dict of scalar metrics)``. A
  metric named ``weight`` (``WEIGHT``) is the batch's weight: how many units (real
  tokens, say) the loss and the metrics average over in it. Evaluation then averages
  over every unit of the data (sums of value x weight, divided once by the total
  weight), not over batches, and so does each log window over its steps. Without
  it a batch weighs its examples. Gradient accumulation weighs each micro-batch by it
  too: the update's loss, metrics and gradients are the means over every unit of the
  global batch. Metrics named in ``COUNTS`` (``tokens``, ``sequences``: what
  ``next_token_loss(..., metrics=True)`` gives) are counts: summed over micro-batches
  and over an evaluation's batches, a log window's mean per step.
* ``predict(model, batch, rng) -> pytree`` whose every leaf is batch-major.

``model`` is the user's Flax NNX module, or a Linen module bound to its parameters.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Callable

import jax
import numpy as np


# The loss metric that weighs its batch (see the module docstring): not logged itself.
WEIGHT = "weight"
# Loss metrics that count units of the batch (see the module docstring): summed.
COUNTS = ("tokens", "sequences")


class UserFunctionError(ValueError):
    """A user function returned something redray cannot use; the message says the fix."""


@dataclasses.dataclass(frozen=True)
class UserFunctions:
    """The user's three functions.

    Attributes:
      collate: list of raw examples -> dict of numpy arrays (batch-major).
      loss: (model, batch, rng, train) -> scalar, or (scalar, dict of metrics).
      predict: optional (model, batch, rng) -> pytree of batch-major arrays.
    """
    collate: Callable[[list], Mapping[str, np.ndarray]]
    loss: Callable[..., Any]
    predict: Callable[..., Any] | None = None

    def __post_init__(self):
        for name in ("collate", "loss"):
            if not callable(getattr(self, name)):
                raise UserFunctionError(f"{name} must be a function, got {getattr(self, name)!r}")
        if self.predict is not None and not callable(self.predict):
            raise UserFunctionError(f"predict must be a function or None, got {self.predict!r}")


def check_batch(batch: Any, n_examples: int | None = None) -> dict[str, np.ndarray]:
    """Validates what ``collate`` returned and converts it to a dict of numpy arrays.

    Args:
      batch: collate's output.
      n_examples: how many examples collate was given; when set, the batch size must
        match (a training batch is placed row by row over the devices, and the
        Predictor maps outputs back to inputs one to one).

    Raises:
      UserFunctionError: naming the key and the fix.
    """
    if not isinstance(batch, Mapping) or not batch:
        raise UserFunctionError(
            f"collate returned {type(batch).__name__}, expected a non-empty dict of numpy "
            "arrays, e.g. {'input_ids': np.array(...), 'labels': np.array(...)}")
    out = {}
    for key, value in batch.items():
        if not isinstance(key, str):
            raise UserFunctionError(f"collate returned a non-string key {key!r}: use str keys")
        if isinstance(value, (list, tuple)):
            raise UserFunctionError(
                f"collate returned batch[{key!r}] as a {type(value).__name__}: return a numpy "
                f"array instead, e.g. np.stack(...) or np.array(...)"
                + _ragged_hint(value))
        if isinstance(value, jax.Array):
            value = np.asarray(value)
        if not isinstance(value, np.ndarray):
            raise UserFunctionError(
                f"collate returned batch[{key!r}] of type {type(value).__name__}: return a "
                "numpy array with one row per example, e.g. np.full(len(examples), value)")
        if value.dtype == object:
            raise UserFunctionError(
                f"collate returned batch[{key!r}] with dtype object (ragged or mixed rows): "
                "pad every row to the same length, e.g. with np.pad, and return a numeric array")
        if value.ndim == 0:
            raise UserFunctionError(
                f"collate returned batch[{key!r}] as a scalar: every entry needs a leading "
                "batch dimension (one row per example)")
        out[key] = value
    sizes = {k: v.shape[0] for k, v in out.items()}
    if len(set(sizes.values())) > 1:
        listed = ", ".join(f"{k}: {s}" for k, s in sizes.items())
        raise UserFunctionError(
            f"collate returned arrays whose batch (first) dimensions differ ({listed}): every "
            "array must have one row per example")
    if n_examples is not None:
        size = next(iter(sizes.values()))
        if size != n_examples:
            raise UserFunctionError(
                f"collate was given {n_examples} examples but returned a batch of {size} rows: "
                "return exactly one row per example")
    return out


def _ragged_hint(value) -> str:
    try:
        lengths = {len(v) for v in value}
    except TypeError:
        return ""
    if len(lengths) > 1:
        return f" (its rows have different lengths {sorted(lengths)[:5]}: pad them first)"
    return ""


def split_loss_output(out: Any) -> tuple[Any, dict]:
    """Checks loss's output (abstract or concrete) and returns (loss, metrics).

    Raises:
      UserFunctionError: for a non-scalar loss or metric, or a malformed tuple.
    """
    metrics: Any = {}
    if isinstance(out, tuple):
        if len(out) != 2 or not isinstance(out[1], Mapping):
            raise UserFunctionError(
                f"loss returned a tuple of {len(out)} items: return a scalar, or "
                "(scalar, dict of scalar metrics)")
        out, metrics = out
    shape = getattr(out, "shape", None)
    if shape is None:
        raise UserFunctionError(f"loss returned {type(out).__name__}, expected a scalar array")
    if tuple(shape) != ():
        raise UserFunctionError(
            f"loss returned shape {tuple(shape)}, expected a scalar: reduce it, e.g. with .mean()")
    if not jax.numpy.issubdtype(out.dtype, jax.numpy.floating):
        raise UserFunctionError(f"loss returned dtype {out.dtype}, expected a floating-point "
                                "scalar")
    checked = {}
    for name, value in metrics.items():
        try:
            shape = tuple(jax.numpy.shape(value))
        except TypeError:
            raise UserFunctionError(f"loss metric {name!r} is a {type(value).__name__}, expected a "
                                "scalar number or array") from None
        if shape != ():
            raise UserFunctionError(
                f"loss metric {name!r} has shape {shape}, expected a scalar: reduce it, "
                "e.g. with .mean()")
        checked[name] = value
    return out, checked


def check_predict_output(out: Any, batch_size: int) -> None:
    """Every leaf of predict's output must be batch-major with ``batch_size`` rows.

    Raises:
      UserFunctionError: naming the leaf's path and shape.
    """
    leaves = jax.tree_util.tree_flatten_with_path(out)[0]
    if not leaves:
        raise UserFunctionError("predict returned no arrays: return an array or a dict of arrays")
    for path, leaf in leaves:
        shape = tuple(getattr(leaf, "shape", ()))
        where = jax.tree_util.keystr(path) or "its output"
        if not shape or shape[0] != batch_size:
            raise UserFunctionError(
                f"predict returned {where} with shape {shape} for a batch of {batch_size}: "
                f"every output needs the batch as its first dimension ({batch_size}, ...), "
                "one row per example (don't reduce over the batch in predict)")
