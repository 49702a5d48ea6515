"""A mixture-of-experts MLP: each token runs through the few experts a router picks.

``MoE`` holds a router (hidden -> experts, no bias) and the experts' gated MLPs stacked
in two kernels, gate and up (experts, hidden, 2, intermediate) and down (experts,
intermediate, hidden): the expert axis leads, so an expert-parallel axis can split it.
Each token's router logits give its ``top_k`` experts and their weights (in float32):

* Mixtral: softmax over the k chosen logits (the softmax over every expert, renormalized
  over the k chosen: the same values);
* Qwen2-MoE and Qwen3-MoE: softmax over every expert, the k largest kept, renormalized
  only with ``norm_topk_prob``, and cast back to the router's dtype;
* DeepSeek-V3 and GLM-4.5 (``scoring="sigmoid"``): each expert's sigmoid score; the
  choice reads the scores plus a per-expert correction bias (``RouterBias``: a buffer,
  not a parameter, which only auxiliary-loss-free balancing moves), limited to the
  ``topk_group`` groups of experts whose two best biased scores sum highest
  (``groups``); the weights are the chosen experts' unbiased scores, renormalized with
  ``norm_topk_prob`` and scaled by ``routed_scaling_factor`` (``scale``).

Dispatch is dropless: the (token, expert) assignments are sorted by expert, each
projection is one grouped matmul over them (``jax.lax.ragged_dot``, the group sizes
being the tokens each expert got), and the outputs go back to their tokens, summed with
the routing weights. With a ``capacity_factor`` an expert keeps at most ``ceil(factor x
tokens x top_k / experts)`` assignments, the first in token order; the others are
dropped (their token gets nothing from that expert; the residual carries it): what a
capacity-bound recipe computes. The compute stays dropless.

Under a plan (a step traced on a mesh), the layer runs in ``shard_map``
(``MoE.routed``): each device sorts and computes its own tokens (without it XLA
gathers every device's assignments at each layer), and the capacity is counted per
device, over its own tokens; on a context axis a device takes its part of each of its
rows' sequences (the tokens are never flattened across it, which would gather them).
The rules split the experts' kernels as Megatron splits an
MLP, inside every expert: gate and up on their inner width over ``model``, down on its
input (the router stays whole), so a device computes its share of every expert's width
and one all-reduce (``psum`` over ``model``) sums the output. With an ``expert`` axis the
experts are split over it (``ExpertParallel``, on the dimension the grouped matmul picks
kernels along); the ``expert`` axis splits the batch for every other layer, as data
parallelism does. Two exchanges move the tokens (``Plan.expert_exchange``; "auto": the
gather for a dropless layer, the all-to-all with a capacity factor):

* ``gathered``: each device all-gathers its expert group's tokens (their choices and
  routing weights beside them), runs its own experts on the assignments routed to them
  with one grouped matmul per projection, and the outputs are reduce-scattered back.
  Nothing is dropped and there are no slots: each token crosses the axis once each way,
  ``ways`` x the device's tokens x hidden, which is at most ways / (the distinct devices
  a token's experts are on) of the least any exchange sends (1.19 for 64 experts, top-6,
  over 4 devices: ``communication/moe_ep/gather``). The gathered tokens' assignments are
  held on every device (``ways`` x tokens x top_k rows).
* ``exchange``: each device's assignments sent to their experts' devices and back by
  all-to-all, each (device, expert) pair with a fixed number of slots: the capacity
  with a ``capacity_factor`` (``factor`` x the assignments' bytes), else the device's
  whole token count (experts x tokens x hidden: 18.7 x the least for the model above).
  XLA:CPU has no ragged all-to-all (the exact-size exchange GPUs and TPUs can run), so
  the slots are fixed-size here.

Auxiliary-loss-free balancing (DeepSeek-V3, ``balance``): a training call counts its
assignments per expert (``ExpertLoad``, state beside the parameters, summed over every
micro-batch of the update and over the whole batch whatever the plan splits it into),
and once the optimizer has updated the parameters (``after_update``, which the
Trainer's step runs) each correction bias moves by ``balance`` toward the experts
that got fewer than the mean; the counts are reset and each layer's loads' coefficient
of variation is logged (``expert_load_cv/<module>/<row>``). Both are run state: a
checkpoint holds them, a resumed run goes on from them. Inside pipeline stages nothing
is counted yet (the bias stays as it is; the console says so once).

Every call also reports what the router did (``report``): assignments per expert, the
sum of the router probabilities per expert, the sum of the squared log-partition
(z-loss) and the tokens counted, over real tokens only (padding and packing's segment 0
count nowhere). A model's blocks stack these per layer and ``summarize`` turns them into
the auxiliary outputs: ``load_balancing`` (Switch Transformer's loss as Mixtral and
``transformers``' ``load_balancing_loss_func`` compute it: experts x the sum over experts
of the fraction of assignments times the mean probability, over every layer's tokens
together), ``router_z`` (the mean squared logsumexp of the router logits, ST-MoE),
``expert_tokens`` (layers, experts) assignments and, for rows of sequences,
``sequence_balance`` (DeepSeek-V3's sequence-wise balance loss, ``sequence_balance``).

Reaching the loss: a mixture-of-experts model called with ``aux=True`` returns
``(logits, aux)`` (``(hidden, aux)`` with ``hidden=True``); plain calls return logits
as every redray model does, so generation and ``next_token_loss`` work unchanged.
``auxiliary_loss(aux, config)`` weighs the two losses by the config's
``router_aux_loss_coef`` (as ``transformers`` adds it to the LM loss) and
``router_z_loss_coef`` (0 unless set), and ``metrics(aux)`` gives scalars to log::

    def loss(model, batch, rng, train):
        logits, aux = model(batch["ids"][:, :-1], train=train, aux=True)
        tokens = optax.softmax_cross_entropy_with_integer_labels(
            logits.astype(jnp.float32), batch["ids"][:, 1:]).mean()
        return tokens + moe.auxiliary_loss(aux, model.config), moe.metrics(aux)

``jax.lax.ragged_dot`` lowers to a grouped matmul on GPU and TPU; XLA:CPU runs JAX's
dense fallback (every assigned row against every expert, masked): exact and
differentiable, but experts x the active FLOPs, and that is what XLA's cost analysis
(so the planner's FLOP count) reports there.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from redray.models import layers
from redray.models.hub import Buffer, Tensor, linear
from redray.sharding.tracing import context_split, traced_mesh, tracing
from redray.sharding.parallelism import BATCH_AXES, CONTEXT, EXPERT, MODEL
from redray.sharding.rules import axes_of, without_axis


@dataclasses.dataclass(frozen=True)
class ExpertLayers:
    """Mixture-of-experts layers of one shape (``MoE``): what the planner's cost model
    (``redray.planning.cost``) and memory model count of them.

    Attributes:
      layers: how many.
      experts, top_k, hidden, inner: the experts, the experts a token uses, the model
        width and an expert's inner width.
      capacity_factor: None (dropless) or the layers' capacity factor.
    """
    layers: int
    experts: int
    top_k: int
    hidden: int
    inner: int
    capacity_factor: float | None

    def slots(self, tokens: int) -> int:
        """Slots per (device, expert) of an expert-parallel exchange of ``tokens``
        tokens per device: the capacity, or every token (nothing dropped)."""
        return expert_capacity(self.capacity_factor, tokens, self.top_k,
                               self.experts) or tokens


def expert_capacity(capacity_factor: float | None, tokens: int, top_k: int,
                    experts: int) -> int | None:
    """The assignments an expert keeps of ``tokens`` tokens: ``ceil(capacity_factor x
    tokens x top_k / experts)``, at most ``tokens`` (a token picks an expert once);
    None without a capacity factor (all)."""
    if capacity_factor is None:
        return None
    return min(tokens, math.ceil(capacity_factor * tokens * top_k / experts))


def _routed_specs(mesh, rows: P, by_expert, by_model, bias_by_model, shared_by_model,
                  shared: int) -> tuple[list[P], P]:
    """The ``shard_map`` specs of ``MoE.routed``'s tokens, choices, weights, kernels
    and ``shared`` expert kernels, and of its results."""
    # The kernels name the mesh's axes of one device on a dimension of theirs: a
    # split over them is no split, and their gradients need no sum over them, which
    # the shard_map's transpose would write as all-reduces over one device each
    # (XLA:CPU keeps those; they move nothing)
    one = tuple(a for a in mesh.axis_names if mesh.shape[a] == 1) or None
    # the tokens, their choices and the outputs name those not among their rows' on
    # their last dimension
    rest = tuple(a for a in one or () if a not in {n for e in rows for n in axes_of(e)})
    result = P(*rows, rest or None)
    specs = [result, result, result, P(by_expert, one, None, by_model),
             P(by_expert, one, bias_by_model), P(by_expert, by_model, one)]
    if shared:  # the shared expert's gate and up, down, and its gate's kernel
        specs += [P(one, None, shared_by_model), P(shared_by_model, one),
                  P(one, None)][:shared]
    return specs, result


def _nested(mesh, specs: list[P]) -> tuple[list[P], dict]:
    """(``specs``, ``shard_map``'s mesh and manual axes) for ``MoE.routed`` on ``mesh``,
    manual over every axis; inside another ``shard_map`` (1F1B's stages, manual over
    ``stage``, and on each device's own rows over the batch axes too) over the axes not
    manual yet, on the mesh it traces in, the axes already manual left out of the specs
    (the rows there are the device's own)."""
    current = jax.sharding.get_abstract_mesh()
    manual = tuple(current.manual_axes)
    if not manual:
        return specs, {"mesh": mesh}
    return ([P(*(without_axis(entry, *manual) for entry in spec)) for spec in specs],
            {"mesh": current, "axis_names": set(mesh.axis_names) - set(manual)})


class RouterBias(Buffer):
    """A router's per-expert correction bias (DeepSeek's ``e_score_correction_bias``):
    float32 state beside the parameters (``hub.Buffer``: loaded and exported with them),
    read by the choice of experts only (no gradient reaches it), so no optimizer or
    weight decay touches it."""


class ExpertLoad(nnx.Variable):
    """The assignments each expert got in the training calls since the last optimizer
    update (float32, beside the parameters: checkpointed with the run, never exported):
    what auxiliary-loss-free balancing (``MoE.after_update``) moves the bias by."""


def limit_groups(choice: jax.Array, groups: int, keep: int) -> jax.Array:
    """``choice`` (..., experts) with every expert outside the ``keep`` best of its
    ``groups`` equal groups at -inf: a group's score is the sum of its two best
    (DeepSeek-V3's group-limited routing: a token's experts on at most ``keep`` groups,
    e.g. nodes)."""
    *lead, experts = choice.shape
    if experts % groups:
        raise ValueError(f"n_group {groups} must divide the experts ({experts})")
    grouped = choice.reshape(*lead, groups, experts // groups)
    best = jax.lax.top_k(grouped, min(2, experts // groups))[0].sum(-1)
    _, kept = jax.lax.top_k(best, keep)
    mask = jax.nn.one_hot(kept, groups, dtype=jnp.int32).sum(-2) > 0
    return jnp.where(mask[..., None], grouped, -jnp.inf).reshape(choice.shape)


class MoE(nnx.Module):
    """Top-k routed experts, each a gated MLP (see the module docstring).

    Args:
      hidden, intermediate: the model width and each expert's inner width.
      experts, top_k: how many experts, and how many each token uses.
      act: the gate's activation (``layers.ACTIVATIONS`` name).
      renormalize: divide the k chosen probabilities by their sum (Mixtral: always;
        Qwen3-MoE: ``norm_topk_prob``).
      float32_weights: combine the experts' outputs with float32 weights (Mixtral);
        False casts them to the router's dtype first (Qwen3-MoE).
      capacity_factor: None (dropless) or the factor of an even share each expert
        keeps (see the module docstring).
      dtype: the compute dtype (parameters stay float32).
      scoring: "softmax" over every expert, or "sigmoid" per expert with a correction
        bias (``RouterBias``) for the choice (DeepSeek-V3, GLM-4.5).
      groups: (n_group, topk_group): the choice limited to the ``topk_group`` best of
        ``n_group`` groups of experts (sigmoid scoring); None: every expert.
      scale: the chosen weights' factor (``routed_scaling_factor``).
      balance: auxiliary-loss-free balancing (DeepSeek-V3, arXiv 2412.19437 section
        2.1.2; sigmoid scoring): after each optimizer update every expert's correction
        bias moves by ``balance`` toward the under-loaded experts (up where an expert got
        fewer than the mean assignments of the update's training calls, down where
        more), from those calls' assignments counted over the whole batch (every data,
        fsdp and expert replica's tokens: the same update everywhere); None or 0: the
        bias stays as loaded.
    """

    def __init__(self, hidden: int, intermediate: int, experts: int, top_k: int, *,
                 act: str = "silu", renormalize: bool = True, float32_weights: bool = True,
                 capacity_factor: float | None = None, dtype=jnp.float32, rngs: nnx.Rngs,
                 router_bias: bool = False, expert_bias: bool = False,
                 clamp: tuple[float, float] | None = None, sigmoid_inputs: bool = False,
                 scoring: str = "softmax", groups: tuple[int, int] | None = None,
                 scale: float = 1.0, balance: float | None = None):
        if not 1 <= top_k <= experts:
            raise ValueError(f"num_experts_per_tok {top_k} must be between 1 and the number "
                             f"of experts ({experts})")
        if capacity_factor is not None and not capacity_factor > 0:
            raise ValueError(f"capacity_factor {capacity_factor!r} must be positive (None: "
                             "dropless)")
        self.top_k, self.renormalize, self.float32_weights = top_k, renormalize, float32_weights
        self.capacity_factor, self.dtype = capacity_factor, dtype
        self.clamp, self.sigmoid_inputs = clamp, sigmoid_inputs
        if scoring not in ("softmax", "sigmoid"):
            raise ValueError(f"scoring {scoring!r}: give 'softmax' or 'sigmoid'")
        if groups is not None and (scoring != "sigmoid" or experts % groups[0]
                                   or not 1 <= groups[1] <= groups[0]):
            raise ValueError(f"groups (n_group, topk_group) = {groups}: n_group must divide "
                             f"the {experts} experts, 1 <= topk_group <= n_group, with "
                             "sigmoid scoring")
        self.scoring, self.groups, self.scale = scoring, groups, scale
        if balance and scoring != "sigmoid":
            raise ValueError(f"balance={balance}: auxiliary-loss-free balancing moves a "
                             "sigmoid router's correction bias; give scoring='sigmoid' or "
                             "balance=None")
        self.balance = float(balance) if balance else None
        if scoring == "sigmoid":
            self.score_bias = RouterBias(jnp.zeros((experts,), jnp.float32))
        if self.balance:
            self.expert_load = ExpertLoad(jnp.zeros((experts,), jnp.float32))
        self.act = layers.activation(act)
        self.router = nnx.Linear(hidden, experts, use_bias=router_bias, dtype=dtype, rngs=rngs)
        # fan-in scaled per expert: the expert axis is a batch of independent kernels
        init = jax.nn.initializers.lecun_normal
        self.gate_up_proj = nnx.Param(init(in_axis=1, out_axis=(2, 3), batch_axis=0)(
            rngs.params(), (experts, hidden, 2, intermediate)))
        self.down_proj = nnx.Param(init(in_axis=1, out_axis=2, batch_axis=0)(
            rngs.params(), (experts, intermediate, hidden)))
        if expert_bias:
            self.gate_up_bias = nnx.Param(jnp.zeros((experts, 2, intermediate), jnp.float32))
            self.down_bias = nnx.Param(jnp.zeros((experts, hidden), jnp.float32))

    def gated(self, h):
        """The experts' gated activation of ``h`` (..., 2, inner): ``act(gate) * up``, or
        gpt-oss's clamped SwiGLU (``clamp`` = (alpha, limit)): the gate clamped from
        above and up both ways at ``limit``, ``(up + 1) * gate * sigmoid(alpha gate)``."""
        gate, up = h[..., 0, :], h[..., 1, :]
        if self.clamp is None:
            return self.act(gate) * up
        alpha, limit = self.clamp
        gate = jnp.minimum(gate, limit)
        up = jnp.clip(up, -limit, limit)
        return (up + 1) * gate * jax.nn.sigmoid(gate * alpha)

    def __call__(self, x: jax.Array, valid: jax.Array | None = None, *,
                 count: bool = False) -> tuple:
        """(output like ``x``, report) for ``x`` (..., hidden); ``valid`` (...): which
        tokens are real (None: all), for the report only; ``count``: a training call,
        whose assignments ``balance`` counts (``ExpertLoad``)."""
        logits = self.router(x)
        if self.scoring == "sigmoid":
            weights, chosen, probs = self._sigmoid_choice(logits)
        else:
            probs = jax.nn.softmax(logits.astype(jnp.float32), -1)
            weights, chosen = jax.lax.top_k(probs, self.top_k)
            if self.sigmoid_inputs:  # Llama 4: the chosen logits' sigmoid scales the input
                weights = jax.nn.sigmoid(
                    jnp.take_along_axis(logits.astype(jnp.float32), chosen, -1))
            elif self.renormalize:
                weights = weights / weights.sum(-1, keepdims=True)
        if not self.float32_weights:
            weights = weights.astype(logits.dtype)
        experts = probs.shape[-1]

        out, kept = self.routed(x, chosen, weights)
        if hasattr(self, "down_bias"):  # each chosen expert's output bias, weighed
            bias = self.down_bias[...].astype(self.dtype)[chosen]
            scale = kept if self.sigmoid_inputs else weights * kept
            out = out + (bias * scale.astype(bias.dtype)[..., None]).sum(-2)
        real = jnp.ones(x.shape[:-1], jnp.float32) if valid is None else \
            valid.astype(jnp.float32)
        per_choice = jnp.broadcast_to(real[..., None], chosen.shape)
        every = tuple(range(real.ndim))  # sums over every token, left in place (no reshape:
        # a sequence split over the context axis stays split)
        report = {
            "expert_tokens": jnp.zeros(experts, jnp.float32).at[chosen].add(per_choice),
            "router_probs": (probs * real[..., None]).sum(every),
            "router_z": (jax.nn.logsumexp(logits.astype(jnp.float32), -1) ** 2 * real).sum(),
            "tokens": real.sum(),
            "dropped": (per_choice * (1.0 - kept)).sum(),
        }
        if x.ndim == 3:  # rows of sequences: what the sequence-wise balance loss reads
            row = jnp.broadcast_to(jnp.arange(x.shape[0])[:, None, None], chosen.shape)
            report["sequence_tokens"] = jnp.zeros((x.shape[0], experts), jnp.float32).at[
                row, chosen].add(per_choice)
            report["sequence_probs"] = (probs * real[..., None]).sum(1)
            report["sequence_length"] = real.sum(1)
        if count and self.balance:
            self.expert_load[...] = self.expert_load[...] + \
                jax.lax.stop_gradient(report["expert_tokens"])
        return out.astype(x.dtype), report

    def after_update(self) -> dict:
        """Runs once after each optimizer update (``ModelRuntime.after_update``): with
        ``balance``, each expert's correction bias moves by ``balance`` x sign(the mean
        load - its load) over the assignments counted since the last update, which are
        then reset; nothing where none were counted (an update without training calls of
        this layer). Returns the loads' coefficient of variation (std / mean; 0 is even)
        per layer, to log (``expert_load_cv``)."""
        if not self.balance:
            return {}
        load = self.expert_load[...]
        mean = load.mean(-1, keepdims=True)
        counted = mean > 0
        move = jnp.where(counted, self.balance * jnp.sign(mean - load), 0.0)
        self.score_bias[...] = self.score_bias[...] + move
        self.expert_load[...] = jnp.zeros_like(load)
        cv = jnp.where(counted, load.std(-1, keepdims=True) / jnp.maximum(mean, 1e-9), 0.0)
        return {"expert_load_cv": cv[..., 0]}

    def _sigmoid_choice(self, logits) -> tuple:
        """(weights, chosen, each expert's share of the token's scores) of sigmoid
        scoring (see the module docstring)."""
        scores = jax.nn.sigmoid(logits.astype(jnp.float32))
        choice = scores + self.score_bias[...]
        if self.groups is not None:
            choice = limit_groups(choice, *self.groups)
        _, chosen = jax.lax.top_k(choice, self.top_k)
        weights = jnp.take_along_axis(scores, chosen, -1)
        if self.renormalize:
            weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
        return weights * self.scale, chosen, scores / scores.sum(-1, keepdims=True)

    def expert_layers(self) -> ExpertLayers:
        """This layer as the planner sees it (``redray.planning.memory.expert_layers``)."""
        shape = self.gate_up_proj.get_value().shape  # (stacked..., experts, hidden, 2, inner)
        return ExpertLayers(math.prod(shape[:-4]), shape[-4], self.top_k, shape[-3], shape[-1],
                            self.capacity_factor)

    def routed(self, x, chosen, weights) -> tuple:
        """(output like ``x``, kept like ``chosen``) of the tokens ``x`` (..., hidden)
        through their ``chosen`` experts (..., k): on one device's whole batch, or on the
        plan's mesh where a step is traced on one (each device its own tokens, its
        experts over ``expert``, their inner width over ``model``; on a context axis, its
        part of every sequence (rows, sequence, hidden))."""
        gate_up = self.gate_up_proj[...].astype(self.dtype)
        down = self.down_proj[...].astype(self.dtype)
        experts = gate_up.shape[0]
        bias = self.gate_up_bias[...].astype(self.dtype) if hasattr(self, "gate_up_bias") \
            else jnp.zeros((experts, 2, 1), self.dtype)
        ffn = ExpertFn(self.gated, self.sigmoid_inputs)
        shared = self.shared_kernels()

        def capacity(n: int) -> int | None:  # per device, over its own tokens
            return expert_capacity(self.capacity_factor, n, self.top_k, experts)

        split = context_split()
        lead = x.shape[:-1]
        mesh = traced_mesh(x.shape[0]) \
            if split and x.ndim == 3 and x.shape[1] % split[1] == 0 else None
        # each device its own rows; on a context axis its part of each of their sequences
        rows = P(BATCH_AXES, CONTEXT.name)
        if mesh is None:  # the tokens in one list, split over the batch axes
            x, chosen, weights = (a.reshape(-1, a.shape[-1]) for a in (x, chosen, weights))
            mesh, rows = traced_mesh(x.shape[0]), P(BATCH_AXES)
        if mesh is None:
            out, kept = dispatch(x, chosen, weights, gate_up, bias, down, ffn,
                                 capacity(x.shape[0]))
            if shared:
                out = out + self.shared_output(x, *shared).astype(out.dtype)
            return out.reshape(*lead, -1), kept.reshape(*lead, -1)
        ways, inner = mesh.shape[EXPERT.name], mesh.shape[MODEL.name]
        if experts % ways:
            raise ValueError(f"expert_axis={ways} does not divide the {experts} experts: use "
                             f"an expert axis that divides {experts}")
        by_expert = EXPERT.name if ways > 1 else None
        how = self.exchange_kind()
        by_model = MODEL.name if inner > 1 and gate_up.shape[-1] % inner == 0 else None
        bias_by_model = by_model if bias.shape[-1] == gate_up.shape[-1] else None
        # a shared expert's inner width splits over model too: one all-reduce for both
        shared_by_model = MODEL.name if shared and inner > 1 and \
            shared[0].shape[-1] % inner == 0 else None
        summed = by_model or shared_by_model

        def local(tokens, chosen, weights, gate_up, bias, down, *shared):
            shape = tokens.shape[:-1]  # (rows, its part of the sequence) on a context axis
            tokens, chosen, weights = (a.reshape(-1, a.shape[-1])
                                       for a in (tokens, chosen, weights))
            if summed is not None:
                # the tokens vary over model from here: their gradient's sum over it is
                # taken once, on the tokens, not on each token's k assignments
                tokens = jax.lax.pcast(tokens, (summed,), to="varying")
            if by_expert is None:
                out, kept = dispatch(tokens, chosen, weights, gate_up, bias, down, ffn,
                                     capacity(tokens.shape[0]))
            elif how == "gather":
                out, kept = gathered(tokens, chosen, weights, gate_up, bias, down, ffn,
                                     by_expert, ways)
            else:
                out, kept = exchange(tokens, chosen, weights, gate_up, bias, down, ffn,
                                     capacity(tokens.shape[0]), by_expert, ways)
            if shared:
                out = out + self.shared_output(tokens, *shared).astype(out.dtype)
            if summed is not None:  # each device summed over its share of the widths
                out = jax.lax.psum(out, summed)
            return out.reshape(*shape, -1), kept.reshape(*shape, -1)

        specs, _ = _routed_specs(mesh, rows, by_expert, by_model, bias_by_model,
                                 shared_by_model, len(shared))
        specs, where = _nested(mesh, specs)
        result = specs[0]  # the tokens' spec, the outputs' too
        out, kept = jax.shard_map(local, in_specs=tuple(specs), out_specs=(result, result),
                                  **where)(x, chosen, weights, gate_up, bias, down, *shared)
        return out.reshape(*lead, -1), kept.reshape(*lead, -1)

    def exchange_kind(self) -> str:
        """How an expert axis exchanges this layer's tokens: the plan's
        ``expert_exchange``, "auto" being "gather" for a dropless layer and "all_to_all"
        for one with a capacity factor (``Plan.expert_exchange``)."""
        asked = tracing().expert_exchange
        if asked == "auto":
            return "gather" if self.capacity_factor is None else "all_to_all"
        if asked == "gather" and self.capacity_factor is not None:
            raise ValueError(f"expert_exchange='gather' drops nothing, so it cannot apply "
                             f"capacity_factor={self.capacity_factor}: use "
                             "expert_exchange='all_to_all' (or 'auto'), or no capacity factor")
        return asked

    def shared_kernels(self) -> tuple:
        """A shared expert's kernels (``mixtral.SharedExpertMoE``): (gate and up (hidden,
        2, inner), down (inner, hidden)[, its gate (hidden, 1)]); () where none."""
        return ()

    def shared_output(self, tokens, gate_up, down, gate=None):
        """The shared expert's output for ``tokens`` (..., hidden) from its kernels (on a
        plan, each device's share of its inner width: a partial sum)."""
        h = jnp.einsum("...h,hpi->...pi", tokens, gate_up)
        out = (self.act(h[..., 0, :]) * h[..., 1, :]) @ down
        if gate is not None:
            out = jax.nn.sigmoid(tokens @ gate) * out
        return out


# rows (m, hidden) x kernels (experts, hidden, 2, inner) -> (m, 2, inner), row groups
# by expert
_GROUPED = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([1], [1]), ([], [])), lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[0])


@dataclasses.dataclass(frozen=True)
class ExpertFn:
    """How an expert computes and where its routing weight applies: ``gated`` the
    activation of its (..., 2, inner) gate and up (``MoE.gated``); ``on_inputs``: the
    weight scales the expert's input (Llama 4) instead of its output."""
    gated: Callable
    on_inputs: bool = False


def dispatch(tokens, chosen, weights, gate_up, bias, down, ffn: ExpertFn,
             capacity: int | None = None):
    """Each token through its chosen experts, sorted by expert and grouped per matmul.

    Args:
      tokens: (n, hidden); chosen, weights: (n, k) experts and their weights.
      gate_up: (experts, hidden, 2, intermediate); bias: its bias (experts, 2,
        intermediate), or (experts, 2, 1) zeros; down: (experts, intermediate, hidden).
      ffn: the experts' activation and where the weights apply.
      capacity: the most assignments an expert keeps (None: all).

    Returns:
      (output (n, hidden) in float32 or the tokens' dtype, kept (n, k) float32: 1 where
      the assignment was computed, 0 where the capacity dropped it).
    """
    n, k = chosen.shape
    flat = chosen.reshape(-1)
    order, sizes = _by_expert(flat, gate_up.shape[0])
    rows = tokens[order // k]
    if ffn.on_inputs:
        rows = rows * weights.reshape(-1)[order][:, None].astype(rows.dtype)
    # gate and up in one grouped matmul over the (experts, hidden, 2, inner) kernel: the
    # inner width stays a dimension of its own (what tensor parallelism splits)
    h = jax.lax.ragged_dot_general(rows, gate_up, sizes, _GROUPED) + bias[flat[order]]
    y = jax.lax.ragged_dot(ffn.gated(h), down, sizes)
    back = jnp.zeros_like(order).at[order].set(jnp.arange(n * k, dtype=order.dtype))
    y = y[back].reshape(n, k, -1)
    kept = jnp.ones((n, k), jnp.float32)
    if capacity is not None:
        kept = (_places(flat, order, sizes) < capacity)[back].reshape(n, k).astype(jnp.float32)
    scale = kept.astype(weights.dtype) if ffn.on_inputs else weights * kept.astype(weights.dtype)
    return (y * scale[..., None]).sum(1), kept


def _by_expert(flat, experts: int) -> tuple:
    """(the assignments ``flat`` sorted by expert, token order kept inside each expert;
    each expert's count)."""
    order = jnp.argsort(flat, stable=True)
    return order, jnp.bincount(flat, length=experts).astype(jnp.int32)


def _places(flat, order, sizes):
    """Each sorted assignment's place among its expert's (0 for the first token)."""
    starts = jnp.cumsum(sizes) - sizes
    return jnp.arange(flat.shape[0]) - starts[flat[order]]


def exchange(tokens, chosen, weights, gate_up, bias, down, ffn: ExpertFn,
             capacity: int | None, axis: str, ways: int):
    """``dispatch`` with the experts split over the mesh axis ``axis`` (``ways``
    devices, each holding ``gate_up.shape[0]`` consecutive experts), inside
    ``shard_map``: every device's assignments sent to their expert's device and the
    results sent back, by two all-to-alls.

    Each (device, expert) pair has ``capacity`` slots (None: the device's tokens, so
    nothing is dropped), filled in token order; an all-to-all of the (experts x slots x
    hidden) buffer sends each device the slots of its experts, which run as one batched
    matmul per projection, and a second all-to-all returns them. The bytes of each
    all-to-all are experts x slots x hidden: ``capacity_factor`` x tokens x top_k x
    hidden with a capacity, experts x tokens x hidden without one.
    """
    n, k = chosen.shape
    local, hidden = gate_up.shape[0], tokens.shape[-1]
    experts = local * ways
    room = n if capacity is None else capacity
    flat = chosen.reshape(-1)
    order, sizes = _by_expert(flat, experts)
    rank = jnp.zeros_like(flat).at[order].set(_places(flat, order, sizes))  # token order
    kept = rank < room
    slot = jnp.where(kept, flat * room + rank, experts * room)  # dropped: off the end
    rows = tokens[jnp.arange(n * k) // k]
    if ffn.on_inputs:
        rows = rows * weights.reshape(-1)[:, None].astype(rows.dtype)
    send = jnp.zeros((experts * room, hidden), tokens.dtype).at[slot].set(rows, mode="drop")
    # (devices, local experts x room, hidden): the block for each device's experts
    got = jax.lax.all_to_all(send.reshape(ways, local * room, hidden), axis, 0, 0,
                             tiled=True)
    x = got.reshape(ways, local, room, hidden).transpose(1, 0, 2, 3).reshape(
        local, ways * room, hidden)
    h = jnp.einsum("erh,ehgf->ergf", x, gate_up) + bias[:, None]
    y = jnp.einsum("erf,efh->erh", ffn.gated(h), down)
    y = y.reshape(local, ways, room, hidden).transpose(1, 0, 2, 3).reshape(
        ways, local * room, hidden)
    back = jax.lax.all_to_all(y, axis, 0, 0, tiled=True).reshape(experts * room, hidden)
    out = jnp.take(back, slot, axis=0, mode="fill", fill_value=0).reshape(n, k, hidden)
    kept = kept.reshape(n, k).astype(jnp.float32)
    scale = kept.astype(weights.dtype) if ffn.on_inputs else weights * kept.astype(weights.dtype)
    return (out * scale[..., None]).sum(1), kept


def gathered(tokens, chosen, weights, gate_up, bias, down, ffn: ExpertFn, axis: str,
             ways: int):
    """``dispatch`` with the experts split over the mesh axis ``axis`` (``ways`` devices,
    each holding ``gate_up.shape[0]`` consecutive experts), inside ``shard_map``, with
    nothing dropped and no slots: each device gathers the tokens of the axis's devices
    with their choices and weights (one all-gather each), runs the assignments routed to
    its own experts through one grouped matmul per projection (the others sorted after
    them, outside every group), weighs and sums them per token, and the sums (each
    device its experts' part of every token's output) are reduce-scattered back to the
    tokens' devices. Each token's hidden state crosses the axis once each way (the
    backward: the transposes, an all-gather of the output's gradient and a
    reduce-scatter of the tokens'), whatever its experts: ``ways x tokens x hidden`` per
    device each way, against ``experts x tokens x hidden`` for ``exchange``'s dropless
    slots. The gathered tokens' assignments are held on every device (``ways x tokens x
    top_k`` rows)."""
    n, k = chosen.shape
    local, hidden = gate_up.shape[0], tokens.shape[-1]
    # the choices sent in the narrowest integer that holds every expert's index
    narrow = jnp.int8 if local * ways <= 127 else jnp.int16 if local * ways <= 32767 \
        else chosen.dtype
    every, choices, weighs = (jax.lax.all_gather(a, axis, tiled=True)
                              for a in (tokens, chosen.astype(narrow), weights))
    choices = choices.astype(chosen.dtype)
    mine = choices - jax.lax.axis_index(axis) * local  # this device's experts: 0..local-1
    owned = (mine >= 0) & (mine < local)
    flat = jnp.where(owned, mine, local).reshape(-1)  # the others: one group after them
    order, sizes = _by_expert(flat, local + 1)
    rows = every[order // k]
    if ffn.on_inputs:
        rows = rows * weighs.reshape(-1)[order][:, None].astype(rows.dtype)
    own = sizes[:local]  # the rows after them are in no group: the matmuls give them 0
    h = jax.lax.ragged_dot_general(rows, gate_up, own, _GROUPED) + \
        bias[jnp.minimum(flat[order], local - 1)]
    y = jax.lax.ragged_dot(ffn.gated(h), down, own)
    back = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
    y = y[back].reshape(ways * n, k, hidden)
    scale = owned.astype(weighs.dtype) if ffn.on_inputs else \
        weighs * owned.astype(weighs.dtype)
    out = (y * scale[..., None]).sum(1)
    out = jax.lax.psum_scatter(out, axis, scatter_dimension=0, tiled=True)
    return out, jnp.ones((n, k), jnp.float32)


def summarize(reports: dict, experts: int) -> dict:
    """The auxiliary outputs (see the module docstring) of the blocks' reports stacked
    on a leading layer axis."""
    rows = jnp.maximum(reports["tokens"].sum(), 1.0)
    share = reports["expert_tokens"].sum(0) / rows
    probability = reports["router_probs"].sum(0) / rows
    assigned = jnp.maximum(reports["expert_tokens"].sum(), 1.0)
    out = {"load_balancing": experts * jnp.sum(share * probability),
           "router_z": reports["router_z"].sum() / rows,
           "expert_tokens": reports["expert_tokens"],
           "dropped": reports["dropped"].sum() / assigned}
    if "sequence_tokens" in reports:
        out["sequence_balance"] = sequence_balance(reports, experts)
    return out


def sequence_balance(reports: dict, experts: int) -> jax.Array:
    """DeepSeek-V3's sequence-wise balance loss (arXiv 2412.19437, eq. 17-20), without
    its factor: per layer and sequence, sum over experts of f_i P_i, with f_i = experts x
    the expert's share of the sequence's assignments and P_i its mean normalized score
    (the router probability) over the sequence's real tokens; the mean over the
    sequences that have any, summed over the layers."""
    counts, length = reports["sequence_tokens"], reports["sequence_length"]  # (L, B, E), (L, B)
    f = experts * counts / jnp.maximum(counts.sum(-1, keepdims=True), 1.0)
    p = reports["sequence_probs"] / jnp.maximum(length[..., None], 1.0)
    real = (length > 0).astype(jnp.float32)
    per_layer = ((f * p).sum(-1) * real).sum(-1) / jnp.maximum(real.sum(-1), 1.0)
    return per_layer.sum()


def auxiliary_loss(aux: dict, config) -> jax.Array:
    """What to add to the LM loss: ``router_aux_loss_coef`` x load balancing (as
    ``transformers`` adds it) + ``router_z_loss_coef`` x router z-loss + ``aux_loss_alpha``
    x the sequence-wise balance loss (DeepSeek's: V2's config field; V3 trained with
    0.0001; 0 unless the config sets them)."""
    balance = float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0)
    z = float(getattr(config, "router_z_loss_coef", 0.0) or 0.0)
    loss = balance * aux["load_balancing"] + z * aux["router_z"]
    alpha = float(getattr(config, "aux_loss_alpha", 0.0) or 0.0)
    if alpha and "sequence_balance" in aux:
        loss = loss + alpha * aux["sequence_balance"]
    return loss


def metrics(aux: dict, per_expert: bool = False) -> dict:
    """Scalars to log from ``aux``: both losses, ``expert_load_max`` (the busiest
    expert's assignments over an even share, worst layer: 1 is perfect balance),
    ``dropped`` (the fraction the capacity dropped) and with ``per_expert`` each
    expert's share of the assignments over all layers (``expert_share/3``)."""
    counts = aux["expert_tokens"]
    even = jnp.maximum(counts.sum(-1, keepdims=True), 1.0) / counts.shape[-1]
    out = {"load_balancing": aux["load_balancing"], "router_z": aux["router_z"],
           "expert_load_max": jnp.max(counts / even), "dropped": aux["dropped"]}
    if "sequence_balance" in aux:
        out["sequence_balance"] = aux["sequence_balance"]
    if per_expert:
        share = counts.sum(0) / jnp.maximum(counts.sum(), 1.0)
        out.update({f"expert_share/{e}": share[e] for e in range(counts.shape[-1])})
    return out


# ------------------------------------------------------------------ Hugging Face layout
@dataclasses.dataclass(frozen=True)
class Experts:
    """Hugging Face's per-expert tensors stacked in one redray kernel (a weight-table
    row, read by ``hub.from_pretrained`` and written by ``save_pretrained``).

    Part ``j * per + p`` is expert j's p-th tensor: the experts lie along axis 0 and,
    with ``per`` > 1, the p-th tensors of an expert along ``axis`` (gate and up).
    """
    parts: tuple[Tensor, ...]
    per: int
    axis: int

    @property
    def path(self) -> str:
        return self.parts[0].path

    def part_shapes(self, shape: tuple) -> list[tuple]:
        one = (1, *shape[1:])
        if self.per > 1:
            one = one[:self.axis] + (1,) + one[self.axis + 1:]
        return [one] * len(self.parts)

    def offsets(self, shape: tuple) -> list[tuple]:
        def at(j, p):
            start = [j] + [0] * (len(shape) - 1)
            if self.per > 1:
                start[self.axis] = p
            return tuple(start)
        return [at(j, p) for j in range(len(self.parts) // self.per) for p in range(self.per)]

    def write(self, array: np.ndarray) -> list[np.ndarray]:
        pieces = [piece for expert in np.split(array, array.shape[0], 0)
                  for piece in np.split(expert, self.per, self.axis)]
        return [part.save(piece) for part, piece in zip(self.parts, pieces)]


def expert_rows(path: str, experts: int, gate_up: tuple[str, str], down: str) -> list[Experts]:
    """Weight-table rows of a ``MoE`` at ``path`` (e.g. "layers/0/mlp") from Hugging
    Face's per-expert ``nn.Linear`` weights: ``gate_up`` and ``down`` name them with
    ``{j}`` for the expert (e.g. "model.layers.0.mlp.experts.{j}.gate_proj.weight")."""
    gate, up = gate_up
    return [Experts(tuple(linear(name.format(j=j), f"{path}/gate_up_proj", in_dims=2)
                          for j in range(experts) for name in (gate, up)), 2, 2),
            Experts(tuple(linear(down.format(j=j), f"{path}/down_proj", in_dims=2)
                          for j in range(experts)), 1, 0)]
