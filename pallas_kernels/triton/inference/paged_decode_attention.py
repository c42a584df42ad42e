"""Grouped-query decode attention over a paged KV cache (docs/inference.md#paged-kv-cache).
Arrays in, arrays out (no autodiff, no argument checks: gdp_jax/ops/gqa_decode/api.py does those).

    query [B, Hq, D] or [B, Tq, Hq, D], pages [num_pages, page_size, Hkv, D] (page_size a power
    of two >= 16), block_tables [B, max_pages] int32, lengths [B] int32 -> float32, query's shape

Position p of sequence b lives in page block_tables[b, p // page_size], slot p % page_size
(vLLM's layout). The kernel is decode_attention.py's (`split_attention`; the splits combine in
the launch, decode_splits.py) with another way of finding a block's rows, since the Triton
lowering has no scalar prefetch: each program gathers its block's page ids from its table row
(masked to the valid rows, clamped to [0, num_pages)) and then the key and value rows by
pointer. Rows past the split's end are masked in every load, so stale slots and unused table
entries are never read; a block may span several pages or part of one.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.common import backend, options
from pallas_kernels.triton.inference import decode_attention as dense
from pallas_kernels.triton.inference import decode_splits

DEFAULTS = options.PagedDecodeOptions()


def attend(
  len_ref,
  tab_ref,
  q_ref,
  k_ref,
  v_ref,
  *,
  capacity,
  num_pages,
  max_pages,
  page_size,
  shape,
  **kw,
):
  """Program (b, h, j)'s partial (acc [RP, DP], m [RP], l [RP]) over the pages. Refs: len_ref []
  int32; tab_ref [max_pages] int32 (row b); q_ref [R, D]; k_ref, v_ref [num_pages, page_size, D]
  (head h squeezed)."""
  dim, dp, block_s = shape["dim"], shape["dp"], kw["block_s"]
  length = jnp.minimum(jnp.maximum(len_ref[()], 0), capacity)
  shift = page_size.bit_length() - 1  # page_size is a power of two
  row = jax.lax.broadcasted_iota(jnp.int32, (block_s,), 0)
  cols = jax.lax.broadcasted_iota(jnp.int32, (1, dp), 1)

  def locate(pos, end):
    p = pos + row  # positions of the block's rows
    ok = p < end
    entry = jax.lax.shift_right_logical(p, jnp.int32(shift))
    page = pltriton.load(tab_ref.at[jnp.minimum(entry, max_pages - 1)], mask=ok, other=0)
    page = jnp.minimum(jnp.maximum(page, 0), num_pages - 1)
    slot = p & (page_size - 1)
    mask = ok[:, None] & (cols < dim) if dp != dim else ok[:, None]
    return page[:, None], slot[:, None], jnp.broadcast_to(mask, (block_s, dp))

  def load(which, addr):
    page, slot, mask = addr
    ref = k_ref if which == "k" else v_ref
    col = jnp.minimum(cols, dim - 1) if dp != dim else cols  # in range even where masked
    return pltriton.load(ref.at[page, slot, col], mask=mask, other=0)

  return dense.split_attention(q_ref, length, locate, load, **shape, **kw)


def _kernel(len_ref, tab_ref, q_ref, k_ref, v_ref, *refs, shape, **kw):
  # refs: the outputs (and the counters' input), decode_splits.split_refs.
  o_ref, scratch = decode_splits.split_refs(refs, kw["num_splits"])
  acc, m, l = attend(len_ref, tab_ref, q_ref, k_ref, v_ref, shape=shape, **kw)
  decode_splits.finish(o_ref, scratch, acc, m, l, shape=shape, num_splits=kw["num_splits"])


@functools.partial(
  jax.jit, static_argnames=("scale", "block_s", "num_splits", "num_warps", "num_stages")
)
def paged_gqa_decode(
  query,
  key_pages,
  value_pages,
  block_tables,
  lengths,
  *,
  scale,
  block_s=None,
  num_splits=None,
  num_warps=DEFAULTS.num_warps,
  num_stages=DEFAULTS.num_stages,
):
  """Paged flash-decoding GQA step; shapes in the module docstring; scale a Python float.

  Returns float32 in the query's shape. block_s (cache rows per inner iteration, a power of
  two >= 16), num_splits, num_warps and num_stages are tuning knobs; None picks the defaults
  (PagedDecodeOptions).
  """
  batch = query.shape[0]
  num_pages, page_size, kv_heads, dim = key_pages.shape
  capacity = block_tables.shape[1] * page_size
  if page_size < 16 or page_size & (page_size - 1):
    raise ValueError(f"page_size must be a power of two >= 16, got {page_size}")
  if block_s is None:
    block_s = dense.default_block_s(key_pages.dtype, capacity, DEFAULTS)
  dense.check_block_s(block_s)
  tq, group = (1 if query.ndim == 3 else query.shape[1]), query.shape[-2] // kv_heads
  tokens, block_s, num_stages = dense.fit_launch(
    tq, group, dim, key_pages.dtype.itemsize, block_s, num_stages
  )
  if num_splits is None:
    num_splits = dense.default_num_splits(batch, kv_heads, capacity, block_s, defaults=DEFAULTS)
  launch = functools.partial(
    _launch,
    key_pages=key_pages,
    value_pages=value_pages,
    block_tables=block_tables,
    scale=scale,
    block_s=block_s,
    num_splits=num_splits,
    num_warps=num_warps,
    num_stages=num_stages,
  )
  return dense.by_token_pieces(launch, query, lengths, tokens, capacity)


def _launch(
  query,
  lengths,
  *,
  key_pages,
  value_pages,
  block_tables,
  scale,
  block_s,
  num_splits,
  num_warps,
  num_stages,
):
  batch = query.shape[0]
  num_pages, page_size, kv_heads, dim = key_pages.shape
  max_pages = block_tables.shape[1]
  capacity = max_pages * page_size
  q_rows, tq, group = dense.query_rows(query, kv_heads)
  rows = tq * group

  shape = dense.kernel_shape(rows, group, tq, dim)
  kernel = functools.partial(
    _kernel,
    capacity=capacity,
    num_pages=num_pages,
    max_pages=max_pages,
    page_size=page_size,
    shape=shape,
    block_s=block_s,
    num_splits=num_splits,
    scale=float(scale),
    split_bf16=key_pages.dtype == jnp.bfloat16,
  )
  pages_spec = pl.BlockSpec((num_pages, page_size, None, dim), lambda b, h, j: (0, 0, h, 0))
  in_specs = [
    pl.BlockSpec((None,), lambda b, h, j: (b,)),  # lengths
    pl.BlockSpec((None, max_pages), lambda b, h, j: (b, 0)),  # the table row of sequence b
    pl.BlockSpec((None, None, rows, dim), lambda b, h, j: (b, h, 0, 0)),  # query rows of h
    pages_spec,  # key pages, head h
    pages_spec,  # value pages, head h
  ]
  inputs = [
    lengths.astype(jnp.int32),
    block_tables.astype(jnp.int32),
    q_rows,
    key_pages,
    value_pages,
  ]
  in_specs, inputs, aliases = decode_splits.with_counters(
    in_specs, inputs, batch, kv_heads, num_splits
  )
  out_specs, out_shape = decode_splits.launch_outputs(batch, kv_heads, num_splits, shape)
  out = backend.pallas_call(
    kernel,
    num_warps=num_warps,
    num_stages=num_stages,
    grid=(batch, kv_heads, num_splits),
    in_specs=in_specs,
    out_specs=out_specs,
    out_shape=out_shape,
    input_output_aliases=aliases,
    name="paged_gqa_decode",
  )(*inputs)[0]  # [B, Hkv, R, D]
  return dense.output_from_rows(out, query.shape, kv_heads, tq, group)
