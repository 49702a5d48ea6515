"""Attention paths: the kernel ``attention.choose`` picks for every model family and kind
of mask, on a GPU of Hopper's generation or newer, an older GPU (Ampere) and a TPU. No
device needed: each family's bf16 model (its real head size, windows, soft-capping and
biases, one layer) is traced abstractly at 4,096 tokens, and each of its attention calls
asks ``choose`` for each target.

Mask kinds: plain causal rows; rows whose padding trails (a collate's right padding);
rows whose padding leads (a generation batch's left padding); packed rows (segment ids,
as ``redray.data.prepare(pack=N)`` writes them). A family's sliding window (Mistral,
Gemma's local layers) is in every kind of its rows.

Figure: ``attention_paths/unfused_defaults``: how many (family, kind) pairs a bf16
model on Hopper or on TPU computes, in some attention call, with the blockwise kernel
or a materialized mask where a fused kernel could honour the mask. The exceptions,
where none can: soft-capped scores on a GPU (cuDNN has none; splash on TPU has), a
learned position bias (T5: neither kernel takes one without it materialized), and
attention that is not causal self-attention (T5's encoder and cross-attention).
Target: 0.

    python benchmarks/attention_paths.py [--tiny]
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import figure, parser, save, simulate_devices  # noqa: E402

COMMAND = "python benchmarks/attention_paths.py"
TOKENS = 4096
KINDS = ("causal", "trailing padding", "leading padding", "packed")


def configs():
    """Each family's tiny config with its real head size and attention features."""
    import transformers as t

    common = dict(vocab_size=256, num_hidden_layers=1, intermediate_size=256)
    llama = dict(common, hidden_size=256, num_attention_heads=2, num_key_value_heads=1,
                 head_dim=128)
    moe = dict(llama, num_local_experts=2, num_experts_per_tok=1)
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

    return {"GPU, Hopper+": Target("gpu", packed=True), "GPU, Ampere": Target("gpu"),
            "TPU": Target("tpu")}


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


def picks(config, kind: str, tokens: int) -> dict[str, dict[str, str]]:
    """Target -> {kernel: why} over the model's attention calls for a batch of ``kind``
    (the model traced abstractly; each call computed the XLA way meanwhile)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    import redray.models as rm
    from redray.models import attention

    found = {name: {} for name in targets()}
    decide = attention.decide

    def asking(q, k, mask, bias, dropout, asked=None, softcap=None, target=None):
        for name, each in targets().items():
            kernel, why = decide(q, k, mask, bias, dropout, "auto", softcap, each)
            found[name].setdefault(kernel, why)
        return ("dense" if softcap is not None or dropout is not None else "xla"), "traced"

    ids, mask, seg = batch(kind, 1, tokens)
    model = nnx.eval_shape(lambda: rm.build(config, dtype=jnp.bfloat16))
    graphdef, state = nnx.split(model)
    attention.decide = asking
    try:
        def forward(state):
            m = nnx.merge(graphdef, state)
            if config.model_type == "t5":
                return m(jnp.asarray(ids), None if mask is None else jnp.asarray(mask),
                         decoder_input_ids=jnp.asarray(ids))
            return m(jnp.asarray(ids), None if mask is None else jnp.asarray(mask),
                     segment_ids=None if seg is None else jnp.asarray(seg))

        jax.eval_shape(forward, state)
    finally:
        attention.decide = decide
    return found


# Where no fused kernel can honour the attention: (family, target) -> why.
EXCEPTIONS = {("gemma2", "GPU, Hopper+"): "soft-capped scores: cuDNN has no soft-capping "
                                          "(splash has, on TPU)",
              ("t5", "GPU, Hopper+"): "a learned position bias; the encoder's and the "
                                      "cross-attention are not causal self-attention",
              ("t5", "TPU"): "as on GPU"}


def main(argv=None) -> None:
    simulate_devices(1)
    args = parser(__doc__).parse_args(argv)
    families = configs()
    if args.tiny:
        families = {k: families[k] for k in ("llama", "gemma2")}
    tokens = 512 if args.tiny else TOKENS
    rows, unfused = [], []
    for family, config in families.items():
        for kind in KINDS:
            if family == "t5" and kind == "packed":
                continue  # T5 takes no segment ids
            found = picks(config, kind, tokens)
            cells = []
            for name in targets():
                kernels = found[name]
                cells.append(", ".join(k if k != "cudnn" or kernels[k] == "causal"
                                       else f"cudnn ({kernels[k]})" for k in sorted(kernels)))
                fused = set(kernels) <= {"cudnn", "splash"}
                if name in ("GPU, Hopper+", "TPU") and not fused \
                        and (family, name) not in EXCEPTIONS:
                    unfused.append((family, kind, name, kernels))
            rows.append((family, kind, *cells))
    table = ["| family | rows | " + " | ".join(targets()) + " |",
             "|---|---|" + "---|" * len(targets())]
    table += ["| " + " | ".join(row) + " |" for row in rows]
    print("\n".join(table))
    for family, kind, name, kernels in unfused:
        print(f"unfused: {family} {kind} on {name}: {kernels}")
    save([figure("attention_paths/unfused_defaults", len(unfused), "",
                 "(family, mask kind) pairs a bf16 model on Hopper or TPU computes with a "
                 "blockwise kernel or a materialized mask where a fused kernel could honour "
                 "it", "<= 0", COMMAND, table=table, exceptions={
                     f"{f} on {t}": why for (f, t), why in EXCEPTIONS.items()},
                 unfused=[f"{f} {k} on {n}: {v}" for f, k, n, v in unfused])], args.out)


if __name__ == "__main__":
    main()
