"""What every implementation of `gated_delta_product` takes and returns, and the reset constant.

An implementation is called with the normalised inputs of gdp_jax/ops/gated_delta_product/api.py
(docs/implementations.md#registering-an-implementation): q, k [B, Tp, H, K]; v [B, Tp, HV, V];
g, beta [B, Tp, HV]; the mask [Bm, Tm, Hm, r, r]; a float32 initial state [B, HV, K, V]; the scale
(a Python float or a scalar float32 array) and the chunk size. Tp is T padded to a multiple of
the chunk with no-op tokens when `pads_time`. It returns (o [B, Tp, HV, V], final [B, HV, K, V]
float32). `varlen` is the packed form (cu_seqlens, docs/varlen.md): B = 1, T not padded, an
initial state per sequence.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from gdp_jax.ops.base import Implementation

# A log-decay at or below this is a reset of the state (docs/chunked_form.md#resets): exp(-112) is
# below the smallest float32 subnormal (1.4e-45, reached from g < -103.3), so it is exactly 0
# whether or not the hardware flushes subnormals to zero (at -88, exp(g) is a subnormal that only
# a flush makes 0). The jnp chunked form treats g <= RESET_LOG_DECAY as an exact reset, the
# kernels clamp g at it (g = -inf would make -inf - (-inf) = nan), and the layers write it at a
# document start. g = -inf is the exact reset.
RESET_LOG_DECAY = -112.0


@dataclasses.dataclass(frozen=True)
class GatedDeltaProductImplementation(Implementation):
  """The operator's implementations (the module docstring says what they take).

  pads_time: whether the caller pads T to a multiple of the chunk (the chunked forms) or not
  (the recurrence, which ignores the chunk size).
  """

  pads_time: ClassVar[bool] = True

  def __call__(self, q, k, v, g, beta, mask, initial_state, scale, chunk_size):
    raise NotImplementedError

  def varlen(self, q, k, v, g, beta, mask, initial_state, scale, chunk_size, cu_seqlens):
    raise NotImplementedError
