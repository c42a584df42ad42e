"""Backward stage 3 (docs/chunked_form.md#the-backward): dq, dk, dw and the per-token dgamma
from o and the state updates, one program per (chunk, batch, head); chunks are independent
given h, dh.

For each key block a (dh[c]: gradient of the state at the END of chunk c):
  ds_a     = scale D (do v_new_a^T)                        D[t,s] = exp(gamma_t - gamma_s), s <= t
  dq^(a)   = ds_a k^(a) + scale exp(gamma) do h[c]^(a)T
  dk^(a)   = ds_a^T q^(a) + exp(gamma_L - gamma) v_new_a dh[c]^(a)T
  dw       = -dv_new h[c]^T        (column block a)
  dgamma_t = rowsum - colsum of ds_a * (q^(a) k^(a)T) + <q, dq_inter> - <k, dk_state>,
             and the last token also gets exp(gamma_L) <h, dh> + sum_t <k_t, dk_state_t>.
jnp counterpart: `gdp_jax.xla_backward.chunk_bwd_dqkwg`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.common import backend, options, rows, specs


def _inner(h_ref, dh_ref, cols, dim_v, piece=32):
  """<h^(a), dh^(a)> over a [dk, V] block, read in column pieces (few registers live)."""
  total = jnp.zeros((), jnp.float32)
  for v0 in range(0, dim_v, min(piece, dim_v)):
    vs = pl.ds(v0, min(piece, dim_v))
    total = total + jnp.sum(
      h_ref[cols, vs].astype(jnp.float32) * dh_ref[cols, vs].astype(jnp.float32)
    )
  return total


def _dqkwg_kernel(
  q_ref,
  k_ref,
  vn_ref,
  g_ref,
  h_ref,
  dh_ref,
  do_ref,
  dvn_ref,
  dq_ref,
  dk_ref,
  dw_ref,
  dg_ref,
  *,
  r,
  scale,
  precision,
):
  dot = functools.partial(backend.dot, precision=precision)
  chunk, dim_k = q_ref.shape
  dim_v = do_ref.shape[-1]
  dk = dim_k // r
  dtype = q_ref.dtype
  f32 = jnp.float32
  g = g_ref[...]
  tok = jax.lax.broadcasted_iota(jnp.int32, (chunk,), 0)
  is_last = tok == chunk - 1
  g_last = jnp.sum(jnp.where(is_last, g, 0.0))
  decay = scale * rows.causal_decay(g, g, tok, tok, strict=False)  # [t, s]
  q_scale = (scale * jnp.exp(g))[:, None]
  k_scale = jnp.exp(g_last - g)[:, None]
  do = do_ref[...].astype(dtype)
  dvn = dvn_ref[...].reshape(chunk * r, dim_v).astype(dtype)  # rows (t, a)
  dg = jnp.zeros((chunk,), f32)
  last = jnp.zeros((), f32)
  for a in range(r):
    cols = pl.ds(a * dk, dk)
    qa = q_ref[:, cols]
    ka = k_ref[:, cols]
    vna = vn_ref[:, a, :].astype(dtype)
    ha = h_ref[cols, :].astype(dtype)
    dha = dh_ref[cols, :].astype(dtype)
    ds = decay * dot(do, vna, trans_b=True)  # [t, s]
    dq_inter = q_scale * dot(do, ha.astype(dtype), trans_b=True)
    dk_state = k_scale * dot(vna, dha.astype(dtype), trans_b=True)
    dq_ref[:, cols] = (dot(ds.astype(dtype), ka) + dq_inter).astype(dq_ref.dtype)
    dk_ref[:, cols] = (dot(ds.astype(dtype), qa, trans_a=True) + dk_state).astype(dk_ref.dtype)
    z = ds * dot(qa, ka, trans_b=True)
    kds = jnp.sum(dk_state * ka.astype(f32), axis=1)
    dg = (
      dg
      + jnp.sum(z, axis=1)
      - jnp.sum(z, axis=0)
      + jnp.sum(dq_inter * qa.astype(f32), axis=1)
      - kds
    )
    last = last + jnp.sum(kds) + jnp.exp(g_last) * _inner(h_ref, dh_ref, cols, dim_v)
    dw_ref[:, cols] = (-dot(dvn, ha.astype(dtype), trans_b=True)).astype(dw_ref.dtype)
  dg_ref[...] = dg + jnp.where(is_last, last, 0.0)


def chunk_bwd_dqkwg(
  q,
  k,
  v_new,
  gcum,
  h,
  dh,
  do,
  dv_new,
  *,
  scale,
  chunk,
  key_blocks,
  launch=options.DEFAULT.bwd_dqkwg,
  precision="ieee",
):
  """q, k [B, Tp, H, K]; v_new, dv_new [B, H, Tp*r, V]; gcum [B, H, Tp]; h, dh [B, H, NT, K, V];
  do [B, Tp, H, V] -> dq, dk [B, Tp, H, K], dgamma [B, H, Tp] float32; dw [B, H, Tp*r, K] in
  q's dtype (bwd_wy, its consumer, uses it in that dtype)."""
  bsz, t_len, heads, dim_k = q.shape
  dim_v = do.shape[-1]
  r = key_blocks
  n = chunk * r
  per_row = pl.BlockSpec((None, None, chunk, r, dim_v), lambda t, b, h: (b, h, t, 0, 0))
  state = pl.BlockSpec((None, None, None, dim_k, dim_v), lambda t, b, h: (b, h, t, 0, 0))
  f32 = jnp.float32
  return backend.pallas_call(
    lambda *refs: _dqkwg_kernel(*refs, precision=precision, r=r, scale=scale),
    grid=(t_len // chunk, bsz, heads),
    in_specs=[
      specs.tokens(chunk, dim_k),
      specs.tokens(chunk, dim_k),
      per_row,
      specs.scalars(chunk),
      state,
      state,
      specs.tokens(chunk, dim_v),
      per_row,
    ],
    out_specs=[
      specs.tokens(chunk, dim_k),
      specs.tokens(chunk, dim_k),
      specs.rows(n, dim_k),
      specs.scalars(chunk),
    ],
    out_shape=[
      jax.ShapeDtypeStruct(q.shape, f32),
      jax.ShapeDtypeStruct(q.shape, f32),
      jax.ShapeDtypeStruct((bsz, heads, t_len * r, dim_k), q.dtype),
      jax.ShapeDtypeStruct(gcum.shape, f32),
    ],
    num_warps=launch.num_warps,
    num_stages=launch.num_stages,
    name="gdp_bwd_dqkwg",
  )(
    q,
    k,
    v_new.reshape(bsz, heads, t_len, r, dim_v),
    gcum,
    h,
    dh,
    do,
    dv_new.reshape(bsz, heads, t_len, r, dim_v),
  )
