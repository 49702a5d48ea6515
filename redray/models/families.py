"""The model families redray reads: one ``Family`` record per Hugging Face ``model_type``.

A record is data only (strings, numbers, tuples, a dict of config fields), so it can be
printed, compared and written out as JSON (``Family.to_dict``); the code lives in the
family's module under ``redray/models/`` (``Family.code``: its ``Model``,
``weight_table`` and ``trace_inputs``). Everything that needs a per-family fact reads
it here: the hub (which module builds a ``model_type``, the class an export names, the
aliases and wrapped configs it unwraps), the planner (the depth fields and the widths a
model axis splits), ``redray plan``'s presets, the sampler, the docs' family table and
the parity tests (each family's tiny configuration). Adding a family is its module plus
one record in ``FAMILIES`` (docs/adding-a-family.md walks through one).
"""

from __future__ import annotations

import dataclasses
import importlib

# The widths a model axis splits in a grouped-query decoder: (heads, key/value heads,
# the MLP's inner width).
GQA_WIDTHS = ("num_attention_heads", "num_key_value_heads", "intermediate_size")
# The tiny decoder every parity test starts from: 2 layers, hidden 32, grouped-query
# attention, a pad token with an id (families whose torch model has a padding row must
# keep its gradient at zero).
TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, pad_token_id=0)
TINY_MOE = dict(TINY, num_experts_per_tok=2)
TINY_GEMMA = dict(TINY, head_dim=8, sliding_window=6, query_pre_attn_scalar=8,
                  final_logit_softcapping=3.0)

# Llama 4's every difference in 4 layers: dense and MoE layers in turn, a NoPE layer (the
# third) among chunked rotary ones, chunks and a temperature scale that show in 12 tokens
TINY_LLAMA4 = dict(TINY, num_hidden_layers=4, head_dim=8, num_local_experts=4,
                   num_experts_per_tok=1, intermediate_size_mlp=48, interleave_moe_layer_step=2,
                   no_rope_layers=[1, 1, 0, 1], attention_chunk_size=4, floor_scale=4,
                   attn_scale=0.5)

# Qwen3-Next and Qwen3.5: a linear and a full attention layer in turn (the released
# configs have three linear layers to one full), twice as many value heads as key heads
# in the linear layers, and packed rows longer than a convolution's window.
TINY_HYBRID = dict(TINY, num_hidden_layers=4, head_dim=8, linear_num_key_heads=2,
                   linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
                   layer_types=["linear_attention", "full_attention"] * 2)
TINY_HYBRID_MOE = dict(TINY_HYBRID, num_experts=4, num_experts_per_tok=2,
                       moe_intermediate_size=16, shared_expert_intermediate_size=24)
# GLM-4.5: a dense first layer, then DeepSeek-V3's router (sigmoid scores, a correction
# bias, 1 of 2 groups of 4 experts, scaled) with a shared expert; half the head rotated,
# q/k/v biases and per-head q/k norms.
TINY_GLM4_MOE = dict(TINY_MOE, num_hidden_layers=3, head_dim=8, moe_intermediate_size=16,
                     n_routed_experts=8, n_group=2, topk_group=1, n_shared_experts=1,
                     first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                     attention_bias=True, use_qk_norm=True, partial_rotary_factor=0.5)
# DeepSeek-V3: queries through a low-rank path, keys and values from a latent of 8 with a
# rotary part of 4 shared by the heads (interleaved, YaRN with mscale_all_dim), query and
# key heads of 12 against values of 6; a dense first layer, then 1 of 2 groups of 4
# experts as GLM-4.5's.
TINY_DEEPSEEK_V3 = {k: v for k, v in TINY_GLM4_MOE.items()
                    if k not in ("head_dim", "attention_bias", "use_qk_norm",
                                 "partial_rotary_factor")} | dict(
    num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=8, qk_rope_head_dim=4,
    qk_nope_head_dim=8, v_head_dim=6, max_position_embeddings=64, rope_interleave=True,
    rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4,
                     "original_max_position_embeddings": 16, "mscale": 1.0,
                     "mscale_all_dim": 1.0, "beta_fast": 32.0, "beta_slow": 1.0})
TINY_VISION = dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=32,
                   out_hidden_size=32)


