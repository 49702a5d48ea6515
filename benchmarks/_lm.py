"""What the language-model benchmarks share: the tiny model sizes, the ``transformers``
configs of each family at those sizes, the collate function and the losses.

A causal-LM example is a window of token ids ``{"ids": (seq + 1,)}``; a T5 example is
``{"input_ids": (seq,), "labels": (seq,)}``.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import optax

FAMILIES = ("gpt2", "llama", "opt", "gptj", "t5")
# redray's own families with experts, configured by ``config`` too: 4 experts each
MOE_FAMILIES = ("gpt_oss", "llama4")
EXPERTS = 4
# the dense 2026 families, configured by ``config`` too
DENSE_2026 = ("olmo3", "smollm3")
# the hybrid linear-attention families, configured by ``config`` too
HYBRID = ("qwen3_next", "qwen3_5")


@dataclasses.dataclass(frozen=True)
class Sizes:
    layers: int = 2
    hidden: int = 256
    heads: int = 4
    intermediate: int = 1024
    vocab: int = 1024
    batch: int = 8
    seq: int = 128


FULL = Sizes()
TINY = Sizes(layers=1, hidden=64, heads=4, intermediate=128, vocab=128, batch=4, seq=16)


def config(family: str, s: Sizes):
    """The ``transformers`` config of a model of ``family`` at sizes ``s`` (no dropout,
    untied LM head where the family allows it).

    ``gpt_oss``: ``EXPERTS`` experts, top-2, a sink per head, biases on the attention,
    the router and the experts, a window of seq/2 in its even layers (0, 2, ...), YaRN.
    ``llama4``: a dense and a MoE layer in turn (``interleave_moe_layer_step=2``), top-1
    of ``EXPERTS`` experts beside a shared expert (both ``intermediate`` wide, as the
    dense MLP), chunks of seq/4 in its rotary layers, every fourth layer NoPE with its
    queries' temperature counted in steps of seq/4.
    ``olmo3``: post-norm blocks, whole-projection q/k norms, a window of seq/2 in its
    even layers. ``smollm3``: every second layer NoPE.
    ``deepseek_v3``: latent attention (a query rank of hidden/2, a key/value latent of
    hidden/4, a quarter of each head rotary, values as wide as a head), its first half of
    the layers dense, then ``EXPERTS`` experts in 2 groups (top-2 of the best group)
    with a shared expert, each a quarter of ``intermediate`` wide.
    ``qwen3_5`` (Qwen3.5 dense) and ``qwen3_next`` (``EXPERTS`` experts, top-2, a
    sigmoid-gated shared expert, each a quarter of ``intermediate`` wide): three Gated
    DeltaNet layers to one full attention layer (a linear and a full one in turn below 4
    layers), as many key heads as ``heads`` and twice as many value heads, every head
    ``hidden / heads`` wide."""
    import transformers as hf

    gpt = dict(n_layer=s.layers, n_embd=s.hidden, n_head=s.heads, n_inner=s.intermediate,
               vocab_size=s.vocab, n_positions=s.seq, resid_pdrop=0.0, embd_pdrop=0.0,
               attn_pdrop=0.0, bos_token_id=s.vocab - 1, eos_token_id=s.vocab - 1)
    if family == "gpt2":
        return hf.GPT2Config(**gpt)
    if family == "gptj":
        return hf.GPTJConfig(rotary_dim=s.hidden // s.heads // 4, **gpt)
    if family == "llama":
        return hf.LlamaConfig(num_hidden_layers=s.layers, hidden_size=s.hidden,
                              num_attention_heads=s.heads, num_key_value_heads=s.heads,
                              intermediate_size=s.intermediate, vocab_size=s.vocab,
                              max_position_embeddings=s.seq, tie_word_embeddings=False)
    if family == "opt":
        return hf.OPTConfig(num_hidden_layers=s.layers, hidden_size=s.hidden,
                            num_attention_heads=s.heads, ffn_dim=s.intermediate,
                            vocab_size=s.vocab, max_position_embeddings=s.seq,
                            word_embed_proj_dim=s.hidden, dropout=0.0, attention_dropout=0.0)
    if family == "t5":
        return hf.T5Config(vocab_size=s.vocab, d_model=s.hidden, d_kv=s.hidden // s.heads,
                           num_heads=s.heads, d_ff=s.intermediate, num_layers=s.layers,
                           num_decoder_layers=s.layers, dropout_rate=0.0,
                           feed_forward_proj="relu")
    moe = dict(num_hidden_layers=s.layers, hidden_size=s.hidden, num_attention_heads=s.heads,
               num_key_value_heads=s.heads, head_dim=s.hidden // s.heads,
               intermediate_size=s.intermediate, num_local_experts=EXPERTS,
               vocab_size=s.vocab, max_position_embeddings=s.seq, tie_word_embeddings=False)
    if family == "gpt_oss":
        return hf.AutoConfig.for_model(
            "gpt_oss", **moe, num_experts_per_tok=2, sliding_window=s.seq // 2,
            rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                             "beta_slow": 1.0, "truncate": False, "rope_theta": 1.5e5,
                             "original_max_position_embeddings": s.seq // 4})
    if family == "llama4":
        return hf.AutoConfig.for_model(
            "llama4_text", **moe, num_experts_per_tok=1, intermediate_size_mlp=s.intermediate,
            interleave_moe_layer_step=2, attention_chunk_size=s.seq // 4,
            floor_scale=s.seq // 4)
    dense = dict(num_hidden_layers=s.layers, hidden_size=s.hidden, num_attention_heads=s.heads,
                 num_key_value_heads=s.heads, intermediate_size=s.intermediate,
                 vocab_size=s.vocab, max_position_embeddings=s.seq, tie_word_embeddings=False,
                 pad_token_id=None, bos_token_id=None, eos_token_id=None)
    if family == "olmo3":
        return hf.AutoConfig.for_model(
            "olmo3", **dense, sliding_window=s.seq // 2,
            layer_types=["sliding_attention", "full_attention"] * (s.layers // 2)
            + ["sliding_attention"] * (s.layers % 2))
    if family == "smollm3":
        return hf.AutoConfig.for_model("smollm3", **dense, no_rope_layer_interval=2)
    if family in HYBRID:
        d = s.hidden // s.heads
        sizes = dict(vocab=s.vocab, hidden=s.hidden, layers=s.layers,
                     intermediate=s.intermediate, heads=s.heads, kv_heads=s.heads, head_dim=d,
                     key_heads=s.heads, value_heads=2 * s.heads, linear_dim=d,
                     max_position_embeddings=s.seq)
        if family == "qwen3_5":
            return hybrid_config(**sizes)
        return hybrid_config(
            **sizes, model_type="qwen3_next", num_experts=EXPERTS, num_experts_per_tok=2,
            moe_intermediate_size=s.intermediate // EXPERTS,
            shared_expert_intermediate_size=s.intermediate // EXPERTS, norm_topk_prob=True)
    if family == "deepseek_v3":
        d = s.hidden // s.heads
        return hf.AutoConfig.for_model(
            "deepseek_v3", **dense, q_lora_rank=s.hidden // 2, kv_lora_rank=s.hidden // 4,
            qk_rope_head_dim=d // 4, qk_nope_head_dim=d - d // 4, v_head_dim=d,
            n_routed_experts=EXPERTS, num_experts_per_tok=2, n_group=2, topk_group=1,
            n_shared_experts=1, moe_intermediate_size=s.intermediate // EXPERTS,
            first_k_dense_replace=s.layers // 2, routed_scaling_factor=2.5,
            rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4,
                             "original_max_position_embeddings": s.seq // 4,
                             "mscale": 1.0, "mscale_all_dim": 1.0})
    raise ValueError(f"family {family!r}: choose from "
                     f"{', '.join(FAMILIES + MOE_FAMILIES + DENSE_2026 + HYBRID)}, deepseek_v3")


def hybrid_config(vocab: int, hidden: int, layers: int, intermediate: int, heads: int,
                  kv_heads: int, head_dim: int, key_heads: int, value_heads: int,
                  linear_dim: int, layer_types=None, model_type: str = "qwen3_5_text",
                  **fields):
    """A Qwen3.5 (text; or ``model_type``) config: ``layers`` layers, three Gated DeltaNet
    layers to one full attention layer (the released period; a linear and a full one in
    turn below 4 layers) unless ``layer_types`` says; the full layers' ``heads`` and
    ``kv_heads`` of ``head_dim``, the linear ones' ``key_heads`` and ``value_heads`` of
    ``linear_dim``; untied, no special tokens; ``fields``: any other config field."""
    import transformers as hf

    if layer_types is None:
        period = ["linear_attention"] * 3 + ["full_attention"] if layers >= 4 else \
            ["linear_attention", "full_attention"]
        layer_types = [period[i % len(period)] for i in range(layers)]
    fields = dict(dict(tie_word_embeddings=False, pad_token_id=None, bos_token_id=None,
                       eos_token_id=None), **fields)
    return hf.AutoConfig.for_model(
        model_type, vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
        intermediate_size=intermediate, num_attention_heads=heads,
        num_key_value_heads=kv_heads, head_dim=head_dim, linear_num_key_heads=key_heads,
        linear_num_value_heads=value_heads, linear_key_head_dim=linear_dim,
        linear_value_head_dim=linear_dim, layer_types=layer_types, **fields)


def collate(examples):
    return {k: np.stack([e[k] for e in examples]) for k in examples[0]}


def loss(model, batch, rng, train):
    """Next-token cross-entropy of a causal LM on ``batch["ids"]``; ``train`` reaches the
    model (dropout, and remat, which only training steps run)."""
    logits = model(batch["ids"][:, :-1], train=train)
    return optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), batch["ids"][:, 1:]).mean()


CHUNK = 2048  # tokens whose logits exist at once in ``chunked_loss``


def chunked_loss(model, batch, rng, train):
    """``loss`` with the LM head run on ``CHUNK`` tokens at a time
    (``redray.models.next_token_loss``): the full-vocabulary logits never exist whole.
    The communication benchmark keeps ``loss``: its ideal counts one vocabulary-parallel
    cross-entropy, not one per chunk."""
    from redray.models import next_token_loss

    return next_token_loss(model, batch["ids"], chunk=CHUNK, train=train)


def seq2seq_loss(model, batch, rng, train):
    """T5's cross-entropy: the decoder reads the labels shifted right from the pad token, 0."""
    labels = batch["labels"]
    decoder_input_ids = jnp.concatenate([jnp.zeros_like(labels[:, :1]), labels[:, :-1]], 1)
    logits = model(batch["input_ids"], decoder_input_ids=decoder_input_ids, train=train)
    return optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), labels).mean()
