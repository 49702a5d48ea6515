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
* plan over compiled: what ``redray plan`` counts for that step from the config alone
  (``plan_model(..., step=StepShape(batch, seq, remat))``: parameters, Adam state,
  gradients, FSDP gather buffers, the activations JAX saves for the backward pass,
  traced, and with remat one layer's recompute), over the compiled step's peak
  (arguments + temporaries + outputs - aliases; the donated state is updated in
  place). The loss is ``next_token_loss`` (full logits). Figure
  ``memory/plan_over_compiled/<mesh>`` with remat "none", target 0.8-1.25; the headline
  ``memory/plan_over_compiled`` is the mesh farthest from 1. The "full" and "dots"
  policies' ratios are in ``detail`` with each policy's compiled peak: XLA:CPU runs the
  recomputations but keeps about as much as without remat (its scheduler does not
  lower the peak with them), so on CPU the plan of a remat policy is below the
  compiled peak by what the policy would save; GPU and TPU schedulers are where it
  is realized (unmeasured here: no accelerator).

Remat on XLA:CPU. ``memory/remat_full_over_none_cpu``: the step's temporaries under
remat "full" over none, 6 layers, data-parallel; the scanned layers' ratio in
``detail``. No target: it shows whether this backend realizes what the policy allows.

Plans. ``redray plan PRESET --devices N --model-axis M --fsdp-axis K`` for the paper's
models on the paper's device counts, computed by the same function
(``redray.planning.from_config.plan_model``, nothing allocated): parameters plus Adam state per
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
from _lm import DENSE_2026, FULL, MOE_FAMILIES, TINY, Sizes, collate, config  # noqa: E402
from common import figure, parser, save, simulate_devices  # noqa: E402

DEVICES = 4
simulate_devices(DEVICES)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import redray  # noqa: E402
from redray.models import build  # noqa: E402
from redray.planning.memory import StepShape  # noqa: E402
from redray.planning.from_config import plan_model  # noqa: E402
from redray.planning.memory import compiled_memory  # noqa: E402


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
    "qwen3-8b": (16, 8, 2),
    # mixtures of experts: the settings of their papers' scale (8 GPUs a host)
    "mixtral-8x7b": (64, 8, 8),
    "qwen3-30b-a3b": (32, 4, 8),
}
# a tiny run checks the script: one mesh using both axes, one preset
TINY_MESHES, TINY_PLANS = ("model2_fsdp2",), ("gpt-j-6b",)


def plan_loss(model, batch, rng, train):
    from redray.models import next_token_loss

    return next_token_loss(model, batch["ids"], train=train)


def compiled_step(s: Sizes, model_axis: int, fsdp_axis: int, remat: str, scan: bool = False,
                  family: str = "llama"):
    """A Trainer on the 4 devices, initialized, for a model of ``family`` (LLaMA) of
    sizes ``s``."""
    config_ = config(family, s)
    trainer = redray.Trainer.of(lambda rngs: build(config_, rngs=rngs, remat=remat, scan=scan),
                             collate,
                             plan_loss, optax.adamw(1e-3), batch_size=s.batch,
                             model_axis=model_axis, fsdp_axis=fsdp_axis, progress=False)
    data = [{"ids": r} for r in np.random.default_rng(0).integers(
        0, s.vocab, (s.batch, s.seq + 1), np.int32)]
    trainer.init(data)
    return trainer, config_


def peak(stats) -> int:
    return compiled_memory(stats)["peak"]


def step_memory(name: str, s: Sizes) -> list[dict]:
    """Compiles the Trainer's step on one mesh; its state figure and the plan's count
    over the compiled peak, per remat policy."""
    model_axis, fsdp_axis = MESHES[name]
    trainer, config_ = compiled_step(s, model_axis, fsdp_axis, "none")
    stats = trainer.compiled_step().memory_analysis()
    sharding = trainer.parallelism.batch_sharding()
    batch_per_device = math.prod(sharding.shard_shape((s.batch, s.seq + 1))) * 4
    leaves = jax.tree.leaves(trainer.state)
    state_total = sum(x.nbytes for x in leaves)
    state_shards = sum(x.addressable_shards[0].data.nbytes for x in leaves)
    state = stats.argument_size_in_bytes - batch_per_device
    ideal_state = state_total / DEVICES
    analysis = {k: getattr(stats, f"{k}_size_in_bytes")
                for k in ("argument", "output", "alias", "temp")}
    mesh = f"model {model_axis} x fsdp {fsdp_axis} ({DEVICES} CPU devices)"
    policies = {}
    for remat in ("none", "full", "dots"):
        if remat != "none":
            trainer, _ = compiled_step(s, model_axis, fsdp_axis, remat)
        compiled = peak(trainer.compiled_step().memory_analysis())
        # the plan of the compiled step's model: its layers listed, as built above
        planned = plan_model(config_, DEVICES, model_axis, fsdp_axis, scan=False,
                             step=StepShape(batch_size=s.batch, seq_len=s.seq,
                                            remat=remat))["memory"]
        policies[remat] = {"plan": planned["total"], "compiled_peak": compiled,
                           "ratio": planned["total"] / compiled, "parts": planned["parts"]}
    none = policies["none"]
    return [
        figure(f"memory/step/{name}/state", state / ideal_state, "x",
               f"training state / {DEVICES} devices ({ideal_state:,.0f} B), {mesh}", "<= 1.05",
               COMMAND, state_bytes_per_device=state, state_bytes_total=state_total,
               state_bytes_from_shardings=state_shards, batch_bytes_per_device=batch_per_device,
               memory_analysis=analysis, sizes=dataclasses.asdict(s)),
        figure(f"memory/plan_over_compiled/{name}", none["ratio"], "x",
               f"XLA's compiled peak per device ({none['compiled_peak']:,} B), {mesh}, "
               "remat none", "0.8-1.25", COMMAND, planned_parts=none["parts"],
               planned_total=none["plan"], compiled_peak=none["compiled_peak"],
               remat={k: {"ratio": v["ratio"], "plan": v["plan"],
                          "compiled_peak": v["compiled_peak"]} for k, v in policies.items()},
               compiled_full_over_none=policies["full"]["compiled_peak"] / none["compiled_peak"],
               sizes=dataclasses.asdict(s)),
    ]