@dataclasses.dataclass(frozen=True)
class Family:
    """One Hugging Face ``model_type`` as redray reads and writes it.

    Attributes:
      model_type: the ``model_type`` of a ``config.json``.
      name: how the docs name it ("LLaMA", "gpt-oss").
      module: the module under ``redray.models`` implementing it (``Model``,
        ``weight_table(config)``, ``trace_inputs(config)``); several model types may
        share one (Mistral and Qwen2 are LLaMA's fields).
      architecture: the ``transformers`` class an export names in ``architectures``.
      aliases: other ``model_type`` values that are this architecture under another
        name (Kimi-K2's ``kimi_k2``, whose folders name remote code), read as this one
        with their config's fields and exported as this one, which ``transformers``
        reads without remote code.
      text_config: where a multimodal config keeps this family's language model (its
        sub-config's field, e.g. "text_config"): the language model is loaded, and
        exported as its own family; None: the config is the model's own.
      weight_prefixes: (checkpoint prefix, redray's) pairs renaming a wrapped model's
        tensors on load (``language_model.model.`` -> ``model.``).
      left_out: prefixes of the checkpoint's tensors a load leaves out, with a console
        line (a multimodal checkpoint's vision tower).
      layer_fields: the config fields that count its layers (T5: encoder and decoder).
      split_widths: the config fields of the widths a model axis splits (the planner
        counts a layer's memory-bound bytes split by them); () where none is counted.
      encoder_decoder: a sequence-to-sequence model (``AutoModelForSeq2SeqLM``).
      presets: ``redray plan`` presets of this family (``redray/models/presets``).
      tiny: the config fields of the tiny random model the tests build
        (``transformers.AutoConfig.for_model(model_type, **tiny)``).
    """
    model_type: str
    name: str
    module: str
    architecture: str
    aliases: tuple[str, ...] = ()
    text_config: str | None = None
    weight_prefixes: tuple[tuple[str, str], ...] = ()
    left_out: tuple[str, ...] = ()
    layer_fields: tuple[str, ...] = ("num_hidden_layers",)
    split_widths: tuple[str, ...] = ()
    encoder_decoder: bool = False
    presets: tuple[str, ...] = ()
    tiny: dict = dataclasses.field(default_factory=dict, compare=False, hash=False)

    @property
    def code(self):
        """The module implementing the family (imported when first asked for)."""
        return importlib.import_module(f"redray.models.{self.module}")

    def to_dict(self) -> dict:
        """The record as JSON-ready values."""
        return {k: (list(map(list, v)) if k == "weight_prefixes" else
                    list(v) if isinstance(v, tuple) else v)
                for k, v in dataclasses.asdict(self).items()}


