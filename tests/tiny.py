"""Tiny models and helpers shared by the tests."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx


class TinyLM(nnx.Module):
    """Embedding, one pre-norm attention + MLP block, tied LM head."""

    def __init__(self, rngs, vocab=64, dim=32, heads=4, dropout=0.0):
        self.heads = heads
        self.wte = nnx.Embed(vocab, dim, rngs=rngs)
        self.ln1 = nnx.LayerNorm(dim, rngs=rngs)
        self.q, self.k, self.v = (nnx.Linear(dim, dim, rngs=rngs) for _ in range(3))
        self.o = nnx.Linear(dim, dim, rngs=rngs)
        self.ln2 = nnx.LayerNorm(dim, rngs=rngs)
        self.fc1 = nnx.Linear(dim, 4 * dim, rngs=rngs)
        self.fc2 = nnx.Linear(4 * dim, dim, rngs=rngs)
        self.drop = nnx.Dropout(dropout, rngs=rngs)

    def __call__(self, ids, train=False):
        x = self.wte(ids)
        b, t, d = x.shape
        h = self.ln1(x)
        q, k, v = (f(h).reshape(b, t, self.heads, d // self.heads)
                   for f in (self.q, self.k, self.v))
        att = jnp.einsum("bthd,bshd->bhts", q, k) / np.sqrt(d // self.heads)
        att = jnp.where(jnp.tril(jnp.ones((t, t), bool)), att, -1e9)
        a = jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(att, -1), v).reshape(b, t, d)
        x = x + self.drop(self.o(a), deterministic=not train)
        x = x + self.fc2(jax.nn.gelu(self.fc1(self.ln2(x))))
        return self.wte.attend(x)


def token_data(n, seq=16, vocab=64, seed=0):
    """Sequences with a learnable pattern: next token = (token + 1) mod vocab, with noise."""
    rs = np.random.default_rng(seed)
    starts = rs.integers(0, vocab, n)
    seqs = (starts[:, None] + np.arange(seq)[None]) % vocab
    noise = rs.random((n, seq)) < 0.1
    seqs = np.where(noise, rs.integers(0, vocab, (n, seq)), seqs)
    return [{"ids": s.astype(np.int32)} for s in seqs]


def lm_collate(examples):
    return {"ids": np.stack([e["ids"] for e in examples])}


def lm_loss(model, batch, rng, train):
    logits = model(batch["ids"][:, :-1], train=train)
    labels = batch["ids"][:, 1:]
    loss = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels)
    return loss.mean(), {"accuracy": (logits.argmax(-1) == labels).mean()}


def lm_predict(model, batch, rng):
    return model(batch["ids"]).argmax(-1)


class Counting:
    """Wraps a collate function and counts its calls (to prove errors come early)."""

    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, examples):
        self.calls += 1
        return self.fn(examples)


def assert_same(a, b):
    """Two pytrees hold bitwise-equal arrays (PRNG keys compared by their data)."""
    def host(x):
        is_key = jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
        return np.asarray(jax.random.key_data(x) if is_key else x)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(host(x), host(y))


def assert_trains_as_one_device(config, loss, seq: int, **split):
    """Trains a stacked-layer redray model of ``config`` for 3 steps of 8 rows of ``seq``
    token ids (``batch["ids"]``) with ``loss`` on one device and on the plan ``split``
    asks for (Trainer keywords); asserts the same losses (1e-5 relative) and the same
    parameters after them. Returns (the split run's history, one device's losses)."""
    import redray
    from redray.models import build

    data = [{"ids": row} for row in np.random.default_rng(1).integers(0, 64, (24, seq))]

    def trainer(**kw):
        return redray.Trainer.of(lambda rngs: build(config, rngs=rngs, scan=True),
                              lambda ex: {"ids": np.stack([e["ids"] for e in ex])}, loss,
                              optax.sgd(0.5, momentum=0.5), batch_size=8, progress=False,
                              log_every=1, **kw)

    one = trainer(mesh=redray.make_mesh(devices=jax.devices()[:1]))
    expected = [r["loss"] for r in one.fit(data, epochs=1)]
    other = trainer(**split)
    history = other.fit(data, epochs=1)
    np.testing.assert_allclose([r["loss"] for r in history], expected, rtol=1e-5)
    for got, want in zip(jax.tree.leaves(nnx.state(other.model, nnx.Param)),
                         jax.tree.leaves(nnx.state(one.model, nnx.Param)), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0,
                                   atol=1e-5 * float(np.max(np.abs(want))) + 1e-7)
    return history, expected


def memory_case(layers: int, rows: int):
    """The memory tests' model and data: a LLaMA of ``layers`` layers (hidden 128,
    vocabulary 512, untied head), ``rows`` random rows of 65 ids, and the collate and
    ``next_token_loss`` loss a Trainer runs them with."""
    import transformers

    from redray.models import next_token_loss

    config = transformers.LlamaConfig(hidden_size=128, intermediate_size=512,
                                      num_hidden_layers=layers, num_attention_heads=4,
                                      vocab_size=512, tie_word_embeddings=False)
    data = [{"ids": r} for r in np.random.default_rng(0).integers(0, 512, (rows, 65), np.int32)]

    def loss(model, batch, rng, train):
        return next_token_loss(model, batch["ids"], train=train)

    return config, data, lm_collate, loss


def _short_conv(x, w):
    """A causal depthwise convolution as users write it: x (b, t, c), w (width, c)."""
    padded = jnp.pad(x, ((0, 0), (w.shape[0] - 1, 0), (0, 0)))
    return sum(padded[:, i:i + x.shape[1]] * w[i] for i in range(w.shape[0]))


class LinearMixer(nnx.Module):
    """A gated linear attention written as a researcher writes one, every name
    meaningless to redray: separate q (``p1``), k (``p2``), v (``p3``) projections, each
    through its own short causal convolution (``w1``-``w3``, (width, dim)) and SiLU; a
    decay per head and token, ``-exp(s1) * softplus(p4(x))``; the state ``S = exp(g) S +
    k v^T`` per head read by q, either by a ``lax.scan`` over tokens (``form="scan"``)
    or as masked decayed q.k scores times v (``"parallel"``); a per-head RMS norm scaled
    by ``s2`` (heads, head dim), gated by SiLU of ``p5(x)``; the output projection
    ``p6``."""

    def __init__(self, rngs, dim=64, heads=4, width=4, form="scan"):
        linear = lambda i, o, bias=False: nnx.Linear(i, o, use_bias=bias, rngs=rngs)  # noqa: E731
        self.p1, self.p2, self.p3 = linear(dim, dim), linear(dim, dim), linear(dim, dim)
        self.p4 = linear(dim, heads, True)
        self.p5, self.p6 = linear(dim, dim), linear(dim, dim)
        conv = lambda: nnx.Param(jax.random.uniform(  # noqa: E731
            rngs.params(), (width, dim), minval=-width ** -0.5, maxval=width ** -0.5))
        self.w1, self.w2, self.w3 = conv(), conv(), conv()
        self.s1 = nnx.Param(jnp.zeros((heads,)))
        self.s2 = nnx.Param(jnp.ones((heads, dim // heads)))
        self.heads, self.form = heads, form

    def __call__(self, x):
        b, t, d = x.shape
        split = lambda a: a.reshape(b, t, self.heads, -1)  # noqa: E731
        q, k, v = (split(jax.nn.silu(_short_conv(p(x), w[...])))
                   for p, w in ((self.p1, self.w1), (self.p2, self.w2), (self.p3, self.w3)))
        q = q / jnp.sqrt(q.shape[-1])
        g = -jnp.exp(self.s1[...]) * jax.nn.softplus(self.p4(x))  # (b, t, heads)
        if self.form == "scan":
            def step(state, inputs):
                qt, kt, vt, gt = inputs
                state = jnp.exp(gt)[..., None, None] * state + \
                    jnp.einsum("bhd,bhe->bhde", kt, vt)
                return state, jnp.einsum("bhd,bhde->bhe", qt, state)

            by_token = lambda a: jnp.moveaxis(a, 1, 0)  # noqa: E731
            start = jnp.zeros((b, self.heads, d // self.heads, d // self.heads), x.dtype)
            _, o = jax.lax.scan(step, start, tuple(map(by_token, (q, k, v, g))))
            o = jnp.moveaxis(o, 0, 1)
        else:
            c = jnp.cumsum(g, 1)
            causal = jnp.tril(jnp.ones((t, t), bool))[None, :, :, None]
            decay = jnp.where(causal, jnp.exp(jnp.where(
                causal, c[:, :, None, :] - c[:, None, :, :], 0.0)), 0.0)
            o = jnp.einsum("btsh,bshd->bthd",
                           jnp.einsum("bthd,bshd->btsh", q, k) * decay, v)
        o = o * jax.lax.rsqrt(jnp.mean(o * o, -1, keepdims=True) + 1e-6) * self.s2[...]
        return self.p6((o * jax.nn.silu(split(self.p5(x)))).reshape(b, t, d))


class LinearLM(nnx.Module):
    """Embedding, ``layers`` pre-norm blocks (``LinearMixer``, then a GELU MLP), a final
    norm and an untied LM head, auto-named lists."""

    def __init__(self, rngs, vocab=128, dim=64, heads=4, layers=2, mlp=256, form="scan"):
        self.e = nnx.Embed(vocab, dim, rngs=rngs)
        self.n1 = nnx.List([nnx.RMSNorm(dim, rngs=rngs) for _ in range(layers)])
        self.m = nnx.List([LinearMixer(rngs, dim, heads, form=form) for _ in range(layers)])
        self.n2 = nnx.List([nnx.RMSNorm(dim, rngs=rngs) for _ in range(layers)])
        self.f1 = nnx.List([nnx.Linear(dim, mlp, rngs=rngs) for _ in range(layers)])
        self.f2 = nnx.List([nnx.Linear(mlp, dim, rngs=rngs) for _ in range(layers)])
        self.n = nnx.RMSNorm(dim, rngs=rngs)
        self.h = nnx.Linear(dim, vocab, use_bias=False, rngs=rngs)

    def __call__(self, ids):
        x = self.e(ids)
        for n1, m, n2, f1, f2 in zip(self.n1, self.m, self.n2, self.f1, self.f2):
            x = x + m(n1(x))
            x = x + f2(jax.nn.gelu(f1(n2(x))))
        return self.h(self.n(x))
