"""The state recurrence fused with the output
(docs/kernels.md#chunk_state_output-the-state-walk-and-the-output).

One program per (V tile, batch, head) (per sequence when packed, packed.py) walks the chunks in
order with S, the state at the chunk's start, in registers as r row blocks [dk, BV] float32; per
chunk it forms v_new = u - w S, the outputs and the next S
(docs/chunked_form.md#the-state-update-and-the-output). The per-chunk states h and v_new leave
the kernel only with save_states=True (what the backward reads). Rows of one key block are read
from the refs viewed as [Tp, r, D] and key blocks as column blocks, so no loaded value is sliced
(docs/pallas_triton.md). Packed sequences in place (`in_place=True`,
docs/varlen.md#the-pallas-kernels): q and k are read from the packed row with masked loads and o
written there with masked stores; w, u, gamma, h and v_new stay in the chunk-aligned layout.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.common import backend, options, packed, rows, specs

CHUNKS = (16, 32, 64)
f32 = jnp.float32


def _kernel(
  q_ref,
  k_ref,
  w_ref,
  u_ref,
  g_ref,
  h0_ref,
  o_ref,
  final_ref,
  *state_refs,
  r,
  chunk,
  num_chunks,
  scale,
  precision,
  in_place=False,
  looped=False,
  table_ref=None,
  every=None,
):
  dim_k = k_ref.shape[-1]
  dk = dim_k // r
  dtype = k_ref.dtype
  dot = functools.partial(backend.dot, precision=precision)
  if looped:
    refs = (q_ref, k_ref, w_ref, u_ref, g_ref, h0_ref, o_ref, final_ref, *state_refs)
    kw = dict(r=r, chunk=chunk, num_chunks=num_chunks, scale=scale, dot=dot, every=every)
    return _loop_kernel(*refs, **kw, in_place=in_place, table_ref=table_ref)
  tok = jax.lax.broadcasted_iota(jnp.int32, (chunk,), 0)
  cols = lambda d: pl.ds(d * dk, dk)

  t_len = q_ref.shape[0]  # the tokens of q, k and o (the packed row's when in place)
  # the program's sequence: its table entries read once, outside the walk's loop
  span = packed.sequence_span(table_ref, pl.program_id(1)) if in_place else None

  def body(c, state):
    t0 = pl.multiple_of(c * chunk, chunk)
    tt = pl.ds(t0, chunk)  # the chunk in the chunk-aligned layout (w, u, gamma, v_new)
    if state_refs and not every:
      for d in range(r):
        state_refs[0][c, cols(d), :] = state[d].astype(state_refs[0].dtype)
    g = g_ref[tt]
    g_last, k_decay = rows.chunk_end_decay(g)
    s_op = [s.astype(dtype) for s in state]  # dot operands
    if in_place:  # the chunk's tokens in the packed row; rows past the sequence read as zeros
      start, valid = packed.sequence_rows(span, c, chunk, t_len)
      q = [packed.load_rows(q_ref, start, chunk, valid, (cols(d),)) for d in range(r)]
      k = [packed.load_rows(k_ref, start, chunk, valid, (cols(d),)) for d in range(r)]
    else:
      q = [q_ref[tt, cols(d)] for d in range(r)]  # [BT, dk] each, loaded once
      k = [k_ref[tt, cols(d)] for d in range(r)]
    # The chunk's start-state part of the output: exp(gamma_t) q_t^T S.
    o = None
    for d in range(r):
      term = dot(q[d], s_op[d])
      o = term if o is None else o + term
    o = jnp.exp(g)[:, None] * o
    decay = rows.causal_decay(g, g, tok, tok, strict=False)
    v_new = []
    for a in range(r):
      pred = None
      for d in range(r):
        term = dot(w_ref[tt, a, cols(d)], s_op[d])
        pred = term if pred is None else pred + term
      vn = (u_ref[tt, a, :].astype(f32) - pred).astype(dtype)
      if state_refs and not every:
        state_refs[1][tt, a, :] = vn.astype(state_refs[1].dtype)
      p = dot(q[a], k[a], trans_b=True) * decay
      o = o + dot(p.astype(dtype), vn)
      v_new.append(vn)
    if in_place:  # the sequence's rows only: the next ones are another sequence's
      packed.store_rows(o_ref, start, scale * o, valid)
    else:
      o_ref[tt, :] = (scale * o).astype(o_ref.dtype)
    out = []
    for d in range(r):
      k_dec = (k[d].astype(f32) * k_decay).astype(dtype)
      out.append(jnp.exp(g_last) * state[d] + dot(k_dec, v_new[d], trans_a=True))
      if every:
        _store_every(state_refs[0], c, every, out[d], (cols(d), slice(None)))
    return tuple(out)

  state = tuple(h0_ref[cols(d), :].astype(f32) for d in range(r))
  if table_ref is None:
    state = jax.lax.fori_loop(0, num_chunks, body, state)
  else:
    state = packed.walk(table_ref, body, state, num_chunks)
  for d in range(r):
    final_ref[cols(d), :] = state[d]


def _loop_kernel(q_ref, k_ref, w_ref, u_ref, g_ref, h0_ref, o_ref, final_ref, *state_refs, r,
                 chunk, num_chunks, scale, dot, in_place, table_ref, every=None):  # fmt: skip
  """The kernel's loop form (`options.key_block_loop`): S one [K, BV] tile, the row blocks a in a
  loop; block a's scores are `(q ⊙ [block a's columns]) k^T` and its update
  `(k ⊙ [block a's columns])^T v_new[(., a)]`."""
  dtype = k_ref.dtype
  tok = jax.lax.broadcasted_iota(jnp.int32, (chunk,), 0)
  t_len = q_ref.shape[0]
  span = packed.sequence_span(table_ref, pl.program_id(1)) if in_place else None

  def body(c, state):
    tt = pl.ds(pl.multiple_of(c * chunk, chunk), chunk)
    if state_refs and not every:
      state_refs[0][c, :, :] = state.astype(state_refs[0].dtype)
    g = g_ref[tt]
    g_last, k_decay = rows.chunk_end_decay(g)
    s_op = state.astype(dtype)
    if in_place:
      start, valid = packed.sequence_rows(span, c, chunk, t_len)
      q = packed.load_rows(q_ref, start, chunk, valid, (slice(None),))
      k = packed.load_rows(k_ref, start, chunk, valid, (slice(None),))
    else:
      q, k = q_ref[tt, :], k_ref[tt, :]
    o = jnp.exp(g)[:, None] * dot(q, s_op)
    decay = rows.causal_decay(g, g, tok, tok, strict=False)
    k_dec = (k.astype(f32) * k_decay).astype(dtype)

    def row_block(a, carry):
      o, update = carry
      vn = (u_ref[tt, a, :].astype(f32) - dot(w_ref[tt, a, :], s_op)).astype(dtype)
      if state_refs and not every:
        state_refs[1][tt, a, :] = vn.astype(state_refs[1].dtype)
      p = dot(rows.key_block_columns(q, a, r), k, trans_b=True) * decay
      k_a = rows.key_block_columns(k_dec, a, r)
      return o + dot(p.astype(dtype), vn), update + dot(k_a, vn, trans_a=True)

    o, update = jax.lax.fori_loop(0, r, row_block, (o, jnp.zeros_like(state)))
    if in_place:
      packed.store_rows(o_ref, start, scale * o, valid)
    else:
      o_ref[tt, :] = (scale * o).astype(o_ref.dtype)
    new = jnp.exp(g_last) * state + update
    if every:
      _store_every(state_refs[0], c, every, new, (slice(None), slice(None)))
    return new

  state = h0_ref[...].astype(f32)
  if table_ref is None:
    state = jax.lax.fori_loop(0, num_chunks, body, state)
  else:
    state = packed.walk(table_ref, body, state, num_chunks)
  final_ref[...] = state


def _store_every(ref, c, every, value, cols):
  """ref[(c + 1) // every - 1, *cols] = value after chunks c = every - 1, 2 every - 1, ...: the
  state after every `every` chunks (a masked store: no branch in the walk)."""
  done = c + 1  # chunks walked; c >= 0, so lax.div and lax.rem (truncating) are exact here
  every = jnp.asarray(every, done.dtype)
  row = jnp.maximum(jax.lax.div(done, every) - 1, 0)
  keep = jnp.full(value.shape, jax.lax.rem(done, every) == 0)
  pltriton.store(ref.at[(row, *cols)], value.astype(ref.dtype), mask=keep)


def chunk_state_output(
  q,
  k,
  w,
  u,
  gamma,
  initial_state,
  *,
  key_blocks,
  chunk,
  scale,
  precision="tf32",
  save_states=False,
  h_dtype=None,
  launch=options.DEFAULT.chunk_state_output,
  table=None,
  in_place=False,
  form="auto",
  save_every=None,
):
  """The state recurrence and the output in one walk over the chunks.

  q, k [B, Tp, H, K] (K / key_blocks a power of two >= 16); w [B, H, Tp*r, K], u [B, H, Tp*r, V]
  (from chunk_fwd.chunk_fwd, rows in (t, a) order); gamma [B, H, Tp] float32 (chunk-local cumsum
  of g over chunks of `chunk` tokens); initial_state [B, H, K, V] float32. `precision` applies to
  float32 dots (float32 inputs). launch.block_v: the V tile of one program (grid V / block_v, B, H).
  Grouped value heads (docs/varlen.md#grouped-value-heads): q and k may have H / group key heads
  for the H heads of w, u, gamma and the state (value head h reads key head h // group; q and k
  are not repeated).

  Returns o [B, Tp, H, V] in q's dtype and the final state [B, H, K, V] float32; with
  save_states=True also h [B, H, NT, K, V] (each chunk's start state, h_dtype, default k's dtype)
  and v_new [B, H, Tp*r, V] in k's dtype.

  table: None, or packed sequences (docs/varlen.md, B = 1, pallas_kernels/common/packed.py):
  int32 [2, N], the rows chunk_start and num_chunks of `varlen.sequence_chunks` at this chunk;
  initial_state and the returned final state are then [N, H, K, V] (one per sequence; an empty
  sequence's final state is its initial state) and the grid is (V / block_v, N, H). The table
  may also be `varlen.sequence_chunks`' [4, N] (rows 2 and 3 unused).

  in_place (with the [4, N] table): q and k are the packed row [1, T, H, K] itself (T any
  length: the N sequences back to back, `cu_seqlens` = rows 2 and 3 of the table), read at each
  chunk's tokens with masked loads, and o [1, T, H, V] is written there with masked stores;
  w, u, gamma (and the saved h, v_new) keep the chunk-aligned layout of Tp = C * NT tokens
  (pallas_kernels/common/packed.py).

  form: `options.LOOP_FORMS` (the row blocks unrolled or in a loop; "auto" by r).

  save_every: None, or E chunks: also return the state after every E chunks, [B, H, NT // E, K,
  V] float32 (row j after chunks [0, (j + 1) E)): the block states of
  gdp_jax/ops/gated_delta_product/block_states.py, written from the walk. Not with save_states
  or a table.
  """
  if save_every is not None and (save_states or table is not None or save_every < 1):
    raise ValueError(
      f"save_every must be a positive number of chunks, without save_states or a table; got "
      f"save_every={save_every!r}, save_states={save_states}, table {table is not None}"
    )
  if q.ndim != 4 or q.shape != k.shape:
    raise ValueError(f"q and k must both be [B, Tp, H, K], got q {q.shape}, k {k.shape}")
  bsz, t_len, key_heads, dim_k = k.shape
  heads = w.shape[1] if w.ndim == 4 else key_heads  # value heads (a bad w fails below)
  t_tokens = t_len  # the tokens of q, k and o
  if in_place:
    if table is None:
      raise ValueError("in_place=True needs the per-sequence table (varlen.sequence_chunks)")
    if gamma.ndim != 3:
      raise ValueError(f"gamma must be [B, H, Tp], got {gamma.shape}")
    t_len = gamma.shape[2]  # the chunk-aligned layout's tokens
  if key_heads == 0 or heads % key_heads:
    raise ValueError(
      f"w has {heads} value heads (w {w.shape}), not a multiple of the {key_heads} key heads of "
      f"q and k {k.shape}"
    )
  r = key_blocks
  if r not in (1, 2, 4, 8, 16) or dim_k % r:
    raise ValueError(f"key_blocks must be a power of two <= 16 dividing K = {dim_k}, got {r!r}")
  if chunk not in CHUNKS or t_len % chunk:
    raise ValueError(f"chunk must be one of {CHUNKS} and divide Tp = {t_len}, got {chunk!r}")
  if w.shape != (bsz, heads, t_len * r, dim_k):
    raise ValueError(f"w must be [B, H, Tp*r, K] = {(bsz, heads, t_len * r, dim_k)}, got {w.shape}")
  dim_v = u.shape[-1]
  if u.shape != (bsz, heads, t_len * r, dim_v):
    raise ValueError(f"u must be [B, H, Tp*r, V] = {(bsz, heads, t_len * r, dim_v)}, got {u.shape}")
  if gamma.shape != (bsz, heads, t_len):
    raise ValueError(f"gamma must be [B, H, Tp] = {(bsz, heads, t_len)}, got {gamma.shape}")
  num_states = bsz if table is None else initial_state.shape[0]
  if initial_state.shape != (num_states, heads, dim_k, dim_v):
    raise ValueError(
      f"initial_state must be [B, H, K, V] = {(num_states, heads, dim_k, dim_v)} ([N, H, K, V] "
      f"with a table), got {initial_state.shape}"
    )
  if table is not None:
    packed.check_table(table, bsz, num_states, "initial_state", in_place=in_place)
  bv = min(launch.block_v, dim_v)
  if dim_v % bv or bv < 16 or bv & (bv - 1) or dim_k // r < 16 or (dim_k // r) & (dim_k // r - 1):
    raise ValueError(
      f"V = {dim_v} must be a multiple of block_v = {bv} (a power of two >= 16) "
      f"and K / key_blocks = {dim_k // r} a power of two >= 16"
    )
  nt = t_len // chunk
  h_dtype = k.dtype if h_dtype is None else h_dtype
  w5 = w.reshape(bsz, heads, t_len, r, dim_k)
  u5 = u.reshape(bsz, heads, t_len, r, dim_v)
  per_row_v = specs.seq_rows(t_len, r, bv, v_block=True)
  state_spec = specs.state(dim_k, bv)
  out_specs = [specs.seq_tokens(t_tokens, bv, v_block=True), state_spec]
  out_shape = [
    jax.ShapeDtypeStruct((bsz, t_tokens, heads, dim_v), q.dtype),
    jax.ShapeDtypeStruct((num_states, heads, dim_k, dim_v), f32),
  ]
  if save_states:
    out_specs += [specs.chunk_states(nt, dim_k, bv), per_row_v]
    out_shape += [
      jax.ShapeDtypeStruct((bsz, heads, nt, dim_k, dim_v), h_dtype),
      jax.ShapeDtypeStruct((bsz, heads, t_len, r, dim_v), k.dtype),
    ]
  if save_every is not None:
    out_specs.append(specs.chunk_states(max(nt // save_every, 1), dim_k, bv))
    out_shape.append(
      jax.ShapeDtypeStruct((bsz, heads, max(nt // save_every, 1), dim_k, dim_v), f32)
    )
  looped = options.key_block_loop(form, r)
  kernel = functools.partial(
    _kernel,
    r=r,
    chunk=chunk,
    num_chunks=nt,
    scale=scale,
    precision=precision,
    in_place=in_place,
    looped=looped,
    every=save_every,
  )
  in_specs = [
    specs.seq_tokens(t_tokens, dim_k, group=heads // key_heads),
    specs.seq_tokens(t_tokens, dim_k, group=heads // key_heads),
    specs.seq_rows(t_len, r, dim_k),
    per_row_v,
    specs.seq_scalars(t_len),
    state_spec,
  ]
  args = (q, k, w5, u5, gamma.astype(f32), initial_state.astype(f32))
  if table is not None:
    # one program per (V tile, sequence, head); the token arrays are those of the one row
    kernel, in_specs, out_specs, args = packed.with_table(
      kernel, in_specs, out_specs, args, table, state_spec
    )
  out = backend.pallas_call(
    kernel,
    grid=(dim_v // bv, num_states, heads),
    in_specs=in_specs,
    out_specs=out_specs,
    out_shape=out_shape,
    num_warps=options.loop_warps(launch.num_warps, looped, dim_k, bv),
    num_stages=launch.num_stages,
    name="gdp_chunk_state_output",
  )(*args)
  if save_states:
    o, final, h, v_new = out
    return o, final, h, v_new.reshape(bsz, heads, t_len * r, dim_v)
  if save_every is not None:
    o, final, states = out
    return o, final, states[:, :, : nt // save_every]
  return tuple(out)
