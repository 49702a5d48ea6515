"""docs/architecture.md stays true: imports follow its table, the modules it names exist."""

import ast
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(ROOT, "docs", "architecture.md")
# Third-party modules the table governs (the rest of the world is free to import).
GOVERNED = {"ray"}


def allowed_imports() -> dict[str, set[str]]:
    """package -> what it may import, from the doc's table."""
    with open(DOC) as f:
        text = f.read()
    rows = re.findall(r"^\| `(redray\.\w+)` \| (.+?) \|$", text, re.MULTILINE)
    table = {package: set(re.findall(r"`([\w.]+)`", allowed)) for package, allowed in rows}
    assert len(table) >= 10, "the import table in docs/architecture.md was not found"
    return table


def package_of(name: str) -> str | None:
    """The governed package an import names: ``redray.<pkg>`` or a governed library."""
    parts = name.split(".")
    if parts == ["redray"]:  # the package itself: the public API, above every layer
        return "redray.__init__"
    if parts[0] == "redray":
        return ".".join(parts[:2])
    return parts[0] if parts[0] in GOVERNED else None


def imports_of(path: str) -> set[str]:
    """Every module a file imports, at any depth (function-level imports included)."""
    names = set()
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "redray":  # from redray import storage: the submodule
                names.update(f"redray.{a.name}" for a in node.names)
            else:
                names.add(node.module)
    return names


def modules():
    for folder, _, files in os.walk(os.path.join(ROOT, "redray")):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                parts = os.path.relpath(path, ROOT)[:-3].split(os.sep)
                yield path, ".".join(parts[:2]) if len(parts) > 1 else "redray"


def test_every_module_imports_only_what_the_design_allows():
    table = allowed_imports()
    wrong = []
    for path, package in modules():
        if package in ("redray", "redray.__init__"):
            continue  # the public API gathers everything
        assert package in table, f"{package} is not in docs/architecture.md's import table"
        for name in imports_of(path):
            target = package_of(name)
            if target is None or target == package:
                continue
            if target not in table[package]:
                wrong.append(f"{os.path.relpath(path, ROOT)} imports {name}")
    assert not wrong, "imports against docs/architecture.md:\n" + "\n".join(wrong)


def test_the_engine_and_sharding_never_touch_ray_or_the_cluster():
    table = allowed_imports()
    for package in ("redray.engine", "redray.sharding"):
        assert not table[package] & {"ray", "redray.cluster", "redray.tracking", "redray.cli"}
    assert "redray.engine" not in table["redray.checkpoint"]


def test_the_table_catches_a_wrong_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from redray.engine.state import TrainState\n")
    target = {package_of(n) for n in imports_of(str(bad))}
    assert target == {"redray.engine"}


def test_importing_the_package_itself_from_inside_is_an_upward_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    import redray\n    return redray.__version__\n")
    assert {package_of(n) for n in imports_of(str(bad))} == {"redray.__init__"}
    assert "redray.__init__" not in set().union(*allowed_imports().values())
    assert "redray.engine" not in allowed_imports()["redray.checkpoint"]


def test_every_path_the_doc_names_exists():
    with open(DOC) as f:
        paths = re.findall(r"`(redray/[\w/.]+)`", f.read())
    assert len(paths) > 20
    missing = [p for p in paths if not os.path.exists(os.path.join(ROOT, p))]
    assert not missing, f"docs/architecture.md names missing paths: {missing}"


# Strings equal to an axis name outside redray/sharding/ that are not axis names: the
# checkpoint item holding the weights, a property's name in an error, a package folder.
NOT_AXES = {("redray/engine/state.py", "MODEL_ITEM, TRAIN_ITEM"),
            ("redray/engine/trainer.py", '_require_init("model")'),
            ("redray/models/tokenizer.py", '"data")'),
            # the Trainer's data settings (its keyword data=)
            ("redray/engine/settings.py", '"data": DataSettings'),
            ("redray/engine/settings.py", '": ("data", "')}


def axis_name_strings(names: set[str]):
    """(path, line) of every string constant equal to one of ``names`` in redray/."""
    for path, _ in modules():
        lines = open(path).read().splitlines()
        for node in ast.walk(ast.parse("\n".join(lines), path)):
            if isinstance(node, ast.Constant) and node.value in names:
                yield os.path.relpath(path, ROOT), lines[node.lineno - 1]


