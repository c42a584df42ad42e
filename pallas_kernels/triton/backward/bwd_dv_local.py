"""Backward stage 1 (docs/chunked_form.md#the-backward): the intra-chunk part of dv_new,

  dv_local[(s,a)] = scale sum_{t>=s in chunk} exp(gamma_t - gamma_s) <q_t^(a), k_s^(a)> do_t

one [BT, BT] score tile and one [BT, BT] x [BT, V] product per key block a; jnp counterpart
`gdp_jax.ops.gated_delta_product.xla_backward.chunk_bwd_dv_local`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.common import backend, options, rows, specs


def _dv_local_kernel(q_ref, k_ref, g_ref, do_ref, dv_ref, *, r, scale, precision):
  dot = functools.partial(backend.dot, precision=precision)
  chunk, dim_k = q_ref.shape
  dk = dim_k // r
  dtype = q_ref.dtype
  g = g_ref[...]
  tok = jax.lax.broadcasted_iota(jnp.int32, (chunk,), 0)
  decay = scale * rows.causal_decay(g, g, tok, tok, strict=False)  # [t, s]
  do = do_ref[...].astype(dtype)
  for a in range(r):
    cols = pl.ds(a * dk, dk)
    p = dot(q_ref[:, cols], k_ref[:, cols], trans_b=True) * decay
    dv_ref[:, a, :] = dot(p.astype(dtype), do, trans_a=True).astype(dv_ref.dtype)


def chunk_bwd_dv_local(
  q,
  k,
  gcum,
  do,
  *,
  scale,
  chunk,
  key_blocks,
  launch=options.DEFAULT.bwd_dv_local,
  precision="ieee",
  out_dtype=jnp.float32,
):
  """q, k [B, Tp, H, K]; gcum [B, H, Tp]; do [B, Tp, H, V] -> dv_local [B, H, Tp*r, V] in
  out_dtype (the operator's backward: do's dtype, as bwd_dhu stores dv_new = dv_local + ... in it;
  accumulated in float32 either way). q and k may have H / group key heads for do's H value heads
  (read at key head h // group; docs/varlen.md#grouped-value-heads)."""
  bsz, t_len, key_heads, dim_k = q.shape
  heads, dim_v = do.shape[2], do.shape[-1]
  group = heads // key_heads
  r = key_blocks
  out = backend.pallas_call(
    lambda *refs: _dv_local_kernel(*refs, precision=precision, r=r, scale=scale),
    grid=(t_len // chunk, bsz, heads),
    in_specs=[
      specs.tokens(chunk, dim_k, group=group),
      specs.tokens(chunk, dim_k, group=group),
      specs.scalars(chunk),
      specs.tokens(chunk, dim_v),
    ],
    out_specs=pl.BlockSpec((None, None, chunk, r, dim_v), lambda t, b, h: (b, h, t, 0, 0)),
    out_shape=jax.ShapeDtypeStruct((bsz, heads, t_len, r, dim_v), out_dtype),
    num_warps=launch.num_warps,
    num_stages=launch.num_stages,
    name="gdp_bwd_dv_local",
  )(q, k, gcum, do)
  return out.reshape(bsz, heads, t_len * r, dim_v)
