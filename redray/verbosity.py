"""How much a run prints: quiet by default, everything with ``REDRAY_VERBOSE=1``.

Quiet, the driver shows one progress line and the run's own messages, and the set-up
chatter of the libraries under redray is dropped (``redray/cluster/console.py``).
Verbose, everything every process prints is shown, each host's progress bar included.
``--verbose`` (``redray.add_cluster_args``, ``redray run``, ``redray submit``) sets the
variable, so the hosts and a submitted job see it too.
"""

from __future__ import annotations

import os

VERBOSE_ENV = "REDRAY_VERBOSE"
# transformers' "advisory" warnings (e.g. "PyTorch was not found": redray never needs
# torch), silenced from redray's import on unless verbose.
ADVICE_ENV = "TRANSFORMERS_NO_ADVISORY_WARNINGS"


def verbose(flag: bool | None = None) -> bool:
    """``flag`` if given, else whether ``REDRAY_VERBOSE`` is set (to anything but 0)."""
    if flag is not None:
        return bool(flag)
    return os.environ.get(VERBOSE_ENV, "").strip().lower() not in ("", "0", "false", "no")


def set_verbose(flag: bool) -> None:
    """Makes this process, and the runs and jobs it starts, verbose (or quiet)."""
    os.environ[VERBOSE_ENV] = "1" if flag else "0"
    if flag:
        os.environ.pop(ADVICE_ENV, None)
    else:
        os.environ.setdefault(ADVICE_ENV, "1")


if not verbose():
    os.environ.setdefault(ADVICE_ENV, "1")
