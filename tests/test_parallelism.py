"""The parallelism plan: one value for the mesh axes, the mesh, the batch geometry and
the spec passes; Trainer, Predictor and the planner built from it."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AbstractMesh, PartitionSpec as P

import redray
from redray.sharding import (AXES, BATCH_AXES, CONTEXT, EXPERT, FSDP, MODEL, STAGE, Parallelism,
                             derive_specs, flatten, make_mesh)
from redray.sharding.rules import SpecPass


class MLP(nnx.Module):
    def __init__(self, rngs):
        self.up = nnx.Linear(16, 64, rngs=rngs)
        self.down = nnx.Linear(64, 16, rngs=rngs)

    def __call__(self, x):
        return self.down(jax.nn.relu(self.up(x)))


def collate(examples):
    x = np.stack([e["x"] for e in examples]).astype(np.float32)
    return {"x": x, "y": x.sum(-1, keepdims=True).repeat(16, -1)}


def loss(model, batch, rng, train):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


DATA = [{"x": np.random.default_rng(i).normal(size=16)} for i in range(32)]


def test_the_axes_are_named_once_and_say_what_they_do():
    assert tuple(a.name for a in AXES) == ("stage", "data", "fsdp", "expert", "context", "model")
    assert BATCH_AXES == ("data", "fsdp", "expert")
    assert [a.keyword for a in AXES] == ["stage_axis", "data_axis", "fsdp_axis", "expert_axis",
                                         "context_axis", "model_axis"]
    assert [a.splits_parameters for a in AXES] == [True, False, True, True, False, True]
    assert MODEL.hosts == "inside" and FSDP.hosts == "prefer inside"
    assert EXPERT.hosts == "inside" and STAGE.hosts == "outer" and CONTEXT.hosts == "prefer inside"


def test_the_layers_read_the_mesh_by_role():
    """Each axis names the roles it plays (``Axis.roles``): the rows are the batch axes'."""
    from redray.sharding.parallelism import ROLES, role_axes

    assert role_axes("rows") == BATCH_AXES
    assert role_axes("sequence") == (CONTEXT.name,) and role_axes("layers") == (STAGE.name,)
    assert all(set(a.roles) <= set(ROLES) for a in AXES)
    with pytest.raises(ValueError, match="'tokens' is not a role.*rows, sequence"):
        role_axes("tokens")


def test_a_plan_builds_the_mesh_make_mesh_builds():
    plan = Parallelism.of(model_axis=2).build()
    assert plan.shape == {"stage": 1, "data": 2, "fsdp": 1, "expert": 1, "context": 1, "model": 2}
    assert plan.shape == dict(make_mesh(model_axis=2).shape)
    assert plan.data_parallel == 2 and plan.devices == 4
    assert plan.describe() == "data=2 x fsdp=1 x model=2"
    assert plan.size(MODEL) == 2 and plan.size(FSDP) == 1
    ids = np.vectorize(lambda d: d.id)(plan.mesh.devices)
    assert ids.reshape(2, 2).tolist() == [[0, 1], [2, 3]]  # model peers are neighbours
    # a given mesh is adopted as it is
    mesh = make_mesh(fsdp_axis=2, model_axis=2)
    assert Parallelism.of(mesh=mesh).build().mesh is mesh
    # every axis of the table is a keyword of make_mesh (the context axis too)
    assert dict(make_mesh(context_axis=2).shape)["context"] == 2
    with pytest.raises(TypeError, match=r"make_mesh got unknown keyword\(s\) \['tensor_axis'\]"):
        make_mesh(tensor_axis=2)


