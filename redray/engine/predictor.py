"""The Predictor: batched, sharded prediction that returns one output per input, in order."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from redray.engine.batches import each_batch
from redray.engine.runtime import ModelRuntime, abstract_batch
from redray.functions import UserFunctionError, check_predict_output
from redray.rngs import KeyStream, stream_key
from redray.sharding import Parallelism


class Predictor:
    """Runs the user's ``predict`` over a list of examples on every local device.

    The last batch is padded (by repeating its last example) to the batch size and the
    padded rows are dropped, so every input gets exactly one output, in input order.

    Args:
      model: a function building a ``flax.nnx.Module`` or a ``redray.LinenModel``.
      collate: list of examples -> dict of numpy arrays, one row per example.
      predict: (model, batch, rng) -> pytree of arrays, each with the batch first.
      params, extra: trained parameters (and other model state, e.g. batch statistics)
        in the model's structure; None initializes fresh ones (directly sharded).
      batch_size: examples per prediction step (a multiple of the data-parallel size).
      parallelism, mesh, compute_dtype, rules, seed, **axes (``model_axis=2``...): as
        for Trainer.
    """

    def __init__(self, model: Any, collate: Callable, predict: Callable, *, params=None,
                 extra=None, batch_size: int, parallelism: Parallelism | None = None,
                 mesh: Mesh | None = None, compute_dtype=None, rules=(), seed: int = 0,
                 **axes):
        parallelism = Parallelism.resolve(parallelism, mesh, rules, axes, "Predictor")
        self._setup(ModelRuntime(model, parallelism, compute_dtype, seed), collate, predict,
                    batch_size, seed)
        self._given = (params, extra)

    @classmethod
    def _from_runtime(cls, runtime, collate, predict, source: Callable, batch_size, seed):
        """A Predictor reading (params, extra) from ``source()`` at every call
        (``TrainerPredictors``)."""
        self = cls.__new__(cls)
        self._setup(runtime, collate, predict, batch_size, seed)
        self._given = None
        self._source = source
        return self

    def _setup(self, runtime, collate, predict, batch_size, seed):
        if not callable(predict):
            raise UserFunctionError(f"predict must be a function, got {predict!r}")
        dp = runtime.parallelism.data_parallel
        if not isinstance(batch_size, int) or batch_size < 1 or batch_size % dp:
            raise ValueError(f"batch_size={batch_size!r} must be a positive multiple of the "
                             f"{dp} data-parallel devices")
        self.runtime, self.collate, self.predict_fn = runtime, collate, predict
        self.batch_size, self.seed = batch_size, seed
        self._step = None
        self._calls = 0
        self._source = lambda: (self.params, self.extra)

    def _prepare(self, sample: dict) -> None:
        rt, predict = self.runtime, self.predict_fn
        abstract = abstract_batch(sample, self.batch_size)
        out = jax.eval_shape(
            lambda p, e, b: rt.apply(lambda m, bb: predict(m, bb, jax.random.key(0)), p, e,
                                     jax.random.key(0), b)[0], *rt.abstract, abstract)
        check_predict_output(out, self.batch_size)
        if rt.specs is None:
            rt.derive(lambda m, b: predict(m, b, jax.random.key(0)), abstract)
        if self._given is not None:
            params, extra = self._given
            if params is None:
                self.params, self.extra = rt.init()
            else:
                if extra is None:  # fresh model state (e.g. batch statistics), not zeros
                    extra = jax.jit(lambda k: rt.adapter.init(k)[1],
                                    out_shardings=rt.shardings[1])(rt.init_key)
                self.params, self.extra = rt.place(params, extra)
            self._given = None

        def step(params, extra, batch, rng):
            out, _ = rt.apply(lambda m, b: predict(m, b, rng), params, extra, rng, batch)
            return out

        self._step = jax.jit(step, out_shardings=rt.replicated())

    def predict(self, examples: Sequence, rng=None) -> list:
        """One output per example, in order: a list of per-example pytrees of numpy.

        Args:
          examples: a list, or a row source (``len`` + ``take_rows``). On many hosts
            each feeds its rows of every batch and every host gets all outputs.
          rng: the key ``predict`` functions get (each batch folds in its position);
            default: from the seed and a count of calls, so sampling differs between
            calls and is the same on every host.
        """
        if not len(examples):
            return []
        if rng is None:
            rng = jax.random.fold_in(stream_key(self.seed, KeyStream.PREDICT), self._calls)
        self._calls += 1

        def run(batch, start):
            params, extra = self._source()
            return self._step(params, extra, batch, jax.random.fold_in(rng, start))

        # the short last batch repeats its last example; those outputs are dropped
        pending = each_batch(examples, self.batch_size, self.runtime.parallelism, self.collate,
                             run, pad_last=True,
                             prepare=self._prepare if self._step is None else None)
        results = []
        for n, out in pending:
            host = jax.device_get(out)
            leaves, treedef = jax.tree.flatten(host)
            for i in range(n):
                results.append(jax.tree.unflatten(treedef, [np.asarray(x[i]) for x in leaves]))
        return results


class TrainerPredictors:
    """A Trainer's Predictors, one per batch size, each reading (params, extra) from
    ``source()`` at every call: the trainer's step donates its state, so holding the
    arrays would leave deleted buffers after the next update. The same one for the same
    batch size: a loop that predicts every iteration compiles once, and its default
    ``rng`` keeps changing between calls."""

    def __init__(self, runtime, functions, source: Callable, default_size: int, seed: int):
        self.runtime, self.functions, self.source = runtime, functions, source
        self.default_size, self.seed = default_size, seed
        self.made: dict[int, Predictor] = {}

    def get(self, batch_size: int | None) -> Predictor:
        if self.functions.predict is None:
            raise UserFunctionError("this Trainer has no predict function: pass predict=... to "
                                    "Trainer")
        size = batch_size or self.default_size
        if size not in self.made:
            self.made[size] = Predictor._from_runtime(
                self.runtime, self.functions.collate, self.functions.predict, self.source,
                size, self.seed)
        return self.made[size]
