"""How a model would be sharded on a mesh, without a device or a single allocation.

``plan_model(config, devices, model_axis, fsdp_axis)`` builds the model abstractly
(``nnx.eval_shape``: ShapeDtypeStructs only), traces its forward pass on abstract
inputs, applies the automatic rules (the parallelism plan's spec passes) on an
abstract plan of the requested sizes (``Parallelism.abstract``), and reports what each
device holds: parameters and Adam state (two float32 moments that follow their
parameter's spec), beside the ideal: the total over the axes that split parameters
(``PARAMETER_AXES``). The data axis replicates by design, so it is not part of it.

Named presets (``presets()``) are the Hugging Face ``config.json`` of well-known models,
shipped in ``redray/models/presets``.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import json
import math
import os

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from redray.planning.memory import StepShape, _fresh_state, step_memory
from redray.planning.memory import part_lines, size_text
from redray.planning.planner import ModelFacts, stacked_layers
from redray.sharding import AXES, PARAMETER_AXES, Parallelism, follow_specs, placement
from redray.sharding.parallelism import describe_shape, role_keywords, role_size
from redray.sharding.rules import axes_of

PRESET_DIR = "presets"
# Parameters smaller than this (norm scales, biases) are counted, not listed, when
# they are left replicated.
REPLICATED_MIN_BYTES = 1 << 20


class PlanError(ValueError):
    """A request that cannot be planned; the message says what to change."""


def presets() -> list[str]:
    """Names of the shipped presets (e.g. ``llama-7b``)."""
    root = importlib.resources.files("redray.models").joinpath(PRESET_DIR)
    return sorted(p.name[:-len(".json")] for p in root.iterdir() if p.name.endswith(".json"))


def preset_fields(name: str) -> dict:
    """The config.json fields of a shipped preset."""
    names = presets()
    if name not in names:
        raise PlanError(f"unknown preset {name!r}: choose one of {', '.join(names)}, "
                        "or give the path of a config.json")
    root = importlib.resources.files("redray.models").joinpath(PRESET_DIR)
    return json.loads(root.joinpath(f"{name}.json").read_text())


def load_fields(preset_or_path: str) -> tuple[str, dict]:
    """(display name, config.json fields) of a preset name or a config path.

    A path may be a config.json file or a folder holding one.
    """
    looks_like_path = (os.sep in preset_or_path or preset_or_path.endswith(".json")
                       or os.path.exists(preset_or_path))
    if not looks_like_path:
        return preset_or_path, preset_fields(preset_or_path)
    path = preset_or_path
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.isfile(path):
        raise PlanError(f"no such config file: {path!r} (give a config.json path, a folder "
                        f"holding one, or a preset: {', '.join(presets())})")
    try:
        with open(path) as f:
            fields = json.load(f)
    except json.JSONDecodeError as e:
        raise PlanError(f"{path!r} is not valid JSON ({e})") from None
    if not isinstance(fields, dict):
        raise PlanError(f"{path!r} does not hold a JSON object (a Hugging Face config.json)")
    return path, fields


def make_config(fields: dict):
    """A ``transformers`` config from config.json fields (``model_type`` required)."""
    from transformers import AutoConfig

    from redray.models.families import lookup, supported

    model_type = fields.get("model_type")
    if model_type is None:
        raise PlanError("the config has no 'model_type' field: it must be a Hugging Face "
                        f"config.json (model_type one of {', '.join(supported())})")
    try:
        lookup(model_type)
    except ValueError as e:
        raise PlanError(str(e)) from None
    rest = {k: v for k, v in fields.items() if k != "model_type"}
    try:
        return AutoConfig.for_model(model_type, **rest)
    except Exception as e:  # noqa: BLE001 -- transformers validates the fields its own way
        cause = e.__cause__ or e
        raise PlanError(f"invalid {model_type} config: "
                        f"{' '.join(str(cause).split())}") from None


def resolve_config(config):
    """A ``transformers`` config from a config object, a fields dict, a preset or a path."""
    if isinstance(config, str):
        config = load_fields(config)[1]
    if isinstance(config, dict):
        return make_config(config)
    return config


def plan_parallelism(devices: int, rules=(), **sizes) -> Parallelism:
    """The abstract plan on ``devices`` of the axis sizes given by keyword
    (``model_axis=8``...); the data axis takes what the others leave of the devices."""
    given = [(a, sizes.get(a.keyword, a.default)) for a in reversed(AXES)
             if a.default != "auto"]
    for name, value in (("devices", devices),
                        *((f"{a.name} axis", size) for a, size in given)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise PlanError(f"{name} must be a positive integer, got {value!r}")
    per_replica = math.prod(size for _, size in given)
    if devices % per_replica:
        lower = devices // per_replica * per_replica
        near = [d for d in (lower, lower + per_replica) if d > 0]
        raise PlanError(
            f"{' x '.join(f'{a.name} axis {size}' for a, size in given)} = {per_replica} does "
            f"not divide {devices} devices: use a device count that is a multiple of "
            f"{per_replica} (e.g. {' or '.join(str(d) for d in sorted(near))}), or axis "
            f"sizes whose product divides {devices}")
    return Parallelism.of(rules=rules, caller="redray plan", **sizes).abstract(devices)


def abstract_model(config, dtype=jnp.float32, scan: bool | None = None):
    """(family module, graphdef, abstract params, abstract extra) without allocating;
    ``scan``: the layers stacked and scanned (None: as ``build`` does by default)."""
    from flax import nnx

    from redray.models.families import lookup
    from redray.rngs import rngs as fast_rngs

    try:
        record = lookup(config.model_type)
        fam = record.code
    except ValueError as e:
        raise PlanError(str(e)) from None
    except ModuleNotFoundError as e:
        if e.name != f"redray.models.{record.module}":
            raise
        raise PlanError(f"model_type {config.model_type!r} needs {e.name}, which this "
                        "install does not have") from None
    abstract = nnx.eval_shape(lambda: fam.Model(config, rngs=fast_rngs(0), dtype=dtype,
                                                scan=scan))
    graphdef, params, extra = nnx.split(abstract, nnx.Param, ...)
    return fam, graphdef, params, extra


# Axes that split some parameters by design (a mixture of experts' experts, the stacked
# layers): the others stay whole over them.
SOME_PARAMETERS = tuple(a for a in AXES if {"experts", "layers"} & set(a.roles))


def _spec_leaves(specs) -> list[P]:
    return jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))


def _axes(spec: P) -> set[str]:
    return {axis for entry in spec for axis in axes_of(entry)}


def _replicated_axes(spec: P, mesh_shape: dict) -> list[str]:
    """The axes meant to split parameters that ``spec`` leaves it whole over (the
    expert axis splits a mixture of experts' experts only, the stage axis the stacked
    layers only: not listed)."""
    used = _axes(spec)
    return [a.name for a in PARAMETER_AXES if mesh_shape[a.name] > 1 and a.name not in used
            and a not in SOME_PARAMETERS]


def _placed(fam, config, graphdef, params, extra, parallelism: Parallelism, whole: list,
            stacked: dict) -> tuple[list, list]:
    """The ``Placement`` rows of the parameters and of Adam's state on the plan (the
    rules' ``whole`` layers and ``stacked`` arrays filed as ``model_specs`` files
    them)."""
    import optax

    from redray.sharding.on_mesh import model_specs

    param_specs, _ = model_specs(graphdef, (params, extra), parallelism,
                                 fam.trace_inputs(config), whole, stacked)
    opt_abs = jax.eval_shape(optax.adam(1e-3).init, params)
    opt_specs = follow_specs(opt_abs, params, param_specs)
    return (placement(params, param_specs, parallelism.mesh),
            placement(opt_abs, opt_specs, parallelism.mesh))


def _ideal_bytes(rows, sizes: dict) -> float:
    """Bytes per device of ``rows`` were each split over every parameter axis (the
    expert and stage axes split some parameters by design: those only)."""
    return sum(math.prod(r.shape) * jnp.dtype(r.dtype).itemsize
               / math.prod(sizes[a.name] for a in PARAMETER_AXES
                           if a not in SOME_PARAMETERS or a.name in _axes(r.spec))
               for r in rows)


def _replicated(param_rows, shape: dict, stacked: dict, why: dict,
                min_bytes: int) -> tuple[list[dict], int]:
    """(the parameters of ``min_bytes`` or more left whole over a parameter axis, the
    largest first, with why and the fix where known; how many smaller ones were left
    out of that list), ``plan_model``'s ``replicated`` and ``replicated_omitted``."""
    replicated, omitted = [], 0
    for row in param_rows:
        axes = _replicated_axes(row.spec, shape)
        if not axes:
            continue
        # a scanned layers' array is one per layer: each layer's is what the size is of
        layers = stacked.get(row.path, 1)
        full = math.prod(row.shape) * jnp.dtype(row.dtype).itemsize
        if full / layers < min_bytes:
            omitted += layers
            continue
        w = why.get(row.path)
        replicated.append({"path": row.path, "shape": list(row.shape),
                           "spec": [e if not isinstance(e, tuple) else list(e) for e in row.spec],
                           "bytes_per_device": row.bytes_per_device,
                           "replicated_over": axes,
                           "why": w.reason if w else None, "fix": w.fix if w else None})
    replicated.sort(key=lambda r: -r["bytes_per_device"])
    return replicated, omitted


