"""Communication: bytes of the collectives in the compiled training step, over the ideal.

For tiny GPT-2, LLaMA, OPT, GPT-J and T5 models (fp32, 2 layers, hidden 256, 4 heads,
intermediate 1024, vocabulary 1024, batch 8 x sequence 128, Adam; causal-LM
cross-entropy, T5 a seq2seq cross-entropy with 2 encoder + 2 decoder layers and
encoder and decoder sequences of 128) on 4 simulated CPU devices, mesh model=4 (data 1),
redray's real training step (``redray.Trainer`` with the family's ``redray.models``
model, ``model_axis=4``) is compiled and every collective of ``compiled.as_text()`` is
counted (``redray.sharding.collectives``: all-reduce, all-gather, reduce-scatter,
all-to-all, collective-permute; an all-gather counts its gathered size, a tuple
all-reduce every operand). Beside it, in the same run, the same step is compiled with
the specs redco 0.4.23's rules give the same parameter tree (redco's
``get_sharding_rules`` + ``get_params_spec``, run in redco's own venv by
``benchmarks/_redco_rules.py``; redray places the state and Adam's moments as those
specs say). Both are divided by the Megatron-LM ideal for tensor parallelism.

The ideal, in bytes, with A = B*S*H*4 the bytes of one fp32 activation (batch B,
sequence S, hidden H):

* decoder-only (GPT-2, LLaMA, OPT, GPT-J), L layers:
  ``(4L + 2) * A + 3 * B*S*4 + 4``: per layer 2 all-reduces forward (after the attention
  output projection and after the MLP's row layer) and 2 backward (the input gradients
  of the column layers QKV and MLP-in, each one partial sum); 1 forward all-reduce for
  the vocabulary-parallel embedding lookup, 1 backward for the input gradient of the
  vocabulary-parallel LM head; 3 of B*S floats for the vocabulary-parallel
  cross-entropy (max, sum of exponentials, the label's logit); 1 scalar (the loss or the
  gradient norm).
* T5, L_e encoder and L_d decoder layers, encoder length S_e, decoder length S_d,
  A_e = B*S_e*H*4, A_d = B*S_d*H*4:
  ``(4 L_e + 1 + L_d) * A_e + (6 L_d + 2) * A_d + 3 * B*S_d*4 + 4``: the encoder's
  embedding lookup (1) and per encoder layer self-attention + MLP (2 forward, 2
  backward); per decoder layer self-attention (2), MLP (2) and cross-attention: 1
  forward after its output projection, 1 backward for the query's input gradient (A_d)
  and 1 backward for the keys' and values' input gradient, which lands on the encoder
  output (A_e); the decoder's embedding lookup and the LM head's input gradient (shared
  embedding, vocabulary-parallel) (2 A_d); the cross-entropy and the scalar as above.
  For L_e = L_d = L and S_e = S_d = S this is ``(11L + 3) * A + 3 * B*S*4 + 4``.

Figures: ``communication/<family>`` = redray bytes / ideal (target <= 1.1) and
``communication/<family>/redco`` = redco rules' bytes / ideal (a reference), with counts
and bytes per collective kind in ``detail``.

    python benchmarks/communication.py [--families gpt2 llama ...] [--no-redco]
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _lm import FAMILIES, FULL, TINY, Sizes, collate, config, loss, seq2seq_loss  # noqa: E402
from common import HERE, figure, parser, save, simulate_devices  # noqa: E402

simulate_devices(4)

import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import redray  # noqa: E402
from redray.models import build  # noqa: E402
from redray.sharding import flatten  # noqa: E402
from redray.sharding.collectives import collectives, summarize, total_bytes  # noqa: E402

MODEL_AXIS = 4
COMMAND = "python benchmarks/communication.py"


def examples(family: str, s: Sizes) -> list[dict]:
    rows = np.random.default_rng(0).integers(1, s.vocab, (s.batch, 2, s.seq + 1), np.int32)
    if family == "t5":
        return [{"input_ids": r[0, :-1], "labels": r[1, :-1]} for r in rows]
    return [{"ids": r[0]} for r in rows]


def ideal(family: str, s: Sizes) -> dict:
    """The Megatron-LM ideal (see the module docstring): bytes and the terms summed."""
    act = s.batch * s.seq * s.hidden * 4
    tokens = s.batch * s.seq * 4
    if family == "t5":
        terms = {"encoder activations (A_e)": 4 * s.layers + 1 + s.layers,
                 "decoder activations (A_d)": 6 * s.layers + 2}
    else:
        terms = {"activations (A)": 4 * s.layers + 2}
    total = sum(terms.values()) * act + 3 * tokens + 4
    return {"bytes": total, "activation_bytes": act, "activation_all_reduces": terms,
            "cross_entropy_bytes": 3 * tokens, "scalar_bytes": 4}


def trainer_for(family: str, s: Sizes, rules=()) -> redray.Trainer:
    c = config(family, s)
    loss_fn = seq2seq_loss if family == "t5" else loss
    return redray.Trainer(lambda rngs: build(c, rngs=rngs), collate, loss_fn, optax.adam(1e-3),
                          batch_size=s.batch, model_axis=MODEL_AXIS, rules=rules,
                          progress=False)


def step_collectives(trainer: redray.Trainer, data: list[dict]):
    """Collectives of the trainer's compiled training step on a batch of ``data``."""
    trainer.init(data)
    return collectives(trainer.compiled_step().as_text())


