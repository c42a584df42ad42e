"""The recurrent reference: the gated delta product token by token
(docs/operator.md#the-recurrence).

Ground truth for every other implementation. Plain `lax.scan` over time, float32 throughout, no
chunking. Inputs are already validated and normalised by `gdp_jax.operator`:

  q, k: [B, T, H, K]   v: [B, T, H, V]   g, beta: [B, T, H]   mask: [B, T, H, r, r] (broadcastable)
  initial_state: [B, H, K, V] float32
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from gdp_jax import nonfinite

HIGHEST = jax.lax.Precision.HIGHEST


def recurrent_step(q, k, v, g, beta, mask, state, scale):
  """One token of the recurrence (docs/operator.md#the-recurrence) for every (batch, head).

  q, k: [B, H, K]; v: [B, H, V]; g, beta: [B, H]; mask: [B, H, r, r]; state: [B, H, K, V] (f32).
  Returns (o [B, H, V] f32, new state [B, H, K, V] f32).
  """
  f32 = jnp.float32
  q, k, v, g, beta, mask = (x.astype(f32) for x in (q, k, v, g, beta, mask))
  bsz, heads, dim_k, dim_v = state.shape
  r = mask.shape[-1]
  dk = dim_k // r
  decayed = jnp.exp(g)[..., None, None] * state  # S' = exp(g) S
  kb = k.reshape(bsz, heads, r, dk)  # key blocks k^(d)
  sb = decayed.reshape(bsz, heads, r, dk, dim_v)  # state row blocks S'^(d)
  proj = jnp.einsum("bhdk,bhdkv->bhdv", kb, sb, precision=HIGHEST)  # (k^(d))^T S'^(d)
  pred = jnp.einsum("bhad,bhdv->bhav", mask, proj, precision=HIGHEST)  # sum_d M[a,d] ...
  err = beta[..., None, None] * (v[:, :, None, :] - pred)  # u_a, [B, H, r, V]
  new = sb + kb[..., None] * err[:, :, :, None, :]  # block a writes its rows
  new = new.reshape(bsz, heads, dim_k, dim_v)
  o = jnp.einsum("bhk,bhkv->bhv", q, new, precision=HIGHEST)
  return scale * o, new


def gated_delta_product_reference(q, k, v, g, beta, mask, initial_state, scale):
  """Returns (o [B, T, H, V] float32, final_state [B, H, K, V] float32).

  g = -inf resets the state (exp(-inf) = 0). Non-finite inputs stay causal in the forward and in
  the backward: the scan runs on cleaned inputs and the outputs from the first bad token on are
  marked nan (gdp_jax/nonfinite.py), so a bad token never reaches earlier gradients through
  `0 * nan` in the scan's backward.
  """
  (q, k, v, g, beta, mask), marks = nonfinite.clean(q, k, v, g, beta, mask)
  o, final = _scan(q, k, v, g, beta, mask, initial_state, scale)
  return nonfinite.mark(o, final, marks)


def _scan(q, k, v, g, beta, mask, initial_state, scale):
  bsz, t_len, heads, _ = q.shape
  mask = jnp.broadcast_to(mask, (bsz, t_len, heads) + mask.shape[-2:])

  def step(state, xs):
    o, state = recurrent_step(*xs, state, scale)
    return state, o

  time_major = lambda x: jnp.moveaxis(x, 1, 0)
  xs = tuple(time_major(x) for x in (q, k, v, g, beta, mask))
  final, o = jax.lax.scan(step, initial_state.astype(jnp.float32), xs)
  return jnp.moveaxis(o, 0, 1), final
