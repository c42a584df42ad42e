"""(I + A)^-1 of each chunk's strictly lower-triangular [N, N] matrix
(docs/chunked_form.md#the-inverse-by-16-row-blocks).

N = BT * r rows in (t, a) order; A is strictly lower triangular in that order (zero on and above
each token's diagonal r x r block). Blocks of 16 rows are inverted by forward substitution; the
full inverse follows by block forward substitution with matmuls:
  X_ii = (I + A_ii)^-1,   X_ij = -X_ii sum_{j <= k < i} A_ik X_kj   (i > j)
which for two blocks is the merge Ai21 = -Ai22 A21 Ai11. Every block is loaded from the ref
(a loaded value cannot be sliced in the Triton lowering, docs/pallas_triton.md).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.common import backend, options, specs

BLOCK = 16


def _invert_diagonal_blocks(a_ref, nb):
  """(I + A_ii)^-1 for the nb strictly lower [16, 16] diagonal blocks, as float32 values.

  Forward substitution, one row per step for all blocks at once: with X = I + Y,
    Y[j] = -A[j] + sum_k (-A[j, k]) Y[k]   (k < j; rows of Y above j are done).
  Row j of A comes straight from the ref (a dynamic row load), so each step needs one reduction.
  """
  idx = jax.lax.broadcasted_iota(jnp.int32, (BLOCK, BLOCK), 0)
  col = jax.lax.broadcasted_iota(jnp.int32, (BLOCK, BLOCK), 1)
  blk = lambda i: pl.ds(i * BLOCK, BLOCK)
  ys = tuple(
    jnp.where(idx > col, -a_ref[blk(i), blk(i)].astype(jnp.float32), 0.0) for i in range(nb)
  )

  def body(j, ys):
    out = []
    for i, y in enumerate(ys):
      row = -a_ref[i * BLOCK + j, blk(i)].astype(jnp.float32)  # [16], zero from column j on
      row = row + jnp.sum(row[:, None] * y, axis=0)
      out.append(jnp.where(idx == j, row[None, :], y))
    return tuple(out)

  ys = jax.lax.fori_loop(1, BLOCK, body, ys)
  eye = (idx == col).astype(jnp.float32)
  return tuple(y + eye for y in ys)


def _solve_tril_kernel(a_ref, ai_ref, *, precision):
  dot = functools.partial(backend.dot, precision=precision)
  n = a_ref.shape[0]
  nb = n // BLOCK
  blk = lambda i: pl.ds(i * BLOCK, BLOCK)
  load = lambda i, j: a_ref[blk(i), blk(j)].astype(jnp.float32)
  diag = _invert_diagonal_blocks(a_ref, nb)
  x = {}
  zeros = jnp.zeros((BLOCK, BLOCK), ai_ref.dtype)
  for i in range(nb):
    x[i, i] = diag[i]
    for j in range(i - 1, -1, -1):
      acc = None
      for k in range(j, i):
        term = dot(load(i, k), x[k, j])
        acc = term if acc is None else acc + term
      x[i, j] = -dot(x[i, i], acc)
    for j in range(nb):  # row block i is final
      ai_ref[blk(i), blk(j)] = x[i, j].astype(ai_ref.dtype) if j <= i else zeros


def solve_tril(
  a, *, chunk_rows, out_dtype=jnp.float32, launch=options.DEFAULT.solve_tril, precision="ieee"
):
  """a [B, H, Tp*r, N] (N = chunk_rows, a multiple of 16) -> (I + A)^-1 blockwise, same shape."""
  bsz, heads, total_rows, n = a.shape
  if n != chunk_rows or n % BLOCK:
    raise ValueError(
      f"solve_tril needs [.., N] blocks with N = {chunk_rows} a multiple of "
      f"{BLOCK}, got shape {a.shape}"
    )
  return backend.pallas_call(
    functools.partial(_solve_tril_kernel, precision=precision),
    grid=(total_rows // n, bsz, heads),
    in_specs=[specs.rows(n, n)],
    out_specs=specs.rows(n, n),
    out_shape=jax.ShapeDtypeStruct(a.shape, out_dtype),
    num_warps=launch.num_warps,
    num_stages=launch.num_stages,
    name="gdp_solve_tril",
  )(a)
