"""Chunk-local cumulative sum of the log-decay g: gamma (docs/chunked_form.md#gamma)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.common import backend


def _cumsum_kernel(g_ref, out_ref, *, reverse):
  g = g_ref[...].astype(jnp.float32)
  if reverse:
    # suffix sum = total - prefix sum + self (the lowering has a forward cumsum only)
    out_ref[...] = jnp.sum(g) - jnp.cumsum(g) + g
  else:
    out_ref[...] = jnp.cumsum(g)


def chunk_local_cumsum(g, chunk, *, reverse=False):
  """gamma: cumsum of g [B, H, Tp] within each chunk of `chunk` tokens; float32.

  reverse=True gives the suffix sums (the backward of a forward cumsum).
  """
  bsz, heads, t_len = g.shape
  spec = pl.BlockSpec((None, None, chunk), lambda t, b, h: (b, h, t))
  return backend.pallas_call(
    lambda g_ref, o_ref: _cumsum_kernel(g_ref, o_ref, reverse=reverse),
    grid=(t_len // chunk, bsz, heads),
    in_specs=[spec],
    out_specs=spec,
    out_shape=jax.ShapeDtypeStruct(g.shape, jnp.float32),
    num_warps=1,
    name="gdp_chunk_cumsum",
  )(g)
