"""The previous design of the grouped-query decode kernels, kept only so that
`benchmarks/bench_decode.py` can time it beside the current one (impls "previous" and
"paged_previous"; docs/performance.md#inference-steps).

The same program walk (`decode_attention.attend`, `paged_decode_attention.attend`) over the grid
(B, Hkv, num_splits), but each program writes its partial (acc, m, l) to arrays in float32 and a
jnp epilogue (`combine_splits`, a second kernel) merges the splits; num_splits about
`PROGRAMS_PER_SM` programs per SM in all (the tuning table's value of 2026-11-29), each split at
least `min_blocks_per_split` blocks long.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.common import backend, device
from pallas_kernels.triton.inference import decode_attention as da
from pallas_kernels.triton.inference import decode_splits
from pallas_kernels.triton.inference import paged_decode_attention as pda

f32 = jnp.float32
PROGRAMS_PER_SM = 16


def num_splits(batch, kv_heads, seq_len, block_s, defaults):
  """The previous split count: about PROGRAMS_PER_SM programs per SM, each split at least
  `min_blocks_per_split` blocks of S long."""
  pairs = max(batch * kv_heads, 1)
  want = pl.cdiv(PROGRAMS_PER_SM * device.sm_count(), pairs)
  most = max(1, seq_len // (defaults.min_blocks_per_split * block_s))
  return int(max(1, min(want, most)))


def _store_partials(o_ref, m_ref, l_ref, acc, m, l, *, rows, dim, rp, dp):
  """Write one split's (acc [R, D], m [R], l [R]), masking the padded rows and columns."""
  zero = pl.program_id(2) * 0
  decode_splits.store_rows(o_ref, acc, zero, rows=rows, dim=dim, rp=rp, dp=dp)
  if rp != rows:
    row_ok = jax.lax.broadcasted_iota(jnp.int32, (rp,), 0) < rows
    pltriton.store(m_ref.at[pl.ds(zero, rp)], m, mask=row_ok)
    pltriton.store(l_ref.at[pl.ds(zero, rp)], l, mask=row_ok)
  else:
    m_ref[...] = m
    l_ref[...] = l


def combine_splits(acc, m, l):
  """Merge per-split partial softmaxes: acc [..., NS, R, D], m and l [..., NS, R] -> [..., R, D]."""
  m_max = jnp.max(m, axis=-2)
  m_safe = jnp.where(m_max == -jnp.inf, 0.0, m_max)
  w = jnp.exp(m - m_safe[..., None, :])
  total = jnp.sum(w * l, axis=-2)
  out = jnp.sum(w[..., None] * acc, axis=-3)
  return out / jnp.where(total > 0, total, 1.0)[..., None]


def _partial_specs(batch, kv_heads, splits, rows, dim):
  specs = [
    pl.BlockSpec((None, None, None, rows, dim), lambda b, h, j: (b, h, j, 0, 0)),
    pl.BlockSpec((None, None, None, rows), lambda b, h, j: (b, h, j, 0)),
    pl.BlockSpec((None, None, None, rows), lambda b, h, j: (b, h, j, 0)),
  ]
  shapes = [
    jax.ShapeDtypeStruct((batch, kv_heads, splits, rows, dim), f32),
    jax.ShapeDtypeStruct((batch, kv_heads, splits, rows), f32),
    jax.ShapeDtypeStruct((batch, kv_heads, splits, rows), f32),
  ]
  return specs, shapes


def _kernel(*refs, attend, n_in, shape, **kw):
  o_ref, m_ref, l_ref = refs[n_in:]
  acc, m, l = attend(*refs[:n_in], shape=shape, **kw)
  part = dict(rows=shape["rows"], dim=shape["dim"], rp=shape["rp"], dp=shape["dp"])
  _store_partials(o_ref, m_ref, l_ref, acc, m, l, **part)


def _launch(query, kv_heads, dim, cache_dtype, positions, defaults, attend, in_specs, inputs, **kw):
  batch = query.shape[0]
  q_rows, tq, group = da.query_rows(query, kv_heads)
  rows = tq * group
  block_s = da.default_block_s(cache_dtype, positions, defaults)
  splits = num_splits(batch, kv_heads, positions, block_s, defaults)
  shape = da.kernel_shape(rows, group, tq, dim)
  kernel = functools.partial(
    _kernel,
    attend=attend,
    n_in=len(inputs) + 1,
    shape=shape,
    block_s=block_s,
    num_splits=splits,
    split_bf16=cache_dtype == jnp.bfloat16,
    **kw,
  )
  q_spec = pl.BlockSpec((None, None, rows, dim), lambda b, h, j: (b, h, 0, 0))
  specs = [*in_specs[:-2], q_spec, *in_specs[-2:]]
  out_specs, out_shape = _partial_specs(batch, kv_heads, splits, rows, dim)
  acc, m, l = backend.pallas_call(
    kernel,
    num_warps=defaults.num_warps,
    num_stages=defaults.num_stages,
    grid=(batch, kv_heads, splits),
    in_specs=specs,
    out_specs=out_specs,
    out_shape=out_shape,
    name="gqa_decode_previous",
  )(*inputs[:-2], q_rows, *inputs[-2:])
  out = combine_splits(acc, m, l)  # [B, Hkv, R, D]
  return da.output_from_rows(out, query.shape, kv_heads, tq, group)


@functools.partial(jax.jit, static_argnames=("scale",))
def gqa_decode(query, key_cache, value_cache, lengths, *, scale):
  """The previous dense decode: as `decode_attention.gqa_decode` with the default launch."""
  _, seq_len, kv_heads, dim = key_cache.shape
  cache_spec = pl.BlockSpec((None, seq_len, None, dim), lambda b, h, j: (b, 0, h, 0))
  in_specs = [pl.BlockSpec((None,), lambda b, h, j: (b,)), cache_spec, cache_spec]
  inputs = [lengths.astype(jnp.int32), key_cache, value_cache]
  return _launch(
    query,
    kv_heads,
    dim,
    key_cache.dtype,
    seq_len,
    da.DEFAULTS,
    da.attend,
    in_specs,
    inputs,
    seq_len=seq_len,
    scale=float(scale),
  )


@functools.partial(jax.jit, static_argnames=("scale",))
def paged_gqa_decode(query, key_pages, value_pages, block_tables, lengths, *, scale):
  """The previous paged decode: as `paged_decode_attention.paged_gqa_decode` with the default
  launch."""
  num_pages, page_size, kv_heads, dim = key_pages.shape
  max_pages = block_tables.shape[1]
  pages_spec = pl.BlockSpec((num_pages, page_size, None, dim), lambda b, h, j: (0, 0, h, 0))
  in_specs = [
    pl.BlockSpec((None,), lambda b, h, j: (b,)),
    pl.BlockSpec((None, max_pages), lambda b, h, j: (b, 0)),
    pages_spec,
    pages_spec,
  ]
  inputs = [lengths.astype(jnp.int32), block_tables.astype(jnp.int32), key_pages, value_pages]
  return _launch(
    query,
    kv_heads,
    dim,
    key_pages.dtype,
    max_pages * page_size,
    pda.DEFAULTS,
    pda.attend,
    in_specs,
    inputs,
    capacity=max_pages * page_size,
    num_pages=num_pages,
    max_pages=max_pages,
    page_size=page_size,
    scale=float(scale),
  )
