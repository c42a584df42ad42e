"""Grouped-query attention with RoPE (`GroupedQueryAttention`) and its KV cache (docs/layers.md)."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.typing import DTypeLike

from gdp_jax.layers import partitioning
from gdp_jax.layers.common import (
  ATTENTION_IMPLS,
  Linear,
  _check_cache,
  _check_choice,
  _check_lengths,
  _check_positive_int,
  _check_room,
  _check_segment_ids,
  _check_x,
  f32,
)
from gdp_jax.layers.partitioning import EMBED, HEADS, KV_HEADS
from gdp_jax.ops import registry
from gdp_jax.ops.gqa_decode.api import REGISTRY as DECODE_REGISTRY
from gdp_jax.ops.gqa_decode.api import gqa_decode
from gdp_jax.ops.once import jitted_kernels


class KVCache(NamedTuple):
  """Decode cache of one attention layer: key, value [B, S, Hkv, D] (keys already rotated) and
  lengths [B] int32, the number of tokens each sequence holds (slots >= length are stale)."""

  key: jax.Array
  value: jax.Array
  lengths: jax.Array


def apply_rope(x, positions, theta):
  """Rotary embedding, rotate-half convention. x [..., T?, H, D] with positions broadcasting
  against x.shape[:-2] (e.g. [T] for [B, T, H, D], [B] for [B, H, D])."""
  dim = x.shape[-1]
  freqs = theta ** (-jnp.arange(0, dim // 2, dtype=f32) * 2.0 / dim)
  angles = positions.astype(f32)[..., None] * freqs  # [..., D/2]
  cos, sin = jnp.cos(angles)[..., None, :], jnp.sin(angles)[..., None, :]
  x1, x2 = jnp.split(x.astype(f32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)


def _flash_attention(q, k, v, segment_ids):
  """Causal attention through JAX's Pallas flash attention kernel (forward and backward), with
  segment ids; q [B, T, Hq, Dh], k, v [B, T, Hkv, Dh] -> [B, T, Hq, Dh]. The layers of a model
  share one lowering of its kernels (`jitted_kernels`)."""
  return _flash_attention_once(q, k, v, segment_ids)


def _flash_attention_kernels(q, k, v, segment_ids):
  import warnings

  with warnings.catch_warnings():  # jax 0.12 points to the separate tokamax package
    warnings.simplefilter("ignore", DeprecationWarning)
    from jax.experimental.pallas.ops.gpu import attention as pallas_attention

  t_len, head_dim = q.shape[1], q.shape[-1]
  block = min(128, t_len)
  if t_len % block:
    raise ValueError(
      f"attention_impl='flash' needs T a multiple of {block} (the kernel's "
      f"block), got T = {t_len}; pad the sequence or use attention_impl='xla'"
    )
  group = q.shape[2] // k.shape[2]
  if group > 1:  # query head h reads key/value head h // group
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
  blocks = pallas_attention.BlockSizes(
    block_q=block,
    block_k=block,
    block_q_dkv=min(32, t_len),
    block_kv_dkv=min(32, t_len),
    block_q_dq=min(32, t_len),
    block_kv_dq=min(32, t_len),
  )
  return pallas_attention.mha(
    q,
    k,
    v,
    segment_ids,
    sm_scale=head_dim**-0.5,
    causal=True,
    block_sizes=blocks,
    interpret=registry.interpreted(),
  )


_flash_attention_once = jitted_kernels(_flash_attention_kernels)


class GroupedQueryAttention(nnx.Module):
  """Causal multi-head attention with grouped key/value heads and RoPE.

  Whole sequence: `layer(x, lengths=None, *, segment_ids=None, return_cache=False,
  cache_size=None)` (causal softmax attention; with right padding the real tokens never see
  padding; with segment_ids [B, T] a token attends only to earlier tokens of its own document).
  One token:
  `layer.step(x_t, cache)`, which writes the new key/value at slot `cache.lengths[b]` of a
  fixed-size cache and attends through `gqa_decode` with the traced lengths (no recompilation
  as lengths change). A token written past the cache's size S is dropped: size the cache for
  prompt + generated tokens. x must be floating-point activations (integer x, e.g. token ids,
  is a TypeError naming its dtype); this layer has no gates (g, beta) to keep in range.

  Args:
    hidden_size: D. num_heads: query heads Hq. num_kv_heads: Hkv (divides Hq; default Hq).
    head_dim: per head (even, for RoPE; default D / Hq). rope_theta: RoPE base.
    cache_dtype: dtype of the KV cache (default float32; bfloat16 halves decode traffic).
    implementation: for `gqa_decode` (None: Pallas on GPU).
    attention_impl: the whole-sequence attention. "xla": `jax.nn.dot_product_attention`
      (segment ids as a boolean [B, 1, T, T] mask; the scores are materialised). "flash":
      JAX's Pallas flash attention (`jax.experimental.pallas.ops.gpu.attention.mha`: Triton on
      a GPU, interpreted elsewhere), causal with segment ids in the kernel, key/value heads
      repeated to the query heads; T must be a multiple of min(T, 128).
    dtype, param_dtype, rngs: as usual.
  """

  def __init__(
    self,
    hidden_size: int,
    num_heads: int,
    num_kv_heads: int | None = None,
    head_dim: int | None = None,
    *,
    rope_theta: float = 10000.0,
    cache_dtype: DTypeLike = f32,
    implementation: str | None = None,
    attention_impl: str = "xla",
    dtype: DTypeLike | None = None,
    param_dtype: DTypeLike = f32,
    rngs: nnx.Rngs,
  ) -> None:
    _check_positive_int("hidden_size", hidden_size)
    _check_positive_int("num_heads", num_heads)
    num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    _check_positive_int("num_kv_heads", num_kv_heads)
    if num_heads % num_kv_heads != 0:
      raise ValueError(
        f"num_heads = {num_heads} must be a multiple of num_kv_heads = "
        f"{num_kv_heads} (query head h reads key/value head h // "
        f"(num_heads // num_kv_heads))"
      )
    if head_dim is None:
      if hidden_size % num_heads != 0:
        raise ValueError(
          f"hidden_size = {hidden_size} is not divisible by num_heads = "
          f"{num_heads}; pass head_dim explicitly"
        )
      head_dim = hidden_size // num_heads
    _check_positive_int("head_dim", head_dim)
    if head_dim % 2 != 0:
      raise ValueError(f"head_dim must be even for RoPE, got {head_dim}")
    if implementation is not None:
      DECODE_REGISTRY.resolve(implementation)  # a clear error if unknown
    _check_choice("attention_impl", attention_impl, ATTENTION_IMPLS)
    self.attention_impl = attention_impl
    self.hidden_size, self.num_heads, self.num_kv_heads = hidden_size, num_heads, num_kv_heads
    self.head_dim, self.rope_theta = head_dim, float(rope_theta)
    self.cache_dtype, self.implementation, self.dtype = cache_dtype, implementation, dtype

    def lin(i, o, names):  # logical axes: docs/sharding.md#annotated-parameters
      init = partitioning.partitioned(nnx.initializers.lecun_normal(), names)
      return Linear(
        i, o, use_bias=False, dtype=dtype, param_dtype=param_dtype, kernel_init=init, rngs=rngs
      )

    self.q_proj = lin(hidden_size, num_heads * head_dim, (EMBED, HEADS))
    self.k_proj = lin(hidden_size, num_kv_heads * head_dim, (EMBED, KV_HEADS))
    self.v_proj = lin(hidden_size, num_kv_heads * head_dim, (EMBED, KV_HEADS))
    self.o_proj = lin(num_heads * head_dim, hidden_size, (HEADS, EMBED))

  def _qkv(self, x):
    shape = x.shape[:-1]
    q = self.q_proj(x).reshape(shape + (self.num_heads, self.head_dim))
    k = self.k_proj(x).reshape(shape + (self.num_kv_heads, self.head_dim))
    v = self.v_proj(x).reshape(shape + (self.num_kv_heads, self.head_dim))
    return q, k, v

  def init_cache(self, batch_size: int, cache_size: int, dtype: DTypeLike | None = None) -> KVCache:
    """An empty cache of `cache_size` slots per sequence."""
    _check_positive_int("cache_size", cache_size)
    shape = (batch_size, cache_size, self.num_kv_heads, self.head_dim)
    dtype = dtype or self.cache_dtype
    return KVCache(
      jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros((batch_size,), jnp.int32)
    )

  def __call__(
    self,
    x: jax.Array,
    lengths: jax.Array | None = None,
    *,
    segment_ids: jax.Array | None = None,
    return_cache: bool = False,
    cache_size: int | None = None,
  ) -> jax.Array | tuple[jax.Array, KVCache]:
    """Causal attention over x [B, T, D] -> y [B, T, D]; with `return_cache`, also the KVCache
    of `cache_size` slots (default T) holding each sequence's first lengths[b] tokens.
    segment_ids [B, T] int (packed documents; not with `return_cache`): token t attends to
    token s <= t only when segment_ids[b, s] == segment_ids[b, t]. Positions (RoPE) stay the
    row's 0..T-1: attention scores depend only on t - s, so a document's scores do not depend
    on where it starts."""
    _check_x(x, self.hidden_size, 3, "[B, T, D]")
    batch, t_len, _ = x.shape
    lengths = _check_lengths(lengths, batch, t_len)
    segment_ids = _check_segment_ids(segment_ids, batch, t_len)
    if segment_ids is not None and return_cache:
      raise ValueError(
        "segment_ids with return_cache is not supported: a decode cache "
        "continues one sequence per row, not packed documents"
      )
    if self.dtype is not None:
      x = x.astype(self.dtype)
    q, k, v = self._qkv(x)
    pos = jnp.arange(t_len)
    q, k = apply_rope(q, pos, self.rope_theta), apply_rope(k, pos, self.rope_theta)
    if self.attention_impl == "flash":
      o = _flash_attention(q, k, v, segment_ids)
    else:
      mask = None
      if segment_ids is not None:
        mask = (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]  # [B, 1, T, T]
      o = jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True)
    y = self.o_proj(o.reshape(batch, t_len, self.num_heads * self.head_dim))
    if not return_cache:
      return y
    cache_size = t_len if cache_size is None else cache_size
    if cache_size < t_len:
      raise ValueError(f"cache_size = {cache_size} is smaller than the sequence (T = {t_len})")
    cache = self.init_cache(batch, cache_size)
    cache = KVCache(
      jax.lax.dynamic_update_slice_in_dim(cache.key, k.astype(cache.key.dtype), 0, axis=1),
      jax.lax.dynamic_update_slice_in_dim(cache.value, v.astype(cache.value.dtype), 0, axis=1),
      jnp.full((batch,), t_len, jnp.int32) if lengths is None else lengths,
    )
    return y, cache

  def step(self, x: jax.Array, cache: KVCache) -> tuple[jax.Array, KVCache]:
    """One token per sequence at position cache.lengths[b]: x [B, D] -> (y [B, D], cache);
    `cache` from `init_cache(B, S)` or from a prefill (`return_cache=True`) of this layer."""
    _check_x(x, self.hidden_size, 2, "[B, D] (one token per sequence)")
    batch = x.shape[0]
    self._check_step_cache(cache, batch)
    if self.dtype is not None:
      x = x.astype(self.dtype)
    q, k, v = self._qkv(x)  # [B, H, Dh]
    pos = cache.lengths
    q, k = apply_rope(q, pos, self.rope_theta), apply_rope(k, pos, self.rope_theta)
    rows = jnp.arange(batch)
    key = cache.key.at[rows, pos].set(k.astype(cache.key.dtype), mode="drop")
    value = cache.value.at[rows, pos].set(v.astype(cache.value.dtype), mode="drop")
    lengths = pos + 1
    o = gqa_decode(q, key, value, lengths, implementation=self.implementation)
    y = self.o_proj(o.astype(x.dtype).reshape(batch, self.num_heads * self.head_dim))
    return y, KVCache(key, value, lengths)

  def _check_step_cache(self, cache, batch):
    size = None if cache is None or not hasattr(cache, "key") else np.shape(cache.key)[1]
    kv = (batch, size, self.num_kv_heads, self.head_dim)
    _check_cache(
      cache,
      KVCache,
      {
        "key": (kv, "[B, S, Hkv, Dh]"),
        "value": (kv, "[B, S, Hkv, Dh]"),
        "lengths": ((batch,), "[B]"),
      },
    )

  def step_tokens(
    self, x: jax.Array, cache: KVCache, lengths: jax.Array | None = None
  ) -> tuple[jax.Array, KVCache]:
    """Tq new tokens per sequence at positions cache.lengths[b] + i (speculative verification,
    chunked prefill from a cache): x [B, Tq, D] -> (y [B, Tq, D], cache). The Tq keys/values
    are written at slots lengths .. lengths + Tq - 1 and `gqa_decode` attends the [B, Tq, Hq, Dh]
    query, each token seeing the cache up to itself: the same as Tq calls of `step`. Tq larger
    than the cache's size S, or concrete lengths with lengths + Tq > S, are a ValueError; under
    `jax.jit` tokens past S are dropped (as in `step`): size the cache for them. lengths [B]
    int (may be traced): only the first lengths[b] tokens are real (right padding): all Tq are
    written, the cache's lengths advance by lengths[b] (the later slots are stale)."""
    _check_x(x, self.hidden_size, 3, "[B, Tq, D] (Tq new tokens per sequence)")
    batch, t_len, _ = x.shape
    self._check_step_cache(cache, batch)
    _check_room(cache.lengths, t_len, cache.key.shape[1], "the cache's S slots")
    if self.dtype is not None:
      x = x.astype(self.dtype)
    q, k, v = self._qkv(x)  # [B, Tq, H, Dh]
    pos = cache.lengths[:, None] + jnp.arange(t_len, dtype=jnp.int32)  # [B, Tq]
    q, k = apply_rope(q, pos, self.rope_theta), apply_rope(k, pos, self.rope_theta)
    rows = jnp.arange(batch)[:, None]
    key = cache.key.at[rows, pos].set(k.astype(cache.key.dtype), mode="drop")
    value = cache.value.at[rows, pos].set(v.astype(cache.value.dtype), mode="drop")
    ends = cache.lengths + t_len
    o = gqa_decode(q, key, value, ends, implementation=self.implementation)
    y = self.o_proj(o.astype(x.dtype).reshape(batch, t_len, self.num_heads * self.head_dim))
    return y, KVCache(key, value, ends if lengths is None else cache.lengths + lengths)
