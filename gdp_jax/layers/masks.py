"""The block masks the gated delta product layer builds from its parameters (docs/operator.md)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from gdp_jax.layers.common import (
  f32,
  l2norm,
)


def block_mask(w):
  """mask = l2norm(|W|) @ l2norm(|W|)^T over the last two axes [..., r, r].

  Rows of |W| are normalised, so the mask is a Gram matrix of unit non-negative vectors:
  symmetric, positive semi-definite, diagonal 1 (up to the l2norm eps), entries in [0, 1].
  """
  n = l2norm(jnp.abs(w.astype(f32)))
  return jnp.einsum("...ad,...bd->...ab", n, n, precision=jax.lax.Precision.HIGHEST)
