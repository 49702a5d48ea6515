"""Chat fine-tuning throughput against TRL: non-padding tokens per second of redray's
training on conversations over TRL's ``SFTTrainer``, the same model, data and batch.

Both train the tiny Qwen3-shaped checkpoint of ``examples/chat_sft`` (hidden 64, 2
layers, GPT-2's BPE with ChatML's turn tokens: 50,259 tokens, float32) on the
example's conversations (``examples/chat_sft/conversations.jsonl``, rendered with Qwen
2.5's ChatML template as TRL ships it, the loss on the assistant's tokens only), on one process
of this CPU, batches of 8 rows of 256 tokens, AdamW at 1e-3:

- TRL 1.16: ``SFTTrainer(assistant_only_loss=True, packing=True, packing_strategy="bfd")``
  (best-fit-decreasing packing, and its padding-free collator: a batch's rows are one
  row of their real tokens with position ids), ``per_device_train_batch_size=8``,
  ``max_length=256``;
- redray: the example's rows (``redray.data.chat.transform``, then
  ``redray.data.prepare(pack=256)``: rows of 256 tokens with segment ids and the loss
  mask, padded at their ends) through ``redray.Trainer`` on this process's one device
  (what ``redray.fit`` runs on its one host), the example's ``collate`` and ``loss``.

Each side trains ``--steps`` optimizer updates after one warm-up update (JAX compiles
there; PyTorch warms its allocator), timed alone; rounds alternate which side runs
first. A side's figure is the non-padding tokens of the batches it trained on over
the seconds of those updates (a batch's non-padding tokens are its conversations'
tokens: the same data, so each side is credited for the tokens it trained on, whatever
its padding).

Figures: ``chat_sft/tokens_per_s_over_trl`` (median over rounds of redray's
tokens per second over TRL's, spread reported; target >= 1.0), with each side's
masked-token fraction (assistant tokens among the non-padding ones) and padding
fraction (padding among all the tokens of its batches) in the detail.

    python benchmarks/chat_sft.py [--rounds 3] [--steps 24] [--tiny]
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np
from common import ROOT, example_module, figure, machine, parser, save

COMMAND = "python benchmarks/chat_sft.py"
SEQ, BATCH, LR = 256, 8, 1e-3


def conversations() -> list[dict]:
    with open(os.path.join(ROOT, "examples", "chat_sft", "conversations.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def checkpoint(folder: str) -> str:
    """The example's tiny checkpoint with Qwen 2.5's ChatML template (TRL's shipped copy,
    which its ``assistant_only_loss`` swaps for its training variant; redray masks the
    same turns)."""
    import trl
    from transformers import AutoTokenizer

    example_module("chat_sft").tiny_checkpoint(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    with open(os.path.join(os.path.dirname(trl.__file__), "chat_templates", "qwen2_5.jinja")) as f:
        tokenizer.chat_template = f.read()
    tokenizer.save_pretrained(folder)
    return folder


def trl_side(folder: str, out: str):
    """A function training ``steps`` updates with TRL: (seconds, token counts)."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    data = Dataset.from_list(conversations())

    def make(steps: int):
        args = SFTConfig(output_dir=out, max_length=SEQ, packing=True, packing_strategy="bfd",
                         assistant_only_loss=True, per_device_train_batch_size=BATCH,
                         learning_rate=LR, lr_scheduler_type="constant", weight_decay=0.0,
                         max_steps=steps, use_cpu=True, report_to=[], save_strategy="no",
                         logging_steps=10**6, disable_tqdm=True, dataloader_num_workers=0,
                         seed=0)
        return SFTTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer)

    def counts(trainer, steps: int) -> dict:
        """The tokens of the batches ``steps`` updates train on, as its loader gives them."""
        total = real = masked = 0
        loader = iter([])
        for _ in range(steps):
            batch = next(loader, None)
            if batch is None:
                loader = iter(trainer.get_train_dataloader())
                batch = next(loader)
            ids = batch["input_ids"]
            pad = batch["attention_mask"] == 0 if "attention_mask" in batch \
                else torch.zeros_like(ids, dtype=torch.bool)
            total += ids.numel()
            real += int((~pad).sum())
            masked += int((batch["labels"] != -100).sum())
        return {"tokens": real, "all": total, "masked": masked}

    make(1).train()  # warm-up

    def run(steps: int):
        trainer = make(steps)
        start = time.perf_counter()
        trainer.train()
        return time.perf_counter() - start, counts(make(steps), steps)
    return run


