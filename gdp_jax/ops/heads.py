"""Grouped value heads (docs/varlen.md#grouped-value-heads): HV value heads read H key heads,
value head i reading key head i // (HV // H). Shared by the implementations of every op."""

from __future__ import annotations

import jax.numpy as jnp


def expand_key_heads(x, value_heads):
  """[..., H, K] -> [..., HV, K]: key head i // (HV // H) for value head i (grouped value heads,
  docs/varlen.md#grouped-value-heads). Autodiff of the repeat sums the gradient over the group."""
  group = value_heads // x.shape[-2]
  return x if group == 1 else jnp.repeat(x, group, axis=-2)


def sum_key_heads(dx, heads):
  """The vjp of `expand_key_heads`: [..., HV, K] -> [..., H, K], the sum over each group."""
  group = dx.shape[-2] // heads
  if group == 1:
    return dx
  summed = dx.astype(jnp.float32).reshape(dx.shape[:-2] + (heads, group, dx.shape[-1])).sum(-2)
  return summed.astype(dx.dtype)
