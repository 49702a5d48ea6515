"""Lines of each example pipeline's code, next to redco 0.4.23's count for the same pipeline.

A line counts if it holds any Python token other than a comment: blank lines and
comment-only lines do not count, docstrings do (the method of
../shared/redco_examples_loc.md, which gives redco's counts). A token spanning several
lines (a docstring, a bracketed expression's continuation) counts on every line it covers.

    python benchmarks/lines_of_code.py [--json]
"""

from __future__ import annotations

import json
import os
import sys
import tokenize

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import ROOT, figure, parser, save  # noqa: E402

# pipeline -> (redray example files, redco 0.4.23's example for the same pipeline and its
# count, from redco_examples_loc.md). redray's classifier learns handwritten digits with
# an MLP: redco's MNIST example is its like (its GLUE example, 154 lines, fine-tunes a
# Hugging Face text classifier).
PIPELINES = {
    "language modeling (causal LM)": (["examples/language_modeling/train.py"],
                                      "language_modeling", 113),
    "text to text (seq2seq)": (["examples/text_to_text/train.py"], "text_to_text", 170),
    "classification (digits)": (["examples/classification/train.py"], "mnist", 80),
    "meta learning (MAML)": (["examples/meta_learning/train.py"], "meta_learning", 165),
    "reinforcement learning (PPO)": (["examples/reinforcement_learning/train.py"],
                                     "reinforcement_learning", 218),
    "differentially private training": (["examples/differential_privacy/train.py"],
                                        "differential_private_training", 165),
    "LoRA fine-tuning": (["examples/lora/train.py"], "lora", 220),
    # redco has no GRPO: its closest pipeline is its reinforcement learning (PPO)
    "reinforcement learning from a verifier (GRPO)": (["examples/grpo/train.py"],
                                                      "reinforcement_learning", 218),
    # redco has no DPO: its closest pipeline fine-tunes a causal LM (its language modeling)
    "preference learning (DPO)": (["examples/dpo/train.py"], "language_modeling", 113),
    # redco has no chat fine-tuning: its closest pipeline is its language modeling
    "chat fine-tuning (assistant-only loss)": (["examples/chat_sft/train.py"],
                                               "language_modeling", 113),
}

SKIPPED = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
           tokenize.ENCODING, tokenize.ENDMARKER}


def count_lines(path: str) -> int:
    """Lines of ``path`` that hold a Python token other than a comment."""
    lines: set[int] = set()
    with open(path, "rb") as f:
        for token in tokenize.tokenize(f.readline):
            if token.type not in SKIPPED:
                lines.update(range(token.start[0], token.end[0] + 1))
    return len(lines)


def measure() -> list[dict]:
    """One row per pipeline whose example exists: redray's and redco's counts."""
    rows = []
    for pipeline, (files, redco_example, redco) in PIPELINES.items():
        paths = [os.path.join(ROOT, f) for f in files]
        if not all(os.path.exists(p) for p in paths):
            continue
        rows.append({"pipeline": pipeline, "files": files,
                     "redray": sum(count_lines(p) for p in paths), "redco": redco,
                     "redco_example": redco_example})
    return rows


def table(rows: list[dict]) -> str:
    out = ["| pipeline | redray files | redray lines | redco 0.4.23 example | redco lines "
           "| redray / redco |", "|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['pipeline']} | {' + '.join(f'`{f}`' for f in r['files'])} | "
                   f"{r['redray']} | `examples/{r['redco_example']}` | {r['redco']} | "
                   f"{r['redray'] / r['redco']:.2f} |")
    return "\n".join(out)


def main(argv=None) -> None:
    ap = parser(__doc__)
    ap.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = ap.parse_args(argv)
    rows = measure()
    print(json.dumps(rows, indent=1) if args.json else table(rows))
    save([figure(f"lines_of_code/{r['pipeline']}", r["redray"], "lines",
                 f"redco 0.4.23's examples/{r['redco_example']}: {r['redco']} lines",
                 f"<= {r['redco']}",
                 "python benchmarks/lines_of_code.py", files=r["files"]) for r in rows],
         args.out)


if __name__ == "__main__":
    main()
