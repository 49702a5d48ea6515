"""Attention paths: the kernel ``attention.choose`` picks for every model family and kind
of mask, on a GPU of Hopper's generation or newer, an older GPU (Ampere) and a TPU, and
what the step lowers to there. No device needed: each family's bf16 model (its real head
size, windows, chunks, soft-capping, sinks and biases, a layer of each kind it stacks)
is traced abstractly at 4,096 tokens, and each of its attention calls asks ``choose``
for each target. The gradient of the same model on the same batch is then lowered for
each target (``jax.jit(...).trace(...).lower(lowering_platforms=...)``, the module
``jax.export`` would serialize; its serialization crashes on the mixture-of-experts
families' grouped-matmul gradients in jax 0.10.2), with stand-ins answering as cuDNN 9.10
on a Hopper or an Ampere GPU and as a TPU v5e would (``stand_ins``): the fused kernels
the module holds (cuDNN's custom calls, splash's Mosaic kernels) must be those
``choose`` picked.

Mask kinds: plain causal rows; rows whose padding trails (a collate's right padding);
rows whose padding leads (a generation batch's left padding); packed rows (segment ids,
as ``redray.data.prepare(pack=N)`` writes them). A family's sliding window (Mistral,
Gemma's, gpt-oss's and OLMo 3's local layers) and chunks (Llama 4's chunked layers) are
in every kind of its rows; windows and chunks are 1,024 tokens (gpt-oss: its own 128) so
that they cut 4,096 tokens.

Figure: ``attention_paths/unfused_defaults``: how many (family, kind) pairs a bf16
model on Hopper or on TPU computes, in some attention call, with the blockwise kernel
or a materialized mask where a fused kernel could honour the mask. A kernel picked with
a fallback that a batch of the kind takes at run time (leading padding: cuDNN before
Hopper) counts as the fallback. The exceptions, where
no fused kernel JAX reaches can (``EXCEPTIONS``): soft-capped scores and attention sinks
on a GPU (JAX's cuDNN attention has neither; splash on TPU has both), a learned position
bias (T5: neither kernel takes one without it materialized), and attention that is not
causal self-attention (T5's encoder and cross-attention). Where a counted pair's mask
could be honoured, and by what: ``COULD``. Target: 0.

    python benchmarks/attention_paths.py [--tiny] [--no-lowering]
"""

from __future__ import annotations

import contextlib
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import figure, parser, save, simulate_devices  # noqa: E402

COMMAND = "python benchmarks/attention_paths.py"
TOKENS = 4096
KINDS = ("causal", "trailing padding", "leading padding", "packed")
FUSED = ("cudnn", "splash")
HOPPER, AMPERE, TPU = "GPU, Hopper+", "GPU, Ampere", "TPU"


