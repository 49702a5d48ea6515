"""DeepSeek-V3 on 2,048 H800s, on paper: ``redray plan`` for DeepSeek-V3's own
configuration (the ``deepseek-v3`` preset: 671 B parameters, 61 layers, 256 routed
experts of which 8 a token and 1 shared) on 256 nodes of 8 H800s (the ``h800`` preset),
bf16, 3,840 sequences of 4,096 tokens a step, beside the published training cost.

Three plans, each the planner's fastest that fits 90% of the device's 80 GB:

* unpinned: every axis, micro-batch, remat policy and schedule the planner's;
* pinned: the nearest layout redray expresses to the published one (16 pipeline stages,
  expert parallelism as wide as redray's expert axis goes: 8, inside a node; the rest
  the planner's, between plain data parallelism and FSDP, redray's sharded-optimizer
  option);
* pinned, capacity factor 1: the same, each (device, expert) pair's slots cut to an even
  share of the assignments (tokens over it dropped, which DeepSeek-V3 does not do):
  what the expert exchange's fixed slots cost, set apart.

Published (the DeepSeek-V3 technical report, arXiv 2412.19437): 180K H800 GPU hours per
trillion tokens, so 1e12 / (180e3 x 3,600) = 1,543 tokens/s per GPU, 3.16M tokens/s on
2,048. Figures: ``planner/seconds_deepseek_v3_2048`` (planning the unpinned plan, timed:
target <= 60 s), ``planner/deepseek_v3_pick_over_published`` and
``planner/deepseek_v3_pinned_over_published`` (predicted tokens/s over the published
rate: a report, no target). ``--tiny``: the pinned plan only.

    python benchmarks/planner_deepseek.py
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import figure, parser, save  # noqa: E402

COMMAND = "python benchmarks/planner_deepseek.py"
DEVICES, HOSTS, BATCH, SEQ = 2048, 256, 3840, 4096
HARDWARE = "h800"
# the technical report's introduction: "180K H800 GPU hours" per trillion tokens, "3.7
# days on our cluster with 2048 H800 GPUs"
GPU_HOURS_PER_TRILLION = 180e3
PUBLISHED_PER_GPU = 1e12 / (GPU_HOURS_PER_TRILLION * 3600)
PUBLISHED_LAYOUT = ("16 pipeline stages (DualPipe), 64-way expert parallelism over 8 nodes, "
                    "ZeRO-1 data parallelism; FP8 matmuls; each token routed to at most 4 "
                    "nodes; no tensor parallelism, no token dropped")
PINNED = dict(stage_axis=16, expert_axis=8)
# what redray cannot express of the published run, said beside the pinned plan
CANNOT = ["DualPipe (its forward and backward chunks overlapping each other's all-to-alls): "
          "redray's schedules are GPipe and 1F1B, circular or not",
          "expert parallelism across nodes: redray's expert axis stays inside a node (8, "
          "not 64)",
          "ZeRO-1: redray shards the optimizer state with the parameters (FSDP, ZeRO-3, "
          "gathered every micro-batch) or not at all (data)",
          "a dropless exchange sized to the tokens routed: redray's has fixed slots per "
          "(device, expert), every token's worth without a capacity factor (experts / "
          "top_k = 32 times the assignments' bytes)",
          "node-limited routing (each token to at most 4 nodes)",
          "FP8 training: planned in bf16, the matmuls at the bf16 rate",
          "multi-token prediction (the preset's one MTP layer is left out, as redray "
          "loads it)"]


def plan(label: str, pins: dict, fields: dict | None = None) -> dict:
    """The planner's pick for DeepSeek-V3 on the cluster with ``pins`` (and ``fields``
    over the preset's), timed, as a JSON-ready row."""
    from redray.planning.from_config import choose_plan, preset_fields
    from redray.planning.hardware import preset
    from redray.planning.planner import network_levels

    hardware = preset(HARDWARE)
    config = {**preset_fields("deepseek-v3"), **(fields or {})}
    start = time.perf_counter()
    ranking = choose_plan(config, DEVICES, HOSTS, BATCH, SEQ, hardware,
                          compute_dtype="bfloat16", **pins)
    seconds = time.perf_counter() - start
    best, c = ranking.best, ranking.best.cost
    return {
        "label": label, "pinned": pins, "fields": fields or {}, "plan": best.plan.brief(),
        "planning_s": seconds, "plans_weighed": len(ranking.ranked) + len(ranking.over),
        "tokens_per_s": best.tokens_per_s, "tokens_per_s_per_gpu": best.tokens_per_s / DEVICES,
        "mfu": best.mfu, "step_s": c.seconds,
        # the MFU at the published rate, on the planner's count of the useful FLOPs
        "published_mfu": best.mfu * PUBLISHED_PER_GPU * DEVICES / best.tokens_per_s,
        "memory_gib": best.memory["total"] / (1 << 30),
        "memory_parts_gib": {k: v / (1 << 30) for k, v in best.memory["parts"].items() if v},
        "parts_s": {"compute": c.compute, "of_which_attention": c.attention,
                    "of_which_memory_bound": c.memory, "tensor": c.tensor,
                    "exposed_traffic": c.exposed, "traffic_before_overlap": c.gradients,
                    "experts": c.experts, "pipeline": c.pipeline, "update": c.update,
                    "micro_batches": c.overhead},
        "network": [{k: row[k] for k in ("level", "axes", "bytes", "seconds")}
                    for row in network_levels(best.plan.shape, HOSTS, hardware, c)],
        "why": ranking.why()}


