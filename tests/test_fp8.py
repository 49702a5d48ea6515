"""FP8 block-scaled checkpoints (DeepSeek-V3's, DeepSeek-R1's and Kimi-K2's releases):
dequantized as transformers does it, a box at a time, loaded sharded with the logits of
the same model stored in float32, exported plain, and refused with the field to fix."""

from __future__ import annotations

import json
import os
import shutil

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hf_tiny import IDS, MASK, assert_logits_match, fp8_checkpoint, hf_logits
from safetensors.numpy import load_file, save_file

import redray.models as rm
from redray import Parallelism
from redray.models import fp8, slices

torch = pytest.importorskip("torch", reason="parity tests need torch (pip install torch==2.13.0; "
                                            "make test installs it)")
transformers = pytest.importorskip("transformers")


def _quantized(rng, shape, block):
    """A random float8 e4m3 weight of ``shape`` and its float32 scales per ``block``."""
    weight = (rng.standard_normal(shape) * 100).astype(ml_dtypes.float8_e4m3fn)
    return weight, rng.uniform(1e-3, 1e-1, fp8.grid(shape, block)).astype(np.float32)


def _torch_fp8(weight):
    return torch.tensor(weight.view(np.uint8)).view(torch.float8_e4m3fn)


def test_fp8_dequantizes_as_transformers_does():
    """Blocks cut short at both edges, non-square blocks, stacked experts: equal to
    transformers' own dequantization bit for bit (one float32 multiply a value)."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize, _dequantize_fp8_weight

    rng = np.random.default_rng(0)
    for shape, block in [((10, 7), (4, 4)), ((130, 300), (128, 128)), ((3, 9, 13), (2, 5)),
                         ((8, 12), (4, 4))]:
        weight, scales = _quantized(rng, shape, block)
        theirs = _dequantize_fp8_weight(_torch_fp8(weight), torch.tensor(scales), list(block),
                                        torch.float32).numpy()
        ours = fp8.dequantize(weight, scales, block)
        assert ours.dtype == np.float32 and ours.shape == shape
        np.testing.assert_array_equal(ours, theirs, err_msg=str((shape, block)))
    # where the blocks divide the weight, transformers' loading op gives the same
    op = Fp8Dequantize(None)
    loaded = op._dequantize_one(_torch_fp8(weight), torch.tensor(scales), torch.float32)
    np.testing.assert_array_equal(fp8.dequantize(weight, scales, block), loaded.numpy())
    with pytest.raises(ValueError, match=r"FP8 weight \(8, 12\) in blocks of \[4, 4\] has "
                                         r"\(2, 3\) blocks, but its scales are \(3, 2\)"):
        fp8.dequantize(weight, scales.T, block)


def test_every_box_of_an_fp8_weight_reads_what_the_whole_gives(tmp_path, monkeypatch):
    """A box reads its own values and the scales of the blocks it meets, through buffers
    of a few bytes, and equals that box of the whole tensor dequantized."""
    rng = np.random.default_rng(0)
    block = (4, 3)
    weight, scales = _quantized(rng, (2, 10, 7), block)
    save_file({"w.weight": weight, "w.weight_scale_inv": scales}, str(tmp_path / "t.safetensors"))
    header = slices.read_header(str(tmp_path / "t.safetensors"))
    monkeypatch.setattr(slices, "CHUNK", 8)
    source = slices.Fp8Source(header["w.weight"], header["w.weight_scale_inv"], block)
    assert source.shape == (2, 10, 7)
    whole = fp8.dequantize(weight, scales, block)
    for box in [((0, 2), (0, 10), (0, 7)), ((1, 2), (3, 9), (2, 5)), ((0, 1), (9, 10), (6, 7)),
                ((0, 2), (4, 8), (3, 6)), ((0, 2), (5, 6), (0, 7))]:
        np.testing.assert_array_equal(source.read(box), whole[slices.slices(box)], err_msg=str(box))
    flat = source.read(((3, 60),), (140,))  # a view that merges the axes reads it whole
    np.testing.assert_array_equal(flat, whole.reshape(140)[3:60])


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(the FP8 folder, the transformers model of its dequantized weights, a folder of
    those weights in float32)."""
    root = tmp_path_factory.mktemp("fp8")
    hf = fp8_checkpoint(str(root / "fp8"))
    hf.save_pretrained(str(root / "dense"))
    return str(root / "fp8"), hf, str(root / "dense")


