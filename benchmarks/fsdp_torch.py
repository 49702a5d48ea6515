"""Against PyTorch FSDP, the paper's baseline: GPT-2 trained by both, side by side.

The same GPT-2 (``transformers`` config: 2 layers, hidden 128, 4 heads, vocabulary
1024, context 128, no dropout, fp32), the same initial weights, the same data in the
same order, the same optimizer (AdamW, lr 1e-3, betas 0.9/0.999, eps 1e-8, weight
decay 0.01, constant), the same global batch (16 windows of 128 tokens: 8 per process)
and the same number of steps, trained

(a) by PyTorch 2.13 FSDP2: ``transformers``' ``GPT2LMHeadModel`` with ``fully_shard`` on
    every block and on the root, 2 processes over gloo on CPU
    (``benchmarks/_torch_fsdp.py``), and
(b) by redray: ``redray.fit`` on 2 simulated hosts x 1 CPU device with ``fsdp_axis=2``
    (the same 2 processes and the same sharding of parameters and Adam state as FSDP's
    2 ranks), starting from PyTorch's initial model saved with ``save_pretrained`` and
    loaded by ``redray.models.from_pretrained``.

The text is CPython's documentation (``pydoc_data.topics``), tokenized by a byte-level
BPE of 1024 tokens trained on it; the last 64 windows are held out. redray's epoch
order (``epoch_order(n, seed, epoch)``, each process the half of a global batch its
device holds) is handed to PyTorch, so both see the same batches in the same order.

Throughput: examples/s of each window of ``--window`` steps (the windows redray's
``fit`` logs; PyTorch's steps are timed at the same boundaries), the first window
(compilation, warm-up) excluded; median per run, the two frameworks alternate over
``--rounds`` runs. Figures: ``fsdp_torch/throughput`` = redray / PyTorch examples/s
(target >= 1.0); ``fsdp_torch/perplexity`` = the larger over the smaller of the two
held-out perplexities after the last step (target <= 1.02).

Beside them, in ``detail.single_core``: each framework's step alone, without FSDP or
collectives, on one process's share of a global batch (8 windows), in a fresh process
pinned to one core (PyTorch with 1 thread): how fast the kernels are (XLA:CPU's against
PyTorch's), apart from everything distributed.

    python benchmarks/fsdp_torch.py [--steps 150] [--window 10] [--rounds 2] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _lm import collate, loss  # noqa: E402
from common import HERE, figure, parser, save, stats  # noqa: E402

import numpy as np  # noqa: E402
import optax  # noqa: E402
import ray  # noqa: E402

import redray  # noqa: E402
from redray.engine.loop import epoch_order  # noqa: E402
from redray.models import from_pretrained  # noqa: E402

COMMAND = "python benchmarks/fsdp_torch.py"
VOCAB, EVAL_WINDOWS, SEED = 1024, 64, 0
OPTIMIZER = dict(lr=1e-3, eps=1e-8, weight_decay=0.01)
FULL = dict(n_layer=2, n_embd=128, n_head=4, seq=128, batch=16)
TINY = dict(n_layer=1, n_embd=32, n_head=4, seq=32, batch=4)


def windows(seq: int) -> tuple[np.ndarray, np.ndarray]:
    """(train, eval) windows of seq + 1 token ids of the pydoc text, BPE of VOCAB tokens."""
    from pydoc_data.topics import topics
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    text = "\n\n".join(topics[k] for k in sorted(topics))
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.train_from_iterator([text], trainers.BpeTrainer(
        vocab_size=VOCAB, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    ids = np.asarray(tokenizer.encode(text).ids, np.int32)
    rows = ids[:len(ids) // (seq + 1) * (seq + 1)].reshape(-1, seq + 1)
    return rows[:-EVAL_WINDOWS], rows[-EVAL_WINDOWS:]


def step_rows(n: int, batch: int, steps: int) -> np.ndarray:
    """(steps, batch): the rows of every global batch, in redray's order."""
    per_epoch = n // batch
    out = []
    for step in range(steps):
        epoch, i = divmod(step, per_epoch)
        out.append(epoch_order(n, SEED, epoch)[i * batch:(i + 1) * batch])
    return np.stack(out)


