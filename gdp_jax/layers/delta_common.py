"""What the two delta layers and their skeleton (delta_mixer.py) share besides it: the types of
the operator callables a layer calls (docs/layers.md#operator-callables), the decode cache, the
configuration checks and the head-major column order of the fused projections
(docs/sharding.md#annotated-parameters)."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from gdp_jax.layers.common import _check_positive_int
from gdp_jax.ops.gated_delta_product.api import REGISTRY
from gdp_jax.ops.step.api import REGISTRY as STEP_REGISTRY
from gdp_jax.ops.validation import CHUNK_SIZES

# What a layer calls: the whole-sequence operator, (q, k, v, g, beta[, mask], *, initial_state,
# output_final_state[, cu_seqlens], ...) -> (o, final_state or None), and the one-token step,
# (q, k, v, g, beta[, mask], state, ...) -> (o, new_state) (docs/layers.md#operator-callables).
OperatorFn = Callable[..., tuple[jax.Array, jax.Array | None]]
StepFn = Callable[..., tuple[jax.Array, jax.Array]]


class GatedDeltaProductCache(NamedTuple):
  """Decode cache of one delta layer (`GatedDeltaProduct` or `HouseholderDeltaProduct`).

  conv: [B, conv_size - 1, channels] the last inputs of the short convolution (q | k | v
    channels: H*K + n*H*K + n*HV*V with n = 1 for the block mask, num_householder for
    DeltaProduct), or None without the convolution.
  state: [B, HV, K, V] float32 recurrent state (HV = num_v_heads).
  """

  conv: Any
  state: jax.Array


def check_operator_config(chunk_size, implementation):
  """A ValueError unless `chunk_size` and `implementation` are ones the operator accepts."""
  if chunk_size not in CHUNK_SIZES:
    raise ValueError(f"chunk_size must be one of {CHUNK_SIZES}, got {chunk_size!r}")
  if implementation is not None:
    REGISTRY.resolve(implementation)  # a clear error if unknown


def step_implementation(implementation):
  """The one-token step's implementation for a layer's `implementation` ("reference" and
  "mosaic_gpu" have no step of their own: "xla")."""
  if implementation in (None, *STEP_REGISTRY.accepted()):
    return implementation
  return "xla"


def check_sizes(hidden_size, num_heads, head_dim, num_v_heads):
  """Positive integer sizes, num_v_heads (None: num_heads) a multiple of num_heads; returns it."""
  _check_positive_int("hidden_size", hidden_size)
  _check_positive_int("num_heads", num_heads)
  _check_positive_int("head_dim", head_dim)
  num_v_heads = num_heads if num_v_heads is None else num_v_heads
  _check_positive_int("num_v_heads", num_v_heads)
  if num_v_heads % num_heads != 0:
    raise ValueError(
      f"num_v_heads = {num_v_heads} must be a multiple of num_heads = {num_heads} (value "
      f"head i reads query/key head i // (num_v_heads // num_heads))"
    )
  return num_v_heads


def takes_keyword(fn, name):
  """True if `fn` (a function or functools.partial) accepts the keyword argument `name`."""
  try:
    params = inspect.signature(fn).parameters
  except (TypeError, ValueError):  # no signature to read: let the call decide
    return True
  return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def head_major(a, writes, heads, width):
  """a [..., writes * heads * width] (columns [writes, heads, width], the parameters' order) as
  [..., heads * writes * width]: each head's `writes` slices side by side, so that a contiguous
  split of the columns is one of heads (docs/sharding.md#annotated-parameters). The identity for
  writes = 1."""
  lead = a.shape[:-1]
  if writes == 1:
    return a
  return a.reshape(lead + (writes, heads, width)).swapaxes(-3, -2).reshape(lead + (-1,))


def writes_first(a, writes, heads, width):
  """The inverse of `head_major`, unflattened: a [..., heads * writes * width] as
  [..., writes, heads, width] (a itself for writes = 1)."""
  lead = a.shape[:-1]
  if writes == 1:
    return a
  return a.reshape(lead + (heads, writes, width)).swapaxes(-3, -2)


def dot_as(x, kernel, proj):
  """x @ kernel in the dtype `proj` (a `Linear`) computes in, as `Linear` does."""
  dtype = x.dtype if proj.dtype is None else proj.dtype
  return jnp.dot(x.astype(dtype), kernel.astype(dtype), precision=proj.precision)


def name_of(fn):
  fn = getattr(fn, "func", fn)  # functools.partial
  return getattr(fn, "__name__", type(fn).__name__)
