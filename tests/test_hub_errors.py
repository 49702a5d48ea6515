"""Hugging Face import of damaged or malformed checkpoint folders: every error names the
file (and the tensor) and says what to do."""

import json
import os
import shutil

import pytest
from transformers import GPT2Config

from redray.models import hub


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny GPT-2 written once as one file and once as two shards with an index."""
    root = tmp_path_factory.mktemp("hf")
    config = GPT2Config(vocab_size=64, n_positions=32, n_embd=16, n_layer=1, n_head=2)
    model = hub.build(config)
    hub.save_pretrained(model, str(root / "single"))
    hub.save_pretrained(model, str(root / "sharded"), max_shard_bytes=8_000)
    return root


def copy(saved, which, tmp_path):
    return shutil.copytree(saved / which, tmp_path / which)


def test_the_intact_folders_load(saved):
    assert sorted(os.listdir(saved / "sharded"))[-1] == hub.INDEX_FILE
    for which in ("single", "sharded"):
        hub.from_pretrained(str(saved / which))


def test_a_truncated_safetensors_file_is_named(saved, tmp_path):
    folder = copy(saved, "single", tmp_path)
    file = folder / hub.SINGLE_FILE
    with open(file, "r+b") as f:  # a download cut short
        f.truncate(os.path.getsize(file) // 2)
    with pytest.raises(ValueError, match=rf"{file} cannot be read as safetensors \(.+\): the "
                       "file is damaged or incomplete .* download or save it again"):
        hub.from_pretrained(str(folder))


def test_a_malformed_index_is_named(saved, tmp_path):
    folder = copy(saved, "sharded", tmp_path)
    index = folder / hub.INDEX_FILE
    content = json.loads(index.read_text())
    index.write_text(json.dumps({**content, "weight_map": list(content["weight_map"])}))
    with pytest.raises(ValueError, match=rf"{index}: its 'weight_map' must map every tensor "
                       r"name to its .safetensors file .*; it is a list"):
        hub.from_pretrained(str(folder))
    index.write_text(json.dumps({"metadata": {}}))
    with pytest.raises(ValueError, match="it is missing"):
        hub.from_pretrained(str(folder))
    index.write_text(json.dumps(content)[:40])
    with pytest.raises(ValueError, match=rf"{index} is not valid JSON \(JSONDecodeError"):
        hub.from_pretrained(str(folder))


def test_a_missing_shard_and_a_tensor_in_the_wrong_file_are_named(saved, tmp_path):
    folder = copy(saved, "sharded", tmp_path)
    index = folder / hub.INDEX_FILE
    content = json.loads(index.read_text())
    files = sorted(set(content["weight_map"].values()))
    assert len(files) >= 2
    moved = next(n for n, f in content["weight_map"].items() if f == files[0])
    wrong = {**content, "weight_map": {**content["weight_map"], moved: files[1]}}
    index.write_text(json.dumps(wrong))
    with pytest.raises(ValueError, match=rf"tensor '{moved}' cannot be read from "
                       rf"{folder / files[1]} \(.+\): the index maps it to this file, which "
                       "does not hold it"):
        hub.from_pretrained(str(folder))
    index.write_text(json.dumps(content))
    os.remove(folder / files[1])
    with pytest.raises(FileNotFoundError, match=rf"{index} maps tensors to '{files[1]}', "
                       "which is not in .*: the download or copy is incomplete"):
        hub.from_pretrained(str(folder))


def test_a_bad_config_is_named(saved, tmp_path):
    folder = copy(saved, "single", tmp_path)
    config = folder / "config.json"
    config.write_text('{"model_type": "gpt2", ')
    with pytest.raises(ValueError, match=rf"{config} is not valid JSON"):
        hub.from_pretrained(str(folder))
    config.write_text('{"hidden_size": 16}')
    with pytest.raises(ValueError, match=rf"{config} has no 'model_type' .*redray reads .*gpt2"):
        hub.from_pretrained(str(folder))
