"""Packed sequences read in place by the Hopper kernels (docs/mosaic_gpu.md
#packed-sequences-in-place): the packed row keeps its chunks at fixed positions, each sequence
start is a reset, and the walks run one program per piece of the row.

A chunk where a sequence starts is a boundary: the reset inside it makes the state after it
independent of the state before it. The row is cut at some boundaries (about every
`chunks_per_piece` chunks) into pieces; a piece walks its first chunk, a cut, silently from a
zero state (the previous piece walks it as its last chunk and writes it), so the pieces' walks
are independent. Every sequence ends in a boundary chunk or the row's last chunk (or just before
it), and the walks keep the state entering each of those chunks (a slot each); a sequence's final
state is that state carried over the chunk's tokens up to the sequence's end (`final_states`, in
jnp, differentiated by JAX). Everything is traced: new boundaries with the same N and T do not
recompile.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from gdp_jax.ops.gated_delta_product import varlen, xla
from gdp_jax.ops.gated_delta_product.base import RESET_LOG_DECAY
from gdp_jax.ops.heads import expand_key_heads
from pallas_kernels.common.device import device_info
from pallas_kernels.mosaic_gpu import forward as mosaic_forward
from pallas_kernels.mosaic_gpu.common import chunk_tokens

i32 = jnp.int32
FLAG_FORWARD_SILENT = 1  # the forward walks the piece's first chunk silently
FLAG_REVERSE_SILENT = 2  # the reverse walk walks its first step (the last chunk) silently


# Programs per multiprocessor the pieces aim at (benchmarks/bench_varlen.py --programs-per-sm
# sweeps it; docs/mosaic_gpu.md#packed-sequences-in-place).
PROGRAMS_PER_MULTIPROCESSOR = 2.0


def chunks_per_piece(num_chunks: int, programs_per_piece: int, multiprocessors: int) -> int:
  """How long a piece may grow (chunks): as many pieces as fit in PROGRAMS_PER_MULTIPROCESSOR
  programs per multiprocessor (each piece runs `programs_per_piece`, one per head and value
  tile; a few more programs than that would start a round of their own), at least one."""
  wanted = PROGRAMS_PER_MULTIPROCESSOR * multiprocessors / programs_per_piece
  return max(1, -(-num_chunks // max(1, math.floor(wanted))))


# The most bounds the walks take into shared memory beside their ring (32 KB, which their
# two-stage rings leave room for at every supported K and r; `walk_shapes.smem_bytes`): more
# sequences take the chunk-aligned layout.
MAX_SLOTS = 8192


def num_slots(num_seqs: int) -> int:
  """The length of `bounds`: N - 1 boundaries at most, the last chunk, a sentinel; a multiple of
  4 (one 16-byte copy per 4)."""
  return -(-(num_seqs + 1) // 4) * 4


def piece_length(num_chunks: int, programs_per_piece: int) -> int:
  """`chunks_per_piece` on this device's multiprocessors."""
  return chunks_per_piece(num_chunks, programs_per_piece, device_info().sm_count)


def row_pieces(cu, num_chunks: int, chunk: int, programs_per_piece: int):
  """`piece_table` of a row of `num_chunks` whole chunks, the pieces' length `piece_length`."""
  per_piece = piece_length(num_chunks, programs_per_piece)
  return piece_table(cu, num_chunks * chunk, chunk, per_piece)