def test_axis_names_are_spelled_once_inside_sharding_and_nowhere_else():
    from redray.sharding.parallelism import AXES

    names = {a.name for a in AXES} | {a.keyword for a in AXES}
    found = list(axis_name_strings(names))
    outside = [(p, line.strip()) for p, line in found if not p.startswith("redray/sharding/")
               and not any(p == q and text in line for q, text in NOT_AXES)]
    assert not outside, f"axis names spelled outside redray/sharding/: {outside}"
    inside = [p for p, _ in found if p.startswith("redray/sharding/")]
    assert inside == ["redray/sharding/parallelism.py"] * (2 * len(AXES)), inside


# The modules that are one axis's own mechanism (its collectives inside a step): each
# may name its axis and no other. Every other module of planning/ and sharding/ prices,
# places and splits an axis by its roles and flags (``Axis.roles``, ``Axis.gathers``,
# ``splits_batch``, ...), never by its name: a new axis is its row of ``AXES``.
AXIS_MODULES = {"redray/sharding/pipeline_schedules.py": "stage",
                "redray/sharding/reductions.py": "model"}
TABLE = "redray/sharding/parallelism.py"


def axis_references(source: str, path: str = "<source>") -> list[tuple[int, str]]:
    """(line, axis name) of every use of an axis by name in ``source``: its constant
    (``MODEL``, ``MODEL.name``) or a string equal to its name or keyword."""
    from redray.sharding.parallelism import AXES

    constants = {a.name.upper(): a.name for a in AXES}
    strings = {a.name: a.name for a in AXES} | {a.keyword: a.name for a in AXES}
    out = []
    for node in ast.walk(ast.parse(source, path)):
        if isinstance(node, ast.Name) and node.id in constants:
            out.append((node.lineno, constants[node.id]))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and node.value in strings:
            out.append((node.lineno, strings[node.value]))
    return out


def test_planning_and_sharding_never_branch_on_an_axis_name():
    """The cost model, the memory model, the planner and the sharding rules name no axis
    outside the axis table and the axes' own modules (docs/architecture.md's new-axis
    walkthrough: a test below adds an axis by its row alone)."""
    found = []
    for package in ("planning", "sharding"):
        folder = os.path.join(ROOT, "redray", package)
        for name in sorted(os.listdir(folder)):
            path = f"redray/{package}/{name}"
            if not name.endswith(".py") or path == TABLE:
                continue
            own = AXIS_MODULES.get(path)
            found += [(path, line, axis) for line, axis in
                      axis_references(open(os.path.join(ROOT, path)).read(), path)
                      if axis != own]
    assert not found, f"axes named outside the table and their own modules: {found}"


def test_the_axis_name_check_catches_a_branch():
    source = ("from redray.sharding import MODEL\n"
              "def f(shape):\n    return shape[MODEL.name] > 1 or shape['fsdp'] > 1\n")
    assert sorted(axis_references(source)) == [(3, "fsdp"), (3, "model")]


TOY_ROW = """REPLICA = Axis("replica", "replica_axis", 1, True, False, ACROSS,
               "a second data-parallel axis (a toy: tests/test_architecture.py)",
               shown_at_one=False, roles=("rows",))
"""
TOY_RUN = r"""
import json, math, sys
import redray
from redray.planning.from_config import choose_plan
from redray.planning.hardware import preset
from redray.planning.memory import StepShape
from redray.planning.from_config import plan_model
from redray.sharding import make_mesh
from transformers import LlamaConfig

assert redray.__file__.startswith(sys.argv[1]), redray.__file__
config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
out = {"mesh": dict(make_mesh(replica_axis=2, model_axis=2).shape)}
for name, axes in (("toy", dict(replica_axis=2, data_axis=2)), ("data", dict(data_axis=4))):
    best = choose_plan(config, 8, 2, 16, 32, preset("h100"), model_axis=2, fsdp_axis=1,
                       stage_axis=1, remat="full", micro_batch_size=2, **axes).best
    memory = plan_model(config, 8, 2, 1, step=StepShape(batch_size=16, seq_len=32),
                        **axes)["memory"]
    out[name] = {"seconds": best.cost.seconds, "memory": memory["total"],
                 "per_device": memory["per_device_batch"],
                 "groups": sorted({t.axes for t in best.cost.traffic}),
                 "plan": best.plan.to_dict()["axes"]}
print(json.dumps(out))
"""


