"""What the layers share: the mode names, the packed-document reset, l2norm, input checks,
the Linear projection, the gated RMSNorm and the rounding helpers of bf16 activations
(docs/layers.md#rounding)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gdp_jax.layers import partitioning
from gdp_jax.layers.partitioning import EMBED

# The log-decay g given to the operator at a document's first token (packed documents, see
# `DeltaMixer.__call__` and docs/train_lm.md): the operator's reset value.
from gdp_jax.ops.gated_delta_product.base import RESET_LOG_DECAY  # noqa: F401

MASK_MODES = ("static", "token", "ones")  # of the block-masked GatedDeltaProduct
KEY_NORMS = ("block", "full")
ATTENTION_IMPLS = ("xla", "flash")
f32 = jnp.float32


class ValuePartial(functools.partial):
  """`functools.partial` that compares by value (its function and arguments) where they are
  hashable: a layer keeps its operator in the static part of its graph definition, so that two
  layers (models) of one configuration have equal graph definitions and a jitted step traces
  and compiles once for both, not once per model."""

  def _key(self):
    return (self.func, self.args, tuple(sorted(self.keywords.items())))

  def __eq__(self, other):
    if not isinstance(other, ValuePartial):
      return NotImplemented
    try:
      return hash(self) == hash(other) and self._key() == other._key()
    except TypeError:  # an unhashable argument: identity, as a plain partial
      return self is other

  def __hash__(self):
    try:
      return hash(self._key())
    except TypeError:
      return id(self)


def round_to(x, dtype):
  """x (float32) rounded to the precision of `dtype` (e.g. bfloat16), still float32; x itself
  when `dtype` is float32. An explicit rounding XLA keeps: a float32 -> bf16 -> float32 pair of
  casts it may drop (excess precision), handing the float32 value on unrounded."""
  info = jnp.finfo(dtype)
  if info.bits >= 32:
    return x
  return jax.lax.reduce_precision(x, exponent_bits=info.nexp, mantissa_bits=info.nmant)


def rounded(x, dtype):
  """x (float32) rounded to `dtype` and cast to it: what a framework that rounds every op's
  result to its dtype (torch) holds, also where XLA would keep the float32 value."""
  return round_to(x, dtype).astype(dtype)


def as_f32(x):
  """x as float32 holding exactly x's values: where x (bf16) was computed in float32, XLA may
  otherwise hand a float32 consumer the unrounded value (a cast pair dropped)."""
  return round_to(x.astype(f32), x.dtype)


def l2norm(x, axis=-1, eps=1e-6):
  """x / sqrt(sum x^2 + eps) along `axis`, computed in float32 (as flash-linear-attention)."""
  x = as_f32(x)
  return x * jax.lax.rsqrt(jnp.sum(x * x, axis=axis, keepdims=True) + eps)


def _check_positive_int(name, value):
  if isinstance(value, bool) or not isinstance(value, int) or value < 1:
    raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _check_choice(name, value, choices):
  if value not in choices:
    raise ValueError(f"{name} must be one of {choices}, got {value!r}")


def _check_lengths(lengths, batch, t_len):
  """[B] int32 lengths in [0, T]: concrete values outside are a ValueError, traced ones are
  clipped to [0, T] (as `gqa_decode` treats lengths beyond its cache)."""
  if lengths is None:
    return None
  if not isinstance(lengths, jax.core.Tracer):
    lengths = np.asarray(lengths)  # before JAX's int32 conversion could wrap
  if not jnp.issubdtype(lengths.dtype, jnp.integer):
    raise TypeError(f"lengths must be integers (int32), got dtype {lengths.dtype}")
  if lengths.shape != (batch,):
    raise ValueError(
      f"lengths has shape {lengths.shape}, expected [B] = [{batch}] "
      f"(one length per sequence, each in [0, T = {t_len}])"
    )
  if (
    isinstance(lengths, np.ndarray)
    and lengths.size
    and (lengths.min() < 0 or lengths.max() > t_len)
  ):
    raise ValueError(
      f"lengths must lie in [0, T = {t_len}] (tokens of each sequence), got {lengths.tolist()}"
    )
  return jnp.clip(jnp.asarray(lengths), 0, t_len).astype(jnp.int32)


def _check_segment_ids(segment_ids, batch, t_len):
  if segment_ids is None:
    return None
  segment_ids = jnp.asarray(segment_ids)
  if not jnp.issubdtype(segment_ids.dtype, jnp.integer):
    raise TypeError(f"segment_ids must be integers (int32), got dtype {segment_ids.dtype}")
  if segment_ids.shape != (batch, t_len):
    raise ValueError(
      f"segment_ids has shape {segment_ids.shape}, expected [B, T] = "
      f"[{batch}, {t_len}] (one document id per token)"
    )
  return segment_ids.astype(jnp.int32)


def segment_starts(segment_ids):
  """[B, T] bool: True at each document's first token, i.e. at t = 0 and wherever
  segment_ids[b, t] != segment_ids[b, t - 1]. A document is a run of equal ids (ids may repeat
  further on: only changes between neighbours count)."""
  first = jnp.ones(segment_ids.shape[:1] + (1,), bool)
  return jnp.concatenate([first, segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)


def _check_cache(cache, kind, fields):
  """A clear error unless `cache` is a `kind` whose arrays have the shapes in `fields`
  ({name: (expected shape or None, what)})."""
  name = kind.__name__
  if cache is None:
    raise TypeError(
      f"cache is None; start from layer.init_cache(...) or the cache a prefill "
      f"returned (return_cache=True): a {name}"
    )
  if not isinstance(cache, kind):
    raise TypeError(
      f"cache must be a {name} (from this layer's init_cache or a prefill with "
      f"return_cache=True), got {type(cache).__name__}"
    )
  for field, (shape, what) in fields.items():
    got = getattr(cache, field)
    got_shape = None if got is None else tuple(np.shape(got))
    if got_shape != shape:
      raise ValueError(
        f"cache.{field} has shape {got_shape}, expected {shape} ({what}): a "
        f"cache of another layer or batch size?"
      )


def _check_x(x, hidden_size, rank, what):
  if not hasattr(x, "ndim") or not hasattr(x, "dtype"):
    raise TypeError(f"x must be an array {what} (a jax or NumPy array), got {type(x).__name__}")
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(
      f"x must be floating-point activations {what} (e.g. float32 or bfloat16), got dtype "
      f"{x.dtype}; token ids go through an embedding first (HybridLM does this)"
    )
  if x.ndim != rank or x.shape[-1] != hidden_size:
    raise ValueError(
      f"x has shape {tuple(x.shape)}, expected {what} with D = hidden_size = {hidden_size}"
    )


class Linear(nnx.Linear):
  """`nnx.Linear` whose `dtype=None` means the input's dtype (nnx.Linear would promote bf16 inputs
  against float32 parameters to float32): bf16 activations keep bf16 projections (and so the
  operator's bf16 kernels) while the parameters stay float32 (cast at use; their gradients too)."""

  def __call__(self, inputs):
    if self.dtype is not None or not jnp.issubdtype(inputs.dtype, jnp.floating):
      return super().__call__(inputs)
    dtype = inputs.dtype
    y = jnp.dot(inputs, self.kernel[...].astype(dtype), precision=self.precision)
    if self.bias is not None:
      y = y + self.bias[...].astype(dtype)
    return y


class GatedRMSNorm(nnx.Module):
  """RMSNorm over the last axis, times a learned weight, optionally times silu(gate)
  (Gated DeltaNet's output norm). Computed in float32; returns `dtype` or x.dtype."""

  def __init__(
    self, num_features: int, *, eps: float = 1e-5, param_dtype=f32, axis_name: str | None = EMBED
  ):
    self.eps = eps
    # axis_name: the weight's logical axis (docs/sharding.md#annotated-parameters): "embed" for
    # the model width, None for a per-head norm's head dimension
    self.weight = partitioning.param(jnp.ones((num_features,), param_dtype), (axis_name,))

  def __call__(self, x, gate=None):
    y = as_f32(x)
    y = y * jax.lax.rsqrt(jnp.mean(y * y, axis=-1, keepdims=True) + self.eps)
    y = y * self.weight[...].astype(f32)
    if gate is not None:
      y = y * jax.nn.silu(as_f32(gate))
    return rounded(y, x.dtype)


def _check_room(lengths, num_new, capacity, what):
  """A ValueError unless `num_new` more tokens fit after concrete `lengths` [B] within
  `capacity` positions (traced lengths: only num_new <= capacity is checked)."""
  if num_new > capacity:
    raise ValueError(f"x has Tq = {num_new} new tokens but {what} hold only {capacity} positions")
  if isinstance(lengths, jax.core.Tracer):
    return
  values = np.asarray(lengths)
  full = np.flatnonzero(values.astype(np.int64) + num_new > capacity)
  if full.size:
    b = int(full[0])
    raise ValueError(
      f"cache too small: sequence {b} holds {int(values[b])} tokens, and Tq = {num_new} more "
      f"need {int(values[b]) + num_new} positions, but {what} hold only {capacity}"
    )
