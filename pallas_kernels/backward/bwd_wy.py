"""Backward stage 4 (docs/chunked_form.md#the-backward): the WY backward, through w = Ai W~,
u = Ai U~, Ai = (I + Ag)^-1 and Ag = beta (Kw Kb^T) D (the gated chunk KKT, kkt.py), per chunk.

With dW~ = Ai^T dw, dU~ = Ai^T du, dAg = -(dW~ w^T + dU~ u^T) on token-strictly-lower entries,
G = dAg D (D = exp(gamma_t - gamma_s), t > s) and KK = Kw Kb^T:
  dKw = beta G Kb + beta exp(gamma) dW~,     dKb = (beta G)^T Kw
  dbeta (per row) = rowsum(G KK) + exp(gamma) <dW~, Kw>,   plus <dU~, v> per token
  dgamma (per row) = rowsum(Z) - colsum(Z) + <dW~, W~>,     Z = beta G KK
  dv = beta sum_a dU~[(t,a)]
and dKw, dKb map back to dk and the per-token dmask through the block structure of the keys
(rows.py). dAg is formed as -Ai^T (dw W~^T + du U~^T) Ai^T, which needs neither w nor u.
jnp counterpart: `gdp_jax.xla_backward.wy_bwd` (which returns dmask already reduced).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.common import backend, options, rows, specs


def _per_token(x, chunk, r):
  """[BT * r] per-row values -> [BT] per-token sums."""
  return x if r == 1 else jnp.sum(x.reshape(chunk, r), axis=1)


def _wy_bwd_kernel(
  k_ref,
  v_ref,
  beta_ref,
  g_ref,
  mask_ref,
  ai_ref,
  dw_ref,
  du_ref,
  dk_ref,
  dv_ref,
  dbeta_ref,
  dmask_ref,
  dg_ref,
  *,
  r,
  precision,
):
  dot = functools.partial(backend.dot, precision=precision)
  # Ordered to keep few [N, K] tiles live at once (registers): the dw part, the du part, then
  # the Ag part, each consuming its products as soon as they are formed.
  k = k_ref[...]
  chunk, dim_k = k.shape
  dim_v = v_ref.shape[-1]
  n = chunk * r
  dtype = k.dtype
  f32 = jnp.float32
  beta = beta_ref[...].astype(f32)
  g = g_ref[...]
  beta_r = rows.per_row(beta, r)
  eg_r = rows.per_row(jnp.exp(g), r)
  scale_w = beta_r * eg_r
  kw = rows.masked_keys(k, mask_ref, r)  # [N, K] f32
  kw_c = kw.astype(dtype)
  kb_c = rows.block_keys(k, r).astype(dtype)
  ai = ai_ref[...].astype(dtype)

  # w = Ai W~ with W~ = beta exp(gamma) Kw:  dW~ = Ai^T dw
  dw = dw_ref[...].astype(dtype)
  dwt = dot(ai, dw, trans_a=True)  # [N, K]
  s_w = jnp.sum(dwt * kw, axis=1)  # <dW~, Kw> per row
  dkw = scale_w[:, None] * dwt
  x = dot(dw, (scale_w[:, None] * kw).astype(dtype), trans_b=True)  # dw W~^T  [N, N]

  # u = Ai U~ with U~ = beta v (per token, repeated over a):  dU~ = Ai^T du
  v = v_ref[...].astype(f32)
  du = du_ref[...].astype(dtype)
  dut = dot(ai, du, trans_a=True)  # [N, V]
  dut_sum = dut if r == 1 else jnp.sum(dut.reshape(chunk, r, dim_v), axis=1)
  dv_ref[...] = (beta[:, None] * dut_sum).astype(dv_ref.dtype)
  dbeta_u = jnp.sum(dut_sum * v, axis=1)
  u_tilde = rows.repeat_rows((beta[:, None] * v).astype(dtype), r)
  x = x + dot(du, u_tilde, trans_b=True)  # + du U~^T

  # Ai = (I + Ag)^-1:  dAg = -Ai^T (dw W~^T + du U~^T) Ai^T on token-strictly-lower entries
  xa = dot(ai, x.astype(dtype), trans_a=True)
  dag = -dot(xa.astype(dtype), ai, trans_b=True)
  tok = rows.row_tokens(n, r)
  g_r = rows.per_row(g, r)
  gd = dag * rows.causal_decay(g_r, g_r, tok, tok, strict=True)  # G
  kk = dot(kw_c, kb_c, trans_b=True)  # Kw Kb^T
  gkk = gd * kk
  z = beta_r[:, None] * gkk
  dbeta_r = jnp.sum(gkk, axis=1) + eg_r * s_w
  dg_r = jnp.sum(z, axis=1) - jnp.sum(z, axis=0) + scale_w * s_w
  gb = (beta_r[:, None] * gd).astype(dtype)
  dkw = dkw + dot(gb, kb_c)
  dkb = dot(gb, kw_c, trans_a=True)
  dbeta_ref[...] = _per_token(dbeta_r, chunk, r) + dbeta_u
  dg_ref[...] = _per_token(dg_r, chunk, r)

  kf = k.astype(f32)
  if r == 1:
    dk_ref[...] = (dkw * mask_ref[:, :, 0].astype(f32) + dkb).astype(dk_ref.dtype)
    dmask_ref[...] = jnp.sum(dkw * kf, axis=1).reshape(chunk, 1, 1)
    return
  dkw3 = dkw.reshape(chunk, r, dim_k)
  ind = rows.block_indicator(r, dim_k)  # [r, K]
  dk_ref[...] = (
    jnp.sum(dkw3 * rows.expanded_mask(mask_ref, r, dim_k), axis=1)
    + jnp.sum(dkb.reshape(chunk, r, dim_k) * ind[None], axis=1)
  ).astype(dk_ref.dtype)
  prod = dkw3 * kf[:, None, :]  # [t, a, c]
  col_block = jax.lax.broadcasted_iota(jnp.int32, (1, 1, dim_k), 2) // (dim_k // r)
  onehot = jax.lax.broadcasted_iota(jnp.int32, (1, 1, r), 2)
  dmask = None
  for b in range(r):
    col = jnp.sum(jnp.where(col_block == b, prod, 0.0), axis=2)  # dM[:, :, b]  [BT, r]
    term = col[:, :, None] * (onehot == b).astype(f32)
    dmask = term if dmask is None else dmask + term
  dmask_ref[...] = dmask


def wy_bwd(
  k,
  v,
  beta,
  mask,
  gcum,
  ai,
  dw,
  du,
  *,
  chunk,
  key_blocks,
  launch=options.DEFAULT.bwd_wy,
  precision="ieee",
):
  """k [B, Tp, H, K]; v [B, Tp, H, V]; beta, gcum [B, H, Tp]; mask [Bm, Tm, Hm, r, r];
  ai [B, H, Tp*r, N]; dw [B, H, Tp*r, K]; du [B, H, Tp*r, V] ->
  dk [B, Tp, H, K], dv [B, Tp, H, V], dbeta [B, H, Tp], per-token dmask [B, H, Tp, r, r],
  dgamma [B, H, Tp]; all float32."""
  bsz, t_len, heads, dim_k = k.shape
  dim_v = v.shape[-1]
  r = key_blocks
  specs.check_key_blocks(mask, r)
  n = chunk * r
  f32 = jnp.float32
  return backend.pallas_call(
    lambda *refs: _wy_bwd_kernel(*refs, precision=precision, r=r),
    grid=(t_len // chunk, bsz, heads),
    in_specs=[
      specs.tokens(chunk, dim_k),
      specs.tokens(chunk, dim_v),
      specs.scalars(chunk),
      specs.scalars(chunk),
      specs.mask(mask.shape, chunk),
      specs.rows(n, n),
      specs.rows(n, dim_k),
      specs.rows(n, dim_v),
    ],
    out_specs=[
      specs.tokens(chunk, dim_k),
      specs.tokens(chunk, dim_v),
      specs.scalars(chunk),
      pl.BlockSpec((None, None, chunk, r, r), lambda t, b, h: (b, h, t, 0, 0)),
      specs.scalars(chunk),
    ],
    out_shape=[
      jax.ShapeDtypeStruct(k.shape, f32),
      jax.ShapeDtypeStruct(v.shape, f32),
      jax.ShapeDtypeStruct(beta.shape, f32),
      jax.ShapeDtypeStruct((bsz, heads, t_len, r, r), f32),
      jax.ShapeDtypeStruct(gcum.shape, f32),
    ],
    num_warps=launch.num_warps,
    num_stages=launch.num_stages,
    name="gdp_bwd_wy",
  )(k, v, beta, gcum, mask, ai, dw, du)
