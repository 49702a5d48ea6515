"""redray.fit on a real local Ray cluster: 2 simulated hosts x 2 CPU devices.

Each host is a separate Ray worker process; together they form one jax.distributed
runtime over gloo. These tests share one local Ray instance (started here).
"""

import json
import os
import time

import jax
import numpy as np
import optax
import pytest

import redray
from redray.checkpoint import latest_meta
from redray.engine.loop import epoch_order
from tiny import TinyLM, lm_collate, lm_loss, lm_predict, token_data

pytestmark = pytest.mark.ray  # a local Ray cluster (or a Ray head)

ray = pytest.importorskip("ray")

DATA = token_data(96)
OPTIONS = dict(batch_size=8, model_axis=2, log_every=1, seed=0)


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def cluster_fit(tmp_path, **kw):
    kw = {"hosts": 2, "devices_per_host": 2, "storage_path": str(tmp_path / "runs"),
          "progress": False, **OPTIONS, **kw}
    return redray.fit(lambda rngs: TinyLM(rngs), lm_collate, lm_loss, optax.adam(1e-2), **kw)


def test_two_hosts_train_like_one_process(tmp_path):
    def metric(examples, predictions):
        return {"next_ok": float(np.mean([np.mean(p[:-1] == e["ids"][1:])
                                          for e, p in zip(examples, predictions)]))}

    local = redray.Trainer.of(lambda rngs: TinyLM(rngs), lm_collate, lm_loss, optax.adam(1e-2),
                           predict=lm_predict, progress=False, **OPTIONS)
    expected = local.fit(DATA, epochs=2, max_steps=16, eval_data=DATA[:21], eval_metric=metric)
    # the cluster runs the local run's plan, given as the file of its JSON
    (tmp_path / "plan.json").write_text(local.plan.to_json())
    result = cluster_fit(tmp_path, train_data=DATA, eval_data=DATA[:21], predict=lm_predict,
                         eval_metric=metric, predict_data=DATA[:13], epochs=2, max_steps=16,
                         model_axis=None, plan=str(tmp_path / "plan.json"))
    assert latest_meta(os.path.dirname(result.checkpoint))["plan"] == local.plan.to_dict()
    train = [r["loss"] for r in result.history if "loss" in r]
    assert len(train) == 16
    np.testing.assert_allclose(train, [r["loss"] for r in expected if "loss" in r], rtol=1e-5)
    evals = [r for r in result.history if "eval_loss" in r]
    assert [r["epoch"] for r in evals] == [0, 1]
    for got, want in zip(evals, [r for r in expected if "eval_loss" in r]):
        assert got["eval_loss"] == pytest.approx(want["eval_loss"], rel=1e-5)
        assert got["eval_next_ok"] == pytest.approx(want["eval_next_ok"], rel=1e-5)
    # predictions come back in input order, every example once (13 = 8 + a padded 5)
    want = local.predictor().predict(DATA[:13])
    assert len(result.predictions) == 13
    for got, ref in zip(result.predictions, want):
        np.testing.assert_array_equal(got, ref)


def recording_collate(folder):
    def collate(examples):
        ids = [int(e["id"]) for e in examples]
        with open(os.path.join(folder, f"host{jax.process_index()}.jsonl"), "a") as f:
            f.write(json.dumps(ids) + "\n")
        return {"ids": np.stack([np.asarray(e["ids"], np.int32) for e in examples])}
    return collate


def seen(folder, host, local_batch):
    """Training batches a host collated (init's one full-batch call left out)."""
    with open(os.path.join(folder, f"host{host}.jsonl")) as f:
        calls = [json.loads(line) for line in f]
    return [c for c in calls if len(c) == local_batch]


