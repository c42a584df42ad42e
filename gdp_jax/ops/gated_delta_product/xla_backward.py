"""The jnp backward of the chunked (WY) form, whole: the vjp of `xla.gated_delta_product_xla`
(and of its packed form, docs/varlen.md) composed from the stages of `xla_backward_stages`, and
`with_xla_backward`, the custom_vjp behind `backward="xla"` of the Pallas implementations
(docs/chunked_form.md#the-backward).

The backward takes the primal inputs and recomputes what it needs (gcum, w, u, h, v_new); Ai may
be passed in from the forward. Resets enter as in the forward (a reset's dg is exactly 0), and
non-finite inputs are cleaned and their outputs' cotangents marked as in the forward
(nonfinite.py; docs/precision.md#non-finite-inputs). Grouped value heads repeat q and k across
each group and sum dq and dk back over it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from gdp_jax.ops.gated_delta_product import nonfinite, varlen
from gdp_jax.ops.gated_delta_product import xla as _xla
from gdp_jax.ops.gated_delta_product.xla import f32
from gdp_jax.ops.gated_delta_product.xla_backward_stages import (
  chunk_bwd_dhu,
  chunk_bwd_dhu_varlen,
  chunk_bwd_dqkwg,
  chunk_bwd_dv_local,
  chunk_local_reverse_cumsum,
  reduce_dmask,
  wy_bwd,
)
from gdp_jax.ops.heads import expand_key_heads, sum_key_heads

__all__ = [
  "chunk_bwd_dv_local",
  "chunk_bwd_dhu",
  "chunk_bwd_dhu_varlen",
  "chunk_bwd_dqkwg",
  "wy_bwd",
  "reduce_dmask",
  "chunk_local_reverse_cumsum",
  "gated_delta_product_xla_bwd",
  "gated_delta_product_xla_varlen_bwd",
  "with_xla_backward",
]


# ----------------------------------------------------------------------------------------------
# 6. the whole backward
# ----------------------------------------------------------------------------------------------


def gated_delta_product_xla_bwd(
  q, k, v, g, beta, mask, initial_state, scale, chunk_size, do, dfinal, ai=None
):
  """The vjp of `xla.gated_delta_product_xla` (same padded, normalised inputs), resets and
  non-finite inputs included (gdp_jax/ops/gated_delta_product/nonfinite.py).

  do: [B,Tp,HV,V] cotangent of o; dfinal: [B,HV,K,V] cotangent of the final state (or None).
  ai: the forward's (I + Ag)^-1 [B,HV,Tp*r,N] if saved, else recomputed.
  Grouped value heads (q, k with H heads, HV % H == 0): q and k are repeated across each group
  and dq, dk summed back over it.
  Returns (dq, dk, dv, dg, dbeta, dmask, d_initial_state), each in its primal's shape and dtype.
  """
  heads, dtypes = q.shape[2], (q.dtype, k.dtype)
  q, k = (expand_key_heads(x, v.shape[2]) for x in (q, k))
  primals = (q, k, v, g, beta, mask)
  (q, k, v, g, beta, mask), marks = nonfinite.clean(*primals)
  do, dfinal = nonfinite.mark_cotangents(do.astype(f32), dfinal, marks)
  grads, dh0 = _stages(q, k, v, g, beta, mask, initial_state, scale, chunk_size, do, dfinal, ai)
  grads = nonfinite.clean_gradients(grads, primals)
  return _grouped(grads, primals, heads, dtypes) + (dh0.astype(initial_state.dtype),)


def _grouped(grads, primals, heads, dtypes):
  """The gradients in the primals' dtypes, dq and dk summed over each group of value heads."""
  dq, dk, *rest = grads
  dq, dk = (sum_key_heads(d, heads).astype(t) for d, t in zip((dq, dk), dtypes))
  return (dq, dk) + tuple(d.astype(x.dtype) for d, x in zip(rest, primals[2:]))


