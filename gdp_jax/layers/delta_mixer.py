"""The skeleton the two delta-rule token mixers share (`GatedDeltaProduct` in delta_product.py,
the block mask; `HouseholderDeltaProduct` in householder.py, DeltaProduct): Gated DeltaNet's
projections, short convolution, gates and output norm around the sequence operator, and the
decode steps (docs/layers.md). The callables' types, the cache and the checks: delta_common.py."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import DTypeLike

from gdp_jax.layers import partitioning
from gdp_jax.layers.common import (
  RESET_LOG_DECAY,
  GatedRMSNorm,
  Linear,
  _check_cache,
  _check_lengths,
  _check_positive_int,
  _check_segment_ids,
  _check_x,
  as_f32,
  f32,
  segment_starts,
)
from gdp_jax.layers.delta_common import (
  GatedDeltaProductCache,
  OperatorFn,
  StepFn,
  check_sizes,
  dot_as,
  head_major,
  name_of,
  takes_keyword,
  writes_first,
)
from gdp_jax.layers.partitioning import EMBED, HEADS
from gdp_jax.layers.short_conv import ShortConv
from gdp_jax.ops.gated_delta_product import varlen
from gdp_jax.ops.validation import check_cu_seqlens, check_cu_seqlens_values


class DeltaMixer(nnx.Module):
  """The skeleton of a delta-rule token mixer, built like Gated DeltaNet (docs/layers.md).

  Per head: q, k = projections of x after an optional causal short convolution + SiLU (their
  normalisation is the subclass's), v = projection (value dim V = head_dim * expand_v), beta =
  sigmoid(b_proj(x)) (times 2 with `allow_neg_eigval`), g = -exp(A_log) * softplus(a_proj(x) +
  dt_bias); the operator's output is RMS-normalised per head (times silu(g_proj(x)) with
  `use_gate`, Gated DeltaNet's gated RMSNorm) and projected back to D. k, v and beta have
  `writes` slices per token (1 for the block mask, n_h for DeltaProduct).

  The whole sequence goes through `self.operator_fn` and one token through `self.step_fn`, the
  callables the layer was given (or built from chunk_size / implementation): a subclass says
  how (`_mix`, `_mix_step`), builds q, k, v (`_shape_qkv`) and any mixing parameters
  (`_init_mixing`).
  """

  operator_fn: OperatorFn
  step_fn: StepFn

  def __init__(
    self,
    hidden_size: int,
    num_heads: int,
    head_dim: int,
    *,
    num_v_heads: int | None,
    writes: int,
    expand_v: float,
    use_short_conv: bool,
    conv_size: int,
    use_gate: bool,
    allow_neg_eigval: bool,
    norm_eps: float,
    operator_fn: OperatorFn,
    step_fn: StepFn,
    dtype: DTypeLike | None,
    param_dtype: DTypeLike,
    rngs: nnx.Rngs,
  ) -> None:
    num_v_heads = check_sizes(hidden_size, num_heads, head_dim, num_v_heads)
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
    if use_short_conv:
      _check_positive_int("conv_size", conv_size)
    for name, fn in (("operator_fn", operator_fn), ("step_fn", step_fn)):
      if not callable(fn):
        raise TypeError(f"{name} must be callable (e.g. a functools.partial), got {fn!r}")
    self.operator_fn, self.step_fn = operator_fn, step_fn
    self.hidden_size, self.num_heads, self.head_dim = hidden_size, num_heads, head_dim
    self.num_v_heads, self.value_dim, self.writes = num_v_heads, int(value_dim), writes
    self.use_short_conv, self.conv_size, self.use_gate = use_short_conv, conv_size, use_gate
    self.allow_neg_eigval = allow_neg_eigval
    self.dtype = dtype

    H, K, V, D, HV, n = num_heads, head_dim, self.value_dim, hidden_size, num_v_heads, writes

    def lin(i, o, names):
      init = partitioning.partitioned(nnx.initializers.lecun_normal(), names)
      return Linear(
        i, o, use_bias=False, dtype=dtype, param_dtype=param_dtype, kernel_init=init, rngs=rngs
      )

    # Logical axes (docs/sharding.md#annotated-parameters): projection columns head by head are
    # "heads"; the `writes` slices of k, v and beta come first in their columns
    # ([n, H, ...]), so with writes > 1 no contiguous split of them is one of heads: not split.
    per_write = HEADS if writes == 1 else None
    self.q_proj = lin(D, H * K, (EMBED, HEADS))
    self.k_proj, self.v_proj = (
      lin(D, n * H * K, (EMBED, per_write)),
      lin(D, n * HV * V, (EMBED, per_write)),
    )
    self.a_proj, self.b_proj = lin(D, HV, (EMBED, HEADS)), lin(D, n * HV, (EMBED, per_write))
    # Mamba-2 / Gated DeltaNet initialisation: A in [1, 16], dt in [1e-3, 1e-1].
    self.A_log = partitioning.param(
      jnp.log(jax.random.uniform(rngs.params(), (HV,), f32, 1.0, 16.0)).astype(param_dtype),
      (HEADS,),
    )
    dt = jnp.exp(jax.random.uniform(rngs.params(), (HV,), f32, math.log(1e-3), math.log(1e-1)))
    dt = jnp.maximum(dt, 1e-4)
    # softplus^-1
    self.dt_bias = partitioning.param((dt + jnp.log(-jnp.expm1(-dt))).astype(param_dtype), (HEADS,))
    # The mixing parameters' key is drawn by every layer, so that the parameters after it are
    # the same for every kind of layer and seed.
    self._init_mixing(rngs.params(), rngs, param_dtype)
    if use_short_conv:
      self.conv = ShortConv(self._conv_channels(), conv_size, param_dtype=param_dtype, rngs=rngs)
    if use_gate:
      self.g_proj = lin(D, HV * V, (EMBED, HEADS))
    self.o_norm = GatedRMSNorm(V, eps=norm_eps, param_dtype=param_dtype, axis_name=None)
    self.o_proj = lin(HV * V, D, (HEADS, EMBED))

  # -- what a subclass gives -------------------------------------------------------------------

  def _init_mixing(self, key, rngs, param_dtype):
    """Create the mixing parameters (e.g. the block mask's) from `key` / `rngs`."""

  def _shape_qkv(self, q, k, v):
    """q, k, v (normalised, with their head axes) from the convolved projections
    [..., channels of each]."""
    raise NotImplementedError

  def _split_qkv(self, qkv):
    """`_shape_qkv` of the convolved projections side by side, qkv [..., q | k | v]."""
    return self._shape_qkv(*self._parts(qkv))

  def _mix(self, x, q, k, v, g, beta, *, initial_state, output_final_state, cu_seqlens):
    """(o [B, T, HV, V], final state or None) through `self.operator_fn`."""
    raise NotImplementedError

  def _mix_step(self, x, q, k, v, g, beta, state):
    """(o [B, HV, V], new state) through `self.step_fn`."""
    raise NotImplementedError

  # -- shared pieces ---------------------------------------------------------------------------

  def _conv_channels(self):
    """Channels of the short convolution: q | k | v (k and v `writes` times)."""
    return self._part_slices()[-1].stop

  def _part_slices(self):
    """The channels of q, k and v in q | k | v (slices)."""
    H, K, V, n = self.num_heads, self.head_dim, self.value_dim, self.writes
    q_end, k_end = H * K, H * K + n * H * K
    return slice(0, q_end), slice(q_end, k_end), slice(k_end, k_end + n * self.num_v_heads * V)

  def _parts(self, qkv):
    """(q, k, v) columns of qkv [..., q | k | v]."""
    return tuple(qkv[..., part] for part in self._part_slices())

  def _part_heads(self):
    """(writes, heads, width per head) of the columns of q [H, K], k [writes, H, K] and
    v [writes, HV, V]."""
    H, K, n = self.num_heads, self.head_dim, self.writes
    return (1, H, K), (n, H, K), (n, self.num_v_heads, self.value_dim)

  def _gates(self, x):
    """g (log-decay) float32 [..., HV] and beta float32 [..., writes * HV] ([..., writes, HV]
    under a mesh)."""
    a = as_f32(self.a_proj(x)) + self.dt_bias[...].astype(f32)
    g = -jnp.exp(self.A_log[...].astype(f32)) * jax.nn.softplus(a)
    if partitioning.mesh_is_set() and self.writes > 1:  # head by head: `_convolved_qkv`
      heads = self.num_v_heads
      layout = (self.writes, heads, 1)
      b = dot_as(x, head_major(self.b_proj.kernel[...], *layout), self.b_proj)
      b = writes_first(b, *layout)[..., 0]
    else:
      b = self.b_proj(x)
    beta = jax.nn.sigmoid(as_f32(b))
    if self.allow_neg_eigval:
      beta = 2.0 * beta
    return g, beta

  def _project_in(self, x):
    """q | k | v projections of x [..., D] as one matmul with the three kernels side by side
    (each output column the same product as its own projection's): x is read once and the
    outputs need no concatenation, which XLA does not do for us when x is large."""
    projs = (self.q_proj, self.k_proj, self.v_proj)  # x is floating (`_check_x`)
    dtype = x.dtype if self.q_proj.dtype is None else self.q_proj.dtype  # as `Linear`
    kernel = jnp.concatenate([p.kernel[...].astype(dtype) for p in projs], axis=1)
    return jnp.dot(x.astype(dtype), kernel, precision=self.q_proj.precision)

  def _convolved_qkv(self, x, conv_segments):
    """(the projections before the convolution: q | k | v in one array, or (q, k, v) head by
    head under a mesh; q, k, v after the short convolution (or SiLU) and `_shape_qkv`).

    Under a mesh of several devices (`partitioning.mesh_is_set`) q, k and v are three matmuls
    whose kernels' columns (and the convolution's channels) are taken head by head
    (`head_major`): each output then splits along heads as the operator's inputs do, where
    the one matmul of `_project_in`, whose q | k | v columns no head split follows, would make
    XLA move the activations between devices (docs/sharding.md#annotated-parameters)."""
    if partitioning.mesh_is_set():
      projs, parts = (self.q_proj, self.k_proj, self.v_proj), self._part_slices()
      heads = self._part_heads()
      pre = tuple(
        dot_as(x, head_major(p.kernel[...], *h), self.q_proj) for p, h in zip(projs, heads)
      )
      if self.use_short_conv:
        weight = self.conv.weight[...]
        qkv = [
          self.conv(p, conv_segments, head_major(weight[:, c], *h))
          for p, c, h in zip(pre, parts, heads)
        ]
      else:
        qkv = [jax.nn.silu(p) for p in pre]
      return pre, self._shape_qkv(*(writes_first(a, *h) for a, h in zip(qkv, heads)))
    pre = self._project_in(x)
    qkv = self.conv(pre, conv_segments) if self.use_short_conv else jax.nn.silu(pre)
    return pre, self._split_qkv(qkv)

  def _conv_state(self, pre, state_after):
    """The convolution's cache, [..., q | k | v] channels in the parameters' order, from the
    projections before it (`_convolved_qkv`) and a function of one array of them."""
    if not isinstance(pre, tuple):
      return state_after(pre)
    states = []
    for p, h in zip(pre, self._part_heads()):
      s = writes_first(state_after(p), *h)
      states.append(s.reshape(s.shape[: p.ndim - 1] + (-1,)))
    return jnp.concatenate(states, axis=-1)

  def _output(self, o, x):
    """o [..., HV, V] -> [..., D]."""
    gate = None
    if self.use_gate:
      gate = self.g_proj(x).reshape(o.shape)
    o = self.o_norm(o, gate)
    return self.o_proj(o.reshape(o.shape[:-2] + (self.num_v_heads * self.value_dim,)))

  # -- whole sequence --------------------------------------------------------------------------

  def __call__(
    self,
    x: jax.Array,
    lengths: jax.Array | None = None,
    *,
    segment_ids: jax.Array | None = None,
    cu_seqlens: jax.Array | None = None,
    return_cache: bool = False,
    state_every: int | None = None,
  ) -> jax.Array | tuple:
    """The whole sequence through the layer's operator (`operator_fn`).

    Args:
      x: [B, T, D].
      lengths: None (every token is real) or [B] int: sequence b holds tokens [0, lengths[b])
        and the rest is right padding. Padding tokens leave the state untouched (beta = g = 0);
        their outputs are meaningless.
      segment_ids: None, or [B, T] int: packed documents, one id per token (a document is a run
        of equal ids; see `segment_starts`). At each document's first token the recurrent state
        is reset: the operator gets g = RESET_LOG_DECAY there, so exp(g) S = 0 exactly and the
        token writes into an empty state (any number of documents per row, any B, any
        operator_fn; see `cu_seqlens` for the operator's packed form), and the short convolution
        reads zeros instead of other documents' inputs. The forward is exact. In the chunked
        backward, a document that starts inside a chunk leaves rounding-level gradient (about
        1e-7 relative) in the log-decay of the earlier tokens of that chunk (through the chunk's
        cumulative sum of g, whose terms cancel only up to rounding); documents starting at
        multiples of `chunk_size` are exactly separated, also in the gradient
        (docs/train_lm.md). Not with `return_cache`.
      cu_seqlens: None, or int [N + 1] offsets of N documents packed in one row (B = 1):
        document n holds tokens [cu_seqlens[n], cu_seqlens[n + 1]) (docs/varlen.md). It is
        given to the operator (`operator_fn(..., cu_seqlens=...)`, which runs them as separate
        sequences: exact in the forward and the gradient wherever the documents start; an
        operator_fn without that argument, e.g. the sharded operator, is a ValueError) and the
        short convolution reads zeros across a boundary. May be traced (new boundaries with
        the same N do not recompile). With `return_cache` the cache has one row per document
        (B = N): a prefill of N packed prompts for a decode of N sequences. Not with `lengths`
        or `segment_ids`.
      return_cache: also return the `GatedDeltaProductCache` after lengths[b] tokens (after
        each document with cu_seqlens).
      state_every: N (with return_cache; an operator_fn taking `state_every`): also the caches
        after every N tokens, `GatedDeltaProductCache(conv [B, T // N, conv_size - 1, C],
        state [B, T // N, HV, K, V])` (docs/inference.md#prefix-caching). Not with cu_seqlens.

    Returns:
      y [B, T, D], or (y, cache) with `return_cache` ((y, cache, blocks) with `state_every`).
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
    pre, (q, k, v) = self._convolved_qkv(x, conv_segments)
    g, beta = self._gates(x)
    if segment_ids is not None:
      g = jnp.where(segment_starts(segment_ids)[..., None], RESET_LOG_DECAY, g)
    if lengths is not None:
      real = (jnp.arange(t_len)[None, :] < lengths[:, None])[..., None]  # [B, T, 1]
      g = jnp.where(real, g, 0.0)
      beta = jnp.where(real[..., None] if beta.ndim == 4 else real, beta, 0.0)
    every = {} if state_every is None else {"state_every": state_every}
    if every and (not return_cache or cu_seqlens is not None or isinstance(pre, tuple)):
      raise ValueError("state_every needs return_cache, and no cu_seqlens nor a mesh")
    o, final, *blocks = self._mix(
      x,
      q,
      k,
      v,
      g,
      beta,
      initial_state=None,
      output_final_state=return_cache,
      cu_seqlens=cu_seqlens,
      **every,
    )
    y = self._output(o, x)
    if not return_cache:
      return y
    conv = None
    if self.use_short_conv:
      if cu_seqlens is not None:
        state_after = lambda p: self.conv.state_after_packed(p, cu_seqlens)
      else:
        state_after = lambda p: self.conv.state_after(p, lengths)
      conv = self._conv_state(pre, state_after)
    if state_every is None:
      return y, GatedDeltaProductCache(conv, final)
    windows = None  # the convolution's inputs before each block end: [B, T // N, size - 1, C]
    if self.use_short_conv:
      size, ends = self.conv_size - 1, (jnp.arange(t_len // state_every) + 1) * state_every
      xp = jnp.pad(pre, ((0, 0), (size, 0), (0, 0)))
      windows = xp[:, ends[:, None] + jnp.arange(size)[None, :]]
    return y, GatedDeltaProductCache(conv, final), GatedDeltaProductCache(windows, blocks[0])

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
    if not takes_keyword(self.operator_fn, "cu_seqlens"):
      raise ValueError(
        f"cu_seqlens is not supported by this layer's operator_fn ({name_of(self.operator_fn)} "
        f"takes no cu_seqlens; with sharding use segment_ids)"
      )
    cu_seqlens, _ = check_cu_seqlens(cu_seqlens)
    check_cu_seqlens_values(cu_seqlens, t_len)
    return varlen.sanitize(cu_seqlens, t_len)

  # -- after a cache ---------------------------------------------------------------------------

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
    """One token per sequence: x [B, D] -> (y [B, D], new cache) through the layer's step
    (`step_fn`); `cache` from `init_cache(B)` or from a prefill (`return_cache=True`) of this
    layer."""
    _check_x(x, self.hidden_size, 2, "[B, D] (one token per sequence)")
    self._check_step_cache(cache, x.shape[0])
    x, (q, k, v), (g, beta), conv = self._step_inputs(x, cache, "step")
    o, state = self._mix_step(x, q, k, v, g, beta, cache.state)
    return self._output(o, x), GatedDeltaProductCache(conv, state)

  def step_tokens(
    self, x: jax.Array, cache: GatedDeltaProductCache, lengths: jax.Array | None = None
  ) -> tuple[jax.Array, GatedDeltaProductCache]:
    """Tq new tokens per sequence after the cache (speculative verification, chunked prefill
    from a cache): x [B, Tq, D] -> (y [B, Tq, D], the cache after the Tq tokens). The same as
    Tq calls of `step` (up to rounding): the short convolution runs over the Tq tokens from the
    cached inputs and the layer's operator (`operator_fn`) from the cached state
    (docs/inference.md#several-new-tokens-per-step). lengths [B] int (may be traced): only the
    first lengths[b] tokens are real (right padding, as in `__call__`): the cache is the one
    after them."""
    _check_x(x, self.hidden_size, 3, "[B, Tq, D] (Tq new tokens per sequence)")
    self._check_step_cache(cache, x.shape[0])
    x, (q, k, v), (g, beta), conv = self._step_inputs(x, cache, "step_tokens", lengths)
    if lengths is not None:
      real = (jnp.arange(x.shape[1])[None, :] < lengths[:, None])[..., None]  # [B, Tq, 1]
      g = jnp.where(real, g, 0.0)
      beta = jnp.where(real[..., None] if beta.ndim == 4 else real, beta, 0.0)
    o, state = self._mix(
      x,
      q,
      k,
      v,
      g,
      beta,
      initial_state=cache.state,
      output_final_state=True,
      cu_seqlens=None,
    )
    return self._output(o, x), GatedDeltaProductCache(conv, state)

  def _step_inputs(self, x, cache, conv_step, lengths=None):
    """x in the layer's dtype, (q, k, v), (g, beta) and the new convolution state of a step from
    a cache; conv_step names the short convolution's step: "step" (one token) or "step_tokens"
    (with `lengths`: the state after that many tokens)."""
    if self.dtype is not None:
      x = x.astype(self.dtype)
    pre = self._project_in(x)
    conv = None
    if self.use_short_conv:
      extra = () if lengths is None else (lengths,)
      qkv, conv = getattr(self.conv, conv_step)(pre, cache.conv, *extra)
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
