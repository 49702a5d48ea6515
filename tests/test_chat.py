"""Chat rows (``redray.data.chat``) against TRL 1.16's own SFT data path: conversations
with a system prompt, several turns and a tool call, rendered by three templates (TRL's
shipped ChatML one, Qwen 2.5's, with tools; its Llama 3 one, with headers; and one with
``{% generation %}`` markers written here), over GPT-2's BPE with the templates'
special tokens added. ``SFTTrainer(assistant_only_loss=True)`` prepares the same rows
(swapping in its own training variants of the first two): the ids and the assistant
masks are equal token for token, prompt-completion rows' masks too, and the loss of
one batch through a tiny transformers checkpoint equals TRL's ``compute_loss`` within
1e-5, unpacked and packed; the packed batch's loss equals the unpacked one's."""

from __future__ import annotations

import json
import logging
import os

import jax.numpy as jnp
import numpy as np
import pyarrow.parquet as pq
import pytest

from hf_tiny import llama_folder
from redray.data import chat, pack, prepare

SPECIALS = ["<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>",
            "<|end_header_id|>", "<|eot_id|>", "<|system|>", "<|user|>", "<|assistant|>",
            "<|tool|>", "</s>"]

# a template with generation markers (Zephyr's turns), its end-of-turn inside them
MARKED = ("{% for m in messages %}{{ '<|' + m['role'] + '|>\n' }}"
          "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] + '</s>\n' }}"
          "{% endgeneration %}{% else %}{{ m['content'] + '</s>\n' }}{% endif %}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}")

TOOLS = [{"type": "function", "function": {
    "name": "multiply", "description": "Multiplies two numbers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "number"},
                                                    "b": {"type": "number"}},
                   "required": ["a", "b"]}}}]


def conversations(tool_calls: bool, count: int = 4) -> list[list[dict]]:
    """``count`` conversations: a system prompt, two or three exchanges, one with a tool
    call and its result (as a call where the template renders calls, else as text)."""
    out = []
    for i in range(count):
        call = {"role": "assistant", "content": "",
                "tool_calls": [{"type": "function", "function": {
                    "name": "multiply", "arguments": {"a": i, "b": 3}}}]} if tool_calls \
            else {"role": "assistant", "content": f"Calling multiply({i}, 3)."}
        messages = [{"role": "system", "content": "You are terse."},
                    {"role": "user", "content": f"What is {i} * 3?"}, call,
                    {"role": "tool", "content": str(3 * i)},
                    {"role": "assistant", "content": f"It is {3 * i}."}]
        messages += [{"role": "user", "content": "Are you sure?"},
                     {"role": "assistant", "content": "Yes. " * (i + 1)}][:2 * (i % 2 + 1)]
        out.append(messages)
    return out


TEMPLATES = {"chatml": ("qwen2_5.jinja", "<|im_end|>", True),
             "llama3": ("llama3.jinja", "<|eot_id|>", False),
             "markers": (None, "</s>", False)}


def tokenizer(kind: str):
    import trl

    from redray.models.tokenizer import gpt2_tokenizer

    name, eos, _ = TEMPLATES[kind]
    tok = gpt2_tokenizer(hf=True)
    tok.add_special_tokens({"additional_special_tokens": SPECIALS})
    tok.bos_token, tok.eos_token, tok.pad_token = "<|begin_of_text|>", eos, "<|endoftext|>"
    tok.chat_template = MARKED if name is None else open(
        os.path.join(os.path.dirname(trl.__file__), "chat_templates", name)).read()
    return tok


def rows_of(kind):
    return [{"messages": c, **({"tools": TOOLS} if TEMPLATES[kind][2] else {})}
            for c in conversations(TEMPLATES[kind][2])]


