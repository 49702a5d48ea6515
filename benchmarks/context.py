"""Context parallelism, read from XLA's compiled steps: how much longer a sequence fits,
the activation bytes per device, and the ring's bytes against its formula.

Every figure compiles the loss-and-gradient step of a LLaMA-shaped model (float32,
stacked layers, ``remat="full"``, ``next_token_loss`` with its chunked cross-entropy,
one row) through redray's model runtime, the way a Trainer does, on 4 simulated
devices with ``context_axis=4`` and on 1 device, and reads ``memory_analysis()`` (the
bytes a device needs) and the collectives of ``as_text()``.

* ``context/max_seq_over_single``: the longest sequence (a multiple of 1024 tokens)
  whose compiled step's peak (arguments + temporaries + outputs) fits a fixed budget per
  device, context 4 (the ring) over 1 device.
* ``context/activation_bytes_ratio``: XLA's temporaries per device (what the step
  allocates beside its arguments and outputs: activations, their gradients, the
  attention's blocks) at context 4 over 1 device, same sequence.
* ``communication/context_ring``: the bytes the ring's ``collective-permute``s move per
  device (the scans unrolled, so each layer's are listed) over the ring's ideal: per
  layer, the forward and the backward each send ``C - 1`` blocks of keys and values
  round the ring, ``2 B n KV D s`` bytes a block (``n = T / C`` tokens, ``s`` the
  compute itemsize), and the backward also sends their gradients ``C`` times (float32,
  home included). Under remat the backward recomputes the forward, whose ring sends
  the same keys along the same route as the backward's: XLA merges the identical
  permutes, so that pass costs nothing. Besides the layers, the final hidden states
  leave the zigzag layout and their gradient returns (``B n d s`` bytes each way). The
  keys' slots and validity travel with them (5 bytes a token, counted in the
  measurement, not in the ideal). The ideal is the planner's own count
  (``redray.planning.cost.context_traffic``), so this figure checks what the planner
  charges a context plan.
* ``context/linear_state_bytes_over_gather``: Gated DeltaNet layers over the context
  axis pass their state, not the sequence (``redray.models.gated_delta.across_context``):
  the bytes of the layers' all-gathers and reduce-scatters (each chunk's state map and
  last convolution inputs, and their gradients; not the zigzag's permutes, which
  attention has too, the parameters' gradient all-reduce or the chunked loss's own
  gathers) over what gathering each linear layer's input
  sequence would move, an all-gather of ``B T d s`` bytes forward and a reduce-scatter
  of its gradient backward. Qwen3.5-shaped linear layers (``LINEAR``: hidden 2048, 16
  key heads and 32 value heads of 128, a convolution of 4 tokens), every layer linear,
  no remat, compiled only.

    python benchmarks/context.py [--only linear]
"""

import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import figure, parser, save, simulate_devices  # noqa: E402

simulate_devices(4)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

COMMAND = "python benchmarks/context.py"
FULL = dict(vocab=512, hidden=256, intermediate=512, layers=4, heads=4, kv_heads=4,
            seq=16384, budget=512 << 20, ring_seq=4096, step=1024)
TINY = dict(vocab=64, hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2,
            seq=2048, budget=24 << 20, ring_seq=512, step=512)


LINEAR = dict(vocab=1024, hidden=2048, intermediate=4096, layers=2, key_heads=16,
              value_heads=32, head=128, seq=16384, ways=4)
LINEAR_TINY = dict(vocab=64, hidden=64, intermediate=128, layers=2, key_heads=2,
                   value_heads=4, head=16, seq=256, ways=4)


def linear_config(s: dict):
    from _lm import hybrid_config

    return hybrid_config(s["vocab"], s["hidden"], s["layers"], s["intermediate"],
                         s["key_heads"], s["key_heads"], s["head"], s["key_heads"],
                         s["value_heads"], s["head"],
                         layer_types=["linear_attention"] * s["layers"])


def linear_state_bytes(s: dict) -> tuple[int, int, dict]:
    """(the linear layers' collective bytes over the context axis, gathering their
    input sequences' bytes, detail) of one compiled step (module docstring)."""
    from redray.sharding.collectives import collectives, summarize

    # the layers' own: their shard_map's gathers and the transposes' reduce-scatters (not
    # the parameters' gradient all-reduce, nor the chunked loss's gathers)
    found = [c for c in collectives(compiled(s, s["seq"], s["ways"], cfg=linear_config(s),
                                             remat=None, unrolled=True).as_text())
             if re.search(r'op_name="[^"]*shard_map/(all_gather|reduce_scatter)"', c.line)]
    measured = sum(c.bytes for c in found)
    gather = 2 * s["layers"] * s["seq"] * s["hidden"] * 4
    return measured, gather, dict(collectives=summarize(found))


def config(s: dict):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=s["vocab"], hidden_size=s["hidden"],
                       intermediate_size=s["intermediate"], num_hidden_layers=s["layers"],
                       num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"],
                       tie_word_embeddings=False)


def loss(model, ids):
    from redray.models import next_token_loss

    return next_token_loss(model, ids, chunk=512, train=True)


