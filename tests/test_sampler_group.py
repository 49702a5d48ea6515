"""Samplers on Ray actors of their own (``SamplerGroup``): on the weights the trainer
sends, they complete requests as a Sampler in this process does, token for token, the
split over replicas and devices changing nothing; a batch submitted before an update
keeps the weights it was submitted on; weights in another dtype arrive as that dtype;
weights of another model are refused with the fix. The weights go directly (pulled
from the trainer's JAX transfer server by each replica), also to a replica on another
Ray node, and through Ray's object store where they cannot, to the same tokens."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import transformers
from flax import nnx

from redray.models import build
from redray.post_training import RewardError, Sampler, SamplerGroup, SamplingParams, score

pytestmark = pytest.mark.ray  # Ray actors, on two Ray nodes (local_ray below)

CONFIG = transformers.LlamaConfig(
    vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, eos_token_id=5)
LENGTH = 40


@pytest.fixture(scope="module")
def local_ray():
    """Two Ray nodes on this machine (``ray.cluster_utils.Cluster``: two raylets and
    object stores, as two hosts), the second offering ``other_node``: the module's
    replicas run on either, one test's on the second by that resource."""
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args=dict(
        num_cpus=2, include_dashboard=False, object_store_memory=128 << 20))
    cluster.add_node(num_cpus=2, resources={"other_node": 2}, object_store_memory=128 << 20)
    ray.init(address=cluster.address, log_to_driver=False)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def builder():
    """The model function: nested, so that Ray ships it by value (an actor process
    cannot import this test module)."""
    def model_fn(rngs):
        return build(CONFIG, rngs=rngs)
    return model_fn


model_fn = builder()


def same(remote, local):
    assert [c.request_id for c in remote] == [c.request_id for c in local]
    for r, m in zip(remote, local):
        assert r.tokens.tolist() == m.tokens.tolist() and r.finish_reason == m.finish_reason
        np.testing.assert_allclose(r.logprobs, m.logprobs, rtol=1e-4, atol=1e-5)


def test_replicas_complete_as_a_local_sampler_on_the_weights_sent(local_ray):
    rs = np.random.default_rng(0)
    prompts = [rs.integers(6, 61, rs.integers(1, 9)).tolist() for _ in range(10)]
    ids = list(range(100, 110))
    trained = model_fn(nnx.Rngs(1))  # not the replicas' own initial weights (seed 0)
    group = SamplerGroup(model_fn, replicas=2, devices_per_replica=2, slots=4,
                         max_length=LENGTH)
    try:
        sync = group.update_weights(trained)
        params = nnx.state(trained, nnx.Param)
        assert sync.bytes == sum(x.nbytes for x in jax.tree.leaves(params))
        assert sync.path == "direct"  # pulled onto one device, copied to the other there
        local = Sampler(trained, slots=3, max_length=LENGTH)
        for how in (SamplingParams(max_new_tokens=8),
                    SamplingParams(max_new_tokens=8, temperature=1.0, top_k=20)):
            same(group.sample(prompts, how, request_ids=ids),
                 local.sample(prompts, how, request_ids=ids))
        # submitted before an update: sampled on the weights it was submitted on
        greedy = SamplingParams(max_new_tokens=8)
        before = local.sample(prompts, greedy)
        pending = group.submit(prompts, greedy)
        newer = jax.tree.map(lambda x: x * 1.5, params)
        group.update_weights(newer)
        same(pending.result(), before)
        local.update_weights(nnx.merge_state(nnx.state(trained), newer))
        after = local.sample(prompts, greedy)
        assert [c.tokens.tolist() for c in after] != [c.tokens.tolist() for c in before]
        same(group.sample(prompts, greedy), after)
        # another model's weights: refused, naming the fix
        other = build(transformers.LlamaConfig(**{**CONFIG.to_dict(), "hidden_size": 48}),
                      rngs=nnx.Rngs(0))
        with pytest.raises(ValueError, match="parameter .* the sampler's model holds .* "
                                             "model_fn"):
            group.update_weights(other)
    finally:
        group.shutdown()