def plan_model(config, devices: int, model_axis: int = 1, fsdp_axis: int = 1, *, rules=(),
               replicated_min_bytes: int = REPLICATED_MIN_BYTES, step: StepShape | None = None,
               device_gib: float | None = None, scan: bool | None = None, **axes) -> dict:
    """What each device holds when ``config``'s model is sharded by the automatic rules.

    Args:
      config: a ``transformers`` config, a dict of config.json fields, a preset name or
        a config.json path.
      devices: the device count; the data axis takes what the other axes leave.
      model_axis, fsdp_axis: tensor-parallel and ZeRO-3 axis sizes.
      rules: (regex, PartitionSpec) overrides, as for ``Trainer``.
      replicated_min_bytes: parameters left replicated that are smaller than this are
        counted in ``replicated_omitted`` instead of listed (a scanned layers' array
        counts as one parameter per layer, each of its layer's size).
      step: a ``redray.planning.memory.StepShape`` (batch, sequence, remat policy,
        compute dtype): the result gets ``memory``, what one training step holds per
        device (``redray.planning.memory.step_memory``).
      device_gib: with ``step``, the device memory to check the step against.
      scan: the model's layers stacked and scanned (None: as ``build`` builds them by
        default; always with a stage axis).
      **axes: the size of any other axis of ``redray.sharding.AXES``, by its keyword.

    Returns:
      A JSON-ready dict: ``n_params``, ``active_params`` (what one token runs through:
      ``n_params`` less each mixture-of-experts layer's experts it does not use),
      ``devices``, ``mesh`` (every axis's size),
      ``param_bytes_per_device``, ``opt_bytes_per_device``, ``ideal_bytes_per_device``
      (parameters + Adam state, total / (model x fsdp)) and its two parts
      ``ideal_param_bytes_per_device`` / ``ideal_opt_bytes_per_device``, ``ratio``
      ({params, opt}: actual / ideal), ``replicated`` (parameters not split over every
      axis of model x fsdp: path, shape, spec, bytes_per_device, replicated_over, and
      for a layer parameter left whole over model ``why`` and ``fix``, else None) and
      ``replicated_omitted`` (how many smaller ones were left out of that list); with
      ``step``, ``memory``.

    Raises:
      PlanError: axis sizes that do not divide the devices, an unsupported model type.
    """
    from flax import nnx

    from redray.planning.memory import expert_layers

    parallelism = plan_parallelism(devices, rules, model_axis=model_axis, fsdp_axis=fsdp_axis,
                                   **axes)
    sizes, mesh = parallelism.shape, parallelism.mesh
    config = resolve_config(config)
    if scan is None and role_size(sizes, "layers") > 1:
        scan = True  # stages split the stacked layers
    if step is not None and step.scan is None:
        step = dataclasses.replace(step, scan=scan)
    if step is None and device_gib is not None:
        raise PlanError("device_gib needs the step's shape: give the batch size and sequence "
                        "length (redray plan --batch-size B --seq-len T)")
    fam, graphdef, params, extra = abstract_model(config, scan=scan)
    whole: list = []
    stacked: dict = {}  # "/"-joined path of a scanned layers' array -> its layers
    param_rows, opt_rows = _placed(fam, config, graphdef, params, extra, parallelism, whole,
                                   stacked)
    experts = expert_layers(nnx.merge(graphdef, params, extra))
    replicated = _replicated(param_rows, dict(mesh.shape), stacked, {w.path: w for w in whole},
                             replicated_min_bytes)
    memory = None
    if step is not None:
        try:
            memory = step_memory(fam, config, param_rows,
                                 int(sum(r.bytes_per_device for r in opt_rows)), parallelism,
                                 step, device_gib, experts=experts)
        except ValueError as e:
            raise PlanError(str(e)) from None
    return _result(config.model_type, devices, sizes, param_rows, opt_rows, experts,
                   replicated, replicated_min_bytes, memory)


