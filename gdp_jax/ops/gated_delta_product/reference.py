"""The recurrent reference: the gated delta product token by token
(docs/operator.md#the-recurrence).

Ground truth for every other implementation. Plain `lax.scan` over time, float32 throughout, no
chunking. Inputs are already validated and normalised by `gdp_jax.ops.gated_delta_product.api`:

  q, k: [B, T, H, K]   v: [B, T, HV, V]   g, beta: [B, T, HV]
  mask: [B, T, HV, r, r] (broadcastable)   initial_state: [B, HV, K, V] float32

HV is a multiple of H (grouped value heads): q and k are repeated across each group first
(`operator.expand_key_heads`). Packed sequences (`cu_seqlens`, docs/varlen.md) run the same scan
over the packed row, with the state replaced by the sequence's initial state at each sequence's
first token.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from gdp_jax.ops.gated_delta_product import nonfinite, varlen
from gdp_jax.ops.gated_delta_product.base import GatedDeltaProductImplementation, packed_states
from gdp_jax.ops.heads import expand_key_heads

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
  marked nan (gdp_jax/ops/gated_delta_product/nonfinite.py), so a bad token never reaches earlier
  gradients through `0 * nan` in the scan's backward.
  """
  q, k = (expand_key_heads(x, v.shape[2]) for x in (q, k))
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


def gated_delta_product_reference_varlen(q, k, v, g, beta, mask, initial_state, scale, cu_seqlens):
  """Packed sequences (docs/varlen.md): q, k [1, T, H, K], v [1, T, HV, V], g, beta [1, T, HV],
  mask [1, Tm, Hm, r, r], initial_state [N, HV, K, V] float32, cu_seqlens [N + 1] int.

  One scan over the T tokens: at a sequence's first token the state becomes that sequence's
  initial state; after its last token the state is stored as its final state (a sequence without
  tokens keeps its initial state). Returns (o [1, T, HV, V] float32, final [N, HV, K, V] float32).
  A non-finite input spoils its own sequence only (`varlen.clean`).
  """
  t_len = q.shape[1]
  q, k = (expand_key_heads(x, v.shape[2]) for x in (q, k))
  cu = varlen.sanitize(cu_seqlens, t_len)
  (q, k, v, g, beta, mask), marks = varlen.clean(q, k, v, g, beta, mask, cu)
  seq, first, last = varlen.token_boundaries(cu, t_len)
  mask = jnp.broadcast_to(mask, q.shape[:3] + mask.shape[-2:])
  h0 = initial_state.astype(jnp.float32)

  def step(carry, xs):
    state, finals = carry
    *token, n, is_first, is_last = xs
    state = jnp.where(is_first, h0[n][None], state)
    o, state = recurrent_step(*token, state, scale)
    finals = finals.at[n].set(jnp.where(is_last, state[0], finals[n]))
    return (state, finals), o

  time_major = lambda x: jnp.moveaxis(x, 1, 0)
  xs = tuple(time_major(x) for x in (q, k, v, g, beta, mask)) + (seq, first, last)
  (_, final), o = jax.lax.scan(step, (h0[:1], h0), xs)
  return nonfinite.mark(jnp.moveaxis(o, 0, 1), final, marks)


@dataclasses.dataclass(frozen=True)
class ReferenceGatedDeltaProduct(GatedDeltaProductImplementation):
  """The recurrence over time in float32 (no chunks): the ground truth."""

  name: ClassVar[str] = "reference"
  summary: ClassVar[str] = (
    "the definitions in float32 (the recurrence over time; paged decode position by position): "
    "the ground truth"
  )
  automatic: ClassVar[bool] = False

  def time_multiple(self, chunk_size, key_blocks):
    return 1  # a recurrence: no chunks

  def __call__(self, q, k, v, g, beta, mask, initial_state, scale, chunk_size):
    del chunk_size
    return gated_delta_product_reference(q, k, v, g, beta, mask, initial_state, scale)

  def varlen(self, q, k, v, g, beta, mask, initial_state, scale, chunk_size, cu_seqlens):
    del chunk_size
    initial_state = packed_states(initial_state, q, v, cu_seqlens)
    return gated_delta_product_reference_varlen(
      q, k, v, g, beta, mask, initial_state, scale, cu_seqlens
    )
