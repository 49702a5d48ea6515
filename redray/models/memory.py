"""What a training step holds per device, counted without a device: the memory half of
``redray plan``.

The state (parameters, optimizer moments) comes from the sharding plan. Beside it a
step holds:

* gradients: one per trained parameter, sharded like it, in its dtype;
* compute-dtype copies: with ``compute_dtype`` (bfloat16) the parameters are cast once
  per step and the copies live through the forward and backward passes;
* FSDP gather buffers: with an fsdp axis each layer's parameters are all-gathered
  before use; two layers are counted (the one computing and the next, prefetched);
* activations: the residuals the backward pass reads, traced by JAX itself
  (``jax.ad_checkpoint``'s saved residuals of the loss's linearization) on the
  per-device batch and sequence, under the remat policy. Residuals whose shape holds a
  size the rules split over ``model`` (heads, intermediate size, vocabulary) count
  1/model per device; the residual stream counts whole, as in Megatron; residuals
  that hold the sequence count 1/context on a context axis;
* the recompute buffer: with a remat policy the backward pass re-runs one layer's
  forward, holding what that layer would have saved without remat.

Layers are traced at depth 1 and 2 and the difference extrapolated to the model's
depth (every layer is alike), so a plan of an 80-layer model traces 2-layer ones.
Checked against XLA's ``compiled.memory_analysis()`` of redray's real training step at
small sizes on CPU (``benchmarks/memory.py``, ``memory/plan_over_compiled``).
"""

from __future__ import annotations

import contextlib
import dataclasses

import jax
import jax.numpy as jnp

from redray.models.layers import remat_policy
from redray.sharding import CONTEXT, EXPERT, FSDP, MODEL, STAGE, Parallelism
from redray.sharding.activations import blockwise_attention
from redray.sharding.cost import expert_exchange_bytes
from redray.sharding.memory import (GATHERED_LAYERS, layer_gather_bytes, pipelined_parts,
                                    saved_residuals, split_residual_bytes, split_sizes, totals)

# Layer-count fields of a config, per model type (every other family: one field).
LAYER_FIELDS = {"t5": ("num_layers", "num_decoder_layers")}


@dataclasses.dataclass(frozen=True)
class StepShape:
    """The step a memory plan is for.

    Attributes:
      batch_size: examples per optimizer update over all devices (micro batch: the
        examples one forward/backward pass holds; ``batch_size`` unless accumulating).
      seq_len: tokens per example the model sees.
      remat: "none", "full", "dots" or "offload" (as the models' ``remat=``).
      compute_dtype: e.g. "bfloat16": the parameters are cast to it for the step and the
        model is built in it (``build(config, dtype=...)``, with ``Trainer(...,
        compute_dtype=...)``); None computes in the parameters' float32.
      loss_chunk: tokens whose logits exist at once (``next_token_loss(chunk=)``).
      micro_batch_size: examples per forward/backward pass (gradient accumulation);
        None: ``batch_size``.
      scan: the model's layers stacked and scanned (None: as ``build`` builds them by
        default); what the backward pass keeps of a scanned stack is not a list's.
      stage_repeats: the pipeline's circular repeats on a stage axis
        (``Trainer(stage_repeats=)``).
      pipeline_schedule: "gpipe" or "1f1b" (``Trainer(pipeline_schedule=)``).
    """

    batch_size: int
    seq_len: int
    remat: str = "none"
    compute_dtype: str | None = None
    loss_chunk: int | None = None
    micro_batch_size: int | None = None
    scan: bool | None = None
    stage_repeats: int = 1
    pipeline_schedule: str = "gpipe"

    def __post_init__(self):
        for name in ("batch_size", "seq_len", "stage_repeats"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        remat_policy(self.remat)  # a clear error naming the policies
        if self.pipeline_schedule not in ("gpipe", "1f1b"):
            raise ValueError(f"pipeline_schedule {self.pipeline_schedule!r}: use 'gpipe' or "
                             "'1f1b'")
        if self.compute_dtype is not None:
            try:
                jnp.dtype(self.compute_dtype)
            except TypeError:
                raise ValueError(f"compute_dtype {self.compute_dtype!r} is not a dtype: use "
                                 "e.g. 'bfloat16' or None") from None

    @property
    def micro(self) -> int:
        return self.micro_batch_size or self.batch_size


def _loss(model, inputs, chunk):
    from redray.models.losses import next_token_loss

    if "decoder_input_ids" in inputs:  # encoder-decoder: the decoder's tokens as targets
        logits = model(**inputs, train=True).astype(jnp.float32)
        targets = inputs["decoder_input_ids"]
        logz = jax.nn.logsumexp(logits, -1)
        return jnp.mean(logz - jnp.take_along_axis(logits, targets[..., None], -1)[..., 0])
    return next_token_loss(model, inputs["input_ids"], chunk=chunk, train=True)


def _abstract_loss(fam, config, batch: int, seq: int, policy: str, compute_dtype, chunk,
                   scan: bool | None = None):
    """(loss(params, extra, inputs), params, extra, inputs), all abstract: one loss
    evaluation of ``config``'s model (its layers stacked or not as ``scan`` says, see
    ``build``) on ``batch`` examples of ``seq`` tokens."""
    from flax import nnx

    from redray.rngs import rngs as fast_rngs

    # a model trained in a compute dtype is built in it too (redray's models compute in
    # their ``dtype``; bfloat16 parameters in a float32 model are cast back per matmul)
    abstract = nnx.eval_shape(lambda: fam.Model(config, rngs=fast_rngs(0), remat=policy,
                                                dtype=compute_dtype or jnp.float32,
                                                scan=scan))
    graphdef, params, extra = nnx.split(abstract, nnx.Param, ...)
    if compute_dtype is not None:  # the copies are counted apart
        params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, compute_dtype)
                              if jnp.issubdtype(x.dtype, jnp.floating) else x, params)
    inputs = fam.trace_inputs(config, batch, seq)
    if "decoder_input_ids" not in inputs:  # next_token_loss feeds seq tokens of seq + 1
        inputs = {"input_ids": jax.ShapeDtypeStruct((batch, seq + 1), jnp.int32)}

    def loss(params, extra, inputs):
        return _loss(nnx.merge(graphdef, params, extra), inputs, chunk)

    return loss, params, extra, inputs


