"""`implementation="pallas"`: the chunked form of DESIGN §2 as Pallas kernels (pallas_kernels/).

Inputs arrive validated and padded in time by `gdp_jax.operator`. Here they are also padded in
the feature axes so every kernel tile is a power of two of at least 16 (the Triton dot's minimum):
each key block of dk = K / r columns to dkp, and V to Vp, with zeros, which changes nothing (a
zero key column never touches the state; a zero value column stays zero).

The pallas chunk: a chunk of BT tokens makes [BT*r, BT*r] chunk matrices that live in registers,
so the kernels use BT = min(chunk_size, 64 // r) tokens, at least 16 (64 for r = 1, 32 for r = 2,
16 for r = 4 and 8): at most 64 rows, 128 for r = 8. The result is the same function; only
rounding differs.

The forward is two fused kernels by default (`FUSED`, docs/kernels.md "Fused forward kernels"):
chunk_fwd (cumsum, KKT, inverse, w and u per chunk) and chunk_state_output (the state walk with
the output). `fused=False` runs the five-kernel pipeline (kkt, solve_tril, wy, chunk_h, chunk_o)
instead, for comparison. The backward is the same either way: it recomputes w, u, h and v_new
from the residuals gamma and Ai.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from gdp_jax.xla_backward import reduce_dmask
from pallas_kernels.backward import bwd_dhu, bwd_dqkwg, bwd_dv_local, bwd_wy
from pallas_kernels.common import backend, cumsum
from pallas_kernels.forward import (chunk_fwd, chunk_h, chunk_o, chunk_state_output, kkt,
                                    solve_tril, wy)

MAX_CHUNK_ROWS = 64

# The fused forward by default; False selects the five-kernel forward (read when the operator is
# traced: set it before jitting).
FUSED = True
# Float32 dot precision of the fused forward (backend.PRECISIONS), or None: "tf32" for half
# precision inputs (only the inverse's block merge has float32 operands then), "ieee" for float32
# inputs (as accurate as the five-kernel forward). See docs/precision.md.
FUSED_PRECISION = None
# Launch parameters of the fused kernels per r (GPU tuning: benchmarks/sweep_fused.py); an r
# without an entry uses the "default" one.
CHUNK_FWD_PARAMS = {"default": dict(merge="panels", num_warps=4, num_stages=1),
                    8: dict(merge="panels", num_warps=8, num_stages=1)}
STATE_OUTPUT_PARAMS = {"default": dict(block_v=64, num_warps=4, num_stages=2)}


def launch_params(table, r):
  """The launch parameters of `table` (CHUNK_FWD_PARAMS, STATE_OUTPUT_PARAMS) for r."""
  return dict(table.get(r, table["default"]))


def fused_precision(dtype, precision=None) -> str:
  """The float32 dot precision the fused forward uses for inputs of `dtype`."""
  if precision is not None:
    return precision
  return "ieee" if jnp.dtype(dtype) == jnp.float32 else "tf32"


def pallas_chunk(chunk_size: int, r: int) -> int:
  """Tokens per chunk the kernels use for a requested chunk size and r key blocks."""
  return max(16, min(chunk_size, MAX_CHUNK_ROWS // r))


def padded_dims(dim_k: int, dim_v: int, r: int) -> tuple[int, int]:
  """(dkp, Vp): each key block and the value dimension padded to a power of two >= 16."""
  return (max(16, backend.next_power_of_2(dim_k // r)), max(16, backend.next_power_of_2(dim_v)))


def pad_key_blocks(x, r, dkp):
  """[..., K] -> [..., r * dkp]: zero-pad each of the r key blocks to dkp columns."""
  dk = x.shape[-1] // r
  if dk == dkp:
    return x
  x = x.reshape(x.shape[:-1] + (r, dk))
  x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, dkp - dk)])
  return x.reshape(x.shape[:-2] + (r * dkp,))


def unpad_key_blocks(x, r, dk, axis):
  """Inverse of pad_key_blocks along `axis`."""
  dkp = x.shape[axis] // r
  if dk == dkp:
    return x
  x = jnp.moveaxis(x, axis, -1)
  x = x.reshape(x.shape[:-1] + (r, dkp))[..., :dk]
  return jnp.moveaxis(x.reshape(x.shape[:-2] + (r * dk,)), -1, axis)


def _pad_last(x, size):
  if x.shape[-1] == size:
    return x
  return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, size - x.shape[-1])])


def _forward(q, k, v, g, beta, mask, h0, scale, bt, fused, precision, save_ai):
  """The forward kernels on feature-padded inputs. Returns (o, final, (gcum, ai)); ai is None
  when the fused forward runs with save_ai=False (a call without gradient)."""
  r = mask.shape[-1]
  g_hm = jnp.moveaxis(g.astype(jnp.float32), 1, 2)                  # [B, H, Tp]
  beta_hm = jnp.moveaxis(beta.astype(jnp.float32), 1, 2)
  if fused:
    precision = fused_precision(q.dtype, precision)
    out = chunk_fwd.chunk_fwd(k, v, g_hm, beta_hm, mask, key_blocks=r, chunk=bt,
                              precision=precision, save_ai=save_ai,
                              **launch_params(CHUNK_FWD_PARAMS, r))
    gcum, w, u = out[:3]
    o, final = chunk_state_output.chunk_state_output(
        q, k, w, u, gcum, h0, key_blocks=r, chunk=bt, scale=scale, precision=precision,
        **launch_params(STATE_OUTPUT_PARAMS, r))
    return o, final, (gcum, out[3] if save_ai else None)
  a, gcum = kkt.chunk_kkt(k, beta_hm, mask, g_hm, bt, from_g=True)
  ai = solve_tril.solve_tril(a, bt * r, out_dtype=q.dtype)
  w, u = wy.recompute_w_u(k, v, beta_hm, mask, gcum, ai, bt)
  h, v_new, final = chunk_h.chunk_state(k, w, u, gcum, h0, bt)
  o = chunk_o.chunk_output(q, k, v_new, h, gcum, scale, bt)
  return o, final, (gcum, ai)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9, 10))
def _gdp_core(q, k, v, g, beta, mask, h0, scale, bt, fused, precision):
  # Without gradient: the fused forward writes neither Ai nor h nor v_new.
  o, final, _ = _forward(q, k, v, g, beta, mask, h0, scale, bt, fused, precision, save_ai=False)
  return o, final


def _gdp_core_fwd(q, k, v, g, beta, mask, h0, scale, bt, fused, precision):
  # Residuals: the inputs (the caller holds them anyway), gamma ([B, H, Tp] float32) and the
  # chunk inverses Ai ([B, H, Tp*r, N] in the input dtype: as much memory as one [B, T, H, N]
  # activation). The backward recomputes w, u (wy.py) and h, v_new (chunk_h.py) from them.
  o, final, (gcum, ai) = _forward(q, k, v, g, beta, mask, h0, scale, bt, fused, precision,
                                  save_ai=True)
  return (o, final), (q, k, v, g, beta, mask, h0, gcum, ai)


def _gdp_core_bwd(scale, bt, fused, precision, residuals, cotangents):
  del fused, precision                     # the backward kernels are the same for both forwards
  q, k, v, g, beta, mask, h0, gcum, ai = residuals
  do, dfinal = cotangents
  r = mask.shape[-1]
  beta_hm = jnp.moveaxis(beta.astype(jnp.float32), 1, 2)
  w, u = wy.recompute_w_u(k, v, beta_hm, mask, gcum, ai, bt)
  h, v_new, _ = chunk_h.chunk_state(k, w, u, gcum, h0, bt)
  dv_local = bwd_dv_local.chunk_bwd_dv_local(q, k, gcum, do, scale, bt, r)
  dh, dh0, dv_new = bwd_dhu.chunk_bwd_dhu(q, k, w, gcum, do, dv_local,
                                          dfinal.astype(jnp.float32), scale, bt,
                                          dh_dtype=q.dtype)
  dq, dk1, dw, dg1 = bwd_dqkwg.chunk_bwd_dqkwg(q, k, v_new, gcum, h, dh, do, dv_new, scale, bt)
  dk2, dv, dbeta, dmask_tok, dg2 = bwd_wy.wy_bwd(k, v, beta_hm, mask, gcum, ai, dw, dv_new, bt)
  dg = cumsum.chunk_local_cumsum(dg1 + dg2, bt, reverse=True)
  dmask = reduce_dmask(dmask_tok, mask.shape)
  time_major = lambda x: jnp.moveaxis(x, 1, 2)                      # [B, H, Tp] -> [B, Tp, H]
  return (dq.astype(q.dtype), (dk1 + dk2).astype(k.dtype), dv.astype(v.dtype),
          time_major(dg).astype(g.dtype), time_major(dbeta).astype(beta.dtype),
          dmask.astype(mask.dtype), dh0.astype(h0.dtype))


_gdp_core.defvjp(_gdp_core_fwd, _gdp_core_bwd)


def gated_delta_product_pallas(q, k, v, g, beta, mask, initial_state, scale, chunk_size, *,
                               fused=None, precision=None):
  """q, k [B, Tp, H, K]; v [B, Tp, H, V]; g, beta [B, Tp, H]; mask [Bm, Tm, Hm, r, r];
  initial_state [B, H, K, V] f32 -> (o [B, Tp, H, V] in q's dtype, final [B, H, K, V] f32).

  Differentiable in every input (jax.custom_vjp); the padding around the kernels is plain jnp.
  fused: the fused forward (default `FUSED`) or the five-kernel one; precision: the fused
  forward's float32 dot precision (default `FUSED_PRECISION`, see `fused_precision`).
  """
  fused = FUSED if fused is None else bool(fused)
  precision = FUSED_PRECISION if precision is None else precision
  if precision is not None and precision not in backend.PRECISIONS:
    raise ValueError(f"precision must be one of {backend.PRECISIONS} or None, got {precision!r}")
  dim_k, dim_v = q.shape[-1], v.shape[-1]
  r = mask.shape[-1]
  bt = pallas_chunk(chunk_size, r)
  dkp, vp = padded_dims(dim_k, dim_v, r)
  q = pad_key_blocks(q, r, dkp)
  k = pad_key_blocks(k, r, dkp)
  v = _pad_last(v, vp)
  h0 = _pad_last(pad_key_blocks(initial_state.swapaxes(-1, -2), r, dkp).swapaxes(-1, -2), vp)
  o, final = _gdp_core(q, k, v, g, beta, mask.astype(jnp.float32), h0, scale, bt, fused,
                       precision)
  o = o[..., :dim_v]
  final = unpad_key_blocks(final[..., :dim_v], r, dim_k // r, axis=-2)
  return o, final