def main(argv=None) -> None:
    args = parser(__doc__).parse_args(argv)
    published = PUBLISHED_PER_GPU * DEVICES
    rows = [] if args.tiny else [plan("unpinned", {})]
    rows += [plan("pinned", PINNED)]
    if not args.tiny:
        rows.append(plan("pinned, capacity factor 1", PINNED, {"capacity_factor": 1.0}))
    for r in rows:
        print(f"{r['label']:<26} {r['plan']:<72} {r['tokens_per_s']:>12,.0f} tokens/s "
              f"({r['tokens_per_s'] / published:.3f} of published) MFU {r['mfu']:.1%} "
              f"{r['memory_gib']:.1f} GiB, planned in {r['planning_s']:.1f} s")
    print(f"published: {published:,.0f} tokens/s ({PUBLISHED_PER_GPU:,.0f} per GPU; "
          f"MFU {rows[-1]['published_mfu']:.1%} on the planner's count)")
    source = (f"DeepSeek-V3 technical report (arXiv 2412.19437): 180K H800 GPU hours per "
              f"trillion tokens = {published:,.0f} tokens/s on {DEVICES}; {PUBLISHED_LAYOUT}")
    context = dict(published_tokens_per_s=published, published_per_gpu=PUBLISHED_PER_GPU,
                   source=source, cannot_express=CANNOT, batch=BATCH, seq=SEQ,
                   hardware=HARDWARE)
    by = {r["label"]: r for r in rows}
    figures = []
    if not args.tiny:
        figures += [
            figure("planner/seconds_deepseek_v3_2048", by["unpinned"]["planning_s"], "s",
                   f"planning DeepSeek-V3 (deepseek-v3 preset) on {DEVICES} H800 in {HOSTS} "
                   f"hosts, batch {BATCH} x {SEQ}, bf16, unpinned "
                   f"({by['unpinned']['plans_weighed']} plans weighed)", "<= 60", COMMAND,
                   command_line=f"redray plan deepseek-v3 --devices {DEVICES} --hardware "
                                f"{HARDWARE} --batch-size {BATCH} --seq-len {SEQ} "
                                "--compute-dtype bfloat16"),
            figure("planner/deepseek_v3_pick_over_published",
                   by["unpinned"]["tokens_per_s"] / published, "x",
                   f"the planner's own pick's predicted tokens/s over DeepSeek's published "
                   f"{published / 1e6:.2f}M tokens/s ({by['unpinned']['plan']}; a report, "
                   "see BENCHMARKS.md)", None, COMMAND, rows=rows, **context)]
    figures.append(figure(
        "planner/deepseek_v3_pinned_over_published", by["pinned"]["tokens_per_s"] / published,
        "x", f"the plan pinned nearest the published layout ({by['pinned']['plan']}): "
        f"predicted tokens/s over DeepSeek's published {published / 1e6:.2f}M tokens/s (a "
        "report, see BENCHMARKS.md)", None, COMMAND, rows=rows, **context))
    save(figures, args.out)


if __name__ == "__main__":
    main()
