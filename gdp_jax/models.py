"""A small hybrid causal language model (gated delta product, DeltaProduct and grouped-query
attention layers) and `generate` for a batch of prompts of different lengths.

    config = HybridConfig(vocab_size=256, hidden_size=128, layer_pattern="DDA")   # or e.g. "DHA"
    model = HybridLM(config, rngs=nnx.Rngs(0))
    logits = model(tokens)                                 # [B, T, vocab] float32
    new_tokens = generate(model, [[1, 2, 3], [4, 5]], 8)   # [B, 8] int32, greedy

Prefill runs the whole (right-padded) prompts through the chunked operator and causal attention
(short prompts: through the decode step, in the decode loop's program); the decode loop is one
`jax.jit`-ed `fori_loop` of `HybridLM.step` with the per-sequence lengths and the step count
traced, so prompts of new lengths and other numbers of new tokens reuse the compiled programs
(shapes are rounded up to multiples of `pad_to`).
`generate(..., page_size=16)` keeps the attention layers' decode cache in pages
(`PagedKVCache`, `paged_gqa_decode`; docs/inference.md#paged-kv-cache).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gdp_jax.layers import (
  ATTENTION_IMPLS,
  KEY_NORMS,
  MASK_MODES,
  GatedDeltaProduct,
  GatedDeltaProductCache,
  GatedRMSNorm,
  GroupedQueryAttention,
  HouseholderDeltaProduct,
  KVCache,
  Linear,
  _check_room,
  apply_rope,
  partitioning,
)
from gdp_jax.layers.partitioning import EMBED, MLP, VOCAB
from gdp_jax.ops.gqa_decode.api import paged_gqa_decode
from gdp_jax.sharding import ShardingConfig

f32 = jnp.float32
LAYER_KINDS = {
  "D": "gated delta product",
  "H": "DeltaProduct (Householder)",
  "A": "grouped-query attention",
}
# HybridConfig.mask_mode: the block masks of `GatedDeltaProduct`, or "householder": every "D"
# layer a `HouseholderDeltaProduct` (the same as writing "H" for it).
CONFIG_MASK_MODES = (*MASK_MODES, "householder")


@dataclasses.dataclass(frozen=True)
class HybridConfig:
  """Configuration of `HybridLM`.

  layer_pattern: one letter per layer, "D" (`layers.GatedDeltaProduct` with the block mask of
    `mask_mode`), "H" (`layers.HouseholderDeltaProduct`: DeltaProduct with `num_householder`
    steps per token) or "A" (GroupedQueryAttention), e.g. "DDA" = two delta product layers
    then one attention layer, "DHA" = a block-mask layer, a DeltaProduct layer and an
    attention layer.
  Delta product layers ("D" and "H"): num_heads, head_dim (K), expand_v, use_short_conv,
    use_gate, allow_neg_eigval, chunk_size; for "D" layers num_blocks (r), mask_mode,
    key_norm, beta_norm (see `layers.GatedDeltaProduct`); num_householder (n_h) for "H" layers
    (see `layers.HouseholderDeltaProduct`). mask_mode = "householder" makes every "D" layer an
    "H" layer.
  Attention layers: attn_num_heads, attn_num_kv_heads, attn_head_dim (default
    hidden_size // attn_num_heads), rope_theta, attn_impl ("xla" or "flash": the
    whole-sequence attention, see `layers.GroupedQueryAttention`'s attention_impl).
  mlp_ratio: SwiGLU hidden size = mlp_ratio * hidden_size (0: no MLP).
  implementation: for the operator and decode steps (None: Pallas on a GPU).
  """

  vocab_size: int
  hidden_size: int = 64
  layer_pattern: str = "DA"
  num_heads: int = 2
  head_dim: int = 32
  expand_v: Any = 1
  num_blocks: int = 2
  mask_mode: str = "static"
  key_norm: str = "block"
  use_short_conv: bool = True
  use_gate: bool = True
  allow_neg_eigval: bool = False
  beta_norm: bool = True
  chunk_size: int = 64
  num_householder: int = 2
  attn_num_heads: int = 2
  attn_num_kv_heads: int = 1
  attn_head_dim: int | None = None
  rope_theta: float = 10000.0
  attn_impl: str = "xla"
  mlp_ratio: int = 4
  norm_eps: float = 1e-5
  tie_embeddings: bool = False
  implementation: str | None = None
  dtype: Any = None

  def __post_init__(self):
    if not isinstance(self.layer_pattern, str) or not self.layer_pattern:
      raise ValueError(
        f"layer_pattern must be a non-empty string of 'D' (gated delta product), "
        f"'H' (DeltaProduct) and 'A' (attention) letters, got "
        f"{self.layer_pattern!r}"
      )
    bad = sorted(set(self.layer_pattern) - set(LAYER_KINDS))
    if bad:
      raise ValueError(
        f"layer_pattern = {self.layer_pattern!r} has unknown letters {bad}; "
        f"expected only 'D' (gated delta product), 'H' (DeltaProduct, "
        f"Householder steps) and 'A' (attention)"
      )
    for name in ("vocab_size", "hidden_size", "num_householder"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if self.mask_mode not in CONFIG_MASK_MODES:
      raise ValueError(f"mask_mode must be one of {CONFIG_MASK_MODES}, got {self.mask_mode!r}")
    if self.key_norm not in KEY_NORMS:
      raise ValueError(f"key_norm must be one of {KEY_NORMS}, got {self.key_norm!r}")
    if self.attn_impl not in ATTENTION_IMPLS:
      raise ValueError(f"attn_impl must be one of {ATTENTION_IMPLS}, got {self.attn_impl!r}")
    if not isinstance(self.mlp_ratio, int) or self.mlp_ratio < 0:
      raise ValueError(f"mlp_ratio must be a non-negative integer, got {self.mlp_ratio!r}")


class SwiGLU(nnx.Module):
  def __init__(self, hidden_size, intermediate_size, *, dtype=None, rngs):
    def lin(i, o, names):  # logical axes: docs/sharding.md#annotated-parameters
      init = partitioning.partitioned(nnx.initializers.lecun_normal(), names)
      return Linear(i, o, use_bias=False, dtype=dtype, kernel_init=init, rngs=rngs)

    self.gate = lin(hidden_size, intermediate_size, (EMBED, MLP))
    self.up = lin(hidden_size, intermediate_size, (EMBED, MLP))
    self.down = lin(intermediate_size, hidden_size, (MLP, EMBED))

  def __call__(self, x):
    return self.down(jax.nn.silu(self.gate(x)) * self.up(x))


class PagedKVCache(NamedTuple):
  """Paged decode cache of one attention layer (docs/inference.md#paged-kv-cache): key_pages,
  value_pages [num_pages, page_size, Hkv, Dh] (keys already rotated), block_tables
  [B, max_pages] int32 (position p of sequence b is slot p % page_size of page
  block_tables[b, p // page_size]) and lengths [B] int32 (tokens each sequence holds)."""

  key_pages: jax.Array
  value_pages: jax.Array
  block_tables: jax.Array
  lengths: jax.Array


def to_paged(cache: KVCache, page_size: int) -> PagedKVCache:
  """A dense `KVCache` [B, S, Hkv, Dh] (S a multiple of page_size) moved into a page pool of
  B * S / page_size pages. The sequences' pages are interleaved in the pool (page i of sequence b
  is page i * B + b), so the decode reads them through the table, as from a server's pool."""
  batch, size, kv_heads, dim = cache.key.shape
  if size % page_size:
    raise ValueError(f"the cache's {size} slots are not a multiple of page_size = {page_size}")
  max_pages = size // page_size
  tables = jnp.arange(max_pages, dtype=jnp.int32)[None, :] * batch
  tables = tables + jnp.arange(batch, dtype=jnp.int32)[:, None]

  def pages(x):
    pool = jnp.zeros((batch * max_pages, page_size, kv_heads, dim), x.dtype)
    return pool.at[tables.reshape(-1)].set(x.reshape(batch * max_pages, page_size, kv_heads, dim))

  return PagedKVCache(pages(cache.key), pages(cache.value), tables, cache.lengths)


def paged_attention_step(
  layer: GroupedQueryAttention, x: jax.Array, cache: PagedKVCache
) -> tuple[jax.Array, PagedKVCache]:
  """`layer.step` with a `PagedKVCache`: one token per sequence at position cache.lengths[b],
  written into its page, then `paged_gqa_decode` (x [B, D] -> (y [B, D], cache)). As in the
  dense step, a token past the capacity (max_pages * page_size) is dropped."""
  batch = x.shape[0]
  if layer.dtype is not None:
    x = x.astype(layer.dtype)
  q, k, v = layer._qkv(x)  # [B, H, Dh]
  pos = cache.lengths
  q, k = apply_rope(q, pos, layer.rope_theta), apply_rope(k, pos, layer.rope_theta)
  num_pages, page_size = cache.key_pages.shape[:2]
  max_pages = cache.block_tables.shape[1]
  entry = jnp.minimum(pos // page_size, max_pages - 1)[:, None]
  page = jnp.take_along_axis(cache.block_tables, entry, axis=1)[:, 0]
  page = jnp.where(pos < max_pages * page_size, page, num_pages)  # out of range: dropped
  slot = pos % page_size
  key_pages = cache.key_pages.at[page, slot].set(k.astype(cache.key_pages.dtype), mode="drop")
  value_pages = cache.value_pages.at[page, slot].set(v.astype(cache.value_pages.dtype), mode="drop")
  lengths = pos + 1
  o = paged_gqa_decode(
    q, key_pages, value_pages, cache.block_tables, lengths, implementation=layer.implementation
  )
  y = layer.o_proj(o.astype(x.dtype).reshape(batch, layer.num_heads * layer.head_dim))
  return y, PagedKVCache(key_pages, value_pages, cache.block_tables, lengths)


def paged_attention_step_tokens(
  layer: GroupedQueryAttention, x: jax.Array, cache: PagedKVCache
) -> tuple[jax.Array, PagedKVCache]:
  """`layer.step_tokens` with a `PagedKVCache`: Tq new tokens per sequence at positions
  cache.lengths[b] + i, written into their pages, then `paged_gqa_decode` with the
  [B, Tq, Hq, Dh] query (x [B, Tq, D] -> (y [B, Tq, D], cache)); the same as Tq calls of
  `paged_attention_step`. Tq beyond the capacity (max_pages * page_size), or concrete lengths
  with lengths + Tq beyond it, are a ValueError; under `jax.jit` tokens past it are dropped."""
  if not hasattr(x, "ndim") or x.ndim != 3 or x.shape[-1] != layer.hidden_size:
    raise ValueError(
      f"x has shape {tuple(np.shape(x))}, expected [B, Tq, D] (Tq new tokens per sequence) "
      f"with D = hidden_size = {layer.hidden_size}"
    )
  if not isinstance(cache, PagedKVCache):
    raise TypeError(f"cache must be a PagedKVCache, got {type(cache).__name__}")
  batch, t_len, _ = x.shape
  if cache.lengths.shape != (batch,) or cache.block_tables.shape[0] != batch:
    raise ValueError(
      f"cache.lengths {tuple(cache.lengths.shape)} and cache.block_tables "
      f"{tuple(cache.block_tables.shape)} must have B = {batch} rows (x of shape "
      f"{tuple(x.shape)}): a cache of another batch size?"
    )
  num_pages, page_size = cache.key_pages.shape[:2]
  max_pages = cache.block_tables.shape[1]
  capacity = max_pages * page_size
  _check_room(cache.lengths, t_len, capacity, "the cache's pages (max_pages * page_size)")
  if layer.dtype is not None:
    x = x.astype(layer.dtype)
  q, k, v = layer._qkv(x)  # [B, Tq, H, Dh]
  pos = cache.lengths[:, None] + jnp.arange(t_len, dtype=jnp.int32)  # [B, Tq]
  q, k = apply_rope(q, pos, layer.rope_theta), apply_rope(k, pos, layer.rope_theta)
  entry = jnp.minimum(pos // page_size, max_pages - 1)
  page = jnp.take_along_axis(cache.block_tables, entry, axis=1)
  page = jnp.where(pos < capacity, page, num_pages)  # out of range: dropped
  slot = pos % page_size
  key_pages = cache.key_pages.at[page, slot].set(k.astype(cache.key_pages.dtype), mode="drop")
  value_pages = cache.value_pages.at[page, slot].set(v.astype(cache.value_pages.dtype), mode="drop")
  lengths = cache.lengths + t_len
  o = paged_gqa_decode(
    q, key_pages, value_pages, cache.block_tables, lengths, implementation=layer.implementation
  )
  y = layer.o_proj(o.astype(x.dtype).reshape(batch, t_len, layer.num_heads * layer.head_dim))
  return y, PagedKVCache(key_pages, value_pages, cache.block_tables, lengths)


class Block(nnx.Module):
  """Pre-norm residual block: x + mixer(norm(x)), then x + mlp(norm(x))."""

  def __init__(self, kind: str, c: HybridConfig, *, rngs: nnx.Rngs, sharding=None):
    self.kind = kind
    self.mixer_norm = GatedRMSNorm(c.hidden_size, eps=c.norm_eps)
    self.mixer: GatedDeltaProduct | HouseholderDeltaProduct | GroupedQueryAttention
    delta: dict[str, Any] = dict(  # the settings both delta layers take
      expand_v=c.expand_v,
      use_short_conv=c.use_short_conv,
      use_gate=c.use_gate,
      allow_neg_eigval=c.allow_neg_eigval,
      norm_eps=c.norm_eps,
      chunk_size=c.chunk_size,
      implementation=c.implementation,
      dtype=c.dtype,
      rngs=rngs,
    )
    if kind == "H" or (kind == "D" and c.mask_mode == "householder"):
      if sharding is not None:
        raise ValueError(
          "sharding is not supported with DeltaProduct layers ('H' in layer_pattern, or "
          "mask_mode='householder') yet; use sharding=None or 'D' layers with a block mask"
        )
      self.mixer = HouseholderDeltaProduct(
        c.hidden_size, c.num_heads, c.head_dim, num_householder=c.num_householder, **delta
      )
    elif kind == "D":
      self.mixer = GatedDeltaProduct(
        c.hidden_size,
        c.num_heads,
        c.head_dim,
        num_blocks=c.num_blocks,
        mask_mode=c.mask_mode,
        key_norm=c.key_norm,
        beta_norm=c.beta_norm,
        sharding=sharding,
        **delta,
      )
    else:
      self.mixer = GroupedQueryAttention(
        c.hidden_size,
        c.attn_num_heads,
        c.attn_num_kv_heads,
        c.attn_head_dim,
        rope_theta=c.rope_theta,
        implementation=None if c.implementation == "reference" else c.implementation,
        attention_impl=c.attn_impl,
        dtype=c.dtype,
        rngs=rngs,
      )
    self.use_mlp = bool(c.mlp_ratio)
    if self.use_mlp:
      self.mlp_norm = GatedRMSNorm(c.hidden_size, eps=c.norm_eps)
      self.mlp = SwiGLU(c.hidden_size, c.mlp_ratio * c.hidden_size, dtype=c.dtype, rngs=rngs)

  def _mlp(self, x):
    return x + self.mlp(self.mlp_norm(x)) if self.use_mlp else x

  def __call__(self, x, lengths=None, *, segment_ids=None, return_cache=False, cache_size=None):
    kw = dict(cache_size=cache_size) if self.kind == "A" and return_cache else {}
    if segment_ids is not None:
      kw["segment_ids"] = segment_ids
    out = self.mixer(self.mixer_norm(x), lengths, return_cache=return_cache, **kw)
    y, cache = out if return_cache else (out, None)
    x = self._mlp(x + y.astype(x.dtype))
    return (x, cache) if return_cache else x

  def step(self, x, cache):
    if isinstance(cache, PagedKVCache):
      y, cache = paged_attention_step(self.mixer, self.mixer_norm(x), cache)
    else:
      y, cache = self.mixer.step(self.mixer_norm(x), cache)
    return self._mlp(x + y.astype(x.dtype)), cache

  def step_tokens(self, x, cache):
    if isinstance(cache, PagedKVCache):
      y, cache = paged_attention_step_tokens(self.mixer, self.mixer_norm(x), cache)
    else:
      y, cache = self.mixer.step_tokens(self.mixer_norm(x), cache)
    return self._mlp(x + y.astype(x.dtype)), cache


def _check_tokens(tokens, vocab_size, name="tokens"):
  """`tokens` as an integer array, checked (docs in `HybridLM.__call__`): a TypeError unless
  its dtype is an integer one; concrete (not traced) ids outside [0, vocab_size) a ValueError
  naming the first one, its position and the vocabulary size."""
  if not hasattr(tokens, "dtype"):
    tokens = np.asarray(tokens)
  if not jnp.issubdtype(tokens.dtype, jnp.integer) or tokens.dtype == jnp.bool_:
    raise TypeError(
      f"{name} must be integer token ids (e.g. int32) in [0, vocab_size = {vocab_size}), "
      f"got dtype {tokens.dtype}"
    )
  if not isinstance(tokens, jax.core.Tracer):
    ids = np.asarray(tokens)
    bad = (ids < 0) | (ids >= vocab_size)
    if bad.any():
      where = tuple(int(i) for i in np.argwhere(bad)[0])
      raise ValueError(
        f"{name} holds id {int(ids[where])} at position {list(where)}, outside "
        f"[0, vocab_size = {vocab_size}) ({int(bad.sum())} such id(s))"
      )
  return tokens


class HybridLM(nnx.Module):
  """Embedding, `len(layer_pattern)` residual blocks, final RMSNorm, vocabulary projection.

  `model(tokens [B, T], lengths=None, *, segment_ids=None) -> logits [B, T, vocab]` (float32;
  segment_ids [B, T] packs several documents in a row, none seeing another: see
  `layers.GatedDeltaProduct.__call__` and `layers.GroupedQueryAttention.__call__`);
  `model.prefill(tokens, lengths, cache_size) -> (logits, cache)`;
  `model.step(token [B], cache) -> (logits [B, vocab], cache)`;
  `model.step_tokens(tokens [B, Tq], cache) -> (logits [B, Tq, vocab], cache)` (Tq steps at once);
  `model.init_cache(batch_size, cache_size)`. The cache is a tuple with one entry per layer
  (`GatedDeltaProductCache` or `KVCache`; an attention layer's `KVCache` may be replaced by its
  paged form, `to_paged(cache, page_size)`, which `step` decodes with `paged_gqa_decode`).

  Every parameter carries logical axis names (`nnx.with_partitioning`; heads, key/value heads
  and the MLP's hidden units split over "model" by `gdp_jax.layers.LOGICAL_AXIS_RULES`): under
  `nnx.logical_axis_rules` `nnx.get_partition_spec(nnx.state(model))` places the model for a
  data x tensor parallel step under plain `jax.jit` (docs/sharding.md#annotated-parameters).

  `sharding`: a `gdp_jax.sharding.ShardingConfig` for the gated delta product layers (their
  operator runs split over batch, heads and sequence under `jax.shard_map`: the explicit form,
  and the way to split the sequence), or None. The rest of the model is jnp code that XLA
  partitions from the inputs' layout (shard the tokens over the batch axes for data
  parallelism).
  """

  def __init__(
    self, config: HybridConfig, *, rngs: nnx.Rngs, sharding: ShardingConfig | None = None
  ) -> None:
    self.config = config
    c = config
    self.embed = nnx.Embed(
      c.vocab_size,
      c.hidden_size,
      embedding_init=partitioning.partitioned(nnx.initializers.normal(1.0), (VOCAB, EMBED)),
      rngs=rngs,
    )
    blocks = [Block(kind, c, rngs=rngs, sharding=sharding) for kind in c.layer_pattern]
    self.blocks = nnx.List(blocks) if hasattr(nnx, "List") else blocks
    self.final_norm = GatedRMSNorm(c.hidden_size, eps=c.norm_eps)
    if not c.tie_embeddings:
      head_init = partitioning.partitioned(nnx.initializers.lecun_normal(), (EMBED, VOCAB))
      self.lm_head = nnx.Linear(
        c.hidden_size, c.vocab_size, use_bias=False, kernel_init=head_init, rngs=rngs
      )

  def _logits(self, x):
    x = self.final_norm(x).astype(f32)
    if self.config.tie_embeddings:
      return x @ self.embed.embedding[...].astype(f32).T
    return self.lm_head(x).astype(f32)

  def _embed(self, tokens, name="tokens"):
    x = self.embed(_check_tokens(tokens, self.config.vocab_size, name))
    return x if self.config.dtype is None else x.astype(self.config.dtype)

  def __call__(
    self,
    tokens: jax.Array,
    lengths: jax.Array | None = None,
    *,
    segment_ids: jax.Array | None = None,
  ) -> jax.Array:
    """tokens [B, T] int -> logits [B, T, vocab] float32 (lengths [B]: right padding;
    segment_ids [B, T]: packed documents).

    Token ids (here and in `prefill`, `step`, `step_tokens`) must be integers in
    [0, vocab_size): float or bool tokens are a TypeError; concrete ids outside the range are a
    ValueError naming the first such id and its position. Traced ids (under `jax.jit`) cannot
    be checked: an id in [-vocab_size, -1] reads the embedding row counted from the end (NumPy
    indexing) and any other id out of range gives a NaN embedding, hence NaN logits for that
    position and every later one it reaches (`jnp.take`'s fill mode)."""
    return self.from_embeddings(self._embed(tokens), lengths, segment_ids=segment_ids)

  def from_embeddings(self, x, lengths=None, *, segment_ids=None):
    """The model after its embedding: x [B, T, D] (embedded tokens) -> logits [B, T, vocab]."""
    for block in self.blocks:
      x = block(x, lengths, segment_ids=segment_ids)
    return self._logits(x)

  def prefill(
    self, tokens: jax.Array, lengths: jax.Array | None = None, cache_size: int | None = None
  ) -> tuple[jax.Array, tuple]:
    """The whole right-padded prompts [B, T] (sequence b holds lengths[b] tokens): the logits
    [B, T, vocab] and the cache after each sequence's tokens (attention caches of
    `cache_size` slots, default T)."""
    x = self._embed(tokens)
    caches = []
    for block in self.blocks:
      x, cache = block(x, lengths, return_cache=True, cache_size=cache_size)
      caches.append(cache)
    return self._logits(x), tuple(caches)

  def init_cache(self, batch_size: int, cache_size: int) -> tuple:
    """The empty cache (no tokens yet); attention layers get `cache_size` slots."""
    caches: list[KVCache | GatedDeltaProductCache] = []
    for b in self.blocks:
      mixer = b.mixer
      if isinstance(mixer, GroupedQueryAttention):
        caches.append(mixer.init_cache(batch_size, cache_size))
      else:
        caches.append(mixer.init_cache(batch_size))
    return tuple(caches)

  def step(self, token: jax.Array, cache: tuple) -> tuple[jax.Array, tuple]:
    """One token per sequence: token [B] int -> (logits [B, vocab] float32, new cache); `cache`
    from `init_cache` or `prefill`, one entry per layer."""
    self._check_cache_tuple(cache)
    x = self._embed(token, "token")
    new = []
    for block, c in zip(self.blocks, cache):
      x, c = block.step(x, c)
      new.append(c)
    return self._logits(x), tuple(new)

  def step_tokens(self, tokens: jax.Array, cache: tuple) -> tuple[jax.Array, tuple]:
    """Tq new tokens per sequence after the cache (speculative verification, chunked prefill
    from a cache): tokens [B, Tq] int -> (logits [B, Tq, vocab] float32, the cache after them).
    The same as Tq calls of `step` (up to rounding): each delta product layer runs its chunked
    operator from the cached state, each attention layer writes the Tq keys/values and decodes
    the [B, Tq] queries (`gqa_decode` / `paged_gqa_decode`). Attention caches must have room
    for Tq more tokens (docs/inference.md#several-new-tokens-per-step)."""
    if not hasattr(tokens, "ndim") or tokens.ndim != 2:
      raise ValueError(
        f"tokens has shape {tuple(np.shape(tokens))}, expected [B, Tq] (Tq new tokens per "
        f"sequence; `step` takes one token [B])"
      )
    self._check_cache_tuple(cache)
    x = self._embed(tokens)
    new = []
    for block, c in zip(self.blocks, cache):
      x, c = block.step_tokens(x, c)
      new.append(c)
    return self._logits(x), tuple(new)

  def _check_cache_tuple(self, cache):
    if not isinstance(cache, (tuple, list)) or len(cache) != len(self.blocks):
      raise TypeError(
        f"cache must be a tuple with one entry per layer ({len(self.blocks)}, "
        f"layer_pattern = {self.config.layer_pattern!r}) from init_cache or "
        f"prefill, got {type(cache).__name__}"
        + (f" of length {len(cache)}" if isinstance(cache, (tuple, list)) else "")
      )


# ----------------------------------------------------------------------------------------------
# Generation
# ----------------------------------------------------------------------------------------------


def _round_up(n, m):
  return max(m, -(-n // m) * m)


def _pick(logits, key, temperature):
  if temperature == 0.0:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  return jax.random.categorical(key, logits / temperature, axis=-1).astype(jnp.int32)


# XLA options of generate's two programs (docs/performance.md#compile-time). XLA's GPU GEMM
# autotuner compiles and times many configurations of every distinct matmul of a program; the
# decode loop's matmuls are [B, D] x [D, *] for a handful of sequences B (latency bound,
# microseconds whichever configuration runs), so the loop is compiled without it. The prefill
# keeps XLA's default: its matmuls grow with the prompts. The options are part of the persistent
# cache's key.
PREFILL_COMPILER_OPTIONS: dict[str, Any] = {}
DECODE_COMPILER_OPTIONS: dict[str, Any] = {"xla_gpu_autotune_level": 0}
# prefill="auto": prompts padded to at most this many tokens are read by the decode step in the
# decode loop (one program, no chunked kernels to compile: seconds less on a first call, at most
# this many more sequential steps per call); longer ones by the chunked operator
# (docs/performance.md#compile-time).
STEP_PREFILL_TOKENS = 64
PREFILL_MODES = ("auto", "chunked", "steps")


def _prefill_program(graphdef, state, tokens, lengths, key, cache_size, temperature, page_size):
  """The first new token [B], the cache after the prompts, and the decode loop's key (the key is
  split here: no eager random op to compile on a first call)."""
  key, decode_key = jax.random.split(key)
  model = nnx.merge(graphdef, state)
  logits, cache = model.prefill(tokens, lengths, cache_size)
  if page_size is not None:
    cache = tuple(to_paged(c, page_size) if isinstance(c, KVCache) else c for c in cache)
  last = jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0]
  return _pick(last, key, temperature), cache, decode_key


def _decode_program(graphdef, state, first, cache, key, steps, capacity, temperature):
  """`steps` (traced) decode steps after the prefill's token `first` [B]: int32 [B, capacity]
  whose first steps + 1 columns are the tokens. The step count is traced (a `fori_loop`: the
  step is compiled once, not unrolled) and the buffer's size a multiple of `pad_to`, so every
  max_new_tokens of one bucket shares this compilation; step i samples with `fold_in(key, i)`."""
  model = nnx.merge(graphdef, state)
  out = jnp.zeros((first.shape[0], capacity), jnp.int32).at[:, 0].set(first)

  def body(i, carry):
    token, cache, out = carry
    logits, cache = model.step(token, cache)
    nxt = _pick(logits, jax.random.fold_in(key, i), temperature)
    return nxt, cache, jax.lax.dynamic_update_slice_in_dim(out, nxt[:, None], i + 1, axis=1)

  _, _, out = jax.lax.fori_loop(0, steps, body, (first, cache, out))
  return out


def _prompt_decode_program(
  graphdef, state, tokens, lengths, key, new_tokens, capacity, cache_size, temperature, page_size
):
  """`generate` with prefill="steps": the prompts read by the decode step itself, in the loop
  that then generates (one program, no chunked kernels: docs/performance.md#compile-time). Every
  sequence advances one token per iteration: sequence b is fed its prompt while i < lengths[b],
  then its own samples; the token sampled at iteration i is its new token j = i - lengths[b] + 1.
  max(lengths) + new_tokens - 1 iterations (traced); a short prompt's sequence generates a few
  tokens past `new_tokens`, unused (the cache holds t_pad + capacity positions). Returns int32
  [B, capacity]; step j of sequence b samples with `fold_in(fold_in(key, b), j)`."""
  model = nnx.merge(graphdef, state)
  batch, width = tokens.shape
  cache = model.init_cache(batch, cache_size)
  if page_size is not None:
    cache = tuple(to_paged(c, page_size) if isinstance(c, KVCache) else c for c in cache)
  rows = jnp.arange(batch)

  def pick(logits, j):
    if temperature == 0.0:
      return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    keys = jax.vmap(lambda b, jb: jax.random.fold_in(jax.random.fold_in(key, b), jb))(rows, j)
    draw = jax.vmap(lambda k, lg: jax.random.categorical(k, lg / temperature))
    return draw(keys, logits).astype(jnp.int32)

  def body(i, carry):
    prev, cache, out = carry
    token = jnp.where(i < lengths, tokens[:, jnp.minimum(i, width - 1)], prev)
    logits, cache = model.step(token, cache)
    j = i - lengths + 1
    nxt = pick(logits, j)
    col = jnp.clip(j, 0, capacity - 1)
    keep = (j >= 0) & (j < capacity)
    out = out.at[rows, col].set(jnp.where(keep, nxt, out[rows, col]))
    return nxt, cache, out

  out = jnp.zeros((batch, capacity), jnp.int32)
  first = jnp.zeros((batch,), jnp.int32)
  steps = jnp.max(lengths) + new_tokens - 1
  _, _, out = jax.lax.fori_loop(0, steps, body, (first, cache, out))
  return out


@functools.cache
def _jitted_prefill(options: tuple) -> Any:
  return jax.jit(
    _prefill_program,
    static_argnames=("graphdef", "cache_size", "temperature", "page_size"),
    compiler_options=dict(options) or None,
  )


@functools.cache
def _jitted_decode(options: tuple) -> Any:
  return jax.jit(
    _decode_program,
    static_argnames=("graphdef", "capacity", "temperature"),
    compiler_options=dict(options) or None,
  )


@functools.cache
def _jitted_prompt_decode(options: tuple) -> Any:
  return jax.jit(
    _prompt_decode_program,
    static_argnames=("graphdef", "capacity", "cache_size", "temperature", "page_size"),
    compiler_options=dict(options) or None,
  )


def generate_programs(prefill_options: tuple = (), decode_options: tuple = ()) -> tuple[Any, Any]:
  """The jitted prefill and decode loop of `generate`, compiled with the XLA options given as
  sorted (name, value) pairs: one jitted function (hence one trace cache) per program and set of
  options."""
  return _jitted_prefill(prefill_options), _jitted_decode(decode_options)


def _options_key(options: dict) -> tuple:
  return tuple(sorted(options.items()))


# The programs `generate` runs with the default options.
_prefill, _decode = generate_programs(
  _options_key(PREFILL_COMPILER_OPTIONS), _options_key(DECODE_COMPILER_OPTIONS)
)


class GenerateCall(NamedTuple):
  """`generate`'s programs and their arguments (`generate_call`). Chunked prefill:
  prefill(**prefill_args) -> (first, cache, key), then decode(graphdef, state, first, cache,
  key, **decode_args). Prefill by steps: prefill is None and decode(**decode_args) is the one
  program."""

  prefill: Any
  decode: Any
  prefill_args: dict
  decode_args: dict
  max_new_tokens: int

  def run(self) -> jax.Array:
    if self.prefill is None:
      return self.decode(**self.decode_args)[:, : self.max_new_tokens]
    first, cache, key = self.prefill(**self.prefill_args)
    graphdef, state = self.prefill_args["graphdef"], self.prefill_args["state"]
    out = self.decode(graphdef, state, first, cache, key, **self.decode_args)
    return out[:, : self.max_new_tokens]


def generate(
  model: HybridLM,
  prompts: Sequence[Sequence[int]] | jax.Array | np.ndarray,
  max_new_tokens: int,
  *,
  lengths: jax.Array | np.ndarray | None = None,
  temperature: float = 0.0,
  rng: jax.Array | None = None,
  pad_to: int = 64,
  page_size: int | None = None,
  compiler_options: tuple[dict | None, dict | None] | None = None,
  prefill: str = "auto",
) -> jax.Array:
  """Continue a batch of prompts of different lengths.

  Args:
    model: a `HybridLM`.
    prompts: a list of token-id sequences (lengths may differ, each >= 1), or an int array
      [B, T] of right-padded prompts together with `lengths` [B].
    max_new_tokens: tokens to generate per prompt (>= 1).
    temperature: 0 (default) for greedy decoding, else sampling from softmax(logits / t).
    rng: a `jax.random` key for sampling (default key 0).
    pad_to: prompts and the KV cache are padded to a multiple of this, so calls with other
      prompt lengths reuse the compiled prefill and decode loop.
    page_size: None (default) keeps each attention layer's cache dense ([B, S, Hkv, Dh],
      `gqa_decode`); a power of two >= 16 keeps it in pages of that many positions
      (`PagedKVCache`, decoded by `paged_gqa_decode`; the cache size is rounded up to a multiple
      of it). The tokens are the same either way.
    compiler_options: (prefill, decode) XLA options of the two programs, None for either the
      default (`PREFILL_COMPILER_OPTIONS`, `DECODE_COMPILER_OPTIONS`: the decode loop without
      XLA's GEMM autotuner, docs/performance.md#compile-time); e.g. ({}, {}) compiles both with
      XLA's defaults. With prefill="steps" the decode options compile the one program.
    prefill: "chunked" reads the prompts with the chunked operator and causal attention in one
      call (a program of its own), "steps" with the decode step inside the decode loop (one
      program: fewer kernels to compile, max(lengths) more sequential steps), "auto" (default)
      "steps" when the prompts padded to `pad_to` are at most `STEP_PREFILL_TOKENS` (64) tokens.
      The tokens are the same either way (greedy, up to floating-point ties; sampling draws
      other keys).

  Returns:
    int32 [B, max_new_tokens]: the generated tokens of each prompt (all of them: there is no
    end-of-sequence stop).

  The prompt is prefilled (`prefill`), then a `jax.jit`-ed loop of decode steps runs with the
  lengths and the step count traced: each program is compiled once per bucket of prompt length
  and of max_new_tokens (multiples of `pad_to`).
  """
  return generate_call(
    model,
    prompts,
    max_new_tokens,
    lengths=lengths,
    temperature=temperature,
    rng=rng,
    pad_to=pad_to,
    page_size=page_size,
    compiler_options=compiler_options,
    prefill=prefill,
  ).run()


def generate_call(
  model: HybridLM,
  prompts: Sequence[Sequence[int]] | jax.Array | np.ndarray,
  max_new_tokens: int,
  *,
  lengths: jax.Array | np.ndarray | None = None,
  temperature: float = 0.0,
  rng: jax.Array | None = None,
  pad_to: int = 64,
  page_size: int | None = None,
  compiler_options: tuple[dict | None, dict | None] | None = None,
  prefill: str = "auto",
) -> GenerateCall:
  """`generate`'s arguments checked and padded into its two jitted programs and their
  arguments, not run (`GenerateCall.run()` runs them; benchmarks/compile_profile.py times each
  program's trace, lowering and compile)."""
  if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
    raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
  if temperature < 0:
    raise ValueError(f"temperature must be >= 0, got {temperature!r}")
  if lengths is None:
    if isinstance(prompts, (jax.Array, np.ndarray)):
      prompts = np.asarray(prompts)
      if prompts.ndim != 2:
        raise ValueError(f"prompts as an array must be [B, T], got shape {prompts.shape}")
      lengths = np.full((prompts.shape[0],), prompts.shape[1], np.int32)
      tokens = prompts
    else:
      seqs = [np.asarray(p, np.int32).reshape(-1) for p in prompts]
      if not seqs or min(len(s) for s in seqs) < 1:
        raise ValueError("prompts must be a non-empty list of non-empty token sequences")
      lengths = np.array([len(s) for s in seqs], np.int32)
      tokens = np.zeros((len(seqs), int(lengths.max())), np.int32)
      for i, s in enumerate(seqs):
        tokens[i, : len(s)] = s
  else:
    tokens, lengths = np.asarray(prompts), np.asarray(lengths, np.int32)
    if tokens.ndim != 2 or lengths.shape != (tokens.shape[0],):
      raise ValueError(
        f"prompts [B, T] and lengths [B] expected, got shapes {tokens.shape} and {lengths.shape}"
      )
    if lengths.min() < 1 or lengths.max() > tokens.shape[1]:
      raise ValueError(f"lengths must lie in [1, T = {tokens.shape[1]}], got {lengths}")
  vocab = model.config.vocab_size
  if tokens.size and (tokens.min() < 0 or tokens.max() >= vocab):
    raise ValueError(f"prompt tokens must lie in [0, vocab_size = {vocab})")
  if page_size is not None and (
    isinstance(page_size, bool)
    or not isinstance(page_size, int)
    or page_size < 16
    or page_size & (page_size - 1)
  ):
    raise ValueError(f"page_size must be None or a power of two >= 16, got {page_size!r}")
  # Every shape is a multiple of pad_to (docs/performance.md#compile-time): prompt lengths and
  # max_new_tokens within one bucket reuse the compiled prefill and decode loop.
  t_pad = _round_up(tokens.shape[1], pad_to)
  tokens = np.pad(tokens, ((0, 0), (0, t_pad - tokens.shape[1])))
  capacity = _round_up(max_new_tokens, pad_to)
  cache_size = t_pad + capacity
  if page_size is not None:
    cache_size = _round_up(cache_size, page_size)
  key = jax.random.key(0) if rng is None else rng
  graphdef, state = nnx.split(model)
  if compiler_options is not None and (
    not isinstance(compiler_options, (tuple, list))
    or len(compiler_options) != 2
    or not all(o is None or isinstance(o, dict) for o in compiler_options)
  ):
    raise TypeError(
      f"compiler_options must be None or a pair (prefill, decode) of dicts of XLA options "
      f"(or None for either's default), got {compiler_options!r}"
    )
  if prefill not in PREFILL_MODES:
    raise ValueError(f"prefill must be one of {PREFILL_MODES}, got {prefill!r}")
  if prefill == "auto":
    prefill = "steps" if t_pad <= STEP_PREFILL_TOKENS else "chunked"
  prefill_opts, decode_opts = compiler_options or (None, None)
  prefill_opts = PREFILL_COMPILER_OPTIONS if prefill_opts is None else prefill_opts
  decode_opts = DECODE_COMPILER_OPTIONS if decode_opts is None else decode_opts
  # NumPy operands go straight to the jitted functions (no eager op to compile first)
  prompt_args = dict(
    graphdef=graphdef,
    state=state,
    tokens=np.asarray(tokens, np.int32),
    lengths=np.asarray(lengths, np.int32),
    key=key,
    cache_size=cache_size,
    temperature=float(temperature),
    page_size=page_size,
  )
  if prefill == "steps":
    program = _jitted_prompt_decode(_options_key(decode_opts))
    args = dict(prompt_args, new_tokens=np.int32(max_new_tokens), capacity=capacity)
    return GenerateCall(None, program, {}, args, max_new_tokens)
  prefill_program, decode = generate_programs(_options_key(prefill_opts), _options_key(decode_opts))
  decode_args = dict(
    steps=np.int32(max_new_tokens - 1), capacity=capacity, temperature=float(temperature)
  )
  return GenerateCall(prefill_program, decode, prompt_args, decode_args, max_new_tokens)
