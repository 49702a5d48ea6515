"""The shell of a decoder-only language model, shared by GPT-2, LLaMA, OPT, GPT-J
and Gemma.

``CausalLM`` does what every causal LM does the same way: it keeps the config and the
compute settings, turns a call's padding, packed documents or KV cache into a mask and
positions, runs the blocks (a list, or stacked and scanned), applies the final norm
and the LM head (the token embedding read backwards, or a head of its own), and makes
the KV cache. A family subclasses it and writes what is its own: its block, how tokens
(and learned positions) become the first hidden states, and its weight table.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from redray.models import context, layers, paged
from redray.models.hub import HFConfig


class CausalLM(nnx.Module):
    """A causal LM built from a ``transformers`` config.

    Call as ``model(input_ids)`` for logits (batch, seq, vocab); with an attention mask
    over key slots for padding (positions count only real tokens, so left-padded rows
    see the positions an unpadded prompt would); with ``segment_ids`` for rows packed
    with several documents (attention stays inside a document, positions restart; see
    ``redray.data.pack``); with ``cache=model.init_cache(...)`` and ``cache_index`` for
    incremental decoding, which returns (logits, cache); with ``hidden=True`` the final
    hidden states instead of logits (``model.logits(hidden)`` applies the LM head: a
    loss can then project a part of the sequence at a time, ``next_token_loss``, and a
    prefill only its last token, ``generate.prompt_prefill``); with
    ``aux=True`` (logits or hidden states, auxiliary outputs) where the blocks report
    what they measured (``REPORTS``: the mixtures of experts, ``redray/models/moe.py``).

    A family builds its parts in ``build_parts`` (embeddings, blocks from
    ``layers.make_blocks``, final norm) and names them in ``TOKENS``, ``BLOCKS`` and
    ``FINAL_NORM`` (Hugging Face's names, so the weight table reads one to one); it
    defines ``embed`` and ``key_value_heads``. Each block is called as ``block(x, cos,
    sin, mask, layer_cache, cache_index, train) -> (x, layer_cache)`` where the family
    sets ``inv_freq`` (rotary embeddings), else without cos and sin; a family whose layers
    differ (Gemma's windows and rotary tables) says what they get in ``block_inputs``.

    Args:
      config: a ``transformers`` config, or the ``config`` of another redray model.
      rngs: draws the initial parameters and dropout's keys.
      dtype: the compute dtype (parameters stay float32).
      remat: what each block keeps for the backward pass: False/"none", True/"full",
        "dots" or "offload" (``layers.REMAT_POLICIES``).
      scan: stack the blocks and scan over them (one compiled block, whatever the
        depth: what pipeline stages split); None (the default): stacked unless the
        config makes its layers differ (``layers_differ``), then a list.
    """
    # splits a sequence over a context axis (the planner may then choose one)
    SPLITS_SEQUENCES = True

    # The attributes holding the token embedding, the blocks and the final norm (a
    # config may leave the last one out: OPT with post-LayerNorm blocks).
    TOKENS = BLOCKS = FINAL_NORM = None
    # Whether the LM head is the token embedding read backwards when the config does not
    # say (``tie_word_embeddings``), and whether the head has a bias (kept apart as
    # ``lm_head_bias`` when tied: Hugging Face ties only the weight).
    TIED_BY_DEFAULT = False
    HEAD_BIAS = False
    # A rotary family's inverse frequencies (``layers.rope_inv_freq``), as a tuple.
    inv_freq = None
    # How many slots back a query sees (Mistral's sliding window); None: all of them.
    window = None
    # Where layers differ in their attention without differing in parameters (windows,
    # chunks, rotary tables or none): one ``layers.LayerAttention`` per layer, and the
    # rotary tables they index ((inverse frequencies, scale) pairs). None: every layer
    # alike (``inv_freq`` and ``window``).
    layer_attention = None
    rope_tables = ()
    # YaRN's attention factor on the rotary tables' cos and sin (``layers.rope_scale``)
    rope_scale = 1.0
    # Whether the blocks return a report beside (x, layer_cache), which ``aux=True``
    # collects (``layers.run_blocks``) and ``auxiliary`` summarizes (mixtures of experts).
    REPORTS = False

    def __init__(self, config, *, rngs: nnx.Rngs, dtype=jnp.float32, remat=False,
                 scan: bool | None = None):
        self.config = config if isinstance(config, HFConfig) else HFConfig(config)
        self.dtype = dtype
        self.remat = layers.remat_policy(remat)
        c = self.config.hf
        scan = default_scan(self, c, scan)
        self.build_parts(c, rngs=rngs, dtype=dtype, scan=scan)
        self.tied = bool(getattr(c, "tie_word_embeddings", self.TIED_BY_DEFAULT))
        if not self.tied:
            width = getattr(self, self.TOKENS).features
            self.lm_head = nnx.Linear(width, c.vocab_size, use_bias=self.HEAD_BIAS, dtype=dtype,
                                      rngs=rngs)
        elif self.HEAD_BIAS:
            self.lm_head_bias = nnx.Param(jnp.zeros((c.vocab_size,), jnp.float32))

    @classmethod
    def layer_kinds(cls, c) -> tuple[str, ...]:
        """Each layer's kind for the ``transformers`` config ``c``: layers of one kind
        share their parameters' shapes and code (``layers.LayerPattern``: how they
        stack). Here every layer is alike."""
        return ("layer",) * c.num_hidden_layers

    # The config fields that hold a value per layer (cut or continued when a config is
    # made at another depth, ``at_depth``), and those that list layer indices.
    PER_LAYER_FIELDS = ("layer_types", "no_rope_layers")
    LAYER_INDEX_FIELDS = ()

    @classmethod
    def at_depth(cls, c, layers: int):
        """A copy of the config ``c`` with ``layers`` layers that go on as its own do: each
        per-layer field cut there, or continued by repeating its shortest period (a
        list of layer indices as the layers it marks), so the pattern the planner
        counts in (``redray.planning.memory.layer_depth``) holds at any depth."""
        total = c.num_hidden_layers
        c = c.__class__.from_dict(c.to_dict())

        def continued(values: list) -> list:
            period = next(p for p in range(1, len(values) + 1)
                          if all(v == values[i % p] for i, v in enumerate(values)))
            return [values[i % period] for i in range(layers)]

        for name in cls.PER_LAYER_FIELDS:
            values = getattr(c, name, None)
            if isinstance(values, (list, tuple)) and len(values) >= total > 0:
                setattr(c, name, continued(list(values)[:total]))
        for name in cls.LAYER_INDEX_FIELDS:
            marked = set(getattr(c, name, None) or ())
            if total > 0:
                flags = continued([i in marked for i in range(total)])
                setattr(c, name, [i for i, flag in enumerate(flags) if flag])
        c.num_hidden_layers = layers
        return c

    @classmethod
    def pattern(cls, c) -> layers.LayerPattern:
        """How the layers of config ``c`` stack (``layers.make_layers``)."""
        return layers.LayerPattern.of(cls.layer_kinds(c))

    def make_layers(self, c, make, rngs: nnx.Rngs, scan: bool) -> None:
        """Builds the blocks, ``make(kind, rngs)`` one of ``layer_kinds(c)``'s kind: the
        ``BLOCKS`` attribute (a list, a stack, or a stack of ``layers.Period``) and,
        where the pattern starts late, ``first_<BLOCKS>`` (a list)."""
        first, blocks = layers.make_layers(make, self.layer_kinds(c), rngs, scan)
        setattr(self, self.BLOCKS, blocks)
        if first is not None:
            setattr(self, f"first_{self.BLOCKS}", first)

    def set_attention(self, tables: tuple, kinds: tuple) -> None:
        """The layers' attention: ``tables`` the rotary tables ((inverse frequencies,
        scale) pairs), ``kinds`` each layer's ``layers.LayerAttention``. Where every
        layer is alike (one table, or none) they are the model's ``inv_freq``,
        ``rope_scale`` and ``window``; else ``rope_tables`` and ``layer_attention``,
        which the blocks get per layer."""
        if len(set(kinds)) == 1 and kinds[0].chunk is None and len(tables) <= 1 \
                and (kinds[0].rope is None) == (not tables):
            self.window = kinds[0].window
            if tables:
                self.inv_freq, self.rope_scale = tables[0]
            return
        self.rope_tables, self.layer_attention = tables, kinds

    def layers_differ(self, c) -> str | None:
        """Why the config ``c`` gives each layer parameters or code of its own (so its
        layers cannot be stacked and scanned), or None."""
        return None

    def build_parts(self, c, *, rngs: nnx.Rngs, dtype, scan: bool):
        """Builds the embeddings, the blocks and the final norm for the ``transformers``
        config ``c`` (the constructor's ``rngs``, ``dtype`` and ``scan``)."""
        raise NotImplementedError(f"{type(self).__name__} does not define build_parts")

    def embed(self, input_ids, positions, train: bool):
        """The first hidden states (batch, seq, hidden) of ``input_ids`` at ``positions``
        (token embeddings, and learned positions where the family has them)."""
        raise NotImplementedError(f"{type(self).__name__} does not define embed")

    def key_value_heads(self) -> tuple[int, int]:
        """(key/value heads, head_dim) of one layer: what its KV cache holds per token."""
        raise NotImplementedError(f"{type(self).__name__} does not define key_value_heads")

    def block_inputs(self, positions, mask, cache_index=0) -> tuple[tuple, tuple]:
        """What the blocks get beside the hidden states: (inputs every block gets, inputs
        per layer: ``layers.run_blocks``'s ``per_layer``). Here the rotary embeddings'
        cos and sin where the family sets ``inv_freq``, and the mask; nothing per layer
        (where layers differ, ``layer_attention``: every rotary table, and each layer's
        window, chunk and table). ``cache_index``: the call's (paged or not)."""
        if self.layer_attention is not None:
            return self._differing_inputs(positions, mask)
        rotary = () if self.inv_freq is None else layers.rope_angles(positions, self.inv_freq,
                                                                      self.rope_scale)
        return (*rotary, mask), ()

    def _differing_inputs(self, positions, mask) -> tuple[tuple, tuple]:
        """``block_inputs`` where layers differ (``layer_attention``): every rotary table
        stacked (cos, sin), the mask with the queries' positions where a layer chunks,
        and per layer its window, chunk and table (``layers.layer_inputs``)."""
        kinds = self.layer_attention
        cos, sin = layers.rotary_tables(positions, self.rope_tables, kinds)
        if layers.attention_choices(kinds)[1]:
            mask = mask.chunked(None, positions)
        stacked = layers.is_stacked(getattr(self, self.BLOCKS))
        return (cos, sin, mask), layers.layer_inputs(kinds, stacked)

    def auxiliary(self, reports):
        """The auxiliary outputs of ``model(..., aux=True)`` from the blocks' reports
        stacked per layer (a family whose blocks report, ``REPORTS``)."""
        raise NotImplementedError(f"{type(self).__name__} does not define auxiliary")

    def __call__(self, input_ids, attention_mask=None, *, cache=None, cache_index=0,
                 segment_ids=None, train: bool = False, hidden: bool = False,
                 aux: bool = False):
        if aux and not self.REPORTS:
            raise ValueError(f"aux=True: {self.config.model_type} has no auxiliary outputs "
                             "(the mixture-of-experts families have: mixtral, qwen2_moe, "
                             "qwen3_moe)")
        if aux and cache is not None:
            raise ValueError("aux=True is for training and scoring: call without a cache")
        length = input_ids.shape[1]
        # a prefill (a cache filled from slot 0) splits its prompt over a context axis as
        # training does; decoding one token at a time does not
        split = None
        if cache is None or (isinstance(cache_index, int) and cache_index == 0):
            # a prefill's attention mask covers the whole cache: its prompt's slots
            prompt = attention_mask if cache is None or attention_mask is None \
                else attention_mask[:, :length]
            split = context.split_sequence(input_ids, prompt, segment_ids)
        if split is not None:
            ways, input_ids, attention_mask, segment_ids = split
        # a split prefill's mask is its prompt's (the cache's later slots are empty)
        mask, positions = layers.decoder_masks(input_ids, attention_mask,
                                               None if split else cache, cache_index,
                                               window=self.window, segment_ids=segment_ids)
        if split is not None:  # each device of the context axis a part of the sequence
            if prompt is None and segment_ids is None:
                # the only padding is the split's alignment, after the sequence's last
                # token: keys no real query sees (a fused kernel may ignore them)
                mask = mask.replace(padded=False)
            input_ids, mask, positions = context.zigzag_inputs(ways, input_ids, mask, positions)
        shared, per_layer = self.block_inputs(positions, mask, cache_index)
        x = self.embed(input_ids, positions, train)
        x, new_cache, *reports = layers.run_layers(
            getattr(self, f"first_{self.BLOCKS}", None), getattr(self, self.BLOCKS), x, shared,
            cache, cache_index, train, self.remat, per_layer, reports=aux)
        final_norm = getattr(self, self.FINAL_NORM, None)
        if final_norm is not None:
            x = final_norm(x)
        if split is not None:
            x = context.merge_sequence(x, length)
        out = x if hidden else self.logits(x)
        if aux:
            return out, self.auxiliary(reports[0])
        return out if cache is None else (out, new_cache)

    def logits(self, x):
        """The LM head on final hidden states (``model(..., hidden=True)``)."""
        if not self.tied:
            return self.lm_head(x)
        logits = getattr(self, self.TOKENS).attend(x)
        bias = getattr(self, "lm_head_bias", None)
        return logits if bias is None else logits + bias[...].astype(x.dtype)

    def unstacked(self):
        """This model for a decoding loop: stacked blocks become the list of their
        layers (``layers.split_layers``), sliced once before the loop where each step
        would slice them again. Called under ``jit`` before the loop, the copy holds
        the layers' weights a second time while the loop runs (as MaxText decodes with
        unscanned layers). A model with a list of blocks is returned as it is."""
        blocks = getattr(self, self.BLOCKS)
        if not layers.is_stacked(blocks):
            return self
        copy = nnx.merge(*nnx.split(self))
        setattr(copy, self.BLOCKS, layers.split_layers(blocks))
        return copy

    def init_cache(self, batch: int, length: int, dtype=None):
        """An empty KV cache for ``batch`` sequences of up to ``length`` tokens: one
        {"k", "v"} per layer, stacked layers too (``layers._unrolled`` says why)."""
        kv_heads, head_dim = self.key_value_heads()
        return layers.empty_cache(self.config.num_hidden_layers, batch, length, kv_heads,
                                  head_dim, dtype or self.dtype)

    def init_pages(self, pages: int, page_size: int = paged.PAGE_SIZE, dtype=None,
                   rows: int | None = None):
        """An empty paged KV cache: a pool of ``pages`` pages of ``page_size`` tokens per
        layer (``redray/models/paged.py``), for calls with ``cache_index=Pages(table,
        lengths)``. ``rows``: the rows the calls decode, for models whose layers keep a
        state per row beside the pages (Qwen3-Next's); unused here."""
        kv_heads, head_dim = self.key_value_heads()
        return paged.empty_pool(self.config.num_hidden_layers, pages, kv_heads, head_dim,
                                dtype or self.dtype, page_size)


def default_scan(model, c, scan: bool | None) -> bool:
    """``scan`` as given, or (None) stacked layers unless ``model.layers_differ(c)``."""
    if scan is None:
        return model.layers_differ(c) is None
    return bool(scan)
