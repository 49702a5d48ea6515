"""``redray plan``: abstract sharding plans of the shipped presets, and the CLI.

Every preset is planned on a setting like the paper's: each device must hold at most
1.05x the ideal share (total / (model x fsdp)) of the parameters and of the Adam state.
Nothing is allocated: opt-66b is 245 GiB of float32 parameters.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from jax.sharding import PartitionSpec as P

import redray
from redray.models.families import FAMILIES, lookup
from redray.planning.memory import StepShape
from redray.sharding.plan import load as load_plan
from redray.planning.from_config import (PlanError, format_model_plan, plan_model, plan_parallelism,
                                preset_fields, presets)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_RATIO = 1.05
KEYS = {"n_params", "devices", "mesh", "param_bytes_per_device", "opt_bytes_per_device",
        "ideal_bytes_per_device", "replicated"}

# preset -> (devices, model axis, fsdp axis, parameter count)
SETTINGS = {
    "gpt2-xl": (8, 4, 2, 1_557_611_200),
    "gpt-j-6b": (8, 8, 1, 6_050_882_784),
    "llama-7b": (16, 8, 2, 6_738_415_616),
    "llama-13b": (32, 8, 4, 13_015_864_320),
    "llama-3-8b": (16, 8, 2, 8_030_261_248),
    "t5-11b": (16, 8, 2, 11_307_321_344),
    "opt-13b": (16, 8, 2, 12_853_473_280),
    "opt-66b": (64, 8, 8, 65_719_701_504),
    "qwen3-8b": (16, 8, 2, 8_190_735_360),
    "mixtral-8x7b": (64, 8, 8, 46_702_792_704),
    "qwen3-30b-a3b": (32, 4, 8, 30_532_122_624),
    # the 2026 families (each count equal to transformers' own model's, built on the
    # meta device from the same config)
    "gpt-oss-20b": (16, 8, 2, 20_914_757_184),
    "llama-4-scout": (64, 8, 8, 107_769_861_120),
    "llama-4-maverick": (256, 8, 32, 400_711_848_960),
    "olmo-3-7b": (16, 8, 2, 7_298_011_136),
    "smollm3-3b": (8, 4, 2, 3_075_098_624),
    "deepseek-v3": (256, 8, 32, 671_026_404_352),
}
def run_cli(*args):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-m", "redray.cli", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def test_presets_are_shipped_and_named_by_their_family():
    assert set(presets()) == set(SETTINGS)
    assert sorted(p for f in FAMILIES.values() for p in f.presets) == presets()
    for name in presets():
        assert name in lookup(preset_fields(name)["model_type"]).presets, name


@pytest.mark.parametrize("name", list(SETTINGS))
def test_paper_setting_fits(name):
    devices, model, fsdp, n_params = SETTINGS[name]
    result = plan_model(name, devices, model, fsdp)
    assert result["n_params"] == n_params
    assert result["mesh"] == {"stage": 1, "data": devices // (model * fsdp), "fsdp": fsdp,
                              "expert": 1, "context": 1, "model": model}
    ideal = {"params": result["ideal_param_bytes_per_device"],
             "opt": result["ideal_opt_bytes_per_device"]}
    assert result["ideal_bytes_per_device"] == pytest.approx(ideal["params"] + ideal["opt"], abs=2)
    assert ideal["params"] == pytest.approx(4 * n_params / (model * fsdp), abs=1)
    assert result["opt_bytes_per_device"] == pytest.approx(
        2 * result["param_bytes_per_device"], abs=64)
    for kind, actual in (("params", result["param_bytes_per_device"]),
                         ("opt", result["opt_bytes_per_device"])):
        assert actual >= ideal[kind] - 64
        assert actual <= MAX_RATIO * ideal[kind], (
            f"{name} {kind}: {actual / ideal[kind]:.3f}x the ideal; replicated: "
            f"{[(r['path'], r['shape']) for r in result['replicated']]}")


def test_llama_plan_lists_nothing_big_replicated():
    result = plan_model("llama-7b", 16, 8, 2)
    assert result["replicated"] == []
    # Norm scales (4096 floats) stay whole (vectors are not split over fsdp): counted, not listed.
    assert result["replicated_omitted"] == 2 * 32 + 1
    text = format_model_plan(result, "llama-7b")
    assert "6,738,415,616 parameters" in text
    assert "data=1 x fsdp=2 x model=8 (16 devices)" in text
    assert "65 smaller parameters" in text


def test_replicated_parameters_are_listed_with_their_axes():
    # OPT's learned positions (2048 + 2 offset rows) divide by no model axis of 8: being
    # large, they are sharded over model as an extra FSDP axis, not left whole.
    result = plan_model("opt-13b", 16, 8, 2)
    assert result["replicated"] == []
    assert result["replicated_omitted"] > 0  # norms and biases, under the size threshold
    forced = plan_model("opt-13b", 16, 8, 2, rules=[(r"^embed_positions/", P())])
    assert [(r["path"], r["shape"], r["replicated_over"]) for r in forced["replicated"]] == [
        ("embed_positions/embedding", [2050, 5120], ["model", "fsdp"])]
    assert forced["replicated"][0]["bytes_per_device"] == 2050 * 5120 * 4
    assert "embed_positions/embedding" in format_model_plan(forced, "opt-13b")


def test_data_axis_replicates_without_changing_the_ideal():
    one = plan_model("llama-7b", 16, 8, 2)
    four = plan_model("llama-7b", 64, 8, 2)
    assert four["mesh"] == {"stage": 1, "data": 4, "fsdp": 2, "expert": 1, "context": 1,
                            "model": 8}
    for key in ("param_bytes_per_device", "opt_bytes_per_device", "ideal_bytes_per_device"):
        assert four[key] == one[key]


def test_config_path_file_or_folder(tmp_path):
    fields = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
              "num_attention_heads": 4, "num_hidden_layers": 2, "vocab_size": 128,
              "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(fields))
    by_file = plan_model(str(tmp_path / "config.json"), 4, 4, 1)
    by_folder = plan_model(str(tmp_path), 4, 4, 1)
    assert by_file == by_folder
    assert by_file["n_params"] == 2 * 128 * 64 + 2 * (2 * 64 + 4 * 64 * 64 + 3 * 64 * 128) + 64
    assert by_file == plan_model(fields, 4, 4, 1)


@pytest.mark.parametrize("devices,model,fsdp,fix", [
    (12, 8, 1, "multiple of 8 (e.g. 8 or 16)"),
    (16, 8, 3, "multiple of 24 (e.g. 24)"),
])
def test_axes_that_do_not_divide_say_the_fix(devices, model, fsdp, fix):
    with pytest.raises(PlanError, match="does not divide") as info:
        plan_parallelism(devices, model_axis=model, fsdp_axis=fsdp)
    assert fix in str(info.value)
    assert "\n" not in str(info.value)


def test_unknown_preset_lists_presets():
    with pytest.raises(PlanError) as info:
        plan_model("llama-70b", 8, 8)
    for name in SETTINGS:
        assert name in str(info.value)


def test_cli_text_in_process(capsys):
    from redray.cli import main

    assert main(["plan", "llama-13b", "--devices", "32", "--model-axis", "8",
                 "--fsdp-axis", "4"]) == 0
    out = capsys.readouterr().out
    assert "llama-13b (llama): 13,015,864,320 parameters" in out
    assert "Adam state" in out and "ideal = total / (model 8 x fsdp 4)" in out


def test_cli_json():
    proc = run_cli("plan", "llama-7b", "--devices", "32", "--model-axis", "8",
                   "--fsdp-axis", "2", "--json")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert KEYS <= set(result)
    assert result["n_params"] == 6_738_415_616
    assert result["devices"] == 32
    assert result["mesh"] == {"stage": 1, "data": 2, "fsdp": 2, "expert": 1,
                              "context": 1, "model": 8}
    assert load_plan(result).shape == result["mesh"]  # the plan of these axes, for plan=
    assert isinstance(result["replicated"], list)
    assert isinstance(result["ideal_bytes_per_device"], int)
    assert result["param_bytes_per_device"] <= MAX_RATIO * result["ideal_param_bytes_per_device"]
    assert result["opt_bytes_per_device"] <= MAX_RATIO * result["ideal_opt_bytes_per_device"]


@pytest.mark.parametrize("args,expected", [
    (["no-such-model", "--devices", "8", "--model-axis", "8"], "unknown preset 'no-such-model'"),
    (["missing/config.json", "--devices", "8", "--model-axis", "8"], "no such config file"),
    (["llama-7b", "--devices", "12", "--model-axis", "8"], "does not divide 12 devices"),
    (["llama-7b", "--devices", "8", "--model-axis", "8", "--device-memory", "80"],
     "--device-memory needs the step's shape"),
    (["llama-7b", "--devices", "8", "--model-axis", "2", "--batch-size", "6", "--seq-len",
      "64"], "micro batch 6 does not split over data x fsdp = 4 devices"),
    (["llama-7b", "--devices", "8", "--model-axis", "8", "--batch-size", "8"],
     "needs both --batch-size and --seq-len"),
    (["llama-7b", "--devices", "8"], "choosing a plan needs the step: give --batch-size"),
    (["llama-7b", "--devices", "8", "--batch-size", "8", "--seq-len", "64", "--hardware",
      "v100"], "unknown hardware 'v100'"),
    (["llama-7b", "--devices", "8", "--hosts", "3", "--batch-size", "8", "--seq-len", "64"],
     "8 devices do not split over 3 hosts"),
    (["llama-7b", "--devices", "12", "--slices", "2", "--hardware", "tpu-v5p", "--batch-size",
      "8", "--seq-len", "64"], "--slices 2: 12 devices do not make 2 slices of whole TPU v5p "
     "hosts (4 devices each): give a device count that is a multiple of 2 x 4 = 8"),
    (["llama-7b", "--devices", "16", "--slices", "2", "--hosts", "3", "--hardware", "tpu-v5p",
      "--batch-size", "8", "--seq-len", "64"], "--hosts 3 do not make 2 slices"),
])
def test_cli_errors_are_one_line_exit_2(args, expected):
    proc = run_cli("plan", *args)
    assert proc.returncode == 2
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert expected in lines[0]
    assert "Traceback" not in proc.stderr
    if "unknown preset" in expected:
        assert all(name in lines[0] for name in SETTINGS)


def test_the_step_memory_counts_every_part_and_says_whether_it_fits(capsys):
    from redray.cli import main

    step = ["llama-7b", "--devices", "16", "--model-axis", "8", "--fsdp-axis", "2",
            "--batch-size", "16", "--seq-len", "1024", "--compute-dtype", "bfloat16"]
    assert main(["plan", *step, "--remat", "full", "--device-memory", "80"]) == 0
    out = capsys.readouterr().out
    for part in ("gradients", "compute-dtype copies", "fsdp gather (2 layers)",
                 "activations (saved)", "recompute (1 layer)"):
        assert part in out, out
    assert "fits on a device of 80.00 GiB: yes" in out
    assert main(["plan", *step, "--device-memory", "16"]) == 0
    out = capsys.readouterr().out
    assert "fits on a device of 16.00 GiB: NO" in out and "try remat='full'" in out

    def memory(remat, **kw):
        shape = StepShape(batch_size=16, seq_len=1024, remat=remat, compute_dtype="bfloat16",
                          **kw)
        return plan_model("llama-7b", 16, 8, 2, step=shape)["memory"]

    none, full, dots = memory("none"), memory("full"), memory("dots")
    # 8 per device (data 1 x fsdp 2); the state parts follow the sharding plan
    assert none["per_device_batch"] == 8
    assert none["parts"]["gradients"] == none["parts"]["parameters"]
    assert none["parts"]["compute_copies"] == none["parts"]["parameters"] // 2
    # full remat keeps each layer's input and nothing else: 8 x 1024 x 4096 in bfloat16
    per_layer_input = 8 * 1024 * 4096 * 2
    assert full["activations_per_layer"] == per_layer_input
    assert full["parts"]["activations"] < dots["parts"]["activations"] < \
        none["parts"]["activations"]
    assert full["parts"]["recompute"] > 0 and none["parts"]["recompute"] == 0
    # accumulating over micro-batches of 8 halves the rows a pass holds
    half = memory("none", micro_batch_size=8)
    assert half["per_device_batch"] == 4
    assert half["parts"]["activations"] == pytest.approx(none["parts"]["activations"] / 2,
                                                         rel=0.01)


def test_the_memory_plan_is_checked_against_the_compiled_step():
    """redray plan's count (from the config) and Trainer.memory's (the built model and
    loss) agree, and are within 0.8-1.25 of XLA's compiled step on CPU, where XLA keeps
    what the policy keeps (no remat: XLA:CPU recomputes but does not lower the peak)."""
    import jax
    import numpy as np
    import optax
    import transformers

    import redray
    from redray.models import build, next_token_loss

    if jax.device_count() < 4:
        pytest.skip("needs 4 simulated devices")
    config = transformers.LlamaConfig(hidden_size=128, intermediate_size=512,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      vocab_size=512, max_position_embeddings=64,
                                      tie_word_embeddings=False)
    data = [{"ids": r} for r in np.random.default_rng(0).integers(0, 512, (8, 65), np.int32)]

    def loss(model, batch, rng, train):
        return next_token_loss(model, batch["ids"], train=train)

    for model_axis, fsdp_axis in ((4, 1), (1, 4), (2, 2)):
        trainer = redray.Trainer.of(lambda rngs: build(config, rngs=rngs), lambda e: {
            "ids": np.stack([x["ids"] for x in e])}, loss, optax.adamw(1e-3), batch_size=8,
            model_axis=model_axis, fsdp_axis=fsdp_axis, progress=False)
        trainer.init(data)
        measured = trainer.memory(device_gib=1)
        planned = plan_model(config, 4, model_axis, fsdp_axis,
                             step=StepShape(batch_size=8, seq_len=64))["memory"]
        assert planned["parts"] == {**measured["parts"], "recompute": 0}, (model_axis, fsdp_axis)
        ratio = planned["total"] / measured["compiled"]["peak"]
        assert 0.8 <= ratio <= 1.25, (model_axis, fsdp_axis, ratio, measured)
        assert measured["fits"] is True
    assert "XLA's compiled step on cpu: peak" in trainer.placement(memory=True)


def test_one_memory_count_for_the_trainer_the_planner_and_redray_plan():
    """Six plans (data; FSDP x model; experts; stages by GPipe and by 1F1B; context):
    ``Trainer.memory()`` (the built model and loss, its state's own arrays), the
    planner's score of the same plan (the facts it ranks a Trainer's plans on) and
    ``redray plan`` (the config alone) report the same parts, byte for byte: one count
    (``redray.planning.memory.step_parts``) behind all three."""
    import jax
    import numpy as np
    import optax
    import transformers

    import redray
    from redray.engine.facts import RuntimeFacts
    from redray.engine.loop import tokens_per_example
    from redray.engine.runtime import ModelRuntime
    from redray.models import build, next_token_loss
    from redray.planning.hardware import preset
    from redray.planning.planner import grid_plan, score
    from redray.sharding.parallelism import AXES

    if jax.device_count() < 4:
        pytest.skip("needs 4 simulated devices")
    small = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64)
    llama = transformers.LlamaConfig(**small, intermediate_size=128, tie_word_embeddings=False)
    mixtral = transformers.MixtralConfig(**small, intermediate_size=32, num_local_experts=4,
                                         num_experts_per_tok=2)
    data = [{"ids": r} for r in np.random.default_rng(0).integers(0, 128, (8, 33), np.int32)]

    def collate(examples):
        return {"ids": np.stack([e["ids"] for e in examples])}

    def loss(model, batch, rng, train):
        return next_token_loss(model, batch["ids"], train=train)

    plans = [(llama, dict(data_axis=4), "gpipe"),
             (llama, dict(fsdp_axis=2, model_axis=2), "gpipe"),
             (mixtral, dict(expert_axis=2, data_axis=2), "gpipe"),
             (llama, dict(stage_axis=2, data_axis=2), "gpipe"),
             (llama, dict(stage_axis=2, data_axis=2), "1f1b"),
             (llama, dict(context_axis=2, data_axis=2), "gpipe")]
    seen = set()
    for config, axes, schedule in plans:
        def make(rngs, config=config):
            return build(config, rngs=rngs)

        trainer = redray.Trainer.of(make, collate, loss, optax.adamw(1e-3), batch_size=8,
                                 micro_batch_size=1, pipeline_schedule=schedule,
                                 progress=False, **axes)
        trainer.init(data)
        measured = trainer.memory()["parts"]
        batch = collate(data)
        facts = RuntimeFacts(ModelRuntime(make, None), loss, optax.adamw(1e-3), batch, None,
                             tokens_per_example(batch))
        sizes = tuple((a.keyword, axes.get(a.keyword, 1)) for a in AXES)
        planned = score(facts, grid_plan(dict(sizes), 1, "none", 8, schedule), 8, 1, preset("cpu"),
                        budget=1e12).memory["parts"]
        step = StepShape(batch_size=8, seq_len=32, pipeline_schedule=schedule,
                         micro_batch_size=trainer.parallelism.data_parallel)
        from_config = plan_model(config, 4, step=step, **axes)["memory"]["parts"]
        assert measured == planned == from_config, (axes, schedule, measured, planned,
                                                    from_config)
        seen |= {name for name, n in measured.items() if n}
    # each plan's own parts were counted, not left out alike by all three
    assert {"fsdp_gathered", "expert_exchange", "pipeline_buffers", "pipeline_gradients",
            "activations", "optimizer"} <= seen


def test_the_planner_ranks_plans_when_no_axis_is_given(capsys):
    from redray.cli import main

    step = ["llama-7b", "--devices", "16", "--batch-size", "32", "--seq-len", "1024",
            "--compute-dtype", "bfloat16"]
    assert main(["plan", *step]) == 0  # H100 hosts of 8: 2 hosts
    out = capsys.readouterr().out
    assert "16 devices in 2 host(s), H100 SXM" in out and "plan: data=" in out
    assert "runner-up" in out and "step ms" in out and "tokens/s" in out
    # pinned parts are kept: a model axis of 4, and the JSON lists every fitting plan
    assert main(["plan", *step, "--model-axis", "4", "--hosts", "2", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["plans"] and all(p["axes"]["model"] == 4 for p in result["plans"])
    times = [p["step_seconds"] for p in result["plans"]]
    assert times == sorted(times)
    # what plan= takes: the best plan, whole, with the hardware it was costed on
    best = redray.Plan.from_dict(result["plans"][0]["plan"])
    assert load_plan(result) == best and best.shape == result["plans"][0]["axes"]
    assert best.geometry.batch_size == 32 and best.hardware["name"] == "H100 SXM"
    assert best.geometry.micro_batch_size == result["plans"][0]["micro_batch_size"]
    # the compute's parts by kind (redray.planning.work): attention at its kernel's
    # rate and the memory-bound kernels are part of it, beside the matmuls
    assert all(0 < p["attention_seconds"] and 0 < p["memory_bound_seconds"]
               and p["attention_seconds"] + p["memory_bound_seconds"] < p["compute_seconds"]
               for p in result["plans"])


def test_every_part_of_a_layout_is_pinned_and_the_pinned_step_taken_apart(capsys):
    """``--pipeline-schedule``, ``--stage-repeats`` and ``--context-attention`` are kept
    in every ranked plan, and ``--explain`` takes the pick apart: the compute by kind,
    the schedule's bubble with its micro-batches and virtual stages, every collective
    by the link it crosses, and the memory against the budget. The parts add up to the
    step the plan was ranked by."""
    from redray.cli import main

    step = ["llama-7b", "--devices", "64", "--hosts", "8", "--batch-size", "64",
            "--seq-len", "4096", "--compute-dtype", "bfloat16", "--model-axis", "8",
            "--stage-axis", "4", "--context-axis", "2", "--pipeline-schedule", "1f1b",
            "--stage-repeats", "2", "--context-attention", "all_gather"]
    assert main(["plan", *step, "--json"]) == 0
    plans = json.loads(capsys.readouterr().out)["plans"]
    assert plans and all(
        p["pipeline_schedule"] == "1f1b" and p["stage_repeats"] == 2
        and p["plan"]["context_attention"] == "all_gather" for p in plans)
    best = plans[0]
    assert main(["plan", *step, "--explain"]) == 0
    out = capsys.readouterr().out
    assert "pipeline: interleaved 1F1B, 4 stages x 2 chunk(s) each (8 virtual stages" in out
    assert "keeps each chunk's activations" in out
    # the context axis priced as pinned: its keys and values gathered, no ring passes
    assert "context: keys and values gathered whole" in out and "round the ring" not in out
    assert "inside a host @ 450 GB/s" in out and "hosts @ 50 GB/s" in out
    assert "memory per device (budget 67.06 GiB)" in out and "fsdp gather" not in out \
        or "fsdp" in best["axes"]
    parts = {line.split()[0]: line for line in out.splitlines()
             if line.startswith(("step ", "compute "))}
    step_s = float(parts["step"].split()[1])
    assert step_s == pytest.approx(best["step_seconds"], rel=1e-3)
    # unpinned, both schedules and several repeat counts are weighed
    assert main(["plan", *step[:-6], "--json"]) == 0
    free = json.loads(capsys.readouterr().out)["plans"]
    assert {p["pipeline_schedule"] for p in free} == {"gpipe", "1f1b"}
    assert len({p["stage_repeats"] for p in free}) > 1


def test_two_v5p_slices_take_the_data_axis_across_them(capsys):
    from redray.cli import main

    step = ["llama-3-8b", "--devices", "32", "--slices", "2", "--hardware", "tpu-v5p",
            "--batch-size", "64", "--seq-len", "4096", "--compute-dtype", "bfloat16"]
    assert main(["plan", *step, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["hosts"] == 8 and result["slices"] == 2
    assert result["hardware"]["slice_devices"] == 16
    best = result["plans"][0]
    levels = {row["level"]: row for row in best["network"]}
    assert list(levels) == ["inside a host", "between hosts of a slice", "across slices"]
    # only the data axis crosses the slices, and the step sends its gradients over them
    assert levels["across slices"]["axes"] == {"data": best["axes"]["data"]}
    assert best["axes"]["data"] >= 2 and levels["across slices"]["bytes"] > 0
    assert levels["across slices"]["link_gb_per_s"] == 50 / 8
    assert sum(best["memory_parts"].values()) == best["memory_bytes"]
    # the explanation: memory per device by part, traffic per level
    assert main(["plan", *step]) == 0
    out = capsys.readouterr().out
    assert "32 devices in 8 host(s) in 2 slices, TPU v5p" in out
    assert "memory per device" in out and "optimizer state" in out
    # FSDP over every chip is predicted faster, and said to be left out
    assert "data=1 x fsdp=32 x model=1, micro 1, remat none is predicted" in out
    crossing = next(line for line in out.splitlines() if line.startswith("  across slices"))
    assert f"data={best['axes']['data']}" in crossing and "6.25 GB/s" in crossing


@pytest.mark.parametrize("axes", [dict(fsdp_axis=2), dict(model_axis=2)])
def test_the_stacked_arrays_are_found_whatever_the_plan(axes):
    """A scanned model's stacked arrays (path -> layers) come from the trace, which runs
    for them even where no spec pass needs it (FSDP alone): ``plan_model`` judges a
    replicated stacked array by one layer's size."""
    from transformers import LlamaConfig

    from redray.models.hub import model_specs
    from redray.planning.from_config import abstract_model

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=4, num_attention_heads=4)
    fam, graphdef, params, extra = abstract_model(config, scan=True)
    stacked: dict = {}
    model_specs(graphdef, (params, extra), plan_parallelism(2, **axes),
                fam.trace_inputs(config), [], stacked)
    assert stacked and set(stacked.values()) == {4}
    assert all(p.startswith("layers/") for p in stacked), sorted(stacked)
