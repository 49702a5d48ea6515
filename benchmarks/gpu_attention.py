"""GPU: redray's attention paths on one GPU: their speed and their error, side by side.

Causal self-attention, bfloat16 inputs, grouped-query heads (32 query heads, 8
key/value heads of 128, LLaMA-3-8B's shape), one forward and backward pass (the
gradient of ``sum(out * g)`` for a fixed random ``g``, jitted), through
``redray.models.attention.attend`` with each implementation forced:

* ``cudnn``: cuDNN's fused flash attention (``jax.nn.dot_product_attention``), what
  "auto" takes on a GPU for plain causal rows;
* ``chunked``: redray's blockwise flash attention in plain JAX (``flash_attention``),
  what "auto" takes for packed rows, windows and soft-capping from 2048 keys, and the
  kernel every step of the context axis's ring runs (``flash_forward`` and
  ``flash_backward``, ``redray/models/context.py``);
* ``xla``: the materialized mask (shorter sequences only: its scores are quadratic).

Time: the median of ``--repeats`` timed windows of ``--window`` calls (after a warm-up
call), interleaved across the implementations. Error: the output's and every input
gradient's ``|x - ref| / |ref|`` (Frobenius norms) against the same attention in
float32 (``dense``), at a shorter sequence (``--check-seq``).

Figures: ``gpu_attention/chunked_over_cudnn`` (time of redray's blockwise kernel over
cuDNN's, at the longest sequence; no target: a finding),
``gpu_attention/cudnn_error_over_xla`` (cuDNN's worst error over XLA's bf16 path's:
cuDNN's kernel is as exact as the path it replaces, target <= 1.5) and
``gpu_attention/cudnn_padded_error_over_xla`` (the same where the rows end or begin in
64 padding slots, or are packed with documents: on Hopper cuDNN's packed layout takes
all three; target <= 1.5) and ``gpu_attention/packed_over_causal`` (the time of "auto"
on rows packed with documents of 256 to 4,096 tokens, cuDNN's packed layout on Hopper,
over plain causal cuDNN on the same tokens, the worse of the sequences; target <= 1.3).
The time of "cudnn trailing" (padding given) is beside plain cuDNN's in ``detail``.
``gpu_attention/ring_blocks_error_over_xla`` checks the context ring's use of cuDNN on
one GPU: causal attention over two halves of the keys, each block through cuDNN
(``context.CudnnBlocks``), merged by the blocks' statistics, each block's gradients
from the merged output and statistics, against float32, over XLA's error (target <= 1.5).
``gpu_attention/ring_step_over_fused`` times one step of that ring (a block of half the
longest sequence against another device's keys, seen whole: forward, merge, backward from
the merged statistics) over the fused kernel's forward and backward on the same block
(target <= 1.5; on CPU with ``--tiny`` the reference blocks against XLA, no target).

    python benchmarks/gpu_attention.py [--seqs 4096 16384] [--tokens 32768]
"""

from __future__ import annotations

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import figure, parser, save, stats  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from redray.models.attention import AttentionMask, attend  # noqa: E402

COMMAND = "python benchmarks/gpu_attention.py"
HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
XLA_UP_TO = 8192  # keys: the materialized path's scores beyond this are too big to time


def inputs(batch: int, seq: int, heads: int, kv_heads: int, dim: int, seed: int = 0):
    keys = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(keys[0], (batch, seq, heads, dim), jnp.float32)
    k = jax.random.normal(keys[1], (batch, seq, kv_heads, dim), jnp.float32)
    v = jax.random.normal(keys[2], (batch, seq, kv_heads, dim), jnp.float32)
    g = jax.random.normal(keys[3], (batch, seq, heads, dim), jnp.float32)
    return q, k, v, g


def real_slots(padding: str, batch: int, t: int) -> jax.Array:
    """(batch, t) bool: the slots holding real tokens under ``padding`` (``step``'s)."""
    slots = jnp.arange(t)[None]
    valid = {"none": slots >= 0, "packed": slots >= 0, "trailing": slots < t - 64,
             "leading": slots >= 64}[padding]
    return jnp.broadcast_to(valid, (batch, t))


def documents(batch: int, t: int, shortest: int = 256, longest: int = 4096) -> jax.Array:
    """(batch, t) segment ids of rows packed with documents of ``shortest`` to
    ``longest`` tokens (drawn with a fixed seed; the last one cut at the row's end)."""
    import numpy as np

    rs = np.random.default_rng(0)
    rows = []
    for _ in range(batch):
        ids, doc = [], 1
        while len(ids) < t:
            ids += [doc] * int(rs.integers(min(shortest, t), min(longest, t) + 1))
            doc += 1
        rows.append(ids[:t])
    return jnp.asarray(rows, jnp.int32)


