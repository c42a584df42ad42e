"""The Householder form on the Mosaic GPU kernels (Hopper): the forward with a token's n_h
sub-steps as the rows of one chunk matrix (`pallas_kernels.mosaic_gpu.forward.householder_forward`,
docs/mosaic_gpu.md#the-householder-form), so q, g and the output keep one row per token and the
sub-steps are never laid out as tokens of their own. Packed sequences without initial states
are read in place, the row walked in pieces as the operator's (`_packed_forward`,
docs/mosaic_gpu.md#packed-sequences-in-place).

Differentiated, the call runs what the other implementations run, the r = 1 operator over the
T n_h sub-steps (its Mosaic forward and backward; `householder_delta_product`'s sub-step path):
a `jax.custom_vjp` whose primal is the forward here and whose forward rule is the sub-step path's
vjp. The non-finite guard is the operator's (docs/precision.md#non-finite-inputs): cleaned
inputs, the outputs from a token with a bad sub-step on marked.
"""

from __future__ import annotations

import jax
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp

from gdp_jax.ops.autodiff import in_forward_mode
from gdp_jax.ops.gated_delta_product import nonfinite, pieces, varlen
from pallas_kernels.common.backend import interpret_mode
from pallas_kernels.mosaic_gpu.common import SUPPORTED_DIMS, SUPPORTED_DTYPES, chunk_tokens
from pallas_kernels.mosaic_gpu.forward import BLOCK_V, householder_forward

SUPPORTED_NUM_HOUSEHOLDER = (2, 4)
SUB_STEPS_PER_CHUNK = 64  # the kernels' chunk: 64 / n_h tokens of n_h sub-steps


def supported(q, k, v, n_h: int, chunk_size: int, cu_seqlens=None, initial_state=None) -> bool:
  """Whether the kernels take this call (else the sub-step path runs). One device only: on
  several, the sub-step path's operator partitions itself (docs/sharding.md), this one would not.
  Packed sequences: without initial states, at most `pieces.MAX_SLOTS` bounds."""
  if cu_seqlens is not None and (
    initial_state is not None or pieces.num_slots(len(cu_seqlens) - 1) > pieces.MAX_SLOTS
  ):
    return False
  return (
    n_h in SUPPORTED_NUM_HOUSEHOLDER
    and chunk_size == SUB_STEPS_PER_CHUNK
    and jnp.dtype(q.dtype) in SUPPORTED_DTYPES
    and q.dtype == k.dtype == v.dtype
    and q.shape[-1] in SUPPORTED_DIMS
    and q.shape[2] == v.shape[2]
    and jax.device_count() == 1
  )


def _forward(q, k, v, g, beta, initial_state, scale, n_h, output_final_state):
  g = jnp.zeros(q.shape[:2] + v.shape[2:3], jnp.float32) if g is None else g
  (q, k, v, g, beta, _), marks = nonfinite.clean(q, k, v, g, beta, None, substeps=n_h)
  o, final = householder_forward(
    q,
    k,
    v,
    g,
    beta,
    scale=scale,
    initial_state=initial_state,
    output_final_state=True,
    interpret=plgpu.InterpretGPUParams() if interpret_mode() else None,
  )
  o, final = nonfinite.mark(o, final, marks)
  return o, (final if output_final_state else None)


def _packed_forward(q, k, v, g, beta, cu_seqlens, scale, n_h, output_final_state):
  """Packed sequences read in place (B = 1, no initial states): each sequence start a reset, the
  walk over pieces of the row, the final states carried from the pieces' states over the
  sub-steps (`pieces.final_states`); the guard per sequence (`varlen.clean`)."""
  t_len, heads = q.shape[1], v.shape[2]
  c = chunk_tokens(n_h)
  cu = varlen.sanitize(cu_seqlens, t_len)
  g = jnp.zeros(q.shape[:2] + v.shape[2:3], jnp.float32) if g is None else g
  (q, k, v, g, beta, _), marks = varlen.clean(q, k, v, g, beta, None, cu, substeps=n_h, local=True)
  g = pieces.starts_as_resets(g, cu)
  value_tiles = -(-v.shape[-1] // BLOCK_V)
  table, bounds = pieces.row_pieces(cu, -(-t_len // c), c, heads * value_tiles)
  o, slot_states = householder_forward(
    q,
    k,
    v,
    g,
    beta,
    scale=scale,
    output_final_state=True,
    seq_table=table,
    pieces=bounds,
    interpret=plgpu.InterpretGPUParams() if interpret_mode() else None,
  )
  # the chunks of 64 sub-steps are the kernels' chunks of 64 / n_h tokens: the same slots
  g_sub = jnp.pad(g[:, :, None], ((0, 0), (0, 0), (0, n_h - 1), (0, 0))).reshape(beta.shape)
  ones = jnp.ones((1, 1, 1, 1, 1), jnp.float32)
  final = pieces.final_states(slot_states, bounds, k, v, g_sub, beta, ones, cu * n_h, c * n_h)
  o, final = nonfinite.mark(o, final, marks)
  return o, (final if output_final_state else None)


def householder_mosaic_gpu(q, k, v, g, beta, initial_state, *, scale, n_h, output_final_state,
                           substeps, cu_seqlens=None):  # fmt: skip
  """`(o, final or None)` of the Householder form: the forward here, the vjp of `substeps`
  (the sub-step path, `(q, k, v, g, beta, initial_state) -> (o, final or None)`, over the same
  cu_seqlens) when differentiated."""
  if in_forward_mode((q, k, v, g, beta, initial_state, scale)):
    # the sub-step path's clear error (its custom_vjp has reverse mode only)
    return substeps(q, k, v, g, beta, initial_state)

  @jax.custom_vjp
  def run(q, k, v, g, beta, initial_state):
    if cu_seqlens is not None:
      return _packed_forward(q, k, v, g, beta, cu_seqlens, scale, n_h, output_final_state)
    return _forward(q, k, v, g, beta, initial_state, scale, n_h, output_final_state)

  def run_fwd(*args):
    return jax.vjp(substeps, *args)

  def run_bwd(vjp, cotangents):
    return vjp(cotangents)

  run.defvjp(run_fwd, run_bwd)
  return run(q, k, v, g, beta, initial_state)
