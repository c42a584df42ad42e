"""`implementation="xla"` of grouped-query decode, dense and paged: jnp, float32 at HIGHEST
(docs/inference.md)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from gdp_jax.ops.base import Implementation

HIGHEST = jax.lax.Precision.HIGHEST


def gqa_decode_xla(query, key_cache, value_cache, lengths, scale):
  """The jnp version: query [B, Tq, Hq, D], caches [B, S, Hkv, D], lengths [B] int (clipped to
  [0, S]) -> f32 [B, Tq, Hq, D].

  Token t of sequence b sees slots j <= lengths[b] - Tq + t. Other scores are set to -inf before
  the softmax, and values of slots j >= lengths[b] to 0 (a `where`, so even an inf in a stale
  slot cannot make a NaN).
  """
  f32 = jnp.float32
  batch, tq, q_heads, dim = query.shape
  _, seq_len, kv_heads, _ = key_cache.shape
  group = q_heads // kv_heads
  q = query.astype(f32).reshape(batch, tq, kv_heads, group, dim)
  pos = jnp.arange(seq_len, dtype=jnp.int32)
  limit = lengths[:, None] - (tq - 1) + jnp.arange(tq, dtype=jnp.int32)  # [B, Tq], exclusive
  visible = pos[None, None, :] < limit[:, :, None]  # [B, Tq, S]
  s = jnp.einsum("btkgd,bskd->btkgs", q, key_cache.astype(f32), precision=HIGHEST) * scale
  s = jnp.where(visible[:, :, None, None, :], s, -jnp.inf)
  m = jnp.max(s, axis=-1, keepdims=True)
  p = jnp.exp(s - jnp.where(m == -jnp.inf, 0.0, m))  # invisible: 0
  total = jnp.sum(p, axis=-1)
  stale = pos[None, :] >= lengths[:, None]  # [B, S]
  v = jnp.where(stale[:, :, None, None], 0.0, value_cache.astype(f32))
  o = jnp.einsum("btkgs,bskd->btkgd", p, v, precision=HIGHEST)
  o = o / jnp.where(total > 0, total, 1.0)[..., None]
  return o.reshape(batch, tq, q_heads, dim)


def paged_gqa_decode_xla(query, key_pages, value_pages, block_tables, lengths, scale):
  """The jnp version: gather each sequence's pages into a dense [B, max_pages * page_size,
  Hkv, D] cache (reads every page of the table: XLA cannot follow the lengths), then
  `gqa_decode_xla`. Table entries are in [0, num_pages) (clipped by the caller)."""
  num_pages, page_size, kv_heads, dim = key_pages.shape
  batch, max_pages = block_tables.shape
  dense_shape = (batch, max_pages * page_size, kv_heads, dim)
  key = jnp.take(key_pages, block_tables, axis=0).reshape(dense_shape)
  value = jnp.take(value_pages, block_tables, axis=0).reshape(dense_shape)
  return gqa_decode_xla(query, key, value, lengths, scale)


@dataclasses.dataclass(frozen=True)
class XlaGqaDecode(Implementation):
  """query [B, Tq, Hq, D], caches [B, S, Hkv, D], lengths [B] int32 in [0, S], scale a float or
  an array -> float32 [B, Tq, Hq, D]."""

  name: ClassVar[str] = "xla"
  summary: ClassVar[str] = "the chunked WY form and the steps in jnp (any backend)"

  def __call__(self, query, key_cache, value_cache, lengths, scale):
    return gqa_decode_xla(query, key_cache, value_cache, lengths, scale)


@dataclasses.dataclass(frozen=True)
class XlaPagedGqaDecode(Implementation):
  """query [B, Tq, Hq, D], pages [num_pages, page_size, Hkv, D], block_tables [B, max_pages]
  int32 in [0, num_pages), lengths [B] int32 -> float32 [B, Tq, Hq, D]."""

  name: ClassVar[str] = "xla"
  summary: ClassVar[str] = "the chunked WY form and the steps in jnp (any backend)"

  def __call__(self, query, key_pages, value_pages, block_tables, lengths, scale):
    return paged_gqa_decode_xla(query, key_pages, value_pages, block_tables, lengths, scale)
