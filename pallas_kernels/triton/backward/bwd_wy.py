"""Backward stage 4 (docs/chunked_form.md#stage-4-the-wy-backward; docs/kernels.md#bwd_wy): the
WY backward through w = Ai W~, u = Ai U~, Ai = (I + Ag)^-1 and the gated chunk KKT Ag, per
chunk: dk, dv, dbeta, the per-token dmask and dgamma. dAg is formed as
-Ai^T (dw W~^T + du U~^T) Ai^T, which needs neither w nor u.

V and K are walked in pieces (launch.block_v, block_k) so that few tiles live at once: the V
pieces give dv and du U~^T; a first pass over the K pieces forms dw W~^T, KK = Kw Kb^T and
<dW~, Kw>; a second, once G = dAg D is known, each K piece of dk and dmask. jnp counterpart:
`gdp_jax.ops.gated_delta_product.xla_backward_stages.wy_bwd` (which returns dmask reduced).
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


def _key_piece(k_ref, mask_ref, cols, b, r):
  """Columns `cols` (inside key block b) of k [BT, BK] f32, Kw and Kb [N, BK] f32 (rows.py's
  masked_keys / block_keys restricted to those columns), and the mask column M[:, :, b]."""
  kp = k_ref[:, cols].astype(jnp.float32)
  chunk, bk = kp.shape
  mcol = mask_ref[:, :, b].astype(jnp.float32)  # [X, r]: M_t[a, b]
  if r == 1:
    return kp, kp * mcol, kp, mcol
  kw = (kp[:, None, :] * mcol[:, :, None]).reshape(chunk * r, bk)
  is_b = (jax.lax.broadcasted_iota(jnp.int32, (1, r, 1), 1) == b).astype(jnp.float32)
  kb = (kp[:, None, :] * is_b).reshape(chunk * r, bk)
  return kp, kw, kb, mcol


def _wy_bwd_kernel(
  k_ref,
  v_ref,
  beta_ref,
  g_ref,
  mask_ref,
  ai_ref,
  dw_ref,
  du_ref,
  *refs,
  r,
  block_k,
  block_v,
  precision,
  add_dk,
  looped=False,
):
  # with add_dk, one more input: the other part of dk, added before the store (`wy_bwd`)
  dk_in_ref = refs[0] if add_dk else None
  dk_ref, dv_ref, dbeta_ref, dmask_ref, dg_ref = refs[1:] if add_dk else refs

  def store_dk(cols, value):
    if dk_in_ref is not None:
      value = value + dk_in_ref[:, cols].astype(jnp.float32)
    dk_ref[:, cols] = value.astype(dk_ref.dtype)

  dot = functools.partial(backend.dot, precision=precision)
  chunk, dim_k = k_ref.shape
  dim_v = v_ref.shape[-1]
  n = chunk * r
  dk = dim_k // r
  dtype = k_ref.dtype
  f32 = jnp.float32
  beta = beta_ref[...].astype(f32)
  g = g_ref[...]
  beta_r = rows.per_row(beta, r)
  eg_r = rows.per_row(jnp.exp(g), r)
  scale_w = beta_r * eg_r
  ai = ai_ref[...].astype(dtype)
  num_pieces = dim_k // block_k

  def over_pieces(body, carry):
    """carry = body(cols, b, carry) over the K pieces (columns `cols` inside key block b):
    unrolled, or in a `fori_loop` (`looped`: one piece's products in the module)."""
    if not looped:
      for c0 in range(0, dim_k, block_k):
        carry = body(pl.ds(c0, block_k), c0 // dk, carry)
      return carry

    def step(i, carry):
      c0 = pl.multiple_of(i * block_k, block_k)
      return body(pl.ds(c0, block_k), c0 // dk, carry)

    return jax.lax.fori_loop(0, num_pieces, step, carry)

  # u = Ai U~ with U~ = beta v (per token, repeated over a):  dU~ = Ai^T du;  X = du U~^T + ...
  x = jnp.zeros((n, n), f32)
  dbeta_u = jnp.zeros((chunk,), f32)
  for v0 in range(0, dim_v, block_v):
    vs = pl.ds(v0, block_v)
    du = du_ref[:, vs].astype(dtype)
    vp = v_ref[:, vs].astype(f32)
    dut = dot(ai, du, trans_a=True)  # [N, BV]
    dut_sum = dut if r == 1 else jnp.sum(dut.reshape(chunk, r, block_v), axis=1)
    dv_ref[:, vs] = (beta[:, None] * dut_sum).astype(dv_ref.dtype)
    dbeta_u = dbeta_u + jnp.sum(dut_sum * vp, axis=1)
    x = x + dot(du, rows.repeat_rows((beta[:, None] * vp).astype(dtype), r), trans_b=True)

  # w = Ai W~ with W~ = beta exp(gamma) Kw:  dW~ = Ai^T dw;  X += dw W~^T;  KK = Kw Kb^T
  def first_pass(cols, b, carry):
    s_w, x, kk = carry
    _, kw, kb, _ = _key_piece(k_ref, mask_ref, cols, b, r)
    dw = dw_ref[:, cols].astype(dtype)
    s_w = s_w + jnp.sum(dot(ai, dw, trans_a=True) * kw, axis=1)
    x = x + dot(dw, (scale_w[:, None] * kw).astype(dtype), trans_b=True)
    kk = kk + dot(kw.astype(dtype), kb.astype(dtype), trans_b=True)
    return s_w, x, kk

  # s_w: <dW~, Kw> per row
  s_w, x, kk = over_pieces(first_pass, (jnp.zeros((n,), f32), x, jnp.zeros((n, n), f32)))

  # Ai = (I + Ag)^-1:  dAg = -Ai^T X Ai^T on token-strictly-lower entries
  xa = dot(ai, x.astype(dtype), trans_a=True)
  dag = -dot(xa.astype(dtype), ai, trans_b=True)
  tok = rows.row_tokens(n, r)
  g_r = rows.per_row(g, r)
  gd = dag * rows.causal_decay(g_r, g_r, tok, tok, strict=True)  # G
  gkk = gd * kk
  z = beta_r[:, None] * gkk
  dbeta_r = jnp.sum(gkk, axis=1) + eg_r * s_w
  dg_r = jnp.sum(z, axis=1) - jnp.sum(z, axis=0) + scale_w * s_w
  dbeta_ref[...] = _per_token(dbeta_r, chunk, r) + dbeta_u
  dg_ref[...] = _per_token(dg_r, chunk, r)
  gb = (beta_r[:, None] * gd).astype(dtype)

  # dKw = beta exp(gamma) dW~ + (beta G) Kb, dKb = (beta G)^T Kw, per K piece -> dk, dmask
  onehot = jax.lax.broadcasted_iota(jnp.int32, (1, 1, r), 2)

  def second_pass(cols, b, dmask):
    kp, kw, kb, mcol = _key_piece(k_ref, mask_ref, cols, b, r)
    dwt = dot(ai, dw_ref[:, cols].astype(dtype), trans_a=True)
    dkw = scale_w[:, None] * dwt + dot(gb, kb.astype(dtype))
    dkb = dot(gb, kw.astype(dtype), trans_a=True)
    if r == 1:
      store_dk(cols, dkw * mcol + dkb)
      return dmask + jnp.sum(dkw * kp, axis=1).reshape(chunk, 1, 1)
    dkw3 = dkw.reshape(chunk, r, block_k)
    is_b = (jax.lax.broadcasted_iota(jnp.int32, (1, r, 1), 1) == b).astype(f32)
    store_dk(
      cols,
      jnp.sum(dkw3 * mcol[:, :, None], axis=1)
      + jnp.sum(dkb.reshape(chunk, r, block_k) * is_b, axis=1),
    )
    col = jnp.sum(dkw3 * kp[:, None, :], axis=2)  # this piece's part of dM[:, :, b]  [BT, r]
    return dmask + col[:, :, None] * (onehot == b).astype(f32)

  dmask_ref[...] = over_pieces(second_pass, jnp.zeros((chunk, r, r), f32))


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
  dk_in=None,
  dk_dtype=jnp.float32,
  dv_dtype=jnp.float32,
  form="auto",
):
  """k [B, Tp, H, K]; v [B, Tp, H, V]; beta, gcum [B, H, Tp]; mask [Bm, Tm, Hm, r, r];
  ai [B, H, Tp*r, N]; dw [B, H, Tp*r, K]; du [B, H, Tp*r, V] ->
  dk [B, Tp, H, K], dv [B, Tp, H, V], dbeta [B, H, Tp], per-token dmask [B, H, Tp, r, r],
  dgamma [B, H, Tp]; float32, but dk in dk_dtype and dv in dv_dtype.

  dk_in: None, or [B, Tp, H, K] (float32): the rest of dk (bwd_dqkwg's part), added to this
  kernel's part in float32 before dk is stored, so the sum and its cast need no pass of their own.

  launch.block_k: the K piece (at most K / r; None: K / r); launch.block_v: the V piece
  (None: all of V). k may have H / group key heads for v's H value heads (read at key head
  h // group); dk has H heads, one per value head. form: `options.LOOP_FORMS` (the K pieces
  unrolled or in a loop; "auto" by r)."""
  bsz, t_len, key_heads, dim_k = k.shape
  heads, dim_v = v.shape[2], v.shape[-1]
  group = heads // key_heads
  r = key_blocks
  specs.check_key_blocks(mask, r)
  n = chunk * r
  dk = dim_k // r
  bk, bv = options.pieces(launch, dk, dim_v)
  f32 = jnp.float32
  add_dk = dk_in is not None
  kernel = functools.partial(
    _wy_bwd_kernel,
    precision=precision,
    r=r,
    block_k=bk,
    block_v=bv,
    add_dk=add_dk,
    looped=options.key_block_loop(form, r),
  )
  return backend.pallas_call(
    kernel,
    grid=(t_len // chunk, bsz, heads),
    in_specs=[
      specs.tokens(chunk, dim_k, group=group),
      specs.tokens(chunk, dim_v),
      specs.scalars(chunk),
      specs.scalars(chunk),
      specs.mask(mask.shape, chunk),
      specs.rows(n, n),
      specs.rows(n, dim_k),
      specs.rows(n, dim_v),
      *([specs.tokens(chunk, dim_k)] if add_dk else []),
    ],
    out_specs=[
      specs.tokens(chunk, dim_k),
      specs.tokens(chunk, dim_v),
      specs.scalars(chunk),
      pl.BlockSpec((None, None, chunk, r, r), lambda t, b, h: (b, h, t, 0, 0)),
      specs.scalars(chunk),
    ],
    out_shape=[
      jax.ShapeDtypeStruct((bsz, t_len, heads, dim_k), dk_dtype),
      jax.ShapeDtypeStruct(v.shape, dv_dtype),
      jax.ShapeDtypeStruct(beta.shape, f32),
      jax.ShapeDtypeStruct((bsz, heads, t_len, r, r), f32),
      jax.ShapeDtypeStruct(gcum.shape, f32),
    ],
    num_warps=launch.num_warps,
    num_stages=launch.num_stages,
    name="gdp_bwd_wy",
  )(k, v, beta, gcum, mask, ai, dw, du, *([dk_in] if add_dk else []))
