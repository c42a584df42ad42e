"""The state walks over packed sequences (docs/varlen.md#the-pallas-kernels): chunk_state_output,
chunk_h and bwd_dhu with a per-sequence table.

The packed row (B = 1) holds N sequences in the chunk-aligned layout (`gdp_jax.varlen.layout`):
sequence n owns the chunks [chunk_start[n], chunk_start[n] + num_chunks[n]), and the NT - used
chunks after the last sequence's (used = chunk_start[N - 1] + num_chunks[N - 1]) hold padding
only. The walks' grid is (V tile, sequence n, head): program n walks sequence n's chunks from its
own initial state (or, backward, from its own final-state gradient), so N sequences give N times
the programs of one row, each walking 1 / N of the chunks, as the batch does unpacked.

The unused chunks: later per-chunk kernels read their h, v_new, dh and dv_new, so they must be
written. There are fewer of them than sequences (NT - used <= N (C - 1) / C < N,
`varlen.max_chunks`), so program n also runs the one step of chunk used + n (when it exists) from
a zero state and drops the state it leaves: what a walk over padding from a zero state writes.

The table is int32 [2, N] (rows chunk_start and num_chunks, `varlen.sequence_chunks`), read whole
by every program (the Triton lowering has no scalar prefetch).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

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
    step(tail, tuple(jnp.zeros_like(s) for s in state))

  return state


def check_table(table, batch, num_states, what):
  """The wrappers' check of a per-sequence table: int32 [2, N], B = 1, N states."""
  if table.shape != (2, num_states) or batch != 1:
    raise ValueError(
      f"table must be int32 [2, N] = {(2, num_states)} (N = {what}.shape[0]) with B = 1, got "
      f"{table.shape} with B = {batch}"
    )
