"""Packed variable-length sequences (`cu_seqlens`): the chunk-aligned padded layout
(docs/varlen.md).

N sequences packed back to back in one row of T tokens, sequence n holding tokens
[cu_seqlens[n], cu_seqlens[n + 1]). The chunked forms need chunks that never straddle two
sequences, so `layout` moves every sequence to start at a chunk boundary of a padded row of
C * NT tokens (NT = `max_chunks(T, N, C)`, a static bound), padded with identity tokens (zeros,
`pack`). Only the state crosses a chunk boundary; the per-chunk tables say where a sequence's
initial state replaces it (`chunk_first`, `chunk_seq`) and after which chunk a final state is
read (`chunk_last`, `last_chunk`). Everything is traced: new boundaries with the same N and T do
not recompile.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from gdp_jax.ops.gated_delta_product import nonfinite

i32 = jnp.int32


def max_chunks(t_len: int, num_seqs: int, chunk: int) -> int:
  """A static upper bound on the chunks of N sequences of T tokens in total, each starting at a
  chunk boundary: sum_n ceil(L_n / C) <= sum over the m <= min(N, T) non-empty sequences of
  (L_n + C - 1) / C = (T + m (C - 1)) / C. The bound is attained (e.g. N - 1 sequences of one
  token and one of the remaining T - N + 1 tokens, with T - N + 1 = 1 mod C)."""
  return (t_len + min(num_seqs, t_len) * (chunk - 1)) // chunk


def sanitize(cu_seqlens, t_len: int):
  """cu_seqlens as int32 offsets that are valid whatever they held: non-decreasing (a running
  max), clipped to [0, T], the first 0 and the last T. Valid offsets pass unchanged; the operator
  checks concrete ones and rejects invalid ones, traced ones cannot be checked (an invalid traced
  cu_seqlens gives a result for these repaired offsets, never an out-of-bounds access)."""
  cu = jnp.clip(jax.lax.cummax(jnp.asarray(cu_seqlens).astype(i32), axis=0), 0, t_len)
  return cu.at[0].set(0).at[-1].set(t_len)


def token_sequences(cu_seqlens, t_len: int):
  """[T] int32: the sequence of each token (empty sequences own no token)."""
  t = jnp.arange(t_len, dtype=i32)
  # the number of sequences that end at or before t
  seq = jnp.searchsorted(cu_seqlens[1:], t, side="right", method="compare_all")
  return jnp.minimum(seq, cu_seqlens.shape[0] - 2).astype(i32)


@dataclasses.dataclass(frozen=True)
class Layout:
  """The chunk-aligned padded layout of N packed sequences (module docstring); a pytree with
  `chunk` static. T = len(positions), NT = len(chunk_seq), T_pad = C * NT.

  cu_seqlens: [N + 1] int32, the (sanitised) offsets.
  token_seq: [T] int32, the sequence of each token.
  positions: [T] int32, the padded position of each token (distinct, in [0, T_pad)).
  sources: [T_pad] int32, the token at each padded position, T + p (out of range, distinct) at
    a padding position p: `positions` inverted, so that `pack` is a gather.
  chunk_seq: [NT] int32, the sequence of each chunk (N - 1 for the unused chunks at the end).
  chunk_first: [NT] bool, the chunk is its sequence's first: the state entering it is the
    sequence's initial state, not the previous chunk's.
  chunk_last: [NT] bool, the chunk is its sequence's last: the state leaving it is the
    sequence's final state.
  chunk_valid: [NT] bool, the chunk holds tokens (False for the unused chunks at the end, which
    hold padding only).
  last_chunk: [N] int32, the index of each sequence's last chunk (-1 for an empty sequence).
  empty: [N] bool, the sequence has no token (its final state is its initial state).
  """

  cu_seqlens: jax.Array
  token_seq: jax.Array
  positions: jax.Array
  sources: jax.Array
  chunk_seq: jax.Array
  chunk_first: jax.Array
  chunk_last: jax.Array
  chunk_valid: jax.Array
  last_chunk: jax.Array
  empty: jax.Array
  chunk: int

  @property
  def num_seqs(self) -> int:
    return self.cu_seqlens.shape[0] - 1

  @property
  def t_len(self) -> int:
    return self.positions.shape[0]

  @property
  def num_chunks(self) -> int:
    return self.chunk_seq.shape[0]

  @property
  def t_pad(self) -> int:
    return self.chunk * self.num_chunks


jax.tree_util.register_dataclass(
  Layout,
  data_fields=[
    "cu_seqlens",
    "token_seq",
    "positions",
    "sources",
    "chunk_seq",
    "chunk_first",
    "chunk_last",
    "chunk_valid",
    "last_chunk",
    "empty",
  ],
  meta_fields=["chunk"],
)


def layout(cu_seqlens, t_len: int, chunk: int) -> Layout:
  """The chunk-aligned padded layout of the sequences cu_seqlens [N + 1] (traced or not) over T
  tokens with chunks of C (static) tokens."""
  cu = sanitize(cu_seqlens, t_len)
  num_seqs = cu.shape[0] - 1
  nt = max_chunks(t_len, num_seqs, chunk)
  lengths = cu[1:] - cu[:-1]
  chunks = (lengths + chunk - 1) // chunk  # [N] chunks of each sequence
  chunk_end = jnp.cumsum(chunks)  # one past each sequence's last chunk
  chunk_start = chunk_end - chunks
  token_seq = token_sequences(cu, t_len)
  t = jnp.arange(t_len, dtype=i32)
  positions = chunk * chunk_start[token_seq] + (t - cu[token_seq])
  j = jnp.arange(nt, dtype=i32)
  chunk_seq = jnp.searchsorted(chunk_end, j, side="right", method="compare_all")
  chunk_seq = jnp.minimum(chunk_seq, num_seqs - 1).astype(i32)
  valid = j < chunk_end[-1]
  empty = lengths == 0
  # the inverse of positions, by arithmetic (no scatter): padded position p is token
  # cu[n] + p - C chunk_start[n] of the sequence n of its chunk, when inside that sequence
  p = jnp.arange(chunk * nt, dtype=i32)
  p_seq = chunk_seq[p // chunk]
  offset = p - chunk * chunk_start[p_seq]
  inside = valid[p // chunk] & (offset < lengths[p_seq])
  sources = jnp.where(inside, cu[p_seq] + offset, t_len + p)
  return Layout(
    cu_seqlens=cu,
    token_seq=token_seq,
    positions=positions.astype(i32),
    sources=sources.astype(i32),
    chunk_seq=chunk_seq,
    chunk_first=valid & (j == chunk_start[chunk_seq]),
    chunk_last=valid & (j == chunk_end[chunk_seq] - 1),
    chunk_valid=valid,
    last_chunk=jnp.where(empty, -1, chunk_end - 1).astype(i32),
    empty=empty,
    chunk=chunk,
  )


def pack(x, lay: Layout, *, reverse_only: bool = False):
  """[1, T, ...] -> [1, T_pad, ...]: each token at its padded position, zeros elsewhere; a
  gather (`sources`), which GPUs run faster than a scatter into zeros.

  JAX differentiates it in every mode; its transpose is then a scatter-add. reverse_only=True
  makes it a custom_vjp whose backward is `unpack`'s gather (the Pallas path, which supports
  reverse mode only)."""
  if reverse_only:
    return _move(x, lay.sources, lay.positions)
  return _take(x, lay.sources)


def unpack(y, lay: Layout, *, reverse_only: bool = False):
  """[1, T_pad, ...] -> [1, T, ...]: the tokens back from their padded positions (a gather).
  reverse_only=True: a custom_vjp whose backward is `pack`'s gather instead of JAX's
  scatter-add."""
  if reverse_only:
    return _move(y, lay.positions, lay.sources)
  return _take(y, lay.positions)


def _take(x, index):
  """out[:, p] = x[:, index[p]], zero where index[p] is out of range (indices distinct)."""
  return x.at[:, index].get(mode="fill", fill_value=0, unique_indices=True)


@jax.custom_vjp
def _move(x, index, inverse):
  """_take(x, index) for a one-to-one index with `inverse` its inverse (out of range where no
  position maps to a token): the transpose is _take(d, inverse), a gather again."""
  return _take(x, index)


def _move_fwd(x, index, inverse):
  return _take(x, index), (index, inverse)


def _move_bwd(residuals, d):
  index, inverse = residuals
  return _move(d, inverse, index), None, None


_move.defvjp(_move_fwd, _move_bwd)


def sequence_chunks(lay: Layout):
  """int32 [4, N], the per-sequence table of the Pallas state walks
  (pallas_kernels/common/packed.py): each sequence's first chunk and number of chunks (rows 0
  and 1, all the walks over the chunk-aligned layout read), then its first token and one past its
  last token in the packed row (rows 2 and 3, `cu_seqlens[:-1]` and `cu_seqlens[1:]`: where a walk
  that reads and writes the packed row in place finds its chunks' tokens). The chunks after the
  last sequence's (the unused ones, fewer than N) hold padding only."""
  cu = lay.cu_seqlens
  lengths = cu[1:] - cu[:-1]
  chunks = (lengths + lay.chunk - 1) // lay.chunk
  return jnp.stack([jnp.cumsum(chunks) - chunks, chunks, cu[:-1], cu[1:]]).astype(i32)


def chunk_tokens(lay: Layout):
  """int32 [2, NT], the per-chunk table of the Pallas kernels that read the packed row in place
  (pallas_kernels/triton/forward/chunk_fwd.py): each chunk's first token in the packed row and its
  number of tokens (C but for a sequence's last chunk; 0 for the unused chunks, whose first token is
  then clipped to T: they read nothing). Chunk j of sequence n starts at token
  cu_seqlens[n] + C (j - chunk_start[n])."""
  cu = lay.cu_seqlens
  lengths = cu[1:] - cu[:-1]
  chunks = (lengths + lay.chunk - 1) // lay.chunk
  chunk_start = jnp.cumsum(chunks) - chunks
  seq = lay.chunk_seq
  j = jnp.arange(lay.num_chunks, dtype=i32)
  first = jnp.minimum(cu[seq] + lay.chunk * (j - chunk_start[seq]), lay.t_len)
  count = jnp.where(lay.chunk_valid, jnp.clip(cu[seq + 1] - first, 0, lay.chunk), 0)
  return jnp.stack([first, count]).astype(i32)


def chunk_initial_states(initial_state, lay: Layout):
  """[N, H, K, V] -> [NT, H, K, V]: the initial state of each chunk's sequence (used where
  `chunk_first`)."""
  return jnp.take(initial_state, lay.chunk_seq, axis=0)


def final_states(ends, initial_state, lay: Layout):
  """Each sequence's final state: the state after its last chunk, or its initial state when it
  is empty. ends: [NT, H, K, V], the state after every chunk; initial_state: [N, H, K, V]."""
  last = jnp.take(ends, jnp.maximum(lay.last_chunk, 0), axis=0)
  return jnp.where(lay.empty[:, None, None, None], initial_state.astype(last.dtype), last)


def token_boundaries(cu_seqlens, t_len: int):
  """(token_seq, first, last), each [T]: the sequence of each token and whether it is its
  sequence's first / last token. cu_seqlens must be sanitised."""
  seq = token_sequences(cu_seqlens, t_len)
  t = jnp.arange(t_len, dtype=i32)
  return seq, t == cu_seqlens[seq], t == cu_seqlens[seq + 1] - 1


def clean(q, k, v, g, beta, mask, cu_seqlens, *, with_state=False, local=False, substeps=1):
  """`nonfinite.clean` per sequence: the cleaned inputs and marks in which a bad token spoils
  the outputs of its own sequence only (from that token on) and that sequence's final state.

  q, k: [1, T, Hk, K] (Hk = H or a divisor of H: grouped value heads); v, g, beta: [1, T, H, ...];
  mask [Bm, Tm, Hm, r, r]; cu_seqlens sanitised [N + 1]; local and substeps (k, v and beta with
  T n_h rows: the Householder form) as `nonfinite.clean`'s.
  Returns (cleaned inputs, nonfinite.Marks(o [1, T, H], final [N, H], state [1, T, H] with
  with_state)).
  """
  t_len = g.shape[1]
  bad_state, bad_q = nonfinite.bad_tokens(q, k, v, g, beta, mask, local=local, substeps=substeps)
  t = jnp.arange(t_len, dtype=i32)[None, :, None]
  # the last bad token at or before t; spoiled when it lies in t's own sequence
  last_bad = jax.lax.cummax(jnp.where(bad_state, t, -1), axis=1)
  seq = token_sequences(cu_seqlens, t_len)
  spoiled = last_bad >= cu_seqlens[seq][None, :, None]
  end = jnp.maximum(cu_seqlens[1:] - 1, 0)
  final = jnp.where((cu_seqlens[1:] > cu_seqlens[:-1])[:, None], spoiled[0, end], False)
  cleaned = nonfinite.cleaned(q, k, v, g, beta, mask)
  return cleaned, nonfinite.Marks(spoiled | bad_q, final, spoiled if with_state else None)


def block_offsets(cu_seqlens, every: int):
  """int32 [N + 1]: where each packed sequence's block states start in the rows of
  `gated_delta_product(..., state_every=every, cu_seqlens=cu_seqlens)`'s states
  (docs/operator.md#block-boundary-states): the running sum of each sequence's whole blocks,
  L_n // every, from 0. cu_seqlens [N + 1] may be traced."""
  cu = jnp.asarray(cu_seqlens).astype(i32)
  blocks = (cu[1:] - cu[:-1]) // every
  return jnp.concatenate([jnp.zeros((1,), i32), jnp.cumsum(blocks).astype(i32)])