def test_on_two_slices_the_data_axis_lines_up_the_slices():
    from redray.sharding.parallelism import _slices_grid

    devices = jax.devices()[:4]
    by_slice = {0: devices[:2], 1: devices[2:]}  # as two slices' slice_index would

    def grid(**sizes):
        shape = tuple(sizes.get(a.name, 1) for a in AXES)
        return np.vectorize(lambda d: d.id)(_slices_grid(by_slice, shape)).reshape(2, 2)

    # data=2 x fsdp=2: each slice holds a whole FSDP group, the data axis's peers across
    assert grid(data=2, fsdp=2).tolist() == [[0, 1], [2, 3]]
    # the data axis crosses the slices before stages do
    assert grid(stage=2, data=2).T.tolist() == [[0, 1], [2, 3]]
    # slices of unequal size are not laid out as slices
    assert _slices_grid({0: devices[:1], 1: devices[1:]}, (1, 4, 1, 1, 1, 1)) is None


def test_an_abstract_plan_needs_no_devices():
    plan = Parallelism.of(model_axis=8, fsdp_axis=2).abstract(64)
    assert isinstance(plan.mesh, AbstractMesh)
    assert plan.shape == {"stage": 1, "data": 4, "fsdp": 2, "expert": 1, "context": 1, "model": 8}
    g = plan.step_geometry(64, 16)
    assert (g.micro_batch_size, g.accumulation, g.process_rows) == (2, 4, slice(0, 64))
    # given to a Trainer, an abstract plan is built on the devices there are
    built = Parallelism.of(model_axis=2).abstract(4).build()
    assert built.mesh.devices.shape == (1, 2, 1, 1, 1, 2)
    with pytest.raises(ValueError, match="model_axis=8 does not divide the 4 devices"):
        plan.build()


def test_the_plan_value_describes_itself_in_one_line():
    """``Plan.describe`` is what the console prints after ``plan`` and MLflow tags as
    ``redray.plan``: the axes, the batch's cut, a pipeline's schedule, the remat policy."""
    from redray.sharding.plan import Plan

    flat = Parallelism.of(model_axis=8, fsdp_axis=2).abstract(64)
    assert Plan.of(flat, flat.step_geometry(64, 16)).describe() == \
        "data=4 x fsdp=2 x model=8, batch 64 = 2 per device x 4 accumulation steps"
    staged = Parallelism.of(stage_axis=4, model_axis=2).abstract(64)
    plan = Plan.of(staged, staged.step_geometry(64, 8), pipeline_schedule="1f1b", remat="full")
    assert plan.describe() == ("stage=4 x data=8 x fsdp=1 x model=2, batch 64 = 1 per device x "
                               "8 pipelined micro-batches, 1f1b, remat full")
    circular = dataclasses.replace(plan, pipeline_schedule="gpipe", stage_repeats=2, remat=None)
    assert circular.describe().endswith("pipelined micro-batches, gpipe x 2 repeats")
    assert Plan().describe() == "one device (no plan)"
    with pytest.raises(TypeError, match=r"trainer\.placement\(\)"):
        plan()  # what Trainer.plan() was: the placement table has its own name now


def test_a_plan_round_trips_through_json_equal_to_itself():
    """``Plan.to_json`` / ``from_json``: every part of a plan (its axes, rules, batch cut,
    pipeline, remat, context attention and hardware numbers) comes back equal; a plan
    over an abstract mesh (the planner's picks) as it was, a built one once rebuilt on
    the same devices; ``load`` reads ``redray plan --json``'s forms."""
    from redray.sharding.plan import Plan, load

    staged = Parallelism.of(stage_axis=2, model_axis=2, rules=[
        (r"wte", P(None, ("fsdp", "model"))), (r"lm_head", P())]).abstract(8)
    hardware = {"name": "H100 SXM", "intra": {"bandwidth": 4.5e11, "latency": 5e-6}}
    plans = [Plan.of(staged, staged.step_geometry(16, 4), pipeline_schedule="1f1b",
                     stage_repeats=2, remat="dots", context_attention="ring",
                     hardware=hardware),
             Plan(Parallelism.of(model_axis=2, data_axis="auto")),  # axes only, unbuilt
             Plan()]
    for plan in plans:
        back = Plan.from_json(plan.to_json())
        assert back == plan and back.to_dict() == plan.to_dict(), plan.describe()
    assert back.parallelism is None
    built = Plan.of(Parallelism.of(model_axis=2).build(),
                    Parallelism.of(model_axis=2).build().geometry(8, 1))
    assert Plan.from_json(built.to_json()) != built  # an abstract mesh, until built
    assert Plan.from_json(built.to_json()).build() == built
    # redray plan --json: a ranking (its best plan first), or one placement's plan
    ranked = {"plans": [{"plan": plans[0].to_dict(), "step_seconds": 1.0},
                        {"plan": built.to_dict()}]}
    assert load(ranked) == load(json.dumps(ranked)) == plans[0]
    assert load({"mesh": {}, "plan": built.to_dict()}).build() == built
    with pytest.raises(ValueError, match="axes \\['tensor'\\] that redray does not have"):
        Plan.from_dict({**built.to_dict(), "axes": {"tensor": 2}})
    with pytest.raises(ValueError, match="ranks no plan that fits"):
        load({"plans": []})
    with pytest.raises(ValueError, match="context_attention='ringg'"):
        Plan(context_attention="ringg")


