"""Grouped-query decode attention over a KV cache, flash-decoding style in one launch
(docs/inference.md; docs/kernels.md#decode_attention). Arrays in, arrays out
(gdp_jax/ops/gqa_decode/api.py checks).

    query [B, Hq, D] or [B, Tq, Hq, D], caches [B, S, Hkv, D], lengths [B] -> float32, query's shape

Grid (B, Hkv, num_splits): program (b, h, j) takes the Tq * G query rows of cache head h as one
tile (every cache byte read once) and walks its share of the valid positions [0, L) in blocks of
`block_s` rows with an online softmax (`split_attention`, shared with the paged kernel); loop
bounds come from the traced length, so new lengths never recompile. The splits combine inside
the launch (decode_splits.py). New token t of Tq sees the slots j <= L - Tq + t; rows past the
end are masked in the load. A bfloat16 cache's products run as two bf16 dots each (high and low
parts of the float32 operand); other dtypes use float32 dots (docs/precision.md).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.common import backend, device, options
from pallas_kernels.triton.inference import decode_splits

f32 = jnp.float32

# Launch defaults: options.DecodeOptions, from the tuning table (pallas_kernels/triton/tuning/).
# block_s keeps a [block_s, 128] tile at 16 KB: 64 rows of a 2-byte cache, 32 of a 4-byte one
# (compiled offline for sm_90 with Triton 3.9: bf16 64/4 warps/3 stages uses 128 registers and
# 78 KB of shared memory, no spills; float32 at 64 rows and 4 warps spills, at 32 it does not).
DEFAULTS = options.DecodeOptions()
BLOCK_S_4BYTE = 32


def default_num_splits(
  batch, kv_heads, seq_len, block_s=DEFAULTS.block_s, sm_count=None, defaults=DEFAULTS
):
  """Splits of the cache positions per (sequence, cache head): decode_splits.default_num_splits
  with the launch's defaults."""
  return decode_splits.default_num_splits(
    batch, kv_heads, seq_len, block_s, defaults=defaults, sm_count=sm_count
  )


def default_block_s(dtype, capacity, defaults=DEFAULTS):
  """Rows per inner iteration: the tuned default for 2-byte caches, BLOCK_S_4BYTE for 4-byte
  ones, never more than the capacity rounded up to a power of two (>= 16)."""
  block_s = defaults.block_s if jnp.dtype(dtype).itemsize <= 2 else BLOCK_S_4BYTE
  return min(block_s, max(16, pl.next_power_of_2(capacity)))


def check_block_s(block_s):
  if block_s < 16 or block_s & (block_s - 1):
    raise ValueError(f"block_s must be a power of two >= 16, got {block_s}")