def boundaries(n: int, batch: int, steps: int, window: int) -> list[int]:
    """Steps after which redray's fit logs a window: every ``window`` steps of an epoch
    and at the epoch's end."""
    per_epoch, out = n // batch, []
    for step in range(1, steps + 1):
        i = (step - 1) % per_epoch + 1
        if i % window == 0 or i == per_epoch or step == steps:
            out.append(step)
    return out




def run_torch(job: dict, folder: str, run: int) -> dict:
    """One PyTorch FSDP training run (2 processes); examples/s per window, eval loss."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    job = {**job, "port": port, "out": os.path.join(folder, f"torch-{run}.json")}
    path = os.path.join(folder, f"torch-job-{run}.json")
    with open(path, "w") as f:
        json.dump(job, f)
    script = os.path.join(HERE, "_torch_fsdp.py")
    procs = [subprocess.Popen([sys.executable, script, "train", path, str(rank)])
             for rank in range(job["world"])]
    codes = [p.wait() for p in procs]
    if any(codes):
        raise RuntimeError(f"PyTorch FSDP run failed (exit codes {codes})")
    with open(job["out"]) as f:
        out = json.load(f)
    ends = np.asarray(out["step_end_s"])
    marks = [out["start_s"]] + [ends[b - 1] for b in job["boundaries"]]
    sizes = np.diff([0] + job["boundaries"])
    rates = job["batch"] * sizes / np.diff(marks)
    return {"rates": rates[1:].tolist(), "eval_loss": out["eval_loss"]}


def run_redray(module, train, held_out, spec: dict, steps: int, window: int, folder: str,
               run: int) -> dict:
    """One redray.fit run on 2 hosts x 1 device, fsdp_axis=2."""
    per_epoch = len(train) // spec["batch"]
    result = redray.fit(
        module, collate, loss,
        optax.adamw(OPTIMIZER["lr"], eps=OPTIMIZER["eps"], weight_decay=OPTIMIZER["weight_decay"]),
        train_data=[{"ids": w} for w in train], eval_data=[{"ids": w} for w in held_out],
        batch_size=spec["batch"], epochs=math.ceil(steps / per_epoch), max_steps=steps,
        hosts=2, devices_per_host=1, fsdp_axis=2, seed=SEED, log_every=window,
        progress=False, checkpoint=False, tracking=False, name=f"redray-{run}",
        storage_path=folder)
    rows = [r for r in result.history if "examples_per_s" in r]
    evals = [r for r in result.history if "eval_loss" in r]
    return {"rates": [r["examples_per_s"] for r in rows[1:]], "eval_loss": evals[-1]["eval_loss"]}


def single_core(job_path: str, job: dict) -> dict:
    """ms per update of each framework's plain step on one core (see the docstring)."""
    pin = lambda: os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # noqa: E731
    out = {}
    for side, command in (("torch", [os.path.join(HERE, "_torch_fsdp.py"), "single"]),
                          ("redray", [os.path.abspath(__file__), "--single-redray"])):
        done = subprocess.run([sys.executable, *command, job_path], preexec_fn=pin,
                              capture_output=True, text=True, check=True)
        out[side] = json.loads(done.stdout.strip().splitlines()[-1])["ms"]
    return out


def single_redray(job_path: str) -> None:
    """redray's side of ``single_core``: a Trainer on one CPU device, same model and rows."""
    import jax
    import time

    with open(job_path) as f:
        job = json.load(f)
    per_process = job["batch"] // job["world"]
    trainer = redray.Trainer.of(from_pretrained(job["init"]), collate, loss, optax.adamw(
        job["lr"], eps=job["eps"], weight_decay=job["weight_decay"]), batch_size=per_process,
        mesh=redray.make_mesh(devices=jax.devices()[:1]), progress=False)
    batch = collate([{"ids": w} for w in np.load(job["train"])[:per_process]])
    trainer.init([{"ids": w} for w in batch["ids"]])
    times = []
    for _ in range(job["single_steps"]):
        start = time.perf_counter()
        jax.block_until_ready(trainer.train_step(batch))
        times.append(time.perf_counter() - start)
    print(json.dumps({"ms": 1000 * float(np.median(times[2:]))}))


