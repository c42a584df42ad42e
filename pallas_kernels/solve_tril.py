"""(I + A)^-1 of each chunk's strictly lower-triangular [N, N] matrix (DESIGN §2, "solve_tril").

N = BT * r rows in (t, a) order; A is strictly lower triangular in that order (zero on and above
each token's diagonal r x r block). Blocks of 16 rows are inverted by forward substitution; the
full inverse follows by block forward substitution with matmuls:
  X_ii = (I + A_ii)^-1,   X_ij = -X_ii sum_{j <= k < i} A_ik X_kj   (i > j)
which for two blocks is the seed's merge Ai21 = -Ai22 A21 Ai11. Every block is loaded from the ref
(a loaded value cannot be sliced in the Triton lowering, DESIGN §4).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import config, specs

BLOCK = 16


def _invert_unit_lower_16(blocks):
  """(I + A)^-1 for a tuple of strictly lower [16, 16] float32 blocks, side by side.

  Row i of X - I is -A[i] + sum_k (-A[i, k]) (X - I)[k] over the rows k < i already done
  (forward substitution; rows are picked with where + sum, the seed's way).
  """
  idx = jax.lax.broadcasted_iota(jnp.int32, (BLOCK, BLOCK), 0)
  lower = idx > jax.lax.broadcasted_iota(jnp.int32, (BLOCK, BLOCK), 1)
  neg = tuple(jnp.where(lower, -a, 0.0) for a in blocks)

  def body(i, ms):
    out = []
    for m in ms:
      pick = idx == i
      row = jnp.sum(jnp.where(pick, m, 0.0), axis=0)                # [16]
      row = row + jnp.sum(row[:, None] * m, axis=0)
      out.append(jnp.where(pick, row[None, :], m))
    return tuple(out)

  ms = jax.lax.fori_loop(1, BLOCK, body, neg)
  eye = (idx == jax.lax.broadcasted_iota(jnp.int32, (BLOCK, BLOCK), 1)).astype(jnp.float32)
  return tuple(m + eye for m in ms)


def _solve_tril_kernel(a_ref, ai_ref):
  n = a_ref.shape[0]
  nb = n // BLOCK
  blk = lambda i: pl.ds(i * BLOCK, BLOCK)
  load = lambda i, j: a_ref[blk(i), blk(j)].astype(jnp.float32)
  diag = _invert_unit_lower_16(tuple(load(i, i) for i in range(nb)))
  x = {}
  for i in range(nb):
    x[i, i] = diag[i]
    for j in range(i - 1, -1, -1):
      acc = None
      for k in range(j, i):
        term = config.dot(load(i, k), x[k, j])
        acc = term if acc is None else acc + term
      x[i, j] = -config.dot(x[i, i], acc)
  zeros = jnp.zeros((BLOCK, BLOCK), ai_ref.dtype)
  for i in range(nb):
    for j in range(nb):
      ai_ref[blk(i), blk(j)] = x[i, j].astype(ai_ref.dtype) if j <= i else zeros


def solve_tril(a, chunk_rows, *, out_dtype=jnp.float32, num_warps=4):
  """a [B, H, Tp*r, N] (N = chunk_rows, a multiple of 16) -> (I + A)^-1 blockwise, same shape."""
  bsz, heads, total_rows, n = a.shape
  if n != chunk_rows or n % BLOCK:
    raise ValueError(f"solve_tril needs [.., N] blocks with N = {chunk_rows} a multiple of "
                     f"{BLOCK}, got shape {a.shape}")
  return config.pallas_call(
      _solve_tril_kernel,
      grid=(total_rows // n, bsz, heads),
      in_specs=[specs.rows(n, n)],
      out_specs=specs.rows(n, n),
      out_shape=jax.ShapeDtypeStruct(a.shape, out_dtype),
      num_warps=num_warps,
      name="gdp_solve_tril",
  )(a)
