"""Checkpoint loading: what a host holds while it loads a Hugging Face checkpoint, over
the bytes of the shards it keeps.

Two LLaMA-shaped checkpoints written by ``transformers`` in bfloat16 (4 safetensors files
each): ``base`` (hidden 1024, 8 layers, 16 heads, intermediate 2816, vocabulary 32,000:
about 336 MB) and ``large``, about 4x (hidden 2048, 11 layers, intermediate 5632: 1.39
GB), are loaded with ``redray.models.from_pretrained(folder,
parallelism=redray.Parallelism.of(fsdp_axis=4))`` on ``jax.distributed`` processes of
this machine (gloo), in two settings: 2 processes x 2 CPU devices, and 4 x 1. Each
process measures:

* ``load/peak_over_own_shards`` (target <= 1.3): the growth of its peak resident memory
  during the load (``VmHWM`` after, less ``VmRSS`` before, the peak reset there) over
  the bytes of the shards it keeps (its devices' shards of every parameter, in the
  dtype it keeps them: float32);
  the figure is the largest over processes, settings and checkpoints, each in
  ``detail``. What a process pays once whatever it loads is paid before the baseline
  and reported apart (``fixed``: the runtime's first compile, and ``transformers``'
  config reader, which imports torch: about 300 MB);
* ``load/seconds_over_disk_read``: the load's time (the slowest process) over reading
  the same files with ``cat`` (the page cache warm on both sides: the files are read
  once before either is timed); the worst setting;
* ``load/logits_vs_transformers`` (target <= 0.001): after the load, the sharded model's
  logits on two rows of 16 tokens against ``transformers``' (float32, on the same
  files), max |difference| over max |logit|, the worst setting.

A load that reads every tensor whole on every host, converts it to float32 and holds a
stacked parameter's layers until all are read costs about the whole model per host,
whatever the host count: this script on the code before slice-wise loading (``207eef4``)
gave 3.99 and 7.11 (base, 2 x 2 and 4 x 1) and 4.58 and 8.34 (large). (The figures
first recorded for it, 3.44 and 2.15, read ``ru_maxrss``, which a child inherits from
its parent across ``exec``, and so read low.)

    python benchmarks/load.py            # the settings above
    python benchmarks/load.py --tiny     # a 2-layer model, 2 x 2 only: checks the script
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import figure, parser, save  # noqa: E402

FULL = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
            num_attention_heads=16, num_key_value_heads=16, vocab_size=32000)
LARGE = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=11,
             num_attention_heads=16, num_key_value_heads=16, vocab_size=32000)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=4, vocab_size=256)
SETTINGS = ((2, 2), (4, 1))  # (processes, CPU devices each)
FSDP = 4
IDS = [[(7 * i + 3 * j) % 250 + 1 for j in range(16)] for i in range(2)]


def write_checkpoint(folder: str, sizes: dict, files: int = 4) -> list[str]:
    """A random LLaMA of ``sizes`` saved by ``transformers`` in bfloat16 in about
    ``files`` safetensors files; returns their paths."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**sizes, tie_word_embeddings=False, torch_dtype="bfloat16")
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    model.save_pretrained(folder, max_shard_size=max(total // files + 1, 1 << 16))
    return sorted(os.path.join(folder, f) for f in os.listdir(folder)
                  if f.endswith(".safetensors"))


def memory(field: str) -> int:
    """A field of /proc/self/status in bytes (VmRSS: resident now; VmHWM: the peak)."""
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def peak_reset() -> int:
    """Resets this process's peak resident memory to what it holds now, and returns
    that. ``ru_maxrss`` cannot serve: it keeps the peak of the process before ``exec``
    (the parent's, which held transformers' model), so a child's growth reads 0."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return memory("VmRSS")


def worker(folder: str, address: str, world: int, rank: int) -> None:
    """One process of a load: joins the runtime, loads, prints what it measured; then
    computes the logits of ``IDS`` (process 0 writes them to ``folder``)."""
    import jax

    from redray import Parallelism
    from redray.models import from_pretrained, load_config
    from redray.processes.jax_runtime import join_jax

    join_jax(address, world, rank)
    start_rss = memory("VmRSS")
    # What every process pays once, whatever it loads, before the baseline: the runtime's
    # first compile, and transformers' config reader (which imports torch).
    jax.jit(lambda key: jax.random.fold_in(key, 1))(jax.random.key(0)).block_until_ready()
    load_config(folder)
    before = peak_reset()
    start = time.perf_counter()
    model = from_pretrained(folder, parallelism=Parallelism.of(fsdp_axis=FSDP))
    from flax import nnx

    leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
    jax.block_until_ready(leaves)
    seconds = time.perf_counter() - start
    after = memory("VmHWM")
    own = sum(s.data.nbytes for leaf in leaves for s in leaf.addressable_shards)
    print("LOAD " + json.dumps({"rank": rank, "grew": after - before, "own": own,
                                "seconds": seconds, "fixed": before - start_rss}), flush=True)
    import numpy as np
    from jax.experimental import multihost_utils

    logits = nnx.jit(lambda m, ids: m(ids))(model, jax.numpy.asarray(IDS))
    logits = multihost_utils.process_allgather(logits, tiled=True)
    if rank == 0:
        np.save(os.path.join(folder, f"logits-{world}.npy"), np.asarray(logits))
    jax.distributed.shutdown()


def hf_logits(folder: str):
    """transformers' float32 logits of ``IDS`` for the checkpoint in ``folder``."""
    import torch
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor(IDS)).logits.numpy()


def logits_gap(folder: str, processes: int, reference) -> float:
    """max |redray's logits - transformers'| over max |transformers'|."""
    import numpy as np

    ours = np.load(os.path.join(folder, f"logits-{processes}.npy"))
    return float(np.abs(ours - reference).max() / np.abs(reference).max())


def on_processes(script: str, args: list[str], processes: int, devices: int,
                 tag: str) -> list[dict]:
    """Runs ``script --worker ARGS ADDRESS WORLD RANK`` on ``processes`` x ``devices``
    CPU devices (one ``jax.distributed`` runtime) and returns the JSON of every line
    each process printed after ``tag``."""
    from redray.processes.jax_runtime import served_at

    address = served_at("127.0.0.1")
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
    procs = [subprocess.Popen([sys.executable, script, "--worker", *args, address,
                               str(processes), str(rank)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
             for rank in range(processes)]
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=1800)
        if p.returncode:
            raise RuntimeError(f"a {os.path.basename(script)} process failed:\n{stderr[-3000:]}")
        out += [json.loads(line[len(tag):]) for line in stdout.splitlines()
                if line.startswith(tag)]
    return out


def load_on(folder: str, processes: int, devices: int) -> list[dict]:
    """Every process's measures of one load on ``processes`` x ``devices``."""
    return on_processes(__file__, [folder], processes, devices, "LOAD ")


def disk_read(files: list[str]) -> float:
    """Seconds to read ``files`` with ``cat`` into a pipe (the best of 3; into
    /dev/null, cat may not read them at all)."""
    import shlex

    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        subprocess.run(["bash", "-c", f"cat {shlex.join(files)} | wc -c"],
                       stdout=subprocess.DEVNULL, check=True)
        best = min(best, time.perf_counter() - start)
    return best


def main(argv=None) -> None:
    import tempfile

    args = parser(__doc__).parse_args(argv)
    checkpoints = {"tiny": TINY} if args.tiny else {"base": FULL, "large": LARGE}
    settings = SETTINGS[:1] if args.tiny else SETTINGS
    runs, cats, gaps, stored = {}, {}, {}, {}
    for which, sizes in checkpoints.items():
        with tempfile.TemporaryDirectory() as folder:
            files = write_checkpoint(folder, sizes)
            stored[which] = (sum(os.path.getsize(f) for f in files), len(files))
            reference = hf_logits(folder)
            cats[which] = disk_read(files)  # warms the page cache too
            for p, d in settings:
                key = f"{which} {p}x{d}"
                runs[key] = load_on(folder, p, d)
                gaps[key] = logits_gap(folder, p, reference)
    ratios = {k: max(r["grew"] / r["own"] for r in rs) for k, rs in runs.items()}
    over_cat = {k: max(r["seconds"] for r in rs) / cats[k.split()[0]] for k, rs in runs.items()}
    worst = max(ratios, key=ratios.get)
    slowest = max(over_cat, key=over_cat.get)
    farthest = max(gaps, key=gaps.get)
    detail = {"checkpoints": {k: {"stored_bytes": b, "files": n, "cat_seconds": cats[k]}
                              for k, (b, n) in stored.items()},
              "settings": {k: {"peak_over_own_shards": ratios[k], "seconds_over_cat": over_cat[k],
                               "logits_gap": gaps[k], "processes": rs} for k, rs in runs.items()}}
    command = "python benchmarks/load.py"
    figures = [
        figure("load/peak_over_own_shards", ratios[worst], "x",
               f"the shards a process keeps (float32), fsdp {FSDP}; the worst of "
               f"{', '.join(ratios)} (checkpoint, processes x devices): {worst}", "<= 1.3",
               command, **detail),
        figure("load/seconds_over_disk_read", over_cat[slowest], "x",
               f"cat of the same files, page cache warm; the slowest load ({slowest})", None,
               command),
        figure("load/logits_vs_transformers", gaps[farthest], "of the largest logit",
               f"transformers' float32 logits on the same files; the farthest ({farthest})",
               "<= 0.001", command)]
    save(figures, args.out)
    for f in figures:
        print(f"{f['name']}: {f['value']:.4g} {f['unit']}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
    else:
        main()