def _trace(fam, config, batch: int, seq: int, policy: str, compute_dtype, chunk,
           scan: bool | None) -> list:
    """Shapes and dtypes of the residuals of one loss evaluation (parameters excluded)."""
    return saved_residuals(*_abstract_loss(fam, config, batch, seq, policy, compute_dtype,
                                           chunk, scan))


def example_flops(fam, config, seq: int, compute_dtype=None, chunk=None) -> float:
    """FLOPs of one example's forward and backward pass (no remat), from XLA's cost
    analysis of the lowered gradient, at depth 1 and 2 and extrapolated to the model's
    depth (every layer is alike)."""
    fields = LAYER_FIELDS.get(config.model_type, ("num_hidden_layers",))
    depth = [getattr(config, f) for f in fields]

    def at(counts):
        # the layers as a list: XLA's cost analysis counts a loop's body once
        loss, params, extra, inputs = _abstract_loss(
            fam, _with_layers(config, fields, counts), 1, seq, "none", compute_dtype, chunk,
            scan=False)
        lowered = jax.jit(jax.grad(loss)).lower(params, extra, inputs)
        return float(lowered.cost_analysis()["flops"])

    base = at([1] * len(fields))
    deltas = [at([2 if j == i else 1 for j in range(len(fields))]) - base
              for i in range(len(fields))]
    return base + sum((n - 1) * d for n, d in zip(depth, deltas))


def _with_layers(config, fields, counts):
    config = config.__class__.from_dict(config.to_dict())
    for field, n in zip(fields, counts):
        setattr(config, field, n)
    return config


