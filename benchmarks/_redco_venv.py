"""The reference implementation, redco 0.4.23, in a virtual environment of its own.

redco is a benchmark-only reference: it never enters redray's environment. It gets
the same jax/jaxlib/flax/optax as redray (the pins in pyproject.toml), so both sides of
a comparison run the same XLA.

    python benchmarks/_redco_venv.py    # creates .venv-redco if missing, prints its python
"""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VENV = os.path.join(ROOT, ".venv-redco")
PACKAGES = ["redco==0.4.23", "jax==0.10.2", "jaxlib==0.10.2", "flax==0.12.8", "optax==0.2.8",
            "orbax-checkpoint==0.12.8", "tqdm==4.70.1", "numpy==2.4.6"]


def python() -> str:
    """The venv's interpreter, creating the venv (a few minutes, once) if needed."""
    exe = os.path.join(VENV, "bin", "python")
    marker = os.path.join(VENV, ".installed")
    wanted = "\n".join(PACKAGES)
    if os.path.exists(marker) and open(marker).read() == wanted:
        return exe
    if not os.path.exists(exe):
        subprocess.run([sys.executable, "-m", "venv", VENV], check=True)
    subprocess.run([exe, "-m", "pip", "install", "-q", *PACKAGES], check=True)
    with open(marker, "w") as f:
        f.write(wanted)
    return exe


if __name__ == "__main__":
    print(python())