def _result(model_type: str, devices: int, sizes: dict, param_rows, opt_rows, experts,
            replicated: tuple[list[dict], int], min_bytes: int, memory: dict | None) -> dict:
    """``plan_model``'s JSON-ready result (see there) from what it found."""
    actual = {"params": sum(r.bytes_per_device for r in param_rows),
              "opt": sum(r.bytes_per_device for r in opt_rows)}
    ideal = {"params": _ideal_bytes(param_rows, sizes), "opt": _ideal_bytes(opt_rows, sizes)}
    n_params = sum(math.prod(r.shape) for r in param_rows)
    # a token runs top_k of each layer's experts: the rest of their parameters idle
    idle = sum(e.layers * (e.experts - e.top_k) * 3 * e.hidden * e.inner for e in experts)
    return {
        "model_type": model_type,
        "n_params": int(n_params),
        "active_params": int(n_params - idle),
        "devices": devices,
        "mesh": sizes,
        "param_bytes_per_device": int(actual["params"]),
        "opt_bytes_per_device": int(actual["opt"]),
        "ideal_bytes_per_device": int(math.ceil(ideal["params"] + ideal["opt"])),
        "ideal_param_bytes_per_device": int(math.ceil(ideal["params"])),
        "ideal_opt_bytes_per_device": int(math.ceil(ideal["opt"])),
        "ratio": {k: (actual[k] / ideal[k] if ideal[k] else 1.0) for k in actual},
        "replicated": replicated[0],
        "replicated_omitted": replicated[1],
        "replicated_min_bytes": min_bytes,
        **({"memory": memory} if memory is not None else {}),
    }