def activation_bytes(fam, config, step: StepShape, per_device_batch: int, model_axis: int,
                     split_sizes: set[int], traces: dict | None = None,
                     context: int = 1, blockwise: bool = False) -> dict:
    """{"saved": residual bytes per device for the whole model, "recompute": one
    layer's rematerialized residuals (0 without remat), "per_layer": saved bytes of one
    layer, "host": residual bytes offloaded to host memory ("offload" policy)}.

    With ``traces`` (a dict kept between calls, the planner's) the traces are reused
    and a batch beyond 2 rows is extrapolated from 1 and 2 (every residual holds the
    batch, or nothing that grows with it: the count is linear in the rows)."""
    policy = remat_policy(step.remat)
    fields = LAYER_FIELDS.get(config.model_type, ("num_hidden_layers",))
    depth = [getattr(config, f) for f in fields]
    # offload keeps the matmul outputs in host memory: on the device it holds what
    # "full" holds; the host holds what "dots" adds to that.
    traced = ({"full", "dots"} if policy == "offload" else {policy}) | {"none"}

    def residuals(counts, batch: int, name: str) -> list:
        key = (tuple(counts), batch, name)
        if traces is None or key not in traces:
            # on a context axis every attention is blockwise (the ring's); on devices
            # with fused kernels (``blockwise``: a GPU or TPU planned from here) they
            # save what the blockwise kernel saves, not the (queries x keys) scores
            with blockwise_attention() if context > 1 or blockwise \
                    else contextlib.nullcontext():
                found = _trace(fam, _with_layers(config, fields, counts), batch, step.seq_len,
                               name, step.compute_dtype, step.loss_chunk, step.scan)
            if traces is None:
                return found
            traces[key] = found
        return traces[key]

    def measure(name):
        def at(counts):
            probe = residuals(counts, 1, name)

            def rows(batch: int) -> int:
                return split_residual_bytes(residuals(counts, batch, name), probe, split_sizes,
                                            model_axis, frozenset({step.seq_len, step.seq_len + 1}),
                                            context)

            if traces is None or per_device_batch <= 2:
                return rows(per_device_batch)
            one, two = rows(1), rows(2)
            return one + (per_device_batch - 1) * (two - one)

        base = at([1] * len(fields))
        deltas = [at([2 if j == i else 1 for j in range(len(fields))]) - base
                  for i in range(len(fields))]
        whole = base + sum((n - 1) * d for n, d in zip(depth, deltas))
        return whole, deltas

    results = {name: measure(name) for name in traced}
    device = "full" if policy == "offload" else policy
    saved, deltas = results[device]
    none_deltas = results["none"][1]
    recompute = 0 if policy == "none" else max(n - d for n, d in zip(none_deltas, deltas))
    host = results["dots"][0] - saved if policy == "offload" else 0
    return {"saved": int(saved), "recompute": int(max(recompute, 0)),
            "per_layer": int(max(deltas)), "host": int(max(host, 0))}


def memory_plan(fam, config, param_rows, opt_bytes: int, parallelism: Parallelism,
                step: StepShape, device_gib: float | None = None,
                traces: dict | None = None, experts=(), pipeline: bool = True,
                blockwise: bool = False) -> dict:
    """Bytes per device of one training step of ``config``'s model on ``parallelism``
    (built, or abstract) (see the module); ``experts``: its mixture-of-experts layers
    (``redray.sharding.cost.ExpertLayers``), whose exchange an expert axis adds;
    ``pipeline``: on a stage axis, count what the pipeline's micro-batches hold
    (``pipelined_parts``; False: one micro-batch's, the planner adds the rest).
    ``blockwise``: count attention as a fused kernel keeps it (planned for a GPU or TPU
    from another machine): the blockwise kernel's residuals.

    Returns a JSON-ready dict: ``parts`` (name -> bytes per device: parameters,
    optimizer, gradients, compute_copies, fsdp_gathered, activations, recompute, and on
    an expert axis expert_exchange),
    ``total``, ``per_device_batch``, ``offloaded_to_host``, the ``step`` it is for and,
    with ``device_gib``, ``fits`` and ``device_bytes``.
    """
    geometry = parallelism.step_geometry(step.batch_size, step.micro)
    per_device = geometry.micro_batch_size
    params = sum(r.bytes_per_device for r in param_rows)
    hidden = getattr(config, "hidden_size", None) or getattr(config, "d_model", 0)
    acts = activation_bytes(fam, config, step, per_device, parallelism.size(MODEL),
                            split_sizes(param_rows, hidden), traces, parallelism.size(CONTEXT),
                            blockwise)
    copies = 0
    item = jnp.dtype(step.compute_dtype).itemsize if step.compute_dtype else 4
    if step.compute_dtype and jnp.dtype(step.compute_dtype) != jnp.float32:
        copies = params * item // 4
    gathered, fsdp = 0, parallelism.size(FSDP)
    if fsdp > 1:
        gathered = GATHERED_LAYERS * layer_gather_bytes(param_rows, fsdp) * item // 4
    parts = {"parameters": params, "optimizer": opt_bytes, "gradients": params,
             "compute_copies": copies, "fsdp_gathered": gathered,
             "activations": acts["saved"], "recompute": acts["recompute"]}
    if parallelism.size(EXPERT) > 1:
        parts["expert_exchange"] = expert_exchange_bytes(
            experts, parallelism.shape,
            per_device * -(-step.seq_len // parallelism.size(CONTEXT)), item,
            every_layer=step.remat in ("none", "dots"))
    if pipeline:
        parts = pipelined_parts(parts, parallelism.size(STAGE), geometry.accumulation,
                                per_device * step.seq_len * hidden * item, step.stage_repeats,
                                step.pipeline_schedule)
    return {**totals(parts, device_gib), "per_device_batch": per_device,
            "activations_per_layer": acts["per_layer"], "offloaded_to_host": acts["host"],
            "step": dataclasses.asdict(step)}