def _stages(q, k, v, g, beta, mask, initial_state, scale, chunk, do, dfinal, ai=None, lay=None):
  """Stages 1-5 on cleaned, time-padded inputs (packed ones with the layout `lay`, whose
  initial_state and dfinal are [N, H, K, V]). Returns ((dq, dk, dv, dg, dbeta, dmask) float32 in
  the (packed) primal shapes, d initial_state)."""
  r = mask.shape[-1]
  g_hm = _xla.to_head_major(g)
  gcum, seg = _xla.gate_cumsum(g_hm, chunk)
  beta_hm = _xla.to_head_major(beta)
  if ai is None:
    ai = _xla.solve_tril(_xla.chunk_kkt(k, beta_hm, mask, gcum, chunk, seg), chunk * r)
  w, u = _xla.recompute_w_u(k, v, beta_hm, mask, gcum, ai, chunk, seg)
  dv_local = chunk_bwd_dv_local(q, k, gcum, do, scale, chunk, r, seg)
  if lay is None:
    h, v_new, _ = _xla.chunk_state(k, w, u, gcum, initial_state, chunk, chunk, seg)
    dh, dh0, dv_new = chunk_bwd_dhu(q, k, w, gcum, do, dv_local, dfinal, scale, chunk, seg)
  else:
    starts = varlen.chunk_initial_states(initial_state, lay)[:, None]
    h, v_new, _ = _xla.chunk_state_varlen(k, w, u, gcum, starts, lay.chunk_first, chunk, seg)
    dh, dh0, dv_new = chunk_bwd_dhu_varlen(q, k, w, gcum, do, dv_local, dfinal, lay, scale, seg)
  dq, dk1, dw, dg1 = chunk_bwd_dqkwg(q, k, v_new, gcum, h, dh, do, dv_new, scale, chunk, seg)
  dk2, dv, dbeta, dmask, dg2 = wy_bwd(k, v, beta_hm, mask, gcum, ai, dw, dv_new, chunk, w, u, seg)
  # gamma is the cumsum of g with resets counted as 0: a reset's dg is exactly 0.
  dg = jnp.where(_xla.resets(g_hm), 0.0, chunk_local_reverse_cumsum(dg1 + dg2, chunk))
  time_major = lambda x: jnp.moveaxis(x, 1, 2)  # [B,H,Tp] -> [B,Tp,H]
  return (dq, dk1 + dk2, dv, time_major(dg), time_major(dbeta), dmask), dh0


def gated_delta_product_xla_varlen_bwd(
  q, k, v, g, beta, mask, initial_state, scale, chunk_size, cu_seqlens, do, dfinal
):
  """The vjp of `xla.gated_delta_product_xla_varlen` (packed sequences, docs/varlen.md; the same
  unpadded inputs): the stages above on the chunk-aligned padded layout, with the reverse state
  recurrence of `chunk_bwd_dhu_varlen`; every other stage works on whole chunks and needs no
  table. do: [1,T,HV,V]; dfinal: [N,HV,K,V] or None.
  Returns (dq, dk, dv, dg, dbeta, dmask, d_initial_state [N,HV,K,V]) in the primals' shapes.
  """
  heads, dtypes = q.shape[2], (q.dtype, k.dtype)
  q, k = (expand_key_heads(x, v.shape[2]) for x in (q, k))
  lay = varlen.layout(cu_seqlens, q.shape[1], chunk_size)
  primals = (q, k, v, g, beta, mask)
  (q, k, v, g, beta, mask), marks = varlen.clean(*primals, lay.cu_seqlens)
  if dfinal is None:
    dfinal = jnp.zeros(initial_state.shape, f32)
  do, dfinal = nonfinite.mark_cotangents(do.astype(f32), dfinal, marks)
  per_token = mask.shape[1] != 1
  q, k, v, g, beta, do = (varlen.pack(x, lay) for x in (q, k, v, g, beta, do))
  if per_token:
    mask = varlen.pack(mask, lay)
  grads, dh0 = _stages(
    q, k, v, g, beta, mask, initial_state, scale, chunk_size, do, dfinal, lay=lay
  )
  grads = tuple(varlen.unpack(d, lay) for d in grads[:5]) + (
    varlen.unpack(grads[5], lay) if per_token else grads[5],
  )
  grads = nonfinite.clean_gradients(grads, primals)
  return _grouped(grads, primals, heads, dtypes) + (dh0.astype(initial_state.dtype),)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 9, 10))
def with_xla_backward(forward, q, k, v, g, beta, mask, initial_state, cu_seqlens, scale, chunk):
  """`forward` (an implementation, hashable) with this module's jnp backward of the chunked form
  behind it: `backward="xla"` of the Pallas implementations, a debugging switch; packed
  sequences too (cu_seqlens, else None)."""
  args = (q, k, v, g, beta, mask, initial_state)
  if cu_seqlens is None:
    return forward(*args, scale, chunk)
  return forward.varlen(*args, scale, chunk, cu_seqlens)


def _with_xla_backward_fwd(forward, *primals):
  *arrays, cu_seqlens, scale, chunk = primals
  out = with_xla_backward(forward, *primals)
  return out, (*arrays, cu_seqlens)


def _with_xla_backward_bwd(forward, scale, chunk, residuals, cotangents):
  *primals, cu_seqlens = residuals
  do, dfinal = cotangents
  if cu_seqlens is None:
    grads = gated_delta_product_xla_bwd(*primals, scale, chunk, do, dfinal)
  else:
    grads = gated_delta_product_xla_varlen_bwd(*primals, scale, chunk, cu_seqlens, do, dfinal)
  return (*grads, None)


with_xla_backward.defvjp(_with_xla_backward_fwd, _with_xla_backward_bwd)
