"""PyTorch's side of benchmarks/fsdp_torch.py: GPT-2 under FSDP2 on CPU over gloo.

Kept apart from the benchmark so that neither imports the other's framework.

    python benchmarks/_torch_fsdp.py init JOB.json          # writes the initial weights
    python benchmarks/_torch_fsdp.py train JOB.json RANK    # one of the processes
    python benchmarks/_torch_fsdp.py single JOB.json        # one process, no FSDP: ms/step

The job (JSON) names ``config`` (GPT2Config fields), ``seed``, ``init`` (a folder),
``train``/``eval`` (.npy windows of seq + 1 token ids), ``order`` (.npy, the global batch
rows of every step, as redray orders them), ``lr``, ``weight_decay``, ``eps``,
``world``, ``port``, ``threads`` and ``out``.
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.utils import logging

logging.disable_progress_bar()


def init(job: dict) -> None:
    """The model both sides start from, saved as a Hugging Face checkpoint."""
    torch.manual_seed(job["seed"])
    GPT2LMHeadModel(GPT2Config(**job["config"])).save_pretrained(job["init"])


def loss_of(model, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids[:, :-1]).logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def train(job: dict, rank: int) -> None:
    """Trains every step of ``order`` on this rank's half of each global batch, noting
    when each step ends, then evaluates; rank 0 writes the results."""
    torch.set_num_threads(job["threads"])
    world = job["world"]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{job['port']}", rank=rank,
                            world_size=world)
    model = GPT2LMHeadModel.from_pretrained(job["init"], dtype=torch.float32)
    model.train()
    for block in model.transformer.h:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=job["lr"], betas=(0.9, 0.999),
                            eps=job["eps"], weight_decay=job["weight_decay"])
    data = torch.from_numpy(np.load(job["train"]).astype(np.int64))
    order = np.load(job["order"])
    per_rank = order.shape[1] // world
    mine = order[:, rank * per_rank:(rank + 1) * per_rank]
    losses, ends, start = [], [], time.perf_counter()
    for rows in mine:
        opt.zero_grad(set_to_none=True)
        loss = loss_of(model, data[torch.from_numpy(rows)])
        loss.backward()
        opt.step()
        losses.append(loss.item())
        ends.append(time.perf_counter())
    eval_loss = evaluate(model, torch.from_numpy(np.load(job["eval"]).astype(np.int64)),
                         order.shape[1], rank, world)
    if rank == 0:
        with open(job["out"], "w") as f:
            json.dump({"start_s": start, "step_end_s": ends, "losses": losses,
                       "eval_loss": eval_loss,
                       "threads": torch.get_num_threads()}, f)
    # Both ranks reach the end before either tears gloo down: a rank that destroys its
    # group while its peer still talks to it aborts ("terminate called without an active
    # exception", seen 1 run in 3 on 2 cores).
    dist.barrier()
    dist.destroy_process_group()


@torch.no_grad()
def evaluate(model, windows: torch.Tensor, batch: int, rank: int, world: int) -> float:
    """Mean token cross-entropy over ``windows``; each rank computes its half of every
    batch (the sharded forward needs both ranks)."""
    model.eval()
    total = torch.zeros(2, dtype=torch.float64)
    per_rank = batch // world
    for start in range(0, len(windows), batch):
        chunk = windows[start:start + batch]
        mine = chunk[rank * per_rank:(rank + 1) * per_rank]
        tokens = mine.shape[0] * (mine.shape[1] - 1)
        total += torch.tensor([loss_of(model, mine).double().item() * tokens, tokens])
    dist.all_reduce(total)
    return float(total[0] / total[1])


def single(job: dict) -> None:
    """Median ms per update of the plain model (no FSDP, no collectives) on one
    process's share of a global batch, 1 thread: PyTorch's kernels alone. Prints JSON."""
    torch.set_num_threads(1)
    model = GPT2LMHeadModel.from_pretrained(job["init"], dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=job["lr"], eps=job["eps"],
                            weight_decay=job["weight_decay"])
    data = torch.from_numpy(np.load(job["train"]).astype(np.int64))
    rows = data[:job["batch"] // job["world"]]
    times = []
    for _ in range(job["single_steps"]):
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss_of(model, rows).backward()
        opt.step()
        times.append(time.perf_counter() - start)
    print(json.dumps({"ms": 1000 * float(np.median(times[2:]))}))


if __name__ == "__main__":
    with open(sys.argv[2]) as f:
        spec = json.load(f)
    if sys.argv[1] == "init":
        init(spec)
    elif sys.argv[1] == "single":
        single(spec)
    else:
        train(spec, int(sys.argv[3]))
