"""The block-masked gated delta product token mixer `GatedDeltaProduct` (static, per-token and
ones masks; docs/layers.md). Its skeleton (projections, short convolution, gates, output norm,
cache) is delta_mixer.py's, shared with `HouseholderDeltaProduct`."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import DTypeLike

from gdp_jax.layers import partitioning
from gdp_jax.layers.common import (
  KEY_NORMS,
  MASK_MODES,
  Linear,
  ValuePartial,
  _check_choice,
  _check_positive_int,
  f32,
  l2norm,
)
from gdp_jax.layers.delta_common import (
  GatedDeltaProductCache,
  OperatorFn,
  StepFn,
  check_operator_config,
  check_sizes,
  step_implementation,
)
from gdp_jax.layers.delta_mixer import DeltaMixer
from gdp_jax.layers.masks import block_mask
from gdp_jax.layers.partitioning import EMBED, HEADS
from gdp_jax.ops.gated_delta_product.api import gated_delta_product
from gdp_jax.ops.step.api import gated_delta_product_step
from gdp_jax.sharding import (
  ShardingConfig,
  sharded_gated_delta_product,
  sharded_gated_delta_product_step,
)

__all__ = ["GatedDeltaProduct", "GatedDeltaProductCache"]


class GatedDeltaProduct(DeltaMixer):
  """Block-masked gated delta product token mixer (docs/operator.md, docs/layers.md), built like
  Gated DeltaNet.

  Per head: q, k = L2-normalised projections of x (after an optional causal short convolution
  + SiLU), v = projection (value dim V = head_dim * expand_v), beta = sigmoid(b_proj(x)) (times 2
  with `allow_neg_eigval`), g = -exp(A_log) * softplus(a_proj(x) + dt_bias), and the r x r block
  mask M = l2norm(|W|) l2norm(|W|)^T (rows of |W| normalised: symmetric, PSD, diagonal 1,
  entries in [0, 1]) with W a parameter [H, r, r] ("static") or a projection of x to H*r*r
  ("token": one mask per token). The operator's output is RMS-normalised per head (times
  silu(g_proj(x)) with `use_gate`, Gated DeltaNet's gated RMSNorm) and projected back to D.

  Inside the operator's value contract by construction (docs/operator.md), for any x and any
  parameters: g = -exp(.) * softplus(.) <= 0 (RESET_LOG_DECAY = -112 at a packed document's
  first token, 0 at padding); beta = sigmoid(.) in [0, 1], or 2 sigmoid(.) in [0, 2] with
  `allow_neg_eigval` (0 at padding), and beta / rho(M) <= beta after `beta_norm` (rho(M) >= 1:
  M's diagonal is 1 and its entries are >= 0). x must be floating-point activations [B, T, D]
  (`_check_x`: integer x, e.g. token ids, is a TypeError naming its dtype).

  Normalisation (`key_norm="block"`, the default). q and k are L2-normalised per key block of
  dk = K / r, so each block is a unit key, and the write strength given to the operator is
  beta / rho(M) with rho(M) = max_a sum_b M[a, b] (>= the largest eigenvalue of M; `beta_norm`).
  Then the per-token transition I - beta/rho * Kb M Kb^T (Kb = block-diagonal of the unit key
  blocks) has eigenvalues 1 - beta * lambda_i(M) / rho(M), all in [1 - beta, 1]: the same range
  as Gated DeltaNet for any r and any mask, so `allow_neg_eigval` gives [-1, 1], never beyond,
  and the chunk matrices (I + A) stay well conditioned. The two ends of the mask are the known
  models: M = I (rho = 1) is r independent Gated DeltaNets on disjoint key blocks that share
  the value (a rank-r update per token, like DeltaProduct's r Householder steps, but all reading
  the same state); M = ones (rho = r) is exactly one Gated DeltaNet with the unit key k / sqrt(r).
  Without `beta_norm` the eigenvalues reach 1 - beta * r at M = ones (unstable for
  beta * r > 2).
  `key_norm="full"` normalises q and k over the whole K instead (Gated DeltaNet's own
  convention; beta is left as is since the eigenvalues are already in [1 - beta, 1]): the r
  blocks then share one unit of write strength, so M = I is a weaker memory than above.

  `mask_mode="ones"` is the gated delta rule itself (Gated DeltaNet): the operator runs with
  r = 1 and the unit keys above (k / sqrt(r) after the per-block normalisation, or the full
  normalisation), which is exactly what "static"/"token" compute at M = ones. It has no mask
  parameters; use it as the baseline of the same size.

  DeltaProduct (n_h Householder steps per token) is its own layer, `HouseholderDeltaProduct`
  (gdp_jax/layers/householder.py).

  The operator is a callable the layer is given, as flax's `MultiHeadAttention` takes
  `attention_fn` (docs/layers.md#operator-callables): `operator_fn(q, k, v, g, beta, mask, *,
  initial_state, output_final_state)` for the whole sequence (with `cu_seqlens=` for packed
  documents) and `step_fn(q, k, v, g, beta, mask, state)` for one token. By default they are
  `gdp_jax.gated_delta_product` and `gdp_jax.gated_delta_product_step` with `chunk_size` and
  `implementation` applied (functools.partial); `sharding=` is a convenience for the sharded
  pair, `sharded_gated_delta_product` / `sharded_gated_delta_product_step` with that config.

  Args:
    hidden_size: D, the model width.
    num_heads: H, the query/key heads.
    head_dim: K, the key dimension per head; K % num_blocks == 0.
    num_v_heads: HV, the value heads (default H): a multiple of H, value head i reading
      query/key head i // (HV // H) (grouped value heads, as Qwen3-Next and Kimi Linear). g,
      beta, the mask, the state and the output have HV heads. Not with `sharding` yet.
    expand_v: value dim V = head_dim * expand_v (a whole number).
    num_blocks: r, the number of key blocks (the mask is r x r).
    mask_mode: "static" | "token" | "ones" (see above).
    key_norm: "block" | "full" (see above).
    beta_norm: divide beta by rho(M) ("block" normalisation only; see above).
    use_short_conv, conv_size: causal depthwise convolution + SiLU on q, k, v (else SiLU only).
    use_gate: output gate silu(g_proj(x)) in the RMSNorm (else a plain RMSNorm).
    allow_neg_eigval: beta = 2 sigmoid(.) in (0, 2) instead of (0, 1): eigenvalues down to -1,
      what state tracking needs (Grazzi et al. 2024).
    norm_eps: RMSNorm epsilon.
    chunk_size, implementation: applied to the default operator and step (`implementation`
      None: the Pallas kernels on a GPU, the jnp forms elsewhere; the step runs "xla" where
      the implementation has no step, e.g. "reference").
    sharding: a `gdp_jax.sharding.ShardingConfig`: the operator and step become
      `functools.partial(sharded_gated_delta_product, sharding=sharding, chunk_size=...,
      implementation=...)` and `functools.partial(sharded_gated_delta_product_step,
      sharding=sharding, implementation=...)`, split over the mesh (batch, heads and sequence;
      the step over batch and heads); None (default): one device. The projections around them
      are ordinary jnp code that XLA partitions from the layouts. Not with `cu_seqlens` (use
      `segment_ids`), nor with `operator_fn` / `step_fn`.
    operator_fn: the whole-sequence operator (default: built from the arguments above), e.g.
      `functools.partial(gdp_jax.gated_delta_product, chunk_size=32, implementation="xla",
      precision="highest")`. Must accept `cu_seqlens=` for packed calls.
    step_fn: the one-token step (default: built from the arguments above), e.g.
      `functools.partial(gdp_jax.gated_delta_product_step, implementation="xla")`.
    dtype: computation dtype of projections, q, k, v (None: x's dtype, so bf16 activations run
      bf16 projections and the operator's bf16 kernels, the fast path on a GPU, while float32
      parameters stay float32); param_dtype: parameters.
    rngs: `nnx.Rngs`.
  """

  def __init__(
    self,
    hidden_size: int,
    num_heads: int,
    head_dim: int,
    *,
    expand_v: float = 1,
    num_blocks: int = 2,
    mask_mode: str = "static",
    key_norm: str = "block",
    use_short_conv: bool = True,
    conv_size: int = 4,
    use_gate: bool = True,
    allow_neg_eigval: bool = False,
    beta_norm: bool = True,
    norm_eps: float = 1e-5,
    chunk_size: int = 64,
    implementation: str | None = None,
    dtype: DTypeLike | None = None,
    param_dtype: DTypeLike = f32,
    sharding: ShardingConfig | None = None,
    num_v_heads: int | None = None,
    operator_fn: OperatorFn | None = None,
    step_fn: StepFn | None = None,
    rngs: nnx.Rngs,
  ) -> None:
    num_v_heads = check_sizes(hidden_size, num_heads, head_dim, num_v_heads)
    _check_positive_int("num_blocks", num_blocks)
    if mask_mode == "householder":
      raise ValueError(
        "mask_mode='householder' is its own layer now: gdp_jax.layers.HouseholderDeltaProduct "
        "(DeltaProduct, num_householder steps per token); GatedDeltaProduct's mask_mode must be "
        f"one of {MASK_MODES}"
      )
    _check_choice("mask_mode", mask_mode, MASK_MODES)
    if head_dim % num_blocks != 0:
      raise ValueError(
        f"head_dim = {head_dim} must be divisible by num_blocks = {num_blocks} "
        f"(the key dimension is split into num_blocks equal blocks)"
      )
    _check_choice("key_norm", key_norm, KEY_NORMS)
    check_operator_config(chunk_size, implementation)
    if sharding is not None:
      if not isinstance(sharding, ShardingConfig):
        raise TypeError(
          f"sharding must be a gdp_jax.sharding.ShardingConfig or None, got "
          f"{type(sharding).__name__}"
        )
      if operator_fn is not None or step_fn is not None:
        raise ValueError(
          "pass either sharding (which builds the sharded operator_fn and step_fn) or "
          "operator_fn / step_fn, not both"
        )
      if num_v_heads != num_heads:
        raise ValueError(
          "num_v_heads != num_heads is not supported with sharding yet (the sharded operator "
          "takes one head count); use sharding=None"
        )
      if num_heads % sharding.size("heads"):
        raise ValueError(
          f"num_heads = {num_heads} is not divisible by the {sharding.size('heads')} "
          f"pieces of the heads mesh axes {sharding.axes('heads')}"
        )
    sequence, step = gated_delta_product, gated_delta_product_step
    if sharding is not None:
      sequence = ValuePartial(sharded_gated_delta_product, sharding=sharding)
      step = ValuePartial(sharded_gated_delta_product_step, sharding=sharding)
    if operator_fn is None:
      operator_fn = ValuePartial(sequence, chunk_size=chunk_size, implementation=implementation)
    if step_fn is None:
      step_fn = ValuePartial(step, implementation=step_implementation(implementation))
    self.num_blocks, self.mask_mode, self.key_norm = num_blocks, mask_mode, key_norm
    self.beta_norm = beta_norm
    super().__init__(
      hidden_size,
      num_heads,
      head_dim,
      num_v_heads=num_v_heads,
      writes=1,
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

  def _init_mixing(self, key, rngs, param_dtype):
    """The mask's parameters: W = I + small positive noise (no exact zeros: d|w|/dw = 0 there),
    [HV, r, r] ("static") or the bias of a projection of x ("token"); none for "ones"."""
    HV, r, D = self.num_v_heads, self.num_blocks, self.hidden_size
    w0 = jnp.eye(r, dtype=f32) + 0.1 * jax.random.uniform(key, (HV, r, r), f32, 0.1, 1.0)
    if self.mask_mode == "static":
      self.mask_weight = partitioning.param(w0.astype(param_dtype), (HEADS, None, None))
    elif self.mask_mode == "token":
      self.mask_proj = Linear(  # columns [HV, r, r]: head by head
        D,
        HV * r * r,
        use_bias=True,
        dtype=self.dtype,
        param_dtype=param_dtype,
        kernel_init=partitioning.partitioned(nnx.initializers.normal(0.02), (EMBED, HEADS)),
        bias_init=partitioning.partitioned(
          lambda *_: w0.reshape(HV * r * r).astype(param_dtype), (HEADS,)
        ),
        rngs=rngs,
      )

  def _mask(self, x):
    """[HV, r, r] (static), [..., HV, r, r] (token: from x [..., D]), or None (ones: r = 1)."""
    H, r = self.num_v_heads, self.num_blocks
    if self.mask_mode == "static":
      return block_mask(self.mask_weight[...])
    if self.mask_mode == "token":
      w = self.mask_proj(x).astype(f32)
      return block_mask(w.reshape(x.shape[:-1] + (H, r, r)))
    return None

  def _qk_norm(self, x):
    """l2norm per key block ("block") or over the whole key ("full"); x [..., H*K]. In "ones"
    mode the block-normalised key is divided by sqrt(r): a unit key."""
    H, K, r = self.num_heads, self.head_dim, self.num_blocks
    blocks = r if self.key_norm == "block" else 1
    y = l2norm(x.reshape(x.shape[:-1] + (H, blocks, K // blocks)))
    if self.mask_mode == "ones" and blocks > 1:
      y = y * (1.0 / math.sqrt(blocks))
    return y.reshape(x.shape[:-1] + (H, K))

  def _scale_beta(self, beta, mask):
    """beta / rho(M), rho(M) = max_a sum_b M[a, b] ([H] or per token), with "block" keys."""
    if not self.beta_norm or mask is None or self.key_norm != "block":
      return beta
    return beta / jnp.max(jnp.sum(mask, axis=-1), axis=-1)

  def _shape_qkv(self, q, k, v):
    """q [..., H, K], k [..., H, K] (normalised, `_qk_norm`) and v [..., HV, V]."""
    q, k = self._qk_norm(q).astype(q.dtype), self._qk_norm(k).astype(k.dtype)
    return q, k, v.reshape(q.shape[:-2] + (self.num_v_heads, self.value_dim))

  def _mix(self, x, q, k, v, g, beta, *, initial_state, output_final_state, cu_seqlens):
    mask = self._mask(x)
    packed = {} if cu_seqlens is None else {"cu_seqlens": cu_seqlens}
    return self.operator_fn(
      q,
      k,
      v,
      g,
      self._scale_beta(beta, mask),
      mask,
      initial_state=initial_state,
      output_final_state=output_final_state,
      **packed,
    )

  def _mix_step(self, x, q, k, v, g, beta, state):
    mask = self._mask(x)
    return self.step_fn(q, k, v, g, self._scale_beta(beta, mask), mask, state)
