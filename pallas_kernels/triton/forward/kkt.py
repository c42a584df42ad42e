"""The chunk KKT with the r x r block mask and the gate
(docs/chunked_form.md#the-chunk-matrix-a).

A[(t,a),(s,b)] = beta_t M_t[a,b] <k_t^(b), k_s^(b)> exp(gamma_t - gamma_s) for t > s, else 0,
computed as one [N, K] x [K, N] matmul of the masked keys Kw and the block keys Kb.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.common import backend, options, rows, specs


def _kkt_kernel(k_ref, beta_ref, g_ref, mask_ref, a_ref, *gcum_ref, r, precision):
  dot = functools.partial(backend.dot, precision=precision)
  k = k_ref[...]
  bt = k.shape[0]
  n = bt * r
  kw = rows.masked_keys(k, mask_ref, r).astype(k.dtype)
  kb = rows.block_keys(k, r).astype(k.dtype)
  kkt = dot(kw, kb, trans_b=True)  # [N, N] float32
  tok = rows.row_tokens(n, r)
  g = g_ref[...].astype(jnp.float32)
  if gcum_ref:  # fused chunk-local cumsum: g_ref holds g, not gamma
    g = jnp.cumsum(g)
    gcum_ref[0][...] = g
  g = rows.per_row(g, r)
  beta = rows.per_row(beta_ref[...].astype(jnp.float32), r)
  decay = rows.causal_decay(g, g, tok, tok, strict=True)
  a_ref[...] = (beta[:, None] * kkt * decay).astype(a_ref.dtype)


def chunk_kkt(
  k,
  beta,
  mask,
  gcum,
  *,
  chunk,
  key_blocks,
  out_dtype=jnp.float32,
  from_g=False,
  launch=options.DEFAULT.kkt,
  precision="ieee",
):
  """k [B, Tp, H, K]; beta, gcum [B, H, Tp]; mask [Bm, Tm, Hm, r, r] -> A [B, H, Tp*r, N].

  from_g=True: the third argument is g itself; the kernel also does the chunk-local cumsum
  (one launch less) and returns (A, gamma [B, H, Tp] float32).
  """
  bsz, t_len, heads, dim_k = k.shape
  r = key_blocks
  specs.check_key_blocks(mask, r)
  n = chunk * r
  a_shape = jax.ShapeDtypeStruct((bsz, heads, t_len * r, n), out_dtype)
  out_specs, out_shape = specs.rows(n, n), a_shape
  if from_g:
    out_specs = [out_specs, specs.scalars(chunk)]
    out_shape = [a_shape, jax.ShapeDtypeStruct(gcum.shape, jnp.float32)]
  return backend.pallas_call(
    lambda *refs: _kkt_kernel(*refs, precision=precision, r=r),
    grid=(t_len // chunk, bsz, heads),
    in_specs=[
      specs.tokens(chunk, dim_k),
      specs.scalars(chunk),
      specs.scalars(chunk),
      specs.mask(mask.shape, chunk),
    ],
    out_specs=out_specs,
    out_shape=out_shape,
    num_warps=launch.num_warps,
    num_stages=launch.num_stages,
    name="gdp_chunk_kkt",
  )(k, beta, gcum, mask)
