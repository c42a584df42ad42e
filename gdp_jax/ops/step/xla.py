"""`implementation="xla"` of the recurrent step: the recurrence's own step in jnp
(docs/inference.md#the-recurrent-step)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp

from gdp_jax.ops.base import Implementation
from gdp_jax.ops.gated_delta_product.reference import recurrent_step


def gated_delta_product_step_xla(q, k, v, g, beta, mask, state, scale):
  """The jnp step (gdp_jax/ops/gated_delta_product/reference.py's recurrent_step)."""
  batch, heads = q.shape[:2]
  r = mask.shape[-1]
  mask_b = jnp.broadcast_to(mask, (batch, heads, r, r))
  o, new = recurrent_step(q, k, v, g, beta, mask_b, state, scale)
  return o.astype(q.dtype), new


@dataclasses.dataclass(frozen=True)
class XlaStep(Implementation):
  """q, k [B, HV, K]; v [B, HV, V]; g, beta [B, HV]; mask [Bm, Hm, r, r]; state [B, HV, K, V]
  float32; scale a float or an array -> (o [B, HV, V] in q's dtype, new state float32)."""

  name: ClassVar[str] = "xla"
  summary: ClassVar[str] = "the chunked WY form and the steps in jnp (any backend)"

  def __call__(self, q, k, v, g, beta, mask, state, scale):
    return gated_delta_product_step_xla(q, k, v, g, beta, mask, state, scale)
