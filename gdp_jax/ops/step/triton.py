"""`implementation="triton"` of the recurrent step: the Pallas kernel
(pallas_kernels/triton/inference/recurrent_step.py), no derivatives
(docs/inference.md#the-recurrent-step)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from gdp_jax.ops.autodiff import no_gradients_message, raise_if_differentiated
from gdp_jax.ops.base import Implementation
from pallas_kernels.triton.inference import recurrent_step as _kernel


def gated_delta_product_step_triton(q, k, v, g, beta, mask, state, scale, *, in_place=True):
  """The Pallas kernel (pallas_kernels/triton/inference/recurrent_step.py); scale a float or
  array."""
  message = no_gradients_message("gated_delta_product_step")
  if not isinstance(scale, jax.Array):
    kernel = raise_if_differentiated(
      lambda *a: _kernel.recurrent_step(*a, scale=scale, in_place=in_place), message
    )
    return kernel(q, k, v, g, beta, mask, state)
  kernel = raise_if_differentiated(
    lambda *a: _kernel.recurrent_step(*a, scale=1.0, out_dtype=jnp.float32, in_place=in_place),
    message,
  )
  o, new = kernel(q, k, v, g, beta, mask, state)
  return (o * scale).astype(q.dtype), new


@dataclasses.dataclass(frozen=True)
class TritonStep(Implementation):
  """As `XlaStep` (gdp_jax/ops/step/xla.py). in_place: write the new state into the state's
  buffer (no copy when the state is carried through a jitted loop or donated)."""

  name: ClassVar[str] = "triton"
  summary: ClassVar[str] = "Pallas GPU kernels through the Triton lowering (interpreted off a GPU)"
  platforms: ClassVar[tuple[str, ...]] = ("gpu",)
  pallas: ClassVar[bool] = True

  in_place: bool = True

  def __call__(self, q, k, v, g, beta, mask, state, scale):
    return gated_delta_product_step_triton(
      q, k, v, g, beta, mask, state, scale, in_place=self.in_place
    )

  def verify(self, q, k, v, g, beta, mask, state, scale):
    """Tq tokens (q [B, Tq, HV, K], mask [Bm, Tm, Hm, r, r]): the kernel once per token, each
    state kept (a new buffer each: not in place) -> (o [B, Tq, HV, V], states [B, Tq, HV, K, V])."""
    outs, states = [], []
    for t in range(q.shape[1]):
      token = (x[:, t] for x in (q, k, v, g, beta))
      m = mask[:, t if mask.shape[1] > 1 else 0]
      o, state = gated_delta_product_step_triton(*token, m, state, scale, in_place=False)
      outs.append(o)
      states.append(state)
    return jnp.stack(outs, axis=1), jnp.stack(states, axis=1)
