"""The causal short convolution before the gated delta product layer's projections
(docs/layers.md)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from gdp_jax.layers import partitioning
from gdp_jax.layers.common import as_f32, f32, round_to, rounded


def _silu_of_sum(y, dtype):
  """SiLU of the convolution's float32 sum y, each rounded to `dtype` as a convolution and an
  activation of that dtype round their results (torch's, causal-conv1d's)."""
  return rounded(jax.nn.silu(round_to(y, dtype)), dtype)


class ShortConv(nnx.Module):
  """Causal depthwise convolution over time (kernel `size`) followed by SiLU.

  In x's dtype with float32 sums: the convolution's output is rounded to x's dtype, then SiLU's
  (docs/layers.md#rounding); the weight is cast to x's dtype first.

  Whole sequence: x [B, T, C] -> [B, T, C] (zeros before the first token); with segment_ids
  [B, T], inputs of other documents count as zeros too (no leak across packed documents).
  Step: `step(x_t [B, C], state [B, size-1, C])`, the state holding the previous inputs.
  """

  def __init__(self, channels: int, size: int = 4, *, param_dtype=f32, rngs: nnx.Rngs):
    self.size = size
    bound = 1.0 / math.sqrt(size)  # PyTorch Conv1d's default for a depthwise kernel
    # Not split (docs/sharding.md#annotated-parameters): the delta layers' channels are
    # q | k | v side by side, which no contiguous split of heads follows; it is small.
    self.weight = partitioning.param(
      jax.random.uniform(rngs.params(), (size, channels), param_dtype, -bound, bound),
      (None, None),
    )

  def __call__(self, x, segment_ids=None, weight=None):
    """x [B, T, C'] -> [B, T, C']; `weight` [size, C'] the kernel of x's channels when x holds
    some of them (e.g. q of the delta layers' q | k | v), default the whole kernel."""
    w = as_f32((self.weight[...] if weight is None else weight).astype(x.dtype))
    t_len = x.shape[1]
    xp = jnp.pad(as_f32(x), ((0, 0), (self.size - 1, 0), (0, 0)))
    if segment_ids is None:
      y = sum(xp[:, i : i + t_len] * w[i] for i in range(self.size))
    else:
      # tap i reads token t - (size - 1 - i): zero it unless that token is in t's document
      sp = jnp.pad(segment_ids, ((0, 0), (self.size - 1, 0)), constant_values=-1)
      y = sum(
        jnp.where((sp[:, i : i + t_len] == segment_ids)[..., None], xp[:, i : i + t_len], 0) * w[i]
        for i in range(self.size)
      )
    return _silu_of_sum(y, x.dtype)

  def state_after_packed(self, x, cu_seqlens):
    """The step state after each of the N documents packed in x [1, T, C] (cu_seqlens [N + 1],
    sanitised): [N, size-1, C], zeros before a document's first token."""
    idx = cu_seqlens[1:, None] - (self.size - 1) + jnp.arange(self.size - 1)[None, :]
    inside = idx >= cu_seqlens[:-1, None]  # [N, size-1]
    values = jnp.take(x[0], jnp.clip(idx, 0, x.shape[1] - 1), axis=0)  # [N, size-1, C]
    return jnp.where(inside[..., None], values, jnp.zeros((), x.dtype))

  def state_after(self, x, lengths):
    """The step state after `lengths[b]` tokens of x [B, T, C] (None: all T): [B, size-1, C]."""
    batch, t_len, _ = x.shape
    xp = jnp.pad(x, ((0, 0), (self.size - 1, 0), (0, 0)))
    if lengths is None:
      return xp[:, t_len:]
    idx = lengths[:, None] + jnp.arange(self.size - 1)[None, :]  # xp index of token l-(s-1)+i
    return jnp.take_along_axis(xp, idx[:, :, None], axis=1)

  def step(self, x, state):
    window = jnp.concatenate([state.astype(x.dtype), x[:, None]], axis=1)  # [B, size, C]
    y = jnp.sum(as_f32(window) * as_f32(self.weight[...].astype(x.dtype))[None], axis=1)
    return _silu_of_sum(y, x.dtype), window[:, 1:]

  def step_tokens(self, x, state, lengths=None):
    """Tq tokens per sequence after the step state: x [B, Tq, C], state [B, size-1, C] ->
    (y [B, Tq, C], the state after the Tq tokens, or after the first lengths[b] of them)."""
    t_len = x.shape[1]
    window = jnp.concatenate([state.astype(x.dtype), x], axis=1)  # [B, size-1+Tq, C]
    w, wf = as_f32(self.weight[...].astype(x.dtype)), as_f32(window)
    y = _silu_of_sum(sum(wf[:, i : i + t_len] * w[i] for i in range(self.size)), x.dtype)
    if lengths is None:
      return y, window[:, t_len:]
    idx = lengths[:, None] + jnp.arange(self.size - 1)[None, :]  # window index of the last inputs
    return y, jnp.take_along_axis(window, idx[:, :, None], axis=1)
