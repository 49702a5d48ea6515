"""What both sides of the redco comparison train: Linen models, their data and loss.

Imported by benchmarks/redco.py's and benchmarks/communication.py's redray sides
(redray's venv) and by benchmarks/_redco_driver.py and benchmarks/_redco_step.py
(redco's venv), so it needs only jax, flax, optax and numpy. Both sides train
literally the same Linen module on the same examples.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn


class MLP(nn.Module):
    """fc_in 256->512 -> fc_mid 512->512 -> fc_out 512->16 (MEASURED.md's MLP)."""

    hidden: int = 512
    classes: int = 16

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(self.hidden, name="fc_in")(x))
        x = nn.relu(nn.Dense(self.hidden, name="fc_mid")(x))
        return nn.Dense(self.classes, name="fc_out")(x)


class Attention(nn.Module):
    heads: int

    @nn.compact
    def __call__(self, h):
        b, t, d = h.shape
        q, k, v = (nn.Dense(d, name=n)(h).reshape(b, t, self.heads, d // self.heads)
                   for n in ("q", "k", "v"))
        att = jnp.einsum("bthd,bshd->bhts", q, k) / np.sqrt(d // self.heads)
        att = jnp.where(jnp.tril(jnp.ones((t, t), bool)), att, -1e9)
        a = jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(att, -1), v).reshape(b, t, d)
        return nn.Dense(d, name="o")(a)


class Block(nn.Module):
    heads: int

    @nn.compact
    def __call__(self, x):
        x = x + Attention(self.heads, name="attn")(nn.LayerNorm(name="ln1")(x))
        h = nn.LayerNorm(name="ln2")(x)
        h = nn.Dense(4 * x.shape[-1], name="fc_in")(h)
        return x + nn.Dense(x.shape[-1], name="fc_out")(jax.nn.gelu(h))


class LM(nn.Module):
    """A small pre-norm decoder: embedding, ``layers`` blocks, tied LM head.

    Parameter names follow the conventions redco's rules look for (``attn``,
    ``q``/``k``/``v``/``o``, ``fc_in``/``fc_out``), so redco shards it Megatron-style.
    """

    vocab: int = 256
    dim: int = 128
    heads: int = 4
    layers: int = 2

    @nn.compact
    def __call__(self, ids):
        wte = nn.Embed(self.vocab, self.dim, name="wte")
        x = wte(ids)
        for i in range(self.layers):
            x = Block(self.heads, name=f"block_{i}")(x)
        return wte.attend(nn.LayerNorm(name="ln_f")(x))


def attention(q, k, v):
    t = q.shape[1]
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, jnp.finfo(s.dtype).min)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v)


def _dense(features: int, name: str | None, hf_names: bool):
    return nn.Dense(features, use_bias=False, name=name if hf_names else None)


class _SeparateAttention(nn.Module):
    heads: int
    hf_names: bool = False

    @nn.compact
    def __call__(self, h):
        b, t, d = h.shape
        q, k, v = (_dense(d, n, self.hf_names)(h).reshape(b, t, self.heads, d // self.heads)
                   for n in ("q_proj", "k_proj", "v_proj"))
        return _dense(d, "o_proj", self.hf_names)(attention(q, k, v).reshape(b, t, d))


class _SeparateMlp(nn.Module):
    intermediate: int
    hf_names: bool = False

    @nn.compact
    def __call__(self, h):
        gate = _dense(self.intermediate, "gate_proj", self.hf_names)(h)
        up = _dense(self.intermediate, "up_proj", self.hf_names)(h)
        return _dense(h.shape[-1], "down_proj", self.hf_names)(nn.silu(gate) * up)


class _SeparateBlock(nn.Module):
    heads: int
    intermediate: int
    hf_names: bool = False

    @nn.compact
    def __call__(self, x):
        named = self.hf_names
        h = nn.RMSNorm(name="input_layernorm" if named else None)(x)
        x = x + _SeparateAttention(self.heads, named, name="self_attn" if named else None)(h)
        h = nn.RMSNorm(name="post_attention_layernorm" if named else None)(x)
        return x + _SeparateMlp(self.intermediate, named, name="mlp" if named else None)(h)


class SeparateLM(nn.Module):
    """A LLaMA written plainly: Q, K, V, gate and up each their own projection,
    auto-named (``Dense_0``...), or with ``hf_names`` the parameter names of Hugging
    Face's Flax LLaMA (``layers_0/self_attn/q_proj/kernel``,
    ``layers_0/mlp/gate_proj/kernel``...), the models redco was written for."""
    s: Any  # benchmarks/_lm.py's Sizes: layers, hidden, heads, intermediate, vocab
    hf_names: bool = False

    @nn.compact
    def __call__(self, ids):
        s = self.s
        x = nn.Embed(s.vocab, s.hidden, name="embed_tokens" if self.hf_names else None)(ids)
        for i in range(s.layers):
            x = _SeparateBlock(s.heads, s.intermediate, self.hf_names,
                               name=f"layers_{i}" if self.hf_names else None)(x)
        x = nn.RMSNorm(name="norm" if self.hf_names else None)(x)
        return _dense(s.vocab, "lm_head", self.hf_names)(x)


class DenseStack(nn.Module):
    """A Linen MLP of ``depth`` auto-named layers (Dense_0 ... Dense_11)."""
    width: int = 512
    classes: int = 16
    depth: int = 12

    @nn.compact
    def __call__(self, x):
        for _ in range(self.depth - 1):
            x = nn.relu(nn.Dense(self.width)(x))
        return nn.Dense(self.classes)(x)


def mlp_examples(n: int, seed: int = 0) -> list[dict]:
    """Inputs with labels a fixed random projection makes learnable."""
    rs = np.random.default_rng(seed)
    x = rs.standard_normal((n, 256)).astype(np.float32)
    labels = (x @ rs.standard_normal((256, 16))).argmax(-1).astype(np.int32)
    return [{"x": xi, "label": yi} for xi, yi in zip(x, labels)]


def lm_examples(n: int, seq: int, vocab: int, seed: int = 0) -> list[dict]:
    """Sequences counting up mod ``vocab`` with 10% noise tokens."""
    rs = np.random.default_rng(seed)
    seqs = (rs.integers(0, vocab, n)[:, None] + np.arange(seq)[None]) % vocab
    seqs = np.where(rs.random((n, seq)) < 0.1, rs.integers(0, vocab, (n, seq)), seqs)
    return [{"ids": s.astype(np.int32)} for s in seqs]


def collate(examples):
    return {k: np.stack([e[k] for e in examples]) for k in examples[0]}


def task(config: dict):
    """(module, examples, example input) of a benchmark configuration."""
    if config["task"] == "mlp":
        return MLP(), mlp_examples(config["examples"]), np.zeros((1, 256), np.float32)
    lm = LM(vocab=config["vocab"], dim=config["dim"], layers=config["layers"])
    return (lm, lm_examples(config["examples"], config["seq"], config["vocab"]),
            np.zeros((1, config["seq"] - 1), np.int32))


def loss_of(apply, batch):
    """Mean cross-entropy of the model ``apply`` (inputs -> logits) on a batch."""
    if "ids" in batch:
        logits, labels = apply(batch["ids"][:, :-1]), batch["ids"][:, 1:]
    else:
        logits, labels = apply(batch["x"]), batch["label"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
