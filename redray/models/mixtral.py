"""Mixtral, Qwen2-MoE, Qwen3-MoE and GLM-4.5: LLaMA's decoder with a mixture of experts
for every MLP.

Attention is LLaMA's (``llama.Attention``: grouped-query, RoPE, one QKV kernel), with
Qwen2-MoE's biases on q/k/v (``qkv_bias``), Qwen3-MoE's queries and keys RMS-normalized
per head before RoPE (``q_norm``, ``k_norm``) and sliding windows where the config sets
them (``llama._windows``: Qwen2-MoE's in the layers ``layer_types`` names). Each block's MLP is
a ``moe.MoE``: Mixtral renormalizes the top-k router probabilities and combines in
float32; the Qwen families renormalize only with ``norm_topk_prob``. Qwen2-MoE adds a
shared expert (``SharedExpertMoE``): a dense gated MLP that every token runs through,
weighed by sigmoid(``shared_expert_gate``(x)), added to the routed experts' output.
GLM-4.5 (``glm4_moe``) routes as DeepSeek-V3 does (``moe.MoE(scoring="sigmoid")``:
sigmoid scores, a correction bias for the choice only, kept as a ``hub.Buffer`` beside
the parameters, the ``topk_group`` best of ``n_group`` groups, ``routed_scaling_factor``)
with ``n_shared_experts`` shared experts added ungated, its first
``first_k_dense_replace`` layers dense, q/k/v biases (``attention_bias``), optional
per-head q/k norms (``use_qk_norm``) and a rotary share of each head
(``partial_rotary_factor``, which LLaMA's attention reads).
A Qwen-MoE config may keep dense MLPs in some layers (``mlp_only_layers``, or
``decoder_sparse_step`` > 1); their layers are LLaMA's, and the layers stack by their
pattern (``layers.LayerPattern``: dense layers at the front apart, a repeating period of
dense and sparse layers as one stacked ``Period``).

Called with ``aux=True`` the model returns ``(logits, aux)``: the load-balancing and
router z-losses and each layer's expert token counts (``redray/models/moe.py`` says how
they reach a loss). Checkpoints store each expert's projections apart (Mixtral
``block_sparse_moe.experts.{j}.w1/w3/w2``, the Qwen families ``mlp.experts.{j}.gate_proj/
up_proj/down_proj``, the router as ``gate``), as ``transformers`` writes them; here they
are stacked per layer in ``mlp/gate_up_proj`` and ``mlp/down_proj``. Qwen2-MoE's shared
expert keeps its names (``mlp/shared_expert``, ``mlp/shared_expert_gate``).
"""

from __future__ import annotations

import types

from flax import nnx

from redray.models import layers, llama, moe
from redray.models.hub import HFConfig, buffer, gated, linear

BASE_PREFIX = llama.BASE_PREFIX
IGNORED = llama.IGNORED
# Hugging Face's names: the MoE module of a layer, and each expert's gate, up and down.
QWEN = ("mlp", "gate_proj", "up_proj", "down_proj")
NAMES = {"mixtral": ("block_sparse_moe", "w1", "w3", "w2"), "qwen2_moe": QWEN, "qwen3_moe": QWEN,
         "glm4_moe": QWEN, "deepseek_v3": QWEN}
# Auxiliary-loss-free balancing's rate (``moe.MoE``'s ``balance``) for the families routed
# as DeepSeek-V3, unless the config sets ``bias_update_speed`` (0: the biases stay as
# loaded): DeepSeek-V3's gamma for most of its pre-training (arXiv 2412.19437, 4.2)
BIAS_UPDATE_SPEED = 0.001
# The families routed as DeepSeek-V3 (sigmoid scores, a correction bias, groups, shared
# experts ungated, a dense prefix)
DEEPSEEK_ROUTED = ("glm4_moe", "deepseek_v3")


def _experts(c) -> tuple[int, int, int]:
    """(experts, experts per token, each expert's intermediate size)."""
    if c.model_type == "mixtral":
        return c.num_local_experts, c.num_experts_per_tok, c.intermediate_size
    if c.model_type in DEEPSEEK_ROUTED:
        return c.n_routed_experts, c.num_experts_per_tok, c.moe_intermediate_size
    return c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size


def _kinds(c) -> tuple[str, ...]:
    """Each layer's MLP: "moe", or "dense" where a Qwen-MoE config keeps a dense one
    (``mlp_only_layers``, or a layer off ``decoder_sparse_step``'s beat), as
    ``transformers`` builds them."""
    if c.model_type == "mixtral":
        return ("moe",) * c.num_hidden_layers
    if c.model_type in DEEPSEEK_ROUTED:  # a dense prefix
        return tuple("dense" if i < c.first_k_dense_replace else "moe"
                     for i in range(c.num_hidden_layers))
    dense = set(c.mlp_only_layers or ())
    return tuple("dense" if i in dense or not c.num_experts or (i + 1) % c.decoder_sparse_step
                 else "moe" for i in range(c.num_hidden_layers))


def _check(c) -> None:
    """Refuses what this family does not implement, naming the field and the fix."""
    jitter = getattr(c, "router_jitter_noise", 0.0)
    if jitter:
        raise ValueError(f"{c.model_type} config: router_jitter_noise={jitter} is not "
                         "implemented; set it to 0.0 (the released checkpoints' value)")


