"""`HybridLM`: the hybrid causal language model (embedding, residual blocks, final norm,
vocabulary head), its whole-sequence call, prefill and decode steps (docs/inference.md,
docs/sharding.md#annotated-parameters)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gdp_jax.layers import (
  GatedDeltaProductCache,
  GatedRMSNorm,
  GroupedQueryAttention,
  KVCache,
  _check_room,
  partitioning,
)
from gdp_jax.layers.partitioning import EMBED, VOCAB
from gdp_jax.models.block import Block
from gdp_jax.models.config import HybridConfig
from gdp_jax.models.paged import PagedKVCache
from gdp_jax.models.scan import layer_plan, same_programs, scan_blocks
from gdp_jax.sharding import ShardingConfig

f32 = jnp.float32


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


def _check_cache_room(cache, num_new):
  """An attention layer's cache checked for `num_new` more tokens (concrete lengths), as the
  layer's own `step_tokens` does."""
  if isinstance(cache, KVCache):
    _check_room(cache.lengths, num_new, cache.key.shape[1], "the cache's S slots")
  elif isinstance(cache, PagedKVCache):
    capacity = cache.block_tables.shape[1] * cache.key_pages.shape[1]
    _check_room(cache.lengths, num_new, capacity, "the cache's pages (max_pages * page_size)")


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
  With `config.scan_layers` (default: when two layers share a configuration) the layers run
  under `jax.lax.scan` (`scan_plan`; docs/train_lm.md#compile-time); parameters and caches are
  one entry per layer either way.

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
    # The layers' scan (docs/train_lm.md#compile-time): None runs them one by one.
    plan = layer_plan(c.layer_pattern)
    self.scan_plan = plan if c.scanned and same_programs(blocks, plan) else None
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

    def layer(block, x, _):
      return block(x, lengths, segment_ids=segment_ids), None

    x, _ = self._layers(layer, x)
    return self._logits(x)

  def _layers(self, fn, x, per_layer=None):
    """x through the blocks, fn(block, x, per_layer[l]) -> (x, out_l) per layer: (x, outs),
    scanned by `scan_plan` (docs/train_lm.md#compile-time) or one layer after another."""
    if self.scan_plan is not None:
      return scan_blocks(self.blocks, self.scan_plan, fn, x, per_layer)
    outs = []
    for block, inp in zip(self.blocks, per_layer or (None,) * len(self.blocks)):
      x, out = fn(block, x, inp)
      outs.append(out)
    return x, tuple(outs)

  def prefill(
    self, tokens: jax.Array, lengths: jax.Array | None = None, cache_size: int | None = None
  ) -> tuple[jax.Array, tuple]:
    """The whole right-padded prompts [B, T] (sequence b holds lengths[b] tokens): the logits
    [B, T, vocab] and the cache after each sequence's tokens (attention caches of
    `cache_size` slots, default T)."""

    def layer(block, x, _):
      return block(x, lengths, return_cache=True, cache_size=cache_size)

    x, caches = self._layers(layer, self._embed(tokens))
    return self._logits(x), caches

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
    x, new = self._layers(lambda block, x, c: block.step(x, c), self._embed(token, "token"), cache)
    return self._logits(x), new

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
    if self.scan_plan is not None:  # in the scan the caches' lengths are traced: checked here
      for c in cache:
        _check_cache_room(c, tokens.shape[1])
    x = self._embed(tokens)
    x, new = self._layers(lambda block, x, c: block.step_tokens(x, c), x, cache)
    return self._logits(x), new

  def _check_cache_tuple(self, cache):
    if not isinstance(cache, (tuple, list)) or len(cache) != len(self.blocks):
      raise TypeError(
        f"cache must be a tuple with one entry per layer ({len(self.blocks)}, "
        f"layer_pattern = {self.config.layer_pattern!r}) from init_cache or "
        f"prefill, got {type(cache).__name__}"
        + (f" of length {len(cache)}" if isinstance(cache, (tuple, list)) else "")
      )
