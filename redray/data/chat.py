"""Conversations to training rows, through the checkpoint's own chat template.

A conversation is a list of messages, ``{"role": "system" | "user" | "assistant" |
"tool", "content": ...}`` (an assistant's may carry ``tool_calls`` and
``reasoning_content``, as the template reads them); a dataset row holds one under
``"messages"``, and optionally the tools the template lists under ``"tools"`` (JSON
schemas, or their JSON text). ``render`` gives its token ids and ``loss_mask``: 1 on the
assistant's tokens (what the model writes: its content, its tool calls and its
end-of-turn token), 0 on the system prompt, the user's and the tools' turns and the
template's role headers. A prompt-completion row (``{"prompt": messages, "completion":
messages}``) masks its completion instead: the tokens after the rendered prompt, the
generation prompt included in the prompt.

Where the mask comes from, in this order:

* a template with ``{% generation %}`` ... ``{% endgeneration %}`` markers: the markers,
  as ``transformers`` reads them (``return_assistant_tokens_mask``);
* a ChatML template (``<|im_start|>role\\n...<|im_end|>``: Qwen, SmolLM and many others)
  or a Llama 3 one (``<|start_header_id|>role<|end_header_id|>\\n\\n...<|eot_id|>``): each
  assistant turn as the template rendered it, from after its role header through its
  end-of-turn token (ChatML: the role name, so the newline after it, and the newline
  after ``<|im_end|>`` too), which is where TRL's training variants of these templates
  put their markers;
* any other template: a ``ValueError`` that says how to add the markers. Never an empty
  or a silent mask.

The turns are found in the text of the whole conversation as the template renders it,
so a template that rewrites history (Qwen3 drops the reasoning of earlier turns,
gpt-oss's harmony format rewrites them) is trained on what it renders; no template is
assumed to be prefix-preserving. ``turns="each"`` gives a row per assistant turn
instead, its history rendered as at inference and only that turn masked: what such a
template shows the model when it writes that turn. The delimiters are searched in the
rendered text: a conversation whose content spells a template's special tokens out is
tokenized with them as special tokens, as ``transformers`` does at inference too.

Rows longer than ``max_length`` tokens are shortened by ``truncation``: ``"turns"``
(the default) keeps the conversation up to the last assistant turn that fits whole and
drops a conversation whose first assistant turn does not fit; ``"keep_start"`` cuts at
``max_length`` (as TRL does) and says so in a warning when the cut falls inside an
assistant turn; ``"drop"`` drops the row. Dropped rows are counted in warnings too.

``transform(tokenizer, ...)`` makes the ``fn(row)`` that ``redray.data.prepare`` runs on
every row; ``prepare(..., pack=N)`` then carries ``loss_mask`` through packing beside
``segment_ids``, and ``redray.models.next_token_loss(..., loss_mask=...)`` trains on it.
"""

from __future__ import annotations

import bisect
import json
import logging
import re
from collections import Counter
from typing import Any, Callable, Sequence

log = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant", "tool")
TRUNCATIONS = ("turns", "keep_start", "drop")

_MARKER = re.compile(r"\{%-?\s*generation\s*-?%\}")

# Templates without markers whose assistant turns can be found in the rendered text:
# name -> (what the template text holds, the opening of an assistant turn up to where
# the mask starts, the end-of-turn text the mask ends with, what may follow it inside)
FAMILIES = {
    "chatml": (("<|im_start|>", "<|im_end|>"), "<|im_start|>assistant", "<|im_end|>", "\n"),
    "llama3": (("<|start_header_id|>", "<|eot_id|>"),
               "<|start_header_id|>assistant<|end_header_id|>\n\n", "<|eot_id|>", ""),
}

# ChatML at its plainest (Qwen's and SmolLM's turns without their tools or default system
# prompt): a template for a tokenizer that has none, on toy tasks and in tests
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] }}"
          "{{ '<|im_end|>\\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")

# how many rows this process shortened or dropped, by why (said in warnings)
_counts: Counter = Counter()


def template_of(tokenizer) -> str:
    """The chat template a tokenizer renders with (a template shipped as named variants:
    its ``default``)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("default")
    if not template:
        raise ValueError(
            f"{type(tokenizer).__name__} has no chat template: a checkpoint's template is "
            "in its tokenizer_config.json (\"chat_template\") or chat_template.jinja; load "
            "the tokenizer from that folder, or set tokenizer.chat_template")
    return template


def mask_source(template: str) -> str:
    """Where ``render`` takes the assistant's tokens from for ``template``:
    ``"markers"``, a family of ``FAMILIES``; a ``ValueError`` for any other template."""
    if _MARKER.search(template):
        return "markers"
    for name, (tokens, *_) in FAMILIES.items():
        if all(t in template for t in tokens):
            return name
    raise ValueError(
        "the chat template has no {% generation %} markers and is neither a ChatML nor a "
        "Llama 3 one, so which tokens are the assistant's is unknown: wrap what the "
        "template writes for an assistant message (its content, tool calls and end-of-turn "
        "token) in {% generation %} ... {% endgeneration %} and set tokenizer.chat_template "
        "to it, or pass template=")


def check_messages(messages: Any) -> list[dict]:
    """The conversation as a list of message dicts; a ``ValueError`` naming what is wrong."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError(f"a conversation is a non-empty list of messages, got "
                         f"{_short(messages)}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m:
            raise ValueError(f"message {i} is not a dict with a \"role\": {_short(m)}")
        if m["role"] not in ROLES:
            raise ValueError(f"message {i} has role {m['role']!r}; roles are {ROLES}")
    return list(messages)


