"""`gated_delta_product(..., state_every=N)`: the state after every N tokens besides o, for prefix
caching (docs/operator.md#block-boundary-states, docs/inference.md#prefix-caching).

Plain rows: states [B, T // N, HV, K, V] float32, row j the state after tokens [0, (j + 1) N).
Packed rows (cu_seqlens): [1, T // N, HV, K, V], the blocks of each sequence counted from its own
start, sequence n's in rows [c[n], c[n + 1]) (c = `varlen.block_offsets`), zeros after the last.
"reference" keeps them from its scan; "xla" and "triton" sample the states their walk over the
chunks computes (each chunk's start state), "mosaic_gpu"'s walk writes them (plain rows);
"triton" and "mosaic_gpu" have no derivatives here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from gdp_jax.ops.autodiff import raise_if_differentiated
from gdp_jax.ops.gated_delta_product import nonfinite, triton, varlen, xla
from gdp_jax.ops.gated_delta_product.reference import recurrent_step
from gdp_jax.ops.heads import expand_key_heads
from pallas_kernels.common import options as kernel_options
from pallas_kernels.triton.forward import chunk_fwd, chunk_state_output

f32 = jnp.float32
i32 = jnp.int32

NO_DERIVATIVES = (
  "gated_delta_product(..., state_every=N) with implementation='triton', 'mosaic_gpu' (or "
  "'pallas') has no derivatives: its kernels' states are a forward-only output. Differentiate "
  "a call without state_every, or use implementation='xla' (or 'reference'), which JAX "
  "differentiates with the states"
)


def _packed_rows(cu, every: int, rows: int):
  """For each states row of the packed form: (sequence n, tokens p of it before the boundary,
  valid). cu: sanitised offsets."""
  offsets = varlen.block_offsets(cu, every)
  i = jnp.arange(rows, dtype=i32)
  n = jnp.searchsorted(offsets[1:], i, side="right", method="compare_all")
  n = jnp.minimum(n, cu.shape[0] - 2).astype(i32)
  return n, (i - offsets[n] + 1) * every, i < offsets[-1]


def _mark(states, marks, token):
  """nan where the state after token `token` [B, rows] is spoiled (`nonfinite.Marks.state`)."""
  token = jnp.clip(token, 0, marks.state.shape[1] - 1)
  bad = jnp.take_along_axis(marks.state, token[..., None], axis=1)  # [B, rows, H]
  return jnp.where(bad[..., None, None], jnp.array(jnp.nan, states.dtype), states)


def _plain(starts, final, every, chunk, rows, marks):
  """The states after every `every` tokens from each chunk's start state starts [B, H, NT, K, V]
  and the final state [B, H, K, V]: [B, rows, H, K, V]."""
  ends = jnp.concatenate([starts[:, :, 1:].astype(f32), final[:, :, None].astype(f32)], axis=2)
  per = every // chunk
  states = jnp.moveaxis(ends[:, :, per - 1 :: per][:, :, :rows], 2, 1)
  token = jnp.broadcast_to((jnp.arange(rows, dtype=i32) + 1) * every - 1, states.shape[:2])
  return _mark(states, marks, token)


def _packed(starts, final, lay, every, rows, marks):
  """The packed form's states from each chunk's start state starts [NT, H, K, V] in the
  chunk-aligned layout `lay` and the final states [N, H, K, V]: [1, rows, H, K, V]."""
  cu = lay.cu_seqlens
  n, p, valid = _packed_rows(cu, every, rows)
  chunk_start = varlen.sequence_chunks(lay)[0]
  after = jnp.minimum(chunk_start[n] + p // lay.chunk, starts.shape[0] - 1)
  inside = (p < cu[n + 1] - cu[n])[:, None, None, None]  # else the boundary is the sequence's end
  states = jnp.where(inside, starts[after].astype(f32), final[n].astype(f32))
  states = jnp.where(
    valid[:, None, None, None], _mark(states[None], marks, (cu[n] + p - 1)[None])[0], 0
  )
  return states[None]


# ---- the implementations -----------------------------------------------------------------------


def _reference(impl, q, k, v, g, beta, mask, h0, scale, chunk, every, cu_seqlens):
  """o and the final state from the reference itself; the states from one more scan over the
  cleaned inputs that writes the state into its row after each block's last token."""
  t_len, rows = q.shape[1], q.shape[1] // every
  if cu_seqlens is None:
    o, final = impl(q, k, v, g, beta, mask, h0, scale, chunk)
  else:
    o, final = impl.varlen(q, k, v, g, beta, mask, h0, scale, chunk, cu_seqlens)
  q, k = (expand_key_heads(x, v.shape[2]) for x in (q, k))
  t = jnp.arange(t_len, dtype=i32)
  if cu_seqlens is None:
    (q, k, v, g, beta, mask), marks = nonfinite.clean(q, k, v, g, beta, mask, with_state=True)
    slot = jnp.where((t + 1) % every == 0, (t + 1) // every - 1, -1)
    seq, first = jnp.zeros((t_len,), i32), jnp.zeros((t_len,), bool)
    token = jnp.broadcast_to((jnp.arange(rows, dtype=i32) + 1) * every - 1, (q.shape[0], rows))
  else:
    cu = varlen.sanitize(cu_seqlens, t_len)
    (q, k, v, g, beta, mask), marks = varlen.clean(q, k, v, g, beta, mask, cu, with_state=True)
    seq, first, _ = varlen.token_boundaries(cu, t_len)
    p = t - cu[seq] + 1  # tokens of its sequence up to and including t
    slot = jnp.where(p % every == 0, varlen.block_offsets(cu, every)[seq] + p // every - 1, -1)
    n, p_row, _ = _packed_rows(cu, every, rows)
    token = (cu[n] + p_row - 1)[None]
  mask = jnp.broadcast_to(mask, q.shape[:3] + mask.shape[-2:])
  h0 = h0.astype(f32)

  def step(carry, xs):
    state, buf = carry
    *token_xs, s, n, is_first = xs
    if cu_seqlens is not None:
      state = jnp.where(is_first, h0[n][None], state)
    _, state = recurrent_step(*token_xs, state, scale)
    row = jnp.maximum(s, 0)
    return (state, buf.at[row].set(jnp.where(s >= 0, state, buf[row]))), None

  time_major = lambda x: jnp.moveaxis(x, 1, 0)
  xs = tuple(time_major(x) for x in (q, k, v, g, beta, mask)) + (slot, seq, first)
  start = h0 if cu_seqlens is None else h0[:1]
  buf = jnp.zeros((rows,) + start.shape, f32)
  (_, buf), _ = jax.lax.scan(step, (start, buf), xs)
  states = _mark(jnp.moveaxis(buf, 0, 1), marks, token)
  if cu_seqlens is not None:  # rows past the last sequence's blocks: zeros
    valid = _packed_rows(cu, every, rows)[2]
    states = jnp.where(valid[None, :, None, None, None], states, 0.0)
  return o, final, states


def _xla(impl, q, k, v, g, beta, mask, h0, scale, chunk, every, cu_seqlens):
  """The chunked form of xla.py, its per-chunk start states h kept."""
  t_len, rows = q.shape[1], q.shape[1] // every
  q, k = (expand_key_heads(x, v.shape[2]) for x in (q, k))
  r = mask.shape[-1]
  if cu_seqlens is None:
    (q, k, v, g, beta, mask), marks = nonfinite.clean(q, k, v, g, beta, mask, with_state=True)
    lay = None
  else:
    lay = varlen.layout(cu_seqlens, t_len, chunk)
    (q, k, v, g, beta, mask), marks = varlen.clean(
      q, k, v, g, beta, mask, lay.cu_seqlens, with_state=True
    )
    q, k, v, g, beta = (varlen.pack(x, lay) for x in (q, k, v, g, beta))
    mask = mask if mask.shape[1] == 1 else varlen.pack(mask, lay)
  gcum, seg = xla.gate_cumsum(xla.to_head_major(g), chunk)
  beta_hm = xla.to_head_major(beta)
  ai = xla.solve_tril(xla.chunk_kkt(k, beta_hm, mask, gcum, chunk, seg), chunk * r)
  w, u = xla.recompute_w_u(k, v, beta_hm, mask, gcum, ai, chunk, seg)
  if lay is None:
    h, v_new, final = xla.chunk_state(k, w, u, gcum, h0, chunk, chunk, seg)
    o = xla.chunk_output(q, k, v_new, h, gcum, scale, chunk, seg)
    states = _plain(h, final, every, chunk, rows, marks)
  else:
    starts = varlen.chunk_initial_states(h0, lay)[:, None]
    h, v_new, ends = xla.chunk_state_varlen(k, w, u, gcum, starts, lay.chunk_first, chunk, seg)
    o = varlen.unpack(xla.chunk_output(q, k, v_new, h, gcum, scale, chunk, seg), lay)
    final = varlen.final_states(jnp.moveaxis(ends[0], 1, 0), h0, lay)
    states = _packed(jnp.moveaxis(h[0], 1, 0), final, lay, every, rows, marks)
  o, final = nonfinite.mark(o, final, marks)
  return o, final, states


def _triton(impl, q, k, v, g, beta, mask, h0, scale, chunk, every, cu_seqlens):
  """The forward kernels of triton.py (chunk_fwd, then chunk_state_output writing the state
  after every `every` tokens from its walk; packed: every chunk's start state, sampled), on
  cleaned inputs; no derivatives."""
  args = (q, k, v, g, beta, mask.astype(f32), h0)
  run = lambda *a: _triton_forward(impl, *a[:7], scale, chunk, every, a[7])
  return raise_if_differentiated(run, NO_DERIVATIVES)(*args, cu_seqlens)


def _triton_forward(impl, q, k, v, g, beta, mask, h0, scale, chunk, every, cu_seqlens):
  t_len, rows = q.shape[1], q.shape[1] // every
  dim_k, dim_v, r = q.shape[-1], v.shape[-1], mask.shape[-1]
  bt = triton.pallas_chunk(chunk, r)
  options = impl.options
  if options is None:
    precision = impl.precision or "tf32"
    options = kernel_options.heuristic_options(
      r=r, dim_k=dim_k, dim_v=dim_v, dtype=q.dtype, precision=precision
    )
  if impl.precision is not None:
    options = options.replace(precision=impl.precision)
  lay, table = None, {}
  if cu_seqlens is None:
    (q, k, v, g, beta, mask), marks = nonfinite.clean(
      q, k, v, g, beta, mask, local=True, with_state=True
    )
  else:
    lay = varlen.layout(cu_seqlens, t_len, bt)
    (q, k, v, g, beta, mask), marks = varlen.clean(
      q, k, v, g, beta, mask, lay.cu_seqlens, with_state=True
    )
    mask = mask if mask.shape[1] == 1 else varlen.pack(mask, lay)
    table = dict(table=varlen.chunk_tokens(lay))
  dkp, vp = triton.padded_dims(dim_k, dim_v, r)
  pad_v = lambda x: jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, vp - dim_v)])
  q, k = (triton.pad_key_blocks(x, r, dkp) for x in (q, k))
  v = pad_v(v)
  h0 = pad_v(triton.pad_key_blocks(h0.swapaxes(-1, -2), r, dkp).swapaxes(-1, -2))
  prec = dict(precision=options.precision, chunk=bt, key_blocks=r)
  head_major = lambda x: jnp.moveaxis(x.astype(f32), 1, 2)
  gcum, w, u = chunk_fwd.chunk_fwd(
    k,
    v,
    head_major(g),
    head_major(beta),
    mask,
    save_ai=False,
    inverse=options.chunk_fwd_inverse,
    launch=options.chunk_fwd,
    **table,
    **prec,
  )
  # plain rows: the walk writes the state after every `every` tokens itself; packed: every
  # chunk's start state (save_states), sampled per sequence
  walk = dict(save_every=every // bt) if lay is None else dict(save_states=True, h_dtype=f32)
  if lay is not None:
    walk.update(table=varlen.sequence_chunks(lay), in_place=True)
  o, final, *saved = chunk_state_output.chunk_state_output(
    q, k, w, u, gcum, h0, scale=scale, launch=options.chunk_state_output, **walk, **prec
  )
  unpad = lambda x: triton.unpad_key_blocks(x[..., :dim_v], r, dim_k // r, axis=-2)
  o, final, h = o[..., :dim_v], unpad(final), unpad(saved[0])
  if lay is None:  # h: [B, H, Tp // every, K, V], row j after (j + 1) every tokens
    h = jnp.moveaxis(h[:, :, :rows], 2, 1)
    token = jnp.broadcast_to((jnp.arange(rows, dtype=i32) + 1) * every - 1, h.shape[:2])
    states = _mark(h, marks, token)
  else:
    states = _packed(jnp.moveaxis(h[0], 1, 0), final, lay, every, rows, marks)
  o, final = nonfinite.mark(o, final, marks)
  return o, final, states


def _mosaic_gpu(impl, q, k, v, g, beta, mask, h0, scale, chunk, every, cu_seqlens):
  """The Hopper forward's walk writing the state after every `every` tokens from its registers
  (mosaic_gpu.py, walk_ws.py); plain rows only (its `unsupported` declines packed ones); no
  derivatives."""
  rows = q.shape[1] // every
  run = lambda *a: impl.block_states(*a, scale, every)
  o, final, h, marks = raise_if_differentiated(run, NO_DERIVATIVES)(q, k, v, g, beta, mask, h0)
  states = jnp.moveaxis(h[:, :, :rows], 2, 1)  # [B, rows, H, K, V], row j after (j + 1) every
  if marks is not None:
    token = jnp.broadcast_to((jnp.arange(rows, dtype=i32) + 1) * every - 1, states.shape[:2])
    states = _mark(states, marks, token)
  return o, final, states


FORMS = {"reference": _reference, "xla": _xla, "triton": _triton, "mosaic_gpu": _mosaic_gpu}


def run(impl, q, k, v, g, beta, mask, initial_state, scale, chunk_size, every, cu_seqlens=None):
  """(o, final, states) of implementation `impl` on the normalised inputs of api.py (T not
  padded); every: a positive multiple of chunk_size (checked by the caller)."""
  form = FORMS.get(impl.name)
  if form is None:
    raise ValueError(
      f"implementation={impl.name!r} does not return block states (state_every); use one of "
      f"{tuple(FORMS)}"
    )
  t_len = q.shape[1]
  args = (q, k, v, g, beta, mask, initial_state)
  multiple = impl.time_multiple(chunk_size, mask.shape[-1])
  t_pad = -(-t_len // multiple) * multiple
  if cu_seqlens is not None or t_pad == t_len:
    return form(impl, *args, scale, chunk_size, every, cu_seqlens)
  # padded with no-op tokens (base.run_padded); the states of whole blocks lie before T
  pad = lambda x: jnp.pad(x, [(0, 0), (0, t_pad - t_len)] + [(0, 0)] * (x.ndim - 2))
  mask = mask if mask.shape[1] == 1 else pad(mask)
  padded = (*map(pad, (q, k, v, g, beta)), mask, initial_state)
  o, final, states = form(impl, *padded, scale, chunk_size, every, None)
  return o[:, :t_len], final, states[:, : t_len // every]
