"""What every benchmark shares: its flags, timing statistics, and the results file.

Each benchmark script measures one or more figures (ratios taken side by side in one
run) and saves them with ``save``: one JSON object per figure with ``name``, ``value``
(a number), ``unit``, ``reference`` (what it is measured against), ``target`` (e.g.
``"<= 1.03"``, or None), ``command`` (what reproduces it) and optional ``detail``.
``benchmarks/report.py`` turns benchmarks/results.json into BENCHMARKS.md's tables.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Callable

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results.json")
KEYS = ("name", "value", "unit", "reference", "target", "command")


def tests_module(name: str):
    """``tests/<name>.py`` as a module (the models and loaders the tests write)."""
    import importlib
    import sys

    if os.path.join(ROOT, "tests") not in sys.path:
        sys.path.insert(0, os.path.join(ROOT, "tests"))
    return importlib.import_module(name)


def example_module(name: str):
    """``examples/<name>/train.py`` as a module (tests/example_runs.py's loader)."""
    load = tests_module("example_runs").example_module

    return load(name)


def simulate_devices(n: int) -> None:
    """Asks JAX for ``n`` CPU devices; call before JAX is imported."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    os.environ["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={n}"])
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


def parser(doc: str) -> argparse.ArgumentParser:
    """A benchmark's parser with the flags every one has: ``--tiny`` (a seconds-long
    run that checks the script works, not a measurement) and ``--out``."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true",
                    help="smallest sizes and repeats: checks the script, measures nothing")
    ap.add_argument("--out", default=RESULTS, help="results file to update (JSON list)")
    return ap


def figure(name: str, value: float, unit: str, reference: str, target: str | None,
           command: str, **detail) -> dict:
    """One result object (see the module docstring)."""
    out = {"name": name, "value": float(value), "unit": unit, "reference": reference,
           "target": target, "command": command}
    if detail:
        out["detail"] = detail
    return out


def met(fig: dict) -> bool | None:
    """Whether a figure meets its target (None when it has none)."""
    target = fig.get("target")
    if not target:
        return None
    low, dash, high = target.partition("-")
    if dash and low and high:  # a range, "0.8-1.25"
        return float(low) <= fig["value"] <= float(high)
    op, _, bound = target.partition(" ")
    value, bound = fig["value"], float(bound)
    return {"<=": value <= bound, ">=": value >= bound, "<": value < bound,
            ">": value > bound}[op]


def save(figures: list[dict], path: str = RESULTS) -> None:
    """Merges ``figures`` into the results file (by name: a new run replaces an old one)
    and prints them."""
    for fig in figures:
        missing = [k for k in KEYS if k not in fig]
        if missing:
            raise ValueError(f"figure {fig.get('name')!r} lacks {missing}")
        print(json.dumps(fig))
    old = []
    if os.path.exists(path):
        with open(path) as f:
            old = json.load(f)
    names = {f["name"] for f in figures}
    merged = [f for f in old if f["name"] not in names] + figures
    with open(path, "w") as f:
        json.dump(merged, f, indent=1)
        f.write("\n")


def machine() -> dict:
    """The host CPU as /proc/cpuinfo names it (model, family/model numbers, the vector
    extensions XLA:CPU's kernels choose by) and its cores: runs on two machines compare
    only beside this."""
    info = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                info.setdefault(key.strip(), value.strip())
    except OSError:
        return {"cores": os.cpu_count()}
    flags = set(info.get("flags", "").split())
    return {"cpu": info.get("model name"), "family": info.get("cpu family"),
            "model": info.get("model"), "cores": os.cpu_count(),
            "vector": sorted(flags & {"avx2", "avx512f", "avx512_bf16", "amx_tile"})}


def repeat(fn: Callable[[], object], repeats: int, warmup: int = 1) -> list[float]:
    """Seconds of ``repeats`` calls of ``fn`` after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def stats(values: list[float]) -> dict:
    """Median and spread (min, max) of repeated measurements."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "n": len(values)}
