"""The gated delta product token mixer `GatedDeltaProduct` and its decode cache
(block-masked, per-token and ones masks; the Householder form, DeltaProduct)."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import DTypeLike

from gdp_jax import dispatch, varlen
from gdp_jax.layers.common import (
  KEY_NORMS,
  MASK_MODES,
  RESET_LOG_DECAY,
  GatedRMSNorm,
  Linear,
  _check_cache,
  _check_choice,
  _check_lengths,
  _check_positive_int,
  _check_segment_ids,
  _check_x,
  f32,
  l2norm,
  segment_starts,
)
from gdp_jax.layers.masks import block_mask
from gdp_jax.layers.short_conv import ShortConv
from gdp_jax.ops.gated_delta_product.api import gated_delta_product
from gdp_jax.ops.householder.api import householder_delta_product, householder_delta_product_step
from gdp_jax.ops.validation import CHUNK_SIZES, check_cu_seqlens, check_cu_seqlens_values
from gdp_jax.sharding import (
  ShardingConfig,
  sharded_gated_delta_product,
  sharded_gated_delta_product_step,
)


class GatedDeltaProductCache(NamedTuple):
  """Decode cache of one `GatedDeltaProduct` layer.

  conv: [B, conv_size - 1, 2*H*K + HV*V] the last inputs of the short convolution (q | k | v
    channels; H*K + n_h*H*(K + V) in "householder" mode), or None without the convolution.
  state: [B, HV, K, V] float32 recurrent state (HV = num_v_heads).
  """

  conv: Any
  state: jax.Array


class GatedDeltaProduct(nnx.Module):
  """Block-masked gated delta product token mixer (docs/operator.md), built like Gated DeltaNet.

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

  `mask_mode="householder"` is DeltaProduct (Siems et al. 2025; flash-linear-attention's
  `GatedDeltaProduct` layer): each token writes `num_householder` = n_h rank-1 delta steps in
  order, each with its own key (from its own slice of k_proj, L2-normalised over the whole
  head), value and beta (sigmoid, times 2 with `allow_neg_eigval`: each step's eigenvalue
  1 - beta in (-1, 1)); the decay once per token before its first step, the output after its
  last (`householder_delta_product`). A product of n_h >= 2 reflections can rotate. num_blocks,
  key_norm and beta_norm do not apply (the operator runs with r = 1 over T * n_h sub-steps).

  Args:
    hidden_size: D, the model width.
    num_heads: H, the query/key heads.
    head_dim: K, the key dimension per head; K % num_blocks == 0.
    num_v_heads: HV, the value heads (default H): a multiple of H, value head i reading
      query/key head i // (HV // H) (grouped value heads, as Qwen3-Next and Kimi Linear). g,
      beta, the mask, the state and the output have HV heads. Not with "householder" or
      `sharding` yet.
    expand_v: value dim V = head_dim * expand_v (a whole number).
    num_blocks: r, the number of key blocks (the mask is r x r).
    mask_mode: "static" | "token" | "ones" | "householder" (see above).
    num_householder: n_h, the delta steps per token in "householder" mode.
    key_norm: "block" | "full" (see above).
    beta_norm: divide beta by rho(M) ("block" normalisation only; see above).
    use_short_conv, conv_size: causal depthwise convolution + SiLU on q, k, v (else SiLU only).
    use_gate: output gate silu(g_proj(x)) in the RMSNorm (else a plain RMSNorm).
    allow_neg_eigval: beta = 2 sigmoid(.) in (0, 2) instead of (0, 1): eigenvalues down to -1,
      what state tracking needs (Grazzi et al. 2024).
    norm_eps: RMSNorm epsilon.
    chunk_size, implementation: passed to `gated_delta_product` / `gated_delta_product_step`
      (None: the Pallas kernels on a GPU, the jnp forms elsewhere).
    sharding: a `gdp_jax.sharding.ShardingConfig` to run the operator split over a device mesh
      (batch, heads and sequence; the step over batch and heads), or None for one device. The
      projections around it are ordinary jnp code that XLA partitions from the layouts.
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
    num_householder: int = 2,
    num_v_heads: int | None = None,
    rngs: nnx.Rngs,
  ) -> None:
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
    if num_v_heads != num_heads and mask_mode == "householder":
      raise ValueError(
        "num_v_heads != num_heads is not supported with mask_mode='householder' yet; use "
        "a block-mask mode"
      )
    if num_v_heads != num_heads and sharding is not None:
      raise ValueError(
        "num_v_heads != num_heads is not supported with sharding yet (the sharded operator "
        "takes one head count); use sharding=None"
      )
    _check_positive_int("num_blocks", num_blocks)
    _check_choice("mask_mode", mask_mode, MASK_MODES)
    householder = mask_mode == "householder"
    if householder:
      _check_positive_int("num_householder", num_householder)
      num_blocks = 1  # the r = 1 operator over T * n_h sub-steps
    if head_dim % num_blocks != 0:
      raise ValueError(
        f"head_dim = {head_dim} must be divisible by num_blocks = {num_blocks} "
        f"(the key dimension is split into num_blocks equal blocks)"
      )
    value_dim = head_dim * expand_v
    if (
      isinstance(expand_v, bool)
      or not isinstance(expand_v, (int, float))
      or value_dim <= 0
      or value_dim != int(value_dim)
    ):
      raise ValueError(
        f"expand_v = {expand_v!r} must be a positive number with head_dim * "
        f"expand_v a whole number (head_dim = {head_dim})"
      )
    _check_choice("key_norm", key_norm, KEY_NORMS)
    if use_short_conv:
      _check_positive_int("conv_size", conv_size)
    if chunk_size not in CHUNK_SIZES:
      raise ValueError(f"chunk_size must be one of {CHUNK_SIZES}, got {chunk_size!r}")
    if implementation is not None:
      dispatch.resolve("gated_delta_product", implementation)  # a clear error if unknown
    if sharding is not None and not isinstance(sharding, ShardingConfig):
      raise TypeError(
        f"sharding must be a gdp_jax.sharding.ShardingConfig or None, got {type(sharding).__name__}"
      )
    if sharding is not None and num_heads % sharding.size("heads"):
      raise ValueError(
        f"num_heads = {num_heads} is not divisible by the {sharding.size('heads')} "
        f"pieces of the heads mesh axes {sharding.axes('heads')}"
      )
    if sharding is not None and mask_mode == "householder":
      raise ValueError(
        "sharding is not supported with mask_mode='householder' yet; use "
        "sharding=None or a block-mask mode"
      )
    self.sharding = sharding
    self.hidden_size, self.num_heads, self.head_dim = hidden_size, num_heads, head_dim
    self.num_v_heads = num_v_heads
    self.value_dim = int(value_dim)
    self.num_blocks, self.mask_mode, self.key_norm = num_blocks, mask_mode, key_norm
    self.use_short_conv, self.conv_size, self.use_gate = use_short_conv, conv_size, use_gate
    self.allow_neg_eigval, self.beta_norm = allow_neg_eigval, beta_norm
    self.chunk_size, self.implementation = chunk_size, implementation
    self.num_householder = num_householder if householder else 1
    self.dtype = dtype

    H, K, V, r, D = num_heads, head_dim, self.value_dim, num_blocks, hidden_size
    HV = num_v_heads  # value heads: v, g, beta, the mask, the state and the output
    n = self.num_householder
    lin = lambda i, o: Linear(i, o, use_bias=False, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    # In "householder" mode k, v and beta have one slice per step: [..., n_h, H, *].
    self.q_proj, self.k_proj, self.v_proj = lin(D, H * K), lin(D, n * H * K), lin(D, n * HV * V)
    self.a_proj, self.b_proj = lin(D, HV), lin(D, n * HV)
    # Mamba-2 / Gated DeltaNet initialisation: A in [1, 16], dt in [1e-3, 1e-1].
    self.A_log = nnx.Param(
      jnp.log(jax.random.uniform(rngs.params(), (HV,), f32, 1.0, 16.0)).astype(param_dtype)
    )
    dt = jnp.exp(jax.random.uniform(rngs.params(), (HV,), f32, math.log(1e-3), math.log(1e-1)))
    dt = jnp.maximum(dt, 1e-4)
    self.dt_bias = nnx.Param((dt + jnp.log(-jnp.expm1(-dt))).astype(param_dtype))  # softplus^-1
    # Mask parameters: W = I + small positive noise (no exact zeros: d|w|/dw = 0 there).
    w0 = jnp.eye(r, dtype=f32) + 0.1 * jax.random.uniform(rngs.params(), (HV, r, r), f32, 0.1, 1.0)
    if mask_mode == "static":
      self.mask_weight = nnx.Param(w0.astype(param_dtype))
    elif mask_mode == "token":
      self.mask_proj = Linear(
        D,
        HV * r * r,
        use_bias=True,
        dtype=dtype,
        param_dtype=param_dtype,
        kernel_init=nnx.initializers.normal(0.02),
        bias_init=lambda *_: w0.reshape(HV * r * r).astype(param_dtype),
        rngs=rngs,
      )
    if use_short_conv:
      self.conv = ShortConv(self._conv_channels(), conv_size, param_dtype=param_dtype, rngs=rngs)
    if use_gate:
      self.g_proj = lin(D, HV * V)
    self.o_norm = GatedRMSNorm(V, eps=norm_eps, param_dtype=param_dtype)
    self.o_proj = lin(HV * V, D)

  # -- pieces shared by both modes -------------------------------------------------------------

  def _conv_channels(self):
    """Channels of the short convolution: q | k | v (k and v n_h times in "householder")."""
    H, K, V, n = self.num_heads, self.head_dim, self.value_dim, self.num_householder
    return H * K + n * H * K + n * self.num_v_heads * V

  def _mask(self, x):
    """[HV, r, r] (static), [..., HV, r, r] (token: from x [..., D]), or None (ones,
    householder: r = 1)."""
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

  def _gates(self, x):
    """g (log-decay) float32 [..., H] and beta float32 [..., H] ([..., n_h, H] in
    "householder" mode)."""
    a = self.a_proj(x).astype(f32) + self.dt_bias[...].astype(f32)
    g = -jnp.exp(self.A_log[...].astype(f32)) * jax.nn.softplus(a)
    beta = jax.nn.sigmoid(self.b_proj(x).astype(f32))
    if self.allow_neg_eigval:
      beta = 2.0 * beta
    if self.mask_mode == "householder":
      beta = beta.reshape(beta.shape[:-1] + (self.num_householder, self.num_v_heads))
    return g, beta

  def _scale_beta(self, beta, mask):
    """beta / rho(M), rho(M) = max_a sum_b M[a, b] ([H] or per token), with "block" keys."""
    if not self.beta_norm or mask is None or self.key_norm != "block":
      return beta
    return beta / jnp.max(jnp.sum(mask, axis=-1), axis=-1)

  def _split_qkv(self, qkv):
    """q [..., H, K], k [..., H, K] and v [..., H, V]; in "householder" mode k [..., n_h, H, K]
    and v [..., n_h, H, V] (each step's key L2-normalised over the whole head)."""
    H, K, V, n = self.num_heads, self.head_dim, self.value_dim, self.num_householder
    HK = H * K
    q, k, v = qkv[..., :HK], qkv[..., HK : HK + n * HK], qkv[..., HK + n * HK :]
    dtype = qkv.dtype
    q = self._qk_norm(q).astype(dtype)
    if self.mask_mode == "householder":
      k = l2norm(k.reshape(k.shape[:-1] + (n, H, K))).astype(dtype)
      return q, k, v.reshape(v.shape[:-1] + (n, H, V))
    k = self._qk_norm(k).astype(dtype)
    return q, k, v.reshape(v.shape[:-1] + (self.num_v_heads, V))

  def _project_in(self, x):
    """q | k | v projections of x [..., D] as one matmul with the three kernels side by side
    (each output column the same product as its own projection's): x is read once and the
    outputs need no concatenation, which XLA does not do for us when x is large."""
    projs = (self.q_proj, self.k_proj, self.v_proj)  # x is floating (`_check_x`)
    dtype = x.dtype if self.q_proj.dtype is None else self.q_proj.dtype  # as `Linear`
    kernel = jnp.concatenate([p.kernel[...].astype(dtype) for p in projs], axis=1)
    return jnp.dot(x.astype(dtype), kernel, precision=self.q_proj.precision)

  def _output(self, o, x):
    """o [..., H, V] -> [..., D]."""
    gate = None
    if self.use_gate:
      gate = self.g_proj(x).reshape(o.shape)
    o = self.o_norm(o, gate)
    return self.o_proj(o.reshape(o.shape[:-2] + (self.num_v_heads * self.value_dim,)))

  # -- whole sequence ---------------------------------------------------------------------------

  def __call__(
    self,
    x: jax.Array,
    lengths: jax.Array | None = None,
    *,
    segment_ids: jax.Array | None = None,
    cu_seqlens: jax.Array | None = None,
    return_cache: bool = False,
  ) -> jax.Array | tuple[jax.Array, GatedDeltaProductCache]:
    """The whole sequence through the chunked operator.

    Args:
      x: [B, T, D].
      lengths: None (every token is real) or [B] int: sequence b holds tokens [0, lengths[b])
        and the rest is right padding. Padding tokens leave the state untouched (beta = g = 0);
        their outputs are meaningless.
      segment_ids: None, or [B, T] int: packed documents, one id per token (a document is a run
        of equal ids; see `segment_starts`). At each document's first token the recurrent state
        is reset: the operator gets g = RESET_LOG_DECAY there, so exp(g) S = 0 exactly and the
        token writes into an empty state (any number of documents per row, any B; see
        `cu_seqlens` for the operator's packed form), and the short convolution reads zeros
        instead of other documents' inputs. The forward is exact. In the chunked backward, a
        document that starts inside a chunk leaves rounding-level gradient (about 1e-7
        relative) in the log-decay of the earlier tokens of that chunk (through the chunk's
        cumulative sum of g, whose terms cancel only up to rounding); documents starting at
        multiples of `chunk_size` are exactly separated, also in the gradient
        (docs/train_lm.md). Not with `return_cache`.
      cu_seqlens: None, or int [N + 1] offsets of N documents packed in one row (B = 1):
        document n holds tokens [cu_seqlens[n], cu_seqlens[n + 1]) (docs/varlen.md). The
        operator runs them as separate sequences (its `cu_seqlens` form: exact in the forward
        and the gradient wherever the documents start) and the short convolution reads zeros
        across a boundary. May be traced (new boundaries with the same N do not recompile).
        With `return_cache` the cache has one row per document (B = N): a prefill of N packed
        prompts for a decode of N sequences. Not with `lengths`, `segment_ids`, "householder"
        or `sharding`.
      return_cache: also return the `GatedDeltaProductCache` after lengths[b] tokens (after
        each document with cu_seqlens).

    Returns:
      y [B, T, D], or (y, cache) with `return_cache`.
    """
    _check_x(x, self.hidden_size, 3, "[B, T, D]")
    batch, t_len, _ = x.shape
    lengths = _check_lengths(lengths, batch, t_len)
    segment_ids = _check_segment_ids(segment_ids, batch, t_len)
    if segment_ids is not None and return_cache:
      raise ValueError(
        "segment_ids with return_cache is not supported: a decode cache "
        "continues one sequence per row, not packed documents"
      )
    conv_segments = segment_ids
    if cu_seqlens is not None:
      cu_seqlens = self._check_cu_seqlens(cu_seqlens, lengths, segment_ids, batch, t_len)
      conv_segments = varlen.token_sequences(cu_seqlens, t_len)[None]
    if self.dtype is not None:
      x = x.astype(self.dtype)
    pre = self._project_in(x)
    qkv = self.conv(pre, conv_segments) if self.use_short_conv else jax.nn.silu(pre)
    q, k, v = self._split_qkv(qkv)
    g, beta = self._gates(x)
    if segment_ids is not None:
      g = jnp.where(segment_starts(segment_ids)[..., None], RESET_LOG_DECAY, g)
    if lengths is not None:
      real = (jnp.arange(t_len)[None, :] < lengths[:, None])[..., None]  # [B, T, 1]
      g = jnp.where(real, g, 0.0)
      beta = jnp.where(real[..., None] if beta.ndim == 4 else real, beta, 0.0)
    if self.mask_mode == "householder":
      n = self.num_householder
      sub = lambda a: a.reshape((batch, t_len * n) + a.shape[3:])  # [B, T*n_h, ...]
      o, final = householder_delta_product(
        q,
        sub(k),
        sub(v),
        g,
        sub(beta),
        num_householder=n,
        output_final_state=return_cache,
        chunk_size=self.chunk_size,
        implementation=self.implementation if cu_seqlens is None else self._varlen_implementation(),
        cu_seqlens=cu_seqlens,
      )
    else:
      mask = self._mask(x)
      beta = self._scale_beta(beta, mask)
      if cu_seqlens is not None:
        o, final = gated_delta_product(
          q,
          k,
          v,
          g,
          beta,
          mask,
          output_final_state=return_cache,
          chunk_size=self.chunk_size,
          implementation=self._varlen_implementation(),
          cu_seqlens=cu_seqlens,
        )
      else:
        o, final = sharded_gated_delta_product(
          q,
          k,
          v,
          g,
          beta,
          mask,
          output_final_state=return_cache,
          chunk_size=self.chunk_size,
          implementation=self.implementation,
          sharding=self.sharding,
        )
    y = self._output(o, x)
    if not return_cache:
      return y
    conv = None
    if self.use_short_conv:
      if cu_seqlens is not None:
        conv = self.conv.state_after_packed(pre, cu_seqlens)
      else:
        conv = self.conv.state_after(pre, lengths)
    return y, GatedDeltaProductCache(conv, final)

  def _check_cu_seqlens(self, cu_seqlens, lengths, segment_ids, batch, t_len):
    """Checked offsets (concrete ones: a ValueError unless valid), sanitised as int32."""
    if lengths is not None or segment_ids is not None:
      raise ValueError(
        "cu_seqlens packs documents in one row: pass it without lengths and segment_ids"
      )
    if batch != 1:
      raise ValueError(
        f"with cu_seqlens the batch size must be 1 (documents packed in one row), got x of "
        f"shape [B, T, D] with B = {batch}"
      )
    if self.sharding is not None:
      raise ValueError("cu_seqlens is not supported with sharding yet; use segment_ids")
    cu_seqlens, _ = check_cu_seqlens(cu_seqlens)
    check_cu_seqlens_values(cu_seqlens, t_len)
    return varlen.sanitize(cu_seqlens, t_len)

  def _varlen_implementation(self):
    """The implementation of a packed (cu_seqlens) call: the layer's own where the packed form
    has it (an explicit "pallas" runs the kernels' packed form, docs/varlen.md), else None
    (the operator's default); the Householder form has no Pallas packed path."""
    names = dispatch.implementations("gated_delta_product_varlen")
    if self.mask_mode == "householder" and dispatch.is_pallas(self.implementation):
      return None
    return self.implementation if self.implementation in names else None

  # -- one token --------------------------------------------------------------------------------

  def init_cache(self, batch_size: int, dtype: DTypeLike | None = None) -> GatedDeltaProductCache:
    """The empty cache: zero convolution inputs (in `dtype`, default the layer's dtype or f32)
    and a zero float32 state."""
    H, K, V = self.num_v_heads, self.head_dim, self.value_dim
    conv = None
    if self.use_short_conv:
      conv = jnp.zeros(
        (batch_size, self.conv_size - 1, self._conv_channels()), dtype or self.dtype or f32
      )
    return GatedDeltaProductCache(conv, jnp.zeros((batch_size, H, K, V), f32))

  def step(
    self, x: jax.Array, cache: GatedDeltaProductCache
  ) -> tuple[jax.Array, GatedDeltaProductCache]:
    """One token per sequence: x [B, D] -> (y [B, D], new cache); `cache` from `init_cache(B)`
    or from a prefill (`return_cache=True`) of this layer."""
    _check_x(x, self.hidden_size, 2, "[B, D] (one token per sequence)")
    self._check_step_cache(cache, x.shape[0])
    x, (q, k, v), (g, beta), conv = self._step_inputs(x, cache, "step")
    impl = self.implementation
    if impl not in (None, *dispatch.implementations("gated_delta_product_step")):
      impl = "xla"  # "reference" has no step of its own
    if self.mask_mode == "householder":
      o, state = householder_delta_product_step(
        q, k, v, g, beta, cache.state, num_householder=self.num_householder, implementation=impl
      )
    else:
      mask = self._mask(x)
      beta = self._scale_beta(beta, mask)
      o, state = sharded_gated_delta_product_step(
        q, k, v, g, beta, mask, cache.state, implementation=impl, sharding=self.sharding
      )
    return self._output(o, x), GatedDeltaProductCache(conv, state)

  def _step_inputs(self, x, cache, conv_step):
    """x in the layer's dtype, (q, k, v), (g, beta) and the new convolution state of a step from
    a cache; conv_step names the short convolution's step: "step" (one token) or "step_tokens"."""
    if self.dtype is not None:
      x = x.astype(self.dtype)
    pre = self._project_in(x)
    conv = None
    if self.use_short_conv:
      qkv, conv = getattr(self.conv, conv_step)(pre, cache.conv)
      conv = conv.astype(cache.conv.dtype)
    else:
      qkv = jax.nn.silu(pre)
    return x, self._split_qkv(qkv), self._gates(x), conv

  def _check_step_cache(self, cache, batch):
    H, K, V, B = self.num_v_heads, self.head_dim, self.value_dim, batch
    conv_shape = (B, self.conv_size - 1, self._conv_channels()) if self.use_short_conv else None
    _check_cache(
      cache,
      GatedDeltaProductCache,
      {
        "state": ((B, H, K, V), "[B, HV, K, V]"),
        "conv": (
          conv_shape,
          "[B, conv_size - 1, channels of the short convolution], None without the convolution",
        ),
      },
    )

  def step_tokens(
    self, x: jax.Array, cache: GatedDeltaProductCache
  ) -> tuple[jax.Array, GatedDeltaProductCache]:
    """Tq new tokens per sequence after the cache (speculative verification, chunked prefill
    from a cache): x [B, Tq, D] -> (y [B, Tq, D], the cache after the Tq tokens). The same as
    Tq calls of `step` (up to rounding): the short convolution runs over the Tq tokens from the
    cached inputs and the chunked operator (`gated_delta_product`, or
    `householder_delta_product` in "householder" mode) from the cached state
    (docs/inference.md#several-new-tokens-per-step)."""
    _check_x(x, self.hidden_size, 3, "[B, Tq, D] (Tq new tokens per sequence)")
    self._check_step_cache(cache, x.shape[0])
    batch, t_len, _ = x.shape
    x, (q, k, v), (g, beta), conv = self._step_inputs(x, cache, "step_tokens")
    if self.mask_mode == "householder":
      n = self.num_householder
      sub = lambda a: a.reshape((batch, t_len * n) + a.shape[3:])  # [B, Tq*n_h, ...]
      o, state = householder_delta_product(
        q,
        sub(k),
        sub(v),
        g,
        sub(beta),
        num_householder=n,
        initial_state=cache.state,
        output_final_state=True,
        chunk_size=self.chunk_size,
        implementation=self.implementation,
      )
    else:
      mask = self._mask(x)
      beta = self._scale_beta(beta, mask)
      o, state = sharded_gated_delta_product(
        q,
        k,
        v,
        g,
        beta,
        mask,
        initial_state=cache.state,
        output_final_state=True,
        chunk_size=self.chunk_size,
        implementation=self.implementation,
        sharding=self.sharding,
      )
    return self._output(o, x), GatedDeltaProductCache(conv, state)
