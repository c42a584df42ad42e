"""The w/u recompute (docs/chunked_form.md#w-and-u): w = Ai (exp(gamma) beta Kw),
u = Ai (beta v), per chunk.

With Ai = (I + Ag)^-1 the gated inverse, w equals exp(gamma) (I + A)^-1 W~, so one inverse serves
both and no exp of a positive argument is formed.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.common import backend, options, rows, specs


def _wy_kernel(k_ref, v_ref, beta_ref, g_ref, mask_ref, ai_ref, w_ref, u_ref, *, r, precision):
  dot = functools.partial(backend.dot, precision=precision)
  k = k_ref[...]
  dtype = k.dtype
  ai = ai_ref[...].astype(dtype)
  beta = beta_ref[...].astype(jnp.float32)
  scale_w = rows.per_row(beta * jnp.exp(g_ref[...]), r)
  w_tilde = (scale_w[:, None] * rows.masked_keys(k, mask_ref, r)).astype(dtype)
  w_ref[...] = dot(ai, w_tilde).astype(w_ref.dtype)
  u_tilde = rows.repeat_rows((beta[:, None] * v_ref[...].astype(jnp.float32)).astype(dtype), r)
  u_ref[...] = dot(ai, u_tilde).astype(u_ref.dtype)


def recompute_w_u(
  k, v, beta, mask, gcum, ai, *, chunk, key_blocks, launch=options.DEFAULT.wy, precision="ieee"
):
  """-> w [B, H, Tp*r, K], u [B, H, Tp*r, V] in k's dtype. k may have H / group key heads for
  v's H value heads (read at key head h // group; docs/varlen.md#grouped-value-heads)."""
  bsz, t_len, key_heads, dim_k = k.shape
  heads, dim_v = v.shape[2], v.shape[-1]
  group = heads // key_heads
  r = key_blocks
  specs.check_key_blocks(mask, r)
  n = chunk * r
  return backend.pallas_call(
    lambda *refs: _wy_kernel(*refs, precision=precision, r=r),
    grid=(t_len // chunk, bsz, heads),
    in_specs=[
      specs.tokens(chunk, dim_k, group=group),
      specs.tokens(chunk, dim_v),
      specs.scalars(chunk),
      specs.scalars(chunk),
      specs.mask(mask.shape, chunk),
      specs.rows(n, n),
    ],
    out_specs=[specs.rows(n, dim_k), specs.rows(n, dim_v)],
    out_shape=[
      jax.ShapeDtypeStruct((bsz, heads, t_len * r, dim_k), k.dtype),
      jax.ShapeDtypeStruct((bsz, heads, t_len * r, dim_v), k.dtype),
    ],
    num_warps=launch.num_warps,
    num_stages=launch.num_stages,
    name="gdp_recompute_w_u",
  )(k, v, beta, gcum, mask, ai)
