"""Backward stage 2 (docs/chunked_form.md#the-backward): the state gradient, backward over chunks.

One program per (V block, batch, head) (per sequence when packed,
pallas_kernels/common/packed.py). dS (the gradient of the state at the end of the current chunk,
kept in registers as r row blocks [dk, BV], float32) starts at d final_state; per chunk, last to
first:
  dh[c]          = dS
  dv_new[(t,a)]  = dv_local[(t,a)] + exp(gamma_L - gamma_t) k_t^(a) dS^(a)
  dS^(d)         = exp(gamma_L) dS^(d) + scale (exp(gamma) q^(d))^T do
                   - sum_a w[(.,a), d]^T dv_new_a
and the dS left after chunk 0 is d initial_state. jnp counterpart: `xla_backward.chunk_bwd_dhu`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.common import backend, options, packed, rows, specs


def _dhu_kernel(
  q_ref,
  k_ref,
  w_ref,
  g_ref,
  do_ref,
  dvl_ref,
  dfinal_ref,
  dh_ref,
  dv_new_ref,
  dh0_ref,
  *,
  r,
  chunk,
  num_chunks,
  scale,
  precision,
  looped=False,
  table_ref=None,
):
  dot = functools.partial(backend.dot, precision=precision)
  if looped:
    refs = (q_ref, k_ref, w_ref, g_ref, do_ref, dvl_ref, dfinal_ref, dh_ref, dv_new_ref, dh0_ref)
    kw = dict(r=r, chunk=chunk, num_chunks=num_chunks, scale=scale, dot=dot, table_ref=table_ref)
    return _dhu_loop(*refs, **kw)
  dim_k = k_ref.shape[-1]
  dk = dim_k // r
  dtype = k_ref.dtype
  cols = lambda d: pl.ds(d * dk, dk)

  def step(c, ds):
    tok = pl.ds(pl.multiple_of(c * chunk, chunk), chunk)
    for d in range(r):
      dh_ref[c, cols(d), :] = ds[d].astype(dh_ref.dtype)
    g = g_ref[tok]
    g_last, k_dec = rows.chunk_end_decay(g)
    dv_new = []
    for a in range(r):
      kd = (k_ref[tok, cols(a)].astype(jnp.float32) * k_dec).astype(dtype)
      dvn = (dvl_ref[tok, a, :] + dot(kd, ds[a].astype(dtype))).astype(dtype)
      dv_new_ref[tok, a, :] = dvn  # in the input dtype: every consumer casts it so
      dv_new.append(dvn)
    q_dec = (scale * jnp.exp(g))[:, None]
    do = do_ref[tok, :].astype(dtype)
    out = []
    for d in range(r):
      qd = (q_ref[tok, cols(d)].astype(jnp.float32) * q_dec).astype(dtype)
      nxt = jnp.exp(g_last) * ds[d] + dot(qd, do, trans_a=True)
      for a in range(r):
        nxt = nxt - dot(w_ref[tok, a, cols(d)], dv_new[a], trans_a=True)
      out.append(nxt)
    return tuple(out)

  ds = tuple(dfinal_ref[cols(d), :].astype(jnp.float32) for d in range(r))
  if table_ref is None:
    ds = jax.lax.fori_loop(0, num_chunks, lambda i, ds: step(num_chunks - 1 - i, ds), ds)
  else:
    ds = packed.walk(table_ref, step, ds, num_chunks, reverse=True)
  for d in range(r):
    dh0_ref[cols(d), :] = ds[d]


def _dhu_loop(q_ref, k_ref, w_ref, g_ref, do_ref, dvl_ref, dfinal_ref, dh_ref, dv_new_ref,
              dh0_ref, *, r, chunk, num_chunks, scale, dot, table_ref):  # fmt: skip
  """The kernel's loop form (`options.key_block_loop`): dS one [K, BV] tile, the row blocks a in a
  loop; block a's dv_new reads `(k ⊙ [block a's columns]) dS`."""
  dtype = k_ref.dtype

  def step(c, ds):
    tok = pl.ds(pl.multiple_of(c * chunk, chunk), chunk)
    dh_ref[c, :, :] = ds.astype(dh_ref.dtype)
    g = g_ref[tok]
    g_last, decay = rows.chunk_end_decay(g)
    kd = (k_ref[tok, :].astype(jnp.float32) * decay).astype(dtype)
    qd = (q_ref[tok, :].astype(jnp.float32) * (scale * jnp.exp(g))[:, None]).astype(dtype)
    ds_op = ds.astype(dtype)
    nxt = jnp.exp(g_last) * ds + dot(qd, do_ref[tok, :].astype(dtype), trans_a=True)

    def row_block(a, nxt):
      dvn = (dvl_ref[tok, a, :] + dot(rows.key_block_columns(kd, a, r), ds_op)).astype(dtype)
      dv_new_ref[tok, a, :] = dvn
      return nxt - dot(w_ref[tok, a, :], dvn, trans_a=True)

    return jax.lax.fori_loop(0, r, row_block, nxt)

  ds = dfinal_ref[...].astype(jnp.float32)
  if table_ref is None:
    ds = jax.lax.fori_loop(0, num_chunks, lambda i, ds: step(num_chunks - 1 - i, ds), ds)
  else:
    ds = packed.walk(table_ref, step, ds, num_chunks, reverse=True)
  dh0_ref[...] = ds


def chunk_bwd_dhu(
  q,
  k,
  w,
  gcum,
  do,
  dv_local,
  dfinal,
  *,
  scale,
  chunk,
  key_blocks,
  dh_dtype=None,
  launch=options.DEFAULT.bwd_dhu,
  precision="ieee",
  table=None,
  form="auto",
):
  """q, k [B, Tp, H, K]; w [B, H, Tp*r, K]; gcum [B, H, Tp]; do [B, Tp, H, V];
  dv_local [B, H, Tp*r, V]; dfinal [B, H, K, V] f32 ->
  dh [B, H, NT, K, V] (dh_dtype, default float32), d initial_state [B, H, K, V] f32,
  dv_new [B, H, Tp*r, V] in q's dtype (its consumers, this kernel's own dots, bwd_dqkwg and
  bwd_wy, all use it in that dtype).

  table: None, or packed sequences (docs/varlen.md, B = 1, pallas_kernels/common/packed.py):
  int32 [2, N] (chunk_start, num_chunks of each sequence; or `varlen.sequence_chunks` [4, N],
  whose rows 2 and 3 are unused here); dfinal and d initial_state are then
  [N, H, K, V] (an empty sequence's d initial_state is its dfinal) and the grid is
  (V / block_v, N, H), one program per sequence walking its chunks last to first. q and k may have
  H / group key heads for do's H value heads (read at key head h // group). form:
  `options.LOOP_FORMS` (the row blocks unrolled or in a loop; "auto" by r)."""
  bsz, t_len, key_heads, dim_k = q.shape
  heads, dim_v = do.shape[2], do.shape[-1]
  group = heads // key_heads
  r = key_blocks
  nt = t_len // chunk
  bv = min(launch.block_v, dim_v)
  dh_dtype = jnp.float32 if dh_dtype is None else dh_dtype
  w5 = w.reshape(bsz, heads, t_len, r, dim_k)
  dvl5 = dv_local.reshape(bsz, heads, t_len, r, dim_v)
  per_row_v = specs.seq_rows(t_len, r, bv, v_block=True)
  looped = options.key_block_loop(form, r)
  kernel = functools.partial(
    _dhu_kernel,
    precision=precision,
    r=r,
    chunk=chunk,
    num_chunks=nt,
    scale=scale,
    looped=looped,
  )
  state_spec, num_states = specs.state(dim_k, bv), bsz
  in_specs = [
    specs.seq_tokens(t_len, dim_k, group=group),
    specs.seq_tokens(t_len, dim_k, group=group),
    specs.seq_rows(t_len, r, dim_k),
    specs.seq_scalars(t_len),
    specs.seq_tokens(t_len, bv, v_block=True),
    per_row_v,
    state_spec,
  ]
  out_specs = [specs.chunk_states(nt, dim_k, bv), per_row_v, state_spec]
  args = (q, k, w5, gcum, do, dvl5, dfinal)
  if table is not None:
    num_states = dfinal.shape[0]
    packed.check_table(table, bsz, num_states, "dfinal")
    kernel, in_specs, out_specs, args = packed.with_table(
      kernel, in_specs, out_specs, args, table, state_spec
    )
  dh, dv_new, dh0 = backend.pallas_call(
    kernel,
    grid=(dim_v // bv, num_states, heads),
    in_specs=in_specs,
    out_specs=out_specs,
    out_shape=[
      jax.ShapeDtypeStruct((bsz, heads, nt, dim_k, dim_v), dh_dtype),
      jax.ShapeDtypeStruct((bsz, heads, t_len, r, dim_v), q.dtype),
      jax.ShapeDtypeStruct((num_states, heads, dim_k, dim_v), jnp.float32),
    ],
    num_warps=options.loop_warps(launch.num_warps, looped, dim_k, bv),
    num_stages=launch.num_stages,
    name="gdp_bwd_dhu",
  )(*args)
  return dh, dh0, dv_new.reshape(bsz, heads, t_len * r, dim_v)
