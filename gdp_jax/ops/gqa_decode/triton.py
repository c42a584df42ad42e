"""`implementation="triton"` of grouped-query decode, dense and paged: the Pallas kernels
(pallas_kernels/triton/inference/), no derivatives (docs/inference.md)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from gdp_jax.ops.autodiff import no_gradients_message, raise_if_differentiated
from gdp_jax.ops.base import Implementation
from pallas_kernels.triton.inference import decode_attention, paged_decode_attention


def gqa_decode_triton(query, key_cache, value_cache, lengths, scale):
  """The Pallas kernel (pallas_kernels/triton/inference/decode_attention.py); scale a float or
  array."""
  if isinstance(scale, jax.Array):
    query = query.astype(jnp.float32) * scale
    scale = 1.0
  kernel = raise_if_differentiated(
    lambda *a: decode_attention.gqa_decode(*a, scale=scale), no_gradients_message("gqa_decode")
  )
  return kernel(query, key_cache, value_cache, lengths)


def paged_gqa_decode_triton(query, key_pages, value_pages, block_tables, lengths, scale):
  """The Pallas kernel (pallas_kernels/triton/inference/paged_decode_attention.py)."""
  if isinstance(scale, jax.Array):
    query = query.astype(jnp.float32) * scale
    scale = 1.0
  kernel = raise_if_differentiated(
    lambda *a: paged_decode_attention.paged_gqa_decode(*a, scale=scale),
    no_gradients_message("paged_gqa_decode"),
  )
  return kernel(query, key_pages, value_pages, block_tables, lengths)


@dataclasses.dataclass(frozen=True)
class TritonGqaDecode(Implementation):
  """As `XlaGqaDecode` (gdp_jax/ops/gqa_decode/xla.py)."""

  name: ClassVar[str] = "triton"
  summary: ClassVar[str] = "Pallas GPU kernels through the Triton lowering (interpreted off a GPU)"
  platforms: ClassVar[tuple[str, ...]] = ("gpu",)
  pallas: ClassVar[bool] = True

  def __call__(self, query, key_cache, value_cache, lengths, scale):
    return gqa_decode_triton(query, key_cache, value_cache, lengths, scale)


@dataclasses.dataclass(frozen=True)
class TritonPagedGqaDecode(Implementation):
  """As `XlaPagedGqaDecode` (gdp_jax/ops/gqa_decode/xla.py)."""

  name: ClassVar[str] = "triton"
  summary: ClassVar[str] = "Pallas GPU kernels through the Triton lowering (interpreted off a GPU)"
  platforms: ClassVar[tuple[str, ...]] = ("gpu",)
  pallas: ClassVar[bool] = True

  def __call__(self, query, key_pages, value_pages, block_tables, lengths, scale):
    return paged_gqa_decode_triton(query, key_pages, value_pages, block_tables, lengths, scale)
