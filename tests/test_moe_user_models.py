"""The user-written mixture-of-experts LMs of ``communication/moe_tp``
(benchmarks/_others.py: experts stacked in einsum kernels, or a list of expert modules)
give, in redray's real step on a 4-way model axis, with the automatic specs or the
hand-written Megatron ones, the loss they give unsharded on one device."""

from __future__ import annotations

import os
import sys

import jax
import numpy as np
import pytest
from flax import nnx

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "benchmarks"))
import _others  # noqa: E402
import communication  # noqa: E402


@pytest.mark.parametrize("megatron", [False, True], ids=["automatic", "megatron"])
@pytest.mark.parametrize("kind", list(_others.MOE_LMS))
def test_sharded_step_loss_is_the_one_device_loss(kind, megatron):
    s = communication.TINY
    rules = _others.MOE_MEGATRON_RULES[kind] if megatron else ()
    trainer, data = communication.moe_setup(kind, s, rules)
    trainer.init(data)
    graphdef, state = nnx.split(trainer.model)
    model = nnx.merge(graphdef, jax.device_put(jax.device_get(state), jax.devices()[0]))
    batch = communication.collate(data)
    _, loss = _others.moe_lm(kind, s)
    want = loss(model, batch, None, False)
    got = trainer.train_step(batch)["loss"]
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5)
