"""The output (docs/chunked_form.md#the-state-update-and-the-output), one program per
(chunk and V block, batch, head):

  o_t = scale ( exp(gamma_t) q_t^T h[c]
              + sum_a sum_{s<=t} exp(gamma_t - gamma_s) <q_t^(a), k_s^(a)> v_new[(s,a)] )

The intra-chunk part runs block by block: P_a = (q^(a) k^(a)T) * decay is [BT, BT] and multiplies
the rows of v_new that belong to block a, read from the ref viewed as [Tp, r, V].
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.common import backend, options, rows


def _chunk_o_kernel(q_ref, k_ref, v_new_ref, h_ref, g_ref, o_ref, *, r, scale, precision):
  dot = functools.partial(backend.dot, precision=precision)
  chunk, dim_k = q_ref.shape
  dk = dim_k // r
  dtype = q_ref.dtype
  g = g_ref[...]
  q = q_ref[...]
  o = jnp.exp(g)[:, None] * dot(q, h_ref[...].astype(dtype))
  tok = jax.lax.broadcasted_iota(jnp.int32, (chunk,), 0)
  decay = rows.causal_decay(g, g, tok, tok, strict=False)
  for a in range(r):
    cols = pl.ds(a * dk, dk)
    p = dot(q_ref[:, cols], k_ref[:, cols], trans_b=True) * decay
    o = o + dot(p.astype(dtype), v_new_ref[:, a, :])
  o_ref[...] = (scale * o).astype(o_ref.dtype)


def chunk_output(
  q,
  k,
  v_new,
  h,
  gcum,
  *,
  scale,
  chunk,
  key_blocks,
  out_dtype=None,
  launch=options.DEFAULT.chunk_o,
  precision="ieee",
):
  """q, k [B, Tp, H, K]; v_new [B, H, Tp*r, V]; h [B, H, NT, K, V]; gcum [B, H, Tp] ->
  o [B, Tp, H, V] (out_dtype, default q's dtype)."""
  bsz, t_len, heads, dim_k = q.shape
  dim_v = v_new.shape[-1]
  r = key_blocks
  nt = t_len // chunk
  bv = min(launch.block_v, dim_v)
  nv = dim_v // bv
  out_dtype = q.dtype if out_dtype is None else out_dtype
  v5 = v_new.reshape(bsz, heads, t_len, r, dim_v)
  return backend.pallas_call(
    lambda *refs: _chunk_o_kernel(*refs, precision=precision, r=r, scale=scale),
    grid=(nt * nv, bsz, heads),
    in_specs=[
      pl.BlockSpec((None, chunk, None, dim_k), lambda i, b, h: (b, i // nv, h, 0)),
      pl.BlockSpec((None, chunk, None, dim_k), lambda i, b, h: (b, i // nv, h, 0)),
      pl.BlockSpec((None, None, chunk, r, bv), lambda i, b, h: (b, h, i // nv, 0, i % nv)),
      pl.BlockSpec((None, None, None, dim_k, bv), lambda i, b, h: (b, h, i // nv, 0, i % nv)),
      pl.BlockSpec((None, None, chunk), lambda i, b, h: (b, h, i // nv)),
    ],
    out_specs=pl.BlockSpec((None, chunk, None, bv), lambda i, b, h: (b, i // nv, h, i % nv)),
    out_shape=jax.ShapeDtypeStruct((bsz, t_len, heads, dim_v), out_dtype),
    num_warps=launch.num_warps,
    num_stages=launch.num_stages,
    name="gdp_chunk_o",
  )(q, k, v5, h, gcum)
