"""Backward stage 3 (docs/chunked_form.md#stage-3-dq-dk-dw-dgamma; docs/kernels.md#bwd_dqkwg):
dq, dk, dw and the per-token dgamma from o and the state updates, one program per (key column
block, chunk, batch, head); chunks are independent given h and dh.

A program takes one block of BK key columns (inside key block a) and walks V in pieces of BV,
accumulating ds_a [BT, BT] and its columns of dq, dk and dw in float32, so few tiles live at
once. Every dgamma term is a sum over key columns: each program writes its columns' part and the
caller sums the parts. jnp counterpart:
`gdp_jax.ops.gated_delta_product.xla_backward_stages.chunk_bwd_dqkwg`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.common import backend, options, rows


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
  scale,
  block_v,
  precision,
):
  dot = functools.partial(backend.dot, precision=precision)
  chunk, bk = q_ref.shape
  n, dim_v = dvn_ref.shape
  dtype = q_ref.dtype
  f32 = jnp.float32

  def piece(i, acc):
    ds, dq_inter, dk_state, dw, inner = acc
    vs = pl.ds(pl.multiple_of(i * block_v, block_v), block_v)
    do = do_ref[:, vs].astype(dtype)
    vn = vn_ref[:, vs].astype(dtype)
    h = h_ref[:, vs]
    hc = h.astype(dtype)
    dh = dh_ref[:, vs]
    inner = inner + jnp.sum(h.astype(f32) * dh.astype(f32))
    ds = ds + dot(do, vn, trans_b=True)  # do v_new_a^T
    dq_inter = dq_inter + dot(do, hc, trans_b=True)
    dk_state = dk_state + dot(vn, dh.astype(dtype), trans_b=True)
    dw = dw + dot(dvn_ref[:, vs].astype(dtype), hc, trans_b=True)
    return ds, dq_inter, dk_state, dw, inner

  zeros = lambda rows_, cols_: jnp.zeros((rows_, cols_), f32)
  acc = (zeros(chunk, chunk), zeros(chunk, bk), zeros(chunk, bk), zeros(n, bk), jnp.zeros((), f32))
  ds, dq_inter, dk_state, dw, inner = jax.lax.fori_loop(0, dim_v // block_v, piece, acc)
  dw_ref[...] = (-dw).astype(dw_ref.dtype)

  g = g_ref[...]
  tok = jax.lax.broadcasted_iota(jnp.int32, (chunk,), 0)
  is_last = tok == chunk - 1
  g_last = jnp.sum(jnp.where(is_last, g, 0.0))
  ds = ds * (scale * rows.causal_decay(g, g, tok, tok, strict=False))  # [t, s]
  dq_inter = (scale * jnp.exp(g))[:, None] * dq_inter
  dk_state = jnp.exp(g_last - g)[:, None] * dk_state
  qa = q_ref[...]
  ka = k_ref[...]
  dsc = ds.astype(dtype)
  dq_ref[...] = (dot(dsc, ka) + dq_inter).astype(dq_ref.dtype)
  dk_ref[...] = (dot(dsc, qa, trans_a=True) + dk_state).astype(dk_ref.dtype)
  z = ds * dot(qa, ka, trans_b=True)
  kds = jnp.sum(dk_state * ka.astype(f32), axis=1)
  dg = jnp.sum(z, axis=1) - jnp.sum(z, axis=0) + jnp.sum(dq_inter * qa.astype(f32), axis=1) - kds
  last = jnp.sum(kds) + jnp.exp(g_last) * inner
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
  dq_dtype=jnp.float32,
):
  """q, k [B, Tp, H, K]; v_new, dv_new [B, H, Tp*r, V]; gcum [B, H, Tp]; h, dh [B, H, NT, K, V];
  do [B, Tp, H, V] -> dq [B, Tp, H, K] in dq_dtype, dk [B, Tp, H, K] and dgamma [B, H, Tp]
  float32; dw [B, H, Tp*r, K] in q's dtype (bwd_wy, its consumer, uses it in that dtype).

  launch.block_k: key columns per program (BK, at most K / r; None: K / r); launch.block_v: the
  V piece of the inner loop (None: all of V). q and k may have H / group key heads for do's H
  value heads (read at key head h // group); dq and dk have H heads, one per value head."""
  bsz, t_len, key_heads, dim_k = q.shape
  heads, dim_v = do.shape[2], do.shape[-1]
  group = heads // key_heads
  r = key_blocks
  n = chunk * r
  dk = dim_k // r
  bk, bv = options.pieces(launch, dk, dim_v)
  per_block = dk // bk  # programs per key block
  nkb = dim_k // bk
  f32 = jnp.float32
  cols = pl.BlockSpec((None, chunk, None, bk), lambda j, t, b, h: (b, t, h, j))
  key_cols = pl.BlockSpec((None, chunk, None, bk), lambda j, t, b, h: (b, t, h // group, j))
  state = pl.BlockSpec((None, None, None, bk, dim_v), lambda j, t, b, h: (b, h, t, j, 0))
  dg_parts = backend.pallas_call(
    lambda *refs: _dqkwg_kernel(*refs, precision=precision, scale=scale, block_v=bv),
    grid=(nkb, t_len // chunk, bsz, heads),
    in_specs=[
      key_cols,
      key_cols,
      # v_new's rows of key block a = j // per_block
      pl.BlockSpec(
        (None, None, chunk, None, dim_v), lambda j, t, b, h: (b, h, t, j // per_block, 0)
      ),
      pl.BlockSpec((None, None, chunk), lambda j, t, b, h: (b, h, t)),
      state,
      state,
      pl.BlockSpec((None, chunk, None, dim_v), lambda j, t, b, h: (b, t, h, 0)),
      pl.BlockSpec((None, None, n, dim_v), lambda j, t, b, h: (b, h, t, 0)),
    ],
    out_specs=[
      cols,
      cols,
      pl.BlockSpec((None, None, n, bk), lambda j, t, b, h: (b, h, t, j)),
      pl.BlockSpec((None, None, None, chunk), lambda j, t, b, h: (j, b, h, t)),
    ],
    out_shape=[
      jax.ShapeDtypeStruct((bsz, t_len, heads, dim_k), dq_dtype),
      jax.ShapeDtypeStruct((bsz, t_len, heads, dim_k), f32),
      jax.ShapeDtypeStruct((bsz, heads, t_len * r, dim_k), q.dtype),
      jax.ShapeDtypeStruct((nkb, *gcum.shape), f32),
    ],
    num_warps=launch.num_warps,
    num_stages=launch.num_stages,
    name="gdp_bwd_dqkwg",
  )(q, k, v_new.reshape(bsz, heads, t_len, r, dim_v), gcum, h, dh, do, dv_new)
  dq, dkk, dw, dg = dg_parts
  return dq, dkk, dw, jnp.sum(dg, axis=0)
