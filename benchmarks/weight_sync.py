"""The trainer-to-sampler weight transfer of separate roles (``rl/weight_sync_over_memcpy``).

Two Ray nodes (``ray.cluster_utils.Cluster``: two raylets and object stores on this
machine, as two hosts; the bytes between them over TCP on the loopback): the trainer
is this driver on the head node, a ``SamplerGroup`` replica is placed on the second
node. ``SamplerGroup.update_weights`` is timed whole, from the trainer's arrays to the
replica's devices, acknowledged, on its two paths side by side, round by round:
"direct" (the default: the replica pulls the arrays from a JAX transfer server in the
trainer's process) and "object_store" (copied to the host, put into the head's object
store, pulled by the second node's, placed on the replica's device). The reference is
a local memory copy of the same bytes (``np.copyto`` of one buffer of their size, the
machine's memcpy). The figure is the direct transfer's bandwidth over memcpy's (the
memcpy's seconds over the transfer's); medians of ``--repeats`` after a warm-up, their
spread beside. Beside it, to explain it: the ceiling of any path over TCP here (the
same bytes sent over one plain socket from this driver to an actor on the second
node), the direct sync to a replica on the trainer's own node, and the object-store
path's parts on the trainer (the copy to the host, the put).

    python benchmarks/weight_sync.py [--repeats 7]
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


class Sink:
    """A Ray actor receiving bytes over one plain TCP socket (the ceiling of a transfer
    over TCP between the two nodes)."""

    def listen(self) -> tuple:
        import socket

        import ray

        self.server = socket.socket()
        self.server.bind((ray.util.get_node_ip_address(), 0))
        self.server.listen(1)
        return self.server.getsockname()

    def receive(self, nbytes: int, times: int) -> None:
        conn, _ = self.server.accept()
        view = memoryview(bytearray(nbytes))
        for _ in range(times):
            got = 0
            while got < nbytes:
                got += conn.recv_into(view[got:], nbytes - got)
            conn.sendall(b"k")
        conn.close()


def tcp_seconds(address: tuple, nbytes: int, times: int) -> list:
    import socket

    data = memoryview(np.ones(nbytes, np.uint8))
    sock = socket.create_connection(address)
    out = []
    for _ in range(times):
        start = time.perf_counter()
        sock.sendall(data)
        sock.recv(1)
        out.append(time.perf_counter() - start)
    sock.close()
    return out


def main(argv=None) -> None:
    ap = parser(__doc__)
    ap.add_argument("--repeats", type=int, default=7)
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
    cluster.add_node(num_cpus=2, resources={"sampler_node": 3}, object_store_memory=store)
    try:
        ray.init(address=cluster.address, log_to_driver=False)
        build_model = model_fn(size)
        trained = build_model(nnx.Rngs(1))
        here = ray.get_runtime_context().get_node_id()
        other = {"resources": {"sampler_node": 1}}
        direct = SamplerGroup(build_model, slots=2, max_length=32, actor_options=other)
        store = SamplerGroup(build_model, slots=2, max_length=32, actor_options=other,
                             weights_via="object_store")
        for group in (direct, store):
            node = ray.get(group.replicas[0].__ray_call__.remote(
                lambda self: ray.get_runtime_context().get_node_id()))
            assert node != here, "the replica is on the head"
        direct_s, store_s = [], []
        for _ in range(repeats + 1):  # side by side, round by round
            sync = direct.update_weights(trained)
            assert sync.path == "direct", sync
            direct_s.append(sync.seconds)
            store_s.append(store.update_weights(trained).seconds)
        direct_s, store_s, nbytes = direct_s[1:], store_s[1:], sync.bytes
        direct.shutdown()
        store.shutdown()
        # the same on the trainer's node (no transfer between nodes)
        near = SamplerGroup(build_model, slots=2, max_length=32, actor_options={
            "scheduling_strategy": NodeAffinitySchedulingStrategy(here, soft=False)})
        same_node = [near.update_weights(trained).seconds for _ in range(repeats + 1)][1:]
        near.shutdown()
        # one plain socket to the other node: the most any path over TCP gets here
        sink = ray.remote(Sink).options(num_cpus=0, **other).remote()
        address = ray.get(sink.listen.remote())
        receiving = sink.receive.remote(nbytes, repeats + 1)
        tcp = tcp_seconds(address, nbytes, repeats + 1)[1:]
        ray.get(receiving)
        # the object-store path's parts on the trainer: the copy to the host, the put
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
        ratio = float(np.median(copies) / np.median(direct_s))
    finally:
        ray.shutdown()
        cluster.shutdown()
    params = sum(x.size for x in jax.tree.leaves(nnx.state(trained, nnx.Param)))
    gb = lambda seconds: nbytes / np.median(seconds) / 1e9  # noqa: E731
    save([figure(
        "rl/weight_sync_over_memcpy", ratio, "x",
        "a local memory copy of the same bytes (np.copyto of one buffer)", ">= 0.25",
        COMMAND, parameters=int(params), bytes=int(nbytes), sync_seconds=stats(direct_s),
        memcpy_seconds=stats(copies), object_store_sync_seconds=stats(store_s),
        object_store_over_memcpy=float(np.median(copies) / np.median(store_s)),
        tcp_socket_seconds=stats(tcp),
        tcp_socket_over_memcpy=float(np.median(copies) / np.median(tcp)),
        same_node_sync_seconds=stats(same_node), to_host_seconds=stats(to_host),
        object_store_put_seconds=stats(put), sync_gb_per_s=gb(direct_s),
        object_store_gb_per_s=gb(store_s), tcp_socket_gb_per_s=gb(tcp),
        memcpy_gb_per_s=gb(copies),
        setup="two Ray nodes on one machine (ray.cluster_utils.Cluster), the trainer on the "
              "head, one SamplerGroup replica on the other; float32; direct: the replica "
              "pulls from the trainer's JAX transfer server")], args.out)


if __name__ == "__main__":
    main()
