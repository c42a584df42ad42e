"""Tq recurrent tokens of the block-masked gated delta product in one launch, keeping the values
each token writes instead of its state: the compact verify step of speculative decoding
(docs/inference.md#verifying-draft-tokens). Arrays in, arrays out (no autodiff, no argument
checks: gdp_jax/ops/step/api.py does those).

    q, k [B, H, Tq, K]   v [B, H, Tq, V]   g, beta [B, H, Tq]   mask [Bm, Hm, Tm, r, r]
    state [B, H, K, V] f32   ->   o [B, H, Tq, V] float32, u [B, H, Tq, r, V] float32

As recurrent_step.py, over a grid (B, H, V / block_v): program (b, h, j) reads its [K, block_v]
column tile of the state once, applies the Tq tokens' updates in registers, and writes each
token's o and the values u_t^(a) its key blocks add (S_t = exp(g_t) S_{t-1} + sum_a k_t^(a)
u_t^(a)^T); the states themselves are never written. The state after any number of the tokens
is rebuilt from the state before them and these values (gdp_jax/ops/step/verify.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.common import backend
from pallas_kernels.triton.inference.recurrent_step import DEFAULTS, tile_sizes, update_tile

f32 = jnp.float32


def _kernel(
  q_ref,
  k_ref,
  v_ref,
  g_ref,
  beta_ref,
  mask_ref,
  state_ref,
  o_ref,
  u_ref,
  *,
  tq,
  tm,
  dim_k,
  dim_v,
  kp,
  tp,
  block_v,
  r,
  scale,
):
  # Refs (b, h squeezed): q_ref, k_ref [Tq, K]; v_ref, o_ref [Tq, V]; g_ref, beta_ref [Tq];
  # mask_ref [Tm, r, r]; state_ref [K, V]; u_ref [Tq, r, V]. Columns [c0, c0 + block_v).
  j = pl.program_id(2)
  c0 = j * block_v
  zero = j * 0  # traced start for padded tiles (a static overrun is rejected)
  rows = jax.lax.broadcasted_iota(jnp.int32, (kp, block_v), 0)
  cols = c0 + jax.lax.broadcasted_iota(jnp.int32, (kp, block_v), 1)
  key_ok = jax.lax.broadcasted_iota(jnp.int32, (kp,), 0) < dim_k
  col_ok = c0 + jax.lax.broadcasted_iota(jnp.int32, (block_v,), 0) < dim_v
  s = pltriton.load(
    state_ref.at[pl.ds(zero, kp), pl.ds(c0, block_v)],
    mask=(rows < dim_k) & (cols < dim_v),
    other=0,
  ).astype(f32)
  token = jax.lax.broadcasted_iota(jnp.int32, (tp,), 0)

  def gates(ref):  # [Tq] -> [TP] float32
    return pltriton.load(ref.at[pl.ds(zero, tp)], mask=token < tq, other=0).astype(f32)

  def pick(vec, t):  # entry t of a [TP] vector
    return jnp.sum(jnp.where(token == t, vec, 0.0))

  g_all, beta_all = gates(g_ref), gates(beta_ref)
  for t in range(tq):
    row = zero + t  # a traced index: the masked loads and stores take no Python int
    key = lambda ref, row=row: pltriton.load(ref.at[row, pl.ds(zero, kp)], mask=key_ok, other=0)
    v = pltriton.load(v_ref.at[row, pl.ds(c0, block_v)], mask=col_ok, other=0).astype(f32)
    tmask = t if tm > 1 else 0
    m = lambda a, d, tmask=tmask: mask_ref[tmask, a, d].astype(f32)
    s, o, us = update_tile(
      s,
      key(q_ref).astype(f32),
      key(k_ref).astype(f32),
      v,
      jnp.exp(pick(g_all, t)),
      pick(beta_all, t),
      m,
      rows,
      dim_k=dim_k,
      kp=kp,
      block_v=block_v,
      r=r,
      scale=scale,
    )
    pltriton.store(o_ref.at[row, pl.ds(c0, block_v)], o, mask=col_ok)
    for a in range(r):
      pltriton.store(u_ref.at[row, zero + a, pl.ds(c0, block_v)], us[a], mask=col_ok)


@functools.partial(jax.jit, static_argnames=("scale", "block_v", "num_warps", "num_stages"))
def recurrent_verify(
  q,
  k,
  v,
  g,
  beta,
  mask,
  state,
  *,
  scale,
  block_v=None,
  num_warps=DEFAULTS.num_warps,
  num_stages=DEFAULTS.num_stages,
):
  """Tq tokens for every (b, h). Shapes in the module docstring; scale a Python float.
  Returns (o [B, H, Tq, V] float32, u [B, H, Tq, r, V] float32)."""
  batch, heads, tq, dim_k = q.shape
  dim_v = v.shape[-1]
  bm, hm, tm, r, _ = mask.shape
  kp, block_v = tile_sizes(dim_k, dim_v, block_v)
  tp = max(16, pl.next_power_of_2(tq))
  kernel = functools.partial(
    _kernel,
    tq=tq,
    tm=tm,
    dim_k=dim_k,
    dim_v=dim_v,
    kp=kp,
    tp=tp,
    block_v=block_v,
    r=r,
    scale=float(scale),
  )
  per_head = lambda *tail: pl.BlockSpec(
    (None, None) + tail, lambda b, h, j: (b, h) + (0,) * len(tail)
  )
  mask_spec = pl.BlockSpec(
    (None, None, tm, r, r), lambda b, h, j: (b if bm > 1 else 0, h if hm > 1 else 0, 0, 0, 0)
  )
  return backend.pallas_call(
    kernel,
    num_warps=num_warps,
    num_stages=num_stages,
    grid=(batch, heads, pl.cdiv(dim_v, block_v)),
    in_specs=[
      per_head(tq, dim_k),
      per_head(tq, dim_k),
      per_head(tq, dim_v),
      per_head(tq),
      per_head(tq),
      mask_spec,
      per_head(dim_k, dim_v),
    ],
    out_specs=[per_head(tq, dim_v), per_head(tq, r, dim_v)],
    out_shape=[
      jax.ShapeDtypeStruct((batch, heads, tq, dim_v), f32),
      jax.ShapeDtypeStruct((batch, heads, tq, r, dim_v), f32),
    ],
    name="gdp_recurrent_verify",
  )(q, k, v, g, beta, mask, state.astype(f32))
