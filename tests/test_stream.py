"""redray.Stream: files read through Ray Data, in an order that is a pure function of
(seed, epoch), resumed by seeking.

The epoch's segments (which rows of which piece each stream reads) and the corpus's pieces are
tested as plain functions; reading, the Trainer over a stream and exact resume run on
a real local Ray instance (Ray Data executes the reads and the transform)."""

from __future__ import annotations

import json
import os

import numpy as np
import optax
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import redray
from redray.data import corpus as corpus_module
from redray.data.corpus import Corpus
from redray.data.stream import Stream, epoch_segments, segments_from, window_order
from tiny import TinyLM, assert_same, lm_collate, lm_loss, token_data

ray = pytest.importorskip("ray")


# --------------------------------------------------------------------------- an epoch's segments

def test_plan_cuts_the_permuted_pieces_into_equal_streams():
    rows = [5, 17, 3, 9, 30, 1]
    streams = epoch_segments(rows, seed=3, epoch=0, shuffle=True, streams=4)
    per = sum(rows) // 4
    assert [sum(s.rows for s in segs) for segs in streams] == [per] * 4
    order = np.random.default_rng([3, 0]).permutation(len(rows))
    laid = [(p, r) for p in order for r in range(rows[p])]  # the rows end to end
    read = [(s.piece, r) for segs in streams for s in segs for r in range(s.start, s.stop)]
    assert read == laid[:4 * per]  # in order, each row once, the remainder left out
    assert epoch_segments(rows, 3, 0, True, 4) == streams  # a pure function of (seed, epoch)
    assert epoch_segments(rows, 3, 1, True, 4) != streams
    unshuffled = epoch_segments(rows, 3, 0, False, 1)[0]
    assert [(s.piece, s.start, s.stop) for s in unshuffled] == \
        [(p, 0, r) for p, r in enumerate(rows)]


def test_segments_from_seeks_inside_a_piece():
    segs = epoch_segments([10, 10, 10], seed=0, epoch=0, shuffle=False, streams=1)[0]
    rest = segments_from(segs, 13)
    assert [(s.piece, s.start, s.stop) for s in rest] == [(1, 3, 10), (2, 0, 10)]
    assert segments_from(segs, 0) == segs


def test_window_order_is_a_seeded_permutation():
    a = window_order(50, 0, 1, 2, 3, True)
    assert sorted(a) == list(range(50)) and list(a) != list(range(50))
    assert list(window_order(50, 0, 1, 2, 3, True)) == list(a)
    assert list(window_order(50, 0, 1, 2, 4, True)) != list(a)
    assert list(window_order(7, 0, 1, 2, 3, False)) == list(range(7))


# --------------------------------------------------------------------------- the corpus

def write_parquet(folder, files=3, rows=100, row_group=16, seq=9):
    os.makedirs(folder, exist_ok=True)
    data = token_data(files * rows, seq=seq)
    for f in range(files):
        part = data[f * rows:(f + 1) * rows]
        table = pa.table({"ids": [e["ids"].tolist() for e in part],
                          "n": list(range(f * rows, (f + 1) * rows))})
        pq.write_table(table, os.path.join(folder, f"part-{f}.parquet"),
                       row_group_size=row_group)
    return data


def test_parquet_pieces_are_row_groups_from_the_footer(tmp_path):
    write_parquet(tmp_path, files=2, rows=40, row_group=16)
    corpus = Corpus(str(tmp_path / "*.parquet"))
    assert [(os.path.basename(p.path), p.index, p.rows) for p in corpus.pieces] == [
        ("part-0.parquet", 0, 16), ("part-0.parquet", 1, 16), ("part-0.parquet", 2, 8),
        ("part-1.parquet", 0, 16), ("part-1.parquet", 1, 16), ("part-1.parquet", 2, 8)]
    assert corpus.rows == 80
    assert corpus.read(corpus.pieces[4], 3, 5).column("n").to_pylist() == [59, 60]
    assert Corpus(str(tmp_path)).rows == 80  # a folder: its data files


def test_jsonl_pieces_are_byte_ranges_at_line_ends(tmp_path, monkeypatch):
    monkeypatch.setattr(corpus_module, "JSONL_PIECE_BYTES", 100)
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"n": i, "text": "x" * (i % 7)}) + "\n"
                            for i in range(50)) + "\n")  # a trailing empty line
    corpus = Corpus(str(path))
    assert len(corpus.pieces) > 5 and corpus.rows == 50
    read = [n for p in corpus.pieces for n in corpus.read(p).column("n").to_pylist()]
    assert read == list(range(50))


def test_bad_paths_say_what_to_give(tmp_path):
    with pytest.raises(FileNotFoundError, match="no data file matches"):
        Corpus(str(tmp_path / "missing-*.parquet"))
    (tmp_path / "a.csv").write_text("n\n1\n")
    with pytest.raises(ValueError, match=r"a.csv.*use .parquet, .jsonl or .json"):
        Corpus(str(tmp_path / "a.csv"))
    write_parquet(tmp_path / "p", files=1, rows=4)
    (tmp_path / "p" / "b.jsonl").write_text('{"n": 1}\n')
    with pytest.raises(ValueError, match="mixing parquet and JSON-lines"):
        Corpus(str(tmp_path / "p"))
    with pytest.raises(ValueError, match="shuffle_buffer=0"):
        Stream(str(tmp_path / "p" / "*.parquet"), shuffle_buffer=0)


# --------------------------------------------------------------------------- reading