def split_attention(
  q_ref,
  length,
  locate,
  load,
  *,
  rows,
  group,
  tq,
  dim,
  rp,
  dp,
  block_s,
  num_splits,
  scale,
  split_bf16,
):
  """Program j's share of the online softmax over positions [0, length) (length clamped to the
  capacity already). Returns (acc [RP, DP], m [RP], l [RP]) in float32.

  q_ref: [R, D] query rows (row r = t * group + g: token t, query head g of the group).
  locate(pos, end) -> addr: what the loads of the block of rows [pos, pos + block_s) need
  (rows >= end are stale: masked); load(which, addr) -> [block_s, DP] tile of "k" or "v", zero
  in masked rows and padded columns.
  """
  j = pl.program_id(2)
  per_split = jax.lax.div(length + (num_splits - 1), jnp.int32(num_splits))  # int32 under x64
  per_split = jax.lax.div(per_split + (block_s - 1), jnp.int32(block_s)) * block_s
  start = j * per_split
  end = jnp.minimum(start + per_split, length)
  n_blocks = jax.lax.div(jnp.maximum(end - start, 0) + (block_s - 1), jnp.int32(block_s))

  # Padded tiles reach past the end of a ref; their extra rows/columns are masked. The start is
  # a traced zero because Pallas rejects a static slice that overruns the ref.
  zero = j * 0
  if rp != rows or dp != dim:
    r_idx = jax.lax.broadcasted_iota(jnp.int32, (rp, dp), 0)
    d_idx = jax.lax.broadcasted_iota(jnp.int32, (rp, dp), 1)
    q_mask = (r_idx < rows) & (d_idx < dim)
    q = pltriton.load(q_ref.at[pl.ds(zero, rp), pl.ds(zero, dp)], mask=q_mask, other=0)
  else:
    q = q_ref[...]
  q = q.astype(f32) * scale
  if split_bf16:
    q_hi = q.astype(jnp.bfloat16)
    q_lo = (q - q_hi.astype(f32)).astype(jnp.bfloat16)

  pos_iota = jax.lax.broadcasted_iota(jnp.int32, (rp, block_s), 1)
  if tq > 1:
    # Causal limit of each query row: token t = r // group sees positions < length - tq + 1 + t.
    token = jax.lax.div(jax.lax.broadcasted_iota(jnp.int32, (rp, block_s), 0), jnp.int32(group))
    row_limit = jnp.minimum(length - (tq - 1) + token, end)

  def scores(k):
    if split_bf16:
      return backend.dot(q_hi, k, trans_b=True, precision="tf32") + backend.dot(
        q_lo, k, trans_b=True, precision="tf32"
      )
    return backend.dot(q, k.astype(f32), trans_b=True, precision="ieee")

  def weighted(p, v):
    if split_bf16:
      p_hi = p.astype(jnp.bfloat16)
      p_lo = (p - p_hi.astype(f32)).astype(jnp.bfloat16)
      return backend.dot(p_hi, v, precision="tf32") + backend.dot(p_lo, v, precision="tf32")
    return backend.dot(p, v.astype(f32), precision="ieee")

  def body(i, carry):
    acc, m, l = carry
    pos = start + i * block_s
    addr = locate(pos, end)
    s = scores(load("k", addr))  # [RP, BS] float32
    if tq > 1:
      s = jnp.where((pos + pos_iota) < row_limit, s, -jnp.inf)  # stale or in a row's future
      m_new = jnp.maximum(m, jnp.max(s, axis=1))  # -inf for a row with nothing valid yet
      m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
      alpha = jnp.exp(m - m_safe)
      p = jnp.exp(s - m_safe[:, None])
    else:
      s = jnp.where((pos + pos_iota) < end, s, -jnp.inf)  # stale slots: no weight
      m_new = jnp.maximum(m, jnp.max(s, axis=1))  # finite: >= 1 valid slot
      alpha = jnp.exp(m - m_new)
      p = jnp.exp(s - m_new[:, None])
    l = alpha * l + jnp.sum(p, axis=1)
    acc = alpha[:, None] * acc + weighted(p, load("v", addr))
    return acc, m_new, l

  init = (jnp.zeros((rp, dp), f32), jnp.full((rp,), -jnp.inf, f32), jnp.zeros((rp,), f32))
  return jax.lax.fori_loop(0, n_blocks, body, init)


def attend(len_ref, q_ref, k_ref, v_ref, *, seq_len, shape, **kw):
  """Program (b, h, j)'s partial (acc [RP, DP], m [RP], l [RP]) over the dense cache.
  Refs: len_ref [] int32; q_ref [R, D]; k_ref, v_ref [S, D] (b and h squeezed: the native
  layout, row stride Hkv * D)."""
  dim, dp, block_s = shape["dim"], shape["dp"], kw["block_s"]
  length = jnp.minimum(jnp.maximum(len_ref[()], 0), seq_len)
  zero = pl.program_id(2) * 0
  col_ok = jax.lax.broadcasted_iota(jnp.int32, (block_s, dp), 1) < dim
  row_iota = jax.lax.broadcasted_iota(jnp.int32, (block_s, dp), 0)

  def locate(pos, end):
    tile_mask = (pos + row_iota) < end
    return pos, (tile_mask & col_ok) if dp != dim else tile_mask

  def load(which, addr):
    pos, tile_mask = addr
    ref = k_ref if which == "k" else v_ref
    return pltriton.load(ref.at[pl.ds(pos, block_s), pl.ds(zero, dp)], mask=tile_mask, other=0)

  return split_attention(q_ref, length, locate, load, **shape, **kw)


