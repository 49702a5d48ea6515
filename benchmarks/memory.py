"""Memory: bytes per device of a training step and of the paper's models, over the ideal.

Compiled step. redray's real training step (a ``redray.Trainer``'s jitted, donated
step) for a small LLaMA (``redray.models``, fp32, 2 layers, hidden 256, 4 heads,
intermediate 1024, vocabulary 1024, AdamW, batch 8 x sequence 128) is compiled on 4
simulated CPU devices with ``model_axis=4``, ``fsdp_axis=4`` and ``model_axis=2,
fsdp_axis=2``, and XLA's ``compiled.memory_analysis()`` is read:

* state per device = argument bytes - the batch's bytes per device. Its ideal is the
  whole training state (parameters, both Adam moments, step, RNG key) divided by the
  4 devices, since model x fsdp spans all of them. Figure ``memory/step/<mesh>/state``,
  target <= 1.05.
* peak per device = arguments + temporaries + outputs - aliases (the donated state is
  updated in place), over state / devices + an activation estimate. The estimate is
  what any implementation of this step must hold beside the state, in fp32, per device
  (b rows of the batch on the device, sequence s, hidden h, heads a, intermediate i,
  vocabulary V, model axis t), written down rather than measured:

  - per layer, the tensors the backward pass reads: the block's input, the two RMSNorm
    inputs and outputs shared by every tensor-parallel peer (4 b*s*h), Q, K, V and the
    attention output split over heads (4 b*s*h / t), the attention probabilities
    (b*a*s*s / t), the gate, the up projection and their product (3 b*s*i / t);
  - after the blocks: the final norm's input and output (2 b*s*h), the logits and
    their softmax (2 b*s*V / t);
  - one gradient of the parameters, sharded like them (the optimizer update reads it
    whole).

  Figure ``memory/step/<mesh>/peak``, no target: XLA keeps more than the estimate
  (fusion outputs, the all-gathered weights of FSDP, Adam's temporaries).

Plans. ``redray plan PRESET --devices N --model-axis M --fsdp-axis K`` for the paper's
models on the paper's device counts, computed by the same function
(``redray.models.plan.plan_model``, nothing allocated): parameters plus Adam state per
device over the ideal (total / (model x fsdp)). Figure ``memory/plan/<preset>``, target
<= 1.05.

Attention. ``memory/attention_seq8192_peak_over_seq1024``: the temporaries of the
compiled gradient of one causal attention layer (batch 1, 8 heads of 64, fp32; q, k and
v inputs) at 8192 tokens over 1024, computed in blocks (``flash_attention``, what
"auto" runs from 2048 keys on, ``redray/models/attention.py``). The ideal growth is
linear, 8x: what must be held (q, k, v, the output, their gradients, the softmax
statistics) is O(T); materialized scores grow with T^2, 64x (the "xla" path's figure and
"auto"'s are in ``detail``). No target: a ratio at or under 8 is linear.

    python benchmarks/memory.py [--meshes model4 fsdp4 model2_fsdp2] [--presets ...]
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _lm import FULL, TINY, Sizes, collate, config, loss  # noqa: E402
from common import figure, parser, save, simulate_devices  # noqa: E402

DEVICES = 4
simulate_devices(DEVICES)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import redray  # noqa: E402
from redray.models import build  # noqa: E402
from redray.models.plan import plan_model  # noqa: E402
from redray.sharding import batch_sharding  # noqa: E402

COMMAND = "python benchmarks/memory.py"
# mesh name -> (model axis, fsdp axis) on the 4 devices
MESHES = {"model4": (4, 1), "fsdp4": (1, 4), "model2_fsdp2": (2, 2)}
# preset -> (devices, model axis, fsdp axis): the paper's settings
PLANS = {
    "gpt2-xl": (8, 4, 2),
    "gpt-j-6b": (8, 8, 1),
    "llama-7b": (16, 8, 2),
    "llama-13b": (32, 8, 4),
    "t5-11b": (16, 8, 2),
    "opt-13b": (16, 8, 2),
    "opt-66b": (64, 8, 8),
}
# a tiny run checks the script: one mesh using both axes, one preset
TINY_MESHES, TINY_PLANS = ("model2_fsdp2",), ("gpt-j-6b",)


def activation_bytes(s: Sizes, rows: int, model: int) -> dict:
    """The module docstring's activation estimate, in bytes per device, by term."""
    b, t, h, i = rows, model, s.hidden, s.intermediate
    seq = s.seq  # the loss feeds seq tokens of each seq + 1 window
    per_layer = (4 * b * seq * h + 4 * b * seq * h / t + b * s.heads * seq * seq / t
                 + 3 * b * seq * i / t)
    return {"blocks": 4 * s.layers * per_layer,
            "head": 4 * (2 * b * seq * h + 2 * b * seq * s.vocab / t)}


