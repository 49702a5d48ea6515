"""One interface over Flax NNX modules and Linen modules with their variables.

The engine keeps a model as two pytrees: ``params`` (trained) and ``extra`` (the rest
of its state: batch statistics, RNG counters). ``bind`` turns them back into the
object the user's ``loss`` and ``predict`` receive.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import linen as nn
from flax import nnx

from redray.rngs import rngs as fast_rngs


class LinenModel:
    """A Linen module plus the example inputs that initialize it.

    ``loss``/``predict`` receive ``module.bind(variables, rngs={'dropout': rng})``, so
    they call it like a function: ``model(batch['x'], train=train)``. Collections other
    than ``params`` (e.g. ``batch_stats``) are carried but read-only while training.

    Args:
      module: the ``flax.linen.Module``.
      *init_args, **init_kwargs: passed to ``module.init`` (example inputs, shapes only).
    """

    def __init__(self, module: nn.Module, *init_args, **init_kwargs):
        if not isinstance(module, nn.Module):
            raise TypeError(f"LinenModel wraps a flax.linen.Module, got {type(module).__name__}")
        self.module, self.init_args, self.init_kwargs = module, init_args, init_kwargs


class _Linen:
    def __init__(self, spec: LinenModel):
        self.spec = spec

    def init(self, key):
        pkey, dkey = jax.random.split(key)
        variables = self.spec.module.init({"params": pkey, "dropout": dkey},
                                          *self.spec.init_args, **self.spec.init_kwargs)
        variables = dict(variables)
        params = variables.pop("params")
        return params, variables

    def bind(self, params, extra, rng):
        return self.spec.module.bind({"params": params, **extra}, rngs={"dropout": rng})

    def extra_of(self, model, extra):
        return extra


class _NNX:
    def __init__(self, factory: Callable | None, module: nnx.Module | None = None):
        self.factory = factory
        try:
            self.takes_rngs = factory is not None and len(inspect.signature(factory).parameters) > 0
        except (TypeError, ValueError):
            self.takes_rngs = True
        self.graphdef = None
        # A module built by the user (e.g. from_pretrained): its arrays are the start.
        self.values = None
        if module is not None:
            self.graphdef, params, extra = nnx.split(module, nnx.Param, ...)
            self.values = (params, extra)

    def _make(self, key):
        module = self.factory(fast_rngs(key)) if self.takes_rngs else self.factory()
        if not isinstance(module, nnx.Module):
            raise TypeError(
                f"the model factory returned {type(module).__name__}, expected a flax.nnx.Module; "
                "for a Linen module pass redray.LinenModel(module, example_input)")
        return module

    def init(self, key):
        graphdef, params, extra = nnx.split(self._make(key), nnx.Param, ...)
        return params, extra

    def abstract(self, key):
        if self.values is not None:
            return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), self.values)
        abstract = nnx.eval_shape(lambda: self._make(key))
        self.graphdef, params, extra = nnx.split(abstract, nnx.Param, ...)
        return params, extra

    def bind(self, params, extra, rng):
        # Fresh Variables in the current trace: merging the caller's own objects would
        # let the model mutate them (BatchNorm stats, RNG counts) from inside jax.grad,
        # which NNX rejects as a cross-trace mutation.
        params, extra = jax.tree.map(lambda x: x, (params, extra))
        return nnx.merge(self.graphdef, params, extra)

    def extra_of(self, model, extra):
        return nnx.split(model, nnx.Param, ...)[2]


def adapter(model: Any):
    """Wraps what the user passed as ``model``.

    An NNX factory (``lambda rngs: MyModel(..., rngs=rngs)``) is the default: the
    parameters are then created directly on their shards. A built ``nnx.Module``
    (e.g. from ``redray.models.from_pretrained``) is the starting point as it is.
    """
    if isinstance(model, LinenModel):
        return _Linen(model)
    if isinstance(model, nn.Module):
        raise TypeError(
            "got a bare Linen module: wrap it as redray.LinenModel(module, example_input) so "
            "redray can initialize it directly sharded")
    if isinstance(model, nnx.Module):
        return _NNX(None, module=model)
    if not callable(model):
        raise TypeError(f"model must be a function returning an nnx.Module or a LinenModel, "
                        f"got {type(model).__name__}")
    return _NNX(model)


def abstract_state(model_adapter, key):
    """(params, extra) as ShapeDtypeStructs, without allocating."""
    if isinstance(model_adapter, _NNX):
        return model_adapter.abstract(key)
    return jax.eval_shape(model_adapter.init, key)


def cast_floating(tree, dtype):
    """Casts floating-point leaves to ``dtype`` (mixed precision); None leaves as is."""
    if dtype is None:
        return tree
    return jax.tree.map(
        lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


def split_trainable(params, pattern: str):
    """(trainable, frozen): ``params`` twice, with the other part's leaves set to None.

    A leaf is trainable when ``re.search(pattern, path)`` matches its "/"-joined path
    (the paths ``Trainer.placement()`` shows). None leaves are empty subtrees to JAX, so
    each part flattens to its own arrays only (optimizer state, gradients and
    checkpoints then hold the trainable part alone).

    Raises:
      ValueError: when the pattern is not a valid regex or matches no parameter.
    """
    import re

    from redray.sharding import path_str

    try:
        rx = re.compile(pattern)
    except (re.error, TypeError) as error:
        raise ValueError(f"trainable={pattern!r} is not a regular expression ({error}): give a "
                         r"regex on parameter paths, e.g. trainable=r'lora_'") from None
    keep = lambda path: bool(rx.search(path_str(path)))  # noqa: E731
    trainable = jax.tree_util.tree_map_with_path(lambda p, x: x if keep(p) else None, params)
    frozen = jax.tree_util.tree_map_with_path(lambda p, x: None if keep(p) else x, params)
    if not jax.tree.leaves(trainable):
        paths = [path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
        raise ValueError(f"trainable={pattern!r} matches no parameter; the paths are e.g. "
                         f"{paths[:10]}: match some of them (re.search on the path)")
    return trainable, frozen


def merge_trainable(trainable, frozen):
    """The whole parameter tree again from ``split_trainable``'s two parts."""
    return jax.tree.map(lambda t, f: f if t is None else t, trainable, frozen,
                        is_leaf=lambda x: x is None)
