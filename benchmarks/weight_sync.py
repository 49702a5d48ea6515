"""The trainer-to-sampler weight transfer of separate roles (``rl/weight_sync_over_memcpy``).

Two Ray nodes (``ray.cluster_utils.Cluster``: two raylets and object stores on this
machine, the bytes between them through Ray's object manager over TCP, as between two
hosts): the trainer is this driver on the head node, a ``SamplerGroup`` replica is
placed on the second node. ``SamplerGroup.update_weights`` is timed whole: the
trainer's parameters copied to the host, put into the head's object store, pulled by the
second node, placed on the replica's device, acknowledged. The reference is a local
memory copy of the same bytes (``np.copyto`` of one buffer of their size, the machine's
memcpy). The figure is the transfer's bandwidth over memcpy's (the memcpy's seconds
over the transfer's); medians of ``--repeats`` after a warm-up, their spread beside.
Beside it, to explain it: the same sync to a replica on the trainer's own node (no
transfer between nodes), and the trainer's parts of it (the copy to the host, the put).

    python benchmarks/weight_sync.py [--repeats 5]
"""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import figure, parser, repeat, save, stats  # noqa: E402

import numpy as np  # noqa: E402

COMMAND = "python benchmarks/weight_sync.py"
# a LLaMA of 4 layers, 1024 wide, vocabulary 8000: ~67M float32 parameters (~270 MB)
FULL = dict(vocab_size=8000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
            num_attention_heads=8)
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
            num_attention_heads=4)


def model_fn(size: dict):
    def build_model(rngs):
        from transformers import LlamaConfig

        from redray.models import build

        return build(LlamaConfig(max_position_embeddings=64, **size), rngs=rngs)
    return build_model


def main(argv=None) -> None:
    ap = parser(__doc__)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    size = TINY if args.tiny else FULL
    repeats = 2 if args.tiny else args.repeats
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import ray
    from flax import nnx
    from ray.cluster_utils import Cluster
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from redray.post_training import SamplerGroup
    from redray.post_training.remote import _host_copy

    store = 2 << 30 if not args.tiny else 256 << 20
    cluster = Cluster(initialize_head=True, head_node_args=dict(
        num_cpus=2, object_store_memory=store, include_dashboard=False))
    cluster.add_node(num_cpus=2, resources={"sampler_node": 1}, object_store_memory=store)
    try:
        ray.init(address=cluster.address, log_to_driver=False)
        build_model = model_fn(size)
        trained = build_model(nnx.Rngs(1))
        group = SamplerGroup(build_model, slots=2, max_length=32,
                             actor_options={"resources": {"sampler_node": 1}})
        node = ray.get(group.replicas[0].__ray_call__.remote(
            lambda self: ray.get_runtime_context().get_node_id()))
        assert node != ray.get_runtime_context().get_node_id(), "the replica is on the head"
        syncs = [group.update_weights(trained) for _ in range(repeats + 1)][1:]
        nbytes = syncs[0].bytes
        group.shutdown()
        # the same on the trainer's node (no transfer between nodes), and the parts on
        # the trainer's side: the copy to the host, the put into the object store
        near = SamplerGroup(build_model, slots=2, max_length=32, actor_options={
            "scheduling_strategy": NodeAffinitySchedulingStrategy(
                ray.get_runtime_context().get_node_id(), soft=False)})
        same_node = [near.update_weights(trained).seconds for _ in range(repeats + 1)][1:]
        near.shutdown()
        leaves = jax.tree.leaves(nnx.state(trained, nnx.Param))
        to_host = repeat(lambda: [_host_copy(x) for x in leaves], repeats)
        host = [_host_copy(x) for x in leaves]
        put = repeat(lambda: ray.put(host), repeats)
        src, dst = np.ones(nbytes, np.uint8), np.zeros(nbytes, np.uint8)
        copies = []
        for _ in range(repeats + 1):
            start = time.perf_counter()
            np.copyto(dst, src)
            copies.append(time.perf_counter() - start)
        copies = copies[1:]
        sync_s = [s.seconds for s in syncs]
        ratio = float(np.median(copies) / np.median(sync_s))
    finally:
        ray.shutdown()
        cluster.shutdown()
    params = sum(x.size for x in jax.tree.leaves(nnx.state(trained, nnx.Param)))
    save([figure(
        "rl/weight_sync_over_memcpy", ratio, "x",
        "a local memory copy of the same bytes (np.copyto of one buffer)", None, COMMAND,
        parameters=int(params), bytes=int(nbytes), sync_seconds=stats(sync_s),
        memcpy_seconds=stats(copies), same_node_sync_seconds=stats(same_node),
        to_host_seconds=stats(to_host), object_store_put_seconds=stats(put),
        sync_gb_per_s=nbytes / np.median(sync_s) / 1e9,
        memcpy_gb_per_s=nbytes / np.median(copies) / 1e9,
        setup="two Ray nodes on one machine (ray.cluster_utils.Cluster), the trainer on the "
              "head, one SamplerGroup replica on the other; float32")], args.out)


if __name__ == "__main__":
    main()