def test_bad_plans_name_the_fix():
    with pytest.raises(TypeError, match="unknown keyword.*'tensor_axis'.*axis size.*model_axis"):
        Parallelism.of(tensor_axis=2)
    with pytest.raises(ValueError, match="model_axis=3 does not divide the 4 devices"):
        Parallelism.of(model_axis=3).build()
    with pytest.raises(ValueError, match="either mesh= or axis sizes"):
        Parallelism.of(mesh=make_mesh(), model_axis=2)
    plan = Parallelism.of(model_axis=2)
    with pytest.raises(ValueError, match="either parallelism= or model_axis, rules, not both"):
        Parallelism.resolve(plan, None, [("x", P())], dict(model_axis=4))
    with pytest.raises(TypeError, match="must be a redray.Parallelism"):
        Parallelism.resolve({"model_axis": 2}, None, (), {})
    with pytest.raises(ValueError, match="not built"):
        plan.data_parallel  # noqa: B018


def test_batch_geometry():
    plan = Parallelism.of(model_axis=2).build()  # 2 data-parallel devices
    g = plan.geometry(8, 2)
    assert (g.batch_size, g.data_parallel, g.micro_batch_size, g.accumulation) == (8, 2, 2, 2)
    assert g.micro_rows == 4 and g.process_rows == slice(0, 8) and g.groups == 1
    assert plan.geometry(8).accumulation == 1 and plan.geometry(8).micro_batch_size == 4
    with pytest.raises(ValueError, match="batch_size=7 does not split over the 2 data-parallel"):
        plan.geometry(7)
    with pytest.raises(ValueError, match="micro_batch_size=3 x 2 data-parallel devices = 6"):
        plan.geometry(8, 3)
    with pytest.raises(ValueError, match="micro batch 6 does not split over data x fsdp = 4"):
        Parallelism.of().abstract(4).step_geometry(12, 6)


class PinBiases(SpecPass):
    """A pass of a new parallelism: every bias no earlier pass split goes over ``fsdp``."""

    def __call__(self, draft):
        for i in draft.free():
            if draft.paths[i].endswith("bias") and draft.entries[i][0] is None \
                    and draft.shapes[i][0] % draft.size(FSDP.name) == 0:
                draft.entries[i][0] = FSDP.name


def test_a_new_parallelism_adds_a_pass_of_its_own():
    plan = Parallelism.of(fsdp_axis=2, model_axis=2).build()
    model = MLP(nnx.Rngs(0))
    _, state = nnx.split(model)
    x = jax.ShapeDtypeStruct((4, 16), jnp.float32)

    def fn(state, x):
        return nnx.merge(nnx.graphdef(model), state)(x)

    def specs(passes):
        out = derive_specs(state, plan.mesh, fn, (x,), passes=passes)
        paths, _, _ = flatten(state)
        return dict(zip(paths, jax.tree.leaves(out, is_leaf=lambda s: isinstance(s, P))))

    base = specs(plan.spec_passes())
    assert base["up/kernel"] == P("fsdp", "model") and base["up/bias"] == P("model")
    assert base["down/bias"] == P()
    more = specs((*plan.spec_passes(), PinBiases()))
    assert more["down/bias"] == P("fsdp") and more["up/bias"] == P("model")
    assert {k: v for k, v in more.items() if k != "down/bias"} == \
        {k: v for k, v in base.items() if k != "down/bias"}
    # a user rule is the first pass: no later pass changes what it set
    ruled = dataclasses.replace(plan, rules=((r"down/bias", P()),))
    assert specs((*ruled.spec_passes(), PinBiases()))["down/bias"] == P()


