"""Helpers shared by the Mosaic GPU kernels (docs/mosaic_gpu.md): the chunk rule, shared-memory
tiles, layouts and tensor-core products staged through shared memory.

Rows of a chunk matrix are block-major: row `(a, t)` is `a * C + t` for key block `a` and token
`t` of a chunk of `C` tokens, `N = C * r` rows in all (docs/chunked_form.md uses token-major rows;
the two orders differ by a permutation, which conjugates every chunk matrix and changes nothing
else). The kernels keep `N = 64`, one tensor-core tile of rows, so `C = 64 // r`.
"""

from __future__ import annotations

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from pallas_kernels.common import device

F32 = jnp.float32
ROWS_PER_CHUNK = 64  # N: rows of every chunk matrix, one wgmma M tile
SUPPORTED_R = (1, 2, 4, 8)  # the forward's r
BACKWARD_R = (1, 2, 4)  # the backward's r
SUPPORTED_DIMS = (64, 128)  # K and V
SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
SMEM_LIMIT = device.SHARED_MEMORY_PER_BLOCK[device.HOPPER]  # the GPUs the kernels compile for

WGMMA = plgpu.Layout.WGMMA
ROWS = plgpu.Layout.WGMMA.reduce(1)  # one value per row of a WGMMA tile
COLS = plgpu.Layout.WGMMA.reduce(0)  # one value per column


def chunk_tokens(r: int) -> int:
  """Tokens per chunk, `C = 64 // r`, so that a chunk matrix has `N = 64` rows.

  Keeping `N = 64` makes every product of the walk one 64-row wgmma tile for every `r` (the
  chain per chunk is the same three dependent products as `r = 1`); the price is `r` times more
  chunks. Key blocks are never sliced (products run over the full key width against block-zeroed
  keys), so `K / r < 16` needs no padding; `C = 64 // r` must be a whole number of at least 8.
  """
  if r not in SUPPORTED_R:
    raise ValueError(f"mask size r={r}: the Mosaic GPU kernels support r in {SUPPORTED_R}")
  return ROWS_PER_CHUNK // r


