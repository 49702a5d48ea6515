"""Layer parameters tensor parallelism leaves whole are never left silently: the rules
say why and the fix (``rules.Whole``), ``Trainer`` warns at init for the large ones,
``Trainer.placement()`` and ``redray plan`` list them."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import redray
from redray.planning.from_config import format_model_plan, plan_model
from redray.sharding import derive_specs, flatten, make_mesh


class GatedMLP(nnx.Module):
    def __init__(self, hidden, width, rngs):
        self.gate = nnx.Linear(hidden, width, use_bias=False, rngs=rngs)
        self.up = nnx.Linear(hidden, width, use_bias=False, rngs=rngs)
        self.down = nnx.Linear(width, hidden, use_bias=False, rngs=rngs)
        self.head = nnx.Linear(hidden, 2, rngs=rngs)

    def __call__(self, x):
        return self.head(self.down(nnx.silu(self.gate(x)) * self.up(x)))


def collate(examples):
    return {"x": np.stack([e["x"] for e in examples]),
            "label": np.array([e["label"] for e in examples])}


def loss(model, batch, rng, train):
    return optax.softmax_cross_entropy_with_integer_labels(model(batch["x"]),
                                                           batch["label"]).mean()


DATA = [{"x": np.full(32, i, np.float32), "label": i % 2} for i in range(8)]


def trainer(width: int, model_axis: int = 2, **options) -> redray.Trainer:
    return redray.Trainer.of(lambda rngs: GatedMLP(32, width, rngs), collate, loss,
                          optax.sgd(0.1), batch_size=8, model_axis=model_axis, progress=False,
                          **options)


def spec_of(t: redray.Trainer, path: str) -> P:
    paths = flatten(t.runtime.abstract[0])[0]
    specs = jax.tree.leaves(t.runtime.specs[0], is_leaf=lambda x: isinstance(x, P))
    return dict(zip(paths, specs))[path]


def test_an_indivisible_width_is_named_with_the_size_that_would_split():
    t = trainer(341)
    with pytest.warns(UserWarning, match="not split over the model axis") as caught:
        t.init(DATA)
    text = str(caught[0].message)
    for path in ("gate/kernel (32, 341)", "up/kernel (32, 341)"):
        assert f"{path}: no output dimension (341) divides by the model axis 2; fix: make " \
            "a size divisible by 2 (e.g. 342 for 341)" in text
    # gate and up whole, nothing feeds down a split input: it is split as a column
    # layer itself (its 32 outputs), and the head after it as a row
    assert "down/kernel" not in text
    assert spec_of(t, "down/kernel") == P(None, "model")
    plan = t.placement()
    assert "left whole over the model axis (2):\n  gate/kernel (32, 341)" in plan


def test_a_divisible_model_warns_nothing():
    t = trainer(344)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        t.init(DATA)
    assert t.runtime.costly_whole() == []
    assert "left whole over the model axis (2):" in t.placement()  # the head, as intended
    assert spec_of(t, "gate/kernel") == P(None, "model")
    assert spec_of(t, "down/kernel") == P("model")


def test_a_user_rule_is_not_second_guessed():
    t = trainer(341, rules=[(r"(gate|up)/kernel", P(None, None)), (r"down/kernel", P())])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        t.init(DATA)
    assert t.runtime.whole == [w for w in t.runtime.whole if w.path == "head/kernel"]


def test_derive_specs_reports_a_contiguous_qkv_cut():
    class Attention(nnx.Module):
        def __init__(self, rngs):
            self.qkv = nnx.Linear(64, 192, rngs=rngs)
            self.out = nnx.Linear(64, 64, rngs=rngs)

        def __call__(self, x):
            b, t, _ = x.shape
            q, k, v = (a.reshape(b, t, 4, 16) for a in jnp.split(self.qkv(x), 3, -1))
            s = jnp.einsum("bqhd,bkhd->bhqk", q, k)
            return self.out(jnp.einsum("bhqk,bkhd->bqhd", s, v).reshape(b, t, 64))

    graphdef, state = nnx.split(Attention(nnx.Rngs(0)))
    whole: list = []
    derive_specs(state, make_mesh(model_axis=4),
                 lambda st, x: nnx.merge(graphdef, st)(x).sum(), (jnp.ones((2, 8, 64)),),
                 whole=whole)
    (w,) = [w for w in whole if w.path == "qkv/kernel"]
    assert w.shape == (64, 192) and not w.by_design
    assert "sliced along dimension 1 (size 192)" in w.reason
    assert "(hidden, 3, heads, head_dim)" in w.fix


def test_redray_plan_says_why_a_matrix_is_replicated():
    # matrices under 1M elements (larger ones are sharded over model like FSDP instead)
    fields = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 683,
              "num_hidden_layers": 1, "num_attention_heads": 8, "vocab_size": 1024}
    result = plan_model(fields, 4, 4, replicated_min_bytes=0)
    rows = {r["path"]: r for r in result["replicated"]}
    gate_up = rows["layers/mlp/gate_up_proj/kernel"]  # stacked layers, the default
    # (hidden, 2, intermediate): the gate|up axis is sliced, so only 683 could split
    assert gate_up["why"] == "no output dimension (683) divides by the model axis 4"
    assert gate_up["fix"].startswith("make a size divisible by 4 (e.g. 684 for 683)")
    assert rows["norm/scale"]["why"] is None  # a vector: not a layer matrix
    assert "    no output dimension (683) divides by the model axis 4; fix: make " \
        in format_model_plan(result, "odd")