def _kernel(len_ref, q_ref, k_ref, v_ref, *refs, seq_len, shape, **kw):
  # refs: the outputs (and the counters' input), decode_splits.split_refs.
  o_ref, scratch = decode_splits.split_refs(refs, kw["num_splits"])
  acc, m, l = attend(len_ref, q_ref, k_ref, v_ref, seq_len=seq_len, shape=shape, **kw)
  decode_splits.finish(o_ref, scratch, acc, m, l, shape=shape, num_splits=kw["num_splits"])


def query_rows(query, kv_heads):
  """query [B, Hq, D] or [B, Tq, Hq, D] -> ([B, Hkv, Tq * G, D], Tq, G): the rows of each cache
  head, token-major (row t * G + g). A reshape only when Tq = 1."""
  q4 = query[:, None] if query.ndim == 3 else query
  batch, tq, q_heads, dim = q4.shape
  group = q_heads // kv_heads
  rows = q4.reshape(batch, tq, kv_heads, group, dim).transpose(0, 2, 1, 3, 4)
  return rows.reshape(batch, kv_heads, tq * group, dim), tq, group


def output_from_rows(out, query_shape, kv_heads, tq, group):
  """[B, Hkv, Tq * G, D] -> the query's shape (inverse of `query_rows`)."""
  batch, dim = out.shape[0], out.shape[-1]
  out = out.reshape(batch, kv_heads, tq, group, dim).transpose(0, 2, 1, 3, 4)
  return out.reshape(query_shape)


def kernel_shape(rows, group, tq, dim):
  """Static shape arguments of `split_attention`: rows and D padded to powers of two >= 16."""
  return dict(
    rows=rows,
    group=group,
    tq=tq,
    dim=dim,
    rp=max(16, pl.next_power_of_2(rows)),
    dp=max(16, pl.next_power_of_2(dim)),
  )


def shared_memory_bytes(rp, dp, block_s, num_stages, itemsize):
  """Shared memory of one program (what the Triton lowering allocates on sm_90): the pipelined
  key and value tiles (num_stages - 1 buffers each), the float32 query tile as a dot operand
  (or its two bf16 halves), the probabilities' tile and a few barriers."""
  return 2 * (num_stages - 1) * block_s * dp * itemsize + rp * dp * 4 + rp * block_s * 4 + 512


