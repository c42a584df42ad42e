"""The state walks over packed sequences (chunk_state_output, chunk_h and bwd_dhu with a
per-sequence table) and the masked row loads and stores of the kernels that read the packed row
in place (docs/varlen.md#the-pallas-kernels).

The packed row (B = 1) holds N sequences in the chunk-aligned layout: sequence n owns chunks
[chunk_start[n], chunk_start[n] + num_chunks[n]). The walks' grid is (V tile, sequence, head):
program n walks sequence n's chunks from its own initial state (backward: its own final-state
gradient), and also runs the one step of the unused chunk `used + n` (when it exists) from a zero
state, so that later kernels read written padding chunks. The table is int32 [2, N] (chunk_start,
num_chunks) or [4, N] (also token_start, token_end), read whole by every program. In place
(`sequence_span`, `sequence_rows`, `load_rows`, `store_rows`, `ChunkRows`), chunk c of sequence n
is read from the packed row [1, T, ...] with the rows past the sequence's end masked: read as
zeros (identity tokens) and never written.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.common import specs


def batch_zero(spec):
  """`spec` (a BlockSpec of the (V tile, batch, head) grid) for the (V tile, sequence, head) grid
  of the packed walks: the same block of the one row B = 0 in every sequence's program."""
  return pl.BlockSpec(spec.block_shape, lambda iv, n, h: spec.index_map(iv, 0, h))


def with_table(kernel, in_specs, out_specs, args, table, state_spec):
  """A walk's pallas_call arguments for packed sequences: every token array's spec (all but those
  that are `state_spec`) reads the one row (`batch_zero`), and the table is appended as the last
  input, passed to `kernel` as `table_ref`. Returns (kernel, in_specs, out_specs, args)."""
  zero = lambda spec: spec if spec is state_spec else batch_zero(spec)
  n = len(in_specs)

  def packed_kernel(*refs):
    return kernel(*refs[:n], *refs[n + 1 :], table_ref=refs[n])

  in_specs = [*map(zero, in_specs), specs.whole(table.shape)]
  return packed_kernel, in_specs, list(map(zero, out_specs)), (*args, table.astype(jnp.int32))


def walk(table_ref, step, state, num_chunks, *, reverse=False):
  """Program n's walk: state = step(c, state) over sequence n's chunks c (last to first when
  reverse), then the unused chunk used + n, if any, from a zero state. Returns the state after
  sequence n (its initial state when it is empty)."""
  n = pl.program_id(1)
  start, count = table_ref[0, n], table_ref[1, n]
  if reverse:
    end = start + count - 1
    state = jax.lax.fori_loop(0, count, lambda i, s: step(end - i, s), state)
  else:
    state = jax.lax.fori_loop(start, start + count, step, state)
  last = table_ref.shape[1] - 1
  tail = table_ref[0, last] + table_ref[1, last] + n

  @pl.when(tail < num_chunks)
  def _():
    step(tail, jax.tree.map(jnp.zeros_like, state))

  return state


def check_table(table, batch, num_states, what, *, in_place=False):
  """The wrappers' check of a per-sequence table: int32 [2, N] or [4, N] ([4, N] in place), B = 1,
  N states."""
  rows = (4,) if in_place else (2, 4)
  if table.ndim != 2 or table.shape[0] not in rows or table.shape[1] != num_states or batch != 1:
    shapes = " or ".join(str((r, num_states)) for r in rows)
    raise ValueError(
      f"table must be int32 [{' or '.join(map(str, rows))}, N] = {shapes} (N = {what}.shape[0]) "
      f"with B = 1, got {table.shape} with B = {batch}"
    )


def sequence_span(table_ref, n):
  """(first chunk, first token, end token) of sequence n, read from the [4, N] table once, before
  a walk's loop: read inside the loop (which stores o) the reads could not be hoisted, and the
  next chunk's loads, whose addresses depend on them, could not be pipelined. n is the program's
  pl.program_id(1), read outside the loop too (the interpreter cannot read a program id inside a
  loop body)."""
  return table_ref[0, n], table_ref[2, n], table_ref[3, n]


def sequence_rows(span, c, chunk, t_len):
  """(start, valid): where chunk c of the sequence of `span` (`sequence_span`) starts in the
  packed row of t_len tokens, and how many of its `chunk` rows are the sequence's (0 for the
  unused chunk a walk runs after its sequence: its start, past the sequence, is clipped to
  t_len)."""
  first_chunk, first_token, end_token = span
  start = first_token + chunk * (c - first_chunk)
  valid = jnp.clip(end_token - start, 0, chunk)
  return jnp.minimum(start, t_len), valid


def _row_mask(shape, valid):
  return jax.lax.broadcasted_iota(jnp.int32, shape, 0) < valid


def load_rows(ref, start, size, valid, cols=()):
  """ref[start : start + size, *cols] with the rows from `valid` on read as zeros: a masked load
  that never reads past the sequence (nor the ref's end)."""
  view = ref.at[(pl.ds(start, size), *cols)]
  return pltriton.load(view, mask=_row_mask(view.shape, valid), other=0)


def store_rows(ref, start, value, valid, cols=()):
  """ref[start : start + len(value), *cols] = value for the first `valid` rows only: the rows
  after them belong to the next sequence (or lie past the ref's end)."""
  view = ref.at[(pl.ds(start, value.shape[0]), *cols)]
  pltriton.store(view, value.astype(view.dtype), mask=_row_mask(value.shape, valid))


class ChunkRows:
  """A chunk's view of a whole-row ref [T, ...]: `view[rows, ...]` loads rows of the chunk that
  starts at token `start` of the row and holds `valid` tokens (the rest read as zeros), as a
  per-chunk block ref [size, ...] would. `rows` is `...`, `:` (the whole chunk) or a `pl.ds`
  inside the chunk; the other indices are passed on."""

  def __init__(self, ref, start, valid, size):
    self.ref, self.start, self.valid, self.size = ref, start, valid, size
    self.shape = (size, *ref.shape[1:])
    self.dtype = ref.dtype

  def __getitem__(self, idx):
    if idx is Ellipsis:
      idx = ()
    idx = idx if isinstance(idx, tuple) else (idx,)
    rows, cols = (idx[0], idx[1:]) if idx else (slice(None), ())
    if isinstance(rows, slice):
      if rows != slice(None):
        raise ValueError(f"ChunkRows takes `:`, `...` or a pl.ds for the rows, got {rows}")
      first, size = 0, self.size
    else:
      first, size = rows.start, rows.size
    return load_rows(self.ref, self.start + first, size, self.valid - first, cols)
