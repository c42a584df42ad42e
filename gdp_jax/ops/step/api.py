"""`gated_delta_product_step`: the public function (docs/inference.md): argument checks,
normalisation and its implementations in order of preference (gdp_jax/ops/registry.py): "triton"
(the Pallas kernel, interpreted on CPU), "xla" (jnp); None the Pallas backend on a supported GPU
for a state of at most `PALLAS_STEP_MAX_STATE` elements.
"""

from __future__ import annotations

from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np

from gdp_jax.ops import registry
from gdp_jax.ops.heads import expand_key_heads
from gdp_jax.ops.step import partitioning
from gdp_jax.ops.step.triton import TritonStep
from gdp_jax.ops.step.verify import CompactStates, rebuild, verify_compact
from gdp_jax.ops.step.xla import XlaStep
from gdp_jax.ops.validation import (
  check_bool,
  check_inputs,
  check_shape,
  check_step_inputs,
  shape_of,
  static_scale,
)
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


# ---- several new tokens: the verify step of speculative decoding (docs/inference.md) ----------

# The most new tokens a verify call takes per sequence: it keeps the state after every token.
MAX_VERIFY_TOKENS = 16


def gated_delta_product_verify(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  g: jax.Array | None = None,
  beta: jax.Array | None = None,
  mask: jax.Array | None = None,
  initial_state: jax.Array | None = None,
  *,
  scale: float | jax.Array | None = None,
  implementation: str | None = None,
  precision: str | None = None,
  compact: bool = False,
) -> tuple[jax.Array, Any]:
  """Tq <= 16 new tokens per sequence after a state in one call, keeping the state after every
  token: the verify step of speculative decoding (docs/inference.md#verifying-draft-tokens).

  Token t computes `gated_delta_product_step` from the state after token t - 1 (the first from
  `initial_state`); `select_state(states, accepted_lengths, initial_state)` then picks the state
  to continue from.

  Args:
    q, k: [B, Tq, H, K]; v: [B, Tq, HV, V] (grouped value heads as `gated_delta_product`);
      g, beta: [B, Tq, HV]; mask: None, [r, r], [HV, r, r] or [B, Tq, HV, r, r];
      initial_state: [B, HV, K, V] or None (zeros). 1 <= Tq <= MAX_VERIFY_TOKENS.
    scale, implementation, precision: as `gated_delta_product_step` ("triton" runs its kernel
      once per token, "xla" the recurrence's step in one unrolled loop).
    compact: False keeps every token's state; True reads the state once and keeps a
      `CompactStates` record instead, Tq (K + r V + 2) numbers per head, from which
      `select_state` rebuilds any length's state with one more read of the state: "xla" (and
      None) runs the Tq tokens as one chunk of the chunked form, "triton" one by one in one
      kernel that writes no state (recurrent_verify.py).

  Returns:
    (o [B, Tq, HV, V] in q.dtype, states [B, Tq, HV, K, V] float32: the state after each token,
    B * Tq * HV * K * V * 4 bytes; or with compact=True the `CompactStates` record).

  Derivatives: as `gated_delta_product_step` ("xla" differentiable, "pallas" none).
  """
  batch, t_q, heads, dim_k, dim_v, mask5, _ = check_inputs(
    q, k, v, g, beta, mask, initial_state, grouped=True
  )
  if t_q > MAX_VERIFY_TOKENS:
    raise ValueError(
      f"q has Tq = {t_q} new tokens per sequence (shape {shape_of(q)}); the verify step takes "
      f"at most {MAX_VERIFY_TOKENS} (it keeps every token's state): use gated_delta_product "
      f"with state_every for longer spans"
    )
  q, k, v, beta, mask5 = (jnp.asarray(x) for x in (q, k, v, beta, mask5))
  q, k = (expand_key_heads(x, heads) for x in (q, k))
  compact = check_bool("compact", compact)
  if compact and implementation is None:
    implementation = "xla"
  if (
    not compact and implementation is None and batch * heads * dim_k * dim_v > PALLAS_STEP_MAX_STATE
  ):
    implementation = "xla"
  impl = REGISTRY.resolve(implementation)
  resolve_precision(precision)
  g = jnp.zeros((batch, t_q, heads), jnp.float32) if g is None else jnp.asarray(g)
  if initial_state is None:
    initial_state = jnp.zeros((batch, heads, dim_k, dim_v), jnp.float32)
  state = jnp.asarray(initial_state).astype(jnp.float32)
  static, dynamic = static_scale(scale, dim_k**-0.5)
  if compact:
    kernel = impl.name == "triton"
    return verify_compact(
      q, k, v, g, beta, mask5, state, static if dynamic is None else dynamic, kernel=kernel
    )
  verify = cast(Any, impl).verify  # XlaStep.verify, TritonStep.verify
  return verify(q, k, v, g, beta, mask5, state, static if dynamic is None else dynamic)


