"""Packed variable-length sequences (`cu_seqlens`, docs/varlen.md): the offsets' helpers and the
chunk-aligned padded layout, from gdp_jax/ops/gated_delta_product/varlen.py."""

from gdp_jax.ops.gated_delta_product.varlen import (
  Layout,
  block_offsets,
  chunk_initial_states,
  chunk_tokens,
  clean,
  final_states,
  layout,
  max_chunks,
  pack,
  sanitize,
  sequence_chunks,
  token_boundaries,
  token_sequences,
  unpack,
)

__all__ = [
  "Layout",
  "block_offsets",
  "chunk_initial_states",
  "chunk_tokens",
  "clean",
  "final_states",
  "layout",
  "max_chunks",
  "pack",
  "sanitize",
  "sequence_chunks",
  "token_boundaries",
  "token_sequences",
  "unpack",
]
