"""What Trainer and Predictor share: the model, its mesh, its specs and its placement."""

from __future__ import annotations

import copy
import dataclasses
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from redray.engine.model import abstract_state, adapter, cast_floating
from redray.rngs import KeyStream, stream_key
from redray.sharding.tracing import traced
from redray.sharding.parallelism import held_layers, is_staged, reorder, stacked_count, unstaged
from redray.sharding.plan import Plan
from redray.sharding import (MODEL, STAGE, Parallelism, derive_specs, format_placement,
                             format_whole, placement, shardings)
from redray.sharding.on_mesh import put
from redray.sharding.reductions import fuse_reductions
from redray.sharding.specs import stacked_arrays


class ModelRuntime:
    """A model on a mesh: abstract shapes, derived specs, sharded init and binding.

    Args:
      model: a function building an ``nnx.Module`` (optionally taking ``nnx.Rngs``), a
        built ``nnx.Module`` (its arrays are the starting point), or a ``redray.LinenModel``.
      plan: the ``Plan`` it runs on (``redray.sharding.plan``), or a built
        ``Parallelism`` alone (no batch geometry: a model that only runs forward); None
        until ``use`` gives one (a plan chosen from the model itself).
      compute_dtype: dtype the model computes in (parameters stay float32); None keeps
        the parameters' dtype.
      seed: initialization seed.

    The plan is one frozen value: ``parallelism``, ``mesh``, ``micro_rows``,
    ``stage_repeats``, ``pipeline_schedule`` and the context attention read it; ``use``
    replaces it whole.
    """

    def __init__(self, model: Any, plan: Plan | Parallelism | None, compute_dtype=None,
                 seed: int = 0):
        self.adapter = adapter(model)
        self.plan = Plan()
        if plan is not None:
            self.use(plan)
        self.compute_dtype = compute_dtype
        self.init_key = stream_key(seed, KeyStream.INIT)
        self.abstract = abstract_state(self.adapter, self.init_key)
        self.specs = None
        self._traced_by, self._stacked = None, None  # what derive traced; its stacks
        self.whole: list = []  # layer parameters the rules left unsplit over model

    def use(self, plan: Plan | Parallelism) -> None:
        """Runs the model on ``plan`` (its parallelism built) from now on; a
        ``Parallelism`` alone: this plan with it."""
        self.plan = plan if isinstance(plan, Plan) else \
            dataclasses.replace(self.plan, parallelism=plan)

    @property
    def parallelism(self) -> Parallelism | None:
        return self.plan.parallelism

    @property
    def mesh(self):
        return self.plan.mesh

    @property
    def micro_rows(self) -> int | None:
        """Rows of one pipeline micro-batch over all devices (a plan with stages); None:
        a pass's rows are one micro-batch."""
        return self.plan.micro_rows

    @property
    def stage_repeats(self) -> int:
        """The pipeline's circular repeats: above 1, the stacked parameters this runtime
        makes, places and runs are held in ``parallelism.layer_order`` (``reorder``)."""
        return self.plan.stage_repeats

    @property
    def pipeline_schedule(self) -> str:
        """With stages: "gpipe" or "1f1b" (``engine/one_f_one_b.py``)."""
        return self.plan.pipeline_schedule

    @property
    def stage_recompute(self) -> bool:
        """With 1F1B: each chunk's backward recomputes its forward (``Plan``)."""
        return self.plan.stage_recompute

    def apply(self, fn: Callable, params, extra, rng, *args, planned: bool = True):
        """Runs ``fn(model, *args)`` on the bound model; returns (output, new extra).
        ``planned``: the model's layers place their activations on the plan's mesh
        (``redray.sharding.tracing``); False runs them as on one device (the
        model's own dataflow, what the spec rules read)."""
        cast = cast_floating(params, self.compute_dtype)
        model = self.adapter.bind(cast, extra, rng)
        parallelism = self.parallelism if planned else None
        specs = None
        if parallelism is not None and self.specs is not None and \
                parallelism.size(STAGE) > 1:
            # what run_stages keeps split (read only on a plan with stages)
            leaves, treedef = jax.tree.flatten(cast)
            try:
                specs = {id(x): s for x, s in zip(leaves, treedef.flatten_up_to(self.specs[0]))}
            except ValueError:  # not the model's parameters (a part of them)
                specs = None
        with self.tracing(planned, specs=specs):
            out = fn(model, *args)
        return out, self.adapter.extra_of(model, extra)

    def after_update(self, params, extra) -> tuple:
        """(new extra, metrics) once the optimizer updated ``params``: every module's
        ``after_update()`` (an NNX module may define one: a mixture of experts' bias
        update from the loads its training calls counted, ``moe.MoE``) run on the
        model bound to them, its returned arrays as metrics named by the key, the
        module's path and, for stacked layers, the row (``expert_load_cv/layers/mlp/2``).
        A model without such modules gives ``extra`` back as it is, at no cost."""
        if not hasattr(self.adapter, "graphdef"):  # a Linen model
            return extra, {}
        model = self.adapter.bind(params, extra, jax.random.key(0))
        metrics = {}
        for path, module in nnx.iter_modules(model):
            settle = getattr(type(module), "after_update", None)
            if settle is None:
                continue
            where = "/".join(map(str, path))
            for key, value in settle(module).items():
                value = jnp.asarray(value, jnp.float32)
                if value.ndim == 0:
                    metrics[f"{key}/{where}"] = value
                for i, row in enumerate(value.reshape(-1) if value.ndim else ()):
                    metrics[f"{key}/{where}/{i}"] = row
        return self.adapter.extra_of(model, extra), metrics

    def tracing(self, planned: bool = True, **changes):
        """Within: a model's layers traced under the ``Tracing`` value of this runtime's
        plan (``planned``; else as on one device): its rows and sequences split, its
        stacks' layout, its context attention (``redray.sharding.tracing``); ``changes``
        to it beside. ``apply`` traces in it; so do the pieces of a step that run a
        model's layers outside ``apply`` (1F1B's stages: inside its ``shard_map`` the
        constraints name the abstract mesh traced in, its ``stage`` manual)."""
        parallelism = self.parallelism if planned else None
        mesh = None if parallelism is None else parallelism.mesh
        current = jax.sharding.get_abstract_mesh()
        if mesh is not None and current.manual_axes:
            mesh = current
        settings = dict(mesh=mesh, ways=1 if parallelism is None else parallelism.data_parallel,
                        micro_rows=self.micro_rows, repeats=self.stage_repeats,
                        context_attention=self.plan.context_attention,
                        expert_exchange=self.plan.expert_exchange,
                        context_choice=self._context_method(), layers=self.stacked_layers)
        return traced(**{**settings, **changes})

    def unplanned(self) -> "ModelRuntime":
        """This model without its plan: its layers run as on one device (what the
        planner traces and times)."""
        return self.on(Plan())

    def on(self, plan: Plan) -> "ModelRuntime":
        """This model on ``plan`` instead (a copy sharing its specs; this one unchanged)."""
        other = copy.copy(self)
        other.plan = plan
        return other

    def _context_method(self):
        """How "auto" chooses a layer's attention across a context axis, on the plan's
        hardware (``Tracing.context_choice``)."""
        from redray.planning import context_chooser

        return context_chooser(self.plan.hardware)

    def train_apply(self, fn: Callable, params, extra, rng, *args):
        """``apply`` for a function that is differentiated: column layers reading one
        input are computed together, so their input gradients cost one all-reduce, and
        so are row layers whose outputs are added (``sharding.reductions``). The same
        values as ``apply``, up to the order of float additions."""
        leaves, treedef = jax.tree.flatten(params)
        specs = treedef.flatten_up_to(self.specs[0])

        def flat(leaves, extra, rng, *args):
            return self.apply(fn, treedef.unflatten(leaves), extra, rng, *args)

        return fuse_reductions(flat, self.mesh, specs)(leaves, extra, rng, *args)

    def derive(self, fn: Callable, *abstract_args):
        """Derives (params, extra) specs by tracing ``fn(model, *abstract_args)`` once."""
        rng = jax.random.key(0)

        def run(state, *args):
            out, _ = self.apply(fn, state[0], state[1], rng, *args, planned=False)
            return out

        self.whole, self._traced_by, self._stacked = [], (run, abstract_args), None
        self.specs = derive_specs(self.abstract, self.mesh, run, abstract_args,
                                  whole=self.whole, passes=self.parallelism.spec_passes())
        if self.stages > 1:  # two stacks held in as many rows could not be read back
            for count in self.stacked_layers:
                stacked_count(held_layers(count, self.stages, self.stage_repeats),
                              self.stacked_layers, self.stages, self.stage_repeats)
        return self.specs

    @property
    def stages(self) -> int:
        return self.parallelism.size(STAGE) if self.parallelism is not None else 1

    @property
    def stacked_arrays(self) -> dict:
        """The model's arrays that stack layers ("/"-joined path -> layer count), from
        the dataflow of what ``derive`` traced, traced when first asked (a checkpoint's
        save: stored a layer a chunk); empty before ``derive``."""
        if self._stacked is None:
            self._stacked = {} if self._traced_by is None else \
                stacked_arrays(self.abstract, *self._traced_by)
        return self._stacked

    @property
    def stacked_layers(self) -> tuple:
        """The layer counts of the model's stacks that the plan splits over ``stage``
        (empty without stages or specs)."""
        if self.specs is None or self.stages == 1:
            return ()
        specs = jax.tree.leaves(self.specs[0], is_leaf=lambda x: isinstance(x, PartitionSpec))
        return tuple(sorted({a.shape[0] for a, spec in zip(jax.tree.leaves(self.abstract[0]), specs)
                             if is_staged(spec)}))

    @property
    def held(self):
        """(params, extra) as ShapeDtypeStructs in the form this runtime holds them: the
        stacked arrays padded to ``parallelism.held_layers`` rows where the stages'
        chunks do not divide the layers (``abstract``: the model's own shapes)."""
        if not self.stacked_layers:
            return self.abstract
        return jax.eval_shape(lambda t: self._reordered(t, self.shardings, True), self.abstract)

    def saved(self, shardings):
        """``shardings`` (of a tree in this runtime's held form) as they lay out the
        same tree in the layers' own order (a checkpoint's, the model a user reads):
        a stacked array no longer split over ``stage``, which may not divide it. The
        same shardings where the runtime holds the stacks as they are (no circular
        repeats, no pads: ``reorder`` moves nothing)."""
        if not self._moves():
            return shardings
        return jax.tree.map(unstaged, shardings)

    def costly_whole(self, share: float = 0.01) -> list:
        """The layer parameters left whole over ``model`` that a split would have saved,
        each holding at least ``share`` of the model's parameter bytes."""
        total = sum(math.prod(a.shape) for a in jax.tree.leaves(self.abstract[0]))
        return [w for w in self.whole
                if not w.by_design and math.prod(w.shape) >= share * total]

    @property
    def shardings(self):
        return shardings(self.mesh, self.specs)

    def init(self):
        """(params, extra) on their shards: created there from a factory (no full copy on
        one device), or copied there from a built module's arrays."""
        values = getattr(self.adapter, "values", None)
        if values is not None:
            return self.place(*values)
        return jax.jit(self.fresh, out_shardings=self.shardings,
                       compiler_options=once_options(self.mesh))(self.init_key)

    @property
    def from_factory(self) -> bool:
        """Whether ``init`` creates the parameters (a factory) rather than copying a
        built module's arrays."""
        return getattr(self.adapter, "values", None) is None

    def fresh(self, key):
        """(params, extra) of the model's factory at ``key``, in this runtime's layer
        order: what ``init`` runs under ``jax.jit`` (traceable, to join other work in
        one program)."""
        return self._reordered(self.adapter.init(key), self.shardings, True)

    def _reordered(self, tree, shardings, to_plan: bool):
        return reorder(tree, shardings, self.stages, self.stage_repeats, to_plan,
                       self.stacked_layers)

    def _moves(self) -> bool:
        """Whether the held form differs from the layers' own: circular repeats, or
        pads."""
        return self.stages > 1 and (self.stage_repeats > 1 or any(
            held_layers(n, self.stages, self.stage_repeats) > n for n in self.stacked_layers))

    def reorder(self, tree, shardings, to_plan: bool):
        """``tree`` with its stacked arrays moved from the layers' own order into the one
        this runtime holds them in (``to_plan``: onto ``shardings``), or back (from
        ``shardings``, onto ``saved(shardings)``): the same tree without circular
        pipeline repeats or pads. Checkpoints and the model a user reads hold the
        layers' own order (``parallelism.layer_order``)."""
        if not self._moves():
            return tree
        return jax.jit(lambda t: self._reordered(t, shardings, to_plan),
                       out_shardings=shardings if to_plan else self.saved(shardings))(tree)

    def place(self, params, extra):
        """Copies given (params, extra) onto this runtime's shardings.

        Always a copy, never an alias: the train step donates its state, and the
        caller's arrays (a user's module, a Predictor's params) must survive it.
        ``device_put(..., may_alias=False)`` still aliases one shard on CPU (jax 0.10),
        so the arrays are copied where they are first (fresh buffers, ours to alias).
        Host arrays, and one host's own arrays when the mesh spans hosts (a built model
        that every host received), are cut into each device's shard.
        """
        placed = jax.tree.map(lambda value, sharding: put(value, sharding, copy=True),
                              (params, extra), self.saved(self.shardings))
        return self.reorder(placed, self.shardings, True)

    def bound(self, params, extra, rng=None):
        """The user's model object, bound to concrete parameters (for inspection): this
        runtime's (``init``, ``place``), in the layers' own order."""
        params = self.reorder(params, shardings(self.mesh, self.specs[0]), False)
        return self.adapter.bind(params, extra, jax.random.key(0) if rng is None else rng)

    def placement_text(self) -> str:
        text = format_placement(placement(self.held, self.specs, self.mesh), self.mesh)
        model_size = self.parallelism.size(MODEL)
        if model_size > 1:
            text += "\n" + format_whole(self.whole, model_size)
        return text

    def replicated(self) -> NamedSharding:
        return self.parallelism.replicated()


def once_options(mesh) -> dict | None:
    """XLA's options for a program that runs once (a fresh state's init): on CPU without
    LLVM's optimizations, which took two thirds of its compile (1.8 s of a tiny model's
    init on 2 cores) and nothing of note from its single run. Every fresh init compiles
    so, whichever path makes it, so the same seed gives the same values everywhere (the
    last bits of a random normal differ between optimization levels)."""
    if mesh is None or mesh.devices.flat[0].platform != "cpu":
        return None
    return {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def abstract_batch(batch: dict, rows: int) -> dict:
    """ShapeDtypeStructs of ``batch`` with ``rows`` rows."""
    return {k: jax.ShapeDtypeStruct((rows, *v.shape[1:]), v.dtype) for k, v in batch.items()}