def test_a_new_data_like_axis_is_its_row_alone(tmp_path):
    """docs/architecture.md's walkthrough, done: a copy of the package whose axis table
    has one more row (a second data-parallel axis) and nothing else changed. The mesh
    takes it by its keyword; the planner prices it, the memory model holds it and the
    plan writes it out, exactly as the data axis it stands in for."""
    import json
    import shutil
    import subprocess
    import sys

    shutil.copytree(os.path.join(ROOT, "redray"), tmp_path / "redray",
                    ignore=shutil.ignore_patterns("__pycache__"))
    table = tmp_path / TABLE
    text = table.read_text()
    axes = "AXES: tuple[Axis, ...] = (STAGE, DATA, FSDP, EXPERT, CONTEXT, MODEL)"
    assert text.count(axes) == 1, "the axis table's line moved: update this test"
    table.write_text(text.replace(axes, TOY_ROW + axes.replace("DATA", "REPLICA, DATA")))
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    done = subprocess.run([sys.executable, "-c", TOY_RUN, str(tmp_path)], env=env,
                          capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["mesh"] == {"stage": 1, "replica": 2, "data": 2, "fsdp": 1, "expert": 1,
                           "context": 1, "model": 2}
    toy, data = out["toy"], out["data"]
    assert toy["plan"]["replica"] == 2 and toy["plan"]["data"] == 2
    assert toy["seconds"] == pytest.approx(data["seconds"], rel=1e-9)
    assert toy["memory"] == data["memory"] and toy["per_device"] == data["per_device"] == 4
    # the gradients are summed over both data-like axes, the model's over the model axis
    assert ["replica", "data"] in toy["groups"] and ["data"] in data["groups"]
    assert ["model"] in toy["groups"]


LONG = 80  # lines of a function, its docstring and nested functions included


def long_functions() -> list[str]:
    """``path:name (lines)`` of every function in redray/ longer than ``LONG``."""
    out = []
    for path, _ in modules():
        for node in ast.walk(ast.parse(open(path).read(), path)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > LONG:
                    out.append(f"{os.path.relpath(path, ROOT)}:{node.name} ({lines})")
    return out


def test_functions_stay_short_and_the_doc_names_any_that_are_not():
    """At most three functions in redray/ run over 80 lines, and docs/architecture.md's
    "Long functions" section names each with why."""
    with open(DOC) as f:
        text = f.read()
    section = text.split("## Long functions", 1)[1].split("\n## ", 1)[0]
    long = long_functions()
    assert len(long) <= 3, f"over {LONG} lines: {long}"
    unnamed = [f for f in long if f"`{f.split(' ')[0]}`" not in section]
    assert not unnamed, f"over {LONG} lines, not named in docs/architecture.md: {unnamed}"


# The planning package's insides: what no module outside it reaches into.
PLANNING_INSIDES = ("redray.planning.cost", "redray.planning.hardware", "redray.planning.probe")


def test_planning_is_one_package_its_insides_private_and_models_plan_nothing():
    """No module outside redray/planning/ imports the cost model, the hardware presets
    or the probe (the rest go through ``redray.planning``'s functions); models and the
    sharding rules import nothing from planning: a model's choices come in with the
    plan."""
    wrong = []
    for path, package in modules():
        rel = os.path.relpath(path, ROOT)
        for name in imports_of(path):
            if package != "redray.planning" and name.startswith(PLANNING_INSIDES):
                wrong.append(f"{rel} imports {name}")
            if package in ("redray.models", "redray.sharding") \
                    and package_of(name) == "redray.planning":
                wrong.append(f"{rel} imports {name}")
    assert not wrong, "\n".join(wrong)
    # and the check sees such an import where it is
    assert any(n.startswith(PLANNING_INSIDES) for n in imports_of(
        os.path.join(ROOT, "redray", "planning", "live.py")))


# The plan's parts: read from the one Plan value, never written one by one.
PLAN_PARTS = {"parallelism", "geometry", "micro_rows", "stage_repeats", "pipeline_schedule",
              "context_attention", "hardware", "mesh"}
# What runs a plan: each reads the parts from the plan it holds.
PLAN_HOLDERS = {"redray/engine/trainer.py", "redray/engine/runtime.py",
                "redray/engine/program.py"}


def plan_writes(source: str, rel: str) -> list[str]:
    """Where ``source`` (the file ``rel``) assigns a part of a plan: another object's
    part, or any in what runs a plan (``PLAN_HOLDERS``)."""
    out = []
    for node in ast.walk(ast.parse(source, rel)):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        for target in targets:
            for t in (target.elts if isinstance(target, ast.Tuple) else [target]):
                if not (isinstance(t, ast.Attribute) and t.attr in PLAN_PARTS):
                    continue
                own = isinstance(t.value, ast.Name) and t.value.id == "self"
                if not own or rel in PLAN_HOLDERS:
                    out.append(f"{rel}:{node.lineno} writes .{t.attr}")
    return out


def test_no_module_writes_a_part_of_the_plan():
    """The plan is one frozen value (``redray.sharding.plan.Plan``), held whole by the
    runtime: no module of redray assigns one of its parts (a new plan is a new value,
    given whole to ``ModelRuntime.use``); an object of its own may keep a mesh of its
    own (a sampler's)."""
    import dataclasses

    from redray.sharding.plan import Plan

    wrong = []
    for path, _ in modules():
        wrong += plan_writes(open(path).read(), os.path.relpath(path, ROOT))
    assert not wrong, "\n".join(wrong)
    # what the check catches: the writes this design removed
    assert plan_writes("runtime.micro_rows, runtime.stage_repeats = 4, 2\n", "x.py") == [
        "x.py:1 writes .micro_rows", "x.py:1 writes .stage_repeats"]
    assert plan_writes("self.geometry = g\n", "redray/engine/trainer.py")
    with pytest.raises(dataclasses.FrozenInstanceError):
        Plan().stage_repeats = 2


# The modules whose code runs beside a Trainer's loop and is handed the Trainer: hooks,
# their helpers, and the cluster layer.
HOOK_SIDE = ("redray/engine/fit_hooks.py", "redray/engine/nonfinite.py",
             "redray/engine/console.py", "redray/engine/hooks.py", "redray/engine/watchdog.py",
             "redray/cluster/")
# makes redray.fit's Trainer on each host and runs it (fit, predictor): its owner, no hook
TRAINER_OWNERS = ("redray/cluster/job.py",)


def trainer_reads(path: str):
    """(line, name, loads) of every ``run.<name>`` or ``trainer.<name>`` in a file."""
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in ("run", "trainer")):
            yield node.lineno, f"{node.value.id}.{node.attr}", isinstance(node.ctx, ast.Load)


def bad_trainer_reads(paths) -> list[str]:
    """Each ``run.<name>`` (or ``trainer.<name>``) in ``paths`` that is not a method or a
    read-only property of the run's view (a private name, a part of the Trainer the view
    does not show), or a write."""
    import inspect
    import types

    from redray.engine.run_view import RunView

    wrong = []
    for path in paths:
        for line, read, loads in trainer_reads(path):
            name = read.split(".", 1)[1]
            member = inspect.getattr_static(RunView, name, None)
            if (not loads or name.startswith("_")
                    or not isinstance(member, (property, types.FunctionType))
                    or isinstance(member, property) and member.fset is not None):
                wrong.append(f"{os.path.relpath(path, ROOT)}:{line}: {read}")
    return wrong


def test_hooks_and_the_cluster_read_the_trainer_through_read_only_names():
    """A hook, a hook's helper or a cluster module reads of the run only what its view
    shows (``RunView``'s methods and read-only properties: no private attribute, not the
    Trainer's state, program or hooks) and writes nothing to it."""
    paths = [p for p, _ in modules()
             if any(os.path.relpath(p, ROOT).startswith(side) for side in HOOK_SIDE)
             and os.path.relpath(p, ROOT) not in TRAINER_OWNERS]
    assert len(paths) > 8
    assert not bad_trainer_reads(paths)


def test_the_trainer_read_check_catches_state_privates_and_writes(tmp_path):
    path = tmp_path / "hook.py"
    path.write_text("def on_step(trainer, info):\n"
                    "    trainer.hooks, trainer.step = trainer.state, trainer._guard\n"
                    "    run.save_checkpoint({}), run.program\n"
                    "    return trainer.describe(), trainer.position, run.saving_step\n")
    found = [line.split(": ")[1] for line in bad_trainer_reads([str(path)])]
    assert sorted(found) == ["run.program", "run.save_checkpoint", "trainer._guard",
                             "trainer.hooks", "trainer.state", "trainer.step"]


def test_the_trainer_coordinates_in_at_most_400_lines_and_nobody_reads_its_privates():
    """The Trainer class stays a coordinator of its pieces (the program, the plan's
    choice, the checkpoints, the hooks, the fit loop, the reports); outside its own
    module only the run's view reads its private attributes."""
    path = os.path.join(ROOT, "redray/engine/trainer.py")
    tree = ast.parse(open(path).read())
    trainer = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Trainer")
    assert trainer.end_lineno - trainer.lineno + 1 <= 400
    private = [f"{os.path.relpath(p, ROOT)}:{line}: {read}" for p, _ in modules()
               if os.path.relpath(p, ROOT) not in ("redray/engine/trainer.py",
                                                   "redray/engine/run_view.py")
               for line, read, _ in trainer_reads(p)
               if read.startswith("trainer._")]
    assert not private


def test_a_step_is_traced_under_one_frozen_value():
    """The layers read one ``Tracing`` value (``redray/sharding/tracing.py``), derived
    from the plan, through one context variable: nested uses refine it, and leave the
    value outside as it was."""
    import dataclasses

    from redray.sharding.tracing import Tracing, attention_kernels, traced, tracing

    found = [os.path.relpath(p, ROOT) for p, _ in modules() if "ContextVar(" in open(p).read()]
    assert found == ["redray/sharding/tracing.py"], found
    assert tracing() == Tracing()
    with attention_kernels() as kernels, traced(ways=4, unroll=True) as inner:
        assert tracing() is inner and inner.kernels is kernels and inner.ways == 4
        with traced(ways=1):
            assert tracing().unroll and tracing().kernels is kernels
        assert tracing() is inner
    assert tracing() == Tracing()
    with pytest.raises(dataclasses.FrozenInstanceError):
        Tracing().ways = 2


def test_the_trainer_takes_its_settings_composed():
    """``Trainer.__init__`` takes at most 15 parameters (self included) and no
    ``**kwargs``: its settings are dataclasses, one per concern; the flat keywords
    (``Trainer.of``, ``redray.fit``) each name one field of one of them."""
    import dataclasses
    import inspect

    from redray.engine import Trainer
    from redray.engine.settings import AS_THEY_ARE, FLAT, GROUPS, from_flat

    parameters = inspect.signature(Trainer.__init__).parameters
    assert len(parameters) <= 15, list(parameters)
    assert all(p.kind != p.VAR_KEYWORD for p in parameters.values())
    assert set(GROUPS) | set(AS_THEY_ARE) <= set(parameters)
    for key, (group, field) in FLAT.items():  # every flat keyword names a real field
        assert field in {f.name for f in dataclasses.fields(GROUPS[group])}, key
    built = from_flat({"model_axis": 2, "log_every": 1, "grad_fn": None, "seed": 3})
    assert built["plan"].axes == {"model_axis": 2} and built["report"].log_every == 1
    assert built["seed"] == 3 and "data" not in built
    with pytest.raises(TypeError, match=r"Trainer got unknown keyword\(s\) \['lerning_rate'\]"):
        from_flat({"lerning_rate": 0.1})


def test_the_command_line_is_a_parser_and_a_dispatch():
    """``redray/cli.py`` parses and dispatches in at most 300 lines; each command's
    parser and handler are in ``redray/commands/``."""
    with open(os.path.join(ROOT, "redray", "cli.py")) as f:
        assert len(f.read().splitlines()) <= 300
