"""The block masks the gated delta product layer builds from its parameters (docs/operator.md)."""

from __future__ import annotations

import math

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


def rotation_mask(w):
  """The "rotation" mode's mask from w [..., r/2, 3] (angle, two scales per pair of key blocks):
  M = I - C with C block-diagonal over the pairs (2a, 2a + 1) of key blocks,

    C_pair = R(theta) diag(c1, c2),  theta = pi tanh(w0),  c1 = tanh(w1),  c2 = tanh(w2),

  R(theta) the rotation by theta. Returns [..., r, r] float32: signed and, for theta != 0, not
  symmetric. With unit key blocks the token's transition restricted to the span of its key
  blocks is I - beta M = (1 - beta) I + beta C; ||C|| <= 1, so for beta in (0, 1) it is a
  contraction that can rotate (c1 = c2 = 1: the rotation by theta at beta = 1) or reflect
  (theta = 0, c1 = 1, c2 = -1). w = 0 gives C = 0, M = I.
  """
  w = w.astype(f32)
  theta, c1, c2 = math.pi * jnp.tanh(w[..., 0]), jnp.tanh(w[..., 1]), jnp.tanh(w[..., 2])
  cos, sin = jnp.cos(theta), jnp.sin(theta)
  pair = jnp.stack(
    [jnp.stack([c1 * cos, -c2 * sin], -1), jnp.stack([c1 * sin, c2 * cos], -1)], -2
  )  # [..., r/2, 2, 2]
  half = w.shape[-2]
  eye = jnp.eye(half, dtype=f32)
  # Block-diagonal [..., r, r]: entry (2a + i, 2b + j) = delta_ab pair[a, i, j].
  c = jnp.einsum("ab,...aij->...aibj", eye, pair).reshape(w.shape[:-2] + (2 * half, 2 * half))
  return jnp.eye(2 * half, dtype=f32) - c