def step(impl: str, padding: str = "none"):
    """jit(forward and backward) of ``impl``: returns (out, dq, dk, dv). ``padding``:
    "none" (a mask known to hold none), "trailing" (a mask that may hold padding, whose
    rows end in 64 padding slots), "leading" (rows that begin with them) or "packed"
    (rows packed with documents of 256 to 4,096 tokens: segment ids)."""
    def run(q, k, v, g):
        b, t = k.shape[:2]
        if padding == "packed":
            seg = documents(b, t)
            mask = AttentionMask(jnp.ones((b, t), bool), jnp.arange(t), seg, seg)
            valid = seg > 0
        else:
            valid = real_slots(padding, b, t)
            mask = AttentionMask(kv_valid=valid, q_slots=jnp.arange(q.shape[1]),
                                 padded=padding != "none")
        scale = q.shape[-1] ** -0.5
        g = g * valid[:, :, None, None]  # the padding's outputs are nobody's

        def loss(q, k, v):
            out = attend(q, k, v, mask, scale, impl=impl)
            return jnp.sum(out.astype(jnp.float32) * g), out
        (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
        return (out, *grads)
    return jax.jit(run)


def relative_error(x, ref) -> float:
    x, ref = x.astype(jnp.float32), ref.astype(jnp.float32)
    return float(jnp.linalg.norm(x - ref) / jnp.linalg.norm(ref))


def errors(impls, seq: int, heads: int, kv_heads: int, dim: int,
           paddings=("none",)) -> dict:
    """Each implementation's worst relative error (output and gradients, the real
    tokens') against float32, for each padding (``step``'s)."""
    q, k, v, g = inputs(1, seq, heads, kv_heads, dim, seed=1)
    low = [x.astype(jnp.bfloat16) for x in (q, k, v)]
    out = {}
    for padding in paddings:
        ref = step("dense", padding)(q, k, v, g)
        real = real_slots(padding, *q.shape[:2])[:, :, None, None]
        for impl in impls:
            got = step(impl, padding)(*low, g)
            name = impl if padding == "none" else f"{impl} {padding}"
            # the padding's outputs are nobody's (its queries' gradients are zero)
            out[name] = {part: relative_error(x * real, r * real) if part == "out"
                         else relative_error(x, r)
                         for part, x, r in zip(("out", "dq", "dk", "dv"), got, ref)}
    return out


def timings(impls, batch: int, seq: int, heads: int, kv_heads: int, dim: int,
            window: int, repeats: int) -> dict:
    q, k, v, g = inputs(batch, seq, heads, kv_heads, dim)
    q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, v))
    # "cudnn trailing": cuDNN with the rows' lengths (a mask that may hold padding)
    fns = {impl: step(*impl.split(" ")) for impl in impls}
    return interleaved(fns, (q, k, v, g), window, repeats)


def interleaved(fns: dict, args: tuple, window: int, repeats: int) -> dict:
    """Seconds a call of each of ``fns`` on ``args`` takes: after a warm-up call each,
    ``repeats`` timed windows of ``window`` calls, interleaved across them."""
    for fn in fns.values():
        jax.block_until_ready(fn(*args))
    seconds = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            for _ in range(window):
                result = fn(*args)
            jax.block_until_ready(result)
            seconds[name].append((time.perf_counter() - start) / window)
    return seconds


