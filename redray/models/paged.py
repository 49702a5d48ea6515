"""A KV cache in pages: each row's keys and values in fixed-size pages of one shared pool.

A dense cache gives every row the columns of the longest sequence it may hold. A paged
one gives each row the pages its own tokens fill: a pool of ``pages`` pages of
``page_size`` tokens per layer (``{"k", "v"}`` of (kv_heads, pages, page_size,
head_dim), the layout of the Pallas paged-attention kernels), and for each row a page
table (its pages in order) and a length (the tokens it holds). A row's token ``i``
sits in page ``table[row, i // page_size]`` at offset ``i % page_size``. Which pages a
row gets is the caller's (a sampler's allocator); the model only reads and writes
through the table.

A model call takes the table and lengths as its ``cache_index`` (``Pages``) and the
pool as its ``cache``: ``model(ids, valid, cache=pool, cache_index=Pages(table,
lengths))``. The tokens ``valid`` marks (all where it is None) are written after each
row's ``lengths`` (a left-padded prompt's padding is not written: positions count real
tokens only), and attend causally to the row's earlier tokens and each other. The
caller then advances ``lengths`` by each row's valid tokens.

Attention reads a row's pages through its table: on a GPU (bfloat16 or float16) and a
TPU, one decoded token per row with no sliding window, chunks or sinks runs JAX's Pallas
paged-attention kernel, which reads each row's own pages only; everything else (a
prefill through the pages, a sliding window, chunks, attention sinks, which the kernels
do not take, a CPU) gathers the table's pages into a dense view and attends over it,
masked by each row's length, as many pages per row as the call's longest row fills, at
one of four widths of the table (``table_widths``). A row's pages hold its real tokens
only, so a token's slot in that view is its position: chunks count from slot 0.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from redray.models import attention as attn

PAGE_SIZE = 16  # tokens per page: what the kernels take (a multiple of 8) and little waste
# the GPU kernel splits a row's pages into this many parts, read in parallel
GPU_SPLITS = 16


@flax.struct.dataclass
class Pages:
    """Where the rows of a paged KV cache are (a model call's ``cache_index``)::

        pool = model.init_pages(64, page_size=16)   # 64 pages of 16 tokens per layer
        table = jnp.arange(8, dtype=jnp.int32).reshape(2, 4)   # 2 rows of 4 pages each
        logits, pool = model(ids, mask, cache=pool,
                             cache_index=Pages(table, jnp.zeros(2, jnp.int32)))
        lengths = mask.sum(1)   # then one token per row: model(token[:, None], None, ...)

    Attributes:
      table: (rows, pages per row) int32: each row's pages in the pool, in order.
        Entries past a row's last page are any page (they are masked).
      lengths: (rows,) int32: the tokens each row holds before this call.
    """
    table: jax.Array
    lengths: jax.Array


def empty_pool(layers: int, pages: int, kv_heads: int, head_dim: int, dtype=jnp.float32,
               page_size: int = PAGE_SIZE) -> list[dict]:
    """A zeroed pool of ``pages`` pages: one {"k", "v"} of (kv_heads, pages, page_size,
    head_dim) per layer."""
    shape = (kv_heads, pages, page_size, head_dim)
    return [{"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)} for _ in range(layers)]


def put_rows(layer: dict, where: jax.Array, new: dict) -> dict:
    """A layer's per-row state (a linear attention's {"conv", "state"}, one row per slot)
    with rows ``where`` replaced by ``new``'s (rows past the state: dropped)."""
    return {k: layer[k].at[where].set(new[k].astype(layer[k].dtype), mode="drop")
            for k in layer}


def written(layer: dict, pages: "Pages", where: jax.Array, new: dict, valid) -> dict:
    """A layer of a pool after a prefill: an attention layer's pages with ``new``'s keys
    and values (dense, (rows, kv heads, tokens, head dim)) written through ``pages``, or
    a per-row state layer's rows ``where`` set to ``new``'s (which resets them)."""
    if "k" in layer:
        return write(layer, pages, jnp.swapaxes(new["k"], 1, 2), jnp.swapaxes(new["v"], 1, 2),
                     valid)
    return put_rows(layer, where, new)


def is_paged(cache_index) -> bool:
    return isinstance(cache_index, Pages)


def positions(pages: Pages, valid) -> jax.Array:
    """(rows, tokens) positions of a call's tokens: after each row's ``lengths``,
    counting the ``valid`` ones only (a padding token gets its successor's)."""
    before = jnp.cumsum(valid.astype(jnp.int32), axis=1) - valid.astype(jnp.int32)
    return pages.lengths[:, None] + before


def write(layer: dict, pages: Pages, k: jax.Array, v: jax.Array, valid) -> dict:
    """A layer's pool with the ``valid`` ones of the new keys and values (rows, tokens,
    kv_heads, head_dim) written at their positions; a token past its row's table (or
    padding) writes nothing."""
    pool_pages, size = layer["k"].shape[1], layer["k"].shape[2]
    pos = positions(pages, valid)
    column = pos // size
    inside = valid.astype(bool) & (column < pages.table.shape[1])
    page = jnp.take_along_axis(pages.table, jnp.minimum(column, pages.table.shape[1] - 1), 1)
    page = jnp.where(inside, page, pool_pages)  # out of range: dropped

    def put(pool, new):  # pool[:, page, offset] is (kv_heads, rows, tokens, head_dim)
        new = jnp.moveaxis(new, 2, 0).astype(pool.dtype)
        return pool.at[:, page, pos % size].set(new, mode="drop")
    return {**layer, "k": put(layer["k"], k), "v": put(layer["v"], v)}