def family_figure(family: str, s: Sizes) -> dict:
    """``memory/plan_over_compiled/<family>``: a 2026 family's plan over the compiled
    peak, model 2 x fsdp 2, remat none, its layers listed (as the LLaMA figures') and,
    in ``detail``, stacked."""
    model_axis, fsdp_axis = MESHES["model2_fsdp2"]
    ratios = {}
    for scan in (False, True):
        trainer, config_ = compiled_step(s, model_axis, fsdp_axis, "none", scan, family)
        compiled = peak(trainer.compiled_step().memory_analysis())
        planned = plan_model(config_, DEVICES, model_axis, fsdp_axis, scan=scan,
                             step=StepShape(batch_size=s.batch, seq_len=s.seq))["memory"]
        ratios["stacked" if scan else "listed"] = {
            "ratio": planned["total"] / compiled, "plan": planned["total"],
            "compiled_peak": compiled, "parts": planned["parts"]}
    listed = ratios["listed"]
    return figure(f"memory/plan_over_compiled/{family}", listed["ratio"], "x",
                  f"XLA's compiled peak per device ({listed['compiled_peak']:,} B), model "
                  f"{model_axis} x fsdp {fsdp_axis} ({DEVICES} CPU devices), remat none, "
                  "layers listed", "0.95-1.05", COMMAND, layouts=ratios,
                  sizes=dataclasses.asdict(s))


def remat_figure(s: Sizes) -> dict:
    """XLA:CPU's temporaries for the step under remat "full" over without remat, layers
    listed and scanned (data-parallel on the 4 devices, the model deepened to 6
    layers so the layers dominate)."""
    s = dataclasses.replace(s, layers=max(s.layers, 6))
    temps = {}
    for scan in (False, True):
        for remat in ("none", "full"):
            trainer, _ = compiled_step(s, 1, 1, remat, scan)
            temps[f"{'scanned' if scan else 'listed'}/{remat}"] = \
                trainer.compiled_step().memory_analysis().temp_size_in_bytes
    planned = {remat: plan_model(config("llama", s), DEVICES, 1, 1, step=StepShape(
        batch_size=s.batch, seq_len=s.seq, remat=remat))["memory"]["parts"]
        for remat in ("none", "full")}
    return figure("memory/remat_full_over_none_cpu", temps["listed/full"] / temps["listed/none"],
                  "x", f"the step's XLA:CPU temporaries without remat, {s.layers} layers listed, "
                  "data-parallel on 4 CPU devices", None, COMMAND, temp_bytes=temps,
                  scanned_full_over_none=temps["scanned/full"] / temps["scanned/none"],
                  planned_activations={k: v["activations"] + v["recompute"]
                                       for k, v in planned.items()},
                  sizes=dataclasses.asdict(s))


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
    ap.add_argument("--families", nargs="*", default=None,
                    choices=list(MOE_FAMILIES + DENSE_2026))
    args = ap.parse_args(argv)
    sizes = TINY if args.tiny else FULL
    meshes = args.meshes if args.meshes is not None else \
        (TINY_MESHES if args.tiny else list(MESHES))
    presets = args.presets if args.presets is not None else \
        (TINY_PLANS if args.tiny else list(PLANS))
    figures = []
    for name in meshes:
        figures += step_memory(name, sizes)
    spread = [f for f in figures if f["name"].startswith("memory/plan_over_compiled/")]
    if spread:
        worst = max(spread, key=lambda f: abs(math.log(f["value"])))
        figures.append(figure(
            "memory/plan_over_compiled", worst["value"], "x",
            f"the compiled peak; the mesh farthest from 1 ({worst['name'].rsplit('/', 1)[1]})",
            "0.8-1.25", COMMAND, all={f["name"]: f["value"] for f in spread}))
    families = args.families if args.families is not None else \
        (() if args.tiny else MOE_FAMILIES + DENSE_2026)
    figures += [family_figure(f, sizes) for f in families]
    figures.append(remat_figure(sizes))
    figures += [plan_figure(p) for p in presets]
    figures.append(attention_figure(args.tiny))
    save(figures, args.out)


if __name__ == "__main__":
    main()
