"""Checkpoint export: what a process holds while it writes a model spread over four
processes as a Hugging Face checkpoint, over the largest tensor it writes.

The LLaMA-shaped bfloat16 checkpoint of ``load.py`` (hidden 1024, 16 heads, intermediate
2816, vocabulary 32,000), with 8 layers and with 32, is loaded with ``fsdp_axis=4`` on 4
``jax.distributed`` processes x 1 CPU device (gloo) and written back with
``redray.models.save_pretrained(model, folder)`` (every process calls it; each tensor is
gathered in turn and process 0 writes it; bfloat16, the checkpoint's dtype). Measured:

* ``export/peak_over_largest_tensor`` (target <= 3): each process's peak resident memory
  growth during the save (``VmHWM`` after, less ``VmRSS`` before, the peak reset
  there) over the bytes of the largest tensor written (the embedding, 65.5 MB in
  bfloat16); the worst process of both models;
* ``export/seconds_32_over_8_layers``: the 32-layer model's save time over the 8-layer
  one's (linear in the layers: about their bytes' ratio, 2.83; a save that fetched a
  whole stacked array per layer would be about 4x that);
* ``export/logits_vs_transformers`` (target <= 0.001): transformers' logits of the
  export over those of the checkpoint it came from, max |difference| over max |logit|
  (bfloat16 -> float32 -> bfloat16 loses nothing: 0 expected).

Not measured here: an export from an Orbax checkpoint without building the model (not
built yet; ``redray export`` builds the model on the driver).

    python benchmarks/export.py            # the two models
    python benchmarks/export.py --tiny     # 2 and 4 layers of a tiny model: checks the script
"""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import figure, parser, save  # noqa: E402
from load import (FULL, TINY, hf_logits, memory, on_processes, peak_reset,  # noqa: E402
                  write_checkpoint)

PROCESSES, FSDP = 4, 4


def worker(folder: str, out: str, address: str, world: int, rank: int) -> None:
    """One process of an export: loads its shards, saves, prints what it measured."""
    import jax

    from redray import Parallelism
    from redray.models import from_pretrained, save_pretrained
    from redray.processes.jax_runtime import join_jax

    join_jax(address, world, rank)
    model = from_pretrained(folder, parallelism=Parallelism.of(fsdp_axis=FSDP))
    jax.block_until_ready(jax.tree.leaves(model))
    before = peak_reset()
    start = time.perf_counter()
    save_pretrained(model, out)
    seconds = time.perf_counter() - start
    print("SAVE " + json.dumps({"rank": rank, "grew": memory("VmHWM") - before,
                                "seconds": seconds}), flush=True)
    jax.distributed.shutdown()


def export_on(folder: str, out: str) -> list[dict]:
    """Every process's measures of one export from ``PROCESSES`` x 1 device."""
    return on_processes(__file__, [folder, out], PROCESSES, 1, "SAVE ")


def largest_tensor(folder: str) -> int:
    """The bytes of the largest tensor in a folder's safetensors files."""
    from redray.models import slices

    return max(s.nbytes for f in os.listdir(folder) if f.endswith(".safetensors")
               for s in slices.read_header(os.path.join(folder, f)).values())


def main(argv=None) -> None:
    import tempfile

    import numpy as np

    args = parser(__doc__).parse_args(argv)
    layers = (2, 4) if args.tiny else (8, 32)
    sizes = TINY if args.tiny else FULL
    runs, gaps, largest, stored = {}, {}, {}, {}
    for n in layers:
        with tempfile.TemporaryDirectory() as folder:
            files = write_checkpoint(folder, {**sizes, "num_hidden_layers": n})
            stored[n] = sum(os.path.getsize(f) for f in files)
            out = os.path.join(folder, "export")
            runs[n] = export_on(folder, out)
            largest[n] = largest_tensor(out)
            theirs, ours = hf_logits(folder), hf_logits(out)
            gaps[n] = float(np.abs(ours - theirs).max() / np.abs(theirs).max())
    ratios = {n: max(r["grew"] for r in rs) / largest[n] for n, rs in runs.items()}
    seconds = {n: max(r["seconds"] for r in rs) for n, rs in runs.items()}
    worst, farthest = max(ratios, key=ratios.get), max(gaps, key=gaps.get)
    small, big = layers
    detail = {f"{n} layers": {"stored_bytes": stored[n], "largest_tensor": largest[n],
                              "peak_over_largest_tensor": ratios[n], "seconds": seconds[n],
                              "logits_gap": gaps[n], "processes": runs[n]} for n in layers}
    command = "python benchmarks/export.py"
    figures = [
        figure("export/peak_over_largest_tensor", ratios[worst], "x",
               f"the largest tensor written (bfloat16), saved from {PROCESSES} processes "
               f"(fsdp {FSDP}); the worst process ({worst} layers)", "<= 3", command, **detail),
        figure("export/seconds_32_over_8_layers", seconds[big] / seconds[small], "x",
               f"the {small}-layer model's save; their bytes' ratio is "
               f"{stored[big] / stored[small]:.2f} (linear)", None, command),
        figure("export/logits_vs_transformers", gaps[farthest], "of the largest logit",
               f"transformers' logits of the checkpoint the export came from ({farthest} "
               "layers)", "<= 0.001", command)]
    save(figures, args.out)
    for f in figures:
        print(f"{f['name']}: {f['value']:.4g} {f['unit']}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]), int(sys.argv[6]))
    else:
        main()