def ring_blocks_check(blocks, seq: int, heads: int, kv_heads: int, dim: int) -> dict:
    """The context ring's contract for a fused kernel, on one device: causal attention
    over two halves of the keys (the second half's queries seeing the first half whole,
    the diagonal halves causal), each block through ``blocks`` (``context.CudnnBlocks``
    on a GPU), merged by their statistics, and each block's gradients from the merged
    output and statistics: against float32 attention, as each implementation's error
    (``errors``' measure)."""
    from redray.models.context import _merge

    q, k, v, g = inputs(1, seq, heads, kv_heads, dim, seed=2)
    low = [x.astype(jnp.bfloat16) for x in (q, k, v)]
    half = seq // 2
    scale = dim ** -0.5

    def part(q, k, v, causal):
        out, lse = blocks.forward(q, k, v, scale, causal)
        lse = jnp.moveaxis(lse, 1, 2)
        return out.astype(jnp.float32), lse, jnp.ones_like(lse)

    def ring(q, k, v, g):
        first = part(q[:, :half], k[:, :half], v[:, :half], True)
        late = _merge(part(q[:, half:], k[:, :half], v[:, :half], False),
                      part(q[:, half:], k[:, half:], v[:, half:], True))
        out = jnp.concatenate([first[0], late[0]], 1)
        lse = jnp.concatenate([first[1] + jnp.log(first[2]), late[1] + jnp.log(late[2])], 1)
        lse = jnp.moveaxis(lse, 2, 1)
        d = g.astype(jnp.bfloat16)
        a = blocks.backward(q[:, :half], k[:, :half], v[:, :half], scale, True, out[:, :half],
                            lse[..., :half], d[:, :half])
        b = blocks.backward(q[:, half:], k[:, :half], v[:, :half], scale, False,
                            out[:, half:], lse[..., half:], d[:, half:])
        c = blocks.backward(q[:, half:], k[:, half:], v[:, half:], scale, True, out[:, half:],
                            lse[..., half:], d[:, half:])
        dq = jnp.concatenate([a[0], b[0] + c[0]], 1)
        dk = jnp.concatenate([a[1] + b[1], c[1]], 1)
        dv = jnp.concatenate([a[2] + b[2], c[2]], 1)
        return out, dq, dk, dv

    ref = step("dense")(q, k, v, g)
    got = jax.jit(ring)(*low, g)
    xla = step("xla")(*low, g)
    parts = ("out", "dq", "dk", "dv")
    return {"ring_blocks": {p: relative_error(x, r) for p, x, r in zip(parts, got, ref)},
            "xla": {p: relative_error(x, r) for p, x, r in zip(parts, xla, ref)}}


def ring_step_timing(blocks, batch: int, seq: int, heads: int, kv_heads: int, dim: int,
                     window: int, repeats: int) -> dict:
    """Seconds of one step of the context ring on a block of ``seq`` queries against
    another device's ``seq`` keys (seen whole): the block's forward through ``blocks``
    merged into the attention so far by the statistics, and its gradients from the
    merged output and statistics; beside the fused kernel's forward and backward on the
    same block (``jax.nn.dot_product_attention``, no mask), interleaved."""
    from redray.models.context import _merge

    q, k, v, g = (x.astype(jnp.bfloat16) for x in inputs(batch, seq, heads, kv_heads, dim))
    scale = dim ** -0.5
    shape = (batch, seq, heads)
    # the attention so far (another block's part): its output and statistics
    before = (jnp.zeros(q.shape, jnp.float32), jnp.zeros(shape, jnp.float32),
              jnp.ones(shape, jnp.float32))

    def ring_step(q, k, v, g):
        out, lse = blocks.forward(q, k, v, scale, False)
        lse = jnp.moveaxis(lse, 1, 2)
        out, top, total = _merge(before, (out.astype(jnp.float32), lse, jnp.ones_like(lse)))
        merged = jnp.moveaxis(top + jnp.log(total), 2, 1)
        return blocks.backward(q, k, v, scale, False, out, merged, g)

    def fused(q, k, v, g):
        impl = "cudnn" if jax.devices()[0].platform == "gpu" else "xla"

        def loss(q, k, v):
            out = jax.nn.dot_product_attention(q, k, v, scale=scale, implementation=impl)
            return jnp.sum(out.astype(jnp.float32) * g.astype(jnp.float32))
        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    return interleaved({"ring_step": jax.jit(ring_step), "fused": jax.jit(fused)},
                       (q, k, v, g), window, repeats)