def select_state(
  states: jax.Array | CompactStates,
  accepted_lengths: jax.Array,
  initial_state: jax.Array | None = None,
) -> jax.Array:
  """The state after the first `accepted_lengths[b]` tokens of a verify call, per sequence:
  the rollback of speculative decoding (docs/inference.md#verifying-draft-tokens).

  states: [B, Tq, HV, K, V] from `gated_delta_product_verify`, or its `CompactStates` record
  (compact=True; it holds the initial state: lengths in [0, Tq]); accepted_lengths: [B] int,
  may be traced, in [1, Tq], or [0, Tq] with initial_state [B, HV, K, V] (the verify's, the
  state for a length of 0). Concrete lengths out of range are a ValueError; traced ones are
  clipped. Returns [B, HV, K, V] float32.
  """
  if isinstance(states, CompactStates):
    batch, t_q = states.initial_state.shape[0], states.gamma.shape[-1]
    lengths = _check_lengths(accepted_lengths, batch, t_q, 0)
    return rebuild(states, lengths)
  states = jnp.asarray(states)
  if states.ndim != 5:
    raise ValueError(
      f"states must be [B, Tq, HV, K, V] (gated_delta_product_verify's), got shape "
      f"{shape_of(states)}"
    )
  batch, t_q = states.shape[:2]
  low = 0 if initial_state is not None else 1
  if initial_state is not None:
    check_shape("initial_state", initial_state, (batch,) + states.shape[2:], "[B, HV, K, V]")
  lengths = _check_lengths(accepted_lengths, batch, t_q, low)
  index = jnp.maximum(lengths - 1, 0)[:, None, None, None, None]
  picked = jnp.take_along_axis(states, index, axis=1)[:, 0]
  if initial_state is None:
    return picked
  before = jnp.asarray(initial_state).astype(picked.dtype)
  return jnp.where((lengths == 0)[:, None, None, None], before, picked)


def _check_lengths(accepted_lengths, batch, t_q, low):
  """accepted_lengths as int32 [B] in [low, Tq]: concrete ones checked, traced ones clipped."""
  lengths = jnp.asarray(accepted_lengths)
  if lengths.shape != (batch,) or not jnp.issubdtype(lengths.dtype, jnp.integer):
    raise ValueError(
      f"accepted_lengths must be an int array [B] = [{batch}], got {lengths.dtype} "
      f"{shape_of(lengths)}"
    )
  if not isinstance(lengths, jax.core.Tracer):
    bad = [int(n) for n in np.asarray(lengths) if not low <= n <= t_q]
    if bad:
      raise ValueError(
        f"accepted_lengths must lie in [{low}, {t_q}] (Tq = {t_q}"
        + ("; 0 needs initial_state" if low else "")
        + f"), got {bad[0]}"
      )
  return jnp.clip(lengths.astype(jnp.int32), low, t_q)
