"""One predicted step taken apart (``redray plan --explain``): the compute by kind, the
pipeline's bubble by schedule, every collective by axis and by the link it crosses with
what of it the compute hides, and the memory per device by part against the budget.

Each figure is the cost model's own (``redray.planning.cost.step_cost``): the parts
add up to the step the planner ranked the plan by."""

from __future__ import annotations

import math

from redray.planning.cost import LEVELS, host_spans, traffic_seconds, _group
from redray.planning.memory import part_lines, size_text
from redray.sharding.parallelism import role_size


def _ms(seconds: float) -> str:
    return f"{seconds:,.3f} s"


def _level(inside: int, across: int, slices: int, hardware) -> str:
    """The outermost level of the network a group of ``inside`` devices of a host times
    ``across`` hosts times ``slices`` slices crosses, with its link."""
    if slices > 1:
        link, name = hardware.across_slices, f"{LEVELS[2]} ({slices})"
    elif across > 1:
        link, name = hardware.inter, f"{across} hosts"
    else:
        link, name = hardware.intra, "inside a host"
    return f"{name} @ {link.bandwidth / 1e9:g} GB/s"


def schedule_lines(plan, facts_layers: int) -> list[str]:
    """The pipeline's schedule, micro-batches, virtual stages, ticks and bubble of
    ``plan`` (nothing without a stage axis)."""
    from redray.planning.planner import _ticks

    stages = role_size(plan.parallelism.shape, "layers")
    if stages <= 1:
        return []
    micro, repeats = plan.geometry.accumulation, plan.stage_repeats
    one_f_one_b = plan.pipeline_schedule == "1f1b"
    passes = _ticks(stages, micro, repeats, one_f_one_b)  # what the cost model charged
    name = (("interleaved 1F1B" if repeats > 1 else "1F1B") if one_f_one_b
            else ("GPipe, circular" if repeats > 1 else "GPipe"))
    work = micro * repeats
    lines = [f"pipeline: {name}, {stages} stages x {repeats} chunk(s) each ({stages * repeats} "
             f"virtual stages, {facts_layers} stacked layers), {micro} micro-batches of "
             f"{plan.geometry.micro_batch_size} example(s) a device: {passes:g} chunk passes "
             f"for {work} of work, a bubble of {passes / work - 1:.1%} of the layers' time "
             f"(Megatron-LM's (S - 1) / (M R) = {(stages - 1) / work:.1%})"]
    if plan.stage_recompute:
        lines.append("  1F1B's backward recomputes each chunk's forward from the input it kept "
                     "(a third more of the layers' work, as full activation checkpointing "
                     "costs; one chunk's activations at a time)")
    elif plan.pipeline_schedule == "1f1b":
        from redray.sharding.pipeline_schedules import one_f_one_b_table

        kept = one_f_one_b_table(stages, micro, repeats).kept_slots
        lines.append("  1F1B keeps each chunk's activations (what its remat policy saves) from "
                     f"its forward to its backward: {kept} chunk passes of them at once "
                     "on the first stage")
    return lines


def breakdown(scored, hosts: int, hardware, budget: float, layers: int = 0) -> str:
    """``scored`` (a ``planner.Scored``) taken apart, one part per line (see the module
    docstring)."""
    plan, c = scored.plan, scored.cost
    shape = plan.parallelism.shape
    devices = math.prod(shape.values())
    lines = [f"{plan.brief()} on {devices:,} {hardware.name} in {hosts:,} host(s)",
             f"step {_ms(c.seconds)} predicted: {scored.tokens_per_s:,.0f} tokens/s "
             f"({scored.tokens_per_s / devices:,.1f} a device), MFU {scored.mfu:.1%}"]
    matmul = c.compute - c.attention - c.memory
    lines.append(f"compute {_ms(c.compute)}: matmuls {_ms(matmul)} (at "
                 f"{hardware.matmul_flops / 1e12:g} TFLOP/s), attention {_ms(c.attention)}"
                 + (f" (fused kernel at {hardware.attention_rate / 1e12:g} TFLOP/s)"
                    if hardware.fused_attention else "")
                 + f", memory-bound {_ms(c.memory)}; the optimizer's update {_ms(c.update)}, "
                   f"the micro-batches' own cost {_ms(c.overhead)}")
    lines += schedule_lines(plan, layers)
    lines.append(f"on the critical path: tensor-parallel all-reduces {_ms(c.tensor)}, pipeline "
                 f"passes {_ms(c.pipeline)}, expert exchanges {_ms(c.experts)}")
    hidden = c.gradients + c.context
    lines.append(f"overlapped with the compute: FSDP, data-parallel and context traffic "
                 f"{_ms(hidden)} before overlap, {_ms(c.exposed)} exposed "
                 f"({_ms(max(0.0, hidden - c.exposed))} hidden)")
    slices = hardware.slices(devices)
    spans = host_spans(shape, hosts, slices)
    lines.append("collectives of a step, by what they carry (buffer bytes times runs; seconds "
                 "before overlap):")
    lines.append(f"  {'what':<62} {'kind':<18} {'axes':<16} {'link':<30} {'a step':>11} "
                 f"{'runs':>7} {'seconds':>10}")
    rows: dict = {}
    for t in c.traffic:
        key = (t.what, t.kind, t.axes, _level(*_group(t, spans), hardware), t.critical)
        sent, runs, sec = rows.get(key, (0.0, 0.0, 0.0))
        rows[key] = (sent + t.bytes * t.times, runs + t.times,
                     sec + traffic_seconds(t, spans, hardware))
    for (what, kind, axes, link, critical), (sent, runs, sec) in sorted(
            rows.items(), key=lambda kv: -kv[1][2]):
        mark = " *" if critical else ""
        lines.append(f"  {what[:62]:<62} {kind:<18} {' x '.join(axes):<16} {link:<30} "
                     f"{size_text(sent):>11} {runs:>7,.0f} {sec:>9.3f}s{mark}")
    lines.append("  (* on the critical path; the rest overlaps the layers' compute as "
                 "XLA's latency-hiding scheduler can run it)")
    lines.append(f"memory per device (budget {size_text(budget)}):")
    lines += part_lines(scored.memory, shape)
    return "\n".join(lines)
