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

The same processes then write the model as a run's Orbax checkpoint (the Trainer's
``model`` item, float32, with the chunks ``redray.checkpoint.save_args`` chooses), and
one process runs ``redray export RUN --to OUT`` on it, as a user would after training:
the checkpoint is read a tensor (a layer) at a time, no model is built. Measured the
same way:

* ``export/orbax_peak_over_largest_tensor`` (target <= 3): that process's peak growth
  during the export over the largest tensor written (measured after its imports:
  Orbax, TensorStore, JAX's runtime and its first compile, transformers' config
  reader, which a process that trained holds already, and which do not grow with the
  model; the resident memory they make is in ``imports``);
* ``export/orbax_seconds_32_over_8_layers``: linear in the layers, as above;
* ``export/orbax_files_equal_live``: 1 when its files are byte for byte the live save's.

    python benchmarks/export.py            # the two models
    python benchmarks/export.py --tiny     # 2 and 4 layers of a tiny model: checks the script
"""

from __future__ import annotations

import filecmp
import json
import os
import shutil
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import figure, parser, save  # noqa: E402
from load import (FULL, TINY, hf_logits, memory, on_processes, peak_reset,  # noqa: E402
                  write_checkpoint)

PROCESSES, FSDP = 4, 4


def worker(folder: str, out: str, run: str, address: str, world: int, rank: int) -> None:
    """One process of an export: loads its shards, saves, prints what it measured; then
    writes the model as ``run``'s Orbax checkpoint."""
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
    from flax import nnx

    from redray.checkpoint import CheckpointConfig, Checkpointer
    from redray.engine.state import CHECKPOINT_ITEMS, MODEL_ITEM

    from redray.sharding import flatten

    _, params, extra = nnx.split(model, nnx.Param, ...)
    writer = Checkpointer(CheckpointConfig(directory=os.path.join(run, "checkpoints")),
                          CHECKPOINT_ITEMS)
    # the stacked layers' arrays, as the Trainer's trace finds them
    paths, leaves, _ = flatten(params)
    stacked = {p: leaf.shape[0] for p, leaf in zip(paths, leaves) if p.startswith("layers/")}
    writer.save({MODEL_ITEM: {"params": params, "extra": extra}}, {"step": 1}, stacked=stacked)
    writer.close()
    jax.distributed.shutdown()


def cli_worker(run: str, out: str) -> None:
    """``redray export RUN --to OUT`` in this process, measured after its imports."""
    import jax

    from redray.cli import main
    from redray.models import load_config

    import orbax.checkpoint  # noqa: F401 - what the export imports, imported before
    import tensorstore  # noqa: F401

    from transformers import GenerationConfig  # noqa: F401

    import redray.commands.runs  # noqa: F401
    import redray.engine.load  # noqa: F401
    import redray.models.hub  # noqa: F401

    jax.random.key(0)  # the runtime's first compile (about 44 MB, whatever the model)
    load_config(os.path.join(run, "config.json"))  # transformers' config reader: imported
    fixed = memory("VmRSS")
    before = peak_reset()
    start = time.perf_counter()
    assert main(["export", run, "--to", out]) == 0
    print("EXPORT " + json.dumps({"grew": memory("VmHWM") - before, "imports": fixed,
                                  "seconds": time.perf_counter() - start}), flush=True)


def export_from_orbax(run: str, out: str) -> dict:
    """One process's measures of ``redray export`` from ``run``'s checkpoint."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, __file__, "--cli", run, out], env=env,
                          capture_output=True, text=True, timeout=1800)
    if done.returncode:
        raise RuntimeError(f"redray export failed:\n{done.stderr[-3000:]}")
    return next(json.loads(line[len("EXPORT "):]) for line in done.stdout.splitlines()
                if line.startswith("EXPORT "))


def export_on(folder: str, out: str, run: str) -> list[dict]:
    """Every process's measures of one export from ``PROCESSES`` x 1 device."""
    return on_processes(__file__, [folder, out, run], PROCESSES, 1, "SAVE ")


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
    runs, gaps, largest, stored, orbax, equal = {}, {}, {}, {}, {}, {}
    for n in layers:
        with tempfile.TemporaryDirectory() as folder:
            files = write_checkpoint(folder, {**sizes, "num_hidden_layers": n})
            stored[n] = sum(os.path.getsize(f) for f in files)
            out, run = os.path.join(folder, "export"), os.path.join(folder, "run")
            os.makedirs(run)
            shutil.copy(os.path.join(folder, "config.json"), run)
            runs[n] = export_on(folder, out, run)
            largest[n] = largest_tensor(out)
            theirs, ours = hf_logits(folder), hf_logits(out)
            gaps[n] = float(np.abs(ours - theirs).max() / np.abs(theirs).max())
            files = os.path.join(folder, "from-orbax")
            orbax[n] = export_from_orbax(run, files)
            names = sorted(os.listdir(out))
            equal[n] = sorted(os.listdir(files)) == names and \
                filecmp.cmpfiles(out, files, names, shallow=False)[0] == names
    ratios = {n: max(r["grew"] for r in rs) / largest[n] for n, rs in runs.items()}
    seconds = {n: max(r["seconds"] for r in rs) for n, rs in runs.items()}
    worst, farthest = max(ratios, key=ratios.get), max(gaps, key=gaps.get)
    small, big = layers
    from_files = {n: orbax[n]["grew"] / largest[n] for n in layers}
    detail = {f"{n} layers": {"stored_bytes": stored[n], "largest_tensor": largest[n],
                              "peak_over_largest_tensor": ratios[n], "seconds": seconds[n],
                              "logits_gap": gaps[n], "processes": runs[n],
                              "orbax": {**orbax[n], "peak_over_largest_tensor": from_files[n],
                                        "files_equal_live": equal[n]}} for n in layers}
    heaviest = max(from_files, key=from_files.get)
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
               "layers)", "<= 0.001", command),
        figure("export/orbax_peak_over_largest_tensor", from_files[heaviest], "x",
               "the largest tensor written (bfloat16), by redray export from the run's "
               f"Orbax checkpoint (float32) in one process ({heaviest} layers)", "<= 3",
               command),
        figure("export/orbax_seconds_32_over_8_layers",
               orbax[big]["seconds"] / orbax[small]["seconds"], "x",
               f"the {small}-layer run's redray export (bytes: "
               f"{stored[big] / stored[small]:.2f}x)", None, command),
        figure("export/orbax_files_equal_live", float(all(equal.values())), "(1: equal, 0: not)",
               "the files of save_pretrained from the 4 processes, byte for byte (both "
               "models)", ">= 1", command)]
    save(figures, args.out)
    for f in figures:
        print(f"{f['name']}: {f['value']:.4g} {f['unit']}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(*sys.argv[2:6], int(sys.argv[6]), int(sys.argv[7]))
    elif sys.argv[1:2] == ["--cli"]:
        cli_worker(sys.argv[2], sys.argv[3])
    else:
        main()
