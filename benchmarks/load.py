"""Checkpoint loading: what a host holds while it loads a Hugging Face checkpoint, over
the bytes of the shards it keeps.

A LLaMA-shaped checkpoint written by ``transformers`` in bfloat16 (hidden 1024, 8
layers, 16 heads, intermediate 2816, vocabulary 32,000: about 336 MB in 4 safetensors
files) is loaded with ``redray.models.from_pretrained(folder,
parallelism=redray.Parallelism.of(fsdp_axis=4))`` on ``jax.distributed`` processes of
this machine (gloo), in two settings: 2 processes x 2 CPU devices, and 4 x 1. Each
process measures:

* ``load/peak_over_own_shards`` (target <= 1.3): the growth of its peak resident memory
  during the load (``ru_maxrss`` after, less before) over the bytes of the shards it
  keeps (its devices' shards of every parameter, in the dtype it keeps them: float32);
  the figure is the largest over processes and settings, each in ``detail``;
* ``load/seconds_over_disk_read``: the load's time (the slowest process) over reading
  the same files with ``cat`` (the page cache warm on both sides: the files are read
  once before either is timed).

A load that reads every tensor whole on every host, converts it to float32 and holds a
stacked parameter's layers until all are read costs about the whole model per host,
whatever the host count: the figure grows with the hosts (issue 85 measured 1.94 on 2 x
2 and 3.12 on 4 x 1 before slice-wise loading).

    python benchmarks/load.py            # the settings above
    python benchmarks/load.py --tiny     # a 2-layer model, 2 x 2 only: checks the script
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import figure, parser, save  # noqa: E402

FULL = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
            num_attention_heads=16, num_key_value_heads=16, vocab_size=32000)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=4, vocab_size=256)
SETTINGS = ((2, 2), (4, 1))  # (processes, CPU devices each)
FSDP = 4


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


def worker(folder: str, address: str, world: int, rank: int) -> None:
    """One process of a load: joins the runtime, loads, prints what it measured."""
    import jax

    from redray import Parallelism
    from redray.models import from_pretrained
    from redray.processes.jax_runtime import join_jax

    join_jax(address, world, rank)
    jax.numpy.zeros(1).block_until_ready()  # the runtime's own buffers, before
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    start = time.perf_counter()
    model = from_pretrained(folder, parallelism=Parallelism.of(fsdp_axis=FSDP))
    from flax import nnx

    leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
    jax.block_until_ready(leaves)
    seconds = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    own = sum(s.data.nbytes for leaf in leaves for s in leaf.addressable_shards)
    print("LOAD " + json.dumps({"rank": rank, "grew": after - before, "own": own,
                                "seconds": seconds}), flush=True)
    jax.distributed.shutdown()


def load_on(folder: str, processes: int, devices: int) -> list[dict]:
    """Every process's measures of one load on ``processes`` x ``devices``."""
    from redray.processes.jax_runtime import served_at

    address = served_at("127.0.0.1")
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", folder, address,
                               str(processes), str(rank)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
             for rank in range(processes)]
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=1200)
        if p.returncode:
            raise RuntimeError(f"a loading process failed:\n{stderr[-3000:]}")
        out += [json.loads(line[5:]) for line in stdout.splitlines() if line.startswith("LOAD ")]
    return out


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
    sizes, settings = (TINY, SETTINGS[:1]) if args.tiny else (FULL, SETTINGS)
    with tempfile.TemporaryDirectory() as folder:
        files = write_checkpoint(folder, sizes)
        stored = sum(os.path.getsize(f) for f in files)
        cat = disk_read(files)  # warms the page cache too
        runs = {f"{p}x{d}": load_on(folder, p, d) for p, d in settings}
    ratios = {k: max(r["grew"] / r["own"] for r in rs) for k, rs in runs.items()}
    seconds = {k: max(r["seconds"] for r in rs) for k, rs in runs.items()}
    worst = max(ratios, key=ratios.get)
    slowest = max(seconds, key=seconds.get)
    detail = {"stored_bytes": stored, "files": len(files), "cat_seconds": cat,
              "settings": {k: {"peak_over_own_shards": ratios[k], "seconds": seconds[k],
                               "processes": rs} for k, rs in runs.items()}}
    command = "python benchmarks/load.py"
    figures = [
        figure("load/peak_over_own_shards", ratios[worst], "x",
               f"the shards a process keeps (float32), fsdp {FSDP}; the worst of "
               f"{', '.join(ratios)} processes x devices ({worst})", "<= 1.3", command,
               **detail),
        figure("load/seconds_over_disk_read", seconds[slowest] / cat, "x",
               f"cat of the same {len(files)} files ({stored:,} B), page cache warm; the "
               f"slowest load ({slowest})", None, command)]
    save(figures, args.out)
    for f in figures:
        print(f"{f['name']}: {f['value']:.3f} {f['unit']}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
    else:
        main()