def main(argv=None) -> None:
    ap = parser(__doc__)
    ap.add_argument("--steps", type=int, default=150, help="optimizer updates per run")
    ap.add_argument("--window", type=int, default=10, help="steps per timed window")
    ap.add_argument("--rounds", type=int, default=2, help="runs per framework, alternating")
    ap.add_argument("--threads", type=int, default=2,
                    help="torch.set_num_threads in each PyTorch process")
    ap.add_argument("--single-redray", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.single_redray:
        return single_redray(args.single_redray)
    spec = TINY if args.tiny else FULL
    if args.tiny:
        args.steps, args.window, args.rounds = 4, 2, 1
    train, held_out = windows(spec["seq"])
    if args.tiny:
        held_out = held_out[:2 * spec["batch"]]
    config = dict(n_layer=spec["n_layer"], n_embd=spec["n_embd"], n_head=spec["n_head"],
                  vocab_size=VOCAB, n_positions=spec["seq"], resid_pdrop=0.0, embd_pdrop=0.0,
                  attn_pdrop=0.0, bos_token_id=None, eos_token_id=None)
    ray.init(address="local", num_cpus=max(os.cpu_count() or 1, 2), include_dashboard=False,
             log_to_driver=False)
    results = {"redray": [], "torch": []}
    try:
        with tempfile.TemporaryDirectory() as folder:
            job = {"config": config, "seed": SEED, "init": os.path.join(folder, "init"),
                   "train": os.path.join(folder, "train.npy"),
                   "eval": os.path.join(folder, "eval.npy"),
                   "order": os.path.join(folder, "order.npy"), "world": 2,
                   "threads": args.threads, "batch": spec["batch"],
                   "boundaries": boundaries(len(train), spec["batch"], args.steps, args.window),
                   **OPTIMIZER}
            np.save(job["train"], train)
            np.save(job["eval"], held_out)
            np.save(job["order"], step_rows(len(train), spec["batch"], args.steps))
            init_path = os.path.join(folder, "init-job.json")
            with open(init_path, "w") as f:
                json.dump(job, f)
            subprocess.run([sys.executable, os.path.join(HERE, "_torch_fsdp.py"), "init",
                            init_path], check=True)
            job["single_steps"] = 5 if args.tiny else 30
            with open(init_path, "w") as f:
                json.dump(job, f)
            kernels = single_core(init_path, job)
            module = from_pretrained(job["init"])
            for r in range(args.rounds):
                results["torch"].append(run_torch(job, folder, r))
                results["redray"].append(run_redray(module, train, held_out, spec, args.steps,
                                                    args.window, folder, r))
    finally:
        ray.shutdown()
    median = {k: [statistics.median(run["rates"]) for run in v] for k, v in results.items()}
    ratio = statistics.median(median["redray"]) / statistics.median(median["torch"])
    perplexity = {k: math.exp(v[-1]["eval_loss"]) for k, v in results.items()}
    setting = (f"GPT-2 {spec['n_layer']} layers x {spec['n_embd']} hidden, vocab {VOCAB}, "
               f"batch {spec['batch']} x {spec['seq']}, {args.steps} steps")
    detail = dict(setting=setting, steps=args.steps, window=args.window, rounds=args.rounds,
                  torch_threads=args.threads,
                  single_core={"step_ms": kernels, "redray_speed_over_torch":
                               kernels["torch"] / kernels["redray"]})
    save([
        figure("fsdp_torch/throughput", ratio, "x",
               f"PyTorch 2.13 FSDP2, 2 processes over gloo; {setting}", ">= 1.0", COMMAND,
               examples_per_s={k: stats(v) for k, v in median.items()},
               windows={k: stats([x for run in v for x in run["rates"]])
                        for k, v in results.items()},
               **detail),
        figure("fsdp_torch/perplexity", max(perplexity.values()) / min(perplexity.values()), "x",
               f"the smaller of the two held-out perplexities; {setting}", "<= 1.02", COMMAND,
               perplexity=perplexity,
               eval_losses={k: [run["eval_loss"] for run in v] for k, v in results.items()},
               **detail),
    ], args.out)


if __name__ == "__main__":
    main()