def test_a_replica_over_two_processes_completes_as_a_local_sampler(local_ray):
    """hosts_per_replica=2: one replica's 2 actors form a JAX runtime of their own, the
    model and cache split over its 4 devices, both running the Sampler's loop."""
    rs = np.random.default_rng(1)
    prompts = [rs.integers(6, 61, rs.integers(1, 9)).tolist() for _ in range(6)]
    trained = model_fn(nnx.Rngs(1))
    with pytest.raises(ValueError, match="devices_per_replica=3 does not split over "
                                         "hosts_per_replica=2"):
        SamplerGroup(model_fn, devices_per_replica=3, hosts_per_replica=2, max_length=LENGTH)
    group = SamplerGroup(model_fn, hosts_per_replica=2, devices_per_replica=4, slots=4,
                         max_length=LENGTH)
    try:
        assert ray_get(group.replicas[0].devices.remote()) == 4  # of both processes
        assert group.update_weights(trained).path == "object_store"  # no direct pull
        group.weights_via = "direct"
        with pytest.raises(ValueError, match="weights_via='direct' cannot run: a replica "
                                             "cannot pull directly .* weights_via='auto'"):
            group.update_weights(trained)
        local = Sampler(trained, slots=4, max_length=LENGTH)
        how = SamplingParams(max_new_tokens=8, temperature=1.0)
        same(group.sample(prompts, how), local.sample(prompts, how))
    finally:
        group.shutdown()


def test_a_replica_on_another_node_pulls_sharded_weights_as_the_object_store_sends(
        local_ray):
    """A replica on the second Ray node, its weights split over its 2 devices by a
    model axis: each pulls its shards straight from this process's transfer server;
    the same replica fed through the object store samples the same tokens."""
    import ray

    from redray.sharding import Parallelism

    with pytest.raises(ValueError, match="weights_via='nccl': give one of"):
        SamplerGroup(model_fn, weights_via="nccl", max_length=LENGTH)
    rs = np.random.default_rng(2)
    prompts = [rs.integers(6, 61, rs.integers(1, 9)).tolist() for _ in range(6)]
    trained = model_fn(nnx.Rngs(1))
    how = SamplingParams(max_new_tokens=8, temperature=1.0)
    group = SamplerGroup(model_fn, devices_per_replica=2, slots=4, max_length=LENGTH,
                         parallelism=Parallelism.of(model_axis=2), weights_via="direct",
                         actor_options={"resources": {"other_node": 1}})
    try:
        node = ray.get(group.replicas[0].__ray_call__.remote(
            lambda self: ray.get_runtime_context().get_node_id()))
        assert node != ray.get_runtime_context().get_node_id()
        wire = ray.get(group.replicas[0].wire.remote())
        assert any(w is not None for w in wire)  # some weights travel in shards
        sync = group.update_weights(trained)
        assert sync.path == "direct"
        assert sync.bytes == sum(x.nbytes for x in jax.tree.leaves(nnx.state(trained,
                                                                             nnx.Param)))
        direct = group.sample(prompts, how)
        group.weights_via = "object_store"
        assert group.update_weights(model_fn(nnx.Rngs(3))).path == "object_store"
        assert [c.tokens.tolist() for c in group.sample(prompts, how)] != \
            [c.tokens.tolist() for c in direct]
        group.update_weights(trained)
        same(group.sample(prompts, how), direct)
        same(direct, Sampler(trained, slots=4, max_length=LENGTH).sample(prompts, how))
    finally:
        group.shutdown()


def ray_get(ref):
    import ray

    return ray.get(ref)


def test_weights_are_sent_in_the_dtype_asked_for(local_ray):
    trained = model_fn(nnx.Rngs(1))
    group = SamplerGroup(model_fn, dtype=jnp.bfloat16, slots=2, max_length=LENGTH)
    try:
        sync = group.update_weights(trained)
        params = nnx.state(trained, nnx.Param)
        assert sync.bytes == sum(x.size * 2 for x in jax.tree.leaves(params))
        halved = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
        local = Sampler(trained, slots=2, max_length=LENGTH)
        local.update_weights(nnx.merge_state(nnx.state(trained), halved))
        prompts = [[7, 8, 9], [10, 11]]
        same(group.sample(prompts, SamplingParams(max_new_tokens=6)),
             local.sample(prompts, SamplingParams(max_new_tokens=6)))
    finally:
        group.shutdown()