def step_memory(name: str, s: Sizes) -> list[dict]:
    """Compiles the Trainer's step on one mesh; its state and peak figures."""
    model_axis, fsdp_axis = MESHES[name]
    config_ = config("llama", s)
    trainer = redray.Trainer(lambda rngs: build(config_, rngs=rngs), collate, loss,
                             optax.adamw(1e-3), batch_size=s.batch, model_axis=model_axis,
                             fsdp_axis=fsdp_axis, progress=False)
    data = [{"ids": r} for r in np.random.default_rng(0).integers(
        0, s.vocab, (s.batch, s.seq + 1), np.int32)]
    trainer.init(data)
    stats = trainer.compiled_step().memory_analysis()
    sharding = batch_sharding(trainer.mesh)
    batch_per_device = math.prod(sharding.shard_shape((s.batch, s.seq + 1))) * 4
    leaves = jax.tree.leaves(trainer.state)
    state_total = sum(x.nbytes for x in leaves)
    state_shards = sum(x.addressable_shards[0].data.nbytes for x in leaves)
    params = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(trainer.state.params))
    state = stats.argument_size_in_bytes - batch_per_device
    ideal_state = state_total / DEVICES
    peak = (stats.argument_size_in_bytes + stats.temp_size_in_bytes
            + stats.output_size_in_bytes - stats.alias_size_in_bytes)
    rows = s.batch // trainer.dp
    act = {**activation_bytes(s, rows, model_axis), "gradient": params}
    ideal_peak = ideal_state + sum(act.values())
    analysis = {k: getattr(stats, f"{k}_size_in_bytes")
                for k in ("argument", "output", "alias", "temp")}
    mesh = f"model {model_axis} x fsdp {fsdp_axis} ({DEVICES} CPU devices)"
    return [
        figure(f"memory/step/{name}/state", state / ideal_state, "x",
               f"training state / {DEVICES} devices ({ideal_state:,.0f} B), {mesh}", "<= 1.05",
               COMMAND, state_bytes_per_device=state, state_bytes_total=state_total,
               state_bytes_from_shardings=state_shards, batch_bytes_per_device=batch_per_device,
               memory_analysis=analysis, sizes=dataclasses.asdict(s)),
        figure(f"memory/step/{name}/peak", peak / ideal_peak, "x",
               f"state / {DEVICES} devices + activation estimate ({ideal_peak:,.0f} B), {mesh}",
               None, COMMAND, peak_bytes_per_device=peak,
               ideal_bytes_per_device={"state": ideal_state, **act},
               rows_per_device=rows, memory_analysis=analysis),
    ]


def plan_figure(preset: str) -> dict:
    devices, model_axis, fsdp_axis = PLANS[preset]
    result = plan_model(preset, devices, model_axis, fsdp_axis)
    actual = result["param_bytes_per_device"] + result["opt_bytes_per_device"]
    ideal = result["ideal_param_bytes_per_device"] + result["ideal_opt_bytes_per_device"]
    return figure(
        f"memory/plan/{preset}", actual / ideal, "x",
        f"parameters + Adam state / (model {model_axis} x fsdp {fsdp_axis}), {devices} devices",
        "<= 1.05", COMMAND,
        redray_command=f"redray plan {preset} --devices {devices} --model-axis {model_axis} "
                       f"--fsdp-axis {fsdp_axis}",
        n_params=result["n_params"], mesh=result["mesh"], bytes_per_device=actual,
        ideal_bytes_per_device=ideal, ratio=result["ratio"],
        replicated=[r["path"] for r in result["replicated"]],
        replicated_small=result["replicated_omitted"])


def attention_figure(tiny: bool) -> dict:
    """The attention layer's gradient temporaries at the long over the short sequence."""
    from redray.models.attention import AttentionMask, attend

    short, long = (256, 1024) if tiny else (1024, 8192)

    def temp(seq: int, impl: str | None) -> int:
        shape = jax.ShapeDtypeStruct((1, seq, 8, 64), jnp.float32)
        mask = AttentionMask(jnp.ones((1, seq), bool), jnp.arange(seq))

        def loss(q, k, v):
            return attend(q, k, v, mask, 0.125, impl=impl).sum()

        compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(shape, shape,
                                                                   shape).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    blocks = {n: temp(n, "chunked") for n in (short, long)}
    dense = {n: temp(n, "xla") for n in (short, long)}
    auto = {n: temp(n, None) for n in (short, long)}
    name = "memory/attention_seq8192_peak_over_seq1024"
    return figure(name, blocks[long] / blocks[short], "x",
                  f"the same at {short} tokens; linear growth would be {long // short}x, "
                  f"materialized scores {(long // short) ** 2}x", None,
                  "python benchmarks/memory.py",
                  temp_bytes=blocks, materialized_temp_bytes=dense,
                  materialized_ratio=dense[long] / dense[short], auto_temp_bytes=auto,
                  sequences=[short, long])


def main(argv=None) -> None:
    ap = parser(__doc__)
    ap.add_argument("--meshes", nargs="*", default=None, choices=list(MESHES))
    ap.add_argument("--presets", nargs="*", default=None, choices=list(PLANS))
    args = ap.parse_args(argv)
    sizes = TINY if args.tiny else FULL
    meshes = args.meshes if args.meshes is not None else \
        (TINY_MESHES if args.tiny else list(MESHES))
    presets = args.presets if args.presets is not None else \
        (TINY_PLANS if args.tiny else list(PLANS))
    figures = []
    for name in meshes:
        figures += step_memory(name, sizes)
    figures += [plan_figure(p) for p in presets]
    figures.append(attention_figure(args.tiny))
    save(figures, args.out)


if __name__ == "__main__":
    main()
