"""Tiny random Hugging Face checkpoints written by transformers + torch, for the tests."""

import json
import os

import numpy as np

from example_runs import example_module

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def demo_module():
    """examples/language_modeling/train.py as a module (its functions, not its main)."""
    return example_module("language_modeling")


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


# The parity tests' prompts: two rows of 12 token ids below 128, the second left-padded
# by 4 (MASK is 0 there).
IDS = np.random.default_rng(0).integers(0, 128, (2, 12))
MASK = np.ones((2, 12), np.int64)
MASK[1, :4] = 0


def hf_logits(model, ids, mask=None):
    """A transformers PyTorch model's logits (numpy) for ``ids`` (and ``mask``)."""
    import torch

    with torch.no_grad():
        kwargs = {} if mask is None else {"attention_mask": torch.tensor(mask)}
        return model(torch.tensor(ids), **kwargs).logits.numpy()


def assert_logits_match(model, hf, atol=1e-4):
    """A redray model's logits equal the transformers model ``hf``'s on IDS, and on the
    real tokens of the left-padded IDS/MASK."""
    import jax.numpy as jnp

    np.testing.assert_allclose(np.asarray(model(jnp.asarray(IDS))), hf_logits(hf, IDS),
                               atol=atol, rtol=0)
    ours = np.asarray(model(jnp.asarray(IDS), jnp.asarray(MASK)))
    real = MASK.astype(bool)
    np.testing.assert_allclose(ours[real], hf_logits(hf, IDS, MASK)[real], atol=atol, rtol=0)


def loaded_pair(name, hf_model, tmp_path_factory):
    """(name, the transformers model ``hf_model(name, folder)`` saves into a fresh folder,
    the folder, the redray model ``from_pretrained`` loads from it): a parity fixture."""
    from redray.models import from_pretrained

    folder = str(tmp_path_factory.mktemp(name))
    hf = hf_model(name, folder)
    return name, hf, folder, from_pretrained(folder)


def assert_export_round_trip(model, hf, folder, **load):
    """``save_pretrained`` writes into ``folder`` what transformers loads (``load``: its
    ``from_pretrained`` arguments) as ``hf``'s class, with ``hf``'s logits."""
    import transformers

    from redray.models import save_pretrained

    save_pretrained(model, str(folder))
    back = transformers.AutoModelForCausalLM.from_pretrained(str(folder), **load).eval()
    assert type(back) is type(hf)
    np.testing.assert_allclose(hf_logits(back, IDS), hf_logits(hf, IDS), atol=1e-5, rtol=0)
    with open(os.path.join(folder, "config.json")) as f:
        assert json.load(f)["architectures"] == [type(hf).__name__]


def assert_greedy_generation_matches(model, hf, new_tokens: int):
    """redray's greedy continuation of IDS/MASK (jitted) equals transformers' token for
    token, as far as transformers generates (it may stop at EOS)."""
    import jax.numpy as jnp
    import torch
    from flax import nnx

    from redray.models import generate

    with torch.no_grad():
        ref = hf.generate(torch.tensor(IDS), attention_mask=torch.tensor(MASK),
                          max_new_tokens=new_tokens, do_sample=False).numpy()[:, IDS.shape[1]:]
    ours = np.asarray(nnx.jit(lambda m, i, a: generate(m, i, a, max_new_tokens=new_tokens))(
        model, jnp.asarray(IDS), jnp.asarray(MASK)))
    np.testing.assert_array_equal(ours[:, :ref.shape[1]], ref)


def assert_language_model_loads(model_type, tiny, folder, capfd, left_out: str, text_type: str,
                                text_class: str):
    """A multimodal checkpoint of ``model_type`` (its registry ``tiny`` fields), written by
    transformers' own class into ``folder``, loads as its language model (``text_type``,
    the console naming what was ``left_out``) with transformers' logits on IDS/MASK, and
    exports a text checkpoint that transformers reads back as ``text_class``."""
    import jax.numpy as jnp
    import torch
    import transformers

    from redray.models import from_pretrained, save_pretrained

    config = transformers.AutoConfig.for_model(model_type, **tiny)
    torch.manual_seed(0)
    hf = transformers.AutoModelForImageTextToText.from_config(config).eval()
    hf.save_pretrained(str(folder / "hf"))
    model = from_pretrained(str(folder / "hf"))
    assert left_out in capfd.readouterr().err
    assert model.config.model_type == text_type
    real = MASK.astype(bool)
    np.testing.assert_allclose(np.asarray(model(jnp.asarray(IDS), jnp.asarray(MASK)))[real],
                               hf_logits(hf, IDS, MASK)[real], atol=1e-4, rtol=0)
    save_pretrained(model, str(folder / "text"))
    back = transformers.AutoModelForCausalLM.from_pretrained(str(folder / "text")).eval()
    assert type(back).__name__ == text_class
    np.testing.assert_allclose(hf_logits(back, IDS), hf_logits(hf, IDS), atol=1e-5, rtol=0)