def test_the_grpo_example_trains_alike_with_its_sampler_on_an_actor(local_ray, tmp_path,
                                                                    monkeypatch):
    """The example's loop in this process, colocated, then with its sampler on an actor
    and its rewards on Ray tasks: the same samples (each request keyed by its id), so
    the same rewards and training."""
    from example_runs import example_module, run_loop

    g = example_module("grpo")
    made = g.row
    # a reward that varies within every group at this size (an untrained model rarely
    # adds right), so that the samples' advantages train the model
    monkeypatch.setattr(g, "reward", lambda pair, message: float(sum(map(ord, message or "?")) % 2))

    def recording(into):
        def row(pair, completion, old_logp=None, advantage=1.0):
            if old_logp is not None:  # a sample
                into.append((int(pair), [int(t) for t in completion], np.asarray(old_logp)))
            return made(pair, completion, old_logp, advantage)
        return row

    tiny = ["--warmup", "1", "--prompts", "4", "--group", "4", "--iterations", "2"]
    here_rows, apart_rows = [], []
    monkeypatch.setattr(g, "row", recording(here_rows))
    _, here, here_log = run_loop(g, "grpo", tiny, tmp_path / "here", monkeypatch)
    monkeypatch.setattr(g, "row", recording(apart_rows))
    _, apart, apart_log = run_loop(
        g, "grpo", [*tiny, "--sampler-replicas", "1", "--reward-workers", "2"],
        tmp_path / "apart", monkeypatch)
    assert len(here_rows) == 2 * 16
    assert [r[:2] for r in here_rows] == [r[:2] for r in apart_rows]  # the same samples
    for (_, _, a), (_, _, b) in zip(here_rows, apart_rows):  # decoded on other devices
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    rewards = [r["reward"] for r in here_log if "reward" in r]
    assert len(rewards) == 2 and all(0 < r < 1 for r in rewards)
    assert rewards == [r["reward"] for r in apart_log if "reward" in r]
    assert [sorted(r) for r in here_log] == [sorted(r) for r in apart_log]
    for a, b in zip(here_log, apart_log):  # losses, held-out accuracies: to rounding
        np.testing.assert_allclose([a[k] for k in sorted(a)], [b[k] for k in sorted(b)],
                                   rtol=1e-4, atol=1e-6)
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-6),
                 jax.device_get(here.state.params), jax.device_get(apart.state.params))


def test_rewards_are_scored_on_ray_tasks_in_the_rows_order(local_ray):
    import os

    def pid_reward(a, b):  # nested: shipped by value
        import os

        if a == 13:
            raise KeyError("no verifier for 13")
        return float(os.getpid()) if b == "pid" else float(a + len(b))

    prompts, answers = list(range(9)), ["x" * i for i in range(9)]
    here = score(pid_reward, prompts, answers)
    assert here.dtype == np.float32 and here.tolist() == [2.0 * i for i in range(9)]
    assert score(pid_reward, prompts, answers, workers=2).tolist() == here.tolist()
    pids = set(score(pid_reward, [0] * 4, ["pid"] * 4, workers=2).tolist())
    assert os.getpid() not in pids and 1 <= len(pids) <= 2  # other processes
    with pytest.raises(RewardError, match=r"failed on row 13 \(13, 'b'\): KeyError"):
        score(pid_reward, list(range(16)), ["b"] * 16, workers=2)
    with pytest.raises(RewardError, match="returned nan for row 1"):
        score(lambda a: a, [0.0, float("nan")])
    with pytest.raises(ValueError, match="lengths \\[1, 2\\]"):
        score(pid_reward, [1], ["a", "b"])


def test_the_grpo_example_overlapped_resumes_on_the_rollouts_it_drew(local_ray, tmp_path,
                                                                      monkeypatch):
    """--overlap: the next iteration's rollouts are sampled while this one trains, on
    weights one update older, and kept in the checkpoint; a run stopped after its first
    iteration (as a kill would leave it: the next rollouts drawn) resumes on those very
    rollouts, so it ends as the run that never stopped."""
    from example_runs import example_module, run_loop

    g = example_module("grpo")
    monkeypatch.setattr(g, "reward", lambda pair, message: float(sum(map(ord, message or "?")) % 2))
    tiny = ["--warmup", "1", "--prompts", "4", "--group", "4", "--sampler-replicas", "1",
            "--overlap"]
    with pytest.raises(SystemExit):  # overlapping needs samplers of their own
        g.parse(["--overlap"])
    whole, trainer, whole_log = run_loop(g, "grpo", [*tiny, "--iterations", "2"],
                                         tmp_path / "whole", monkeypatch)
    assert whole == {"first_epoch": 0, "step": 3}
    first, _, _ = run_loop(g, "grpo", [*tiny, "--iterations", "1"], tmp_path / "stopped",
                           monkeypatch)
    assert first["step"] == 2
    again, resumed, again_log = run_loop(g, "grpo", [*tiny, "--iterations", "2"],
                                         tmp_path / "stopped", monkeypatch)
    assert again == {"first_epoch": 2, "step": 3}
    # the checkpoint of step 2 held the rollouts of iteration 2 (epoch 2), drawn on the
    # weights before iteration 1's update
    assert list(resumed.resumed_from["run"]["rollouts"]) == ["2"]
    assert again_log == whole_log[-len(again_log):]  # the same samples and rewards
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(resumed.state.params),
                 jax.device_get(trainer.state.params))
