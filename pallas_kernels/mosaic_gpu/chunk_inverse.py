"""The chunk-parallel kernel of the forward: the gate-free inverse T0 = (I + A0)^-1 per chunk
(docs/mosaic_gpu.md#the-chunk-inverse has the math).

Per chunk of `C` tokens (`N = C r = 64` block-major rows `(a, t)`, `common.py`),
`A0[(a,t),(d,s)] = beta_t M_t[a,d] <k_t^(d), k_s^(d)>` for t > s from one Gram product over all
key blocks, and T0 by merging token groups of 2, 4, ..., C on the tensor cores; compiled, the
groups of 16 rows are solved in float32 first (`diag_solve.py`). The gates enter in the walk
(docs/chunked_form.md#one-inverse-for-w-and-u). k of rank 5 holds the Householder form's
sub-steps, whose merges start from each token's block inverse
(docs/mosaic_gpu.md#the-householder-form). Each program walks several chunks, the next chunk's
loads and the last chunk's store in flight.
"""

from __future__ import annotations

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from pallas_kernels.common import device
from pallas_kernels.mosaic_gpu import diag_solve as diag_solve_mod
from pallas_kernels.mosaic_gpu.common import (
  F32,
  ROWS,
  ROWS_PER_CHUNK,
  WGMMA,
  bcast_rows,
  block_of,
  check_smem,
  chunk_tokens,
  clean_tile,
  compiler_params,
  iota,
  mask_matrix,
  matmul,
  matmul_reg,
  own_block,
  smem,
  token_of,
)

N = ROWS_PER_CHUNK


def _product(a: jax.Array, b: jax.Array, bufs, dtype) -> jax.Array:
  """`a @ b` for float32 `[N, N]` register tiles on the tensor cores, operands rounded to `dtype`:
  `b` staged in `bufs[0]`, `a` a register operand (staged in `bufs[1]` in the interpreter)."""
  bufs[0][...] = b.astype(dtype)
  plgpu.commit_smem()
  return matmul_reg(a.astype(dtype), bufs[0], (N, N), stage=bufs[1] if len(bufs) > 1 else None)


def earlier_rows(r: int, householder: bool = False) -> jax.Array:
  """Where A0 may be nonzero, `[N, N]` bool: row `(a, t)`, column `(d, s)` with `t > s` (and in
  the Householder form also `s = t, d < a`: a token's earlier sub-steps)."""
  c = chunk_tokens(r)
  sq = (N, N)
  tok_r, tok_c = token_of(iota(sq, 0), c), token_of(iota(sq, 1), c)
  earlier = tok_r > tok_c
  if householder:
    earlier = earlier | ((tok_r == tok_c) & (block_of(iota(sq, 0), c) > block_of(iota(sq, 1), c)))
  return earlier


def invert(a0: jax.Array, r: int, bufs, dtype, solve_s=None, householder: bool = False):
  """`T0 = (I + A0)^-1` as float32 WGMMA-layout registers `[N, N]` from A0 (float32 registers,
  zero outside `earlier_rows`), by the merges of the module docstring.

  bufs: shared-memory `[N, N]` tiles of `dtype` for the merges' products (`_product`: one on a
    GPU, two in the interpreter); free again on return.
  solve_s: None, or `diag_solve.scratch()`: the 16-row groups solved exactly in float32 first
    (compiled only), the merges from there.
  """
  c = chunk_tokens(r)
  sq = (N, N)
  tok_r, tok_c = token_of(iota(sq, 0), c), token_of(iota(sq, 1), c)
  eye = (iota(sq, 0) == iota(sq, 1)).astype(F32)
  if solve_s is not None:  # groups of 16 rows exactly in float32, then merges
    x = diag_solve_mod.diag_block_inverse(a0, solve_s, r, within_token=householder)
    size = 2 * diag_solve_mod.BLOCK_ROWS // r
  elif householder:  # each token's own block: (I + L)^-1 = (I - L)(I + L^2)(I + L^4)...
    low = jnp.where(tok_r == tok_c, a0, 0.0)
    x = eye - low
    power = 2
    while power < r:
      low = _product(low, low, bufs, dtype)
      x = _product(x, eye + low, bufs, dtype)
      power *= 2
    size = 2
  else:  # token groups of 2: X = I - L exactly (X = I before)
    x = None
    size = 2
  while size <= c:
    half = size // 2
    off = (
      (lax.div(tok_r, size) == lax.div(tok_c, size))
      & (lax.rem(tok_r, size) >= half)
      & (lax.rem(tok_c, size) < half)
    )
    link = jnp.where(off, a0, 0.0)
    if x is None:
      x = eye - link
    else:
      lx = _product(link, x, bufs, dtype)
      x = x - _product(x, lx, bufs, dtype)
    size *= 2
  return eye if x is None else x  # (None: one token per chunk, not reached: C >= 8)


