"""`implementation="reference"` of paged grouped-query decode: the definition, position by
position (float32) (docs/inference.md#paged-kv-cache)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from gdp_jax.ops.base import Implementation

HIGHEST = jax.lax.Precision.HIGHEST


def paged_gqa_decode_reference(query, key_pages, value_pages, block_tables, lengths, scale):
  """The definition, position by position: sequence b's position p is slot p % page_size of
  page block_tables[b, p // page_size]; token t attends to positions p <= lengths[b] - Tq + t
  with a plain masked softmax (float32)."""
  f32 = jnp.float32
  batch, tq, q_heads, _ = query.shape
  _, page_size, kv_heads, _ = key_pages.shape
  pos = jnp.arange(block_tables.shape[1] * page_size)
  page = block_tables[:, pos // page_size]  # [B, C]
  key = key_pages[page, pos % page_size].astype(f32)  # [B, C, Hkv, D]
  value = value_pages[page, pos % page_size].astype(f32)
  head = jnp.arange(q_heads) // (q_heads // kv_heads)  # cache head of each query head
  key, value = key[:, :, head], value[:, :, head]  # [B, C, Hq, D]
  sees = pos[None, None, :] <= (lengths[:, None] - tq + jnp.arange(tq))[:, :, None]  # [B, Tq, C]
  sees = sees[:, :, None, :]  # [B, Tq, 1, C]
  s = jnp.einsum("bthd,bchd->bthc", query.astype(f32), key, precision=HIGHEST) * scale
  w = jax.nn.softmax(jnp.where(sees, s, -jnp.inf), axis=-1, where=sees)
  w = jnp.where(sees, w, 0.0)  # rows that see nothing: zeros
  value = jnp.where((pos[None, :] < lengths[:, None])[:, :, None, None], value, 0.0)
  return jnp.einsum("bthc,bchd->bthd", w, value, precision=HIGHEST)


@dataclasses.dataclass(frozen=True)
class ReferencePagedGqaDecode(Implementation):
  """As `XlaPagedGqaDecode` (gdp_jax/ops/gqa_decode/xla.py)."""

  automatic: ClassVar[bool] = False
  name: ClassVar[str] = "reference"
  summary: ClassVar[str] = (
    "the definitions in float32 (the recurrence over time; paged decode position by position): "
    "the ground truth"
  )

  def __call__(self, query, key_pages, value_pages, block_tables, lengths, scale):
    return paged_gqa_decode_reference(query, key_pages, value_pages, block_tables, lengths, scale)
