"""`make bench`: every CPU benchmark, one after another, then BENCHMARKS.md's table.

Every ``benchmarks/*.py`` that is a benchmark (all but this file, ``common.py``,
``report.py``, helper modules named ``_*.py`` and the GPU-only ``gpu_*.py``) runs as
its own process (each sets its own
simulated devices) and updates benchmarks/results.json.

    python benchmarks/run_all.py [--tiny] [--only NAME ...]
"""

from __future__ import annotations

import argparse
import glob
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
NOT_BENCHMARKS = {"common.py", "report.py", "run_all.py"}


def scripts() -> list[str]:
    """The CPU benchmark scripts, by name."""
    return sorted(os.path.basename(p) for p in glob.glob(os.path.join(HERE, "*.py"))
                  if os.path.basename(p) not in NOT_BENCHMARKS
                  and not os.path.basename(p).startswith(("gpu_", "_")))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="check every script quickly")
    ap.add_argument("--only", nargs="*", help="these scripts only (e.g. overhead.py)")
    ap.add_argument("--out", default=None, help="results file (default benchmarks/results.json)")
    args = ap.parse_args(argv)
    failed = []
    for script in args.only or scripts():
        command = [sys.executable, os.path.join(HERE, script)] + (["--tiny"] if args.tiny else []) \
            + (["--out", args.out] if args.out else [])
        start = time.perf_counter()
        print(f"== {script}", flush=True)
        if subprocess.run(command).returncode:
            failed.append(script)
        print(f"== {script}: {time.perf_counter() - start:.0f} s", flush=True)
    if not args.tiny and not args.out:
        subprocess.run([sys.executable, os.path.join(HERE, "report.py")], check=True)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
