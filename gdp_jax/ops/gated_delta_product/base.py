"""What every implementation of `gated_delta_product` takes and returns, and what they share.

An implementation is called with the normalised inputs of gdp_jax/ops/gated_delta_product/api.py
(docs/implementations.md#registering-an-implementation): q, k [B, Tp, H, K]; v [B, Tp, HV, V];
g, beta [B, Tp, HV] (g clamped at RESET_LOG_DECAY); the mask [Bm, Tm, Hm, r, r]; a float32
initial state [B, HV, K, V]; the scale (a Python float) and the chunk size. Tp is T padded with
no-op tokens to a multiple of `time_multiple` (`run_padded`). It returns (o [B, Tp, HV, V],
final [B, HV, K, V] float32). `varlen` is the packed form (cu_seqlens, docs/varlen.md): B = 1,
T not padded, an initial state per sequence or None (zeros: `packed_states`).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax.numpy as jnp

from gdp_jax.ops.base import Implementation
from pallas_kernels.common.gates import RESET_LOG_DECAY

__all__ = [
  "RESET_LOG_DECAY",
  "GatedDeltaProductImplementation",
  "Problem",
  "packed_states",
  "run_padded",
]


class Problem(NamedTuple):
  """What an implementation's `unsupported` looks at in a call."""

  dtype: jnp.dtype
  key_dim: int
  value_dim: int
  key_blocks: int  # r
  packed: bool  # cu_seqlens given
  state_every: int | None = None  # block states (block_states.py)


@dataclasses.dataclass(frozen=True)
class GatedDeltaProductImplementation(Implementation):
  """The operator's implementations (the module docstring says what they take)."""

  def time_multiple(self, chunk_size: int, key_blocks: int) -> int:
    """T is padded to a multiple of this (1: not padded)."""
    return chunk_size

  def __call__(self, q, k, v, g, beta, mask, initial_state, scale, chunk_size):
    raise NotImplementedError

  def varlen(self, q, k, v, g, beta, mask, initial_state, scale, chunk_size, cu_seqlens):
    raise NotImplementedError


def packed_states(initial_state, q, v, cu_seqlens):
  """A `varlen` call's initial states: as given, or float32 zeros `[N, HV, K, V]` for None (a
  call without initial states; the Hopper kernels read such packed rows in place,
  docs/mosaic_gpu.md#packed-sequences-in-place)."""
  if initial_state is not None:
    return initial_state
  shape = (cu_seqlens.shape[0] - 1, v.shape[2], q.shape[-1], v.shape[-1])
  return jnp.zeros(shape, jnp.float32)


def run_padded(run, q, k, v, g, beta, mask, initial_state, scale, chunk_size):
  """`run` (an implementation) on any T: padded with no-op tokens (beta = g = 0, which change
  nothing: docs/chunked_form.md#padding) to its `time_multiple`, o cut back."""
  t_len = q.shape[1]
  multiple = run.time_multiple(chunk_size, mask.shape[-1])
  t_pad = -(-t_len // multiple) * multiple
  if t_pad == t_len:
    return run(q, k, v, g, beta, mask, initial_state, scale, chunk_size)
  pad = lambda x: jnp.pad(x, [(0, 0), (0, t_pad - t_len)] + [(0, 0)] * (x.ndim - 2))
  mask = mask if mask.shape[1] == 1 else pad(mask)
  arrays = (pad(q), pad(k), pad(v), pad(g), pad(beta), mask, initial_state)
  o, final = run(*arrays, scale, chunk_size)
  return o[:, :t_len], final
