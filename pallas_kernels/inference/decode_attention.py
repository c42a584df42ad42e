"""Grouped-query decode attention over a KV cache, flash-decoding style (docs/inference.md).

Arrays in, arrays out (no autodiff, no argument checks: `gdp_jax.decode` does those).

    query [B, Hq, D]    key_cache, value_cache [B, S, Hkv, D]    lengths [B] int32
    -> float32 [B, Hq, D]

Grid (B, Hkv, num_splits). Program (b, h, j) takes the G = Hq / Hkv query heads of cache head h
as one [GP, DP] tile (so every cache byte is read once, by one program) and walks its share of
the valid positions of sequence b in blocks of `block_s` rows, keeping an online softmax
(running max m, running sum l, unnormalised output acc). The valid range [0, L) with
L = clamp(lengths[b], 0, S) is cut into `num_splits` equal pieces (rounded up to whole blocks),
so the work follows the real lengths, not S: loop bounds come from L inside the kernel (traced
`fori_loop` bounds), the grid is static, and a new set of lengths never recompiles.
A small jnp epilogue combines the splits' partial softmaxes.

The cache is read in its native [B, S, Hkv, D] layout through BlockSpecs that squeeze b and h:
each program sees an [S, D] view with row stride Hkv * D and loads [block_s, DP] tiles straight
from it (no transpose, no copy). Rows at or beyond the split's end are masked in the load
(`other=0`), so stale slots (even inf or the dtype's max) never reach registers; their scores
are also set to -inf before the softmax.

Numerics: float32 throughout. For a bfloat16 cache the products run on the tensor cores as two
bf16 dots each (the float32 query and the float32 weights are split into a bf16 high part and a
bf16 low part, and the bf16 cache values are exact): about 16 mantissa bits, near float32,
at tensor-core speed (full float32 FMA dots would make this memory-bound kernel compute-bound
at G = 16 rows). Other cache dtypes are converted to float32 and use IEEE float32 dots.

Triton-lowering constraints honoured (docs/pallas_triton.md): every loaded/stored tile has
power-of-two dims >= 16 (G and D are padded with masks), dots are 2-D, no slicing of loaded
values.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.common import backend, options

f32 = jnp.float32

# Launch defaults live in pallas_kernels/common/options.py (DecodeOptions); the benchmark sweeps
# them (benchmarks/bench_decode.py). block_s keeps a [block_s, 128] tile at 16 KB: 64 rows of a
# 2-byte cache, 32 of a 4-byte one (compiled offline for sm_90 with Triton 3.9: bf16 64/4 warps/
# 3 stages uses 128 registers and 78 KB of shared memory, no spills; float32 at 64 rows and 4 warps
# spills, at 32 it does not).
DEFAULTS = options.DecodeOptions()
BLOCK_S_4BYTE = 32


def default_num_splits(batch, kv_heads, seq_len, block_s=DEFAULTS.block_s, sm_count=None):
  """Splits of the cache positions per (sequence, cache head): about `programs_per_sm` programs
  per SM of the device in all, each split at least `min_blocks_per_split` blocks of S long."""
  sm_count = options.device_info().sm_count if sm_count is None else sm_count
  pairs = max(batch * kv_heads, 1)
  want = pl.cdiv(DEFAULTS.programs_per_sm * sm_count, pairs)
  most = max(1, seq_len // (DEFAULTS.min_blocks_per_split * block_s))
  return int(max(1, min(want, most)))


def _kernel(
  len_ref,
  q_ref,
  k_ref,
  v_ref,
  o_ref,
  m_ref,
  l_ref,
  *,
  seq_len,
  group,
  dim,
  gp,
  dp,
  block_s,
  num_splits,
  scale,
  split_bf16,
):
  # Refs: len_ref [] int32; q_ref [G, D]; k_ref, v_ref [S, D] (b and h squeezed: the native
  # layout, row stride Hkv * D); outputs o_ref [G, D], m_ref, l_ref [G] of split j.
  j = pl.program_id(2)
  length = jnp.minimum(jnp.maximum(len_ref[()], 0), seq_len)
  per_split = jax.lax.div(length + (num_splits - 1), jnp.int32(num_splits))  # int32 under x64 too
  per_split = jax.lax.div(per_split + (block_s - 1), jnp.int32(block_s)) * block_s
  start = j * per_split
  end = jnp.minimum(start + per_split, length)
  n_blocks = jax.lax.div(jnp.maximum(end - start, 0) + (block_s - 1), jnp.int32(block_s))

  pad_g = gp != group
  pad_d = dp != dim
  # Padded tiles reach past the end of a ref; their extra rows/columns are masked. The start is
  # a traced zero because Pallas rejects a static slice that overruns the ref.
  zero = j * 0
  g_idx = jax.lax.broadcasted_iota(jnp.int32, (gp, dp), 0)
  d_idx = jax.lax.broadcasted_iota(jnp.int32, (gp, dp), 1)
  if pad_g or pad_d:
    q_mask = (g_idx < group) & (d_idx < dim)
    q = pltriton.load(q_ref.at[pl.ds(zero, gp), pl.ds(zero, dp)], mask=q_mask, other=0)
  else:
    q_mask = None
    q = q_ref[...]
  q = q.astype(f32) * scale
  if split_bf16:
    q_hi = q.astype(jnp.bfloat16)
    q_lo = (q - q_hi.astype(f32)).astype(jnp.bfloat16)

  col_ok = jax.lax.broadcasted_iota(jnp.int32, (block_s, dp), 1) < dim
  row_iota = jax.lax.broadcasted_iota(jnp.int32, (block_s, dp), 0)
  pos_iota = jax.lax.broadcasted_iota(jnp.int32, (gp, block_s), 1)

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
    tile_mask = (pos + row_iota) < end
    if pad_d:
      tile_mask = tile_mask & col_ok
    k = pltriton.load(k_ref.at[pl.ds(pos, block_s), pl.ds(zero, dp)], mask=tile_mask, other=0)
    s = scores(k)  # [GP, BS] float32
    s = jnp.where((pos + pos_iota) < end, s, -jnp.inf)  # stale slots: no weight
    m_new = jnp.maximum(m, jnp.max(s, axis=1))  # finite: >= 1 valid slot
    alpha = jnp.exp(m - m_new)
    p = jnp.exp(s - m_new[:, None])
    l = alpha * l + jnp.sum(p, axis=1)
    v = pltriton.load(v_ref.at[pl.ds(pos, block_s), pl.ds(zero, dp)], mask=tile_mask, other=0)
    acc = alpha[:, None] * acc + weighted(p, v)
    return acc, m_new, l

  init = (jnp.zeros((gp, dp), f32), jnp.full((gp,), -jnp.inf, f32), jnp.zeros((gp,), f32))
  acc, m, l = jax.lax.fori_loop(0, n_blocks, body, init)

  if q_mask is not None:
    pltriton.store(o_ref.at[pl.ds(zero, gp), pl.ds(zero, dp)], acc, mask=q_mask)
  else:
    o_ref[...] = acc
  if pad_g:
    row_ok = jax.lax.broadcasted_iota(jnp.int32, (gp,), 0) < group
    pltriton.store(m_ref.at[pl.ds(zero, gp)], m, mask=row_ok)
    pltriton.store(l_ref.at[pl.ds(zero, gp)], l, mask=row_ok)
  else:
    m_ref[...] = m
    l_ref[...] = l


def combine_splits(acc, m, l):
  """Merge per-split partial softmaxes: acc [..., NS, G, D], m and l [..., NS, G] -> [..., G, D].

  Empty splits (m = -inf, l = 0, acc = 0) get weight 0; rows with no valid slot at all
  (length 0) come out as exact zeros.
  """
  m_max = jnp.max(m, axis=-2)
  m_safe = jnp.where(m_max == -jnp.inf, 0.0, m_max)
  w = jnp.exp(m - m_safe[..., None, :])  # exp(-inf) = 0
  total = jnp.sum(w * l, axis=-2)
  out = jnp.sum(w[..., None] * acc, axis=-3)
  return out / jnp.where(total > 0, total, 1.0)[..., None]


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
  num_warps=DEFAULTS.num_warps,
  num_stages=DEFAULTS.num_stages,
):
  """Flash-decoding GQA step. query [B, Hq, D]; caches [B, S, Hkv, D] (one dtype);
  lengths [B] int32 (clamped to [0, S] in the kernel); scale a Python float.

  Returns float32 [B, Hq, D]. block_s (power of two >= 16), num_splits, num_warps and
  num_stages are tuning knobs; None picks the defaults above.
  """
  batch, q_heads, dim = query.shape
  _, seq_len, kv_heads, _ = key_cache.shape
  group = q_heads // kv_heads
  gp = max(16, pl.next_power_of_2(group))
  dp = max(16, pl.next_power_of_2(dim))
  if block_s is None:
    block_s = DEFAULTS.block_s if key_cache.dtype.itemsize <= 2 else BLOCK_S_4BYTE
    block_s = min(block_s, max(16, pl.next_power_of_2(seq_len)))
  if block_s < 16 or block_s & (block_s - 1):
    raise ValueError(f"block_s must be a power of two >= 16, got {block_s}")
  if num_splits is None:
    num_splits = default_num_splits(batch, kv_heads, seq_len, block_s)
  split_bf16 = key_cache.dtype == jnp.bfloat16

  kernel = functools.partial(
    _kernel,
    seq_len=seq_len,
    group=group,
    dim=dim,
    gp=gp,
    dp=dp,
    block_s=block_s,
    num_splits=num_splits,
    scale=float(scale),
    split_bf16=split_bf16,
  )
  cache_spec = pl.BlockSpec((None, seq_len, None, dim), lambda b, h, j: (b, 0, h, 0))
  acc, m, l = backend.pallas_call(
    kernel,
    num_warps=num_warps,
    num_stages=num_stages,
    grid=(batch, kv_heads, num_splits),
    in_specs=[
      pl.BlockSpec((None,), lambda b, h, j: (b,)),  # lengths
      pl.BlockSpec((None, group, dim), lambda b, h, j: (b, h, 0)),  # query heads of h
      cache_spec,  # keys
      cache_spec,  # values
    ],
    out_specs=[
      pl.BlockSpec((None, None, None, group, dim), lambda b, h, j: (b, h, j, 0, 0)),
      pl.BlockSpec((None, None, None, group), lambda b, h, j: (b, h, j, 0)),
      pl.BlockSpec((None, None, None, group), lambda b, h, j: (b, h, j, 0)),
    ],
    out_shape=[
      jax.ShapeDtypeStruct((batch, kv_heads, num_splits, group, dim), f32),
      jax.ShapeDtypeStruct((batch, kv_heads, num_splits, group), f32),
      jax.ShapeDtypeStruct((batch, kv_heads, num_splits, group), f32),
    ],
    name="gqa_decode",
  )(lengths.astype(jnp.int32), query, key_cache, value_cache)
  out = combine_splits(acc, m, l)  # [B, Hkv, G, D]
  return out.reshape(batch, q_heads, dim)
