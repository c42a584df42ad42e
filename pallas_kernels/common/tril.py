"""In-kernel inverse of a unit lower-triangular 16 x 16 tile, by repeated squaring.

For A strictly lower triangular (16 x 16, so A^16 = 0) the Neumann series is finite and factors:

  (I + A)^-1 = sum_{k<16} (-A)^k = (I - A)(I + A^2)(I + A^4)(I + A^8)

six 16 x 16 products (three squarings, three multiplications) instead of a 16-step forward
substitution whose every step is a cross-thread reduction (docs/chunked_form.md, "the inverse by
16-row blocks"). In exact arithmetic both give the same matrix; the products run in float32 at
the given precision ("ieee" by default: the entries of A^k can be much larger than those of the
inverse, so these products should not use TF32).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.common import backend

BLOCK = 16


def unit_lower_inverse(a, *, precision="ieee"):
  """(I + a)^-1 for a strictly lower-triangular [16, 16] float32 value (in a kernel)."""
  if a.shape != (BLOCK, BLOCK):
    raise ValueError(f"unit_lower_inverse needs a [{BLOCK}, {BLOCK}] tile, got {a.shape}")
  a = a.astype(jnp.float32)
  dot = lambda x, y: backend.dot(x, y, precision=precision)
  row = jax.lax.broadcasted_iota(jnp.int32, (BLOCK, BLOCK), 0)
  col = jax.lax.broadcasted_iota(jnp.int32, (BLOCK, BLOCK), 1)
  p = jnp.where(row == col, 1.0, 0.0) - a  # I - A
  power = a
  for _ in range(3):  # A^2, A^4, A^8
    power = dot(power, power)
    p = p + dot(p, power)  # p (I + A^(2^j))
  return p
