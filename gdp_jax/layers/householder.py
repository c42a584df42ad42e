"""The DeltaProduct token mixer `HouseholderDeltaProduct`: n_h Householder delta steps per token
(docs/layers.md). Its skeleton (projections, short convolution, gates, output norm, cache) is
delta_mixer.py's, shared with the block-masked `GatedDeltaProduct`."""

from __future__ import annotations

from flax import nnx
from jax.typing import DTypeLike

from gdp_jax.layers.common import ValuePartial, _check_positive_int, f32, l2norm
from gdp_jax.layers.delta_common import (
  OperatorFn,
  StepFn,
  check_operator_config,
  check_sizes,
  step_implementation,
)
from gdp_jax.layers.delta_mixer import DeltaMixer
from gdp_jax.ops.householder.api import householder_delta_product, householder_delta_product_step

__all__ = ["HouseholderDeltaProduct"]


class HouseholderDeltaProduct(DeltaMixer):
  """DeltaProduct (Siems et al. 2025; flash-linear-attention's `GatedDeltaProduct` layer), built
  like Gated DeltaNet (docs/layers.md).

  Each token writes `num_householder` = n_h rank-1 delta steps in order, each with its own key
  (from its own slice of k_proj, L2-normalised over the whole head), value and beta (sigmoid,
  times 2 with `allow_neg_eigval`: each step's eigenvalue 1 - beta in (-1, 1)); the decay
  g = -exp(A_log) * softplus(a_proj(x) + dt_bias) once per token before its first step, the
  output (q L2-normalised over the head) after its last (`householder_delta_product`: the r = 1
  operator over T * n_h sub-steps). A product of n_h >= 2 reflections can rotate the state,
  which the block mask's symmetric transition cannot. The output is RMS-normalised per head
  (times silu(g_proj(x)) with `use_gate`) and projected back to D. Same calls as
  `GatedDeltaProduct` (`__call__` with lengths, segment_ids or cu_seqlens, `step`,
  `step_tokens`, `init_cache`) and the same `GatedDeltaProductCache`.

  The operator is a callable the layer is given (docs/layers.md#operator-callables):
  `operator_fn(q, k, v, g, beta, *, num_householder, initial_state, output_final_state)` over
  the sub-steps (k, v [B, T * n_h, H, *], beta [B, T * n_h, H]; with `cu_seqlens=` for packed
  documents) and `step_fn(q, k, v, g, beta, state, *, num_householder)` for one token (k, v
  [B, n_h, H, *], beta [B, n_h, H]). By default `householder_delta_product` and
  `householder_delta_product_step` with `chunk_size` and `implementation` applied
  (functools.partial). It has no `sharding=` (shard_map) form yet; under plain `jax.jit` its
  annotated parameters shard it over heads (docs/sharding.md#annotated-parameters).

  Args:
    hidden_size: D, the model width.
    num_heads: H, the heads (query, key and value).
    head_dim: K, the key dimension per head.
    num_householder: n_h >= 1, the delta steps per token.
    expand_v: value dim V = head_dim * expand_v (a whole number).
    use_short_conv, conv_size: causal depthwise convolution + SiLU on q, k, v (else SiLU only).
    use_gate: output gate silu(g_proj(x)) in the RMSNorm (else a plain RMSNorm).
    allow_neg_eigval: beta = 2 sigmoid(.) in (0, 2) instead of (0, 1): eigenvalues down to -1.
    norm_eps: RMSNorm epsilon.
    chunk_size, implementation: applied to the default operator and step (None: the Pallas
      kernels on a GPU, "xla" elsewhere; with cu_seqlens too).
    operator_fn, step_fn: the operator and the step (default: built from the arguments above).
    dtype: computation dtype of projections, q, k, v (None: x's dtype); param_dtype: parameters.
    rngs: `nnx.Rngs`.
  """

  def __init__(
    self,
    hidden_size: int,
    num_heads: int,
    head_dim: int,
    *,
    num_householder: int = 2,
    expand_v: float = 1,
    use_short_conv: bool = True,
    conv_size: int = 4,
    use_gate: bool = True,
    allow_neg_eigval: bool = False,
    norm_eps: float = 1e-5,
    chunk_size: int = 64,
    implementation: str | None = None,
    dtype: DTypeLike | None = None,
    param_dtype: DTypeLike = f32,
    operator_fn: OperatorFn | None = None,
    step_fn: StepFn | None = None,
    rngs: nnx.Rngs,
  ) -> None:
    check_sizes(hidden_size, num_heads, head_dim, None)
    _check_positive_int("num_householder", num_householder)
    check_operator_config(chunk_size, implementation)
    if operator_fn is None:
      operator_fn = ValuePartial(
        householder_delta_product, chunk_size=chunk_size, implementation=implementation
      )
    if step_fn is None:
      step_fn = ValuePartial(
        householder_delta_product_step, implementation=step_implementation(implementation)
      )
    self.num_householder = num_householder
    super().__init__(
      hidden_size,
      num_heads,
      head_dim,
      num_v_heads=None,
      writes=num_householder,
      expand_v=expand_v,
      use_short_conv=use_short_conv,
      conv_size=conv_size,
      use_gate=use_gate,
      allow_neg_eigval=allow_neg_eigval,
      norm_eps=norm_eps,
      operator_fn=operator_fn,
      step_fn=step_fn,
      dtype=dtype,
      param_dtype=param_dtype,
      rngs=rngs,
    )

  def _shape_qkv(self, q, k, v):
    """q [..., H, K], k [..., n_h, H, K] (each L2-normalised over the head) and
    v [..., n_h, H, V], from q [..., H * K] and k, v flat ([..., n_h * H * K]) or already
    [..., n_h, H, *] (under a mesh, `_convolved_qkv`)."""
    H, K, V, n = self.num_heads, self.head_dim, self.value_dim, self.num_householder
    lead = q.shape[:-1]
    q = l2norm(q.reshape(lead + (H, K))).astype(q.dtype)
    k = l2norm(k.reshape(lead + (n, H, K))).astype(k.dtype)
    return q, k, v.reshape(lead + (n, H, V))

  def _gates(self, x):
    """g [..., H] and beta [..., n_h, H]."""
    g, beta = super()._gates(x)
    return g, beta.reshape(g.shape[:-1] + (self.num_householder, self.num_heads))

  def _mix(self, x, q, k, v, g, beta, *, initial_state, output_final_state, cu_seqlens):
    batch, t_len, n = q.shape[0], q.shape[1], self.num_householder
    sub = lambda a: a.reshape((batch, t_len * n) + a.shape[3:])  # [B, T*n_h, ...]
    packed = {} if cu_seqlens is None else {"cu_seqlens": cu_seqlens}
    return self.operator_fn(
      q,
      sub(k),
      sub(v),
      g,
      sub(beta),
      num_householder=n,
      initial_state=initial_state,
      output_final_state=output_final_state,
      **packed,
    )

  def _mix_step(self, x, q, k, v, g, beta, state):
    return self.step_fn(q, k, v, g, beta, state, num_householder=self.num_householder)
