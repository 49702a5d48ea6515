"""Regenerates BENCHMARKS.md's results table from benchmarks/results.json.

The table sits between the markers ``<!-- results:start -->`` and
``<!-- results:end -->``; everything else in BENCHMARKS.md (the targets missed, each
group's method) is written by hand, and so are the pages of docs/performance/ (how each
figure is made, what limits it).

    python benchmarks/report.py
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import RESULTS, ROOT, met  # noqa: E402

START, END = "<!-- results:start -->", "<!-- results:end -->"


def table(figures: list[dict]) -> str:
    rows = ["| figure | value | target | met | reference | command |", "|---|---|---|---|---|---|"]
    for f in sorted(figures, key=lambda f: f["name"]):
        ok = {True: "yes", False: "**no**", None: ""}[met(f)]
        # ratios to 4 decimals: 1.00001 and 1.0015 must not both read "1"
        number = f"{f['value']:.4f}" if f["unit"] == "x" else f"{f['value']:.4g}"
        value = f"{number} {f['unit']}".strip()
        rows.append(f"| {f['name']} | {value} | {f['target'] or ''} | {ok} | {f['reference']} "
                    f"| `{f['command']}` |")
    return "\n".join(rows)


def render(markdown: str, figures: list[dict]) -> str:
    """``markdown`` with the text between the markers replaced by the table."""
    if START not in markdown or END not in markdown:
        raise ValueError(f"BENCHMARKS.md lacks the markers {START} ... {END}")
    head, rest = markdown.split(START, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{START}\n{table(figures)}\n{END}{tail}"


def main(results: str = RESULTS, path: str = os.path.join(ROOT, "BENCHMARKS.md")) -> None:
    with open(results) as f:
        figures = json.load(f)
    with open(path) as f:
        text = f.read()
    rendered = render(text, figures)  # before the file is opened: a failure keeps it
    with open(path, "w") as f:
        f.write(rendered)
    print(f"{path}: {len(figures)} figures")


if __name__ == "__main__":
    main()