def default_chunks_per_program(batch: int, heads: int, chunks: int) -> int:
  """The most chunks per program (8, 4 or 2, dividing the chunk count) that still leave about
  1.5 programs per streaming multiprocessor (two fit on one), else 1.

  A program walks its chunks with the next chunk's loads in flight and its stores left in flight,
  so more chunks per program hide more of the memory latency, as long as every SM has work.
  """
  for cpp in (8, 4, 2):
    if chunks % cpp == 0 and batch * heads * (chunks // cpp) * 2 >= 3 * device.sm_count():
      return cpp
  return 1


def chunk_inverse(
  k: jax.Array,
  beta_rows: jax.Array,
  mask_rows: jax.Array,
  *,
  chunks_per_program: int | None = None,
  diag_solve: bool | None = None,
  clean: bool = False,
  interpret=None,
):
  """T0 per chunk, `[B, H, NC * N, N]` in `k.dtype` (chunk `c` is rows `c*N .. c*N + N - 1`).

  Args:
    k: `[B, Tp, Hk, K]` keys, `Tp` a multiple of `C = 64 // r`; `Hk` divides the value heads
      `H` of beta_rows (grouped value heads: key head `h // (H / Hk)` serves value head `h`).
    beta_rows: `[B, H, NC * N]` float32, beta per block-major row `(a, t)` of each chunk
      (`forward.block_rows`: whole 256-byte rows, so every TMA destination stays 128-byte
      aligned; copying `C`-token pieces into a row misaligns them for `C = 16, 8`).
    mask_rows: `[Bm, Hm, NCm, r, N]` float32, `Bm in {1, B}`, `Hm in {1, H}`, `NCm in {1, NC}`;
      entry `[.., d, (a, t)] = M_t[a, d]` (`forward.mask_rows` builds it).
    chunks_per_program: chunks each program walks (a divisor of the chunk count; None:
      `default_chunks_per_program`).
    diag_solve: solve the 16-row diagonal blocks in float32 (`diag_solve.py`) and merge only
      larger groups on the tensor cores, or merge from 2-token groups up (False). None: the
      solve compiled, the merges in the interpreter (which runs no raw Mosaic GPU code).
    clean: the non-finite guard in the loads: each chunk's keys cleaned in place as they land
      (`common.clean_tile`), so no nan or inf reaches a product.
    interpret: None on a GPU, or `plgpu.InterpretGPUParams()` for the Mosaic GPU interpreter.
  """
  householder = k.ndim == 5
  if householder:  # [B, Tp, n_h, Hk, K]: the Householder form's sub-step keys
    batch, padded, _, key_heads, key_dim = k.shape
  else:
    batch, padded, key_heads, key_dim = k.shape
  heads = beta_rows.shape[1]
  if heads % key_heads:
    raise ValueError(f"beta_rows: {heads} value heads, not a multiple of k's {key_heads} heads")
  group = heads // key_heads
  r = mask_rows.shape[-2]
  c = chunk_tokens(r)
  if padded % c:
    raise ValueError(f"k: length {padded} must be a multiple of the chunk {c} (r={r})")
  if beta_rows.shape != (batch, heads, padded * r):
    raise ValueError(f"beta_rows: shape {beta_rows.shape}, expected {(batch, heads, padded * r)}")
  if mask_rows.ndim != 5 or mask_rows.shape[-1] != N:
    raise ValueError(f"mask_rows: shape {mask_rows.shape}, expected [Bm, Hm, NCm, r, {N}]")
  if householder and k.shape[2] != r:
    raise ValueError(f"k: {k.shape[2]} sub-steps per token, mask_rows says r={r}")
  nc = padded // c
  cpp = chunks_per_program or default_chunks_per_program(batch, heads, nc)
  if nc % cpp:
    raise ValueError(f"chunks_per_program={cpp} must divide the chunk count {nc}")
  m_b, m_h, m_n = mask_rows.shape[:3]
  dtype = k.dtype
  dk = key_dim // r
  staged = interpret is not None
  if diag_solve is None:
    diag_solve = not staged
  if diag_solve and staged:
    raise ValueError("diag_solve=True: the Mosaic GPU interpreter runs no raw Mosaic GPU code")
  itemsize = jnp.dtype(dtype).itemsize
  n_bufs = 2 if staged else 1  # b, and in the interpreter a
  tiles = (2 + (r > 1 and not householder)) * N * key_dim * itemsize + (
    2 + n_bufs
  ) * N * N * itemsize
  solve_bytes = 2 * N * (N + diag_solve_mod.PAD) * 4 if diag_solve else 0
  check_smem("chunk_inverse", tiles + solve_bytes + 2 * (r + 1) * N * 4)

  scratch = dict(
    krep_s=smem((2, N, key_dim), dtype),  # double-buffered: the next chunk's keys load meanwhile
    beta_s=plgpu.SMEM((2, N), F32),
    m_s=plgpu.SMEM((2, r, N), F32),
    bufs=[smem((N, N), dtype) for _ in range(n_bufs)],
    t_s=smem((2, N, N), dtype),  # double-buffered: a chunk's store leaves while the next runs
    bar=plgpu.Barrier(num_arrivals=r + 2, num_barriers=2),
  )
  if r > 1 and not householder:
    scratch["kb_s"] = smem((N, key_dim), dtype)
  if diag_solve:
    scratch["solve_s"] = diag_solve_mod.scratch()

  def body(
    k_ref, beta_ref, m_ref, t0_ref, krep_s, beta_s, m_s, bufs, t_s, bar, kb_s=None, solve_s=None
  ):
    b, nb, h = lax.axis_index("b"), lax.axis_index("n"), lax.axis_index("h")
    mb = b if m_b > 1 else 0
    mh = h if m_h > 1 else 0

    def issue(i, slot):
      n = nb * cpp + i
      rows = pl.ds(n * c, c)
      hk = lax.div(h, group)
      for a in range(r):
        src = k_ref.at[b, rows, a, hk] if householder else k_ref.at[b, rows, hk]
        plgpu.copy_gmem_to_smem(src, krep_s.at[slot].at[pl.ds(a * c, c)], bar.at[slot])
      plgpu.copy_gmem_to_smem(beta_ref.at[b, h, pl.ds(n * N, N)], beta_s.at[slot], bar.at[slot])
      mn = n if m_n > 1 else 0
      plgpu.copy_gmem_to_smem(m_ref.at[mb, mh, mn], m_s.at[slot], bar.at[slot])

    issue(0, 0)
    sq = (N, N)
    earlier = earlier_rows(r, householder)

    @pl.loop(0, cpp)
    def _chunk(i):
      slot = lax.rem(i, 2)
      plgpu.barrier_wait(bar.at[slot])

      @pl.when(i + 1 < cpp)
      def _prefetch():
        plgpu.commit_smem()  # this program's reads of the other slot come before the copy
        issue(i + 1, 1 - slot)

      keys = krep_s.at[slot]
      if clean:
        clean_tile(keys)
        plgpu.commit_smem()
      if r == 1 or householder:
        gram = matmul(keys, keys.T, sq)
      else:
        kshape = (N, key_dim)
        kfull = plgpu.load(keys, layout=WGMMA)
        own = own_block(kshape, dk, c)
        kb_s[...] = jnp.where(own, kfull, jnp.zeros_like(kfull))
        plgpu.commit_smem()
        gram = matmul(keys, kb_s.T, sq)  # [(a,t),(d,s)] = <k_t^(d), k_s^(d)>
      coef = bcast_rows(plgpu.load(beta_s.at[slot], layout=ROWS), sq)
      if not householder:
        coef = coef * mask_matrix(m_s.at[slot], sq, c, r)
      a0 = jnp.where(earlier, gram * coef, 0.0)

      x = invert(a0, r, bufs, dtype, solve_s if diag_solve else None, householder)
      plgpu.wait_smem_to_gmem(1, wait_read_only=True)  # t_s[slot] of chunk i - 2 has left
      t_s.at[slot][...] = x.astype(dtype)
      plgpu.commit_smem()
      n = nb * cpp + i
      plgpu.copy_smem_to_gmem(t_s.at[slot], t0_ref.at[b, h, pl.ds(n * N, N)])

    plgpu.wait_smem_to_gmem(0)

  return plgpu.kernel(
    body,
    out_type=jax.ShapeDtypeStruct((batch, heads, nc * N, N), dtype),
    scratch_types=scratch,
    grid=(batch, nc // cpp, heads),
    grid_names=("b", "n", "h"),
    compiler_params=compiler_params(),
    interpret=interpret,
    kernel_name=f"gdp_chunk_inverse_r{r}",
  )(k, beta_rows, mask_rows)
