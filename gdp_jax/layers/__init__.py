"""Flax (`flax.nnx`) layers, one per file (docs/layers.md): the block-masked gated delta product
token mixer `GatedDeltaProduct` (delta_product.py), DeltaProduct `HouseholderDeltaProduct`
(householder.py) and grouped-query attention (attention.py), with the short convolution
(short_conv.py), the block mask (masks.py), the delta layers' skeleton (delta_mixer.py,
delta_common.py), the logical axis names of the parameters (partitioning.py) and what all of
them share (common.py).

The delta layers run their operator through callables they are given (`operator_fn`, `step_fn`;
docs/layers.md#operator-callables). Every layer runs the whole sequence (`layer(x, ...)`, packed
documents and a prefill cache included), one token (`layer.step`) or Tq tokens after a cache
(`layer.step_tokens`), and the modes agree; caches are plain pytrees passed in and returned.
From `flax.linen` code use `flax.nnx.bridge.to_linen(GatedDeltaProduct, ...)`.
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
from gdp_jax.layers.delta_common import GatedDeltaProductCache
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