def render(messages: Sequence[dict], tokenizer, *, tools=None, template: str | None = None,
           add_generation_prompt: bool = False, **template_kwargs) -> dict:
    """``{"ids": [...], "loss_mask": [...]}`` of a conversation: its tokens as the chat
    template renders them, and 1 on the assistant's (see the module docstring).

    Args:
      messages: the conversation.
      tokenizer: a ``transformers`` fast tokenizer with the checkpoint's template.
      tools: the tools the template lists (JSON schemas or their JSON text), or None.
      template: a template to use instead of the tokenizer's.
      add_generation_prompt: end with the opening of an assistant turn (a prompt).
      **template_kwargs: other variables the template reads (``enable_thinking``...).
    """
    messages = check_messages(messages)
    common = _template_args(tokenizer, tools, template, add_generation_prompt=add_generation_prompt,
                            **template_kwargs)
    source = mask_source(common["chat_template"])
    if source == "markers":
        out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True, **common)
        return {"ids": list(out["input_ids"]), "loss_mask": list(out["assistant_masks"])}
    text = tokenizer.apply_chat_template(messages, tokenize=False, **common)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    mask = tokens_of(enc["offset_mapping"], turn_spans(text, source))
    return {"ids": list(enc["input_ids"]), "loss_mask": mask}


def turn_spans(text: str, family: str) -> list[tuple[int, int]]:
    """The (start, end) characters of each assistant turn's masked text in ``text``, as
    ``FAMILIES[family]`` delimits it; a turn left open runs to the end."""
    _, opening, closing, after = FAMILIES[family]
    spans, at = [], 0
    while (start := text.find(opening, at)) >= 0:
        start += len(opening)
        end = text.find(closing, start)
        end = len(text) if end < 0 else end + len(closing)
        if after and text.startswith(after, end):
            end += len(after)
        spans.append((start, end))
        at = end
    return spans


def tokens_of(offsets, spans) -> list[int]:
    """A 0/1 per token: 1 from the token holding each span's first character through the
    one holding its last (``transformers``' rule for its generation markers). Tokens of
    no characters are never the ends of a span."""
    mask = [0] * len(offsets)
    kept = [i for i, (a, b) in enumerate(offsets) if b > a]
    starts = [offsets[i][0] for i in kept]
    ends = [offsets[i][1] for i in kept]
    for start, end in spans:
        first = bisect.bisect_right(ends, start)  # the first token ending after start
        last = bisect.bisect_left(starts, end) - 1  # the last token starting before end
        if first <= last:
            mask[kept[first]:kept[last] + 1] = [1] * (kept[last] + 1 - kept[first])
    return mask


def render_prompt(messages: Sequence[dict], tokenizer, *, tools=None,
                  template: str | None = None, **template_kwargs) -> list[int]:
    """The token ids of a prompt: the conversation so far and the opening of the
    assistant's turn (the generation prompt), as a sampler continues it."""
    messages = check_messages(messages)
    out = tokenizer.apply_chat_template(
        messages, tokenize=True, return_dict=True,
        **_template_args(tokenizer, tools, template, add_generation_prompt=True,
                         **template_kwargs))
    return list(out["input_ids"])


def render_completion(prompt: Sequence[dict], completion: Sequence[dict], tokenizer, *,
                      tools=None, template: str | None = None, **template_kwargs) -> dict:
    """``{"ids", "loss_mask"}`` of a prompt-completion row: the conversation rendered
    whole, 1 on the tokens after the rendered prompt (with its generation prompt). A
    template that renders the prompt alone otherwise than inside the whole (a token
    merged across the boundary, history rewritten) starts the mask where the two
    first differ, and says so in a warning."""
    prompt, completion = check_messages(prompt), check_messages(completion)
    head = render_prompt(prompt, tokenizer, tools=tools, template=template,
                         **template_kwargs)
    whole = tokenizer.apply_chat_template(
        prompt + completion, tokenize=True, return_dict=True,
        **_template_args(tokenizer, tools, template, **template_kwargs))
    ids = list(whole["input_ids"])
    same = 0
    while same < min(len(head), len(ids)) and head[same] == ids[same]:
        same += 1
    if same < len(head):
        _say("prompt_not_prefix", "the rendered prompt is not a prefix of the rendered "
             "prompt and completion (the template renders it otherwise alone, or a token "
             "merges across the boundary): the completion's mask starts where they first "
             "differ")
    return {"ids": ids, "loss_mask": [0] * same + [1] * (len(ids) - same)}