def redray_side(folder: str, out: str):
    """A function training ``steps`` updates with redray: (seconds, token counts)."""
    import optax
    import pyarrow.parquet as pq

    import redray
    from redray.data import chat
    from redray.models import from_pretrained
    from transformers import AutoTokenizer

    ex = example_module("chat_sft")
    done = redray.data.prepare(conversations(), out, pack=SEQ,
                               transform=chat.transform(AutoTokenizer.from_pretrained(folder),
                                                        max_length=SEQ))
    table = pq.read_table(out).to_pylist()
    rows = [{k: np.asarray(r[k], np.int32) for k in ("ids", "segment_ids", "loss_mask")}
            for r in table]
    model = from_pretrained(folder)
    trainer = redray.Trainer.of(model, ex.collate, ex.loss, optax.adamw(LR, weight_decay=0.0),
                             batch_size=BATCH, log_every=10**6, progress=False, seed=0)
    trainer.fit(rows, epochs=10**6, max_steps=1, shuffle=False)  # warm-up: compiles

    def run(steps: int):
        first = trainer.step
        start = time.perf_counter()
        trainer.fit(rows, epochs=10**6, max_steps=first + steps, shuffle=False)
        seconds = time.perf_counter() - start
        return seconds, counts(first, steps)

    def counts(first: int, steps: int) -> dict:  # the batches of those updates, in order
        per_epoch = len(rows) // BATCH  # the Trainer drops a last partial batch
        taken = [rows[(s % per_epoch) * BATCH + i] for s in range(first, first + steps)
                 for i in range(BATCH)]
        return {"tokens": int(sum((r["segment_ids"] > 0).sum() for r in taken)),
                "all": SEQ * len(taken),
                "masked": int(sum(r["loss_mask"].sum() for r in taken))}
    print(f"redray: {done.documents} conversations in {len(rows)} rows of {SEQ} tokens",
          file=sys.stderr)
    return run


def fractions(c: dict) -> dict:
    return {"masked_fraction": c["masked"] / c["tokens"],
            "padding_fraction": 1 - c["tokens"] / c["all"]}


def main(argv=None):
    ap = parser(__doc__)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=24, help="timed updates per side per round")
    args = ap.parse_args(argv)
    rounds, steps = (1, 2) if args.tiny else (args.rounds, args.steps)
    with tempfile.TemporaryDirectory() as tmp:
        folder = checkpoint(os.path.join(tmp, "model"))
        sides = {"trl": trl_side(folder, os.path.join(tmp, "trl")),
                 "redray": redray_side(folder, os.path.join(tmp, "rows"))}
        rates, counted = {"trl": [], "redray": []}, {}
        for r in range(rounds):
            for name in (("trl", "redray") if r % 2 == 0 else ("redray", "trl")):
                seconds, c = sides[name](steps)
                rates[name].append(c["tokens"] / seconds)
                counted[name] = c
                print(f"round {r} {name}: {c['tokens'] / seconds:,.0f} tokens/s "
                      f"({seconds:.2f} s, {fractions(c)})", file=sys.stderr)
    ratios = [a / b for a, b in zip(rates["redray"], rates["trl"])]
    fig = figure("chat_sft/tokens_per_s_over_trl", statistics.median(ratios), "x",
                 "TRL 1.16 SFTTrainer (packing bfd, padding-free, assistant_only_loss) on the "
                 "same model, conversations and batch, one CPU process", ">= 1.0",
                 f"{COMMAND} --rounds {rounds} --steps {steps}",
                 spread=[min(ratios), max(ratios)], per_round=ratios, steps=steps,
                 tokens_per_s={k: [round(v) for v in rates[k]] for k in rates},
                 **{f"{k}_{f}": round(v, 4) for k in counted
                    for f, v in fractions(counted[k]).items()},
                 machine=machine())
    save([fig], args.out)


if __name__ == "__main__":
    main()
