"""A trained run's weights in one call: ``load_params`` and ``load_model``; and
``stored_params``, a checkpoint's parameters read a piece at a time (an export)."""

from __future__ import annotations

import logging
from typing import Any

import jax
from flax import nnx

from redray.checkpoint import (CheckpointConfig, Checkpointer, CheckpointMismatch, StoredArrays,
                               check_meta, find_checkpoints, select_step, storage_paths)
from redray.engine.model import _NNX, abstract_state, adapter, merge_trainable, split_trainable
from redray.sharding import flatten
from redray.engine.state import CHECKPOINT_ITEMS, MODEL_ITEM
from redray.rngs import KeyStream, stream_key

log = logging.getLogger("redray.checkpoint")


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
    """The (params, extra) of the checkpoint ``step``/``best`` chooses, else of the newest
    one that reads back: a damaged newest checkpoint (a write cut short, a partial copy)
    is skipped with a warning naming it and why, as training does; nothing is renamed."""
    directory, found = find_checkpoints(path)
    checkpointer = Checkpointer(CheckpointConfig(directory=directory), CHECKPOINT_ITEMS)
    try:
        wanted = step if step is not None else found
        if wanted is not None or best is not None:
            chosen = select_step(checkpointer, wanted, best)
            try:
                return _read(checkpointer, chosen, wrapped)
            except CheckpointMismatch:
                raise
            except Exception as error:  # noqa: BLE001 - named in the error below
                others = [s for s in checkpointer.steps() if s != chosen]
                raise CheckpointMismatch(
                    f"checkpoint {checkpointer.step_path(chosen)} could not be restored into "
                    f"this model ({_reason(error)}). If the model is the one the run trained, "
                    "the checkpoint is damaged (a write cut short, a partial copy): "
                    + (f"load another (step=..., of {others}) or leave step out for the "
                       "newest readable one" if others else "the run has no other checkpoint")
                    + "; otherwise pass the model the run trained") from None
        skipped = []
        select_step(checkpointer, None, None)  # none at all: its FileNotFoundError
        for candidate in reversed(checkpointer.steps()):
            try:
                values = _read(checkpointer, candidate, wrapped)
            except CheckpointMismatch:  # readable, but another model's: older ones are too
                raise
            except Exception as error:  # noqa: BLE001 - any failure: try the one before
                skipped.append((candidate, error))
                continue
            for bad, error in skipped:
                log.warning("checkpoint %s cannot be restored (%s): skipped; loading %s, the "
                            "newest readable one", checkpointer.step_path(bad), _reason(error),
                            checkpointer.step_path(candidate))
            return values
        newest, error = skipped[0]
        raise CheckpointMismatch(
            f"no checkpoint in {directory} could be restored into this model: the newest, "
            f"{checkpointer.step_path(newest)}, fails with {_reason(error)}"
            + (f", and the {len(skipped) - 1} older ones fail too (the oldest, "
               f"{checkpointer.step_path(skipped[-1][0])}, with {_reason(skipped[-1][1])})"
               if len(skipped) > 1 else "")
            + ": pass the model the run trained (the same factory, module or LinenModel, "
            "with the same sizes)") from None
    finally:
        checkpointer.close()


def _reason(error: Exception) -> str:
    return f"{type(error).__name__}: {str(error).splitlines()[0][:300]}" if str(error) \
        else type(error).__name__


def _read(checkpointer: Checkpointer, step: int, wrapped):
    """Checkpoint ``step``'s (params, extra) as host arrays in ``wrapped``'s structure."""
    meta = checkpointer.read_meta(step)
    check_meta(meta, step)
    params, extra = abstract_state(wrapped, jax.random.key(0))
    pattern = meta.get("trainable")
    saved = params if pattern is None else split_trainable(params, pattern)[0]
    # without shardings: restored into host memory
    like = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype),
                        {"params": saved, "extra": extra})
    values = checkpointer.restore(step, {MODEL_ITEM: like})[MODEL_ITEM]
    params = values["params"]
    if pattern is not None:
        # Only the trained parameters were saved; the rest are the model's as built
        # (a built module's weights, or a factory's initialization with the run's seed).
        base = getattr(wrapped, "values", None)
        if base is None:
            base = jax.jit(wrapped.init)(stream_key(meta.get("seed", 0), KeyStream.INIT))
        frozen = split_trainable(jax.device_get(base[0]), pattern)[1]
        params = merge_trainable(params, frozen)
    return params, values["extra"]


