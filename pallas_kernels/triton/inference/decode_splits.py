"""Flash-decoding's splits, shared by the dense and the paged decode kernels
(docs/kernels.md#decode_attention): how many programs share the cache positions of one (sequence,
cache head) pair, and how they combine inside the one launch.

With one split a program normalises its output and writes it. With several, program (b, h, j)
writes its partial (unnormalised output, running max, running sum) to scratch outputs, waits for
its threads (a barrier), then counts itself done on the pair's counter (an atomic add,
acquire-release at GPU scope); the program that counts last reads every split's partial, merges
them and writes the normalised output. The counters start at zero: an input of zeros aliased to
an output. No jnp epilogue, no second kernel.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.common import backend, device

f32 = jnp.float32


def default_num_splits(batch, kv_heads, seq_len, block_s, *, defaults, sm_count=None):
  """Splits per (sequence, cache head) that minimise a model of the launch's time.

  Programs run in waves of `defaults.resident_per_sm` per SM; a wave streams the cache at full
  bandwidth while at least one program per SM is busy (fewer, in a last partial wave, stream
  proportionally slower), and every wave pays `defaults.wave_overhead_blocks` blocks of start-up
  (the pipeline's prologue, the partials' stores). Each split is at least
  `defaults.min_blocks_per_split` blocks long. Ties go to more splits.
  """
  sm_count = device.sm_count() if sm_count is None else sm_count
  pairs = max(batch * kv_heads, 1)
  blocks = max(1, pl.cdiv(seq_len, block_s))
  most = max(1, blocks // defaults.min_blocks_per_split)
  wave = max(1, defaults.resident_per_sm * sm_count)

  def cost(splits):
    full, rest = divmod(pairs * splits, wave)
    paid = full * wave + (max(rest, sm_count) if rest else 0)  # program slots the time pays for
    waves = full + (rest > 0)
    return paid * pl.cdiv(blocks, splits) / wave + waves * defaults.wave_overhead_blocks

  return min(range(1, most + 1), key=lambda splits: (cost(splits), -splits))


def launch_outputs(batch, kv_heads, num_splits, shape):
  """(out_specs, out_shape) of a decode launch over the grid (B, Hkv, num_splits): the result
  [B, Hkv, R, D] in float32, then with several splits the scratch partials (acc, m, l; rows and
  columns padded to powers of two) and the counters (output 4, aliased to `with_counters`')."""
  rows, dim, rp, dp = shape["rows"], shape["dim"], shape["rp"], shape["dp"]
  specs = [pl.BlockSpec((None, None, rows, dim), lambda b, h, j: (b, h, 0, 0))]
  shapes = [jax.ShapeDtypeStruct((batch, kv_heads, rows, dim), f32)]
  if num_splits > 1:
    pair = lambda b, h, j: (b, h, 0, 0)  # every split of the pair: the last one reads them all
    specs += [
      pl.BlockSpec((None, None, num_splits, rp, dp), lambda b, h, j: (b, h, 0, 0, 0)),
      pl.BlockSpec((None, None, num_splits, rp), pair),
      pl.BlockSpec((None, None, num_splits, rp), pair),
      pl.BlockSpec((batch * kv_heads,), lambda b, h, j: (0,)),  # the counters, all of them
    ]
    shapes += [
      jax.ShapeDtypeStruct((batch, kv_heads, num_splits, rp, dp), f32),
      jax.ShapeDtypeStruct((batch, kv_heads, num_splits, rp), f32),
      jax.ShapeDtypeStruct((batch, kv_heads, num_splits, rp), f32),
      jax.ShapeDtypeStruct((batch * kv_heads,), jnp.int32),
    ]
  return specs, shapes


def with_counters(in_specs, inputs, batch, kv_heads, num_splits):
  """in_specs, inputs and input_output_aliases with the zeroed counters appended (several
  splits), or unchanged (one split)."""
  if num_splits == 1:
    return in_specs, inputs, {}
  counters = jnp.zeros((batch * kv_heads,), jnp.int32)
  spec = pl.BlockSpec((batch * kv_heads,), lambda b, h, j: (0,))
  return [*in_specs, spec], [*inputs, counters], {len(inputs): 4}


def split_refs(refs, num_splits):
  """A decode kernel's refs after its cache inputs -> (o_ref, scratch for `finish`): with several
  splits (counters in, out, acc, m, l, counters out), else (out,)."""
  if num_splits == 1:
    return refs[0], ()
  _, o_ref, acc_ref, m_ref, l_ref, count_ref = refs
  return o_ref, (acc_ref, m_ref, l_ref, count_ref)


def store_rows(o_ref, x, zero, *, rows, dim, rp, dp):
  """Write the [RP, DP] tile x into o_ref [R, D], masking the padded rows and columns. zero: a
  traced 0 (Pallas rejects a static slice past the ref's end)."""
  if rp != rows or dp != dim:
    r_idx = jax.lax.broadcasted_iota(jnp.int32, (rp, dp), 0)
    d_idx = jax.lax.broadcasted_iota(jnp.int32, (rp, dp), 1)
    mask = (r_idx < rows) & (d_idx < dim)
    pltriton.store(o_ref.at[pl.ds(zero, rp), pl.ds(zero, dp)], x, mask=mask)
  else:
    o_ref[...] = x


def _normalised(acc, l):
  """acc / l per row; rows with no valid position (l = 0, acc = 0) give exact zeros."""
  return acc / jnp.where(l > 0, l, 1.0)[:, None]


def merge(acc, m, l, acc_s, m_s, l_s):
  """Two partial softmaxes as one. An empty partial (m = -inf, l = 0, acc = 0) weighs 0."""
  m_new = jnp.maximum(m, m_s)
  m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
  alpha, beta = jnp.exp(m - m_safe), jnp.exp(m_s - m_safe)
  return alpha[:, None] * acc + beta[:, None] * acc_s, m_new, alpha * l + beta * l_s


def finish(o_ref, scratch, acc, m, l, *, shape, num_splits):
  """End of program (b, h, j) (module docstring). o_ref [R, D]; scratch: () with one split,
  else (acc_ref [NS, RP, DP], m_ref [NS, RP], l_ref [NS, RP], counters [B * Hkv])."""
  j = pl.program_id(2)  # read here: the interpreter has no program ids inside `pl.when`
  store = lambda x: store_rows(
    o_ref, x, j * 0, rows=shape["rows"], dim=shape["dim"], rp=shape["rp"], dp=shape["dp"]
  )
  if num_splits == 1:
    store(_normalised(acc, l))
    return
  acc_ref, m_ref, l_ref, count_ref = scratch
  acc_ref[j] = acc
  m_ref[j] = m
  l_ref[j] = l
  backend.barrier()  # every thread's stores before the release below
  pair = pl.program_id(0) * pl.num_programs(1) + pl.program_id(1)
  done = pltriton.atomic_add(count_ref, (pair,), jnp.int32(1))

  @pl.when(done == num_splits - 1)
  def _():
    def body(s, carry):
      return merge(*carry, acc_ref[s], m_ref[s], l_ref[s])

    init = (jnp.zeros_like(acc), jnp.full_like(m, -jnp.inf), jnp.zeros_like(l))
    acc_all, _, l_all = jax.lax.fori_loop(0, num_splits, body, init)
    store(_normalised(acc_all, l_all))
