"""The paged decode cache of an attention layer (`PagedKVCache`, `to_paged`) and the attention
layer's decode steps that read it through `paged_gqa_decode` (docs/inference.md#paged-kv-cache).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from gdp_jax.layers import GroupedQueryAttention, KVCache, _check_room, apply_rope
from gdp_jax.ops.gqa_decode.api import paged_gqa_decode


class PagedKVCache(NamedTuple):
  """Paged decode cache of one attention layer (docs/inference.md#paged-kv-cache): key_pages,
  value_pages [num_pages, page_size, Hkv, Dh] (keys already rotated), block_tables
  [B, max_pages] int32 (position p of sequence b is slot p % page_size of page
  block_tables[b, p // page_size]) and lengths [B] int32 (tokens each sequence holds)."""

  key_pages: jax.Array
  value_pages: jax.Array
  block_tables: jax.Array
  lengths: jax.Array


def to_paged(cache: KVCache, page_size: int) -> PagedKVCache:
  """A dense `KVCache` [B, S, Hkv, Dh] (S a multiple of page_size) moved into a page pool of
  B * S / page_size pages. The sequences' pages are interleaved in the pool (page i of sequence b
  is page i * B + b), so the decode reads them through the table, as from a server's pool."""
  batch, size, kv_heads, dim = cache.key.shape
  if size % page_size:
    raise ValueError(f"the cache's {size} slots are not a multiple of page_size = {page_size}")
  max_pages = size // page_size
  tables = jnp.arange(max_pages, dtype=jnp.int32)[None, :] * batch
  tables = tables + jnp.arange(batch, dtype=jnp.int32)[:, None]

  def pages(x):
    pool = jnp.zeros((batch * max_pages, page_size, kv_heads, dim), x.dtype)
    return pool.at[tables.reshape(-1)].set(x.reshape(batch * max_pages, page_size, kv_heads, dim))

  return PagedKVCache(pages(cache.key), pages(cache.value), tables, cache.lengths)


def paged_attention_step(
  layer: GroupedQueryAttention, x: jax.Array, cache: PagedKVCache
) -> tuple[jax.Array, PagedKVCache]:
  """`layer.step` with a `PagedKVCache`: one token per sequence at position cache.lengths[b],
  written into its page, then `paged_gqa_decode` (x [B, D] -> (y [B, D], cache)). As in the
  dense step, a token past the capacity (max_pages * page_size) is dropped."""
  batch = x.shape[0]
  if layer.dtype is not None:
    x = x.astype(layer.dtype)
  q, k, v = layer._qkv(x)  # [B, H, Dh]
  pos = cache.lengths
  q, k = apply_rope(q, pos, layer.rope_theta), apply_rope(k, pos, layer.rope_theta)
  num_pages, page_size = cache.key_pages.shape[:2]
  max_pages = cache.block_tables.shape[1]
  entry = jnp.minimum(pos // page_size, max_pages - 1)[:, None]
  page = jnp.take_along_axis(cache.block_tables, entry, axis=1)[:, 0]
  page = jnp.where(pos < max_pages * page_size, page, num_pages)  # out of range: dropped
  slot = pos % page_size
  key_pages = cache.key_pages.at[page, slot].set(k.astype(cache.key_pages.dtype), mode="drop")
  value_pages = cache.value_pages.at[page, slot].set(v.astype(cache.value_pages.dtype), mode="drop")
  lengths = pos + 1
  o = paged_gqa_decode(
    q, key_pages, value_pages, cache.block_tables, lengths, implementation=layer.implementation
  )
  y = layer.o_proj(o.astype(x.dtype).reshape(batch, layer.num_heads * layer.head_dim))
  return y, PagedKVCache(key_pages, value_pages, cache.block_tables, lengths)


def paged_attention_step_tokens(
  layer: GroupedQueryAttention, x: jax.Array, cache: PagedKVCache
) -> tuple[jax.Array, PagedKVCache]:
  """`layer.step_tokens` with a `PagedKVCache`: Tq new tokens per sequence at positions
  cache.lengths[b] + i, written into their pages, then `paged_gqa_decode` with the
  [B, Tq, Hq, Dh] query (x [B, Tq, D] -> (y [B, Tq, D], cache)); the same as Tq calls of
  `paged_attention_step`. Tq beyond the capacity (max_pages * page_size), or concrete lengths
  with lengths + Tq beyond it, are a ValueError; under `jax.jit` tokens past it are dropped."""
  if not hasattr(x, "ndim") or x.ndim != 3 or x.shape[-1] != layer.hidden_size:
    raise ValueError(
      f"x has shape {tuple(np.shape(x))}, expected [B, Tq, D] (Tq new tokens per sequence) "
      f"with D = hidden_size = {layer.hidden_size}"
    )
  if not isinstance(cache, PagedKVCache):
    raise TypeError(f"cache must be a PagedKVCache, got {type(cache).__name__}")
  batch, t_len, _ = x.shape
  if cache.lengths.shape != (batch,) or cache.block_tables.shape[0] != batch:
    raise ValueError(
      f"cache.lengths {tuple(cache.lengths.shape)} and cache.block_tables "
      f"{tuple(cache.block_tables.shape)} must have B = {batch} rows (x of shape "
      f"{tuple(x.shape)}): a cache of another batch size?"
    )
  num_pages, page_size = cache.key_pages.shape[:2]
  max_pages = cache.block_tables.shape[1]
  capacity = max_pages * page_size
  _check_room(cache.lengths, t_len, capacity, "the cache's pages (max_pages * page_size)")
  if layer.dtype is not None:
    x = x.astype(layer.dtype)
  q, k, v = layer._qkv(x)  # [B, Tq, H, Dh]
  pos = cache.lengths[:, None] + jnp.arange(t_len, dtype=jnp.int32)  # [B, Tq]
  q, k = apply_rope(q, pos, layer.rope_theta), apply_rope(k, pos, layer.rope_theta)
  entry = jnp.minimum(pos // page_size, max_pages - 1)
  page = jnp.take_along_axis(cache.block_tables, entry, axis=1)
  page = jnp.where(pos < capacity, page, num_pages)  # out of range: dropped
  slot = pos % page_size
  key_pages = cache.key_pages.at[page, slot].set(k.astype(cache.key_pages.dtype), mode="drop")
  value_pages = cache.value_pages.at[page, slot].set(v.astype(cache.value_pages.dtype), mode="drop")
  lengths = cache.lengths + t_len
  o = paged_gqa_decode(
    q, key_pages, value_pages, cache.block_tables, lengths, implementation=layer.implementation
  )
  y = layer.o_proj(o.astype(x.dtype).reshape(batch, t_len, layer.num_heads * layer.head_dim))
  return y, PagedKVCache(key_pages, value_pages, cache.block_tables, lengths)
