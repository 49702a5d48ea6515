"""The vendors' fused attention kernels (redray/models/fused_attention.py), checked
without an accelerator: cuDNN's packed layout means the mask redray meant; a training
step lowered for CUDA holds cuDNN's fused attention forward and backward and no
(queries x keys) intermediate, and for TPU splash attention's Mosaic kernels; splash in
Pallas's interpreter computes what the reference does, forward and backward."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from redray.models import attention, fused_attention
from redray.models.attention import AttentionMask, Target, choose, dense_attention
from redray.models.fused_attention import packed_layout
from redray.sharding.tracing import attention_kernels


def implied(offsets, lengths, window, keys):
    """The (batch, queries, keys) mask cuDNN's packed layout means: a query of a run
    sees the keys of its run at and before it, the ``window`` latest of them."""
    out = np.zeros((offsets.shape[0], keys, keys), bool)
    for row, (starts, sizes) in enumerate(zip(offsets, lengths)):
        for start, size in zip(starts, sizes):
            if size < 0:
                continue
            for i in range(start, start + size):
                first = start if window is None else max(start, i - window + 1)
                out[row, i, first:i + 1] = True
    return out


def packing(rs, keys, kind):
    """One row's segment ids (0: padding) of a random packing of ``kind``."""
    if kind == "one document":
        return np.ones(keys, np.int32)
    lead = rs.integers(0, keys // 4) if kind in ("leading padding", "both") else 0
    trail = rs.integers(0, keys // 4) if kind in ("trailing padding", "both") else 0
    ids, doc = [0] * lead, 1
    while len(ids) < keys - trail:
        size = 1 if kind == "single tokens" else int(rs.integers(1, keys // 3))
        ids += [doc] * min(size, keys - trail - len(ids))
        doc += 1
    return np.asarray(ids + [0] * trail, np.int32)


KINDS = ["documents", "single tokens", "one document", "leading padding",
         "trailing padding", "both"]


@pytest.mark.parametrize("segmented", [True, False], ids=["segment ids", "padding only"])
@pytest.mark.parametrize("window", [None, 3, 50])
def test_the_packed_layout_means_the_mask_redray_meant(segmented, window):
    rs = np.random.default_rng(0)
    keys = 40
    for trial in range(30):
        kinds = [KINDS[(trial + r) % len(KINDS)] for r in range(3)]
        if not segmented:  # one document per row: the padding decides
            kinds = [k if k != "documents" and k != "single tokens" else "both" for k in kinds]
        seg = np.stack([packing(rs, keys, k) for k in kinds])
        if not segmented:
            seg = (seg != 0).astype(np.int32)
        valid = seg != 0
        mask = AttentionMask(jnp.asarray(valid), jnp.arange(keys),
                             jnp.asarray(seg) if segmented else None,
                             jnp.asarray(seg) if segmented else None, window=window)
        offsets, lengths, inside, exact = packed_layout(
            mask.kv_valid, mask.kv_segments, keys)
        assert bool(exact), (kinds, seg)
        np.testing.assert_array_equal(np.asarray(inside), valid)
        means = implied(np.asarray(offsets), np.asarray(lengths), window, keys)
        meant = np.asarray(mask.dense())
        # every query of a real token sees what the mask says; a padding query nothing
        # (its output is zero on the fused path, unused on every path)
        np.testing.assert_array_equal(means[valid], meant[valid])
        assert not means[~valid].any()
        assert np.all(np.asarray(offsets)[:, -1] == -1)  # the layout's closing column


def test_what_the_packed_layout_cannot_say_is_known():
    """Padding inside a document, one segment id in two runs, more runs than the bound:
    not exact (those batches run the blockwise kernel)."""
    def exact(seg, valid=None, bound=8):
        seg = jnp.asarray([seg], jnp.int32)
        valid = seg != 0 if valid is None else jnp.asarray([valid], bool)
        return bool(packed_layout(valid, seg, bound)[3])

    assert exact([1, 1, 2, 2, 0])
    assert not exact([1, 1, 1, 1, 1], [1, 1, 0, 1, 1])  # a hole inside a document
    assert not exact([1, 1, 2, 2, 1])  # id 1 in two places
    assert not exact([1, 2, 3, 4, 5], bound=4)  # more documents than the bound
    assert exact([0, 0, 0, 0])  # nothing real: nothing to describe
    lengths, trailing = fused_attention.trailing_padding(jnp.asarray([[1, 1, 0], [1, 1, 1]]))
    assert lengths.tolist() == [2, 3] and bool(trailing)


def test_a_batch_with_more_documents_in_a_row_than_the_bound_is_refused(monkeypatch):
    monkeypatch.setenv(fused_attention.MAX_SEGMENTS_ENV, "3")
    fused_attention.check_segments({"segment_ids": np.array([[1, 1, 2, 3, 0]])})
    with pytest.raises(ValueError, match=r"row 1 of the batch holds 4 documents "
                                         r"\(segment_ids\): cuDNN's packed attention takes "
                                         r"at most 3 per row \(REDRAY_MAX_SEGMENTS"):
        fused_attention.check_segments({"segment_ids": np.array([[1, 1, 2, 3, 0],
                                                                 [1, 2, 3, 4, 4]])})


# ------------------------------------------------------------------ lowered for devices
transformers = pytest.importorskip("transformers")
SMALL = dict(vocab_size=96, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, initializer_range=0.2)
CUDNN_CALLS = ["__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward"]


def model_of(name, tokens):
    import redray.models as rm

    config = {
        "llama": lambda: transformers.LlamaConfig(**SMALL),
        "mistral": lambda: transformers.MistralConfig(**SMALL, sliding_window=tokens // 4),
        "gemma3": lambda: transformers.Gemma3TextConfig(
            **SMALL, head_dim=16, sliding_window=tokens // 4, query_pre_attn_scalar=16,
            layer_types=["sliding_attention", "full_attention"]),
    }[name]()
    return rm.build(config, dtype=jnp.bfloat16, scan=True)


def batch_of(kind, rows, tokens):
    """(ids, attention mask or None, segment ids or None) of a batch of ``kind``."""
    rs = np.random.default_rng(0)
    ids = rs.integers(0, SMALL["vocab_size"], (rows, tokens)).astype(np.int32)
    if kind == "packed":
        seg = np.stack([packing(rs, tokens, "documents") for _ in range(rows)])
        return ids, None, seg
    if kind == "left padded":
        valid = np.arange(tokens)[None] >= np.array([[tokens // 3], [0]])
        return ids, valid.astype(np.int32), None
    return ids, None, None


def exported_step(model, kind, rows, tokens, platform):
    """A training step's gradient (the model's own loss on the batch), lowered for
    ``platform`` with jax.export: its StableHLO text."""
    from flax import nnx
    from jax import export

    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    ids, mask, seg = batch_of(kind, rows, tokens)

    def loss(params, ids):
        logits = nnx.merge(graphdef, params, jax.tree.map(lambda x: x, rest))(
            ids, None if mask is None else jnp.asarray(mask),
            segment_ids=None if seg is None else jnp.asarray(seg))
        return logits.astype(jnp.float32).mean()

    calls = CUDNN_CALLS if platform == "cuda" else ["tpu_custom_call"]
    exported = export.export(
        jax.jit(jax.grad(loss)), platforms=[platform],
        disabled_checks=[export.DisabledSafetyCheck.custom_call(c) for c in calls])(
        params, jnp.asarray(ids))
    return exported.mlir_module()


def largest_square(text: str) -> int:
    """The largest n such that some tensor of the module has two dimensions of n or
    more: a (queries x keys) intermediate at n tokens."""
    best = 0
    for dims in re.findall(r"tensor<((?:\d+x)+)\w+>", text):
        sizes = sorted(int(d) for d in dims.rstrip("x").split("x"))
        if len(sizes) >= 2:
            best = max(best, sizes[-2])
    return best


@pytest.mark.parametrize("name,kind", [("llama", "packed"), ("mistral", "plain"),
                                       ("llama", "left padded"), ("gemma3", "plain")])
def test_a_gpu_training_step_runs_cudnn_for_every_mask(hopper, monkeypatch, name, kind):
    """LLaMA with grouped-query heads on packed rows, Mistral's sliding window, a
    left-padded batch, Gemma 3's scanned local and global layers: cuDNN's fused
    attention forward and backward, and nothing as large as (queries x keys)."""
    tokens = 1024
    if kind == "packed":  # what the check below sees of a materialized mask
        monkeypatch.setenv("REDRAY_ATTENTION", "xla")
        assert largest_square(exported_step(model_of(name, tokens), kind, 2, tokens,
                                            "cuda")) >= tokens
        monkeypatch.delenv("REDRAY_ATTENTION")
    with attention_kernels() as found:
        text = exported_step(model_of(name, tokens), kind, 2, tokens, "cuda")
    assert set(re.findall(r"@(__cudnn\$\w+)", text)) == set(CUDNN_CALLS)
    assert list(found.why) == ["cudnn"], found.describe()
    assert list(found.checks) == (["cudnn"] if kind == "packed" else [])
    # the blockwise kernel a batch the layout cannot describe would run: blocks of 512
    assert largest_square(text) < tokens
    config = text.replace("\\22", '"')  # the backend configs, JSON strings in the module
    windows = set(re.findall(r'"sliding_window_length": (\d+)', config))
    assert windows == {"0": {"0"}, "mistral": {str(tokens // 4)},
                       "gemma3": {"0", str(tokens // 4)}}.get(name, {"0"}), windows
    segments = set(re.findall(r'"max_seg_per_batch": (\d+)', config))
    # without padding the plain kernel (no layout: 1); a left-padded row is one run, in
    # a layout of two (the packed form JAX gives cuDNN from two up)
    assert segments == {"packed": {"64"}, "left padded": {"2"}}.get(kind, {"1"}), segments
    masks = set(re.findall(r'"mask_type": "(\w+)"', config))
    assert masks == ({"CAUSAL"} if kind == "plain" else {"PADDING_CAUSAL"}), masks


@pytest.mark.parametrize("name,kind", [("llama", "packed"), ("gemma3", "left padded")])
def test_a_tpu_training_step_runs_splash_attention(monkeypatch, name, kind):
    """For TPU: splash attention's Mosaic kernels, forward and both backward ones (the
    queries' gradient, the keys' and values'), for packed rows and for Gemma 3's local
    and global layers on a left-padded batch."""
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    tokens = 256
    with attention_kernels() as found:
        text = exported_step(model_of(name, tokens), kind, 2, tokens, "tpu")
    assert list(found.why) == ["splash"], found.describe()
    kernels = set(re.findall(r'kernel_name\s*=\s*"?([\w\-]+)', text))
    assert kernels == {"splash_mqa_fwd_segmented_residuals",
                       "splash_mqa_dq_segmented_no_residuals",
                       "splash_mqa_dkv_segmented_no_residuals"}, kernels
    assert largest_square(text) < tokens


@pytest.mark.parametrize("kind", ["packed", "windowed", "soft-capped"])
def test_splash_in_the_interpreter_computes_the_reference_attention(kind):
    """Splash (Pallas's interpreter on CPU) against float32 attention on the same bf16
    inputs: output and the three inputs' gradients within twice the XLA path's own
    error, on every real token (a padding query's output is no path's business). Splash
    has no scale: the queries are scaled before it, rounded once to bf16 (as MaxText
    does), which the XLA path does in float32; at the usual scale that costs little."""
    b, t, h, kvh, d = 2, 384, 4, 2, 32  # blocks of 128: three by three per head
    rs = np.random.default_rng(7)
    q, k, v = (jnp.asarray(rs.normal(size=(b, t, n, d)), jnp.bfloat16) for n in (h, kvh, kvh))
    seg = np.stack([packing(rs, t, "documents"), packing(rs, t, "both")])
    if kind != "packed":
        seg = (seg != 0).astype(np.int32)  # padding only
    mask = AttentionMask(jnp.asarray(seg != 0), jnp.arange(t),
                         *((jnp.asarray(seg),) * 2 if kind == "packed" else (None, None)),
                         window=40 if kind == "windowed" else None)
    # the models' scale (scores of about one); a cap they reach
    softcap = 1.0 if kind == "soft-capped" else None
    scale = d ** -0.5
    real = jnp.asarray(seg != 0)[:, :, None, None]
    cotangent = jnp.asarray(rs.normal(size=(b, t, h, d)), jnp.float32) * real

    def run(fn, *inputs):
        def loss(q, k, v):
            return jnp.sum(fn(q, k, v).astype(jnp.float32) * cotangent)
        out = fn(*inputs)
        return (out.astype(jnp.float32) * real, *jax.grad(loss, argnums=(0, 1, 2))(*inputs))

    exact = run(lambda q, k, v: dense_attention(q, k, v, mask.dense(), scale, softcap=softcap),
                *(x.astype(jnp.float32) for x in (q, k, v)))
    xla = run(lambda q, k, v: attention.attend(q, k, v, mask, scale, impl="xla",
                                               softcap=softcap), q, k, v)
    splash = run(lambda q, k, v: attention.attend(q, k, v, mask, scale, impl="splash",
                                                  softcap=softcap), q, k, v)
    for name, want, theirs, ours in zip(("output", "dq", "dk", "dv"), exact, xla, splash):
        budget = float(jnp.abs(theirs.astype(jnp.float32) - want).max())
        error = float(jnp.abs(ours.astype(jnp.float32) - want).max())
        assert 0 < budget and error <= 2 * budget, (name, error, budget)


def test_the_table_picks_a_fused_kernel_only_where_it_honours_the_mask():
    hopper_gpu, ampere, tpu = Target("gpu", packed=True), Target("gpu"), Target("tpu")
    t = 256
    q = jnp.zeros((2, t, 4, 128), jnp.bfloat16)
    k = jnp.zeros((2, t, 2, 128), jnp.bfloat16)
    valid = jnp.asarray(np.arange(t)[None].repeat(2, 0) >= 3)
    seg = jnp.asarray((np.arange(t)[None] // 40 + 1).repeat(2, 0), jnp.int32)
    plain = AttentionMask(jnp.ones((2, t), bool), jnp.arange(t), padded=False)
    packed = AttentionMask(valid, jnp.arange(t), seg, seg)
    scanned = AttentionMask(valid, jnp.arange(t)).windowed(jnp.asarray(8))

    def pick(mask, target, q=q, k=k, softcap=None):
        return choose(q, k, mask, None, None, "auto", softcap, target)

    assert [pick(plain, x) for x in (hopper_gpu, ampere, tpu)] == ["cudnn", "cudnn", "splash"]
    assert [pick(packed, x) for x in (hopper_gpu, ampere, tpu)] == ["cudnn", "xla", "splash"]
    assert pick(plain, hopper_gpu, softcap=50.0) == "dense"  # no soft-capping in cuDNN
    assert pick(plain, tpu, softcap=50.0) == "splash"
    wide = jnp.zeros((2, t, 4, 256), jnp.bfloat16)
    assert pick(plain, hopper_gpu, wide, wide) == "cudnn" and pick(plain, ampere, wide, wide) \
        == "xla"  # heads of 256: Hopper
    assert pick(plain, hopper_gpu, q.astype(jnp.float32), k.astype(jnp.float32)) == "xla"
    # a traced window the kernels cannot know statically; listed, they switch among them
    assert pick(scanned, hopper_gpu) == "xla"
    assert pick(AttentionMask(valid, jnp.arange(t)).windowed(jnp.asarray(8), (8, 1 << 30)),
                hopper_gpu) == "cudnn"
    odd = jnp.zeros((2, 200, 4, 128), jnp.bfloat16)  # splash: no block of 128 divides 200
    assert pick(AttentionMask(jnp.ones((2, 200), bool), jnp.arange(200)), tpu, odd,
                odd[:, :, :2]) == "xla"


def test_a_gpu_step_with_a_context_axis_runs_cudnn_in_every_ring_block(hopper):
    """A bf16 LLaMA step with its sequence split over a context axis of 2, lowered for
    CUDA: each block of the ring through cuDNN (forward with its statistics, backward
    from the merged ones), and nothing as large as (queries x keys)."""
    from redray.engine.runtime import ModelRuntime
    from redray.sharding import Parallelism

    tokens = 1024
    plan = Parallelism.of(data_axis=1, context_axis=2).build(jax.devices()[:2])
    runtime = ModelRuntime(lambda rngs: model_of("llama", tokens), plan)

    def loss(model, ids):
        return model(ids).astype(jnp.float32).mean()

    ids = jax.ShapeDtypeStruct((2, tokens), jnp.int32)
    runtime.derive(loss, ids)
    params, extra = runtime.init()
    step = jax.jit(jax.grad(lambda p, e, ids: runtime.apply(loss, p, e, jax.random.key(0),
                                                            ids)[0]))
    # lowered for CUDA (an export would serialize the step's other custom partitionings,
    # which run Python at compile time)
    text = step.trace(params, extra, ids).lower(lowering_platforms=("cuda",)).as_text()
    assert set(re.findall(r"@(__cudnn\$\w+)", text)) == set(CUDNN_CALLS)
    # the diagonal block causal, the others' blocks whole
    masks = set(re.findall(r'\\22mask_type\\22: \\22(\w+)\\22', text))
    assert masks == {"CAUSAL", "NO_MASK"}, masks
    assert "collective_permute" in text  # the ring
    assert largest_square(text) < tokens