def configs():
    """Each family's tiny config with its real head size and attention features."""
    import transformers as t

    common = dict(vocab_size=256, num_hidden_layers=1, intermediate_size=256)
    llama = dict(common, hidden_size=256, num_attention_heads=2, num_key_value_heads=1,
                 head_dim=128)
    moe = dict(llama, num_local_experts=2, num_experts_per_tok=1)
    ids = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)  # rows of the vocabulary
    return {
        "gpt2": t.GPT2Config(vocab_size=256, n_embd=128, n_head=2, n_layer=1,
                             n_positions=TOKENS),
        "llama": t.LlamaConfig(**llama),
        "mistral": t.MistralConfig(**llama, sliding_window=1024),
        "qwen2": t.Qwen2Config(**llama, use_sliding_window=False),
        "qwen3": t.Qwen3Config(**llama),
        "gemma2": t.Gemma2Config(**dict(llama, head_dim=256), sliding_window=1024,
                                 query_pre_attn_scalar=256, attn_logit_softcapping=50.0,
                                 final_logit_softcapping=30.0,
                                 layer_types=["sliding_attention"]),
        "gemma3": t.Gemma3TextConfig(**dict(llama, head_dim=256, num_hidden_layers=2),
                                     sliding_window=1024, query_pre_attn_scalar=256,
                                     layer_types=["sliding_attention", "full_attention"]),
        "mixtral": t.MixtralConfig(**moe),
        "qwen2_moe": t.Qwen2MoeConfig(**dict(llama, num_experts=2, num_experts_per_tok=1,
                                             moe_intermediate_size=128,
                                             shared_expert_intermediate_size=128)),
        "qwen3_moe": t.Qwen3MoeConfig(**dict(llama, num_experts=2, num_experts_per_tok=1,
                                             moe_intermediate_size=128)),
        # heads of 64, a window of 128 in every other layer, a sink per head
        "gpt_oss": t.GptOssConfig(**dict(moe, head_dim=64, num_hidden_layers=2),
                                  sliding_window=128,
                                  layer_types=["sliding_attention", "full_attention"]),
        # a dense and a MoE layer in turn; chunks in the rotary layers, the fourth NoPE
        "llama4": t.Llama4TextConfig(**dict(moe, num_hidden_layers=4), **ids,
                                     intermediate_size_mlp=256, interleave_moe_layer_step=2,
                                     attention_chunk_size=1024),
        # every fourth layer NoPE, no window (SmolLM3-3B's)
        "smollm3": t.SmolLM3Config(**dict(llama, num_hidden_layers=4), **ids),
        # three local layers and a global one
        "olmo3": t.Olmo3Config(**dict(llama, num_hidden_layers=4), **ids,
                               sliding_window=1024),
        "opt": t.OPTConfig(vocab_size=256, hidden_size=128, num_attention_heads=2,
                           num_hidden_layers=1, ffn_dim=256, word_embed_proj_dim=128,
                           max_position_embeddings=TOKENS),
        "gptj": t.GPTJConfig(vocab_size=256, n_embd=512, n_head=2, n_layer=1, rotary_dim=64,
                             n_positions=TOKENS),
        "t5": t.T5Config(vocab_size=256, d_model=128, d_kv=64, num_heads=2, num_layers=1,
                         d_ff=256),
    }


def targets():
    from redray.models.attention import Target

    return {HOPPER: Target("gpu", packed=True), AMPERE: Target("gpu"), TPU: Target("tpu")}