def gathered(pool: jax.Array, table: jax.Array) -> jax.Array:
    """A pool's pages for each row, through its table, as a dense (rows, kv_heads,
    table columns x page_size, head_dim) view."""
    kv, _, size, d = pool.shape
    rows, columns = table.shape
    view = pool[:, table]  # (kv_heads, rows, columns, page_size, head_dim)
    return jnp.moveaxis(view, 0, 1).reshape(rows, kv, columns * size, d)


def attention(q, layer: dict, pages: Pages, mask: attn.AttentionMask, scale: float,
              softcap: float | None = None, sinks=None) -> jax.Array:
    """The new tokens' attention (q: (rows, tokens, heads, head_dim)) over their rows'
    pages, the new keys already written (``write``); ``mask.kv_valid``: which of the
    new tokens are real, ``mask.window`` / ``layer_window``: a sliding window,
    ``mask.chunk`` / ``layer_chunk``: chunks (counted from each row's first token);
    ``sinks``: (heads,) attention sinks, or None."""
    valid = mask.kv_valid
    pos = positions(pages, valid)
    ends = pages.lengths + valid.astype(jnp.int32).sum(1)
    kernel = None if sinks is not None else kernel_for(q, layer["k"], pages, mask)
    if kernel is not None:
        return kernel(q[:, 0], layer["k"], layer["v"], pages.table, ends, scale,
                      softcap)[:, None].astype(q.dtype)

    def over(columns):  # attention over the table's first ``columns`` pages
        table = pages.table[:, :columns]
        k, v = gathered(layer["k"], table), gathered(layer["v"], table)
        slot = jnp.arange(k.shape[2])
        seen = (slot[None, None, :] < ends[:, None, None]) & (slot[None, None, :] <= pos[..., None])
        for window in (mask.window, mask.layer_window):
            if window is not None:
                seen = seen & (pos[..., None] - slot[None, None, :] < window)
        for chunk in (mask.chunk, mask.layer_chunk):
            if chunk is not None:  # the keys of the token's chunk (slots are positions)
                seen = seen & (pos[..., None] - slot[None, None, :] <= (pos % chunk)[..., None])
        return attn.dense_attention(q, k, v, seen, scale, softcap=softcap, heads_first=True,
                                    sinks=sinks)
    widths = table_widths(pages.table.shape[1])
    if len(widths) == 1:
        return over(widths[0])
    # as many pages as the longest row fills, of a few widths (each compiled)
    need = -(-jnp.max(ends) // layer["k"].shape[2])
    branch = jnp.minimum(jnp.searchsorted(jnp.asarray(widths), need), len(widths) - 1)
    return jax.lax.switch(branch, [lambda w=w: over(w) for w in widths])


def table_widths(columns: int) -> list[int]:
    """The page-table widths the gathered path reads: a quarter, a half, three
    quarters and all of a table's ``columns`` (the longest row in the call picks one),
    each ``table_columns``."""
    return sorted({min(columns, table_columns(-(-columns * k // 4))) for k in (1, 2, 3, 4)})


def table_columns(pages: int) -> int:
    """A page table's columns for rows of up to ``pages`` pages: exact up to
    ``GPU_SPLITS``, then a multiple of it (the parts the GPU kernel splits a row into)."""
    return pages if pages <= GPU_SPLITS else -(-pages // GPU_SPLITS) * GPU_SPLITS


def kernel_for(q, pool, pages: Pages, mask: attn.AttentionMask):
    """JAX's Pallas paged-attention kernel for this call, or None where it does not
    apply: one new token per row, no sliding window or chunks, the live platform's
    kernel (GPU: bfloat16 or float16; TPU: a head size that is a multiple of 128),
    "auto" attention asked for (``REDRAY_ATTENTION``). (Nor sinks: ``attention``.)"""
    platform = jax.default_backend()
    if q.shape[1] != 1 or mask.sliding or mask.chunking or attn.implementation() != "auto":
        return None
    if platform == "gpu" and q.dtype in (jnp.bfloat16, jnp.float16) \
            and pages.table.shape[1] % min(GPU_SPLITS, pages.table.shape[1]) == 0:
        return gpu_kernel
    if platform == "tpu" and q.shape[-1] % 128 == 0 and pool.shape[2] % 8 == 0:
        return tpu_kernel
    return None


def gpu_kernel(q, k_pool, v_pool, table, lengths, scale, softcap, interpret: bool = False):
    """JAX's Triton paged-attention kernel (q: (rows, heads, head_dim), scaled here)."""
    from jax.experimental.pallas.ops.gpu import paged_attention as kernels
    splits = min(GPU_SPLITS, table.shape[1])
    return kernels.paged_attention(
        (q * scale).astype(q.dtype), k_pool, v_pool, table, lengths.astype(jnp.int32),
        k_splits=splits, pages_per_compute_block=min(8, table.shape[1] // splits),
        attn_logits_soft_cap=softcap, interpret=interpret)


def tpu_kernel(q, k_pool, v_pool, table, lengths, scale, softcap):
    """JAX's Mosaic paged-attention kernel (q: (rows, heads, head_dim), scaled here)."""
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention
    per_block = max(c for c in (1, 2, 4, 8) if table.shape[1] % c == 0)
    return paged_attention((q * scale).astype(q.dtype), k_pool, v_pool,
                           lengths.astype(jnp.int32), table, attn_logits_soft_cap=softcap,
                           pages_per_compute_block=per_block)
