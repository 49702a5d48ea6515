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
    untied LM head where the family allows it)."""
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
    raise ValueError(f"family {family!r}: choose from {', '.join(FAMILIES)}")


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