class SharedExpertMoE(moe.MoE):
    """Routed experts (``moe.MoE``, whose arguments it takes) plus a shared expert of
    width ``shared``, a gated MLP every token runs through: Qwen2-MoE's, weighed by
    sigmoid(``shared_expert_gate``(x)); Llama 4's (``gated=False``) added as it is. On a
    plan it is computed beside the routed experts (``MoE.routed``), its inner width
    split over the model axis as theirs, so one all-reduce sums both."""

    def __init__(self, hidden: int, *args, shared: int, act: str, dtype, rngs: nnx.Rngs,
                 gated: bool = True, **kwargs):
        super().__init__(hidden, *args, act=act, dtype=dtype, rngs=rngs, **kwargs)
        fields = types.SimpleNamespace(hidden_size=hidden, intermediate_size=shared,
                                       hidden_act=act)
        self.shared_expert = llama.MLP(fields, rngs=rngs, dtype=dtype)
        if gated:
            self.shared_expert_gate = nnx.Linear(hidden, 1, use_bias=False, dtype=dtype,
                                                 rngs=rngs)

    def shared_kernels(self) -> tuple:
        expert = self.shared_expert
        kernels = (expert.gate_up_proj.kernel[...], expert.down_proj.kernel[...])
        if hasattr(self, "shared_expert_gate"):
            kernels += (self.shared_expert_gate.kernel[...],)
        return tuple(k.astype(self.dtype) for k in kernels)


def _moe(c, *, rngs, dtype) -> moe.MoE:
    """A layer's experts, routed as the family routes (see the module docstring)."""
    experts, top_k, inner = _experts(c)
    mixtral = c.model_type == "mixtral"
    kind, extra = ((SharedExpertMoE, dict(shared=c.shared_expert_intermediate_size))
                   if c.model_type == "qwen2_moe" else (moe.MoE, {}))
    if c.model_type in DEEPSEEK_ROUTED:  # DeepSeek-V3's router, its shared experts ungated
        kind, extra = SharedExpertMoE, dict(
            shared=inner * c.n_shared_experts, gated=False, scoring="sigmoid",
            groups=(c.n_group, c.topk_group), scale=c.routed_scaling_factor,
            balance=getattr(c, "bias_update_speed", BIAS_UPDATE_SPEED))
    return kind(c.hidden_size, inner, experts, top_k, act=c.hidden_act,
                renormalize=mixtral or bool(c.norm_topk_prob), float32_weights=mixtral,
                capacity_factor=getattr(c, "capacity_factor", None), dtype=dtype, rngs=rngs,
                **extra)


class Model(llama.Model):
    """A Mixtral, Qwen2-MoE or Qwen3-MoE causal LM built from a ``transformers`` config
    (called as ``CausalLM`` says; ``aux=True`` adds the router's auxiliary outputs).
    Its blocks are LLaMA's, with experts for the MLP of a "moe" layer."""

    REPORTS = True
    LAYER_INDEX_FIELDS = ("mlp_only_layers",)

    @classmethod
    def layer_kinds(cls, c) -> tuple[str, ...]:
        return _kinds(c)

    def block(self, c, kind: str, *, rngs, dtype, choices):
        return llama.Block(c, rngs=rngs, dtype=dtype, choices=choices,
                           mlp=_moe if kind == "moe" else llama.MLP)

    def build_parts(self, c, *, rngs: nnx.Rngs, dtype, scan: bool):
        _check(c)
        super().build_parts(c, rngs=rngs, dtype=dtype, scan=scan)

    def auxiliary(self, reports: dict) -> dict:
        if reports is None:
            raise ValueError(f"aux=True: this {self.config.model_type} config has no "
                             "mixture-of-experts layer (every layer dense)")
        return moe.summarize(reports, _experts(self.config)[0])


trace_inputs = layers.causal_lm_inputs


def weight_table(config) -> list:
    """Hugging Face tensor names <-> redray parameter paths: LLaMA's, the dense MLP's
    rows replaced by the router and the stacked experts (and Qwen2-MoE's shared
    expert)."""
    c = config.hf if isinstance(config, HFConfig) else config
    kinds = _kinds(c)
    rows = [row for row in llama.weight_table(c)
            if "/mlp/" not in row.path or kinds[int(row.path.split("/")[1])] == "dense"]
    module, gate, up, down = NAMES[c.model_type]
    experts = _experts(c)[0]
    for i in range(c.num_hidden_layers):
        if kinds[i] == "dense":
            continue
        hf, me = f"model.layers.{i}", f"layers/{i}"
        rows.append(linear(f"{hf}.{module}.gate.weight", f"{me}/mlp/router/kernel"))
        each = f"{hf}.{module}.experts.{{j}}"
        rows += moe.expert_rows(f"{me}/mlp", experts,
                                (f"{each}.{gate}.weight", f"{each}.{up}.weight"),
                                f"{each}.{down}.weight")
        if c.model_type == "qwen2_moe":
            theirs, ours = f"{hf}.mlp.shared_expert", f"{me}/mlp/shared_expert"
            rows += gated((f"{theirs}.gate_proj", f"{theirs}.up_proj"), f"{ours}/gate_up_proj")
            rows += [linear(f"{theirs}.down_proj.weight", f"{ours}/down_proj/kernel"),
                     linear(f"{theirs}_gate.weight", f"{ours}_gate/kernel")]
        if c.model_type in DEEPSEEK_ROUTED:
            theirs, ours = f"{hf}.mlp.shared_experts", f"{me}/mlp/shared_expert"
            rows += gated((f"{theirs}.gate_proj", f"{theirs}.up_proj"), f"{ours}/gate_up_proj")
            rows += [linear(f"{theirs}.down_proj.weight", f"{ours}/down_proj/kernel"),
                     buffer(f"{hf}.mlp.gate.e_score_correction_bias", f"{me}/mlp/score_bias")]
    return rows
