"""``redray export`` from a run's Orbax checkpoint without building the model: the
files it writes, read a tensor (a layer) at a time, are byte for byte the files of the
model loaded and saved (``load_model`` + ``save_pretrained``); stacked parameters are
stored in chunks of a layer, so a layer is read alone."""

import filecmp
import glob
import os
import shutil
import subprocess
import sys

import optax
import pytest
from transformers import LlamaConfig

import redray
import redray.checkpoint as checkpoint
from redray.commands.runs import export_run
from redray.engine.load import stored_params
from redray.models import build, load_config, save_pretrained
from tiny import lm_collate, lm_loss, token_data

CONFIG = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                     tie_word_embeddings=False)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A run folder (``<storage>/run``): its config.json and checkpoints, trained a few
    steps with stacked layers (checkpoints at steps 1 and 2), saved in chunks of 256
    bytes (the rule ``save_args`` applies above 16 MB, here at this model's size)."""
    folder = tmp_path_factory.mktemp("storage") / "run"
    os.makedirs(folder)
    CONFIG.save_pretrained(folder)
    config = load_config(str(folder / "config.json"))
    saved = checkpoint.CHUNK_BYTES
    checkpoint.CHUNK_BYTES = 256
    try:
        trainer = redray.Trainer.of(lambda rngs: build(config, rngs=rngs), lm_collate, lm_loss,
                                    optax.adam(1e-2), batch_size=4, progress=False,
                                    fsdp_axis=2, checkpoint=redray.CheckpointConfig(
                                        str(folder / "checkpoints"), save_every=1))
        trainer.fit(token_data(8, seq=12), epochs=1)
    finally:
        checkpoint.CHUNK_BYTES = saved
    return folder, config


def same_files(a, b):
    names = sorted(os.listdir(a))
    assert names == sorted(os.listdir(b))
    match, mismatch, errors = filecmp.cmpfiles(a, b, names, shallow=False)
    assert (mismatch, errors) == ([], []) and len(match) >= 3, (mismatch, errors)


def test_an_export_from_the_files_equals_the_loaded_models_save(run, tmp_path):
    folder, config = run
    stored = stored_params(str(folder), lambda rngs: build(config, rngs=rngs))
    # a stacked parameter's layer is a chunk of its own: read without the others
    down = next(p for p in stored._where.values() if "down_proj" in p)
    assert stored._stored.shapes[down][0] == CONFIG.num_hidden_layers
    stored._stored.read(down, 0)
    assert stored._stored._arrays[down].chunk_layout.read_chunk.shape[0] == 1
    # another array above the chunk size is read a chunk at a time
    embed = next(p for p in stored._where.values() if "embed" in p)
    stored._stored.read(embed)
    chunk = stored._stored._arrays[embed].chunk_layout.read_chunk.shape
    assert chunk != stored._stored.shapes[embed]

    loaded = redray.load_model(str(folder), lambda rngs: build(config, rngs=rngs))
    for dtype in ("float32", "bfloat16"):
        save_pretrained(loaded, str(tmp_path / f"loaded-{dtype}"), dtype=dtype)
    export_run(str(folder), config, str(tmp_path / "files-float32"), dtype="float32")
    # the command, in a process of its own (it sets the process's allocator)
    done = subprocess.run([sys.executable, "-m", "redray.cli", "export", str(folder), "--to",
                           str(tmp_path / "files-bfloat16"), "--dtype", "bfloat16"],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert done.returncode == 0, done.stderr[-2000:]
    for dtype in ("float32", "bfloat16"):
        same_files(tmp_path / f"loaded-{dtype}", tmp_path / f"files-{dtype}")
    # into a model that lists its layers (scan=False): each layer read from the stack
    listed = stored_params(str(folder), lambda rngs: build(config, rngs=rngs, scan=False))
    from redray.models.hub import write_pretrained

    write_pretrained(config, listed.shapes, listed.fetch, str(tmp_path / "listed"),
                     dtype="float32")
    same_files(tmp_path / "loaded-float32", tmp_path / "listed")


def test_another_models_config_is_refused_naming_the_array(run):
    folder, _ = run
    other = LlamaConfig(**(CONFIG.to_dict() | {"intermediate_size": 48}))
    with pytest.raises(redray.CheckpointMismatch, match="intermediate|mlp|shape"):
        stored_params(str(folder), lambda rngs: build(other, rngs=rngs))


def test_a_damaged_newest_checkpoint_is_skipped_as_load_model_skips_it(run, tmp_path, capsys):
    folder, config = run
    copy = tmp_path / "run"
    shutil.copytree(folder, copy)
    files = [f for f in glob.glob(f"{copy}/checkpoints/2/model/**", recursive=True)
             if os.path.isfile(f)]
    largest = max(files, key=os.path.getsize)
    with open(largest, "r+b") as f:  # a write cut short
        f.truncate(os.path.getsize(largest) // 2)
    export_run(str(copy), config, str(tmp_path / "files"))
    assert "checkpoints/2 failed" in capsys.readouterr().err
    older = redray.load_model(str(folder), lambda rngs: build(config, rngs=rngs), step=1)
    save_pretrained(older, str(tmp_path / "older"))
    same_files(tmp_path / "older", tmp_path / "files")
