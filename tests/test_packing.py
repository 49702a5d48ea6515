"""Sequence packing: rows of many documents with segment ids, models that keep them
apart, and ``prepare`` writing a packed, tokenized corpus (in this process, or through Ray
Data: the same files)."""

from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np
import pyarrow.parquet as pq
import pytest
import transformers as hf
from flax import nnx

import redray
from redray.data import efficiency, next_token_mask, pack, prepare
from redray.models import build
from redray.models.layers import segment_positions

ray = pytest.importorskip("ray")


def test_pack_fills_rows_in_order_and_splits_long_documents():
    docs = [[1, 2, 3], [4, 5, 6, 7, 8], [9], [10, 11, 12, 13, 14, 15, 16]]
    rows = list(pack(docs, 6))
    assert [r["ids"].tolist() for r in rows] == [[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12],
                                                 [13, 14, 15, 16, 0, 0]]
    assert [r["segment_ids"].tolist() for r in rows] == [[1, 1, 1, 2, 2, 2],
                                                         [1, 1, 2, 3, 3, 3],
                                                         [1, 1, 1, 1, 0, 0]]
    assert efficiency(rows) == 16 / 18


def test_pack_without_split_puts_each_document_whole_in_the_row_it_fits_best():
    docs = [[1, 2, 3], [4, 5, 6, 7, 8], [9], [10] * 13]
    rows = list(pack(docs, 6, split=False))
    # [9] fits both open rows: the fuller one takes it (and is written as it fills);
    # the long document fills two rows and its rest joins the row with room for it
    assert [r["ids"].tolist() for r in rows] == [[4, 5, 6, 7, 8, 9], [10] * 6, [10] * 6,
                                                 [1, 2, 3, 10, 0, 0]]
    assert rows[0]["segment_ids"].tolist() == [1, 1, 1, 1, 1, 2]
    assert rows[3]["segment_ids"].tolist() == [1, 1, 1, 2, 0, 0]
    # at most open_rows wait: with one, a document that does not fit writes the row out
    one = list(pack(docs[:3], 6, split=False, open_rows=1))
    assert [r["ids"].tolist() for r in one] == [[1, 2, 3, 0, 0, 0], [4, 5, 6, 7, 8, 9]]


def test_rows_with_a_loss_mask_keep_each_conversation_whole_by_default():
    talks = [{"ids": [t] * n, "loss_mask": [1] * n} for t, n in ((1, 4), (2, 5), (3, 2), (4, 3))]
    rows = list(pack(talks, 6))
    for talk in talks:  # every conversation in one row, its mask beside it
        (holder,) = [r for r in rows if talk["ids"][0] in r["ids"]]
        assert (holder["ids"] == talk["ids"][0]).sum() == len(talk["ids"])
        assert holder["loss_mask"][holder["ids"] == talk["ids"][0]].tolist() == talk["loss_mask"]
    assert [r["ids"].tolist() for r in rows] == [[1, 1, 1, 1, 3, 3], [2, 2, 2, 2, 2, 0],
                                                 [4, 4, 4, 0, 0, 0]]
    cut = list(pack(talks, 6, split=True))  # asked for: laid end to end, cut at the rows
    assert [r["ids"].tolist() for r in cut][0] == [1, 1, 1, 1, 2, 2]


def test_next_token_mask_and_positions_restart_at_each_document():
    seg = np.array([[1, 1, 1, 2, 2, 0]])
    assert next_token_mask(seg).tolist() == [[True, True, False, True, False]]
    assert segment_positions(jnp.asarray(seg)).tolist() == [[0, 1, 2, 0, 1, 0]]


@pytest.mark.parametrize("family", ["llama", "gpt2", "opt", "gptj"])
def test_a_packed_row_scores_each_document_as_if_alone(family):
    config = {"llama": hf.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, vocab_size=50,
                                      max_position_embeddings=32),
              "gpt2": hf.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=50,
                                    n_positions=32),
              "opt": hf.OPTConfig(hidden_size=32, ffn_dim=64, num_hidden_layers=2,
                                  num_attention_heads=4, vocab_size=50,
                                  max_position_embeddings=32, word_embed_proj_dim=32),
              "gptj": hf.GPTJConfig(n_embd=32, n_layer=2, n_head=4, vocab_size=50,
                                    n_positions=32, rotary_dim=4)}[family]
    model = build(config, rngs=nnx.Rngs(0))
    a, b = np.arange(3, 8), np.arange(10, 19)
    (row,) = list(pack([a, b], 16))
    logits = model(jnp.asarray(row["ids"][None]), segment_ids=jnp.asarray(
        row["segment_ids"][None]))
    for doc, start in ((a, 0), (b, len(a))):
        alone = model(jnp.asarray(doc[None]))
        np.testing.assert_allclose(np.asarray(logits[0, start:start + len(doc)]),
                                   np.asarray(alone[0]), rtol=1e-5, atol=1e-5)


@pytest.mark.ray
def test_prepare_tokenizes_packs_and_writes_small_row_groups(tmp_path, local_ray):
    docs = [{"text": " ".join(["word"] * (i % 9 + 1))} for i in range(60)]

    def tokenize(row):
        return None if row["text"] == "word" else {"ids": [7] * len(row["text"].split())}

    # 60 rows: transformed in this process by default; parallel=True through Ray Data,
    # which must write the same files
    out = prepare(docs, str(tmp_path / "packed"), transform=tokenize, pack=8,
                  row_group_rows=4, rows_per_file=10)
    through_ray = prepare(docs, str(tmp_path / "through-ray"), transform=tokenize, pack=8,
                          row_group_rows=4, rows_per_file=10, parallel=True)
    assert (through_ray.rows, through_ray.documents, through_ray.packing_efficiency) == \
        (out.rows, out.documents, out.packing_efficiency)
    assert [os.path.basename(f) for f in through_ray.files] == \
        [os.path.basename(f) for f in out.files]
    for here, there in zip(out.files, through_ray.files):
        assert pq.read_table(here).equals(pq.read_table(there)), here
    tokens = sum(i % 9 + 1 for i in range(60) if i % 9)  # rows of one word are dropped
    assert out.documents == 60 - 7 and out.rows == -(-tokens // 8)
    assert out.packing_efficiency == tokens / (out.rows * 8)
    assert [pq.ParquetFile(f).metadata.num_row_groups for f in out.files] == \
        [3] * (out.rows // 10) + ([-(-(out.rows % 10) // 4)] if out.rows % 10 else [])
    stream = redray.Stream(str(tmp_path / "packed"))
    (rows,) = list(stream.in_order(1000))
    assert len(rows) == out.rows and {len(r["ids"]) for r in rows} == {8}
    assert sum(np.count_nonzero(r["segment_ids"]) for r in rows) == tokens
    with pytest.raises(FileExistsError, match="already holds parquet files"):
        prepare(docs, str(tmp_path / "packed"), transform=tokenize, pack=8)
    with pytest.raises(ValueError, match=r"parallel=False\) transforms a list of dicts"):
        prepare(str(tmp_path / "packed"), str(tmp_path / "again"), parallel=False)