def batch(kind: str, rows: int, tokens: int):
    """(ids, attention_mask, segment_ids) of a batch of ``kind``."""
    import numpy as np

    ids = np.zeros((rows, tokens), np.int32)
    if kind == "trailing padding":
        return ids, (np.arange(tokens)[None] < tokens - 64).repeat(rows, 0).astype(np.int32), None
    if kind == "leading padding":
        return ids, (np.arange(tokens)[None] >= 64).repeat(rows, 0).astype(np.int32), None
    if kind == "packed":
        seg = (np.arange(tokens)[None] // 1024 + 1).repeat(rows, 0).astype(np.int32)
        return ids, None, seg
    return ids, None, None


def _call(config, graphdef, state, ids, mask, seg):
    """The model of ``graphdef`` and ``state`` on a batch: its logits."""
    import jax.numpy as jnp
    from flax import nnx

    m = nnx.merge(graphdef, state)
    if config.model_type == "t5":
        return m(jnp.asarray(ids), None if mask is None else jnp.asarray(mask),
                 decoder_input_ids=jnp.asarray(ids))
    return m(jnp.asarray(ids), None if mask is None else jnp.asarray(mask),
             segment_ids=None if seg is None else jnp.asarray(seg))


def picks(config, kind: str, tokens: int, scan: bool = True) -> dict[str, dict[str, str]]:
    """Target -> {kernel: why} over the model's attention calls for a batch of ``kind``
    (the model, its layers stacked or, without ``scan``, a list, traced abstractly; each
    call computed the XLA way meanwhile)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    import redray.models as rm
    from redray.models import attention

    found = {name: {} for name in targets()}
    decide = attention.decide

    def asking(q, k, mask, bias, dropout, asked=None, softcap=None, target=None, sinks=None):
        for name, each in targets().items():
            kernel, why = decide(q, k, mask, bias, dropout, "auto", softcap, each, sinks)
            found[name].setdefault(kernel, why)
        return ("dense" if softcap is not None or sinks is not None or dropout is not None
                else "xla"), "traced"

    ids, mask, seg = batch(kind, 1, tokens)
    graphdef, state = nnx.split(nnx.eval_shape(
        lambda: rm.build(config, dtype=jnp.bfloat16, scan=scan)))
    attention.decide = asking
    try:
        jax.eval_shape(lambda state: _call(config, graphdef, state, ids, mask, seg), state)
    finally:
        attention.decide = decide
    return found


@contextlib.contextmanager
def stand_ins(name: str):
    """The process as it would be on target ``name`` for lowering: JAX's backend, and
    (private to jax 0.10, pinned, as tests/conftest.py's ``hopper`` and
    tests/test_attention_sinks.py's ``tpu_v5e``) cuDNN 9.10 on a GPU of compute
    capability 9.0 or 8.0, or Mosaic's TPU generation (a v5e), which it reads while it
    lowers some of splash's operations."""
    import jax
    from jax._src.cudnn import fused_attention_stablehlo as cudnn
    from jax._src.pallas.mosaic import tpu_info

    class Version:
        @staticmethod
        def cudnn_get_version():
            return 91000

    capability = (9, 0) if name == HOPPER else (8, 0)
    saved = (jax.default_backend, cudnn.cuda_versions, cudnn.check_compute_capability,
             tpu_info.registry.get("cpu"))
    jax.default_backend = lambda: "tpu" if name == TPU else "gpu"
    cudnn.cuda_versions = Version
    cudnn.check_compute_capability = \
        lambda c: capability >= tuple(int(x) for x in c.split("."))
    tpu_info.registry["cpu"] = lambda: tpu_info.get_tpu_info_for_chip(
        tpu_info.ChipVersion.TPU_V5E, 1)
    tpu_info.get_tpu_info.cache_clear()
    try:
        yield
    finally:
        jax.default_backend, cudnn.cuda_versions, cudnn.check_compute_capability, cpu = saved
        if cpu is None:
            tpu_info.registry.pop("cpu", None)
        else:
            tpu_info.registry["cpu"] = cpu
        tpu_info.get_tpu_info.cache_clear()


def lowered(config, kind: str, tokens: int, name: str, scan: bool = True
            ) -> dict[str, list[str]]:
    """The fused kernels (cudnn: its custom calls; splash: its Mosaic kernels) in the
    gradient of the model's mean logit on a batch of ``kind``, lowered for target
    ``name`` under ``stand_ins``."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    import redray.models as rm

    ids, mask, seg = batch(kind, 1, tokens)
    graphdef, params, rest = nnx.split(rm.build(config, dtype=jnp.bfloat16, scan=scan),
                                       nnx.Param, ...)

    def loss(params):
        # the model's other state (its rngs' counts) copied in: made inside the trace
        state = nnx.merge_state(params, jax.tree.map(lambda x: x, rest))
        return _call(config, graphdef, state, ids, mask, seg).astype(jnp.float32).mean()

    with stand_ins(name):
        text = jax.jit(jax.grad(loss)).trace(params).lower(
            lowering_platforms=("tpu" if name == TPU else "cuda",)).as_text()
    found = {"cudnn": sorted(set(re.findall(r"@(__cudnn\$\w+)", text))),
             "splash": sorted(set(re.findall(r'kernel_name\s*=\s*"?(splash[\w\-]*)', text)))}
    return {k: v for k, v in found.items() if v}


def at_run_time(kernel: str, why: str, kind: str) -> str:
    """The kernel a batch of ``kind`` runs where ``choose`` picked ``kernel`` for the
    reason ``why``: a fused kernel whose reason names its blockwise fallback for leading
    padding gives way to it on such a batch."""
    if kernel in FUSED and kind == "leading padding" and "blockwise where" in why:
        return "chunked"
    return kernel


def cell(kernels: dict[str, str]) -> str:
    """A table cell: the kernels picked, a fused one with its reason where it is not
    the plain case."""
    plain = {"cudnn": "causal", "splash": "splash attention"}
    return ", ".join(k if k not in plain or kernels[k] == plain[k]
                     else f"{k} ({kernels[k].removeprefix('splash attention; ')})"
                     for k in sorted(kernels))


# Where no fused kernel JAX reaches can honour the attention: (family, target) -> why.
EXCEPTIONS = {("gemma2", HOPPER): "soft-capped scores: cuDNN has no soft-capping "
                                  "(splash has, on TPU)",
              ("gpt_oss", HOPPER): "attention sinks: JAX's cuDNN attention (jax 0.10) takes "
                                   "none. cuDNN's frontend has them since cuDNN 9.13 and "
                                   "FlashAttention-3 as vLLM vendors it takes them; JAX "
                                   "reaches neither (splash takes them, on TPU)",
              ("t5", HOPPER): "a learned position bias; the encoder's and the "
                              "cross-attention are not causal self-attention",
              ("t5", TPU): "as on GPU"}

# Where a fused kernel could honour a pair counted unfused: (family, target) -> how.
# Empty since Llama 4's chunks run fused (a run per chunk on cuDNN's packed layout and
# as splash's segments): a pair counted again is explained here.
COULD: dict[tuple[str, str], str] = {}


def main(argv=None) -> None:
    simulate_devices(1)
    ap = parser(__doc__)
    ap.add_argument("--no-lowering", action="store_true",
                    help="pick kernels only; lower no step")
    ap.add_argument("--listed", action="store_true",
                    help="the models' layers as a list (scan=False), not stacked: figure "
                         "attention_paths/unfused_defaults/listed, no target")
    args = ap.parse_args(argv)
    families = configs()
    if args.tiny:
        families = {k: families[k] for k in ("llama", "gemma2", "llama4")}
    tokens = 512 if args.tiny else TOKENS
    rows, unfused, disagree, seen, checked = [], [], [], set(), 0
    for family, config in families.items():
        for kind in KINDS:
            if family == "t5" and kind == "packed":
                continue  # T5 takes no segment ids
            found = picks(config, kind, tokens, scan=not args.listed)
            cells = []
            for name in targets():
                kernels = found[name]
                cells.append(cell(kernels))
                if not args.no_lowering:
                    got = lowered(config, kind, tokens, name, scan=not args.listed)
                    checked += 1
                    seen.update(n for names in got.values() for n in names)
                    if set(got) != set(kernels) & set(FUSED):
                        disagree.append(f"{family} {kind} on {name}: picked {kernels}, "
                                        f"lowered to {got or 'no fused kernel'}")
                runs = {at_run_time(k, why, kind) for k, why in kernels.items()}
                if name in (HOPPER, TPU) and not runs <= set(FUSED) \
                        and (family, name) not in EXCEPTIONS:
                    unfused.append((family, kind, name, kernels))
            rows.append((family, kind, *cells))
    table = ["| family | rows | " + " | ".join(targets()) + " |",
             "|---|---|" + "---|" * len(targets())]
    table += ["| " + " | ".join(row) + " |" for row in rows]
    print("\n".join(table))
    for family, kind, name, kernels in unfused:
        print(f"unfused: {family} {kind} on {name}: {kernels}")
    for line in disagree:
        print(f"lowering disagrees: {line}")
    pairs = sorted({(family, kind) for family, kind, *_ in unfused})
    save([figure("attention_paths/unfused_defaults" + ("/listed" if args.listed else ""),
                 len(pairs), "",
                 "(family, mask kind) pairs a bf16 model on Hopper or TPU computes with a "
                 "blockwise kernel or a materialized mask where a fused kernel could honour "
                 "it" + (", its layers a list (scan=False)" if args.listed else ""),
                 None if args.listed else "<= 0",
                 COMMAND + (" --listed" if args.listed else ""), table=table, exceptions={
                     f"{f} on {t}": why for (f, t), why in EXCEPTIONS.items()},
                 pairs=[f"{f} {k}" for f, k in pairs],
                 unfused=[f"{f} {k} on {n}: {v}" for f, k, n, v in unfused],
                 could={f"{f} on {t}": how for (f, t), how in COULD.items()
                        if any(u[0] == f and u[2] == t for u in unfused)},
                 lowered_cells=checked, lowered_kernels=sorted(seen),
                 lowering_disagrees=disagree, tokens=tokens)], args.out)


if __name__ == "__main__":
    main()
