"""A trained run's weights in one call: ``load_params`` and ``load_model``."""

from __future__ import annotations

from typing import Any

import jax

from redray.checkpoint import (CheckpointConfig, Checkpointer, CheckpointMismatch,
                               find_checkpoints, select_step)
from redray.engine.model import _NNX, abstract_state, adapter, merge_trainable, split_trainable
from redray.engine.state import CHECKPOINT_ITEMS, MODEL_ITEM
from redray.rngs import Stream, stream_key


def load_params(path: str, model: Any, *, step: int | None = None, best: str | None = None):
    """The trained (params, extra) of a checkpoint, as host arrays in ``model``'s structure.

    One call for fine-tuning from a trained run or for prediction::

        params, extra = redray.load_params("/runs/my-run", model)
        Predictor(model, collate, predict, params=params, extra=extra, batch_size=32)

    A run that trained only some parameters (``trainable=``) saved only those: the
    others are taken from ``model`` as it builds them (the same base weights the run
    started from).

    Args:
      path: a run folder (``<storage>/<name>``), its ``checkpoints`` folder, or one
        checkpoint's folder.
      model: what built the run's model (the same factory, module or LinenModel).
      step: a step to load; default the newest (or see ``best``).
      best: ``"min:<metric>"`` / ``"max:<metric>"``: the best checkpoint by that metric.
    """
    return _load(path, adapter(model), step, best)


def load_model(path: str, model: Any, *, step: int | None = None, best: str | None = None):
    """An NNX model with a checkpoint's weights (``model``: the run's factory or module)."""
    from flax import nnx

    wrapped = adapter(model)
    if not isinstance(wrapped, _NNX):
        raise TypeError("load_model builds NNX models; for a LinenModel use load_params")
    params, extra = _load(path, wrapped, step, best)
    return nnx.merge(wrapped.graphdef, params, extra)


def _load(path, wrapped, step, best):
    directory, found = find_checkpoints(path)
    checkpointer = Checkpointer(CheckpointConfig(directory=directory), CHECKPOINT_ITEMS)
    try:
        chosen = select_step(checkpointer, step if step is not None else found, best)
        meta = checkpointer.read_meta(chosen)
        params, extra = abstract_state(wrapped, jax.random.key(0))
        pattern = meta.get("trainable")
        saved = params if pattern is None else split_trainable(params, pattern)[0]
        # without shardings: restored into host memory
        like = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype),
                            {"params": saved, "extra": extra})
        try:
            values = checkpointer.restore(chosen, {MODEL_ITEM: like})[MODEL_ITEM]
        except (KeyError, ValueError) as error:
            raise CheckpointMismatch(
                f"checkpoint {checkpointer.step_path(chosen)} does not match this model "
                f"({type(error).__name__}: {error}): pass the model the run trained") from None
        params = values["params"]
        if pattern is not None:
            # Only the trained parameters were saved; the rest are the model's as built
            # (a built module's weights, or a factory's initialization with the run's seed).
            base = getattr(wrapped, "values", None)
            if base is None:
                base = jax.jit(wrapped.init)(stream_key(meta.get("seed", 0), Stream.INIT))
            frozen = split_trainable(jax.device_get(base[0]), pattern)[1]
            params = merge_trainable(params, frozen)
        return params, values["extra"]
    finally:
        checkpointer.close()
