"""`gated_delta_product_step`: the public function (docs/inference.md): argument checks,
normalisation and its implementations in order of preference (gdp_jax/ops/registry.py): "triton"
(the Pallas kernel, interpreted on CPU), "xla" (jnp); None the Pallas backend on a supported GPU
for a state of at most `PALLAS_STEP_MAX_STATE` elements.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from gdp_jax.ops import registry
from gdp_jax.ops.heads import expand_key_heads
from gdp_jax.ops.step import partitioning
from gdp_jax.ops.step.triton import TritonStep
from gdp_jax.ops.step.xla import XlaStep
from gdp_jax.ops.validation import check_bool, check_step_inputs, static_scale
from pallas_kernels.common import tuning
from pallas_kernels.common.backend import resolve_precision

# implementation=None: the Pallas step up to this many state elements (B * HV * K * V), XLA's
# fused jnp step above, where it reads a large state faster (measured on an H200: the tuning
# table's "step_max_state", pallas_kernels/triton/tuning/h200.json, docs/inference.md).
PALLAS_STEP_MAX_STATE = tuning.value("step_max_state")
REGISTRY = registry.Registry("gated_delta_product_step", (TritonStep(), XlaStep()))


def gated_delta_product_step(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  g: jax.Array | None = None,
  beta: jax.Array | None = None,
  mask: jax.Array | None = None,
  state: jax.Array | None = None,
  *,
  scale: float | jax.Array | None = None,
  implementation: str | None = None,
  precision: str | None = None,
  in_place: bool = True,
) -> tuple[jax.Array, jax.Array]:
  """One token of the block-masked gated delta product for every sequence (docs/inference.md).

    S' = exp(g) S;  u_a = beta (v - sum_d M[a,d] k^(d)T S'^(d));  S_new^(a) = S'^(a) + k^(a) u_a^T;
    o = scale q^T S_new

  Args:
    q, k: [B, H, K]. v: [B, HV, V] with HV a multiple of H (grouped value heads: value head i
      reads key head i // (HV // H), as in `gated_delta_product`). One dtype for all three:
      float32, bfloat16 or float16.
    g: [B, HV] log-decay (<= 0), or None for no decay.
    beta: [B, HV] write strength (required; a keyword default only to keep the operator's order).
    mask: None (r = 1), [r, r], [HV, r, r] or [B, HV, r, r]; K % r == 0.
    state: [B, HV, K, V] (computed in float32), or None for zeros.
    scale: output scale, default K ** -0.5.
    implementation: "xla", "triton", "pallas" (the best Pallas backend) or None: the Pallas
      backend on a supported GPU for a state of at most `PALLAS_STEP_MAX_STATE` elements
      (B * HV * K * V), else "xla" (docs/inference.md).
    precision: accepted as in `gated_delta_product` (validated); one token has no matmul to
      speed up, so both implementations compute the step in full float32 whatever it says.
    in_place: the kernels only: write the new state into the state's buffer (no copy when the state
      is carried through a jitted loop or donated; otherwise XLA copies it first).

  Returns:
    (o [B, HV, V] in q.dtype, new_state [B, HV, K, V] float32).

  Derivatives: "xla" is plain jnp (JAX differentiates it); "pallas" raises NotImplementedError.

  Example:
    >>> import jax.numpy as jnp
    >>> from gdp_jax import gated_delta_product_step
    >>> q = k = jnp.ones((2, 3, 16)) / 4.0
    >>> v = jnp.ones((2, 3, 8))
    >>> o, state = gated_delta_product_step(q, k, v, beta=jnp.full((2, 3), 0.5))
    >>> o.shape, state.shape
    ((2, 3, 8), (2, 3, 16, 8))
  """
  in_place = check_bool("in_place", in_place)
  batch, heads, dim_k, dim_v, mask4, r = check_step_inputs(
    q, k, v, g, beta, mask, state, grouped=True
  )
  q, k, v, beta, mask4 = (jnp.asarray(x) for x in (q, k, v, beta, mask4))
  # grouped value heads: both implementations run on q and k repeated across each group
  q, k = (expand_key_heads(x, heads) for x in (q, k))
  g = None if g is None else jnp.asarray(g)
  if implementation is None and batch * heads * dim_k * dim_v > PALLAS_STEP_MAX_STATE:
    implementation = "xla"  # a large state: XLA's fused step reads it faster
  impl = REGISTRY.resolve(implementation)
  resolve_precision(precision)  # a clear error for a bad value
  if g is None:
    g = jnp.zeros((batch, heads), jnp.float32)
  if state is None:
    state = jnp.zeros((batch, heads, dim_k, dim_v), jnp.float32)
  state = jnp.asarray(state).astype(jnp.float32)
  static, dynamic = static_scale(scale, dim_k**-0.5)
  run = impl
  if impl.pallas:
    run = impl.replace(in_place=in_place)
    # Inputs sharded over batch and heads under jax.jit: the kernel runs per device
    # (docs/sharding.md#under-plain-jaxjit).
    run = partitioning.per_device(run)
  return run(q, k, v, g, beta, mask4, state, static if dynamic is None else dynamic)
