"""GPU: model FLOPs utilization of a ~1B LLaMA training on one GPU, beside a hand-written step.

The model is ``redray.models``' LLaMA with TinyLlama-1.1B's shape (22 layers, hidden
2048, intermediate 5632, 32 query heads and 4 key/value heads of 64, vocabulary 32000,
untied head: 1.10e9 parameters), float32 parameters and Adam state, bfloat16 compute
(the model built with ``dtype=bfloat16`` and ``compute_dtype=jnp.bfloat16``), every
block rematerialized (``remat="dots"``: the projections' outputs kept, attention
recomputed; ``--remat`` names another policy), sequence 2048, random tokens, AdamW, the
loss over 2048-token chunks of the LM head (``redray.models.next_token_loss``: the
(tokens, 32000) logits never exist whole). Attention is ``redray.models.attention``'s
"auto": cuDNN's fused flash attention on GPU. Two steps train it on the
same device, alternating rounds of ``--windows`` timed windows of ``--window`` steps
(the first window of each round excluded):

* redray: ``redray.Trainer.of(..., compute_dtype=jnp.bfloat16).fit`` on the examples in
  memory; tokens/s from the windows ``fit`` logs;
* hand-written: ``jax.jit`` of value_and_grad of the same loss on the same model
  (parameters cast to bfloat16 inside), ``optax`` update, donated state, each batch
  put on the device from numpy, as a plain JAX loop does.

FLOPs are counted per trained token as ``6 N + 6 L H Q T``, where N counts the
parameters that enter a matrix multiplication (all but the input embedding table, a
lookup; the LM head counts), L layers, H query heads, Q head dimension, T the sequence:
the attention scores and their product with the values, forward and backward, halved
for the causal mask (PaLM's appendix B counts ``12 L H Q T``, the whole square; MaxText
halves it for causal attention, which is what a causal kernel computes).
Rematerialization is not counted (model FLOPs, not hardware FLOPs). MFU = tokens/s x
FLOPs per token / the
device's peak dense bf16 FLOP/s, from ``PEAK_TFLOPS`` by ``device_kind`` (or
``--peak-tflops``).

A third side trains the same model on rows packed with documents of 256 to 2,048
tokens (``segment_ids``, as ``redray.data.prepare(pack=...)`` writes them; the loss and
attention stay inside each document: cuDNN's packed layout on Hopper).

Figures: ``gpu_mfu/mfu`` (% of peak, target >= 50 on H100),
``gpu_mfu/redray_vs_jit`` (redray tokens/s over the hand-written step's, target
>= 0.97) and ``gpu_mfu/packed_over_unpacked`` (redray's tokens/s on packed rows over
its tokens/s on unpacked ones, target >= 0.95). ``--tiny`` runs a tiny LLaMA on any
backend (CPU included) to check the script: its figures measure nothing.
``run_all.py`` skips ``gpu_*`` scripts. ``--profile DIR`` traces ``--window`` more steps
of redray's Trainer after the timed rounds (``jax.profiler``, a Perfetto trace TensorBoard's
profile plugin and Perfetto read) and writes where their time went, the largest
operations on the device's streams, into the figures' ``detail["profile"]``.

    python benchmarks/gpu_mfu.py [--batch 8] [--seq 2048] [--window 10] [--windows 3]
                                 [--rounds 3] [--remat dots] [--peak-tflops 989]
"""

from __future__ import annotations

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _lm import chunked_loss as loss  # noqa: E402
from _lm import collate  # noqa: E402
from common import figure, parser, save, stats  # noqa: E402

# Two copies of the model and its Adam state (redray's and the hand-written one's) live
# on the device side by side; JAX's default 75% preallocation leaves too little.
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import redray  # noqa: E402
from redray.models import build  # noqa: E402