def test_each_host_reads_an_equal_disjoint_deterministic_share(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"id": i, "ids": e["ids"].tolist()} for i, e in enumerate(token_data(50))]
    pq.write_table(pa.Table.from_pylist(rows[:25]), tmp_path / "part0.parquet")
    pq.write_table(pa.Table.from_pylist(rows[25:]), tmp_path / "part1.parquet")
    folder = tmp_path / "seen"
    folder.mkdir()
    redray.fit(lambda rngs: TinyLM(rngs), recording_collate(str(folder)), lm_loss,
               optax.sgd(0.1), train_data=str(tmp_path / "*.parquet"), epochs=2, hosts=2,
               devices_per_host=2, storage_path=str(tmp_path / "runs"), progress=False,
               **OPTIONS)
    collated = [seen(folder, h, 4) for h in range(2)]
    # Deterministic: each host's batches are exactly its share of the order that the seed
    # and epoch give, so another run of the same seed reads the same batches
    for epoch in range(2):
        per_host = [sum(calls[epoch * 6:(epoch + 1) * 6], []) for calls in collated]
        assert [len(h) for h in per_host] == [24, 24]  # 6 batches each, remainder of 2 dropped
        assert not set(per_host[0]) & set(per_host[1])
        order = epoch_order(50, 0, epoch)[:48].reshape(6, 8)
        assert per_host[0] == order[:, :4].ravel().tolist()  # the Core engine's order
        assert per_host[1] == order[:, 4:].ravel().tolist()
    assert sum(collated[0][:6], []) != sum(collated[0][6:], [])  # epochs differ