FAMILIES: dict[str, Family] = {f.model_type: f for f in (
    Family("llama", "LLaMA", "llama", "LlamaForCausalLM", split_widths=GQA_WIDTHS,
           presets=("llama-7b", "llama-13b", "llama-3-8b"),
           tiny=dict(TINY, tie_word_embeddings=False)),
    Family("mistral", "Mistral", "llama", "MistralForCausalLM", split_widths=GQA_WIDTHS,
           tiny=dict(TINY, sliding_window=6)),
    Family("qwen2", "Qwen2", "llama", "Qwen2ForCausalLM", split_widths=GQA_WIDTHS,
           tiny=dict(TINY, use_sliding_window=False, tie_word_embeddings=True)),
    Family("qwen3", "Qwen3", "llama", "Qwen3ForCausalLM", split_widths=GQA_WIDTHS,
           presets=("qwen3-8b",), tiny=dict(TINY, head_dim=12)),
    Family("smollm3", "SmolLM3", "llama", "SmolLM3ForCausalLM", split_widths=GQA_WIDTHS,
           presets=("smollm3-3b",),
           tiny=dict(TINY, no_rope_layers=[1, 0], use_sliding_window=True, sliding_window=6)),
    Family("olmo3", "OLMo 3", "olmo", "Olmo3ForCausalLM", split_widths=GQA_WIDTHS,
           presets=("olmo-3-7b",),
           tiny=dict(TINY, sliding_window=6, max_position_embeddings=64,
                     layer_types=["sliding_attention", "full_attention"],
                     rope_parameters={
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                         "full_attention": {"rope_type": "yarn", "factor": 4.0,
                                            "original_max_position_embeddings": 16,
                                            "rope_theta": 5e5}})),
    Family("gemma2", "Gemma 2", "gemma", "Gemma2ForCausalLM", split_widths=GQA_WIDTHS,
           tiny=dict(TINY_GEMMA, attn_logit_softcapping=2.0)),
    Family("gemma3_text", "Gemma 3 (text)", "gemma", "Gemma3ForCausalLM",
           split_widths=GQA_WIDTHS,
           tiny=dict(TINY_GEMMA, layer_types=["sliding_attention", "full_attention"])),
    Family("mixtral", "Mixtral", "mixtral", "MixtralForCausalLM", presets=("mixtral-8x7b",),
           tiny=dict(TINY_MOE, intermediate_size=16, num_local_experts=4)),
    Family("qwen2_moe", "Qwen2-MoE", "mixtral", "Qwen2MoeForCausalLM",
           tiny=dict(TINY_MOE, moe_intermediate_size=16, shared_expert_intermediate_size=24,
                     num_experts=4, norm_topk_prob=False)),
    Family("qwen3_moe", "Qwen3-MoE", "mixtral", "Qwen3MoeForCausalLM",
           presets=("qwen3-30b-a3b",),
           tiny=dict(TINY_MOE, moe_intermediate_size=16, num_experts=4, norm_topk_prob=True)),
    Family("glm4_moe", "GLM-4.5", "mixtral", "Glm4MoeForCausalLM", tiny=TINY_GLM4_MOE),
    Family("deepseek_v3", "DeepSeek-V3", "deepseek", "DeepseekV3ForCausalLM",
           aliases=("kimi_k2",), presets=("deepseek-v3",), tiny=TINY_DEEPSEEK_V3),
    Family("gpt_oss", "gpt-oss", "gpt_oss", "GptOssForCausalLM", presets=("gpt-oss-20b",),
           tiny=dict(TINY_MOE, num_local_experts=4, head_dim=8, sliding_window=6,
                     max_position_embeddings=64,
                     rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                                      "beta_slow": 1.0, "truncate": False,
                                      "original_max_position_embeddings": 16,
                                      "rope_theta": 1.5e5})),
    Family("llama4_text", "Llama 4 (text)", "llama4", "Llama4ForCausalLM",
           presets=("llama-4-scout", "llama-4-maverick"), tiny=TINY_LLAMA4),
    Family("llama4", "Llama 4", "llama4", "Llama4ForConditionalGeneration",
           text_config="text_config",
           weight_prefixes=(("language_model.model.", "model."),
                            ("language_model.lm_head.", "lm_head.")),
           left_out=("vision_model.", "multi_modal_projector."),
           tiny=dict(text_config=TINY_LLAMA4,
                     vision_config=dict(hidden_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, intermediate_size=64,
                                        image_size=28, patch_size=14, vision_output_dim=32,
                                        projector_input_dim=32, projector_output_dim=32))),
    Family("qwen3_next", "Qwen3-Next", "qwen3_next", "Qwen3NextForCausalLM",
           tiny=TINY_HYBRID_MOE),
    Family("qwen3_5_text", "Qwen3.5 (text)", "qwen3_next", "Qwen3_5ForCausalLM",
           tiny=TINY_HYBRID),
    Family("qwen3_5_moe_text", "Qwen3.5-MoE (text)", "qwen3_next", "Qwen3_5MoeForCausalLM",
           tiny=TINY_HYBRID_MOE),
    Family("qwen3_5", "Qwen3.5", "qwen3_next", "Qwen3_5ForConditionalGeneration",
           text_config="text_config",
           weight_prefixes=(("model.language_model.", "model."),), left_out=("model.visual.",),
           tiny=dict(text_config=TINY_HYBRID, vision_config=TINY_VISION)),
    Family("qwen3_5_moe", "Qwen3.5-MoE", "qwen3_next", "Qwen3_5MoeForConditionalGeneration",
           text_config="text_config",
           weight_prefixes=(("model.language_model.", "model."),), left_out=("model.visual.",),
           tiny=dict(text_config=TINY_HYBRID_MOE, vision_config=TINY_VISION)),
    Family("gpt2", "GPT-2", "gpt2", "GPT2LMHeadModel", presets=("gpt2-xl",),
           tiny=dict(vocab_size=128, n_positions=32, n_embd=32, n_layer=2, n_head=4,
                     pad_token_id=0)),
    Family("opt", "OPT", "opt", "OPTForCausalLM", presets=("opt-13b", "opt-66b"),
           tiny=dict(vocab_size=128, max_position_embeddings=32, hidden_size=32,
                     num_hidden_layers=2, num_attention_heads=4, ffn_dim=64,
                     word_embed_proj_dim=32, pad_token_id=0)),
    Family("gptj", "GPT-J", "gptj", "GPTJForCausalLM", presets=("gpt-j-6b",),
           tiny=dict(vocab_size=128, n_positions=32, n_embd=32, n_layer=2, n_head=4,
                     rotary_dim=4, tie_word_embeddings=False, pad_token_id=0)),
    Family("t5", "T5", "t5", "T5ForConditionalGeneration", encoder_decoder=True,
           layer_fields=("num_layers", "num_decoder_layers"), presets=("t5-11b",),
           tiny=dict(vocab_size=128, d_model=32, d_kv=8, num_heads=4, d_ff=64, num_layers=2,
                     num_decoder_layers=2, decoder_start_token_id=0, pad_token_id=0)),
)}
# every model_type a config may carry -> its family's record
_BY_TYPE = {name: family for family in FAMILIES.values()
            for name in (family.model_type, *family.aliases)}


def supported() -> list[str]:
    """Every ``model_type`` redray reads (aliases included), sorted."""
    return sorted(_BY_TYPE)


def lookup(model_type: str) -> Family:
    """The record of a ``model_type`` (or an alias of one), or a ValueError naming the
    supported ones."""
    try:
        return _BY_TYPE[model_type]
    except KeyError:
        raise ValueError(f"model_type {model_type!r} is not supported; supported: "
                         f"{', '.join(supported())}") from None
