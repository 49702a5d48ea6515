"""``redray plan``: a model's placement on a plan, or the planner's ranked plans, without
devices (``redray.planning.from_config``)."""

from __future__ import annotations

import argparse
import json
import os

from redray.commands import UsageError, command


def add(sub) -> None:
    from redray.sharding.parallelism import AXES, PARAMETER_AXES

    p = command(sub, "plan", "show how a model would be sharded, without devices",
                 "Builds the model abstractly, applies the automatic sharding rules on a "
                 f"({', '.join(a.name for a in AXES)}) mesh and prints the parameter and "
                 "Adam-state bytes per device beside the ideal total / "
                 f"({' x '.join(a.name for a in PARAMETER_AXES)}).",
                 "examples:\n  redray plan llama-7b --devices 8 --model-axis 8\n"
                 "  redray plan llama-7b --devices 8 --model-axis 8 --batch-size 16 "
                 "--seq-len 2048 --remat full --compute-dtype bfloat16 --device-memory 80\n"
                 "  redray plan path/to/config.json --devices 16 --model-axis 4 --fsdp-axis 4\n"
                 "  redray plan llama-7b --devices 64 --hosts 8 --batch-size 256 --seq-len "
                 "4096 --compute-dtype bfloat16 --hardware h100+ethernet\n"
                 "  redray plan llama-3-8b --devices 32 --slices 2 --hardware tpu-v5p "
                 "--batch-size 256 --seq-len 4096 --compute-dtype bfloat16")
    p.add_argument("config", metavar="PRESET_OR_CONFIG",
                   help=f"a preset ({', '.join(preset_names())}) or the path of a Hugging "
                        "Face config.json")
    p.add_argument("--devices", type=int, required=True, help="number of devices")
    for axis in reversed(AXES):  # the data axis takes what the others leave
        if axis.default != "auto":
            p.add_argument(f"--{axis.keyword.replace('_', '-')}", type=int, default=None,
                           help=f"{axis.doc}: its size (given alone: that plan's placement, "
                                f"the others {axis.default}; with --hosts or --hardware, or "
                                "none given: the planner chooses the rest)")
    p.add_argument("--scan", action=argparse.BooleanOptionalAction, default=None,
                   help="the model's layers stacked and scanned, so the planner tries "
                        "pipeline stages too (the default, where the config allows it); "
                        "--no-scan: a list of layers, as build(config, scan=False)")
    p.add_argument("--hosts", type=int, default=None,
                   help="the planner: hosts the devices are in (default: devices / a host's "
                        "devices of --hardware)")
    p.add_argument("--hardware", default=None,
                   help="the planner: a preset the plans are costed on: h100, "
                        "h800, h100-96gb-500w, h200, a100, l4, tpu-v5e, tpu-v5p, tpu-v6e "
                        "(Trillium) or cpu, '+ethernet' for hosts joined by 100 Gb/s "
                        "Ethernet (default h100)")
    p.add_argument("--slices", type=int, default=1,
                   help="the planner: TPU slices the devices are in, joined by the "
                        "data-centre network (multislice; default 1): each holds devices / "
                        "slices of them, whole hosts; the data axis crosses them first")
    memory = p.add_argument_group(
        "one training step's memory per device (gradients, compute-dtype copies, FSDP "
        "gather buffers, activations): give --batch-size and --seq-len")
    memory.add_argument("--batch-size", type=int, help="examples per update, all devices")
    memory.add_argument("--micro-batch-size", type=int,
                        help="examples per forward/backward pass (gradient accumulation)")
    memory.add_argument("--seq-len", type=int, help="tokens per example")
    memory.add_argument("--remat", default=None, choices=("none", "full", "dots", "offload"),
                        help="the models' remat policy (default none; the planner chooses)")
    memory.add_argument("--compute-dtype", default=None,
                        help="e.g. bfloat16: the model built in it and its parameters cast "
                             "to it for the step (default: float32)")
    memory.add_argument("--loss-chunk", type=int, default=None,
                        help="tokens whose logits exist at once (next_token_loss(chunk=))")
    memory.add_argument("--device-memory", type=float, default=None, metavar="GIB",
                        help="say whether the step fits on a device of this many GiB")
    pins = p.add_argument_group(
        "the planner: the rest of a layout, pinned (each kept as given; the planner "
        "chooses what is not)")
    pins.add_argument("--pipeline-schedule", choices=("gpipe", "1f1b"), default=None,
                      help="on a stage axis: GPipe or 1F1B (default: both tried)")
    pins.add_argument("--stage-repeats", type=int, default=None, metavar="R",
                      help="on a stage axis: each stage's chunks of layers (circular GPipe, "
                           "interleaved 1F1B: R virtual stages a device; 1: none; default: "
                           "every count up to 8 tried)")
    pins.add_argument("--context-attention", choices=("auto", "ring", "all_gather"),
                      default=None,
                      help="on a context axis: how attention crosses it (ring, or the keys "
                           "and values all-gathered with the queries local; default auto)")
    p.add_argument("--explain", action="store_true",
                   help="the planner: take the pick (the pinned plan, where every part is "
                        "pinned) apart: compute by kind, the pipeline's bubble, every "
                        "collective by axis and link and what of it is hidden, memory by "
                        "part")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(run_command=_plan)



