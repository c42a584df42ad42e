"""The state recurrence over chunks (docs/chunked_form.md#the-state-update-and-the-output),
one program per (V block, batch, head) (per sequence when packed,
pallas_kernels/common/packed.py).

For each chunk c, with S the state at its start (kept in registers as r row blocks [dk, BV]):
  h[c] = S
  v_new[(t,a)] = u[(t,a)] - sum_d w[(t,a), block d] S^(d)
  S^(d) = exp(gamma_last) S^(d) + sum_t exp(gamma_last - gamma_t) k_t^(d)T v_new[(t,d)]
Rows of one block a are read straight from the refs viewed as [Tp, r, D] (strided loads), so no
value is ever sliced (docs/pallas_triton.md).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.common import backend, options, packed, rows, specs


def _chunk_h_kernel(
  k_ref,
  w_ref,
  u_ref,
  g_ref,
  h0_ref,
  h_ref,
  v_new_ref,
  final_ref,
  *,
  r,
  chunk,
  num_chunks,
  precision,
  looped=False,
  table_ref=None,
):
  dot = functools.partial(backend.dot, precision=precision)
  if looped:
    refs = (k_ref, w_ref, u_ref, g_ref, h0_ref, h_ref, v_new_ref, final_ref)
    return _chunk_h_loop(
      *refs, r=r, chunk=chunk, num_chunks=num_chunks, dot=dot, table_ref=table_ref
    )
  dim_k = k_ref.shape[-1]
  dk = dim_k // r
  dtype = k_ref.dtype
  cols = lambda d: pl.ds(d * dk, dk)

  def body(c, state):
    t0 = pl.multiple_of(c * chunk, chunk)
    tok = pl.ds(t0, chunk)
    for d in range(r):
      h_ref[c, cols(d), :] = state[d].astype(h_ref.dtype)
    g = g_ref[tok]
    g_last, decay = rows.chunk_end_decay(g)
    v_new = []
    for a in range(r):
      pred = None
      for d in range(r):
        term = dot(w_ref[tok, a, cols(d)], state[d].astype(dtype))
        pred = term if pred is None else pred + term
      vn = (u_ref[tok, a, :].astype(jnp.float32) - pred).astype(dtype)
      v_new_ref[tok, a, :] = vn.astype(v_new_ref.dtype)
      v_new.append(vn)
    out = []
    for d in range(r):
      k_dec = (k_ref[tok, cols(d)].astype(jnp.float32) * decay).astype(dtype)
      out.append(jnp.exp(g_last) * state[d] + dot(k_dec, v_new[d], trans_a=True))
    return tuple(out)

  state = tuple(h0_ref[cols(d), :].astype(jnp.float32) for d in range(r))
  if table_ref is None:
    state = jax.lax.fori_loop(0, num_chunks, body, state)
  else:
    state = packed.walk(table_ref, body, state, num_chunks)
  for d in range(r):
    final_ref[cols(d), :] = state[d]


def _chunk_h_loop(k_ref, w_ref, u_ref, g_ref, h0_ref, h_ref, v_new_ref, final_ref, *, r, chunk,
                  num_chunks, dot, table_ref):  # fmt: skip
  """The kernel's loop form (`options.key_block_loop`): S one [K, BV] tile, the row blocks a in a
  loop; block a's update is `(k ⊙ [block a's columns])^T v_new[(., a)]`."""
  dtype = k_ref.dtype

  def body(c, state):
    tok = pl.ds(pl.multiple_of(c * chunk, chunk), chunk)
    h_ref[c, :, :] = state.astype(h_ref.dtype)
    g = g_ref[tok]
    g_last, decay = rows.chunk_end_decay(g)
    s_op = state.astype(dtype)
    k_dec = (k_ref[tok, :].astype(jnp.float32) * decay).astype(dtype)

    def row_block(a, update):
      vn = (u_ref[tok, a, :].astype(jnp.float32) - dot(w_ref[tok, a, :], s_op)).astype(dtype)
      v_new_ref[tok, a, :] = vn.astype(v_new_ref.dtype)
      return update + dot(rows.key_block_columns(k_dec, a, r), vn, trans_a=True)

    update = jax.lax.fori_loop(0, r, row_block, jnp.zeros_like(state))
    return jnp.exp(g_last) * state + update

  state = h0_ref[...].astype(jnp.float32)
  if table_ref is None:
    state = jax.lax.fori_loop(0, num_chunks, body, state)
  else:
    state = packed.walk(table_ref, body, state, num_chunks)
  final_ref[...] = state


def chunk_state(
  k,
  w,
  u,
  gcum,
  initial_state,
  *,
  chunk,
  key_blocks,
  h_dtype=None,
  launch=options.DEFAULT.chunk_h,
  precision="ieee",
  table=None,
  form="auto",
):
  """k [B, Tp, H, K]; w [B, H, Tp*r, K]; u [B, H, Tp*r, V]; gcum [B, H, Tp] f32;
  initial_state [B, H, K, V] f32 ->
  h [B, H, NT, K, V] (h_dtype, default k's dtype), v_new [B, H, Tp*r, V] (k's dtype),
  final state [B, H, K, V] float32.

  table: None, or packed sequences (docs/varlen.md, B = 1, pallas_kernels/common/packed.py):
  int32 [2, N] (chunk_start, num_chunks of each sequence; or `varlen.sequence_chunks` [4, N],
  whose rows 2 and 3 are unused here); initial_state and the final state are
  then [N, H, K, V] (an empty sequence's final state is its initial state) and the grid is
  (V / block_v, N, H), one program per sequence. form: `options.LOOP_FORMS` (the row blocks
  unrolled or in a loop; "auto" by r)."""
  bsz, t_len, key_heads, dim_k = k.shape
  heads, dim_v = u.shape[1], u.shape[-1]  # k may have H / group key heads (grouped value heads)
  r = key_blocks
  nt = t_len // chunk
  bv = min(launch.block_v, dim_v)
  h_dtype = k.dtype if h_dtype is None else h_dtype
  w5 = w.reshape(bsz, heads, t_len, r, dim_k)
  u5 = u.reshape(bsz, heads, t_len, r, dim_v)
  per_row_v = specs.seq_rows(t_len, r, bv, v_block=True)
  looped = options.key_block_loop(form, r)
  kernel = functools.partial(
    _chunk_h_kernel,
    precision=precision,
    r=r,
    chunk=chunk,
    num_chunks=nt,
    looped=looped,
  )
  state_spec, num_states = specs.state(dim_k, bv), bsz
  in_specs = [
    specs.seq_tokens(t_len, dim_k, group=heads // key_heads),
    specs.seq_rows(t_len, r, dim_k),
    per_row_v,
    specs.seq_scalars(t_len),
    state_spec,
  ]
  out_specs = [specs.chunk_states(nt, dim_k, bv), per_row_v, state_spec]
  args = (k, w5, u5, gcum, initial_state)
  if table is not None:
    num_states = initial_state.shape[0]
    packed.check_table(table, bsz, num_states, "initial_state")
    kernel, in_specs, out_specs, args = packed.with_table(
      kernel, in_specs, out_specs, args, table, state_spec
    )
  h, v_new, final = backend.pallas_call(
    kernel,
    grid=(dim_v // bv, num_states, heads),
    in_specs=in_specs,
    out_specs=out_specs,
    out_shape=[
      jax.ShapeDtypeStruct((bsz, heads, nt, dim_k, dim_v), h_dtype),
      jax.ShapeDtypeStruct((bsz, heads, t_len, r, dim_v), k.dtype),
      jax.ShapeDtypeStruct((num_states, heads, dim_k, dim_v), jnp.float32),
    ],
    num_warps=options.loop_warps(launch.num_warps, looped, dim_k, bv),
    num_stages=launch.num_stages,
    name="gdp_chunk_h",
  )(*args)
  return h, v_new.reshape(bsz, heads, t_len * r, dim_v), final