def test_a_trainer_given_a_plan_is_the_trainer_given_its_keywords(tmp_path, monkeypatch):
    from redray.sharding.plan import Plan

    def make(**options):
        t = redray.Trainer.of(lambda rngs: MLP(rngs), collate, loss, optax.sgd(0.1), batch_size=8,
                           progress=False, **options)
        history = t.fit(DATA, epochs=1)
        return t, [row["loss"] for row in history]

    by_keywords, a = make(model_axis=2, micro_batch_size=2)
    plan = Parallelism.of(model_axis=2)
    by_plan, b = make(plan=plan, micro_batch_size=2)
    assert a == b
    assert by_plan.parallelism.shape == by_keywords.parallelism.shape
    assert by_plan.runtime.specs == by_keywords.runtime.specs
    assert by_plan.geometry == by_keywords.geometry
    # the settings themselves: the same Trainer as its flat keywords
    settings = redray.Trainer(lambda rngs: MLP(rngs), collate, loss, optax.sgd(0.1),
                              batch_size=8, plan=redray.PlanSettings(
                                  axes={"model_axis": 2}, micro_batch_size=2),
                              report=redray.ReportSettings(progress=False))
    assert settings.plan == by_keywords.plan and not settings.progress
    # the whole plan written out and given back: the same plan, the same steps
    written, c = make(plan=by_keywords.plan.to_json())
    assert written.plan == by_keywords.plan and c == a

    def trainer(**options):
        return redray.Trainer.of(lambda rngs: MLP(rngs), collate, loss, optax.sgd(0.1),
                              **{"batch_size": 8, **options})

    with pytest.raises(ValueError, match="either plan= or model_axis"):
        trainer(plan=plan, model_axis=4)
    text = by_keywords.plan.to_json()
    with pytest.raises(ValueError, match="either plan= or micro_batch_size, model_axis"):
        trainer(plan=text, micro_batch_size=2, model_axis=2)
    with pytest.raises(ValueError, match="plan for batch_size=8, but batch_size=16"):
        trainer(plan=text, batch_size=16)
    with pytest.raises(ValueError, match="plan for 8 devices, but this run has 4"):
        trainer(plan=Plan(Parallelism.of(model_axis=2).abstract(8)).to_json())
    with pytest.raises(ValueError, match="neither 'auto', JSON, nor a file"):
        trainer(plan="plan.jsn")
    with pytest.raises(ValueError, match="not a written redray plan"):
        trainer(plan={"axes": {"model": 2}})
    with pytest.raises(TypeError, match="takes the plan as plan="):
        trainer(parallelism=plan)
    # redray run --plan FILE: the script's Trainers run on it where they would choose one
    (tmp_path / "plan.json").write_text(text)
    monkeypatch.setenv("REDRAY_PLAN", str(tmp_path / "plan.json"))
    assert trainer().plan == by_keywords.plan == trainer(plan="auto").plan
    assert trainer(plan=text).plan == by_keywords.plan  # the same plan given twice
    with pytest.raises(ValueError, match="REDRAY_PLAN .* also gives model_axis: drop them"):
        trainer(model_axis=4)
    with pytest.raises(ValueError, match="REDRAY_PLAN .* gives another as plan="):
        trainer(plan=plan)
    with pytest.raises(TypeError, match=r"Trainer got unknown keyword\(s\) \['lerning_rate'\]"):
        redray.Trainer.of(lambda rngs: MLP(rngs), collate, loss, optax.sgd(0.1), batch_size=8,
                       lerning_rate=0.1)