def piece_table(cu, t_len: int, chunk: int, per_piece: int, row=None):
  """(table [P, 8] int32, bounds [S] int32) for N sequences (cu sanitised) over T tokens in chunks
  of `chunk`, cut at the boundary nearest each multiple of `per_piece` chunks (P = NC //
  per_piece + 1, S = `num_slots(N)`); the rows longest piece first (the walks' programs start in
  row order: the longest first leave the shortest to fill the last round).

  bounds: the boundary chunks and the last chunk, increasing, each once, then a value past every
  chunk; slot j of the walks is the state entering chunk bounds[j].
  table row p: (first chunk, chunk count, flags (FLAG_*), the number of bounds before the first
  chunk, the index of the last bound at or before the last chunk, 0, 0, 0); pieces after the
  last walk nothing (count 0). row: `row_bounds(cu, t_len, chunk)` when already at hand."""
  num = cu.shape[0] - 1
  nc = -(-t_len // chunk)
  past = nc + 1
  boundaries, bounds = row_bounds(cu, t_len, chunk) if row is None else row
  # cuts: the boundary nearest every multiple of per_piece (the later one on a tie)
  want = per_piece * jnp.arange(1, nc // per_piece + 1, dtype=i32)
  at = jnp.searchsorted(boundaries, want, side="left", method="compare_all")
  if num > 1:
    after = jnp.where(at < num - 1, boundaries[jnp.minimum(at, num - 2)], past)
    before = boundaries[jnp.maximum(at - 1, 0)]
    cuts = jnp.where((at > 0) & (want - before < after - want), before, after)
  else:
    cuts = jnp.full_like(want, past)
  cuts = jnp.where(cuts > 0, cuts, past)  # chunk 0 starts piece 0 anyway
  prev_cut = jnp.concatenate([jnp.full((1,), -1, i32), cuts[:-1]])
  cuts = jnp.sort(jnp.where(cuts != prev_cut, cuts, past))  # each once (cuts are increasing)
  num_cuts = jnp.sum(cuts < past)
  p = jnp.arange(cuts.shape[0] + 1, dtype=i32)
  ext = jnp.concatenate([cuts, jnp.full((1,), past, i32)])
  first = jnp.where(p == 0, 0, ext[jnp.maximum(p - 1, 0)])
  last = jnp.where(p < num_cuts, ext[p], nc - 1)
  used = p <= num_cuts
  first = jnp.where(used, first, 0)
  count = jnp.where(used, last - first + 1, 0)
  flags = FLAG_FORWARD_SILENT * (p > 0) + FLAG_REVERSE_SILENT * (p < num_cuts)
  before_first = jnp.searchsorted(bounds, first, side="left", method="compare_all")
  last_bound = jnp.searchsorted(bounds, last, side="right", method="compare_all") - 1
  zero = jnp.zeros_like(p)
  table = jnp.stack([first, count, flags, before_first, last_bound, zero, zero, zero], axis=1)
  table = table[jnp.argsort(-count, stable=True)]
  return table.astype(i32), bounds


def row_bounds(cu, t_len: int, chunk: int):
  """(the boundary chunks, increasing, then values past every chunk [N - 1]; `bounds` [S]):
  what `piece_table` and `split_table` cut at."""
  num = cu.shape[0] - 1
  nc = -(-t_len // chunk)
  past = nc + 1
  starts = cu[1:-1]
  start_chunks = starts // chunk
  previous = jnp.concatenate([jnp.full((1,), -1, i32), start_chunks[:-1]])
  # cu is non-decreasing: the starts in one chunk are adjacent
  new = (starts < t_len) & (start_chunks != previous)
  boundaries = jnp.sort(jnp.where(new, start_chunks, past))  # [N - 1]
  last_chunk = jnp.where(jnp.any(boundaries == nc - 1), past, nc - 1)  # once
  bounds = jnp.sort(jnp.concatenate([boundaries, last_chunk[None]]))  # [N]
  bounds = jnp.full((num_slots(num),), past, i32).at[:num].set(bounds.astype(i32))
  return boundaries.astype(i32), bounds


# A row is cut inside sequences (`split_table`) when the boundary cuts leave a piece longer than
# this many times the balanced length (docs/mosaic_gpu.md#long-sequences-in-pieces).
SPLIT_WHEN_LONGER = 1.5


def split_table(cu, t_len: int, chunk: int, per_piece: int, row=None):
  """(table [P, 8] int32, bounds [S] int32): the row cut every `per_piece` chunks whatever the
  sequences (P = ceil(NC / per_piece)), a long sequence over several pieces
  (docs/mosaic_gpu.md#long-sequences-in-pieces). Rows in piece order: (first chunk, chunk count,
  0 (no silent chunk), the number of bounds before the first chunk, the index of the last bound
  at or before the last chunk, the span, 0, 0); `bounds` as `piece_table`'s (`row` too).

  A piece p > 0 walks from a zero state, and its transition (the map of the state entering it)
  over its span: from its first chunk through the first chunk where a sequence starts (the
  reset there ends the entering state's reach), or its last chunk."""
  nc = -(-t_len // chunk)
  past = nc + 1
  boundaries, bounds = row_bounds(cu, t_len, chunk) if row is None else row
  p = jnp.arange(-(-nc // per_piece), dtype=i32)
  first = p * per_piece
  count = jnp.minimum(per_piece, nc - first)
  ext = jnp.concatenate([boundaries, jnp.full((1,), past, i32)])
  reset = ext[jnp.searchsorted(boundaries, first, side="left", method="compare_all")]
  span = jnp.where(p == 0, 0, jnp.minimum(count, reset - first + 1))
  before_first = jnp.searchsorted(bounds, first, side="left", method="compare_all")
  last_bound = jnp.searchsorted(bounds, first + count - 1, side="right", method="compare_all") - 1
  zero = jnp.zeros_like(p)
  table = jnp.stack([first, count, zero, before_first, last_bound, span, zero, zero], axis=1)
  return table.astype(i32), bounds


def split_initial_states(num_pieces: int, heads: int, key_dim: int, value_dim: int):
  """[P, H, K, V + K] float32: the walks of `split_table`'s pieces start from zero (columns up
  to V) and their transitions from the identity (columns V to V + K; zero for piece 0, which
  needs none)."""
  eye = jnp.broadcast_to(jnp.eye(key_dim, dtype=jnp.float32), (num_pieces, heads, key_dim, key_dim))
  eye = eye.at[0].set(0.0)
  return jnp.concatenate([jnp.zeros((num_pieces, heads, key_dim, value_dim), jnp.float32), eye], -1)


def entering_states(ends, value_dim: int):
  """[P, H, K, V] float32: the state entering each piece of `split_table`, from the state after
  each piece's walk `ends` [P, H, K, V + K] (its walk from zero, then its transition): the
  state after piece p is E_p + A_p S_p (docs/mosaic_gpu.md#long-sequences-in-pieces), a short
  scan over the pieces."""
  walked, transition = ends[..., :value_dim], ends[..., value_dim:]

  def step(state, piece):
    e, a = piece
    after = e + jnp.einsum("hkl,hlv->hkv", a, state, precision=jax.lax.Precision.HIGHEST)
    return after, state

  _, entering = jax.lax.scan(step, jnp.zeros_like(walked[0]), (walked, transition))
  return entering


def split_forward(q, k, v, g, beta, mask, table, bounds, *, scale, per_piece, guard_marks,
                  interpret):  # fmt: skip
  """(o, the slots' states [S, H, K, V]) of a packed row read in place over `split_table`'s
  pieces (mask as `forward.forward` takes it): the walks from zero with their transitions beside
  them, the states entering the pieces by a scan, the outputs and slots corrected
  (docs/mosaic_gpu.md#long-sequences-in-pieces)."""
  heads, value_dim = v.shape[2:]
  h0 = split_initial_states(table.shape[0], heads, k.shape[-1], value_dim)
  o, slots, o_id, ends = mosaic_forward.forward(
    q, k, v, g, beta, mask, scale=scale, initial_state=h0, output_final_state=True,
    seq_table=table, pieces=bounds, guard_marks=guard_marks, transitions=True,
    interpret=interpret,
  )  # fmt: skip
  entering = entering_states(ends, value_dim)
  chunk = chunk_tokens(mask.shape[-1])
  return split_outputs(o, o_id, slots, table, bounds, entering, per_piece, chunk)


def split_outputs(o, o_id, slots, table, bounds, entering, per_piece: int, chunk: int):
  """(o [1, T, H, V], the slots' states [S, H, K, V]) of a row walked in `split_table`'s pieces
  (docs/mosaic_gpu.md#long-sequences-in-pieces): the walks' o from zero plus the transitions'
  outputs o_id [H, T, K] (head-major) times the state entering the piece, over each span (o_id
  is not written past it); a slot inside a span (at most one per piece: the span's last chunk,
  or the row's last) gains its transition's part of `slots` [S, H, K, V + K] applied to that
  state."""
  t_len, heads, value_dim = o.shape[1:]
  tokens = per_piece * chunk
  full = t_len // tokens
  s_lo = entering.astype(o_id.dtype)  # the state as the walk's own products read it
  parts = []  # [H, ., V] (float32 accumulation on a GPU)
  if full:
    x = o_id[:, : full * tokens].reshape(heads, full, tokens, -1)
    y = jnp.einsum("hptk,phkv->hptv", x, s_lo[:full])
    parts.append(y.reshape(heads, full * tokens, value_dim))
  if t_len > full * tokens:
    parts.append(jnp.einsum("htk,hkv->htv", o_id[:, full * tokens :], s_lo[full]))
  correction = jnp.concatenate(parts, axis=1) if len(parts) > 1 else parts[0]
  t = jnp.arange(t_len, dtype=i32)
  piece = t // tokens
  # rows apart: a row past the span (never written) drops out in the select
  inside = (t // chunk - piece * per_piece) < table[piece, 5]
  correction = jnp.swapaxes(correction, 0, 1)[None]  # [1, T, H, V]
  o = o + jnp.where(inside[None, :, None, None], correction, jnp.zeros((), o.dtype))
  walked, transition = slots[..., :value_dim], slots[..., value_dim:]
  j = jnp.minimum(table[:, 3], slots.shape[0] - 1)  # the first bound at or after the first chunk
  inside = (table[:, 3] < slots.shape[0]) & (bounds[j] < table[:, 0] + table[:, 5])
  part = jnp.einsum("phkl,phlv->phkv", transition[j], entering, precision=jax.lax.Precision.HIGHEST)
  return o, walked.at[j].add(jnp.where(inside[:, None, None, None], part, 0.0))


def starts_as_resets(g, cu):
  """g [1, T, H] with each sequence's first token a reset (RESET_LOG_DECAY): the state before it,
  another sequence's, is forgotten (docs/chunked_form.md#resets); a first token's own g does not
  matter from a zero state, and its gradient is 0 through the select."""
  _, first, _ = varlen.token_boundaries(cu, g.shape[1])
  return jnp.where(first[None, :, None], jnp.asarray(RESET_LOG_DECAY, g.dtype), g)


def final_states(slot_states, bounds, k, v, g, beta, mask, cu, chunk: int):
  """[N, H, K, V] float32: each sequence's final state from the walks' slots [S, H, K, V] (the
  state entering chunk bounds[j]).

  Sequence n ends at token e = cu[n + 1] - 1; L = min((e + 1) // chunk, NC - 1) is a bound (a
  boundary, or the last chunk), and its tokens up to e (the others identity tokens) carried over
  from the state entering it give the state after e: a sequence starting inside L forgets that
  state at its reset (g: `starts_as_resets`). k [1, T, Hk, K], v [1, T, H, V], g, beta [1, T, H],
  mask [Bm, Tm, Hm, r, r]; non-finite entries are read as 0 (the operator's guard marks the
  states they spoil)."""
  t_len = k.shape[1]
  nc = -(-t_len // chunk)
  ends = cu[1:]
  last = jnp.minimum(ends // chunk, nc - 1)
  slot = jnp.searchsorted(bounds, last, side="left", method="compare_all")
  tokens = last[:, None] * chunk + jnp.arange(chunk, dtype=i32)  # [N, C]
  inside = tokens < ends[:, None]
  take = lambda x: jnp.take(x[0], jnp.minimum(tokens, t_len - 1), axis=0)
  keep = lambda x: jnp.where(
    inside.reshape(inside.shape + (1,) * (x.ndim - 2)) & jnp.isfinite(x), x, 0
  )
  k_n, v_n, g_n, beta_n = (keep(take(x)) for x in (k, v, g, beta))
  mask_n = mask if mask.shape[1] == 1 else keep(take(mask))
  k_n = expand_key_heads(k_n, v.shape[2])
  q_n = jnp.zeros_like(k_n)  # the outputs are not used
  _, final = xla.chunked_forward(q_n, k_n, v_n, g_n, beta_n, mask_n, slot_states[slot], 1.0, chunk)
  empty = cu[1:] == cu[:-1]
  return jnp.where(empty[:, None, None, None], 0.0, final)