class StoredParams:
    """A checkpoint's parameters, read a piece at a time: ``shapes`` (model path ->
    shape, the paths ``redray.sharding.flatten`` gives the model's parameters) and
    ``fetch(dtype)``, a ``fetch(model path, layer)`` for ``redray.models.writing.hf_stream``
    that reads one parameter, or one layer of a stacked one, from the files. ``path``:
    the checkpoint read."""

    def __init__(self, path: str, stored: StoredArrays, shapes: dict, where: dict, moves: dict):
        self.path, self.shapes = path, shapes
        self._stored, self._where, self._moves = stored, where, moves

    def fetch(self, dtype):
        def one(model_path: str, layer: int | None):
            stored = self._where[model_path]
            move = self._moves.get(stored)
            if move is None:
                return self._stored.read(stored, layer, dtype)
            if move[0] == "slice":  # the model lists its layers, the checkpoint stacks them
                value = self._stored.read(move[1], move[2], dtype)
                return value if layer is None else value[layer]
            if layer is not None:  # the model stacks them, the checkpoint lists them
                return self._stored.read(move[1][layer], None, dtype)
            import numpy as np

            return np.stack([self._stored.read(p, None, dtype) for p in move[1]])

        return one


def stored_params(path: str, model: Any, *, step: int | None = None,
                  best: str | None = None) -> StoredParams | None:
    """The parameters of a run's checkpoint (as ``load_params`` chooses it), to be read a
    piece at a time without building or restoring the model: only ``model``'s shapes
    are traced (``model``: what built the run's model, an NNX factory or module).

    Returns None where the checkpoint is not read a piece at a time: a run that
    trained some parameters only (``trainable=``; the others are not in its
    checkpoints, ``load_model`` builds them), a model with state beside its parameters
    that an export writes too (a router's correction bias: ``load_model`` restores it
    with them), or a checkpoint whose arrays do not open (damaged: ``load_model`` skips
    it, naming it, for an older one).

    Raises:
      CheckpointMismatch: the checkpoint holds another model's arrays (named).
    """
    wrapped = adapter(model)
    if not isinstance(wrapped, _NNX):
        raise TypeError("stored_params reads NNX models' checkpoints; for a LinenModel use "
                        "load_params")
    params, extra = abstract_state(wrapped, jax.random.key(0))
    variables = jax.tree.leaves(extra, is_leaf=lambda x: isinstance(x, nnx.Variable))
    if any(not isinstance(v, nnx.RngState) for v in variables):
        return None
    directory, found = find_checkpoints(path)
    checkpointer = Checkpointer(CheckpointConfig(directory=directory), CHECKPOINT_ITEMS)
    try:
        chosen = select_step(checkpointer, step if step is not None else found, best)
        at = checkpointer.step_path(chosen)
        try:
            meta = checkpointer.read_meta(chosen)
            check_meta(meta, chosen)
            if meta.get("trainable") is not None:
                return None
            like = {"params": params, "extra": extra}
            moves = checkpointer.check_structure(chosen, {MODEL_ITEM: like}).get(MODEL_ITEM, {})
            stored = StoredArrays(at, MODEL_ITEM)
        except CheckpointMismatch:
            raise
        except Exception as error:  # noqa: BLE001 - damaged: the restore path names it
            log.warning("checkpoint %s does not open (%s)", at, _reason(error))
            return None
    finally:
        checkpointer.close()
    model_paths = flatten(params)[0]
    storage = ["params/" + p for p in storage_paths(params)]
    shapes = {m: tuple(leaf.shape) for m, leaf in zip(model_paths, jax.tree.leaves(params))}
    for m, s in zip(model_paths, storage):
        if s not in moves and stored.shapes.get(s) != shapes[m]:
            raise CheckpointMismatch(
                f"checkpoint {at} holds {m} with shape {stored.shapes.get(s)}, this model's "
                f"is {shapes[m]}: pass the config of the model the run trained")
    return StoredParams(at, stored, shapes, dict(zip(model_paths, storage)), moves)