@pytest.fixture(scope="module")
def sft(tmp_path_factory):
    """For each template: TRL's prepared rows (unpacked, packed, prompt-completion), a
    batch of each through its collator and TRL's loss of it, on one tiny LLaMA."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import SFTConfig, SFTTrainer

    folder = llama_folder(tmp_path_factory.mktemp("chat") / "model",
                          tokenizer=tokenizer("chatml"))
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    out = {"folder": folder}
    for kind in TEMPLATES:
        tok = tokenizer(kind)
        runs = {}
        for name, rows, packing in (
                ("unpacked", rows_of(kind), False), ("packed", rows_of(kind), True),
                ("completion", [{"prompt": r["messages"][:2], "completion": r["messages"][2:3]}
                                for r in rows_of("llama3")], False)):
            args = SFTConfig(output_dir=str(tmp_path_factory.mktemp("trl")), max_length=1024,
                             assistant_only_loss=name != "completion", packing=packing,
                             report_to=[], use_cpu=True, per_device_train_batch_size=4)
            trainer = SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows),
                                 processing_class=tok)
            prepared = [trainer.train_dataset[i] for i in range(len(trainer.train_dataset))]
            batch = trainer.data_collator(prepared)
            with torch.no_grad():
                loss = float(trainer.compute_loss(model, batch))
            runs[name] = {"rows": prepared, "loss": loss}
        out[kind] = runs
    return out


@pytest.mark.parametrize("kind", list(TEMPLATES))
def test_the_assistant_masks_are_trls_token_for_token(sft, kind):
    tok = tokenizer(kind)
    for messages, ref in zip(conversations(TEMPLATES[kind][2]), sft[kind]["unpacked"]["rows"]):
        row = chat.render(messages, tok, tools=TOOLS if TEMPLATES[kind][2] else None)
        assert row["ids"] == ref["input_ids"]
        assert row["loss_mask"] == [int(x != -100) for x in ref["labels"]]
        # the end-of-turn token is the assistant's: the model learns to stop
        eot = tok.convert_tokens_to_ids(TEMPLATES[kind][1])
        ends = [m for i, m in zip(row["ids"], row["loss_mask"]) if i == eot]
        assert sum(ends) == sum(m["role"] == "assistant" for m in messages)
    # prompt-completion rows: the completion's tokens, as TRL diffs the two renderings
    for r, ref in zip(rows_of("llama3"), sft[kind]["completion"]["rows"]):
        row = chat.render_completion(r["messages"][:2], r["messages"][2:3], tok)
        assert row["ids"] == ref["input_ids"]
        assert row["loss_mask"] == [int(x != -100) for x in ref["labels"]]


def redray_loss(model, rows, length=None):
    """next_token_loss of rendered rows: right-padded to a batch, or packed into one row
    of ``length`` tokens."""
    from redray.models import next_token_loss

    if length is None:
        width = max(len(r["ids"]) for r in rows)
        ids = np.array([r["ids"] + [0] * (width - len(r["ids"])) for r in rows], np.int32)
        mask = np.array([r["loss_mask"] + [0] * (width - len(r["ids"])) for r in rows],
                        np.int32)
        return next_token_loss(model, jnp.asarray(ids), loss_mask=jnp.asarray(mask),
                               metrics=True)
    (packed,) = pack(rows, length)  # every row in one
    return next_token_loss(model, jnp.asarray(packed["ids"][None]),
                           jnp.asarray(packed["segment_ids"][None]),
                           loss_mask=jnp.asarray(packed["loss_mask"][None]), metrics=True)


@pytest.mark.parametrize("kind", list(TEMPLATES))
def test_one_batchs_loss_is_trls_unpacked_and_packed(sft, kind):
    import redray.models as rm

    model = rm.from_pretrained(sft["folder"])
    tok = tokenizer(kind)
    rows = [chat.render(c, tok, tools=TOOLS if TEMPLATES[kind][2] else None)
            for c in conversations(TEMPLATES[kind][2])]
    unpacked, counted = redray_loss(model, rows)
    packed, counted_packed = redray_loss(model, rows, length=sum(len(r["ids"]) for r in rows))
    np.testing.assert_allclose(float(unpacked), sft[kind]["unpacked"]["loss"], rtol=1e-5)
    np.testing.assert_allclose(float(packed), sft[kind]["packed"]["loss"], rtol=1e-5)
    np.testing.assert_allclose(float(packed), float(unpacked), rtol=1e-5)
    # the targets: every masked token but each row's first (nothing predicts it)
    assert float(counted["tokens"]) == float(counted_packed["tokens"]) == \
        sum(sum(r["loss_mask"][1:]) for r in rows)


def test_sequences_normalize_per_conversation_packed_or_not(sft):
    """normalize="sequences": the mean of each conversation's own mean, the same
    whether the conversations are rows or segments of one packed row."""
    import redray.models as rm
    from redray.models import next_token_loss

    model = rm.from_pretrained(sft["folder"])
    tok = tokenizer("chatml")
    rows = [chat.render(c, tok, tools=TOOLS) for c in conversations(True)]
    each = [float(next_token_loss(model, jnp.asarray([r["ids"]]),
                                  loss_mask=jnp.asarray([r["loss_mask"]]))) for r in rows]
    (packed,) = pack(rows, sum(len(r["ids"]) for r in rows))
    value, counted = next_token_loss(
        model, jnp.asarray(packed["ids"][None]), jnp.asarray(packed["segment_ids"][None]),
        loss_mask=jnp.asarray(packed["loss_mask"][None]), normalize="sequences", metrics=True)
    np.testing.assert_allclose(float(value), np.mean(each), rtol=1e-5)
    assert float(counted["weight"]) == float(counted["sequences"]) == len(rows)
    assert float(counted["tokens"]) == sum(sum(r["loss_mask"][1:]) for r in rows)
    tokens = float(next_token_loss(model, jnp.asarray(packed["ids"][None]),
                                   jnp.asarray(packed["segment_ids"][None]),
                                   loss_mask=jnp.asarray(packed["loss_mask"][None])))
    assert abs(tokens - float(value)) > 1e-4  # the two normalizations differ here


def test_prepare_packs_the_masks_beside_the_segments(tmp_path):
    """Each conversation lands whole in one row, as one segment, its mask beside it
    (never cut across rows: packing rows with a per-token column does not split)."""
    tok = tokenizer("chatml")
    rows = rows_of("chatml")
    rendered = [chat.render(r["messages"], tok, tools=TOOLS) for r in rows]
    length = max(len(r["ids"]) for r in rendered) * 2  # two of them to a row
    out = prepare(rows, str(tmp_path / "packed"), transform=chat.transform(tok), pack=length)
    table = pq.read_table(out.files).to_pylist()
    assert set(table[0]) == {"ids", "segment_ids", "loss_mask"}
    segments = [tuple(tuple(v for v, s in zip(t[k], t["segment_ids"]) if s == n)
                      for k in ("ids", "loss_mask"))
                for t in table for n in range(1, max(t["segment_ids"]) + 1)]
    assert sorted(segments) == sorted((tuple(r["ids"]), tuple(r["loss_mask"]))
                                      for r in rendered)
    assert out.rows == len(table) > 1 and len(segments) > len(table)  # packed, some together


def test_turns_each_and_truncation_keep_whole_assistant_turns(caplog):
    tok = tokenizer("llama3")
    messages = conversations(False)[1]  # three assistant turns
    whole = chat.render(messages, tok)
    each = chat.each_turn(messages, tok)
    assert len(each) == 3 and each[-1]["ids"] == whole["ids"]
    assert [sum(r["loss_mask"]) for r in each] == [
        len(run) for run in "".join(map(str, whole["loss_mask"])).split("0") if run]
    # turns: cut after the last whole assistant turn that fits
    second_end = len(each[1]["ids"])
    cut = chat.truncate(dict(whole), second_end + 3, "turns")
    assert cut["ids"] == whole["ids"][:second_end]
    assert cut["loss_mask"] == whole["loss_mask"][:second_end]
    first_turn = each[0]["loss_mask"].index(1)
    assert chat.truncate(dict(whole), first_turn + 1, "turns") is None
    with caplog.at_level(logging.WARNING, logger="redray.data.chat"):
        kept = chat.truncate(dict(whole), first_turn + 1, "keep_start")
    assert len(kept["ids"]) == first_turn + 1
    assert "inside an assistant turn" in caplog.text
    assert chat.truncate(dict(whole), 10, "drop") is None
    fn = chat.transform(tok, turns="each", max_length=second_end)
    assert [len(r["ids"]) for r in fn({"messages": messages})] == \
        [len(each[0]["ids"]), second_end]


def test_what_cannot_be_masked_is_refused_by_name():
    tok = tokenizer("markers")
    tok.chat_template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    with pytest.raises(ValueError, match="generation"):
        chat.transform(tok)
    with pytest.raises(ValueError, match="role 'bot'"):
        chat.render([{"role": "bot", "content": "hi"}], tokenizer("chatml"))
    fn = chat.transform(tokenizer("chatml"))
    with pytest.raises(ValueError, match="without an assistant message"):
        fn({"messages": [{"role": "user", "content": "hi"}]})
    with pytest.raises(KeyError, match="prompt"):
        fn({"text": "hi"})
    with pytest.raises(ValueError, match="per-token columns"):
        list(pack([{"ids": [1, 2], "loss_mask": [1, 1]}, {"ids": [3, 4], "loss_mask": [1]}], 8))
    assert json.loads(json.dumps(chat.render(conversations(False)[0], tokenizer("llama3"))))


def test_the_end_of_turn_tokens_are_read_and_written_with_the_checkpoint(sft, tmp_path):
    """An instruct checkpoint lists its end-of-turn tokens in generation_config.json:
    decoding stops on all of them by default, and save_pretrained writes them (with the
    tokenizer's EOS, a chat fine-tune's end of turn) for any server of the folder."""
    import shutil

    import transformers

    import redray.models as rm
    from redray.models.generate import special_tokens

    folder = str(tmp_path / "instruct")
    shutil.copytree(sft["folder"], folder)
    chatml, llama3 = tokenizer("chatml"), tokenizer("llama3")
    end, eot = chatml.eos_token_id, llama3.eos_token_id
    transformers.GenerationConfig(bos_token_id=chatml.bos_token_id,
                                  eos_token_id=[end, 50256]).save_pretrained(folder)
    model = rm.from_pretrained(folder)
    assert special_tokens(model.config, None, None)[0] == [end, 50256]
    assert special_tokens(model.config, 7, None)[0] == 7  # asked for: as asked
    out = str(tmp_path / "export")
    rm.save_pretrained(model, out, tokenizer=llama3)
    written = transformers.GenerationConfig.from_pretrained(out)
    assert written.eos_token_id == [end, 50256, eot]
    assert written.bos_token_id == chatml.bos_token_id
    assert rm.from_pretrained(out).config.generation["eos_token_id"] == [end, 50256, eot]
    # a checkpoint without one: the config's EOS, and the tokenizer's beside it
    bare = str(tmp_path / "bare")
    shutil.copytree(sft["folder"], bare)
    os.remove(os.path.join(bare, "generation_config.json"))
    plain = rm.from_pretrained(bare)
    assert plain.config.generation is None
    rm.save_pretrained(plain, str(tmp_path / "plain"), tokenizer=llama3)
    assert transformers.GenerationConfig.from_pretrained(
        str(tmp_path / "plain")).eos_token_id == [end, eot]


def test_a_vocabulary_tokenizer_and_a_built_models_generation_config(tmp_path):
    """vocabulary_tokenizer reads the longest listed token first and renders chats with
    its template (saved and loaded as any tokenizer); build(generation=) gives a random
    model the end-of-turn tokens an instruct checkpoint's generation_config.json holds:
    the Sampler stops on them, save_pretrained writes them, messages() decodes to them."""
    import transformers
    from transformers import LlamaConfig

    import redray.models as rm
    from redray.models.generate import special_tokens
    from redray.post_training import Sampler, SamplingParams, messages

    tokens = ["<pad>", "<|im_start|>", "<|im_end|>", "a", "ab", "b", "\n", "user",
              "assistant"]
    tok = rm.vocabulary_tokenizer(tokens, special=tokens[:3], pad="<pad>", eos="<|im_end|>",
                                  chat_template=chat.CHATML)
    assert tok.encode("abab", add_special_tokens=False) == [4, 4]
    assert tok.encode("aab", add_special_tokens=False) == [3, 4]
    ids = chat.render_prompt([{"role": "user", "content": "ba"}], tok)
    assert tok.convert_ids_to_tokens(ids) == ["<|im_start|>", "user", "\n", "b", "a",
                                              "<|im_end|>", "\n", "<|im_start|>",
                                              "assistant", "\n"]
    assert tok.decode([4, 5, 2], skip_special_tokens=True) == "abb"
    tok.save_pretrained(str(tmp_path / "tok"))
    again = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    assert chat.render_prompt([{"role": "user", "content": "ba"}], again) == ids
    with pytest.raises(ValueError, match="<eos>"):
        rm.vocabulary_tokenizer(tokens, eos="<eos>")

    config = LlamaConfig(vocab_size=len(tokens), hidden_size=32, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=2, eos_token_id=0,
                         pad_token_id=0)
    model = rm.build(config, generation={"eos_token_id": [2, 0]})
    assert list(special_tokens(model.config, None, None)[0]) == [2, 0]
    assert rm.build(config).config.generation is None
    done = Sampler(model, slots=4, max_length=24).sample([ids] * 4, SamplingParams(
        max_new_tokens=6, temperature=1.0))
    said = messages(done, tok, [2, 0])
    for c, text in zip(done, said):  # stopped on an end of turn, or cut at 6 tokens
        assert (c.finish_reason == "eos") == (c.tokens[-1] in (2, 0)) == (text is not None)
        if text is not None:
            assert text == tok.decode(c.tokens[:-1], skip_special_tokens=True)
    rm.save_pretrained(model, str(tmp_path / "out"), tokenizer=tok)
    written = transformers.GenerationConfig.from_pretrained(str(tmp_path / "out"))
    assert written.eos_token_id == [2, 0]
