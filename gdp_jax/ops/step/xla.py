"""`implementation="xla"` of the recurrent step: the recurrence's own step in jnp
(docs/inference.md#the-recurrent-step)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
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


def gated_delta_product_verify_xla(q, k, v, g, beta, mask, state, scale):
  """Tq steps in one unrolled loop: q, k [B, Tq, HV, K]; v [B, Tq, HV, V]; g, beta [B, Tq, HV];
  mask [Bm, Tm, Hm, r, r] -> (o [B, Tq, HV, V] in q's dtype, states [B, Tq, HV, K, V] f32)."""
  batch, t_q, heads = q.shape[:3]
  mask = jnp.broadcast_to(mask, (batch, t_q, heads) + mask.shape[-2:])

  def step(state, xs):
    o, state = recurrent_step(*xs, state, scale)
    return state, (o, state)

  xs = tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v, g, beta, mask))
  _, (o, states) = jax.lax.scan(step, state.astype(jnp.float32), xs, unroll=True)
  return jnp.moveaxis(o, 0, 1).astype(q.dtype), jnp.moveaxis(states, 0, 1)


@dataclasses.dataclass(frozen=True)
class XlaStep(Implementation):
  """q, k [B, HV, K]; v [B, HV, V]; g, beta [B, HV]; mask [Bm, Hm, r, r]; state [B, HV, K, V]
  float32; scale a float or an array -> (o [B, HV, V] in q's dtype, new state float32)."""

  name: ClassVar[str] = "xla"
  summary: ClassVar[str] = "the chunked WY form and the steps in jnp (any backend)"

  def __call__(self, q, k, v, g, beta, mask, state, scale):
    return gated_delta_product_step_xla(q, k, v, g, beta, mask, state, scale)

  def verify(self, q, k, v, g, beta, mask, state, scale):
    """Tq tokens, the state after each kept (`gated_delta_product_verify_xla`)."""
    return gated_delta_product_verify_xla(q, k, v, g, beta, mask, state, scale)