def preset_names() -> list[str]:
    """The shipped presets of ``redray plan`` (redray/models/presets), read without
    importing the models (which would import JAX)."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    folder = os.path.join(package, "models", "presets")
    return sorted(n[:-len(".json")] for n in os.listdir(folder) if n.endswith(".json"))


def _plan(args) -> int:
    from redray.planning.from_config import format_model_plan, load_fields, plan_model
    from redray.sharding.parallelism import AXES

    from redray.planning.memory import StepShape

    name, fields = load_fields(args.config)
    sizes = {a.keyword: getattr(args, a.keyword) for a in AXES if a.default != "auto"}
    chosen = (args.pipeline_schedule, args.stage_repeats, args.context_attention)
    if args.hosts is not None or args.hardware is not None or args.slices != 1 or all(
            v is None for v in sizes.values()) or args.explain or \
            any(v is not None for v in chosen):
        return _choose(args, name, fields, {k: v for k, v in sizes.items() if v is not None})
    sizes = {a.keyword: a.default if sizes[a.keyword] is None else sizes[a.keyword]
             for a in AXES if a.keyword in sizes}
    step = None
    if args.batch_size is not None or args.seq_len is not None:
        if args.batch_size is None or args.seq_len is None:
            raise UsageError("the step's memory needs both --batch-size and --seq-len")
        try:
            step = StepShape(batch_size=args.batch_size, seq_len=args.seq_len,
                             remat=args.remat or "none", compute_dtype=args.compute_dtype,
                             loss_chunk=args.loss_chunk, micro_batch_size=args.micro_batch_size)
        except ValueError as e:
            raise UsageError(str(e)) from None
    elif args.device_memory is not None:
        raise UsageError("--device-memory needs the step's shape: give --batch-size and "
                         "--seq-len too")
    result = plan_model(fields, args.devices, step=step, device_gib=args.device_memory,
                        scan=args.scan, **sizes)
    if args.json:
        print(json.dumps({"config": name, **result, "plan": _given_plan(args, sizes)},
                         indent=2))
    else:
        print(format_model_plan(result, name))
    return 0


def _given_plan(args, sizes: dict) -> dict:
    """The plan of ``redray plan``'s axis sizes (and its batch, where given) written out:
    what ``plan=`` takes."""
    from redray.sharding import Parallelism, Plan

    par = Parallelism.of(**sizes).abstract(args.devices)
    if args.batch_size is None:
        return Plan(par, remat=args.remat).to_dict()
    try:
        return Plan.of(par, par.step_geometry(args.batch_size, args.micro_batch_size),
                       remat=args.remat).to_dict()
    except ValueError as e:
        raise UsageError(str(e)) from None


def _choose(args, name: str, fields: dict, pinned: dict) -> int:
    """``redray plan`` without every axis size: the planner's ranked plans."""
    import dataclasses

    from redray.planning import resolve_hardware
    from redray.planning.from_config import choose_plan

    if args.batch_size is None or args.seq_len is None:
        raise UsageError("choosing a plan needs the step: give --batch-size and --seq-len "
                         "(or --model-axis, without --hosts or --hardware, for one plan's "
                         "placement)")
    try:
        hardware = resolve_hardware(args.hardware or "h100")
    except ValueError as e:
        raise UsageError(str(e)) from None
    if args.device_memory is not None:
        hardware = dataclasses.replace(hardware, device_memory=args.device_memory * (1 << 30))
    hardware, hosts = _in_slices(args, hardware)
    ranking = choose_plan(fields, args.devices, hosts, args.batch_size, args.seq_len, hardware,
                          compute_dtype=args.compute_dtype, loss_chunk=args.loss_chunk,
                          micro_rows=args.micro_batch_size, remat=args.remat, scan=args.scan,
                          pipeline_schedule=args.pipeline_schedule,
                          stage_repeats=args.stage_repeats,
                          context_attention=args.context_attention, **pinned)
    if args.json:
        print(json.dumps({"config": name, "hardware": hardware.describe(), "hosts": hosts,
                          "slices": args.slices,
                          "plans": [_scored_json(s, hardware, hosts) for s in ranking.ranked],
                          "over_budget": len(ranking.over)}, indent=2))
        return 0
    slices = f" in {args.slices} slices" if args.slices > 1 else ""
    print(f"{name}: {args.devices} devices in {hosts} host(s){slices}, {hardware.name} "
          f"({hardware.source})")
    print(f"batch {args.batch_size} x {args.seq_len} tokens")
    print(ranking.why())
    if args.explain:
        from redray.planning.explain import breakdown

        print(breakdown(ranking.best, hosts, hardware, ranking.budget,
                        ranking.layers))
    print(ranking.explain(memory=not args.explain))
    print()
    print(ranking.table())
    return 0


