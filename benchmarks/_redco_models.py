"""What both sides of the redco comparison train: Linen models, their data and loss.

Imported by benchmarks/redco.py's redray side (redray's venv) and by
benchmarks/_redco_driver.py (redco's venv), so it needs only jax, flax, optax and
numpy. Both sides train literally the same Linen module on the same examples.
"""

from __future__ import annotations

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