def format_model_plan(result: dict, name: str | None = None) -> str:
    """The human-readable report of ``plan_model``'s result."""
    mesh = result["mesh"]
    title = f"{name} ({result['model_type']})" if name else result["model_type"]
    ratio = result["ratio"]
    ideal = {"params": result["ideal_param_bytes_per_device"],
             "opt": result["ideal_opt_bytes_per_device"]}
    lines = [
        f"{title}: {result['n_params']:,} parameters "
        f"({size_text(result['n_params'] * 4)} in float32)"
        + (f", {result['active_params']:,} active per token"
           if result.get("active_params", result["n_params"]) != result["n_params"] else ""),
        f"mesh: {describe_shape(mesh)} "
        f"({result['devices']} devices)",
        "",
        f"{'per device':<24}{'actual':>14}{'ideal':>14}{'ratio':>9}",
    ]
    rows = (("parameters (float32)", result["param_bytes_per_device"], ideal["params"],
             ratio["params"]),
            ("Adam state (2 x float32)", result["opt_bytes_per_device"], ideal["opt"],
             ratio["opt"]))
    for label, a, i, r in rows:
        lines.append(f"{label:<24}{size_text(a):>14}{size_text(i):>14}{r:>8.3f}x")
    a = result["param_bytes_per_device"] + result["opt_bytes_per_device"]
    i = ideal["params"] + ideal["opt"]
    lines.append(f"{'total':<24}{size_text(a):>14}{size_text(i):>14}{a / i if i else 1.0:>8.3f}x")
    over = " x ".join(f"{a.name} {mesh[a.name]}" for a in PARAMETER_AXES
                      if a.shown_at_one or mesh[a.name] > 1)
    by_design = ", ".join(f"{a.name} axis ({mesh[a.name]})" for a in AXES
                          if not a.splits_parameters)
    experts = "".join(f" (the {a.name} axis divides the {what} share only)"
                      for role, what in (("experts", "experts'"), ("layers", "stacked layers'"))
                      for a in SOME_PARAMETERS if role in a.roles and mesh.get(a.name, 1) > 1)
    lines.append(f"ideal = total / ({over}){experts}; the {by_design} replicates by design.")
    lines.append("")
    threshold = size_text(result["replicated_min_bytes"])
    reps, omitted = result["replicated"], result["replicated_omitted"]
    if not reps:
        lines.append(f"no parameter of {threshold} or more is left replicated over model or fsdp")
    else:
        lines.append(f"left replicated ({len(reps)} of {threshold} or more):")
        width = max(len(r["path"]) for r in reps)
        for r in reps:
            spec = "P(" + ", ".join(repr(e) for e in r["spec"]) + ")"
            lines.append(f"  {r['path']:<{width}}  {str(tuple(r['shape'])):<18} {spec:<22} "
                         f"over {'+'.join(r['replicated_over']):<11} "
                         f"{size_text(r['bytes_per_device']):>11}/device")
            if r.get("why"):
                fix = f"; fix: {r['fix']}" if r["fix"] else " (as intended)"
                lines.append(f"    {r['why']}{fix}")
    if omitted:
        lines.append(f"({omitted} smaller parameters left replicated are not listed: "
                     "norm scales, biases)")
    if "memory" in result:
        lines += ["", *format_memory(result["memory"], mesh)]
    return "\n".join(lines)