def test_an_fp8_checkpoint_loads_sharded_as_its_dequantized_weights(checkpoint, tmp_path, capfd,
                                                                    monkeypatch):
    """Loaded on fsdp 2 x model 2 (each device's shard read a box at a time, no weight
    whole), the model gives the logits of the float32 checkpoint of the same values and
    transformers'; the export is plain (float32 on request: the same tensors as the
    float32 checkpoint's; bfloat16 by default) without quantization_config, and
    transformers reads it back."""
    folder, hf, dense = checkpoint
    plan = Parallelism.of(fsdp_axis=2, model_axis=2)
    read, boxes = slices.Fp8Source.read, []
    monkeypatch.setattr(slices.Fp8Source, "read", lambda self, box, grouped=None: (
        boxes.append((box, self.shape)), read(self, box, grouped))[1])
    model = rm.from_pretrained(folder, parallelism=plan)
    assert "14 weights stored in FP8 with a scale per 5x3 block" in capfd.readouterr().err
    assert boxes and all(box != tuple((0, n) for n in shape) for box, shape in boxes)
    reference = rm.from_pretrained(dense, parallelism=plan)
    for mask in (None, jnp.asarray(MASK)):
        np.testing.assert_allclose(np.asarray(model(jnp.asarray(IDS), mask)),
                                   np.asarray(reference(jnp.asarray(IDS), mask)),
                                   atol=1e-6, rtol=0)
    assert_logits_match(model, hf)

    rm.save_pretrained(model, str(tmp_path / "f32"), dtype="float32")
    written, plain = load_file(str(tmp_path / "f32" / "model.safetensors")), \
        load_file(os.path.join(dense, "model.safetensors"))
    assert written.keys() == plain.keys()
    for key, value in plain.items():
        np.testing.assert_array_equal(written[key], value, err_msg=key)
    rm.save_pretrained(model, str(tmp_path / "out"))
    with open(tmp_path / "out" / "config.json") as f:
        config = json.load(f)
    assert "quantization_config" not in config and config["dtype"] == "bfloat16"
    saved = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert saved.keys() == plain.keys() and {str(v.dtype) for v in saved.values()} == {"bfloat16"}
    back = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "out"), dtype=torch.float32).eval()
    scale = np.abs(hf_logits(hf, IDS)).max()
    np.testing.assert_allclose(hf_logits(back, IDS), hf_logits(hf, IDS), atol=2e-2 * scale, rtol=0)


def _copy(folder, to, config=None, tensors=None):
    """``folder`` copied to ``to`` with ``config(dict)`` and ``tensors(dict)`` applied."""
    shutil.copytree(folder, to)
    if config is not None:
        with open(os.path.join(to, "config.json")) as f:
            content = json.load(f)
        config(content)
        with open(os.path.join(to, "config.json"), "w") as f:
            json.dump(content, f)
    if tensors is not None:  # through torch: safetensors' numpy reader has no float8
        from safetensors.torch import load_file as load, save_file as save

        file = os.path.join(to, "model.safetensors")
        content = load(file)
        tensors(content)
        save(content, file)
    return str(to)


Q = "model.layers.0.self_attn.q_proj"


def test_an_fp8_checkpoint_it_cannot_read_is_refused_by_field(checkpoint, tmp_path):
    folder = checkpoint[0]

    def quantization(**fields):
        return lambda c: c["quantization_config"].update(fields)

    cases = [
        ("fmt", dict(config=quantization(fmt="e5m2")),
         r"quantization_config\.fmt is 'e5m2'; redray reads FP8 weights stored as 'e4m3'"),
        ("block", dict(config=quantization(weight_block_size=[4, 4])),
         rf"cannot read 14 FP8 weights of .*:\n(  .*\n)*  {Q}\.weight_scale_inv is \(7, 11\), "
         rf"but {Q}\.weight \(32, 32\) in blocks of \[4, 4\] has \(8, 8\) blocks\n(  .*\n)*"
         r"the scales fit blocks of \[5, 3\]: set .*config\.json's quantization_config\."
         r"weight_block_size \(now \[4, 4\]\) to the block size the checkpoint was quantized "
         r"with"),
        ("no_block", dict(config=quantization(weight_block_size=None)),
         r"quantization_config\.weight_block_size is None; .* needs the block's \[rows, "
         r"columns\] \(e\.g\. \[128, 128\]"),
        ("no_config", dict(config=lambda c: c.pop("quantization_config")),
         r"holds 14 FP8 weights with a scale per block .* has no quantization_config with "
         r"quant_method \"fp8\": add the release's"),
        ("scales", dict(tensors=lambda t: t.update({f"{Q}.weight_scale_inv":
                                                    t[f"{Q}.weight_scale_inv"][:, :5].clone()})),
         rf"cannot read 1 FP8 weights .*\n  {Q}\.weight_scale_inv is \(7, 5\), but {Q}\.weight "
         r"\(32, 32\) in blocks of \[5, 3\] has \(7, 11\) blocks\nset .*config\.json's "
         r"quantization_config\.weight_block_size \(now \[5, 3\]\) .* or fetch the tensors' "
         r"files again$"),
        ("no_scales", dict(tensors=lambda t: t.pop(f"{Q}.weight_scale_inv")),
         rf"{Q}\.weight is stored as float8_e4m3fn without its scales beside it "
         rf"\({Q}\.weight_scale_inv\): fetch the checkpoint's files again"),
        ("e5m2", dict(tensors=lambda t: t.update({f"{Q}.weight": t[f"{Q}.weight"].float().to(
            torch.float8_e5m2)})),
         rf"{Q}\.weight is stored as float8_e5m2, not float8_e4m3fn as .*config\.json's "
         r"quantization_config\.fmt 'e4m3' says"),
    ]
    for name, change, message in cases:
        with pytest.raises(ValueError, match=message):
            rm.from_pretrained(_copy(folder, tmp_path / name, **change))
