"""Flax (`flax.nnx`) layers, one per file: the gated delta product token mixer
(`delta_product.py`) and grouped-query attention (`attention.py`), with the short convolution
(`short_conv.py`), the block masks (`masks.py`) and what they share (`common.py`).

Both layers run in two modes that agree with each other:

- the whole sequence, `layer(x, lengths=None, *, segment_ids=None, return_cache=False)`: the
  chunked operator (Pallas kernels on a GPU, `implementation=None`) or causal attention; with
  `return_cache=True` it also returns the cache after each sequence's first `lengths[b]` tokens
  (a prefill of right-padded prompts of different lengths); with `segment_ids` [B, T] several
  documents are packed in one row and none sees another (see `segment_starts`); the gated delta
  product layer also takes `cu_seqlens` [N + 1] for N documents packed in one row (the
  operator's variable-length form, docs/varlen.md);
- one token per sequence, `layer.step(x_t, cache) -> (y_t, cache)`, through
  `gated_delta_product_step` or `gqa_decode`; `layer.init_cache(...)` is the empty cache;
- Tq new tokens per sequence after a cache, `layer.step_tokens(x [B, Tq, D], cache)` (the same as
  Tq steps: speculative verification, chunked prefill from a cache).

Caches are plain pytrees (NamedTuples) passed in and returned, never stored in the module, so a
decode loop can carry them through `jax.lax.scan` / `jax.jit`.

From `flax.linen` code use `flax.nnx.bridge.to_linen(GatedDeltaProduct, ...)` (see
`tests/test_layers.py::test_linen_bridge`).
"""

from gdp_jax.layers.attention import GroupedQueryAttention, KVCache, apply_rope
from gdp_jax.layers.attention import _flash_attention as _flash_attention  # benchmarks use it
from gdp_jax.layers.common import (
  ATTENTION_IMPLS,
  KEY_NORMS,
  MASK_MODES,
  RESET_LOG_DECAY,
  GatedRMSNorm,
  Linear,
  l2norm,
  segment_starts,
)
from gdp_jax.layers.common import _check_room as _check_room  # models use it
from gdp_jax.layers.delta_product import GatedDeltaProduct, GatedDeltaProductCache
from gdp_jax.layers.masks import block_mask
from gdp_jax.layers.short_conv import ShortConv

__all__ = [
  "ATTENTION_IMPLS",
  "KEY_NORMS",
  "MASK_MODES",
  "RESET_LOG_DECAY",
  "GatedDeltaProduct",
  "GatedDeltaProductCache",
  "GatedRMSNorm",
  "GroupedQueryAttention",
  "KVCache",
  "Linear",
  "ShortConv",
  "apply_rope",
  "block_mask",
  "l2norm",
  "segment_starts",
]
