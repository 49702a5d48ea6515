"""Streaming data: bounded memory over a corpus larger than the object store, the cost of
Ray Data on the step, resume by seeking, and packing.

Four figures, one run:

* ``data/stream_peak_rss_over_buffer``: a generated parquet corpus of several GB (rows
  of 16 token ids and a 16 KiB payload the collate drops, so every byte is read and
  moved through Ray Data) trained on for one whole epoch by 2 simulated hosts x 2 CPU
  devices, on a local Ray whose object store holds 300 MB. A psutil thread samples the
  resident memory of the driver, the two hosts (Ray Train workers) and every other Ray
  worker (Ray Data's reads) every 0.2 s. The reference is the same run on a corpus of
  one shuffle buffer per stream (what the streams hold at a time) with the same model:
  the figure is the largest ratio of peak memory, per role. Target <= 2.0.
* ``data/stream_over_memory``: ``Trainer.fit`` fed by a ``redray.Stream`` of parquet
  files over the same fit fed by the same rows in a list (one process, 4 devices,
  data 2 x model 2, TinyLM dim 128, batch 32, sequence 64), steady-state wall time per
  step (first step to last: Ray Data reads on the prefetch thread, on the timed path),
  alternating rounds. Target <= 1.05. The time to the first step is in ``detail``.
* ``data/resume_seek_ratio``: time from a fresh process's start to its first step
  when resuming 2 batches before the end of an epoch, over resuming 2 batches after its
  start, same corpus (about 200 MB of rows) and checkpoints; fresh processes,
  alternating. Target <= 1.2.
* ``data/packing_efficiency``: real tokens over token slots of the demo's packed
  training rows (``examples/language_modeling/train.py``'s ``corpus``: documents
  tokenized and packed into 65-token rows); ``split=False`` (a
  document never cut across rows) in ``detail``.

    python benchmarks/streaming.py [--gigabytes 3] [--rounds 3]
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (HERE, ROOT, example_module, figure, parser, save,  # noqa: E402
                    simulate_devices)

simulate_devices(4)
sys.path.insert(0, os.path.join(ROOT, "tests"))

import numpy as np  # noqa: E402
import optax  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402

import redray  # noqa: E402
from redray.engine.hooks import Position  # noqa: E402
from redray.engine.loop import TrainingData  # noqa: E402
from tiny import TinyLM, lm_loss, token_data  # noqa: E402

COMMAND = "python benchmarks/streaming.py"
PAYLOAD = 16 << 10
OBJECT_STORE = 300 << 20


def write_corpus(folder: str, rows: int, seq: int = 16, vocab: int = 64,
                 payload: int = PAYLOAD, row_group: int = 64, file_rows: int = 8192) -> int:
    """Parquet files of ``rows`` rows: ``ids`` (seq int32) and ``payload`` bytes.
    Returns the bytes written."""
    os.makedirs(folder, exist_ok=True)
    rs = np.random.default_rng(0)
    blob = rs.bytes(payload)
    for f, start in enumerate(range(0, rows, file_rows)):
        n = min(file_rows, rows - start)
        ids = rs.integers(0, vocab, (n, seq), dtype=np.int32)
        table = pa.table({"ids": pa.FixedSizeListArray.from_arrays(ids.reshape(-1), seq),
                          "payload": pa.array([blob] * n, pa.binary())})
        pq.write_table(table, os.path.join(folder, f"part-{f:05d}.parquet"),
                       row_group_size=row_group, compression="none", use_dictionary=False)
    return sum(os.path.getsize(os.path.join(folder, p)) for p in os.listdir(folder))


def ids_collate(examples):
    return {"ids": np.stack([np.asarray(e["ids"], np.int32) for e in examples])}


class Sampler:
    """Peak resident memory per process of this Ray session, by role, every 0.2 s."""

    def __init__(self):
        import psutil

        self.psutil, self.peak, self.role = psutil, {}, {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        me = os.getpid()
        while not self.stop.is_set():
            for p in self.psutil.process_iter(["pid", "cmdline", "memory_info"]):
                try:
                    title = " ".join(p.info["cmdline"] or [])
                    rss = p.info["memory_info"].rss
                except (self.psutil.Error, AttributeError):
                    continue
                if p.info["pid"] == me:
                    role = "driver"
                elif title.startswith("ray::Host"):
                    role = "host"
                elif title.startswith("ray::") and not any(
                        k in title for k in ("Tracker", "Results")):
                    role = "ray_worker"
                else:
                    continue
                pid = p.info["pid"]
                self.peak[pid] = max(self.peak.get(pid, 0), rss)
                if self.role.get(pid) != "host":
                    self.role[pid] = role
            time.sleep(0.2)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()

    def by_role(self) -> dict:
        out: dict = {}
        for pid, rss in self.peak.items():
            role = self.role[pid]
            out[role] = max(out.get(role, 0), rss)
        return out


def cluster_epoch(corpus: str, storage: str, buffer: int, batch: int) -> dict:
    """One epoch of the corpus on 2 hosts x 2 devices; peak memory by role (bytes)."""
    import ray

    ray.init(address="local", num_cpus=(os.cpu_count() or 1) + 4, object_store_memory=OBJECT_STORE,
             include_dashboard=True, log_to_driver=False)
    try:
        stream = redray.Stream(corpus, shuffle_buffer=buffer)
        with Sampler() as sampler:
            start = time.perf_counter()
            result = redray.fit(lambda rngs: TinyLM(rngs), ids_collate, lm_loss,
                                optax.adam(1e-3), train_data=stream, epochs=1,
                                batch_size=batch, model_axis=2, hosts=2, devices_per_host=2,
                                storage_path=storage, name="epoch", log_every=50,
                                progress=False, tracking=False)
            seconds = time.perf_counter() - start
    finally:
        ray.shutdown()
    steps = max(r["step"] for r in result.history if "step" in r)
    return {"peak_bytes": sampler.by_role(), "seconds": seconds, "steps": steps}


def memory_figure(args, work: str) -> dict:
    rows_per_gb = (1 << 30) // (PAYLOAD + 64)
    big_rows = int(args.gigabytes * rows_per_gb)
    small_rows = 2 * args.buffer  # one shuffle buffer per stream, 2 streams
    sizes = {}
    for name, rows in (("corpus", big_rows), ("one_buffer", small_rows)):
        sizes[name] = write_corpus(os.path.join(work, name), rows)
    runs = {name: cluster_epoch(os.path.join(work, name, "*.parquet"),
                                os.path.join(work, f"runs-{name}"), args.buffer, args.batch)
            for name in ("one_buffer", "corpus")}
    ratios = {role: runs["corpus"]["peak_bytes"][role] / runs["one_buffer"]["peak_bytes"][role]
              for role in runs["corpus"]["peak_bytes"]}
    return figure("data/stream_peak_rss_over_buffer", max(ratios.values()), "x",
                  f"the same run on a corpus of one shuffle buffer per stream ({small_rows} rows)",
                  "<= 2.0", COMMAND, ratio_by_role=ratios,
                  peak_mb={n: {k: v / 2**20 for k, v in r["peak_bytes"].items()}
                           for n, r in runs.items()},
                  corpus_bytes=sizes["corpus"], one_buffer_bytes=sizes["one_buffer"],
                  object_store_bytes=OBJECT_STORE, corpus_over_object_store=sizes["corpus"]
                  / OBJECT_STORE, seconds={n: r["seconds"] for n, r in runs.items()},
                  steps={n: r["steps"] for n, r in runs.items()}, shuffle_buffer=args.buffer,
                  batch=args.batch)


# ----------------------------------------------------------------------------- step time
def lm_parquet(folder: str, data: list[dict]) -> None:
    os.makedirs(folder, exist_ok=True)
    ids = np.stack([e["ids"] for e in data])
    table = pa.table({"ids": pa.FixedSizeListArray.from_arrays(ids.reshape(-1), ids.shape[1])})
    pq.write_table(table, os.path.join(folder, "part-00000.parquet"), row_group_size=256)


class StepClock(redray.Hook):
    def __init__(self):
        self.times = []

    def on_step(self, run, info):
        info.metrics["loss"].block_until_ready()
        self.times.append(time.perf_counter())


def timed_fit(feed, steps: int, seed: int) -> dict:
    clock = StepClock()
    trainer = redray.Trainer.of(lambda rngs: TinyLM(rngs, vocab=256, dim=128), ids_collate,
                             lm_loss, optax.adam(1e-3), batch_size=32, model_axis=2,
                             progress=False, log_every=steps, seed=seed, hooks=[clock])
    start = time.perf_counter()
    trainer.fit(feed, epochs=1, max_steps=steps)
    t = clock.times
    return {"first_step_s": t[0] - start, "per_step_s": (t[-1] - t[0]) / (len(t) - 1)}


def step_figure(args, work: str) -> dict:
    import ray

    steps = args.steps
    data = token_data(32 * (steps + 2), seq=64, vocab=256)
    lm_parquet(os.path.join(work, "lm"), data)
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        stream = redray.Stream(os.path.join(work, "lm", "*.parquet"), shuffle_buffer=1024)
        listed = [{"ids": e["ids"]} for e in data]
        runs = {"memory": [], "stream": []}
        for r in range(args.rounds):
            for name, feed in (("memory", listed), ("stream", stream)):
                runs[name].append(timed_fit(feed, steps, seed=r))
    finally:
        ray.shutdown()
    per = {k: [x["per_step_s"] for x in v] for k, v in runs.items()}
    first = {k: [x["first_step_s"] for x in v] for k, v in runs.items()}
    return figure("data/stream_over_memory",
                  float(np.median(per["stream"]) / np.median(per["memory"])), "x",
                  "Trainer.fit fed the same rows from a list, same model/mesh/steps", "<= 1.05",
                  COMMAND, per_step_s=per, first_step_s=first, steps=steps, rounds=args.rounds)


# ----------------------------------------------------------------------------- resume
def resume_probe(corpus: str, checkpoints: str) -> None:
    """Child process: restore the newest checkpoint and time the first step."""
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    clock = StepClock()
    start = time.perf_counter()
    trainer = redray.Trainer.of(lambda rngs: TinyLM(rngs), ids_collate, lm_loss, optax.adam(1e-3),
                             batch_size=32, model_axis=2, progress=False, hooks=[clock],
                             checkpoint=redray.CheckpointConfig(checkpoints, save_every=10**9))
    stream = redray.Stream(corpus, shuffle_buffer=1024, streams=2)
    trainer.init(stream)
    resumed = trainer.step
    trainer.fit(stream, epochs=1, max_steps=resumed + 1)
    print(json.dumps({"first_step_s": clock.times[0] - start, "resumed_step": resumed}))
    ray.shutdown()


def resume_figure(args, work: str) -> dict:
    import ray

    rows = int(args.resume_mb * (1 << 20) // (PAYLOAD + 64))
    corpus = os.path.join(work, "resume", "*.parquet")
    write_corpus(os.path.join(work, "resume"), rows)
    stream = redray.Stream(corpus, shuffle_buffer=1024, streams=2)
    per_epoch = stream.steps_per_epoch(32, 2)
    folders = {}
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        for name, at in (("start", 2), ("end", per_epoch - 2)):
            folders[name] = os.path.join(work, f"ckpt-{name}")
            trainer = redray.Trainer.of(lambda rngs: TinyLM(rngs), ids_collate, lm_loss,
                                     optax.adam(1e-3), batch_size=32, model_axis=2,
                                     progress=False, checkpoint=redray.CheckpointConfig(
                                         folders[name], save_every=10**9))
            trainer.init(stream)
            # a checkpoint at batch `at` of epoch 0 (its state untrained: what is timed is
            # reading from there on)
            data = TrainingData.of(stream, trainer.seed, True, trainer.geometry, None)
            trainer.save_checkpoint(data.settings(), position=Position(0, at, False))
            trainer.checkpointer.wait()
    finally:
        ray.shutdown()
    times = {"start": [], "end": []}
    for r in range(args.rounds):
        for name in ("start", "end"):
            fresh = os.path.join(work, f"probe-{name}-{r}")  # a probe saves as it ends
            shutil.copytree(folders[name], fresh)
            done = subprocess.run([sys.executable, os.path.join(HERE, "streaming.py"),
                                   "--resume-probe", corpus, fresh],
                                  capture_output=True, text=True)
            if done.returncode:
                raise RuntimeError(f"the resume probe failed:\n{done.stderr[-4000:]}")
            times[name].append(json.loads(done.stdout.strip().splitlines()[-1])["first_step_s"])
    ratio = float(np.median(times["end"]) / np.median(times["start"]))
    return figure("data/resume_seek_ratio", ratio, "x",
                  "restart to first step, resuming 2 batches into the epoch", "<= 1.2",
                  COMMAND, seconds=times, steps_per_epoch=per_epoch, corpus_rows=rows,
                  rounds=args.rounds)


# ----------------------------------------------------------------------------- packing
def packing_figure(args, work: str) -> dict:
    import ray

    demo = example_module("language_modeling")
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        train, _, _ = demo.corpus(os.path.join(work, "demo-data"), 64)
        rows = [r for chunk in train.in_order(4096) for r in chunk]
    finally:
        ray.shutdown()
    split = redray.data.efficiency(rows)
    documents = _demo_documents(demo)
    whole = redray.data.efficiency(redray.data.pack(documents, 65, split=False))
    return figure("data/packing_efficiency", split, "fraction",
                  "token slots of the packed rows (real / all)", None, COMMAND,
                  rows=len(rows), without_splitting_documents=whole, row_tokens=65)


def _demo_documents(demo) -> list:
    """The demo's training documents as token ids (for the split=False comparison)."""
    from pydoc_data.topics import topics

    from redray.models import gpt2_tokenizer

    tokenizer = gpt2_tokenizer()
    texts = [topics[k] for i, k in enumerate(sorted(topics)) if i % 10 != 5]
    return [tokenizer.encode(t).ids for t in texts]