def fit_launch(tq, group, dim, itemsize, block_s, num_stages, limit=None):
  """(query tokens per launch, block_s, num_stages) whose programs fit `limit` bytes of shared
  memory (default: the device's; docs/inference.md#several-new-tokens-per-step): many new tokens
  (a chunked prefill from a cache) run as several launches over pieces of the tokens; a tile
  too large even for one token takes fewer stages, then fewer rows per block."""
  limit = device.shared_memory_per_block() if limit is None else limit
  dp = max(16, pl.next_power_of_2(dim))
  rp = lambda tokens: max(16, pl.next_power_of_2(tokens * group))
  fits = lambda tokens: shared_memory_bytes(rp(tokens), dp, block_s, num_stages, itemsize) <= limit
  while not fits(1) and (num_stages > 2 or block_s > 16):
    num_stages, block_s = (
      (num_stages - 1, block_s) if num_stages > 2 else (num_stages, block_s // 2)
    )
  tokens = tq
  while tokens > 1 and not fits(tokens):
    tokens = (tokens + 1) // 2
  return tokens, block_s, num_stages


def by_token_pieces(decode, query, lengths, tokens, capacity):
  """decode(query piece, lengths) over pieces of at most `tokens` of the query's Tq new tokens:
  piece [t0, t1) sees what its tokens see in the whole call (slots < L - Tq + 1 + t, L clamped
  to [0, capacity]), which is the whole call's rule with lengths L - (Tq - t1) and Tq = t1 - t0."""
  if query.ndim == 3 or query.shape[1] <= tokens:
    return decode(query, lengths)
  tq = query.shape[1]
  lengths = jnp.clip(lengths, 0, capacity)
  outs = [
    decode(query[:, t0 : min(t0 + tokens, tq)], lengths - (tq - min(t0 + tokens, tq)))
    for t0 in range(0, tq, tokens)
  ]
  return jnp.concatenate(outs, axis=1)


@functools.partial(
  jax.jit, static_argnames=("scale", "block_s", "num_splits", "num_warps", "num_stages")
)
def gqa_decode(
  query,
  key_cache,
  value_cache,
  lengths,
  *,
  scale,
  block_s=None,
  num_splits=None,
  num_warps=None,
  num_stages=DEFAULTS.num_stages,
):
  """Flash-decoding GQA step. query [B, Hq, D] or [B, Tq, Hq, D]; caches [B, S, Hkv, D] (one
  dtype); lengths [B] int32 (clamped to [0, S] in the kernel); scale a Python float.

  Returns float32 in the query's shape. block_s (power of two >= 16), num_splits, num_warps and
  num_stages are tuning knobs; None picks the defaults above (num_warps: more warps when the
  sequence is split over several programs, `DecodeOptions.split_num_warps`).
  """
  batch = query.shape[0]
  _, seq_len, kv_heads, dim = key_cache.shape
  if block_s is None:
    block_s = default_block_s(key_cache.dtype, seq_len)
  check_block_s(block_s)
  tq, group = (1 if query.ndim == 3 else query.shape[1]), query.shape[-2] // kv_heads
  tokens, block_s, num_stages = fit_launch(
    tq, group, dim, key_cache.dtype.itemsize, block_s, num_stages
  )
  if num_splits is None:
    num_splits = default_num_splits(batch, kv_heads, seq_len, block_s)
  if num_warps is None:
    num_warps = DEFAULTS.num_warps if num_splits == 1 else DEFAULTS.split_num_warps
  launch = functools.partial(
    _launch,
    key_cache=key_cache,
    value_cache=value_cache,
    scale=scale,
    block_s=block_s,
    num_splits=num_splits,
    num_warps=num_warps,
    num_stages=num_stages,
  )
  return by_token_pieces(launch, query, lengths, tokens, seq_len)


def _launch(
  query, lengths, *, key_cache, value_cache, scale, block_s, num_splits, num_warps, num_stages
):
  batch = query.shape[0]
  _, seq_len, kv_heads, dim = key_cache.shape
  q_rows, tq, group = query_rows(query, kv_heads)
  rows = tq * group

  shape = kernel_shape(rows, group, tq, dim)
  kernel = functools.partial(
    _kernel,
    seq_len=seq_len,
    shape=shape,
    block_s=block_s,
    num_splits=num_splits,
    scale=float(scale),
    split_bf16=key_cache.dtype == jnp.bfloat16,
  )
  cache_spec = pl.BlockSpec((None, seq_len, None, dim), lambda b, h, j: (b, 0, h, 0))
  in_specs = [
    pl.BlockSpec((None,), lambda b, h, j: (b,)),  # lengths
    pl.BlockSpec((None, None, rows, dim), lambda b, h, j: (b, h, 0, 0)),  # query rows of h
    cache_spec,  # keys
    cache_spec,  # values
  ]
  inputs = [lengths.astype(jnp.int32), q_rows, key_cache, value_cache]
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
    name="gqa_decode",
  )(*inputs)[0]  # [B, Hkv, R, D]
  return output_from_rows(out, query.shape, kv_heads, tq, group)
