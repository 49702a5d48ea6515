"""Checkpoints by slices: a model loaded over two ``jax.distributed`` processes (each
device reading only the bytes of its shards) and saved back from them (each tensor
gathered in turn, process 0 writing) equals the single-process load and save, for every
kind of weight-table transform: fused (q/k/v, gate/up), transposed (``nn.Linear``),
GPT-2's ``Conv1D``, stacked layers, tied embeddings, per-expert tensors, MXFP4
dequantization with gate/up interleaved, FP8 weights with a scale per block, and a row
read whole through its own function (Qwen3.5's channels regrouped by key head)."""

import os
import subprocess
import sys

import numpy as np
import pytest
from flax import nnx
from hf_tiny import fp8_checkpoint, hf_model, mxfp4_gpt_oss
from safetensors.numpy import load_file

from redray import Parallelism
from redray.models import from_pretrained, save_pretrained, slices
from redray.sharding import flatten

HERE = os.path.dirname(os.path.abspath(__file__))
KINDS = {"llama": dict(tie_word_embeddings=True),  # fused, transposed, stacked, tied
         "gpt2": {},                                # Conv1D, a fused q|k|v
         "qwen2_moe": {},                           # per-expert tensors, a shared expert
         "qwen3_5_text": {}}                        # a row read whole: its own function


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    """Each checkpoint folder, after two processes x 2 devices loaded and saved it."""
    from redray.processes.jax_runtime import served_at

    root = tmp_path_factory.mktemp("slices")
    folders = {}
    for name, overrides in KINDS.items():
        folders[name] = str(root / name)
        hf_model(name, folders[name], **overrides)
    folders["gpt_oss"] = str(root / "gpt_oss")  # MXFP4 experts, gate/up interleaved
    mxfp4_gpt_oss(folders["gpt_oss"])
    folders["fp8"] = str(root / "fp8")  # a LLaMA's linear weights in FP8, 5x3 blocks
    fp8_checkpoint(folders["fp8"], **KINDS["llama"])
    address = served_at("127.0.0.1")
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "slices_worker.py"), address,
                               "2", str(rank), *folders.values()], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank in range(2)]
    for p in procs:
        out, _ = p.communicate(timeout=600)
        assert p.returncode == 0, out[-4000:]
    return folders


@pytest.mark.parametrize("name", [*KINDS, "gpt_oss", "fp8"])
def test_two_processes_load_and_save_what_one_does(loaded, name, tmp_path):
    folder = loaded[name]
    model = from_pretrained(folder, parallelism=Parallelism.of(fsdp_axis=2, model_axis=2))
    paths, leaves, _ = flatten(nnx.state(model, nnx.Param))
    multi = np.load(f"{folder}/multi.npz")
    assert sorted(multi.files) == sorted(p.replace("/", "|") for p in paths)
    for path, leaf in zip(paths, leaves):
        np.testing.assert_array_equal(multi[path.replace("/", "|")], np.asarray(leaf),
                                      err_msg=path)
    save_pretrained(model, str(tmp_path), max_shard_bytes=40_000)
    ours, theirs = _tensors(str(tmp_path)), _tensors(f"{folder}/multi-out")
    assert len(theirs) > 1 and ours.keys() == theirs.keys()  # same files, same tensors
    for file in ours:
        assert list(ours[file]) == list(theirs[file]), file  # in the same order
        for key, value in ours[file].items():
            np.testing.assert_array_equal(theirs[file][key], value, err_msg=key)
    with open(f"{folder}/multi-out/model.safetensors.index.json") as f, \
            open(tmp_path / "model.safetensors.index.json") as g:
        assert f.read() == g.read()


def _tensors(folder: str) -> dict:
    files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    return {f: {k: load_file(os.path.join(folder, f))[k]
                for k in slices.read_header(os.path.join(folder, f))} for f in files}


def _boxes(shape):
    """Whole, from 1, the first half, the last entry: every combination over the axes."""
    import itertools

    return itertools.product(*[sorted({(0, n), (min(1, n - 1), n), (0, max(1, n // 2)),
                                       (n - 1, n)}) for n in shape])


def test_every_box_of_every_view_reads_what_the_whole_tensor_gives(tmp_path, monkeypatch):
    """A box of redray's array pulled back through a view reads exactly that box of the
    converted tensor, through buffers of a few bytes (chunks of rows, rows one by one)."""
    import ml_dtypes
    from safetensors.numpy import save_file

    from redray.models import mxfp4

    rng = np.random.default_rng(0)
    stored = {"w": rng.standard_normal((12, 10)).astype(ml_dtypes.bfloat16),
              "x": rng.standard_normal((2, 3, 8)).astype(np.float32),
              "q_blocks": rng.integers(0, 256, (2, 5, 3, 16), dtype=np.uint8),
              "q_scales": rng.integers(120, 130, (2, 5, 3), dtype=np.uint8)}
    save_file(stored, str(tmp_path / "t.safetensors"))
    header = slices.read_header(str(tmp_path / "t.safetensors"))
    monkeypatch.setattr(slices, "CHUNK", 40)
    w = stored["w"].astype(np.float32)
    cases = [(header["w"], slices.linear_view((12, 10), s, k), w.T.reshape(s))
             for s, k in [((10, 3, 4), 1), ((10, 12), 1), ((5, 2, 12), 2)]]
    cases += [(header["x"], slices.interleaved_view((2, 3, 8), (2, 3, 2, 4)),
               stored["x"].reshape(2, 3, 4, 2).swapaxes(-1, -2)),
              (header["x"], slices.reshape_view((2, 3, 8), (6, 2, 4)),
               stored["x"].reshape(6, 2, 4)),
              (header["x"], slices.reshape_view((2, 3, 8), (2, 3, 2, 2, 2)),
               stored["x"].reshape(2, 3, 2, 2, 2))]
    for source, view, whole in cases:
        for box in _boxes(whole.shape):
            out = np.zeros([b - a for a, b in box], np.float32)
            for grouped, split, sub in view.pieces(box):
                block = slices.read_box(source, grouped, np.float32, view.grouped)
                block = block.reshape(split).transpose(view.perm)
                out[slices.slices(sub, [a for a, _ in box])] = block
            np.testing.assert_array_equal(out, whole[slices.slices(box)], err_msg=str(box))
    assert slices.linear_view((12, 10), (10, 5, 3), 1) is None  # 15 outputs, not 12
    quantized = slices.Mxfp4Source(header["q_blocks"], header["q_scales"])
    whole = mxfp4.dequantize(stored["q_blocks"], stored["q_scales"])
    for box in [((0, 2), (0, 96), (0, 5)), ((1, 2), (30, 70), (2, 4)), ((0, 1), (95, 96), (4, 5))]:
        np.testing.assert_array_equal(quantized.read(box), whole[slices.slices(box)])


def test_a_long_load_and_save_say_how_far_they_are(loaded, tmp_path, monkeypatch, capfd):
    from redray.models import hub

    monkeypatch.setattr(hub._Progress, "EVERY", 0.0)
    model = from_pretrained(loaded["llama"])
    save_pretrained(model, str(tmp_path))
    err = capfd.readouterr().err
    assert f"redray: loading {loaded['llama']}: 1/" in err and "parameters placed" in err
    assert "all" in err and "GB read from 1 file(s) on this host" in err
    assert f"redray: saving {tmp_path}: 1/" in err and "tensors written" in err
