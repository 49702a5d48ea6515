"""Flax NNX models (GPT-2, LLaMA/Mistral/Qwen2/Qwen3, Gemma 2/3, the mixtures of experts
Mixtral, Qwen2-MoE and Qwen3-MoE, OPT, GPT-J, T5) with Hugging Face I/O.

* ``from_pretrained(path, model_axis=...)``: a local HF checkpoint folder, sharded by
  the automatic rules as it loads.
* ``save_pretrained(model, path, tokenizer=...)``: config.json + safetensors that
  ``transformers``' Auto classes load, with the tokenizer's files.
* ``build(config)``: a random model from a ``transformers`` config.
* ``generate(model, input_ids, attention_mask, max_new_tokens=...)``: KV-cache decoding.
* ``gpt2_tokenizer()``: GPT-2's real BPE, offline; ``vocabulary_tokenizer(tokens)``: a
  tokenizer over a fixed list of tokens (toy tasks), with a chat template if given.
* ``build(config, generation={"eos_token_id": [...]})``: the generation config an
  instruct checkpoint keeps in ``generation_config.json`` (the Sampler's stop tokens).
* ``next_token_loss(model, ids, segment_ids=None, chunk=...)``: the causal-LM loss,
  inside packed documents, with the LM head run a chunk of tokens at a time.
* ``add_lora(model, rank, targets=...)`` / ``merge_lora(model)``: LoRA adapters (train
  them alone with ``Trainer.of(..., trainable=r"lora_")``) and folding them back.
* ``model(ids, aux=True)`` of a mixture of experts: (logits, the router's load-balancing
  and z-losses and expert token counts); ``moe.auxiliary_loss(aux, model.config)`` adds
  them to a loss, ``moe.metrics(aux)`` logs them (``redray/models/moe.py``).
"""

from redray.models.families import FAMILIES, Family
from redray.models.generate import generate, sample_token
from redray.models.hub import build, from_pretrained, load_config, save_pretrained, save_tokenizer
from redray.models.lora import LoRA, add_lora, merge_lora
from redray.models.losses import chunked_cross_entropy, next_token_loss
from redray.models.tokenizer import gpt2_tokenizer, vocabulary_tokenizer

__all__ = ["FAMILIES", "Family", "LoRA", "add_lora", "build", "chunked_cross_entropy",
           "from_pretrained", "generate", "gpt2_tokenizer", "load_config", "merge_lora",
           "next_token_loss", "sample_token", "save_pretrained", "save_tokenizer",
           "vocabulary_tokenizer"]
