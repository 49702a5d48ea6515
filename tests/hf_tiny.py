"""Tiny random Hugging Face checkpoints written by transformers + torch, for the tests."""

import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def demo_module():
    """examples/language_modeling/train.py as a module (its functions, not its main)."""
    spec = importlib.util.spec_from_file_location(
        "lm_demo", os.path.join(ROOT, "examples", "language_modeling", "train.py"))
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    return demo


def gpt2_tokenizer():
    """GPT-2's real BPE as a transformers tokenizer, offline."""
    from redray.models import gpt2_tokenizer as gpt2

    return gpt2(hf=True)


def llama_folder(folder, vocab_size=128, tokenizer=None):
    """A random LLaMA (2 layers, hidden 64, grouped-query attention) saved by transformers
    into ``folder``, with ``tokenizer`` saved beside it (its vocabulary sets the model's)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    special = {}
    if tokenizer is not None:
        vocab_size = len(tokenizer)
        special = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
        tokenizer.save_pretrained(str(folder))
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=128, tie_word_embeddings=True, **special)
    LlamaForCausalLM(config).save_pretrained(str(folder))
    return str(folder)