def each_turn(messages: Sequence[dict], tokenizer, **kw) -> list[dict]:
    """A row per assistant turn: the conversation through that turn, rendered whole,
    with only that turn's tokens masked (its history as the template renders it when the
    model writes that turn)."""
    messages = check_messages(messages)
    rows = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        row = render(messages[:i + 1], tokenizer, **kw)
        row["loss_mask"] = last_run(row["loss_mask"])
        rows.append(row)
    return rows


def last_run(mask: Sequence[int]) -> list[int]:
    """``mask`` with only its last run of ones kept."""
    out = [0] * len(mask)
    end = len(mask)
    while end and not mask[end - 1]:
        end -= 1
    start = end
    while start and mask[start - 1]:
        start -= 1
    out[start:end] = [1] * (end - start)
    return out


def truncate(row: dict, max_length: int, truncation: str = "turns") -> dict | None:
    """``row`` (``ids``, ``loss_mask`` and any other per-token lists) at most
    ``max_length`` tokens long, by ``truncation`` (see the module docstring), or None
    where it drops the row."""
    if truncation not in TRUNCATIONS:
        raise ValueError(f"truncation={truncation!r}: give one of {TRUNCATIONS}")
    ids, mask = row["ids"], row["loss_mask"]
    if len(ids) <= max_length:
        return row
    if truncation == "drop":
        _say("dropped_long", f"rows longer than max_length={max_length} are dropped "
             "(truncation=\"drop\")")
        return None
    if truncation == "keep_start":
        cut = max_length
        if mask[cut - 1] and mask[cut]:
            _say("cut_in_turn", f"rows cut at max_length={max_length} inside an assistant "
                 "turn (truncation=\"keep_start\"; \"turns\" keeps whole turns)")
    else:
        # the last end of an assistant turn within max_length
        cut = max((i + 1 for i in range(min(max_length, len(mask)))
                   if mask[i] and (i + 1 == len(mask) or not mask[i + 1])), default=0)
        if not cut:
            _say("dropped_turn", f"conversations whose first assistant turn ends past "
                 f"max_length={max_length} are dropped (truncation=\"turns\")")
            return None
    return {k: (v[:cut] if isinstance(v, list) and len(v) == len(ids) else v)
            for k, v in row.items()}


def transform(tokenizer, *, key: str = "messages", tools_key: str = "tools",
              max_length: int | None = None, truncation: str = "turns",
              turns: str = "all", template: str | None = None,
              **template_kwargs) -> Callable[[dict], Any]:
    """``fn(row)`` for ``redray.data.prepare(..., transform=fn)``: a row's conversation
    (under ``key``; a prompt-completion row's ``prompt`` and ``completion``) to
    ``{"ids", "loss_mask"}``, shortened to ``max_length`` by ``truncation``;
    ``turns="each"``: a list of rows, one per assistant turn. Checks the template once,
    here (a template ``render`` cannot mask fails now, not on a worker)."""
    if turns not in ("all", "each"):
        raise ValueError(f"turns={turns!r}: give \"all\" (a row per conversation) or "
                         "\"each\" (a row per assistant turn)")
    if truncation not in TRUNCATIONS:
        raise ValueError(f"truncation={truncation!r}: give one of {TRUNCATIONS}")
    mask_source(template or template_of(tokenizer))

    def fn(row: dict):
        kw = dict(tools=row.get(tools_key), template=template, **template_kwargs)
        if key in row:
            messages = row[key]
            if not any(isinstance(m, dict) and m.get("role") == "assistant"
                       for m in messages or ()):
                raise ValueError(f"a conversation without an assistant message has "
                                 f"nothing to train on: {_short(messages)}")
            rows = each_turn(messages, tokenizer, **kw) if turns == "each" else \
                [render(messages, tokenizer, **kw)]
        elif "prompt" in row and "completion" in row:
            rows = [render_completion(row["prompt"], row["completion"], tokenizer, **kw)]
        else:
            raise KeyError(f"a chat row holds {key!r} (a conversation) or \"prompt\" and "
                           f"\"completion\"; this one holds {sorted(row)}")
        for r in rows:
            if not any(r["loss_mask"]):
                raise ValueError("the template rendered no assistant tokens for "
                                 f"{_short(row)}: its markers cover nothing")
        if max_length is not None:
            rows = [r for r in (truncate(r, max_length, truncation) for r in rows)
                    if r is not None]
        if turns == "each":
            return rows
        return rows[0] if rows else None

    return fn


def _template_args(tokenizer, tools, template: str | None, **template_kwargs) -> dict:
    """``apply_chat_template``'s keywords: the tools (parsed from their JSON text), the
    template (the tokenizer's unless given) and the template's other variables."""
    return dict(tools=json.loads(tools) if isinstance(tools, str) else tools,
                chat_template=template or template_of(tokenizer), **template_kwargs)


def _say(what: str, text: str) -> None:
    """A warning for the 1st, 10th, 100th... row of its kind in this process."""
    _counts[what] += 1
    n = _counts[what]
    if str(n).rstrip("0") == "1":
        log.warning("%s (%d so far in this process)", text, n)


def _short(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
