"""Packed sequences read in place by the Hopper kernels (docs/mosaic_gpu.md
#packed-sequences-in-place): the packed row keeps its chunks at fixed positions, each sequence
start is a reset, and the walks run one program per piece of the row.

A piece starts at a chunk where a sequence starts (a boundary, walked silently from a zero
state: the reset inside it makes the state after it exact) and runs to the next boundary, which
it walks as its own last chunk; what a walk keeps of a piece is the state entering that last
chunk. Every sequence ends in the last chunk of some piece (or just before it), so its final
state is that piece's state carried over the chunk's tokens up to the sequence's end
(`final_states`, in jnp, differentiated by JAX). Everything is traced: new boundaries with the
same N and T do not recompile.
"""

from __future__ import annotations

import jax.numpy as jnp

from gdp_jax.ops.gated_delta_product import varlen, xla
from gdp_jax.ops.gated_delta_product.base import RESET_LOG_DECAY
from gdp_jax.ops.heads import expand_key_heads

i32 = jnp.int32


def _boundaries(cu, t_len: int, chunk: int):
  """([N] int32, m): the chunks where sequences 1..N-1 start (each once, increasing, a value
  past every chunk after the m of them)."""
  starts = cu[1:-1]
  chunks = starts // chunk
  previous = jnp.concatenate([jnp.full((1,), -1, i32), chunks[:-1]])
  new = (starts < t_len) & (chunks != previous)  # cu is non-decreasing: equal chunks are adjacent
  past = -(-t_len // chunk) + 1
  bounds = jnp.sort(jnp.where(new, chunks, past))
  return jnp.concatenate([bounds, jnp.full((1,), past, i32)]).astype(i32), jnp.sum(new)


def piece_table(cu, t_len: int, chunk: int):
  """int32 [N, 4], the walks' table for N sequences (cu sanitised) over T tokens in chunks of
  `chunk`: row p is (first chunk, chunk count, the forward walks the first chunk silently, the
  reverse walk walks its first step, the last chunk, silently). With boundaries b_0 < ... <
  b_{m-1}: piece 0 is chunks [0, b_0], piece p [b_{p-1}, b_p], piece m [b_{m-1}, NC - 1], and the
  pieces after m walk nothing."""
  num = cu.shape[0] - 1
  nc = -(-t_len // chunk)
  bounds, m = _boundaries(cu, t_len, chunk)
  p = jnp.arange(num, dtype=i32)
  first = jnp.where(p == 0, 0, bounds[jnp.maximum(p - 1, 0)])
  last = jnp.where(p < m, bounds[jnp.minimum(p, num - 1)], nc - 1)
  used = p <= m
  first = jnp.where(used, first, 0)
  count = jnp.where(used, last - first + 1, 0)
  return jnp.stack([first, count, p > 0, p < m], axis=1).astype(i32)


def starts_as_resets(g, cu):
  """g [1, T, H] with each sequence's first token a reset (RESET_LOG_DECAY): the state before it,
  another sequence's, is forgotten (docs/chunked_form.md#resets); a first token's own g does not
  matter from a zero state, and its gradient is 0 through the select."""
  _, first, _ = varlen.token_boundaries(cu, g.shape[1])
  return jnp.where(first[None, :, None], jnp.asarray(RESET_LOG_DECAY, g.dtype), g)


def final_states(piece_states, k, v, g, beta, mask, cu, chunk: int):
  """[N, H, K, V] float32: each sequence's final state from the pieces' states [N, H, K, V]
  (the state entering each piece's last chunk).

  Sequence n ends at token e = cu[n + 1] - 1; L = min((e + 1) // chunk, NC - 1) is the last chunk
  of the piece whose index is the number of boundaries before L, and its tokens up to e (the
  others identity tokens) carried over from that piece's state give the state after e: a
  sequence starting inside L forgets the piece's state at its reset (g: `starts_as_resets`).
  k [1, T, Hk, K], v [1, T, H, V], g, beta [1, T, H], mask [Bm, Tm, Hm, r, r]."""
  t_len = k.shape[1]
  nc = -(-t_len // chunk)
  bounds, _ = _boundaries(cu, t_len, chunk)
  ends = cu[1:]
  last = jnp.minimum(ends // chunk, nc - 1)
  piece = jnp.searchsorted(bounds, last, side="left", method="compare_all")
  tokens = last[:, None] * chunk + jnp.arange(chunk, dtype=i32)  # [N, C]
  inside = tokens < ends[:, None]
  take = lambda x: jnp.take(x[0], jnp.minimum(tokens, t_len - 1), axis=0)
  # the tokens up to e, non-finite entries zeroed (the operator's guard marks those states)
  keep = lambda x: jnp.where(
    inside.reshape(inside.shape + (1,) * (x.ndim - 2)) & jnp.isfinite(x), x, 0
  )
  k_n, v_n, g_n, beta_n = (keep(take(x)) for x in (k, v, g, beta))
  mask_n = mask if mask.shape[1] == 1 else keep(take(mask))
  k_n = expand_key_heads(k_n, v.shape[2])
  q_n = jnp.zeros_like(k_n)  # the outputs are not used
  _, final = xla.chunked_forward(
    q_n, k_n, v_n, g_n, beta_n, mask_n, piece_states[piece], 1.0, chunk
  )
  empty = cu[1:] == cu[:-1]
  return jnp.where(empty[:, None, None, None], 0.0, final)