def _in_slices(args, hardware):
    """(``hardware`` as ``--slices`` slices of the devices, the hosts they are in):
    ``--hosts``, or the devices over a host's devices."""
    try:
        hardware = hardware.in_slices(args.slices, args.devices)
    except ValueError as e:
        raise UsageError(f"--slices {args.slices}: {e}") from None
    hosts = args.hosts or max(1, args.devices // hardware.devices_per_host)
    if hosts % args.slices:
        raise UsageError(f"--hosts {hosts} do not make {args.slices} slices of whole hosts: "
                         f"give a multiple of {args.slices}")
    return hardware, hosts


def _scored_json(s, hardware, hosts: int) -> dict:
    """A ranked plan: ``plan`` written out (what ``plan=`` takes), its axes, its
    predicted step by part, its memory per device by part, its traffic per level of
    the network."""
    import dataclasses

    from redray.planning.planner import network_levels

    c = s.cost
    plan = dataclasses.replace(s.plan, hardware=hardware.to_dict())
    return {"plan": plan.to_dict(), "axes": s.plan.shape,
            "micro_batch_size": s.plan.geometry.micro_batch_size,
            "remat": s.plan.remat, "accumulation": s.accumulation,
            "pipeline_schedule": s.plan.pipeline_schedule,
            "stage_repeats": s.plan.stage_repeats,
            "step_seconds": c.seconds, "compute_seconds": c.compute,
            "attention_seconds": c.attention, "memory_bound_seconds": c.memory,
            "update_seconds": c.update, "pipeline_seconds": c.pipeline,
            "tensor_seconds": c.tensor, "gradient_seconds": c.gradients,
            "exposed_gradient_seconds": c.exposed, "tokens_per_s": s.tokens_per_s,
            "mfu": s.mfu, "memory_bytes": s.memory["total"],
            "memory_parts": s.memory["parts"],
            "network": network_levels(s.plan.shape, hosts, hardware, c)}
