"""Flax (`flax.nnx`) layers, one per file: the block-masked gated delta product token mixer
`GatedDeltaProduct` (`delta_product.py`), DeltaProduct `HouseholderDeltaProduct`
(`householder.py`) and grouped-query attention (`attention.py`), with the short convolution
(`short_conv.py`), the block mask (`masks.py`), the two delta layers' shared skeleton
(`delta_mixer.py`) and what all of them share (`common.py`). docs/layers.md describes them.

The two delta layers run their sequence operator through callables they are given (as flax's
`MultiHeadAttention` takes `attention_fn`): `operator_fn` for the whole sequence and `step_fn`
for one token, by default `gdp_jax.gated_delta_product` / `gated_delta_product_step` (or the
Householder pair) with the layer's `chunk_size` and `implementation` applied;
`GatedDeltaProduct(..., sharding=...)` builds the sharded pair. Every parameter carries logical
axis names (`nnx.with_partitioning`, `partitioning.py`; `LOGICAL_AXIS_RULES` maps them onto a
("data", "model") mesh) for data x tensor parallel training under plain `jax.jit`.

All layers run in two modes that agree with each other:

- the whole sequence, `layer(x, lengths=None, *, segment_ids=None, return_cache=False)`: the
  chunked operator (Pallas kernels on a GPU, `implementation=None`) or causal attention; with
  `return_cache=True` it also returns the cache after each sequence's first `lengths[b]` tokens
  (a prefill of right-padded prompts of different lengths); with `segment_ids` [B, T] several
  documents are packed in one row and none sees another (see `segment_starts`); the delta
  layers also take `cu_seqlens` [N + 1] for N documents packed in one row (the operator's
  variable-length form, docs/varlen.md);
- one token per sequence, `layer.step(x_t, cache) -> (y_t, cache)`, through the step
  (`gated_delta_product_step`) or `gqa_decode`; `layer.init_cache(...)` is the empty cache;
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
from gdp_jax.layers.delta_mixer import GatedDeltaProductCache
from gdp_jax.layers.delta_product import GatedDeltaProduct
from gdp_jax.layers.householder import HouseholderDeltaProduct
from gdp_jax.layers.masks import block_mask
from gdp_jax.layers.partitioning import LOGICAL_AXIS_RULES
from gdp_jax.layers.short_conv import ShortConv

__all__ = [
  "ATTENTION_IMPLS",
  "KEY_NORMS",
  "LOGICAL_AXIS_RULES",
  "MASK_MODES",
  "RESET_LOG_DECAY",
  "GatedDeltaProduct",
  "GatedDeltaProductCache",
  "GatedRMSNorm",
  "GroupedQueryAttention",
  "HouseholderDeltaProduct",
  "KVCache",
  "Linear",
  "ShortConv",
  "apply_rope",
  "block_mask",
  "l2norm",
  "segment_starts",
]
