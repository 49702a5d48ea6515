"""Communication: bytes of the collectives in the compiled training step, over the ideal.

Every case is redray's real training step (``redray.Trainer``, Adam, ``model_axis=4``,
4 simulated CPU devices, fp32) compiled once; every collective of
``compiled.as_text()`` is counted (``redray.sharding.collectives``: all-reduce,
all-gather, reduce-scatter, all-to-all, collective-permute; an all-gather counts its
gathered size, a tuple all-reduce every operand) and divided by the ideal.
``detail.idle_bytes`` is the part of those bytes in collectives each of whose device
groups holds one device (an all-reduce over mesh axes of size 1), which move nothing.

Cases (``communication/<case>``), language models at 2 layers, hidden 256, 4 heads,
intermediate 1024, vocabulary 1024, batch 8 x sequence 128:

* ``gpt2``, ``llama``, ``opt``, ``gptj``, ``t5``: redray's own models
  (``redray.models``), Q/K/V and gate/up each in one kernel laid out per head.
* ``separate_qkv``: a Linen LLaMA written plainly, auto-named (``Dense_0``...), with
  separate Q, K, V, gate and up projections (``benchmarks/_others.py``).
* ``parallel_residual``: a Linen GPT-J-style block (attention and MLP read one normed
  input and are added), separate Q, K and V, auto-named.
* ``gpt2_layout``: a Linen GPT-2 with one (hidden, 3 * hidden) q|k|v kernel cut into
  thirds after the matmul: the rules leave it (and the projection after it) whole and
  say so; its figure is below 1.0 because its attention communicates nothing, and
  ``detail.param_bytes_over_ideal`` is what that costs in memory.
* ``gemma``: Google's Gemma, the ``gemma`` package's (2.0.8) Linen ``Transformer``, with
  4 key/value heads (Gemma 7B's per-head QKV einsum).
* ``penzai_llama``: penzai 0.2.5's LLaMA (separate query/key/value and gate/value
  layers on named axes) in a 15-line NNX wrapper (``benchmarks/_others.py``).
* ``dense12``: a Linen MLP of 12 auto-named ``Dense`` layers, 256 -> 512 x 11 -> 16,
  batch 64 (MEASURED.md's MLP, deeper).
* ``gpt_oss``, ``llama4``: redray's own gpt-oss and Llama 4 (text) at the sizes above,
  with 4 experts (the model axis splits each expert's inner width, as ``moe_tp``'s
  Megatron specs do; the routers whole). gpt-oss: 2 layers, top-2 of the experts,
  a sink per head, biases on every attention projection, on the router and on the
  experts, a window of S/2 in its first layer, YaRN. Llama 4: 4 layers, a dense and a
  MoE layer in turn (``interleave_moe_layer_step=2``), chunks of S/4 in the first three
  and none in the fourth (NoPE), the MoE layers' top-1 expert (its sigmoid scaling the
  token before the expert) beside a shared expert of the same width. The dense MLP is
  ``intermediate`` wide.
* ``qwen3_5``, ``qwen3_next``: redray's own Qwen3.5 (dense) and Qwen3-Next (4 experts,
  top-2, a sigmoid-gated shared expert) at 4 layers: three Gated DeltaNet layers (4 key
  heads, 8 value heads, each 64 wide; their q, k, v, z, b, a projections grouped by key
  head, a convolution of 4 tokens) and one gated full attention layer.
* ``linear_attention_user``: the linear-attention LM ``tests/tiny.py`` writes
  (``LinearLM``), every name meaningless (``p1``...``p6``, ``w1``...``w3``, ``s1``,
  ``s2``): separate q, k, v projections each through a short convolution, a per-head
  decay ``-exp(s1) * softplus(p4(x))``, the state run by a ``lax.scan`` over tokens, a
  per-head norm scale and an output gate; 2 layers with a GELU MLP.
* ``mla``: redray's own DeepSeek-V3 (``redray/models/deepseek.py``) at 2 layers, a dense
  one and a MoE one (4 experts in 2 groups, top-2 within the best group, a shared
  expert): latent attention with a query rank of 128, a key/value latent of 64 and a
  rotary key part of 16 (the heads 48 + 16 wide, values 64).
* ``moe_tp``: two NNX mixture-of-experts LMs written as a user writes them
  (``benchmarks/_others.py``): separate Q, K, V and O, a router, and 4 SwiGLU experts run
  densely on every token and mixed by the top-2 router weights, the experts either
  stacked in (experts, hidden, intermediate) kernels used through einsum
  (``StackedMoELM``) or a list of expert modules (``ListMoELM``); untied LM head.

The ideal, in bytes, with A = B*S*H*4 the bytes of one fp32 activation (batch B,
sequence S, hidden H), is the fewest all-reduces tensor parallelism needs:

* decoder-only, L layers (``gpt2``, ``llama``, ``opt``, ``separate_qkv``,
  ``gpt2_layout``, ``gemma``, ``penzai_llama``): Megatron-LM's
  ``(4L + 2) * A + 3 * B*S*4 + 4``: per layer 2 all-reduces forward (after the attention
  output projection and after the MLP's row layer) and 2 backward (the input gradients
  of the column layers reading each sublayer's input, summed into one partial sum); 1
  forward all-reduce for the vocabulary-parallel embedding lookup, 1 backward for the
  input gradient of the vocabulary-parallel LM head; 3 of B*S floats for the
  vocabulary-parallel cross-entropy (max, sum of exponentials, the label's logit); 1
  scalar (the gradient norm).
* a decoder with mixture-of-experts layers (``gpt_oss``, ``llama4``, ``qwen3_next``), L
  layers of which L_moe have experts, k of them per token: ``(4L + 2) * A + L_moe *
  B*S*k*4 + 3 * B*S*4 + 4``. A MoE layer is a sublayer like an MLP: each device computes its share
  of the inner width of every expert a token uses (and of Llama 4's shared expert) and
  of the output projections, so the experts' outputs, weighted and added (with the
  shared expert's), are one partial sum: 1 forward all-reduce; the input gradients of
  every expert's and the shared expert's gate/up, summed, 1 backward. The routers are
  whole (their logits pick experts) and read the replicated normed input: their
  gradients need nothing, but the routing weights' gradients do: a weight multiplies an
  expert output that is a partial sum until the forward all-reduce (gpt-oss), or scales
  the token whose gradient is one until the backward one (Llama 4), so its gradient (its
  dot product with the output's or the input's gradient) is a partial sum too: one
  all-reduce of B*S*k floats per MoE layer. gpt-oss's sinks, one per head, split with
  the heads, and so do the attention projections' biases but the output's (added after
  the all-reduce, whole); the router's bias is whole; the experts' gate/up biases split
  with their inner width; their down biases are added after the all-reduce (whole):
  none of them communicates.
* a linear-attention layer (``qwen3_5``, ``qwen3_next``, ``linear_attention_user``) is
  a sublayer like attention, counted in the decoder formula above: its q, k and v (and
  the output gate z, the write rate b and the decay a) are column layers reading the
  normed input, split by (key) head groups; the output projection is row. So 1 forward
  all-reduce after the output projection, 1 backward for the summed input gradients of
  the column layers. The per-head parameters (the convolution kernel, the decay's rate
  and step bias, the user model's per-head norm scale) split with the heads and
  communicate nothing; the recurrence runs inside each device's heads. Gated DeltaNet's
  norm scale (one value head's width, shared by all heads) and the full attention's
  q/k norm scales are whole and scale head-split values: their gradients are partial
  sums, a few hundred bytes the ideal leaves out. ``qwen3_next`` counts as a decoder
  with experts (the formula below); its shared expert's sigmoid gate (one unit per
  token) is whole.
* latent attention (``mla``) as Megatron-LM's multi-latent attention splits it: the
  heads over ``model`` (``q_b_proj`` and ``kv_b_proj`` column parallel along their
  heads, ``o_proj`` row), the latent path whole on every device (the down projections
  ``q_a_proj`` and ``kv_a_proj_with_mqa``, their norms, the rotary key part shared by
  the heads). Its forward all-reduce is the output projection's (A); its backward
  all-reduce is of the cotangents of what the whole latent path hands the head-split
  layers, the query latent, the key/value latent and the rotary key part: B*S*(q_lora +
  kv_lora + rope)*4 bytes in place of A (narrower than the hidden state in the
  released shapes, 1536 + 512 + 64 against 7168). So the MoE formula with each layer's
  attention backward A replaced by that latent term.
* parallel residual (``gptj``, ``parallel_residual``): ``(2L + 2) * A + 3 * B*S*4 + 4``,
  as GPT-J's own implementation (mesh-transformer-jax) reduces it: one forward
  all-reduce per layer of the attention and MLP outputs added, one backward of the input
  gradient of every column layer reading the shared normed input. (Megatron-LM's
  per-sublayer count, ``(4L + 2) * A``, is in ``detail.megatron_bytes``.)
* T5, L_e encoder and L_d decoder layers, encoder length S_e, decoder length S_d,
  A_e = B*S_e*H*4, A_d = B*S_d*H*4:
  ``(4 L_e + 2) * A_e + (6 L_d + 2) * A_d + 3 * B*S_d*4 + 4``: the encoder's embedding
  lookup (1) and per encoder layer self-attention + MLP (2 forward, 2 backward); per
  decoder layer self-attention (2), MLP (2) and cross-attention: 1 forward after its
  output projection, 1 backward for the query's input gradient (A_d); 1 backward for
  the input gradient that the keys and values of every decoder layer give the encoder
  output (A_e, summed over the decoder layers first: Megatron-LM reduces it once per
  decoder layer, ``L_d * A_e``, its total is in ``detail.megatron_bytes``); the decoder's
  embedding lookup and the LM head's input gradient (shared embedding,
  vocabulary-parallel) (2 A_d); the cross-entropy and the scalar as above.
* ``dense12``, width W, C classes, batch B: layers alternate column and row (Dense_0
  column, Dense_1 row, ...), so ``6`` forward all-reduces of the row layers' outputs
  (5 of B*W*4 bytes, the last of B*C*4) and ``5`` backward of the column layers' input
  gradients (B*W*4; Dense_0 reads the data, which needs none), plus the scalar.

``communication/moe_ep``: redray's Mixtral (``redray.models``; 4 experts, top-2, the
sizes above) with ``expert_axis=4`` and the all-to-all exchange (the experts split over
the 4 devices, each device's tokens sent to their experts by all-to-all and back; a
dropless layer's own exchange, the gather, is ``benchmarks/moe_exchange.py``'s), against the ideal
all-to-all bytes: a device sends each of its tokens' ``top_k`` hidden vectors to their
experts and gets them back, in the forward pass and again (the transposes) in the
backward: ``4 x L x (B*S / 4) x top_k x H x 4`` bytes (counting the whole buffer, as
XLA's all-to-all does, including the quarter a device keeps). With a capacity factor of
1 the slots are exactly that (the figure); dropless on XLA:CPU, whose all-to-all is
fixed-size, every (device, expert) pair has a slot per token, experts / top_k times
the ideal (``communication/moe_ep/dropless``).

``communication/moe_tp`` has its own reference: the same step compiled with the specs a
user writes by hand for Megatron-style tensor parallelism of these models (``rules=``,
one rule per parameter, ``_others.MOE_MEGATRON_RULES``): q, k, v column and o row; each
expert's gate and up split on its intermediate size, its down on its input; the router
whole; the embedding split on the vocabulary, the LM head column; norms whole. Its value
is the larger of the two models' (automatic bytes / hand-written bytes); ``detail`` has
each model's bytes and collectives both ways, the automatic spec of every MoE parameter
and every parameter whose automatic spec differs from the hand-written one.

redray reaches these counts because it adds partial sums before reducing them
(``redray/sharding/reductions.py``): all column layers that read one activation give
one backward all-reduce, all row layers whose outputs are added one forward all-reduce,
whatever the number of kernels. XLA:CPU reduces each partial sum separately, which is
what the models written without redray cost before (separate Q/K/V: 1.60x).

``communication/<case>/unfused`` is the same step compiled without
``fuse_reductions`` (``ModelRuntime.train_apply`` replaced by ``apply``): what XLA
alone makes of the same specs.

Beside redray, in the same run, the same step is compiled with the specs redco 0.4.23's
rules give (``get_sharding_rules`` + ``get_params_spec``, run in redco's own venv by
``benchmarks/_redco_rules.py``; redray places the state and Adam's moments as those
specs say):

* ``communication/<case>/redco_rules``: redco's rules in redray's step (which adds
  partial sums before reducing them for any specs): on redray's own families' trees,
  with their fused per-head kernels (a layout redco never sees), on the
  separate-Q/K/V LLaMA with the parameter names of Hugging Face's Flax LLaMA (the
  models redco was written for: ``q_proj``, ``k_proj``... under ``self_attn``), and on
  the auto-named MLP; this isolates the rules;
* ``communication/separate_qkv/redco`` and ``communication/dense12/redco``: what a
  redco user gets, redco's rules and redco's own training step (its
  ``default_train_step`` under ``pjit``, ``benchmarks/_redco_step.py`` in its venv),
  compiled on the same Linen module and batch.

    python benchmarks/communication.py [--cases gpt2 separate_qkv ...] [--no-redco]
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _lm import (  # noqa: E402
    FAMILIES,
    FULL,
    HYBRID,
    MOE_FAMILIES,
    TINY,
    Sizes,
    collate,
    config,
    loss,
    seq2seq_loss,
)
from common import HERE, figure, parser, save, simulate_devices  # noqa: E402

simulate_devices(4)

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import redray  # noqa: E402
from redray.models import build  # noqa: E402
from redray.sharding import flatten, placement  # noqa: E402
from redray.sharding.collectives import (  # noqa: E402
    collectives,
    device_groups,
    summarize,
    total_bytes,
)

MODEL_AXIS = 4
COMMAND = "python benchmarks/communication.py"

# What each case's ideal counts (see the module docstring).
KIND = {"gpt2": "decoder", "llama": "decoder", "opt": "decoder", "gptj": "parallel",
        "t5": "t5", "separate_qkv": "decoder", "parallel_residual": "parallel",
        "gpt2_layout": "decoder", "gemma": "decoder", "penzai_llama": "decoder",
        "dense12": "mlp", "gpt_oss": "moe", "llama4": "moe", "qwen3_next": "moe",
        "qwen3_5": "decoder", "linear_attention_user": "decoder", "mla": "moe"}
# cases of redray's own families under another name: the family each builds
FAMILY_OF = {"mla": "deepseek_v3"}
MOE_TP = "moe_tp"  # the rules against hand-written specs on user-written MoE LMs
MOE_EP = "moe_ep"  # expert parallelism's all-to-alls against their ideal
EXPERTS, TOP_K = 4, 2  # redray's Mixtral of the moe_ep case
CASES = (*KIND, MOE_TP, MOE_EP)
TINY_CASES = ("llama", "t5", "separate_qkv", "parallel_residual", "dense12", *MOE_FAMILIES,
              *HYBRID, "mla", "linear_attention_user", MOE_TP, MOE_EP)
# Cases redco's rules are also measured on, in redray's step (separate_qkv's tree with
# Hugging Face Flax LLaMA names), and those compiled by redco's own step too.
REDCO_CASES = (*FAMILIES, "separate_qkv", "dense12")
REDCO_STEP_CASES = ("separate_qkv", "dense12")


@dataclasses.dataclass(frozen=True)
class MlpSizes:
    inputs: int = 256
    width: int = 512
    classes: int = 16
    batch: int = 64
    depth: int = 12


MLP_FULL, MLP_TINY = MlpSizes(), MlpSizes(inputs=32, width=64, classes=8, batch=16)


def examples(family: str, s: Sizes) -> list[dict]:
    rows = np.random.default_rng(0).integers(1, s.vocab, (s.batch, 2, s.seq + 1), np.int32)
    if family == "t5":
        return [{"input_ids": r[0, :-1], "labels": r[1, :-1]} for r in rows]
    return [{"ids": r[0]} for r in rows]


def moe_sizes(case: str, s: Sizes) -> Sizes:
    """The sizes of ``case``: Llama 4 at twice the layers (a dense and a MoE layer for
    each of the other cases' layers), the hybrid families too (three linear-attention
    layers and a full one for two of the others')."""
    double = case == "llama4" or case in HYBRID
    return dataclasses.replace(s, layers=s.layers * (2 if double else 1))


def moe_layers(c) -> int:
    """How many of a config's layers have experts (gpt-oss: all; DeepSeek-V3: those after
    its dense prefix)."""
    moe = getattr(c, "moe_layers", None)
    if moe is not None:
        return len(moe)
    return c.num_hidden_layers - (getattr(c, "first_k_dense_replace", 0) or 0)


def ideal(case: str, s: Sizes, m: MlpSizes = MLP_FULL) -> dict:
    """The fewest bytes tensor parallelism moves for ``case`` (see the module docstring):
    bytes, the activation all-reduces by kind, and Megatron-LM's per-sublayer total."""
    kind = KIND[case]
    if kind == "mlp":
        pairs = m.depth // 2
        terms = {f"forward, B x {m.width}": pairs - 1, f"forward, B x {m.classes}": 1,
                 f"backward, B x {m.width}": pairs - 1}
        total = (2 * (pairs - 1) * m.batch * m.width + m.batch * m.classes) * 4 + 4
        return {"bytes": total, "activation_all_reduces": terms, "megatron_bytes": total,
                "scalar_bytes": 4}
    act = s.batch * s.seq * s.hidden * 4
    tokens = s.batch * s.seq * 4
    if kind == "t5":
        terms = {"encoder activations (A_e)": 4 * s.layers + 2,
                 "decoder activations (A_d)": 6 * s.layers + 2}
        megatron = s.layers - 1  # one encoder-output reduction per decoder layer
    elif kind == "moe":
        c = config(FAMILY_OF.get(case, case), moe_sizes(case, s))
        top_k = c.num_experts_per_tok
        routing = moe_layers(c) * s.batch * s.seq * top_k * 4
        total = (4 * c.num_hidden_layers + 2) * act + routing + 3 * tokens + 4
        latent = {}
        if case == "mla":  # each attention's backward reduces its latent cotangents, not A
            width = (c.q_lora_rank or 0) + c.kv_lora_rank + c.qk_rope_head_dim
            latent = {"latent_bytes": s.batch * s.seq * width * 4, "latent_width": width}
            total += c.num_hidden_layers * (latent["latent_bytes"] - act)
        return {"bytes": total, "activation_bytes": act, **latent,
                "activation_all_reduces": {"activations (A)": 4 * c.num_hidden_layers + 2},
                "routing_weight_bytes": routing, "megatron_bytes": total,
                "cross_entropy_bytes": 3 * tokens, "scalar_bytes": 4,
                "layers": c.num_hidden_layers, "moe_layers": moe_layers(c), "top_k": top_k}
    elif kind == "parallel":
        terms = {"activations (A)": 2 * s.layers + 2}
        megatron = 2 * s.layers  # attention and MLP reduced apart, forward and backward
    else:
        terms = {"activations (A)": 4 * moe_sizes(case, s).layers + 2}
        megatron = 0
    total = sum(terms.values()) * act + 3 * tokens + 4
    return {"bytes": total, "activation_bytes": act, "activation_all_reduces": terms,
            "megatron_bytes": total + megatron * act, "cross_entropy_bytes": 3 * tokens,
            "scalar_bytes": 4}


def setup(case: str, s: Sizes, m: MlpSizes = MLP_FULL, rules=(),
          hf_names: bool = False) -> tuple[redray.Trainer, list[dict]]:
    """The Trainer of ``case`` (model_axis 4) and a batch of its examples."""
    import _others

    if case in FAMILIES:
        c = config(case, s)
        # its layers as a list: the compiled text then holds each layer's collectives (a
        # scanned step holds one loop body, which the count would see once)
        model, loss_fn = (lambda rngs: build(c, rngs=rngs, scan=False)), \
            (seq2seq_loss if case == "t5" else loss)
    elif case in MOE_FAMILIES or case in HYBRID or case in FAMILY_OF:
        c = config(FAMILY_OF.get(case, case), moe_sizes(case, s))
        model, loss_fn = (lambda rngs: build(c, rngs=rngs, scan=False)), loss
    elif case == "dense12":
        model, loss_fn, make = _others.dense_stack(m.width, m.classes, m.inputs, m.depth)
        return _trainer(model, loss_fn, m.batch, rules), make(m.batch)
    elif case == "gemma":
        model, loss_fn = _others.gemma_lm(s)
    elif case == "penzai_llama":
        model, loss_fn = _others.penzai_lm(s)
    elif case == "linear_attention_user":
        model, loss_fn = _others.linear_attention_lm(s)
    else:
        module = {"separate_qkv": lambda: _others.SeparateLM(s, hf_names),
                  "parallel_residual": lambda: _others.ParallelLM(s),
                  "gpt2_layout": lambda: _others.Gpt2LayoutLM(s)}[case]()
        model, loss_fn = _others.linen_lm(module, s)
    return _trainer(model, loss_fn, s.batch, rules), examples(case, s)


def _trainer(model, loss_fn, batch: int, rules) -> redray.Trainer:
    return redray.Trainer.of(model, collate, loss_fn, optax.adam(1e-3), batch_size=batch,
                          model_axis=MODEL_AXIS, rules=rules, progress=False)


def trainer_for(family: str, s: Sizes, rules=()) -> redray.Trainer:
    """The Trainer of one of redray's own families (``setup`` without the examples)."""
    return setup(family, s, rules=rules)[0]


def step_collectives(trainer: redray.Trainer, data: list[dict]):
    """Collectives of the trainer's compiled training step on a batch of ``data``."""
    trainer.init(data)
    return collectives(trainer.compiled_step().as_text())


def redco_rules(trainer: redray.Trainer, redco_python: str) -> list[tuple[str, P]]:
    """One exact-path rule per parameter: the spec redco 0.4.23 gives it."""
    paths, leaves, _ = flatten(trainer.runtime.abstract[0])
    request = {"model_shards": MODEL_AXIS,
               "params": {p: list(leaf.shape) for p, leaf in zip(paths, leaves)}}
    # -P: benchmarks/ stays off the path, where benchmarks/redco.py would shadow redco
    done = subprocess.run([redco_python, "-P", os.path.join(HERE, "_redco_rules.py")],
                          input=json.dumps(request), capture_output=True, text=True, check=True)
    specs = json.loads(done.stdout)
    return [(f"^{re.escape(p)}$", P(*specs[p])) for p in paths]


def redco_step_collectives(case: str, s: Sizes, m: MlpSizes, data: list[dict],
                           redco_python: str):
    """Collectives of redco 0.4.23's own compiled training step (its rules, its
    ``default_train_step``) on the same model and batch (``benchmarks/_redco_step.py``)."""
    sizes = dataclasses.asdict(m if case == "dense12" else s)
    request = {"case": case, "model_shards": MODEL_AXIS, "sizes": sizes,
               "batch": m.batch if case == "dense12" else s.batch,
               "examples": [{k: np.asarray(v).tolist() for k, v in e.items()} for e in data]}
    done = subprocess.run([redco_python, "-P", os.path.join(HERE, "_redco_step.py")],
                          input=json.dumps(request), capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"redco's step failed:\n{done.stderr[-3000:]}")
    return collectives(done.stdout)


def memory_detail(trainer: redray.Trainer) -> dict:
    """Parameter bytes per device over the ideal (all / model axis), and what the
    rules left whole over ``model`` with why."""
    rows = placement(trainer.runtime.abstract[0], trainer.runtime.specs[0], trainer.mesh)
    held = sum(r.bytes_per_device for r in rows)
    total = sum(math.prod(r.shape) * np.dtype(r.dtype).itemsize for r in rows)
    return {"param_bytes_over_ideal": held / (total / MODEL_AXIS),
            "left_whole": [f"{w.path} {w.shape}: {w.reason}" for w in trainer.runtime.whole]}


def moe_setup(kind: str, s: Sizes, rules=()) -> tuple[redray.Trainer, list[dict]]:
    """The Trainer (model_axis 4) of the user-written MoE LM ``kind`` (``_others.MOE_LMS``)
    and a batch of its examples."""
    import _others

    model, loss_fn = _others.moe_lm(kind, s)
    return _trainer(model, loss_fn, s.batch, rules), examples(kind, s)


def spec_table(trainer: redray.Trainer) -> dict[str, str]:
    """Parameter path -> its spec over the mesh, as ``P(None, 'model')`` (trailing
    Nones dropped, so a rule's ``P()`` and a derived ``P(None, None)`` read alike)."""
    paths, _, _ = flatten(trainer.runtime.abstract[0])
    specs = jax.tree.leaves(trainer.runtime.specs[0], is_leaf=lambda x: isinstance(x, P))
    table = {}
    for path, spec in zip(paths, specs):
        entries = list(spec)
        while entries and entries[-1] is None:
            entries.pop()
        table[path] = f"P({', '.join(map(repr, entries))})"
    return table


def measure_moe_tp(s: Sizes) -> list[dict]:
    """``communication/moe_tp``: the automatic rules' bytes over hand-written Megatron
    specs' on each user-written MoE LM (the module docstring)."""
    import _others

    models, ratios = {}, {}
    for kind in _others.MOE_LMS:
        rules = _others.MOE_MEGATRON_RULES[kind]
        auto, data = moe_setup(kind, s)
        found = step_collectives(auto, data)
        hand, _ = moe_setup(kind, s, rules)
        hand_found = step_collectives(hand, data)
        auto_specs, hand_specs = spec_table(auto), spec_table(hand)
        uncovered = [p for p in hand_specs if not any(re.search(r, p) for r, _ in rules)]
        if uncovered:
            raise ValueError(f"the hand-written {kind} specs leave {uncovered} to the rules")
        ratios[kind] = total_bytes(found) / total_bytes(hand_found)
        models[kind] = {
            "ratio": ratios[kind],
            "bytes": {"automatic": total_bytes(found), "megatron": total_bytes(hand_found)},
            "collectives": {"automatic": _nonzero(summarize(found)),
                            "megatron": _nonzero(summarize(hand_found))},
            "automatic_moe_specs": {p: v for p, v in auto_specs.items() if "/moe/" in p},
            "differs_from_megatron": {p: f"{v} (megatron {hand_specs[p]})"
                                      for p, v in auto_specs.items() if v != hand_specs[p]},
            "left_whole": memory_detail(auto)["left_whole"]}
    return [figure(
        f"communication/{MOE_TP}", max(ratios.values()), "x",
        f"hand-written Megatron specs on the same user-written MoE models (stacked einsum "
        f"experts; a list of expert modules), model axis {MODEL_AXIS}", "<= 1.1", COMMAND,
        models=models, sizes=dataclasses.asdict(s), experts=_others.EXPERTS,
        top_k=_others.TOP_K)]


def measure_moe_ep(s: Sizes) -> list[dict]:
    """``communication/moe_ep``: the all-to-all bytes of redray's Mixtral step with
    ``expert_axis=4`` and ``expert_exchange="all_to_all"`` over the ideal (the module
    docstring), with a capacity factor of 1 (the figure) and dropless (``/dropless``)."""
    from transformers import MixtralConfig

    figures = []
    for capacity in (1.0, None):
        c = MixtralConfig(num_hidden_layers=s.layers, hidden_size=s.hidden,
                          num_attention_heads=s.heads, num_key_value_heads=s.heads,
                          intermediate_size=s.intermediate, vocab_size=s.vocab,
                          max_position_embeddings=s.seq, num_local_experts=EXPERTS,
                          num_experts_per_tok=TOP_K, tie_word_embeddings=False)
        c.capacity_factor = capacity
        # the all-to-all, which a dropless layer runs only when asked for ("auto": the
        # gather, benchmarks/moe_exchange.py)
        plan = redray.Plan(redray.Parallelism.of(expert_axis=MODEL_AXIS).build(),
                           expert_exchange="all_to_all")
        trainer = redray.Trainer.of(lambda rngs, c=c: build(c, rngs=rngs, scan=False), collate,
                                    loss, optax.adam(1e-3), batch_size=s.batch, plan=plan,
                                    progress=False)
        found = summarize(step_collectives(trainer, examples("llama", s)))
        tokens = s.batch * s.seq // MODEL_AXIS  # a device's
        ideal_bytes = 4 * s.layers * tokens * TOP_K * s.hidden * 4
        name = f"communication/{MOE_EP}" + ("" if capacity else "/dropless")
        figures.append(figure(
            name, found["all-to-all"]["bytes"] / ideal_bytes, "x",
            f"ideal all-to-all bytes, {ideal_bytes:,} B: 4 x layers x tokens per device x "
            f"top_k x hidden x 4 B (expert axis {MODEL_AXIS}, "
            + (f"capacity factor {capacity})" if capacity else "dropless)"),
            "<= 1.1" if capacity else None, COMMAND, bytes=found["all-to-all"]["bytes"],
            ideal_bytes=ideal_bytes, collectives=_nonzero(found), experts=EXPERTS,
            top_k=TOP_K, capacity_factor=capacity, sizes=dataclasses.asdict(s)))
    return figures


def measure(case: str, s: Sizes, m: MlpSizes, redco_python: str | None) -> list[dict]:
    if case == MOE_TP:
        return measure_moe_tp(s)
    if case == MOE_EP:
        return measure_moe_ep(s)
    want = ideal(case, s, m)
    sizes = dataclasses.asdict(m if KIND[case] == "mlp" else moe_sizes(case, s))
    trainer, data = setup(case, s, m)
    found = step_collectives(trainer, data)
    figures = [figure(f"communication/{case}", total_bytes(found) / want["bytes"], "x",
                      f"ideal, {want['bytes']:,} B (model axis {MODEL_AXIS}; module docstring)",
                      None if case == "gpt2_layout" else "<= 1.1", COMMAND,
                      bytes=total_bytes(found), ideal=want,
                      collectives=_nonzero(summarize(found)), idle_bytes=idle_bytes(found),
                      sizes=sizes, **memory_detail(trainer))]
    unfused, _ = setup(case, s, m)
    unfused.runtime.train_apply = unfused.runtime.apply  # the step as XLA alone reduces it
    found = step_collectives(unfused, data)
    figures.append(figure(
        f"communication/{case}/unfused", total_bytes(found) / want["bytes"], "x",
        "the same ideal; redray's step without fuse_reductions (each partial sum reduced "
        "where XLA makes it)", None, COMMAND, bytes=total_bytes(found),
        ideal_bytes=want["bytes"], collectives=_nonzero(summarize(found)),
        idle_bytes=idle_bytes(found), sizes=sizes))
    if redco_python is not None and case in REDCO_CASES:
        rules = redco_rules(setup(case, s, m, hf_names=True)[0], redco_python)
        redco_trainer, _ = setup(case, s, m, rules=rules, hf_names=True)
        found = step_collectives(redco_trainer, data)
        tree = ("redray's own fused per-head tree" if case in FAMILIES else
                "the same model with Hugging Face Flax LLaMA names" if case == "separate_qkv"
                else "the same auto-named tree")
        figures.append(figure(
            f"communication/{case}/redco_rules",
            total_bytes(found) / want["bytes"], "x",
            f"the same ideal; redco 0.4.23's rules on {tree}, in redray's step", None,
            COMMAND, bytes=total_bytes(found), ideal_bytes=want["bytes"],
            collectives=_nonzero(summarize(found)), sizes=sizes))
        if case in REDCO_STEP_CASES:
            found = redco_step_collectives(case, s, m, data, redco_python)
            figures.append(figure(
                f"communication/{case}/redco", total_bytes(found) / want["bytes"], "x",
                f"the same ideal; redco 0.4.23's rules and its own step on {tree}", None,
                COMMAND, bytes=total_bytes(found), ideal_bytes=want["bytes"],
                collectives=_nonzero(summarize(found)), sizes=sizes))
    return figures


def idle_bytes(found) -> int:
    """Bytes of the collectives each of whose device groups holds one device: they move
    nothing (an all-reduce over mesh axes of size 1)."""
    return sum(c.bytes for c in found
               if all(len(g) <= 1 for g in device_groups(c, MODEL_AXIS)))


def _nonzero(summary: dict) -> dict:
    return {k: v for k, v in summary.items() if v["count"]}


def main(argv=None) -> None:
    ap = parser(__doc__)
    ap.add_argument("--cases", nargs="*", choices=CASES,
                    help=f"default: all (with --tiny: {', '.join(TINY_CASES)})")
    ap.add_argument("--no-redco", action="store_true", help="skip redco's side")
    args = ap.parse_args(argv)
    sizes, mlp = (TINY, MLP_TINY) if args.tiny else (FULL, MLP_FULL)
    redco_python = None
    if not args.no_redco:
        from _redco_venv import VENV, python

        existing = os.path.join(VENV, "bin", "python")
        # a tiny run checks the script: it does not spend minutes creating redco's venv
        redco_python = (existing if os.path.exists(existing) else None) if args.tiny \
            else python()
    figures = []
    for case in args.cases or (TINY_CASES if args.tiny else CASES):
        figures += measure(case, sizes, mlp, redco_python)
    save(figures, args.out)


if __name__ == "__main__":
    main()