def compiled(s: dict, seq: int, ways: int, method: str = "ring", unrolled: bool = False,
             cfg=None, remat: str | None = "full"):
    """The compiled loss-and-gradient step on ``ways`` devices (context ``ways``) for a
    row of ``seq`` tokens (the model sees ``seq``: the ids are one longer) of ``cfg``
    (default: ``config(s)``)."""
    from redray.engine.runtime import ModelRuntime
    from redray.models import build
    from redray.sharding import Parallelism
    from redray.sharding.tracing import unrolled_loops

    os.environ["REDRAY_CONTEXT_ATTENTION"] = method
    plan = Parallelism.of(data_axis=1, context_axis=ways).build(jax.devices()[:ways])
    cfg = config(s) if cfg is None else cfg
    runtime = ModelRuntime(lambda rngs: build(cfg, rngs=rngs, scan=True, remat=remat), plan)
    batch = jax.ShapeDtypeStruct((1, seq + 1), jnp.int32)
    runtime.derive(loss, batch)
    params, extra = runtime.abstract
    step = jax.jit(jax.value_and_grad(
        lambda p, e, ids: runtime.apply(loss, p, e, jax.random.key(0), ids)[0]),
        in_shardings=(*runtime.shardings, plan.batch_sharding()))
    if unrolled:
        with unrolled_loops():
            return step.lower(params, extra, batch).compile()
    return step.lower(params, extra, batch).compile()


def memory(s: dict, seq: int, ways: int, method: str = "ring") -> dict:
    from redray.planning.memory import compiled_memory

    return compiled_memory(compiled(s, seq, ways, method).memory_analysis())


def longest(s: dict, ways: int) -> tuple[int, list]:
    """The longest multiple of ``s["step"]`` tokens whose step's peak fits the budget
    (doubling, then halving the gap), and the (tokens, peak) pairs tried."""
    tried = []

    def fits(seq):
        peak = memory(s, seq, ways)["peak"]
        tried.append((seq, peak))
        return peak <= s["budget"]

    step = s["step"]
    lo, hi = 0, step
    while fits(hi):
        lo, hi = hi, hi * 2
    while hi - lo > step:
        mid = (lo + hi) // 2 // step * step
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo, tried


def ring_bytes(s: dict, ways: int) -> tuple[int, float, dict]:
    from redray.sharding.collectives import collectives
    from redray.planning.cost import context_traffic

    seq = s["ring_seq"]
    found = [c for c in collectives(compiled(s, seq, ways, "ring", unrolled=True).as_text())
             if c.kind == "collective-permute"]
    measured = sum(c.bytes for c in found)
    # the planner's count of the ring (redray.planning.cost.context_traffic): float32
    traffic = context_traffic({"context": ways}, 1, seq, s["kv_heads"] * s["hidden"] // s["heads"],
                              s["hidden"], s["layers"], 4, 1)
    ideal = sum(t.bytes * t.times for t in traffic)
    per_layer = sum(t.bytes * t.times for t in traffic[:2]) / s["layers"]
    zigzag = traffic[2].bytes * traffic[2].times
    return measured, ideal, dict(permutes=len(found), per_layer_ideal=per_layer,
                                 zigzag_ideal=zigzag)


def main(argv=None) -> None:
    ap = parser(__doc__)
    ap.add_argument("--only", choices=("linear",),
                    help="only context/linear_state_bytes_over_gather (seconds)")
    args = ap.parse_args(argv)
    s = TINY if args.tiny else FULL
    model = {k: v for k, v in s.items() if k not in ("budget", "step")}
    figures = []
    if args.only == "linear":
        save([linear_figure(args.tiny)], args.out)
        return
    single, single_tried = longest(s, 1)
    split, split_tried = longest(s, 4)
    figures.append(figure(
        "context/max_seq_over_single", split / single, "x",
        f"the longest sequence whose step fits {s['budget'] >> 20} MiB a device on 1 device",
        ">= 3.5", COMMAND, single_tokens=single, context4_tokens=split,
        single_tried=single_tried, context4_tried=split_tried, model=model))
    one = memory(s, s["seq"], 1)
    detail = {"single": one}
    for method in ("ring", "all_gather"):
        detail[method] = memory(s, s["seq"], 4, method)
    figures.append(figure(
        "context/activation_bytes_ratio",
        detail["ring"]["temporaries"] / one["temporaries"], "x",
        f"XLA's temporaries per device on 1 device, {s['seq']} tokens", "<= 0.3", COMMAND,
        all_gather=detail["all_gather"]["temporaries"] / one["temporaries"],
        tokens=s["seq"], memory=detail, model=model))
    measured, ideal, about = ring_bytes(s, 4)
    figures.append(figure(
        "communication/context_ring", measured / ideal, "x",
        "the ring's ideal bytes (module docstring's formula)", "<= 1.1", COMMAND,
        measured_bytes=measured, ideal_bytes=ideal, tokens=s["ring_seq"], **about,
        model=model))
    figures.append(linear_figure(args.tiny))
    save(figures, args.out)


def linear_figure(tiny: bool) -> dict:
    lin = LINEAR_TINY if tiny else LINEAR
    measured, gather, about = linear_state_bytes(lin)
    return figure(
        "context/linear_state_bytes_over_gather", measured / gather, "x",
        f"gathering each linear layer's input sequence ({lin['seq']} tokens, context "
        f"{lin['ways']}): an all-gather forward, a reduce-scatter backward", None, COMMAND,
        measured_bytes=measured, gather_bytes=gather, **about, model=lin)


if __name__ == "__main__":
    main()