def smem(shape: tuple[int, ...], dtype, max_swizzle: int = 128):
  """A shared-memory tile tiled and swizzled for TMA and wgmma (minor dimension last).

  max_swizzle: a tile whose major dimension a product contracts over needs that dimension to be
  a multiple of `swizzle / itemsize` (wgmma's k group): the backward's token tiles of `C < 64`
  tokens take a smaller swizzle.
  """
  dtype = jnp.dtype(dtype)
  swizzle = min(plgpu.find_swizzle(shape[-1] * dtype.itemsize * 8), max_swizzle)
  transforms = (
    plgpu.TilingTransform((8, swizzle // dtype.itemsize)),  # type: ignore[abstract]
    plgpu.SwizzleTransform(swizzle),  # type: ignore[abstract]
  )
  return plgpu.SMEM(shape, dtype, transforms=transforms)


def iota(shape: tuple[int, int], dim: int) -> jax.Array:
  return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=WGMMA)


def bcast_rows(vec: jax.Array, shape: tuple[int, int]) -> jax.Array:
  """`vec[i]` along row `i` (`vec` in the ROWS layout)."""
  return lax.broadcast_in_dim(vec, shape, [0])


def bcast_cols(vec: jax.Array, shape: tuple[int, int]) -> jax.Array:
  """`vec[j]` along column `j` (`vec` in the COLS layout)."""
  return lax.broadcast_in_dim(vec, shape, [1])


def matmul(a_ref, b_ref, shape: tuple[int, int]) -> jax.Array:
  """`a @ b` on the tensor cores into a fresh float32 accumulator; both operands in shared memory.

  Operands staged in shared memory (never registers) and a fresh accumulator (never
  `pl.run_state` on an initialised one) keep every product runnable in the Mosaic GPU
  interpreter. The optimization barrier keeps arithmetic on the result after the wait for the
  wgmma (a stale-accumulator hazard of jax 0.11.2's lowering).
  """

  def scoped(acc):
    plgpu.wgmma(acc, a_ref, b_ref)
    return acc[...]

  return lax.optimization_barrier(pl.run_scoped(scoped, plgpu.ACC(shape, F32)))


def matmul_reg(a: jax.Array, b_ref, shape: tuple[int, int], *, init=None, stage=None) -> jax.Array:
  """`init + a @ b` on the tensor cores with `a` a 16-bit WGMMA-layout array: a register left
  operand, so the product need not wait for `a` to be stored and fenced in shared memory (the
  walk's chain runs three such products per chunk).

  init: None (a fresh accumulator) or a float32 WGMMA-layout array the product is added to, in the
    accumulator itself.
  stage: None on a GPU. The Mosaic GPU interpreter runs neither register operands nor initialised
    accumulators: there `a` is staged through this shared-memory tile and `init` added after, the
    same arithmetic.
  """
  if stage is not None:
    stage[...] = a
    plgpu.commit_smem()
    out = matmul(stage, b_ref, shape)
    return out if init is None else init + out

  def body(acc):
    plgpu.wgmma(acc, a, b_ref)

  if init is None:

    def scoped(acc):
      body(acc)
      return acc[...]

    out = pl.run_scoped(scoped, plgpu.ACC(shape, F32))
  else:
    out = pl.run_state(body)(plgpu.ACC.init(init))
  return lax.optimization_barrier(out)


def matmul_sum(init: jax.Array, products, shape: tuple[int, int], *, stage=None) -> jax.Array:
  """`init + sum(a @ b for a, b in products)` on the tensor cores, every product issued into one
  accumulator initialised with the float32 WGMMA-layout `init` before a single wait.

  products: `(a, b)` pairs, `b` a shared-memory ref, `a` a ref or a 16-bit WGMMA-layout array
    (a register left operand).
  stage: None on a GPU. In the Mosaic GPU interpreter (no initialised accumulators, no register
    operands) each product runs on its own (`matmul` / `matmul_reg` with this staging tile) and is
    added after: the same arithmetic.
  """
  if stage is not None:
    out = init
    for a, b in products:
      out = out + (matmul_reg(a, b, shape, stage=stage) if isinstance(a, jax.Array)
                   else matmul(a, b, shape))  # fmt: skip
    return out

  def body(acc):
    for a, b in products:
      plgpu.wgmma(acc, a, b)

  return lax.optimization_barrier(pl.run_state(body)(plgpu.ACC.init(init)))


def token_of(index: jax.Array, tokens: int) -> jax.Array:
  """Token `t` of block-major row or column `(a, t)`."""
  return lax.rem(index, tokens)


def block_of(index: jax.Array, tokens: int) -> jax.Array:
  """Key block `a` of block-major row or column `(a, t)`."""
  return lax.div(index, tokens)


def mask_matrix(m_smem, shape: tuple[int, int], col_block_width: int, r: int) -> jax.Array:
  """`M_t[a, d]` at row `(a, t)`, column group `d = col // col_block_width`, float32.

  `m_smem` holds the mask rows `[r, N]`: entry `[d, (a, t)] = M_t[a, d]`.
  """
  col_block = lax.div(iota(shape, 1), col_block_width)
  terms = []
  for d in range(r):
    m_d = bcast_rows(plgpu.load(m_smem.at[d], layout=ROWS), shape)
    terms.append(jnp.where(col_block == d, m_d, 0.0))
  out = terms[0]
  for term in terms[1:]:
    out = out + term
  return out


def own_block(shape: tuple[int, int], block_width: int, tokens: int) -> jax.Array:
  """True where column `j` lies in key block `j // block_width` equal to row `(a, t)`'s block `a`:
  `where(own_block(...), keys repeated per block, 0)` is the block keys Kb."""
  return lax.div(iota(shape, 1), block_width) == block_of(iota(shape, 0), tokens)


def chunk_decay(g_rows: jax.Array, g_cols: jax.Array, tokens: int) -> jax.Array:
  """`Dec[(a,t),(d,s)] = exp(gamma_t - gamma_s)` for `t >= s`, else 0: `[N, N]` float32 from gamma
  per row (ROWS layout) and per column (COLS layout) (docs/chunked_form.md#gamma)."""
  sq = (ROWS_PER_CHUNK, ROWS_PER_CHUNK)
  later = token_of(iota(sq, 0), tokens) >= token_of(iota(sq, 1), tokens)
  return jnp.exp(jnp.where(later, bcast_rows(g_rows, sq) - bcast_cols(g_cols, sq), -jnp.inf))


def key_stage(kb_ref, kw_ref, m_ref, block_width, r, dtype, mask_keys):
  """For `mask_keys` (r > 1): the keys repeated per block (`kb_ref`) into Kb, in place, and the
  masked keys Kw (`kw_ref`). Returns Kb in registers (16-bit), or None without `mask_keys`."""
  if not mask_keys:
    return None
  tokens = ROWS_PER_CHUNK // r
  kshape = kb_ref.shape
  kfull = plgpu.load(kb_ref, layout=WGMMA).astype(F32)
  kw_ref[...] = (kfull * mask_matrix(m_ref, kshape, block_width, r)).astype(dtype)
  kb_lo = jnp.where(own_block(kshape, block_width, tokens), kfull, 0.0).astype(dtype)
  kb_ref[...] = kb_lo
  return kb_lo


def gated(t0v: jax.Array, g_rows, g_cols, beta_cols, tokens: int) -> jax.Array:
  """`Ag = T0 ⊙ Dec ⊙ beta_s`, float32 `[N, N]`, from T0 (float32 registers)."""
  sq = (ROWS_PER_CHUNK, ROWS_PER_CHUNK)
  return t0v * chunk_decay(g_rows, g_cols, tokens) * bcast_cols(beta_cols, sq)


def clean_tile(ref) -> None:
  """The non-finite guard in a kernel's loads (docs/mosaic_gpu.md#the-guard-in-the-loads): the
  nan and inf entries of a 16-bit tile in shared memory set to 0, in place (a select). A tile of
  fewer than 64 rows (a chunk's q at r > 1) is passed transposed."""
  x = plgpu.load(ref, layout=WGMMA)
  ref[...] = jnp.where(jnp.abs(x.astype(F32)) < jnp.inf, x, jnp.zeros_like(x))


def gate_stage(
  kb_ref, kw_ref, t_ref, m_ref, g_rows, g_cols, beta_cols, block_width, r, dtype, mask_keys=None
):
  """A walk's stage made ready, in place: for r > 1 the keys repeated per block (`kb_ref`) into Kb
  and the masked keys Kw (`kw_ref`), and T0 (`t_ref`) into `Ag = T0 ⊙ Dec ⊙ beta_s`. Returns Kb
  in registers (16-bit; None for r = 1, where the keys are Kb already, and with
  `mask_keys=False`: the Householder form's sub-step keys, Kb = Kw as loaded)."""
  if mask_keys is None:
    mask_keys = r > 1
  kb_lo = key_stage(kb_ref, kw_ref, m_ref, block_width, r, dtype, mask_keys)
  t0v = plgpu.load(t_ref, layout=WGMMA).astype(F32)
  t_ref[...] = gated(t0v, g_rows, g_cols, beta_cols, ROWS_PER_CHUNK // r).astype(dtype)
  return kb_lo


# Alignment of the buffers adds to a kernel's own estimate of its shared memory (233,600 bytes
# measured against 231,376 estimated for the forward walk at K = 128, r = 4, 3 stages): keep this
# much spare.
SMEM_MARGIN = 8 * 1024


def ring_stages(name: str, smem_bytes_of, stages: int | None = None) -> int:
  """The ring stages of a warp-specialised walk: `stages`, or (None) the most of 3 and 2 for which
  `smem_bytes_of(stages)` fits in shared memory with `SMEM_MARGIN` to spare. A ValueError naming
  the kernel when even 2 do not fit."""
  if stages is None:
    stages = next((s for s in (3, 2) if smem_bytes_of(s) + SMEM_MARGIN <= SMEM_LIMIT), 2)
  need = smem_bytes_of(max(stages, 2))
  if stages < 2 or need + SMEM_MARGIN > SMEM_LIMIT:
    raise ValueError(
      f"{name} needs {need} bytes of shared memory with {max(stages, 2)} stages, above the "
      f"{SMEM_LIMIT} limit"
    )
  return stages


def check_smem(name: str, nbytes: int) -> None:
  if nbytes > SMEM_LIMIT:
    raise ValueError(f"{name} needs {nbytes} bytes of shared memory, above the {SMEM_LIMIT} limit")


def set_registers(n: int, warpgroups: int) -> None:
  """setmaxnreg to `n` registers per thread in a kernel of `warpgroups` warpgroups: a decrease
  below the count every thread starts with (64K registers shared out, in steps of 8), an increase
  above it (an increase to fewer is an illegal instruction on sm_90), nothing at it."""
  start = 65536 // (128 * warpgroups) // 8 * 8
  if n != start:
    plgpu.set_max_registers(n, action="increase" if n > start else "decrease")


def compiler_params() -> plgpu.CompilerParams:
  return plgpu.CompilerParams(approx_math=True)


def when(condition, fn) -> None:
  """`fn()` if `condition`: at trace time for a Python bool, else under `pl.when`."""
  if isinstance(condition, bool):
    if condition:
      fn()
  else:
    pl.when(condition)(fn)


def check_seq_table(seq_table, batch: int, state, state_name: str) -> int:
  """A walk's per-sequence table (packed sequences, B = 1): int32 `[N, 4]`, and `state` (the
  initial state or d final state, or None) with N leading entries. Returns N (B without one)."""
  if seq_table is None:
    return batch
  num_states = seq_table.shape[0]
  width = seq_table.shape[-1]
  if batch != 1 or seq_table.shape != (num_states, width) or seq_table.dtype != jnp.int32:
    raise ValueError(
      f"seq_table: {seq_table.shape} {seq_table.dtype} with B={batch}: int32 [N, 4], B=1"
    )
  if width not in (4, 8):
    raise ValueError(f"seq_table: {seq_table.shape}: rows of 4 (sequences) or 8 (pieces)")
  if state is not None and state.shape[0] != num_states:
    raise ValueError(f"{state_name}: {state.shape}, expected {num_states} states")
  return num_states


def copy_tiles(tiles, real, dummy=None, silent=None) -> None:
  """Copies shared-memory `tiles` to global memory: to the refs `real()` gives, or where `silent`
  (a piece's silent step, docs/mosaic_gpu.md#packed-sequences-in-place) to `dummy()`'s, which
  other silent steps write too and nothing reads."""

  def copy(dsts):
    for tile, dst in zip(tiles, dsts):
      plgpu.copy_smem_to_gmem(tile, dst)

  if silent is None:
    copy(real())
    return
  pl.when(silent)(lambda: copy(dummy()))
  pl.when(jnp.logical_not(silent))(lambda: copy(real()))


def read_seq_table(tab_ref, sc_ref, tab_s, sc_s, bar, seq, wg, bounds=None):
  """In a walk over packed sequences (three warpgroups): warpgroup 1 copies sequence `seq`'s
  row of the table and the scale (and `bounds`, a (global, shared) pair: the pieces' bounds)
  into shared memory, every warpgroup waits for them; returns the sequence's (first chunk,
  chunk count)."""

  @pl.when(wg == 1)
  def _():
    plgpu.copy_gmem_to_smem(tab_ref.at[seq], tab_s, bar)
    plgpu.copy_gmem_to_smem(sc_ref, sc_s, bar)
    if bounds is not None:
      plgpu.copy_gmem_to_smem(*bounds, bar)

  plgpu.barrier_wait(bar)
  return tab_s[0], tab_s[1]