COMMAND = "python benchmarks/gpu_mfu.py"
# device_kind substring (lower case) -> peak dense bf16 TFLOP/s, first match wins
PEAK_TFLOPS = (
    ("gh200", 989.0),
    ("h200", 989.0),
    ("h100 pcie", 756.0),
    ("h100 nvl", 835.0),
    ("h100", 989.0),  # SXM (device_kind "NVIDIA H100 80GB HBM3")
    ("h800", 989.0),
    ("a100", 312.0),
    ("b200", 2250.0),
)
MODEL = dict(num_hidden_layers=22, hidden_size=2048, intermediate_size=5632,
             num_attention_heads=32, num_key_value_heads=4, vocab_size=32000)
TINY = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
            num_attention_heads=4, num_key_value_heads=2, vocab_size=256)
LR = 3e-4


def peak_tflops(kind: str) -> float | None:
    kind = kind.lower()
    return next((peak for key, peak in PEAK_TFLOPS if key in kind), None)


def llama_config(fields: dict, seq: int):
    from transformers import LlamaConfig

    return LlamaConfig(max_position_embeddings=seq, tie_word_embeddings=False,
                       rms_norm_eps=1e-5, **fields)


def flops_per_token(config, n_params: int, seq: int) -> dict:
    """The module docstring's count: 6 N + 6 L H Q T (causal attention, halved)."""
    head_dim = config.hidden_size // config.num_attention_heads
    matmul_params = n_params - config.vocab_size * config.hidden_size
    attention = 6 * config.num_hidden_layers * config.num_attention_heads * head_dim * seq
    return {"matmul_params": matmul_params, "dense": 6 * matmul_params, "attention": attention,
            "total": 6 * matmul_params + attention}


class HandWritten:
    """The same model trained by a plain ``jax.jit`` step."""

    def __init__(self, config, remat: str):
        model = build(config, dtype=jnp.bfloat16, remat=remat, seed=1)
        self.graphdef, params, self.rest = nnx.split(model, nnx.Param, ...)
        self.params = jax.tree.map(jnp.asarray, params)
        self.tx = optax.adamw(LR)
        self.opt_state = self.tx.init(self.params)
        graphdef, tx = self.graphdef, self.tx

        def step(params, opt_state, rest, ids):
            def loss_of(p):
                p = jax.tree.map(lambda x: x.astype(jnp.bfloat16), p)
                # fresh variables of this trace: the model's RNG counters (dropout) change
                # inside remat, which NNX refuses for objects of an outer trace
                model = nnx.merge(graphdef, p, jax.tree.map(lambda x: x, rest))
                return loss(model, {"ids": ids}, None, True)

            value, grads = jax.value_and_grad(loss_of)(params)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, value

        self.step = jax.jit(step, donate_argnums=(0, 1))

    def windows(self, batches, window: int, count: int) -> list[float]:
        """Seconds of ``count`` windows of ``window`` steps."""
        out, k = [], 0
        for _ in range(count):
            start = time.perf_counter()
            for _ in range(window):
                ids = jax.device_put(batches[k % len(batches)])
                self.params, self.opt_state, value = self.step(self.params, self.opt_state,
                                                               self.rest, ids)
                k += 1
            value.block_until_ready()
            out.append(time.perf_counter() - start)
        return out


def packed_loss(model, batch, rng, train):
    """``chunked_loss`` on rows packed with documents (``segment_ids``)."""
    from redray.models import next_token_loss

    return next_token_loss(model, batch["ids"], batch["segment_ids"], chunk=2048, train=train)


def documents(rows: int, length: int, shortest: int = 256, longest: int = 2048):
    """(rows, length) segment ids of rows packed with documents of ``shortest`` to
    ``longest`` tokens (a fixed seed; the last one cut at the row's end)."""
    rs = np.random.default_rng(1)
    out = np.zeros((rows, length), np.int32)
    for row in out:
        at, doc = 0, 1
        while at < length:
            size = int(rs.integers(min(shortest, length), min(longest, length) + 1))
            row[at:at + size] = doc
            at, doc = at + size, doc + 1
    return out


