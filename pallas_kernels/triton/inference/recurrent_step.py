"""One recurrent token of the block-masked gated delta product (docs/operator.md,
docs/inference.md#the-recurrent-step, docs/kernels.md#recurrent_step). Arrays in, arrays out (no
autodiff, no argument checks: gdp_jax/ops/step/api.py does those).

    q, k [B, H, K]   v [B, H, V]   g, beta [B, H]   mask [Bm, Hm, r, r]   state [B, H, K, V] f32
    ->   o [B, H, V] (out_dtype), new state [B, H, K, V] float32

Every operation is independent across value columns, so the grid is (B, H, V / block_v):
program (b, h, j) reads the [K, block_v] column tile of the state once, applies the decay, the
block projections, the errors u_a and the update in registers, and writes it once (in place when
`in_place`) with its block_v entries of o. No dots (r may be small): the block structure is
handled with row masks and column reductions on one 2-D tile (docs/pallas_triton.md).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.common import backend, options

f32 = jnp.float32

# Launch defaults: options.StepOptions, from the tuning table (pallas_kernels/triton/tuning/).
DEFAULTS = options.StepOptions()


def update_tile(s, q, k, v, decay, beta, m, rows, *, dim_k, kp, block_v, r, scale):
  """The one-token update of one [KP, BV] state tile (module docstring): returns (new tile,
  o [BV] float32, [u_a [BV] for each key block a]: the values each block writes). q, k [KP],
  v [BV] float32; decay, beta scalars; m(a, d) the mask entry; rows [KP, BV] the row index."""
  s = decay * s.astype(f32)  # S' = exp(g) S
  ks = k[:, None] * s  # k_i S'_i
  if r == 1:
    us = [beta * (v - m(0, 0) * jnp.sum(ks, axis=0))]  # [BV]
    u_rows = jnp.broadcast_to(us[0][None, :], (kp, block_v))
  else:
    dk = dim_k // r
    blk = jax.lax.div(rows, jnp.int32(dk))  # key block of each row
    proj = [jnp.sum(jnp.where(blk == d, ks, 0.0), axis=0) for d in range(r)]
    us, u_rows = [], None
    for a in range(r):
      pred = m(a, 0) * proj[0]
      for d in range(1, r):
        pred = pred + m(a, d) * proj[d]
      us.append(beta * (v - pred))
      u_a = jnp.broadcast_to(us[a][None, :], (kp, block_v))
      u_rows = u_a if u_rows is None else jnp.where(blk == a, u_a, u_rows)
  new = s + k[:, None] * u_rows  # block a writes its rows
  o = scale * jnp.sum(q[:, None] * new, axis=0)  # [BV]
  return new, o, us


def tile_sizes(dim_k, dim_v, block_v):
  """(K padded to a power of two of at least 16, the value tile: `block_v`, checked, or the
  default for V)."""
  if block_v is None:
    block_v = min(DEFAULTS.block_v, max(16, pl.next_power_of_2(dim_v)))
  if block_v < 16 or block_v & (block_v - 1):
    raise ValueError(f"block_v must be a power of two >= 16, got {block_v}")
  return max(16, pl.next_power_of_2(dim_k)), block_v


def _kernel(
  q_ref,
  k_ref,
  v_ref,
  g_ref,
  beta_ref,
  mask_ref,
  state_ref,
  o_ref,
  new_ref,
  *,
  dim_k,
  dim_v,
  kp,
  block_v,
  r,
  scale,
):
  # Refs (b, h squeezed): q_ref, k_ref [K]; v_ref [V]; g_ref, beta_ref []; mask_ref [r, r];
  # state_ref, new_ref [K, V]; o_ref [V]. This program owns columns [c0, c0 + block_v).
  j = pl.program_id(2)
  c0 = j * block_v
  zero = j * 0  # traced start for padded row tiles (a static overrun is rejected)
  pad_k = kp != dim_k
  pad_v = dim_v % block_v != 0

  rows = jax.lax.broadcasted_iota(jnp.int32, (kp, block_v), 0)
  cols = c0 + jax.lax.broadcasted_iota(jnp.int32, (kp, block_v), 1)
  tile_mask = None
  if pad_k and pad_v:
    tile_mask = (rows < dim_k) & (cols < dim_v)
  elif pad_k:
    tile_mask = rows < dim_k
  elif pad_v:
    tile_mask = cols < dim_v
  vec_rows = jax.lax.broadcasted_iota(jnp.int32, (kp,), 0)
  vec_cols = c0 + jax.lax.broadcasted_iota(jnp.int32, (block_v,), 0)

  def load_vec(ref):  # [K] -> [KP] float32
    if pad_k:
      return pltriton.load(ref.at[pl.ds(zero, kp)], mask=vec_rows < dim_k, other=0).astype(f32)
    return ref[...].astype(f32)

  q = load_vec(q_ref)
  k = load_vec(k_ref)
  col_ok = (vec_cols < dim_v) if pad_v else None
  if pad_v:
    v = pltriton.load(v_ref.at[pl.ds(c0, block_v)], mask=col_ok, other=0)
  else:
    v = v_ref[pl.ds(c0, block_v)]
  v = v.astype(f32)
  decay = jnp.exp(g_ref[()].astype(f32))
  beta = beta_ref[()].astype(f32)

  tile = state_ref.at[pl.ds(zero, kp), pl.ds(c0, block_v)]
  if tile_mask is not None:
    s = pltriton.load(tile, mask=tile_mask, other=0)
  else:
    s = tile[...]
  m = lambda a, d: mask_ref[a, d].astype(f32)  # loaded where used
  new, o, _ = update_tile(
    s, q, k, v, decay, beta, m, rows, dim_k=dim_k, kp=kp, block_v=block_v, r=r, scale=scale
  )

  out_tile = new_ref.at[pl.ds(zero, kp), pl.ds(c0, block_v)]
  if tile_mask is not None:
    pltriton.store(out_tile, new, mask=tile_mask)
  else:
    out_tile[...] = new
  if pad_v:
    pltriton.store(o_ref.at[pl.ds(c0, block_v)], o.astype(o_ref.dtype), mask=col_ok)
  else:
    o_ref[pl.ds(c0, block_v)] = o.astype(o_ref.dtype)


@functools.partial(
  jax.jit,
  static_argnames=(
    "scale",
    "out_dtype",
    "block_v",
    "num_warps",
    "num_stages",
    "in_place",
  ),
)
def recurrent_step(
  q,
  k,
  v,
  g,
  beta,
  mask,
  state,
  *,
  scale,
  out_dtype=None,
  block_v=None,
  num_warps=DEFAULTS.num_warps,
  num_stages=DEFAULTS.num_stages,
  in_place=True,
):
  """One token for every (b, h). Shapes in the module docstring; scale a Python float.

  Returns (o [B, H, V] in out_dtype (default q.dtype), new state [B, H, K, V] float32).
  in_place aliases the state buffer to the new state: free inside a jitted decode loop or when
  the caller donates the state; otherwise XLA inserts a copy of the state first.
  """
  batch, heads, dim_k = q.shape
  dim_v = v.shape[-1]
  bm, hm, r, _ = mask.shape
  kp, block_v = tile_sizes(dim_k, dim_v, block_v)
  out_dtype = q.dtype if out_dtype is None else out_dtype
  n_v = pl.cdiv(dim_v, block_v)
  out_shape = [
    jax.ShapeDtypeStruct((batch, heads, dim_v), out_dtype),
    jax.ShapeDtypeStruct((batch, heads, dim_k, dim_v), f32),
  ]
  args = (q, k, v, g, beta, mask, state.astype(f32))
  aliases = {6: 1} if in_place else {}

  kernel = functools.partial(
    _kernel, dim_k=dim_k, dim_v=dim_v, kp=kp, block_v=block_v, r=r, scale=float(scale)
  )
  vec = lambda n: pl.BlockSpec((None, None, n), lambda b, h, j: (b, h, 0))
  scalar = pl.BlockSpec((None, None), lambda b, h, j: (b, h))
  mask_spec = pl.BlockSpec(
    (None, None, r, r), lambda b, h, j: (b if bm > 1 else 0, h if hm > 1 else 0, 0, 0)
  )
  state_spec = pl.BlockSpec((None, None, dim_k, dim_v), lambda b, h, j: (b, h, 0, 0))
  o, new_state = backend.pallas_call(
    kernel,
    num_warps=num_warps,
    num_stages=num_stages,
    grid=(batch, heads, n_v),
    in_specs=[vec(dim_k), vec(dim_k), vec(dim_v), scalar, scalar, mask_spec, state_spec],
    out_specs=[vec(dim_v), state_spec],
    out_shape=out_shape,
    input_output_aliases=aliases,
    name="gdp_recurrent_step",
  )(*args)
  return o, new_state