def format_memory(plan: dict, mesh: dict) -> list[str]:
    """The lines of a memory plan: each part per device, the total, whether it fits."""
    step = plan["step"]
    dtype = step["compute_dtype"] or "float32"
    chunk = f", loss chunk {step['loss_chunk']}" if step["loss_chunk"] else ""
    micro = step["micro_batch_size"] or step["batch_size"]
    lines = [f"one training step, per device: micro batch {micro}"
             f" ({plan['per_device_batch']} per device) x {step['seq_len']} tokens, "
             f"remat={step['remat']!r}, compute in {dtype}{chunk}"]
    lines += part_lines(plan, mesh)
    lines.append("activations: residuals JAX saves for the backward pass, traced; XLA's "
                 "temporaries (fusion outputs, collectives' buffers) come on top")
    return lines


# The planner's remat policies for a redray.models family ("offload" trades host
# transfers the cost model does not count: chosen only when pinned).
REMAT_POLICIES = ("none", "dots", "full")
# Matmul FLOPs of a step under each policy, over none: "full" runs the forward once more
# (a third of forward + backward), "dots" keeps the matmul outputs and recomputes only
# the cheap elementwise work around them.
REMAT_FLOPS = {"none": 1.0, "dots": 1.0, "full": 4 / 3, "offload": 1.0}