@pytest.mark.ray
def test_batches_split_seek_and_cover_the_epoch(tmp_path, local_ray):
    write_parquet(tmp_path, files=3, rows=100, row_group=16)
    stream = Stream(str(tmp_path / "*.parquet"), shuffle_buffer=40)
    assert stream.steps_per_epoch(16, 2) == (300 // 2) // 8
    halves = [list(stream.epoch_batches(0, 7, True, 16, rows, 0, 18, 2))
              for rows in (slice(0, 8), slice(8, 16))]
    whole = list(stream.epoch_batches(0, 7, True, 16, slice(0, 16), 0, 18, 2))
    n = [[[r["n"] for r in b] for b in part] for part in (*halves, whole)]
    assert [a + b for a, b in zip(n[0], n[1])] == n[2]  # processes' parts make the batch
    seen = [x for b in n[2] for x in b]
    assert len(seen) == len(set(seen)) == 18 * 16  # every row at most once per epoch
    resumed = list(stream.epoch_batches(0, 7, True, 16, slice(0, 16), 11, 18, 2))
    assert [[r["n"] for r in b] for b in resumed] == n[2][11:]  # seek: the same rows
    other = list(stream.epoch_batches(1, 7, True, 16, slice(0, 16), 0, 2, 2))
    assert [[r["n"] for r in b] for b in other] != n[2][:2]


@pytest.mark.ray
def test_transform_runs_through_ray_data_and_must_keep_rows(tmp_path, local_ray):
    write_parquet(tmp_path, files=1, rows=50)
    stream = Stream(str(tmp_path / "*.parquet"),
                    transform=lambda row: {"ids": row["ids"], "double": row["n"] * 2})
    (chunk,) = list(stream.in_order(64))
    assert [r["double"] for r in chunk] == [2 * i for i in range(50)]
    dropping = Stream(str(tmp_path / "*.parquet"),
                      batch_transform=lambda b: {k: v[::2] for k, v in b.items()})
    with pytest.raises(ValueError, match="gave 25 rows for 50.*redray.data.prepare"):
        list(dropping.in_order(64))


def fit(stream, steps, storage, max_steps=None):
    trainer = redray.Trainer.of(lambda rngs: TinyLM(rngs), lm_collate, lm_loss,
                             optax.adam(1e-2), batch_size=8, model_axis=2, progress=False,
                             log_every=1, checkpoint=redray.CheckpointConfig(
                                 str(storage), save_every=3))
    history = trainer.fit(stream, epochs=2, max_steps=max_steps or steps)
    return trainer, history


@pytest.mark.ray
def test_training_resumes_bitwise_from_a_checkpoint_mid_epoch(tmp_path, local_ray):
    write_parquet(tmp_path / "data", files=2, rows=64, row_group=8)
    stream = Stream(str(tmp_path / "data" / "*.parquet"), shuffle_buffer=24, streams=2)
    whole, history = fit(stream, 20, tmp_path / "a")  # 16 steps per epoch: into epoch 1
    assert len([r for r in history if "loss" in r]) == 20
    fit(stream, 20, tmp_path / "b", max_steps=9)  # stops at 9: checkpoint at step 9
    resumed, rest = fit(stream, 20, tmp_path / "b")
    assert resumed.resumed_from["step"] == 9
    assert [r["loss"] for r in rest if "loss" in r] == \
        [r["loss"] for r in history if "loss" in r][9:]
    assert_same(resumed.state.params, whole.state.params)
    with pytest.raises(redray.CheckpointMismatch, match="shuffle_buffer"):
        fit(Stream(str(tmp_path / "data" / "*.parquet"), shuffle_buffer=25, streams=2), 20,
            tmp_path / "b")


@pytest.mark.ray
def test_evaluate_and_predict_read_the_stream_in_order(tmp_path, local_ray):
    data = write_parquet(tmp_path, files=2, rows=21, row_group=8)
    stream = Stream(str(tmp_path / "*.parquet"))
    trainer = redray.Trainer.of(lambda rngs: TinyLM(rngs), lm_collate, lm_loss,
                             optax.adam(1e-2), predict=lambda m, b, r: m(b["ids"]).argmax(-1),
                             batch_size=8, model_axis=2, progress=False)
    as_list = [{"ids": e["ids"].astype(np.int64)} for e in data]  # parquet gives int64
    trainer.init(as_list)
    assert trainer.evaluate(stream) == pytest.approx(trainer.evaluate(as_list), rel=1e-6)
    got, want = trainer.predictor().predict(stream), trainer.predictor().predict(as_list)
    assert len(got) == 42
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)


@pytest.mark.ray
def test_json_lines_through_a_uri_and_through_a_filesystem(tmp_path, local_ray, monkeypatch):
    from pyarrow import fs

    monkeypatch.setattr(corpus_module, "JSONL_PIECE_BYTES", 200)
    folder = tmp_path / "lines"
    folder.mkdir()
    for f in range(2):
        (folder / f"part-{f}.jsonl").write_text("".join(
            json.dumps({"n": f * 30 + i, "ids": [i % 5] * 4}) + "\n" for i in range(30)))
    by_uri = Stream(f"file://{folder}/*.jsonl", shuffle_buffer=16)
    assert len(by_uri) == 60 and len(by_uri.corpus.pieces) > 4
    inside = Stream("*.jsonl", filesystem=fs.SubTreeFileSystem(str(folder), fs.LocalFileSystem()),
                    shuffle_buffer=16)
    for stream in (by_uri, inside):
        (rows,) = list(stream.in_order(100))
        assert [r["n"] for r in rows] == list(range(60))
        batches = list(stream.epoch_batches(0, 1, True, 8, slice(0, 8), 0, 7, 1))
        seen = [r["n"] for b in batches for r in b]
        assert len(set(seen)) == 56 and seen != sorted(seen)
