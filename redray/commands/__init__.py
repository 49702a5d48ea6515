"""The ``redray`` command line's commands, one module per group: each module's ``add``
puts its commands' parsers on the command line's (``redray/cli.py``), each command's
handler beside its parser.

Errors a user can fix are ``UsageError``: one line on stderr, exit code 2.
"""

from __future__ import annotations

import argparse
import os

VERBOSE_HELP = ("show everything the run's processes print (default: one progress line "
                "and the run's messages; REDRAY_VERBOSE=1 does the same)")


class UsageError(Exception):
    """A mistake the user can fix; printed as one line."""


def command(sub, name: str, help: str, description: str, epilog: str):
    """A subcommand whose --help ends with usage examples."""
    return sub.add_parser(name, help=help, description=description, epilog=epilog,
                          formatter_class=argparse.RawDescriptionHelpFormatter)


def script(path: str) -> str:
    """The training script ``path`` (a ``UsageError`` where there is none)."""
    if not os.path.isfile(path):
        raise UsageError(f"no script {path!r}: give the path of a Python training script")
    return path