def fused_attention(trainer) -> bool:
    """Whether the compiled redray step holds a cuDNN fused attention kernel (a fMHA or
    flash-attention custom call)."""
    targets = [line.split("custom_call_target=")[1].split(",")[0].lower()
               for line in trainer.compiled_step().as_text().splitlines()
               if "custom_call_target=" in line]
    return any("fmha" in t or "flash" in t for t in targets)


def profile_summary(folder: str, steps: int, top: int = 15) -> list[dict]:
    """Where profiled steps' time went: the Perfetto trace ``jax.profiler.trace`` wrote
    under ``folder``, its complete events summed by name on the device's threads (on a
    GPU its streams; on a CPU, where there are none, every thread but Python's), the ``top`` largest
    as {name, ms a step, share of the summed time}."""
    import glob
    import gzip
    import json

    paths = sorted(glob.glob(os.path.join(folder, "**", "perfetto_trace.json.gz"),
                             recursive=True))
    if not paths:
        return []
    with gzip.open(paths[-1]) as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    names = {(e.get("pid"), e.get("tid")): e.get("args", {}).get("name", "")
             for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"}
    processes = {e.get("pid"): e.get("args", {}).get("name", "")
                 for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    device = {key for key, name in names.items()
              if "stream" in name.lower() or "/device:gpu" in processes.get(key[0], "").lower()}
    spans: dict[str, float] = {}
    for e in events:
        if e.get("ph") != "X" or (device and (e.get("pid"), e.get("tid")) not in device):
            continue
        if e["name"].startswith("$"):  # the Python tracer's frames, on the host
            continue
        spans[e["name"]] = spans.get(e["name"], 0.0) + float(e.get("dur", 0.0))
    total = sum(spans.values()) or 1.0
    ranked = sorted(spans.items(), key=lambda kv: -kv[1])[:top]
    return [{"name": name, "ms_per_step": us / 1e3 / steps, "share": us / total}
            for name, us in ranked]


def main(argv=None) -> None:
    ap = parser(__doc__)
    ap.add_argument("--batch", type=int, default=8, help="sequences per step")
    ap.add_argument("--seq", type=int, default=2048, help="tokens per sequence")
    ap.add_argument("--window", type=int, default=10, help="steps per timed window")
    ap.add_argument("--windows", type=int, default=3, help="timed windows per round")
    ap.add_argument("--rounds", type=int, default=3, help="rounds per side, alternating")
    ap.add_argument("--remat", default="dots", choices=["none", "full", "dots", "offload"],
                    help="what each block keeps for the backward pass")
    ap.add_argument("--peak-tflops", type=float, help="the device's peak dense bf16 TFLOP/s")
    ap.add_argument("--profile", metavar="DIR",
                    help="after the timed rounds, trace --window steps of redray's Trainer "
                         "with jax.profiler into DIR and write where their time went "
                         "(the largest operations) into the figures' detail")
    args = ap.parse_args(argv)
    fields = MODEL
    if args.tiny:
        fields, args.batch, args.seq, args.window, args.windows, args.rounds = \
            TINY, 2, 32, 2, 2, 1
    device = jax.devices()[0]
    if device.platform != "gpu" and not args.tiny:
        raise SystemExit(f"gpu_mfu.py measures a GPU; this machine's JAX device is "
                         f"{device.device_kind!r} ({device.platform}): run it on a GPU, or "
                         "with --tiny to check the script")
    peak = args.peak_tflops or peak_tflops(device.device_kind)
    remat = args.remat
    config = llama_config(fields, args.seq)
    rows = np.random.default_rng(0).integers(0, config.vocab_size,
                                             (args.batch * args.window, args.seq + 1), np.int32)
    examples = [{"ids": r} for r in rows]

    trainer = redray.Trainer.of(lambda rngs: build(config, rngs=rngs, dtype=jnp.bfloat16,
                                                remat=remat),
                             collate, loss, optax.adamw(LR), batch_size=args.batch,
                             compute_dtype=jnp.bfloat16, log_every=args.window, progress=False,
                             mesh=redray.make_mesh(devices=[device]))
    segments = documents(len(rows), args.seq + 1)
    packed_examples = [{"ids": r, "segment_ids": seg} for r, seg in zip(rows, segments)]
    packed = redray.Trainer.of(lambda rngs: build(config, rngs=rngs, dtype=jnp.bfloat16,
                                               remat=remat),
                            collate, packed_loss, optax.adamw(LR), batch_size=args.batch,
                            compute_dtype=jnp.bfloat16, log_every=args.window,
                            progress=False, mesh=redray.make_mesh(devices=[device]))
    hand = HandWritten(config, remat)
    batches = [rows[i:i + args.batch] for i in range(0, len(rows), args.batch)]
    n_params = sum(x.size for x in jax.tree.leaves(hand.params))
    flops = flops_per_token(config, n_params, args.seq)
    tokens = {"redray": [], "jit": [], "packed": []}
    for _ in range(args.rounds):
        for name, each, data in (("redray", trainer, examples),
                                 ("packed", packed, packed_examples)):
            done = each.step if each.state is not None else 0
            # one epoch is one window: fit logs a row per window
            logged = each.fit(data, epochs=10**9,
                              max_steps=done + args.window * (args.windows + 1))
            tokens[name] += [r["examples_per_s"] * args.seq for r in logged[1:]]
        seconds = hand.windows(batches, args.window, args.windows + 1)[1:]
        tokens["jit"] += [args.batch * args.seq * args.window / s for s in seconds]
    profile = None
    if args.profile:
        done = trainer.step
        with jax.profiler.trace(args.profile, create_perfetto_trace=True):
            trainer.fit(examples, epochs=10**9, max_steps=done + args.window)
        profile = profile_summary(args.profile, args.window)
        for row in profile:
            print(f"  {row['ms_per_step']:9.3f} ms/step {100 * row['share']:5.1f}%  "
                  f"{row['name'][:90]}")
    fused = fused_attention(trainer)
    median = {k: statistics.median(v) for k, v in tokens.items()}
    achieved = median["redray"] * flops["total"]
    setting = (f"LLaMA {n_params:,} parameters, bf16 compute, seq {args.seq}, batch "
               f"{args.batch}, remat {remat}, on {device.device_kind}")
    detail = dict(device=device.device_kind, tokens_per_s={k: stats(v) for k, v in tokens.items()},
                  flops_per_token=flops, n_params=n_params, batch=args.batch, seq=args.seq,
                  remat=remat, cudnn_fused_attention=fused, window=args.window,
                  attention=trainer.describe().get("attention"),
                  packed_attention=packed.describe().get("attention"),
                  windows=args.windows, rounds=args.rounds, profile=profile,
                  date=time.strftime("%Y-%m-%d"), jax=jax.__version__)
    figures = [figure("gpu_mfu/redray_vs_jit", median["redray"] / median["jit"], "x",
                      f"hand-written jax.jit step of the same model; {setting}", ">= 0.97",
                      COMMAND, **detail),
               figure("gpu_mfu/packed_over_unpacked", median["packed"] / median["redray"], "x",
                      f"redray's tokens/s on unpacked rows; rows packed with documents of "
                      f"256 to 2,048 tokens; {setting}", ">= 0.95", COMMAND, **detail)]
    if peak is not None:
        mfu = 100 * achieved / (peak * 1e12)
        figures.append(figure("gpu_mfu/mfu", mfu, "%", f"peak {peak:g} dense bf16 TFLOP/s; "
                              f"{setting}", ">= 50", COMMAND, peak_tflops=peak,
                              model_tflops=achieved / 1e12,
                              jit_mfu=100 * median["jit"] * flops["total"] / (peak * 1e12),
                              **detail))
    else:
        print(f"no peak FLOP/s known for {device.device_kind!r}: MFU not computed (give "
              "--peak-tflops)", file=sys.stderr)
    save(figures, args.out)


if __name__ == "__main__":
    main()
