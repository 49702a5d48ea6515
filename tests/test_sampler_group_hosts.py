"""A SamplerGroup and ``score`` under a trainer of 2 hosts (``redray.run``, 2 simulated
hosts x 2 devices): the parameters, sharded over both hosts, are gathered and sent by
host 0, and every host gets the completions and rewards that host 0 asked for; and a
Sampler colocated on the trainer's mesh over both hosts completes them alike."""

import numpy as np
import optax
import pytest
import transformers

import redray

pytestmark = pytest.mark.ray  # a local Ray cluster

ray = pytest.importorskip("ray")

CONFIG = transformers.LlamaConfig(
    vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, eos_token_id=5)


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    # 2 hosts, the sampler's actor, a reward task
    ray.init(address="local", num_cpus=6, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def builder():
    def model_fn(rngs):  # nested: Ray ships it by value to the sampler's process
        from redray.models import build

        return build(CONFIG, rngs=rngs)
    return model_fn


def loop():
    import jax
    from flax import nnx
    from jax.experimental import multihost_utils

    from redray.post_training import Sampler, SamplerGroup, SamplingParams, score

    model_fn = builder()

    def loss(model, batch, rng, train):
        return (model(batch["ids"], train=train) ** 2).mean()

    data = [{"ids": np.arange(8, dtype=np.int32) + i} for i in range(8)]
    trainer = redray.Trainer.of(model_fn, lambda rows: {"ids": np.stack([r["ids"] for r in rows])},
                             loss, optax.sgd(0.0), batch_size=8, fsdp_axis=4, seed=3,
                             progress=False, checkpoint=False)
    trainer.init(data)
    sharded = [x for x in jax.tree.leaves(nnx.state(trainer.model, nnx.Param))
               if not x.is_fully_addressable]
    assert sharded, "no parameter is split over the hosts: the gather is not exercised"
    group = SamplerGroup(model_fn, slots=4, max_length=32)
    sync = group.update_weights(trainer.model)
    prompts = [[7, 8, 9], [10, 11], [12], [13, 14, 15, 16]]
    how = SamplingParams(max_new_tokens=6, temperature=1.0)
    done = group.sample(prompts, how, request_ids=[4, 5, 6, 7])
    rewards = score(lambda p, t: float(len(t) + p[0]), prompts, [c.tokens for c in done],
                    workers=1)
    # what this host holds: host 0's completions, as a Sampler here makes them
    gathered = jax.tree.map(
        lambda x: np.asarray(multihost_utils.process_allgather(x, tiled=True)),
        nnx.state(trainer.model, nnx.Param))
    local = model_fn(nnx.Rngs(0))
    nnx.update(local, gathered)
    mine = Sampler(local, slots=4, max_length=32).sample(prompts, how, request_ids=[4, 5, 6, 7])
    assert len(done) == len(mine) == len(prompts)
    for c, m in zip(done, mine):
        assert c.tokens.tolist() == m.tokens.tolist() and c.request_id == m.request_id
        np.testing.assert_allclose(c.logprobs, m.logprobs, rtol=1e-4, atol=1e-5)
    assert rewards.tolist() == [len(c.tokens) + p[0] for p, c in zip(prompts, done)]
    # colocated on the trainer's own mesh over both hosts: every host runs the Sampler's
    # loop, the cache split over the 4 devices of 2 processes
    together = Sampler(trainer.model, slots=4, max_length=32)
    assert together.placement.spmd
    for c, m in zip(together.sample(prompts, how, request_ids=[4, 5, 6, 7]), mine):
        assert c.tokens.tolist() == m.tokens.tolist()
        np.testing.assert_allclose(c.logprobs, m.logprobs, rtol=1e-4, atol=1e-5)
    # more prompts than slots: refilled inside one compiled call over both hosts, as the
    # host refills them here
    more, ids = prompts + [[17, 18], [19, 20, 21]], list(range(4, 10))
    here = Sampler(local, slots=4, max_length=32, refill_on_device=False).sample(
        more, how, request_ids=ids)
    for c, m in zip(together.sample(more, how, request_ids=ids), here):
        assert c.tokens.tolist() == m.tokens.tolist()
        np.testing.assert_allclose(c.logprobs, m.logprobs, rtol=1e-4, atol=1e-5)
    group.shutdown()
    return {"host": jax.process_index(), "bytes": sync.bytes, "lengths": [len(c.tokens)
                                                                            for c in done]}


def test_every_host_gets_what_host_0_sampled_on_the_gathered_weights(tmp_path):
    result = redray.run(loop, hosts=2, devices_per_host=2, name="sampling",
                        storage_path=str(tmp_path), checkpoint=False)
    assert result.value["host"] == 0 and result.value["bytes"] > 0
    assert all(1 <= n <= 6 for n in result.value["lengths"])