def hf_model(name, folder=None, **overrides):
    """transformers' random model of the registry's tiny ``name`` (its biases, norms and
    sinks drawn away from their initial values, so each one shows), saved to
    ``folder``."""
    import torch
    import transformers

    from redray.models.families import FAMILIES

    config = transformers.AutoConfig.for_model(name, **{**FAMILIES[name].tiny, **overrides})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation="eager").eval()
    with torch.no_grad():
        for key, value in model.named_parameters():
            if value.ndim == 1 or key.endswith(("bias", "sinks")):
                value.add_(0.3 * torch.randn_like(value))
    if folder is not None:
        model.save_pretrained(folder)
    return model


def mxfp4_gpt_oss(folder):
    """A tiny gpt-oss saved into ``folder`` as the released checkpoints are: every expert
    tensor as MXFP4 blocks and scales, the config's quantization_config. Returns the
    transformers model whose experts are those values dequantized."""
    import torch
    from safetensors.numpy import save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    hf = hf_model("gpt_oss")
    rng = np.random.default_rng(1)
    tensors = {k: v.numpy() for k, v in hf.state_dict().items()}
    for key, value in list(tensors.items()):
        if not key.endswith(("experts.gate_up_proj", "experts.down_proj")):
            continue
        experts, inner, outer = value.shape  # stored transposed: (experts, out, in / 32, 16)
        blocks = rng.integers(0, 256, (experts, outer, inner // 32, 16), dtype=np.uint8)
        scales = rng.integers(118, 124, (experts, outer, inner // 32), dtype=np.uint8)
        del tensors[key]
        tensors[f"{key}_blocks"], tensors[f"{key}_scales"] = blocks, scales
        dense = convert_moe_packed_tensors(torch.tensor(blocks), torch.tensor(scales),
                                           dtype=torch.float32)
        with torch.no_grad():
            hf.get_parameter(key).copy_(dense)
    hf.config.save_pretrained(folder)
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "mxfp4",
                                     "modules_to_not_convert": ["model.layers.*.self_attn"]}
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    return hf


def fp8_checkpoint(folder, name="llama", block=(5, 3), **overrides):
    """A tiny ``name`` saved into ``folder`` as DeepSeek-V3's and Kimi-K2's releases are:
    every layer's linear weight as float8 e4m3 with a float32 scale per ``block`` (which
    need not divide its shape) in ``X.weight_scale_inv``, the config's
    quantization_config. Returns the transformers model whose weights are those values
    as transformers dequantizes them (``overrides``: of the registry's tiny config)."""
    import ml_dtypes
    import torch
    from safetensors.numpy import save_file
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    hf = hf_model(name, **overrides)
    rng = np.random.default_rng(1)
    tensors, seen = {}, set()
    for key, value in hf.state_dict().items():  # a tied tensor once, as transformers saves it
        if value.data_ptr() not in seen:
            seen.add(value.data_ptr())
            tensors[key] = value.numpy().copy()
    for key, value in list(tensors.items()):
        if not (key.startswith("model.layers.") and key.endswith(".weight") and value.ndim == 2):
            continue
        (rows, cols), (b0, b1) = value.shape, block
        grid = (-(-rows // b0), -(-cols // b1))
        padded = np.zeros((grid[0] * b0, grid[1] * b1), np.float32)
        padded[:rows, :cols] = np.abs(value)
        largest = padded.reshape(grid[0], b0, grid[1], b1).max(axis=(1, 3))
        scales = (largest / 448 * rng.uniform(1, 2, grid) + 1e-6).astype(np.float32)
        each = np.repeat(np.repeat(scales, b0, 0), b1, 1)[:rows, :cols]
        weight = (value / each).astype(ml_dtypes.float8_e4m3fn)
        tensors[key], tensors[key.removesuffix(".weight") + ".weight_scale_inv"] = weight, scales
        stored = torch.tensor(weight.view(np.uint8)).view(torch.float8_e4m3fn)
        dense = _dequantize_fp8_weight(stored, torch.tensor(scales), list(block), torch.float32)
        with torch.no_grad():
            hf.get_parameter(key).copy_(dense)
    hf.config.save_pretrained(folder)
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                     "activation_scheme": "dynamic",
                                     "weight_block_size": list(block)}
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    return hf
