"""The training state: one typed pytree that the step transforms and checkpoints hold.

The same ``TrainState`` class carries the arrays, their abstract shapes
(``jax.ShapeDtypeStruct``) and their shardings (``NamedSharding``): each is a
``TrainState`` whose leaves are of that kind, so one field list serves all three.
Adding a field (an EMA copy, a loss scale) means adding it here and to the step.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from redray.engine.model import merge_trainable
from redray.rngs import KeyStream, stream_key
from redray.sharding import Parallelism, follow_specs, shardings

# What a checkpoint holds, by item: "model" is what ``load_params`` reads back (the
# weights alone), "train" what only resuming needs. The names are the on-disk layout.
MODEL_ITEM, TRAIN_ITEM = "model", "train"
CHECKPOINT_ITEMS = (MODEL_ITEM, TRAIN_ITEM)


@struct.dataclass
class TrainState:
    """Everything a training step reads and writes.

    Attributes:
      step: optimizer updates done (int32 scalar).
      rng: the training key; each step splits it (``KeyStream.TRAIN`` at step 0).
      params: the trained parameters.
      extra: the model's other state (batch statistics, NNX RNG counters).
      opt_state: the optimizer's state for ``params``.
      frozen: the parameters left out of training (``Trainer.of(trainable=...)``), or None.
        They are never updated and never saved: they come from the model as built.
      nonfinite_step: the first step whose loss or gradient norm was not finite (int32
        scalar; 0: none yet). Set inside the step, so finding a NaN needs no host sync
        per step; read on the log cadence and before every save. Never saved: a saved
        state is always finite.
    """
    step: Any
    rng: Any
    params: Any
    extra: Any
    opt_state: Any
    frozen: Any = None
    nonfinite_step: Any = None

    @property
    def whole_params(self):
        """Every parameter: the trained ones merged with the frozen ones (if any)."""
        return self.params if self.frozen is None else merge_trainable(self.params, self.frozen)

    def checkpoint_items(self) -> dict[str, dict]:
        """The parts a checkpoint stores, by item (``frozen`` is left out)."""
        return {MODEL_ITEM: {"params": self.params, "extra": self.extra},
                TRAIN_ITEM: {"opt_state": self.opt_state, "step": self.step, "rng": self.rng}}

    @classmethod
    def from_checkpoint_items(cls, items: dict[str, dict], frozen=None) -> "TrainState":
        """The inverse of ``checkpoint_items``."""
        model, train = items[MODEL_ITEM], items[TRAIN_ITEM]
        return cls(step=train["step"], rng=train["rng"], params=model["params"],
                   extra=model["extra"], opt_state=train["opt_state"], frozen=frozen)


def counters(seed: int):
    """(step, rng, nonfinite_step) of a run's start: step 0, the training stream's first
    key, no non-finite step."""
    return jnp.zeros((), jnp.int32), stream_key(seed, KeyStream.TRAIN), jnp.zeros((), jnp.int32)


@dataclasses.dataclass(frozen=True)
class StateLayout:
    """A TrainState's abstract form and shardings on a plan, computed without arrays.

    Attributes:
      abstract: ``TrainState`` of ``jax.ShapeDtypeStruct`` (``frozen``: None).
      shardings: ``TrainState`` of ``NamedSharding`` (``frozen``: the frozen
        parameters' shardings, or None).
    """
    abstract: TrainState
    shardings: TrainState

    @classmethod
    def build(cls, parallelism: Parallelism, seed: int, optimizer, params, param_specs, extra,
              extra_shardings, frozen_shardings=None) -> "StateLayout":
        """The layout of a run's state.

        Args:
          parallelism: the built plan (its mesh).
          seed: the run's seed (the start key's shape and type).
          optimizer: the ``optax.GradientTransformation`` whose state is held.
          params, param_specs: the trained parameters (abstract) and their specs; the
            optimizer's state follows its parameters' specs.
          extra, extra_shardings: the model's other state (abstract) and its shardings.
          frozen_shardings: the frozen parameters' shardings, or None.
        """
        step, rng, nonfinite_step = jax.eval_shape(lambda: counters(seed))
        opt_state = jax.eval_shape(optimizer.init, params)
        opt_specs = follow_specs(opt_state, params, param_specs)
        replicated, mesh = parallelism.replicated(), parallelism.mesh
        return cls(
            abstract=TrainState(step=step, rng=rng, params=params, extra=extra,
                                opt_state=opt_state, nonfinite_step=nonfinite_step),
            shardings=TrainState(step=replicated, rng=replicated,
                                 params=shardings(mesh, param_specs), extra=extra_shardings,
                                 opt_state=shardings(mesh, opt_specs), frozen=frozen_shardings,
                                 nonfinite_step=replicated))