def redco_rules(trainer: redray.Trainer, redco_python: str) -> list[tuple[str, P]]:
    """One exact-path rule per parameter: the spec redco 0.4.23 gives it."""
    paths, leaves, _ = flatten(trainer.runtime.abstract[0])
    request = {"model_shards": MODEL_AXIS,
               "params": {p: list(leaf.shape) for p, leaf in zip(paths, leaves)}}
    # -P: benchmarks/ stays off the path, where benchmarks/redco.py would shadow redco
    done = subprocess.run([redco_python, "-P", os.path.join(HERE, "_redco_rules.py")],
                          input=json.dumps(request), capture_output=True, text=True, check=True)
    specs = json.loads(done.stdout)
    return [(f"^{re.escape(p)}$", P(*specs[p])) for p in paths]


def measure(family: str, s: Sizes, redco_python: str | None) -> list[dict]:
    data = examples(family, s)
    want = ideal(family, s)
    sizes = dataclasses.asdict(s)
    found = step_collectives(trainer_for(family, s), data)
    figures = [figure(f"communication/{family}", total_bytes(found) / want["bytes"], "x",
                      f"Megatron-LM ideal, {want['bytes']:,} B (model axis {MODEL_AXIS})",
                      "<= 1.1", COMMAND, bytes=total_bytes(found), ideal=want,
                      collectives=_nonzero(summarize(found)), sizes=sizes)]
    if redco_python is not None:
        base = trainer_for(family, s)
        found = step_collectives(trainer_for(family, s, redco_rules(base, redco_python)), data)
        figures.append(figure(
            f"communication/{family}/redco", total_bytes(found) / want["bytes"], "x",
            "Megatron-LM ideal; redco 0.4.23's rules on the same parameter tree and step",
            None, COMMAND, bytes=total_bytes(found), ideal_bytes=want["bytes"],
            collectives=_nonzero(summarize(found)), sizes=sizes))
    return figures


def _nonzero(summary: dict) -> dict:
    return {k: v for k, v in summary.items() if v["count"]}


def main(argv=None) -> None:
    ap = parser(__doc__)
    ap.add_argument("--families", nargs="*", choices=FAMILIES,
                    help="default: all (with --tiny: llama and t5, one of each kind)")
    ap.add_argument("--no-redco", action="store_true", help="skip redco's side")
    args = ap.parse_args(argv)
    sizes = TINY if args.tiny else FULL
    redco_python = None
    if not args.no_redco:
        from _redco_venv import VENV, python

        existing = os.path.join(VENV, "bin", "python")
        # a tiny run checks the script: it does not spend minutes creating redco's venv
        redco_python = (existing if os.path.exists(existing) else None) if args.tiny \
            else python()
    figures = []
    for family in args.families or (("llama", "t5") if args.tiny else FAMILIES):
        figures += measure(family, sizes, redco_python)
    save(figures, args.out)


if __name__ == "__main__":
    main()