class ConfigFacts(ModelFacts):
    """What the planner needs of a ``redray.models`` family built from ``config``
    (``redray.planning.planner.ModelFacts``): its parameters, its dataflow, one
    example's FLOPs (XLA's cost analysis, layers at depth 1 and 2 extrapolated) and a
    step's memory (``step_memory``, its traces kept between candidates).

    Args:
      config: a ``transformers`` config (or a preset name, a path, config fields).
      seq_len: tokens per example.
      compute_dtype: e.g. "bfloat16" (None: float32).
      loss_chunk: tokens whose logits exist at once (``next_token_loss(chunk=)``).
      scan: the layers stacked and scanned (what pipeline stages split: the planner
        then tries stage axes); None: as ``build`` builds the model by default.
      fused_attention: the step runs on devices with fused attention kernels (a GPU
        or a TPU, ``Hardware.fused_attention``): its attention keeps what the blockwise
        kernel keeps, whatever this machine would run.
      grouped_matmuls: the step runs on devices whose grouped matmuls compute only
        each row's own expert (a GPU or a TPU, ``Hardware.grouped_matmuls``): a mixture
        of experts' FLOPs and work are counted so, not as XLA:CPU computes them
        (``redray.planning.work.grouped_matmuls``).
    """

    def __init__(self, config, seq_len: int, compute_dtype: str | None = None,
                 loss_chunk: int | None = None, scan: bool | None = None,
                 fused_attention: bool = False, grouped_matmuls: bool = False):
        from flax import nnx

        from redray.planning.memory import context_states, expert_layers
        from redray.sharding.specs import flatten, trace_tree

        self.config = resolve_config(config)
        self.step = StepShape(batch_size=1, seq_len=seq_len, compute_dtype=compute_dtype,
                              loss_chunk=loss_chunk, scan=scan)
        self.fused_attention, self.grouped_matmuls = fused_attention, grouped_matmuls
        self.fam, graphdef, params, extra = abstract_model(self.config, scan=scan)
        self.paths, leaves, _ = flatten(params)
        self.shapes = [tuple(x.shape) for x in leaves]
        self.dtypes = [x.dtype for x in leaves]
        inputs = self.fam.trace_inputs(self.config)

        def forward(params, kwargs):
            # the model's other state made in this trace (a scanned model's RNG counts
            # enter its scan, which takes nothing from an outer trace)
            return nnx.merge(graphdef, params, jax.tree.map(_fresh_state, extra))(**kwargs)

        self.trace = trace_tree(params, forward, (inputs,))
        self.experts = expert_layers(nnx.merge(graphdef, params, extra))
        tokens = math.prod(next(iter(inputs.values())).shape)
        self.trace_examples = tokens / seq_len  # in the step's examples
        self.tokens_per_example = seq_len
        heads = getattr(self.config, "num_attention_heads", None)
        if heads:  # a context axis's ring moves keys and values of this width
            # latent attention's keys are qk_head_dim wide and its values padded to them
            # (redray.models.deepseek); its config's head_dim is the rotary part's
            dim = (getattr(self.config, "qk_head_dim", None)
                   or getattr(self.config, "head_dim", None)
                   or self.config.hidden_size // heads)
            self.kv_heads = getattr(self.config, "num_key_value_heads", None) or heads
            self.kv_width = self.kv_heads * dim
            self.attention_layers = getattr(self.config, "num_hidden_layers", None)
            self.linear_layers, self.linear_state = context_states(
                nnx.merge(graphdef, params, extra))
            if self.attention_layers:
                self.attention_layers -= self.linear_layers
        # redray's decoders split a sequence over a context axis (T5 does not)
        self.splits_sequences = not getattr(self.config, "is_encoder_decoder", False)
        self.compute_itemsize = jnp.dtype(compute_dtype or jnp.float32).itemsize
        self.remat_policies = REMAT_POLICIES
        # the 1F1B schedule cuts a model at one stack of layers: not an encoder-decoder
        self.one_f_one_b = "decoder_input_ids" not in inputs
        self._flops: float | None = None
        self._traces: dict = {}
        self._work = None

    def flops(self, remat: str) -> float:
        from redray.planning.memory import example_flops

        if self._flops is None:
            self._flops = example_flops(self.fam, self.config, self.step.seq_len,
                                        self.step.compute_dtype, self.step.loss_chunk,
                                        self.grouped_matmuls)
        return self._flops * REMAT_FLOPS[remat]

    def work(self):
        from redray.planning.work import config_work

        if self._work is None:
            self._work = config_work(self.fam, self.config, self.step.seq_len,
                                     self.step.compute_dtype, self.step.loss_chunk,
                                     self.experts if self.grouped_matmuls else ())
        return self._work

    def memory(self, parallelism: Parallelism, rows, per_device_batch: int, remat: str,
               accumulation: int = 1, schedule: str = "gpipe", repeats: int = 1,
               stage_recompute: bool = False) -> dict:
        rows_per_pass = per_device_batch * parallelism.data_parallel
        step = dataclasses.replace(self.step, batch_size=rows_per_pass * accumulation,
                                   micro_batch_size=rows_per_pass, remat=remat,
                                   pipeline_schedule=schedule, stage_repeats=repeats,
                                   stage_recompute=stage_recompute)
        params = sum(r.bytes_per_device for r in rows)
        return step_memory(self.fam, self.config, rows, 2 * params, parallelism, step,
                           traces=self._traces, experts=self.experts,
                           blockwise=self.fused_attention, layers=stacked_layers(self))


def choose_plan(config, devices: int, hosts: int, batch_size: int, seq_len: int,
                hardware, *, compute_dtype: str | None = None, loss_chunk: int | None = None,
                rules=(), micro_batch_size: int | None = None, micro_rows: int | None = None,
                remat: str | None = None, scan: bool | None = None,
                pipeline_schedule: str | None = None, stage_repeats: int | None = None,
                context_attention: str | None = None, **axes):
    """Every plan of ``config``'s model on ``devices`` devices in ``hosts`` hosts, ranked by
    the planner (``redray.planning.planner.rank``) on ``hardware``; what is given (axis
    sizes by keyword, 1 included, ``micro_batch_size`` per device or ``micro_rows`` over all
    devices, ``remat``) is kept. ``scan``: the model's layers stacked and scanned, so the
    planner tries pipeline stages too (None: as ``build`` builds it by default; False: a
    list of layers, no stages).

    Raises:
      PlanError: an unsupported model, pinned sizes no plan takes, or no plan that fits
        (naming the smallest and what to change).
    """
    from redray.planning.planner import NoPlanFits, pins, rank

    for name, value in (("devices", devices), ("hosts", hosts), ("batch size", batch_size),
                        ("sequence length", seq_len)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise PlanError(f"{name} must be a positive integer, got {value!r}")
    if devices % hosts:
        raise PlanError(f"{devices} devices do not split over {hosts} hosts: give a device "
                        f"count that is a multiple of {hosts}")
    Parallelism.of(caller="redray plan", **axes)  # an unknown keyword fails as such
    if scan is None and any(axes.get(k, 1) not in (1, "auto") for k in role_keywords("layers")):
        scan = True  # stages need it
    facts = ConfigFacts(config, seq_len, compute_dtype, loss_chunk, scan,
                        fused_attention=hardware.fused_attention,
                        grouped_matmuls=hardware.grouped_matmuls)
    pinned = pins(micro_batch_size=micro_batch_size, micro_rows=micro_rows, remat=remat,
                  pipeline_schedule=pipeline_schedule, context_attention=context_attention,
                  **axes)
    if stage_repeats is not None:  # 1 too: no circular repeats
        pinned["stage_repeats"] = stage_repeats
    # an axis given is kept, 1 too (context_axis=1: no sequence split), where the
    # Trainer's defaults (pins) leave the planner free
    pinned.update({k: v for k, v in axes.items() if v is not None and v != "auto"})
    try:
        return rank(facts, devices, hosts, batch_size, hardware, pinned, rules)
    except (NoPlanFits, ValueError) as e:
        raise PlanError(str(e)) from None