def main(argv=None):
    ap = parser(__doc__)
    ap.add_argument("--gigabytes", type=float, default=3.0, help="the large corpus's size")
    ap.add_argument("--buffer", type=int, default=1024, help="shuffle buffer (rows)")
    ap.add_argument("--batch", type=int, default=128, help="global batch of the memory run")
    ap.add_argument("--steps", type=int, default=80, help="steps of the step-time runs")
    ap.add_argument("--resume-mb", type=float, default=200, help="the resume corpus's size")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--only", nargs="*", choices=sorted(FIGURES), help="default: all")
    ap.add_argument("--resume-probe", nargs=2, help=argparse_hidden())
    args = ap.parse_args(argv)
    if args.resume_probe:
        return resume_probe(*args.resume_probe)
    if args.tiny:
        args.gigabytes, args.buffer, args.batch = 0.01, 64, 16
        args.steps, args.resume_mb, args.rounds = 4, 4, 1
    with tempfile.TemporaryDirectory(prefix="redray-streaming-") as work:
        figures = [FIGURES[name](args, work) for name in args.only or FIGURES]
    save(figures, args.out)


FIGURES = {"packing": packing_figure, "step": step_figure, "resume": resume_figure,
           "memory": memory_figure}


def argparse_hidden():
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    main()
