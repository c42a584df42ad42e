"""Qwen3.5's Gated DeltaNet block: `GatedDeltaProduct` rounding where transformers' model rounds
to its compute dtype (docs/qwen3_5.md#bf16).

In a bf16 model transformers computes beta = sigmoid(b) in bf16, runs its recurrent core in
float32 on float32 L2-normalised q and k (the core's output rounded to bf16), and its gated
RMSNorm rounds twice before the gate: the normalised x, then times the weight. `GatedDeltaNet`
does the same; where the operator computes in bf16 (the Pallas kernels) q, k and v go to it in
bf16, as the kernels take them. In float32 every rounding is the identity: the layer is
`GatedDeltaProduct` itself.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from gdp_jax.layers import GatedDeltaProduct
from gdp_jax.layers.common import GatedRMSNorm, as_f32, f32, round_to, rounded
from gdp_jax.ops.gated_delta_product.api import REGISTRY

FLOAT32_CORES = ("xla", "reference")  # implementations that compute in float32 inside


class TransformersGatedRMSNorm(GatedRMSNorm):
  """transformers' Qwen3_5RMSNormGated: x / rms(x) in float32 rounded to x's dtype, times the
  weight rounded again, times silu(gate) in float32, rounded."""

  def __call__(self, x, gate=None):
    dtype = x.dtype
    y = as_f32(x)
    y = round_to(y * jax.lax.rsqrt(jnp.mean(y * y, axis=-1, keepdims=True) + self.eps), dtype)
    y = round_to(y * self.weight[...].astype(f32), dtype)
    if gate is not None:
      y = y * jax.nn.silu(as_f32(gate))
    return rounded(y, dtype)


class GatedDeltaNet(GatedDeltaProduct):
  """`GatedDeltaProduct(mask_mode="ones", key_norm="full", num_blocks=1, ...)` (the arguments
  are its) with transformers' rounding: beta rounded to the activations' dtype, the gated
  RMSNorm above, and q, k, v handed to an operator that computes in float32 ("xla",
  "reference", or None where it resolves to one) in float32, its output rounded back."""

  def __init__(self, *args, **kwargs) -> None:
    super().__init__(*args, **kwargs)
    self.o_norm = TransformersGatedRMSNorm(
      self.value_dim,
      eps=self.o_norm.eps,
      param_dtype=kwargs.get("param_dtype", f32),
      axis_name=None,
    )
    implementation = kwargs.get("implementation")
    self.float32_core = REGISTRY.resolve(implementation).name in FLOAT32_CORES

  def _gates(self, x):
    g, beta = super()._gates(x)
    return g, round_to(beta, x.dtype)

  def _shape_qkv(self, q, k, v):
    if not self.float32_core:
      return super()._shape_qkv(q, k, v)
    v = as_f32(v).reshape(q.shape[:-1] + (self.num_v_heads, self.value_dim))
    return self._qk_norm(q), self._qk_norm(k), v

  def _mix(self, x, *args, **kwargs):
    o, *rest = super()._mix(x, *args, **kwargs)
    return (rounded(o.astype(f32), x.dtype), *rest)

  def _mix_step(self, x, *args):
    o, state = super()._mix_step(x, *args)
    return rounded(o.astype(f32), x.dtype), state
