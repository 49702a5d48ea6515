"""The planner's absolute predictions against published GPU runs, on paper: for each run,
the planner pinned to the run's configuration (its axis sizes, its batch per GPU, the
remat policy nearest its own where the source names one) on the preset of its GPU
predicts the throughput, beside the published figure in its own unit, their ratio, and
the planner's own pick for the same GPUs and batch.

Figure ``planner/published_ratio_worst``: the ratio (predicted over published) farthest
from 1 (target within 0.85-1.15). ``planner/seconds_16k``: planning a 405B-parameter
LLaMA shape (126 layers) on 16,384 H100 in 2,048 hosts, at 2,048 x 8,192 and at 128 x
131,072 tokens, timed (target <= 60 s each). ``--tiny``: redray's own H200 run only,
and no 16k planning.

Published FLOPs are counted as MaxText and docs/performance/gpu-mfu.md count them:
``6 N + 6 L H Q T`` per token (N the parameters that enter a matmul, the head included;
attention's square halved for the causal mask).

    python benchmarks/planner_published.py
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import figure, parser, save  # noqa: E402

COMMAND = "python benchmarks/planner_published.py"

# Meta's config.json fields of the models (untied heads)
LLAMA31_8B = dict(model_type="llama", hidden_size=4096, intermediate_size=14336,
                  num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                  vocab_size=128256, rope_theta=500000.0, tie_word_embeddings=False)
LLAMA2_7B = dict(model_type="llama", hidden_size=4096, intermediate_size=11008,
                 num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                 vocab_size=32000, tie_word_embeddings=False)
LLAMA31_70B = dict(model_type="llama", hidden_size=8192, intermediate_size=28672,
                   num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                   vocab_size=128256, rope_theta=500000.0, tie_word_embeddings=False)
# Llama-3.1-405B's config.json fields
LLAMA31_405B = dict(model_type="llama", hidden_size=16384, intermediate_size=53248,
                    num_hidden_layers=126, num_attention_heads=128, num_key_value_heads=8,
                    vocab_size=128256, rope_theta=500000.0, tie_word_embeddings=False)
# TinyLlama-1.1B's shape, as benchmarks/gpu_mfu.py builds it
TINYLLAMA = dict(model_type="llama", hidden_size=2048, intermediate_size=5632,
                 num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4,
                 vocab_size=32000, tie_word_embeddings=False)


@dataclasses.dataclass(frozen=True)
class Run:
    """A published run: its model, GPUs, batch and what it measured."""
    name: str
    fields: dict
    hardware: str
    devices: int
    batch: int
    seq: int
    pinned: dict
    published: float
    unit: str  # "tokens/s per GPU", "TFLOP/s per GPU" or "MFU"
    source: str


RUNS = [
    Run("torchtitan Llama-3.1-8B, 8 H100 (FSDP 8)", LLAMA31_8B, "h100-96gb-500w", 8, 16, 8192,
        dict(fsdp_axis=8, micro_batch_size=2, remat="dots"), 5762, "tokens/s per GPU",
        "torchtitan benchmarks/llama3_h100_202412_torchtitan.md, table 1: FSDP, local "
        "batch 2, selective activation checkpointing, bf16, no torch.compile; Grand "
        "Teton H100 96 GB HBM2e at 500 W"),
    Run("MaxText Llama-2-7B, 8 H100 (FSDP 8)", LLAMA2_7B, "h100", 8, 32, 4096,
        dict(fsdp_axis=8, micro_batch_size=4, remat="dots"), 492, "TFLOP/s per GPU",
        "MaxText configs/gpu/a3/llama_2_7b (1vm.sh, its README: 492 TFLOP/s per GPU on "
        "one A3 VM); per-device batch 4, remat minimal_with_context, cuDNN flash "
        "attention, bf16"),
    Run("MaxText Llama-3.1-70B, 256 H200 (FSDP 256)", LLAMA31_70B, "h200", 256, 512, 8192,
        dict(fsdp_axis=256, micro_batch_size=2), 0.514, "MFU",
        "issue 63's figure: 51.4% MFU; configuration as NVIDIA's DGXC MaxText Llama3 "
        "70B recipe for 256 GPUs (dcn_fsdp 32 x ici_fsdp 8, per-device batch 2, "
        "8,192 tokens); remat not published: the planner's choice"),
    Run("redray TinyLlama-1.1B shape, 1 H200", TINYLLAMA, "h200", 1, 8, 2048,
        dict(micro_batch_size=8, remat="dots"), 64865, "tokens/s per GPU",
        "docs/performance/gpu-mfu.md: benchmarks/gpu_mfu.py on this project's H200, "
        "remat dots, batch 8 x 2048, bf16, cuDNN attention (44.3% MFU)"),
]


def flops_per_token(fields: dict, seq: int) -> float:
    """MaxText's count: 6 x the matmul parameters (the head's, not the embedding's) plus
    6 L H Q T for causal attention."""
    h, layers = fields["hidden_size"], fields["num_hidden_layers"]
    heads = fields["num_attention_heads"]
    dim = h // heads
    kv = fields["num_key_value_heads"]
    per_layer = h * (heads + 2 * kv) * dim + heads * dim * h + 3 * h * fields["intermediate_size"]
    params = layers * per_layer + h * fields["vocab_size"]
    return 6 * params + 6 * layers * heads * dim * seq


def predict(run: Run, own: bool = True) -> dict:
    """The planner pinned to ``run`` (and, with ``own``, its own pick for the same GPUs
    and batch), beside the published figure."""
    from redray.planning.from_config import choose_plan
    from redray.planning.hardware import preset

    hardware = preset(run.hardware)
    hosts = max(1, run.devices // hardware.devices_per_host)
    start = time.perf_counter()
    pinned = choose_plan(run.fields, run.devices, hosts, run.batch, run.seq, hardware,
                         compute_dtype="bfloat16", **run.pinned).best
    seconds = time.perf_counter() - start
    own = choose_plan(run.fields, run.devices, hosts, run.batch, run.seq, hardware,
                      compute_dtype="bfloat16").best if own else pinned
    per_gpu = pinned.tokens_per_s / run.devices
    flops = per_gpu * flops_per_token(run.fields, run.seq)
    value = {"tokens/s per GPU": per_gpu, "TFLOP/s per GPU": flops / 1e12,
             "MFU": flops / hardware.peak_flops}[run.unit]
    c = pinned.cost
    return {"run": run.name, "hardware": hardware.name, "plan": pinned.plan.brief(),
            "predicted": value, "published": run.published, "unit": run.unit,
            "ratio": value / run.published,
            "predicted_tokens_per_s_per_gpu": per_gpu,
            "step_s": c.seconds, "parts_s": {
                "compute": c.compute, "of_which_attention": c.attention,
                "of_which_memory_bound": c.memory, "update": c.update,
                "exposed_traffic": c.exposed, "traffic_before_overlap": c.gradients,
                "tensor": c.tensor, "micro_batches": c.overhead},
            "own_pick": own.plan.brief(),
            "own_pick_tokens_per_s_per_gpu": own.tokens_per_s / run.devices,
            "planning_s": seconds, "source": run.source}


def plan_16k(seq: int, batch: int) -> dict:
    """Planning LLaMA-3.1-405B's shape on 16,384 H100 in 2,048 hosts, timed: the pick, or
    why there is none."""
    from redray.planning.from_config import PlanError, choose_plan
    from redray.planning.hardware import preset

    start = time.perf_counter()
    try:
        ranking = choose_plan(LLAMA31_405B, 16384, 2048, batch, seq, preset("h100"),
                              compute_dtype="bfloat16", loss_chunk=8192)
        found = {"pick": ranking.best.plan.brief(), "mfu": ranking.best.mfu,
                 "plans_weighed": len(ranking.ranked) + len(ranking.over)}
    except PlanError as e:
        found = {"pick": None, "refused": str(e)}
    return {"seq": seq, "batch": batch, "seconds": time.perf_counter() - start, **found}


def main(argv=None) -> None:
    ap = parser(__doc__)
    args = ap.parse_args(argv)
    runs = RUNS[-1:] if args.tiny else RUNS
    rows = [predict(r) for r in runs]
    for r in rows:
        print(f"{r['run']:<46} {r['plan']:<42} predicted {r['predicted']:>10,.3f} "
              f"published {r['published']:>10,.3f} {r['unit']:<17} ratio {r['ratio']:.3f}  "
              f"own pick {r['own_pick']} ({r['own_pick_tokens_per_s_per_gpu']:,.0f} tokens/s "
              "per GPU)")
    worst = max(rows, key=lambda r: abs(r["ratio"] - 1))
    figures = [figure("planner/published_ratio_worst", worst["ratio"], "x",
                      f"predicted over published throughput, the farthest from 1 of "
                      f"{len(rows)} runs ({worst['run']})", "0.85-1.15", COMMAND, rows=rows)]
    if not args.tiny:
        at = [plan_16k(8192, 2048), plan_16k(131072, 128)]
        for a in at:
            print(f"16,384 H100, {a['batch']} x {a['seq']}: {a['seconds']:.1f} s, "
                  f"{a['pick'] or a['refused']}")
        planned = [a for a in at if a["pick"]]
        refused = [f"{a['batch']} x {a['seq']}" for a in at if not a["pick"]]
        figures.append(figure(
            "planner/seconds_16k", max(a["seconds"] for a in planned), "s",
            "planning a 405B-parameter LLaMA shape on 16,384 H100 in 2,048 hosts, the "
            "longest of " + ", ".join(f"{a['batch']} x {a['seq']}" for a in planned)
            + (f"; no plan found for {', '.join(refused)}" if refused else ""),
            "<= 60", COMMAND, runs=at))
    save(figures, args.out)


if __name__ == "__main__":
    main()