def main(argv=None) -> None:
    ap = parser(__doc__)
    ap.add_argument("--seqs", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--tokens", type=int, default=32768,
                    help="tokens per call: the batch is tokens / seq")
    ap.add_argument("--check-seq", type=int, default=2048)
    ap.add_argument("--window", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    heads, kv_heads, dim = HEADS, KV_HEADS, HEAD_DIM
    device = jax.devices()[0]
    gpu = device.platform == "gpu"
    if args.tiny:
        args.seqs, args.tokens, args.check_seq, args.window, args.repeats = [256], 512, 128, 1, 2
        heads, kv_heads, dim = 4, 2, 16
    elif not gpu:
        raise SystemExit(f"gpu_attention.py measures a GPU; this machine's JAX device is "
                         f"{device.device_kind!r}: run it on a GPU, or with --tiny")
    fused = ["cudnn"] if gpu else []
    err = errors(fused + ["chunked", "xla"], args.check_seq, heads, kv_heads, dim,
                 ("none", "trailing", "leading", "packed"))
    per_seq = {}
    for seq in args.seqs:
        # the kernel "auto" takes for packed rows, beside the plain causal one
        impls = fused + [f"{f} trailing" for f in fused] + ["auto packed", "chunked"] + \
            (["xla"] if seq <= XLA_UP_TO else [])
        batch = max(1, args.tokens // seq)
        seconds = timings(impls, batch, seq, heads, kv_heads, dim, args.window, args.repeats)
        per_seq[seq] = {"batch": batch, "seconds": {k: stats(v) for k, v in seconds.items()}}
        print(f"seq {seq} batch {batch}: " + ", ".join(
            f"{k} {statistics.median(v) * 1e3:.2f} ms" for k, v in seconds.items()))
    from redray.models import context

    blocks = context.CudnnBlocks() if gpu else context.ReferenceBlocks()
    ring_err = ring_blocks_check(blocks, args.check_seq, heads, kv_heads, dim)
    # one ring step on a block of a device's share of the longest sequence
    ring_seq = max(args.seqs) // 2
    ring_seconds = ring_step_timing(blocks, max(1, args.tokens // max(args.seqs)), ring_seq,
                                    heads, kv_heads, dim, args.window, args.repeats)
    print(f"ring step on {ring_seq} x {ring_seq}: " + ", ".join(
        f"{k} {statistics.median(v) * 1e3:.2f} ms" for k, v in ring_seconds.items()))
    print("relative errors against float32:", err, "ring blocks:", ring_err)
    detail = dict(device=device.device_kind, heads=heads, kv_heads=kv_heads, head_dim=dim,
                  tokens=args.tokens, per_seq=per_seq, errors=err, check_seq=args.check_seq,
                  window=args.window, repeats=args.repeats, jax=jax.__version__,
                  date=time.strftime("%Y-%m-%d"))
    longest = per_seq[max(args.seqs)]["seconds"]
    base = "cudnn" if gpu else "xla" if "xla" in longest else None
    figures = []
    if base is not None:
        figures.append(figure(
            "gpu_attention/chunked_over_cudnn",
            longest["chunked"]["median"] / longest[base]["median"], "x",
            f"{base} attention's time, forward and backward, causal, bf16, seq "
            f"{max(args.seqs)}, on {device.device_kind}", None, COMMAND, **detail))
    if gpu:
        ratios = {seq: r["seconds"]["auto packed"]["median"] / r["seconds"]["cudnn"]["median"]
                  for seq, r in per_seq.items()}
        figures.append(figure(
            "gpu_attention/packed_over_causal", max(ratios.values()), "x",
            f"cuDNN's plain causal attention on the same tokens, forward and backward, bf16, "
            f"rows packed with documents of 256 to 4,096 tokens against unpacked rows (the "
            f"worse of seqs {sorted(ratios)}), on {device.device_kind}", "<= 1.3", COMMAND,
            ratios=ratios, **detail))
    worst = {impl: max(e.values()) for impl, e in err.items()}
    fused_name = "cudnn" if gpu else "chunked"
    figures.append(figure(
        "gpu_attention/cudnn_error_over_xla",
        worst[fused_name] / worst["xla"], "x",
        f"XLA's bf16 attention's worst relative error (output, dq, dk, dv) against float32,"
        f" seq {args.check_seq}, on {device.device_kind}", "<= 1.5", COMMAND, **detail))
    padded = [p for p in ("trailing", "leading", "packed")]
    figures.append(figure(
        "gpu_attention/cudnn_padded_error_over_xla",
        max(worst[f"{fused_name} {p}"] for p in padded)
        / max(worst[f"xla {p}"] for p in padded), "x",
        f"XLA's worst relative error on rows padded at their end or start (64 of "
        f"{args.check_seq} slots) or packed with documents (cuDNN's packed layout on "
        f"Hopper), on {device.device_kind}", "<= 1.5", COMMAND, **detail))
    figures.append(figure(
        "gpu_attention/ring_blocks_error_over_xla",
        max(ring_err["ring_blocks"].values()) / max(ring_err["xla"].values()), "x",
        f"XLA's bf16 attention's worst relative error against float32; the context ring's "
        f"blocks through {type(blocks).__name__} (two halves of the keys merged by their "
        f"statistics, each block's gradients from the merged ones), seq {args.check_seq}, "
        f"on {device.device_kind}", "<= 1.5", COMMAND, ring=ring_err, **detail))
    ring_times = {k: stats(v) for k, v in ring_seconds.items()}
    figures.append(figure(
        "gpu_attention/ring_step_over_fused",
        ring_times["ring_step"]["median"] / ring_times["fused"]["median"], "x",
        f"the fused kernel's forward and backward on the same block ({ring_seq} queries "
        f"against {ring_seq} keys seen whole, bf16) through jax.nn.dot_product_attention; "
        f"the ring's step: the block through {type(blocks).__name__}, merged by its "
        f"statistics, its gradients from the merged ones, on {device.device_kind}",
        "<= 1.5" if gpu else None, COMMAND, seconds=ring_times, ring_seq=ring_seq,
        **detail))
    save(figures, args.out)


if __name__ == "__main__":
    main()