def test_every_source_kind_gives_the_same_rows(tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    from redray.data import RowSource, to_dataset

    rows = [{"id": i, "ids": [i, i + 1, i + 2]} for i in range(12)]
    with open(tmp_path / "rows.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    with open(tmp_path / "rows.json", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "rows.parquet")
    sources = [rows, datasets.Dataset.from_list(rows), str(tmp_path / "rows.jsonl"),
               str(tmp_path / "rows.json"), str(tmp_path / "*.parquet"),
               ray.data.from_items(rows)]
    for source in sources:
        got = RowSource(to_dataset(source)).take_rows(range(12))
        assert [(int(r["id"]), [int(v) for v in r["ids"]]) for r in got] == \
               [(r["id"], r["ids"]) for r in rows], type(source)
    with pytest.raises(FileNotFoundError, match="no data file matches"):
        to_dataset(str(tmp_path / "missing-*.parquet"))
    with pytest.raises(TypeError, match="unsupported data source int"):
        to_dataset(3)


def failing_collate(marker):
    def collate(examples):
        if jax.process_index() == 1 and os.path.exists(marker + ".armed"):
            with open(marker, "w") as f:
                f.write(str(time.time()))
            raise RuntimeError("collate exploded on host 1")
        if len(examples) == 4:  # training batches (init collates the full batch first)
            open(marker + ".armed", "w").close()
        return lm_collate(examples)
    return collate


def test_an_error_on_one_host_ends_the_job_quickly_with_its_traceback(tmp_path):
    marker = str(tmp_path / "failed_at")
    with pytest.raises(redray.cluster.HostError) as err:
        redray.fit(lambda rngs: TinyLM(rngs), failing_collate(marker), lm_loss, optax.adam(1e-2),
                   train_data=DATA, epochs=3, hosts=2, devices_per_host=2,
                   storage_path=str(tmp_path / "runs"), progress=False, **OPTIONS)
    ended = time.time()
    assert "host 1 failed" in str(err.value)
    assert "RuntimeError: collate exploded on host 1" in str(err.value)  # the user's traceback
    assert "in collate" in str(err.value)
    assert ended - float(open(marker).read()) < 60


def killing_collate(marker):
    def collate(examples):
        if (jax.process_index() == 1 and len(examples) == 4 and not os.path.exists(marker)
                and os.path.exists(marker + ".step2")):
            open(marker, "w").close()
            os.kill(os.getpid(), 9)  # SIGKILL: no cleanup, no Python exception
        if jax.process_index() == 1 and len(examples) == 4:
            open(marker + ".step2", "w").close()
        return lm_collate(examples)
    return collate


def test_a_killed_host_restarts_the_worker_group(tmp_path):
    marker = str(tmp_path / "killed")
    result = redray.fit(lambda rngs: TinyLM(rngs), killing_collate(marker), lm_loss,
                        optax.adam(1e-2), train_data=DATA, max_steps=6, hosts=2,
                        devices_per_host=2, storage_path=str(tmp_path / "runs"), progress=False,
                        max_failures=1, **OPTIONS)
    assert os.path.exists(marker)  # host 1 really died once
    assert [r["step"] for r in result.history] == list(range(1, 7))  # and the run completed


def test_a_chat_batch_accumulated_over_two_hosts_has_trls_loss(tmp_path):
    """Eight conversations (system prompts, tool calls, two or three exchanges) with
    ChatML's assistant masks, one update of 2 hosts x 1 device x 2 micro-batches of 2:
    the logged loss is TRL's for the same update (SFTTrainer's rows and collator; its
    loss per micro-batch divided by the update's target tokens over every micro-batch
    and process, ``num_items_in_batch`` with ``average_tokens_across_devices``, summed
    as DDP's mean x the process count does), within 1e-5, and the target tokens are
    counted over the whole update. Micro-batches of unequal token counts averaged
    alike would be off by more."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import SFTConfig, SFTTrainer

    import redray.models as rm
    from hf_tiny import llama_folder
    from redray.data import chat
    from test_chat import TOOLS, conversations, tokenizer

    tok = tokenizer("chatml")
    folder = llama_folder(tmp_path / "model", tokenizer=tok)
    talks = conversations(True, count=8)
    for i, talk in enumerate(talks):  # answers of 2 to 50 words: micro-batches unequal
        talk += [{"role": "user", "content": "Again?"},
                 {"role": "assistant", "content": "Yes. " * (1 + i * i)}]
    rows = [{"messages": c, "tools": TOOLS} for c in talks]
    args = SFTConfig(output_dir=str(tmp_path / "trl"), max_length=1024, report_to=[],
                     assistant_only_loss=True, use_cpu=True, per_device_train_batch_size=2,
                     gradient_accumulation_steps=2, average_tokens_across_devices=True)
    reference = AutoModelForCausalLM.from_pretrained(folder).eval()
    trl = SFTTrainer(model=reference, args=args, train_dataset=Dataset.from_list(rows),
                     processing_class=tok)
    micro = [trl.data_collator([trl.train_dataset[i] for i in range(j, j + 2)])
             for j in range(0, 8, 2)]  # host 0's two micro-batches, then host 1's
    targets = sum(int((m["labels"][:, 1:] != -100).sum()) for m in micro)
    with torch.no_grad():
        want = sum(float(trl.compute_loss(reference, m, num_items_in_batch=targets))
                   for m in micro)
        alike = np.mean([float(trl.compute_loss(reference, m)) for m in micro])
    # the weighting is what this test sees: unweighted is 10x the tolerance off or more
    assert abs(alike - want) > 1e-4 * want

    data = [chat.render(c, tok, tools=TOOLS) for c in talks]
    width = max(len(r["ids"]) for r in data)

    def collate(examples):
        return {k: np.stack([np.pad(e[k], (0, width - len(e[k]))) for e in examples])
                for k in ("ids", "loss_mask")}

    def loss(model, batch, rng, train):
        return rm.next_token_loss(model, batch["ids"], loss_mask=batch["loss_mask"],
                                  metrics=True, train=train)

    result = redray.fit(rm.from_pretrained(folder), collate, loss, optax.sgd(0.0),
                        train_data=data, batch_size=8, micro_batch_size=2, max_steps=1,
                        hosts=2, devices_per_host=1, storage_path=str(tmp_path / "runs"),
                        progress=False, log_every=1, seed=0)
    (first,) = [r for r in result.history if "loss" in r]
    assert first["step"] == 1 and first["tokens"] == targets
    np.testing.assert_allclose(first["loss"], want, rtol=1e-5)
