"""Writes conversations.jsonl: a conversation per topic of CPython's own documentation
(``pydoc_data.topics``, 79 topics, no download). A user asks what a section is about and
the assistant answers with the section's first sentence; every third conversation asks
the section's title in a second turn, every other one opens with a system prompt.

    python examples/chat_sft/make_conversations.py
"""

import json
import os
import re

SYSTEM = "You answer questions about Python's documentation in one sentence."


def first_sentence(text: str) -> tuple[str, str]:
    """(the section's title, its first sentence) of a pydoc topic."""
    lines = text.strip().splitlines()
    # the prose: unindented lines (code and grammar are indented), no heading rules
    body = " ".join(line.strip() for line in lines[2:]
                    if line.strip() and not line.startswith(" ")
                    and not set(line.strip()) <= set("=*-^~"))
    sentence = next(s for s in re.split(r"(?<=[.:])\s", body)
                    if not s.startswith(("New in", "Changed in", "Added in")))
    return lines[0].strip(), sentence[:240].rstrip(" :") + ("" if sentence.endswith(".") else ".")


def conversations() -> list[dict]:
    from pydoc_data.topics import topics

    out = []
    for i, key in enumerate(sorted(topics)):
        title, sentence = first_sentence(topics[key])
        messages = [{"role": "system", "content": SYSTEM}] if i % 2 == 0 else []
        messages += [{"role": "user", "content": "What is the documentation section on "
                                                 f"{key.replace('-', ' ')} about?"},
                     {"role": "assistant", "content": sentence}]
        if i % 3 == 0:
            messages += [{"role": "user", "content": "What is the section called?"},
                         {"role": "assistant", "content": title}]
        out.append({"messages": messages})
    return out


if __name__ == "__main__":
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "conversations.jsonl")
    with open(path, "w") as f:
        for row in conversations():
            f.write(json.dumps(row) + "\n")
    print(f"wrote {path}")
