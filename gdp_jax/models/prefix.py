"""`PrefixCache`: a `HybridLM`'s caches at every block boundary of earlier prompts, so that
`generate(..., prefix_cache=cache)` computes only the tokens after a prompt's longest cached
prefix (docs/inference.md#prefix-caching).

After a cached prefix a prompt is read block by block (one compiled program for every block,
the last one right-padded) in `HybridLM.step_tokens` calls of `tokens_per_call` tokens; with
nothing cached, in one prefill with `state_every` where the layers allow. After each whole block
the cache keeps, under a hash of the prompt up to that block's end, every layer's part: a delta
layer's state and short-convolution inputs, an attention layer's keys and values of the block.
"""

from __future__ import annotations

import collections
import functools
import hashlib
import weakref
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gdp_jax.layers import KVCache
from gdp_jax.models.paged import to_paged


class BlockRows(NamedTuple):
  """An attention layer's part of a cache entry: the keys and values of one block of tokens,
  [1, block_tokens, Hkv, Dh] (keys rotated, as `KVCache`)."""

  key: jax.Array
  value: jax.Array


def _pick(logits, key, temperature):
  if temperature == 0.0:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  return jax.random.categorical(key, logits / temperature, axis=-1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("graphdef", "cache_size"))
def _init_program(graphdef, state, cache_size):
  return nnx.merge(graphdef, state).init_cache(1, cache_size)


@functools.partial(jax.jit, static_argnames=("graphdef", "temperature", "per_call"))
def _block_program(graphdef, state, tokens, length, cache, key, temperature, per_call):
  """One block after `cache`: tokens [1, N] whose first length[0] are real, read `per_call`
  tokens per `step_tokens` -> (the token after them, sampled as generate's prefill does, the
  cache after them, the block's entry, the decode loop's key)."""
  key, decode_key = jax.random.split(key)
  model = nnx.merge(graphdef, state)
  new, logits = cache, []
  for start in range(0, tokens.shape[1], per_call):
    part = tokens[:, start : start + per_call]
    real = jnp.clip(length - start, 0, part.shape[1])  # 0: a no-op but for stale slots
    out, new = model.step_tokens(part, new, real)
    logits.append(out)
  last = jnp.take_along_axis(jnp.concatenate(logits, 1), (length - 1)[:, None, None], axis=1)
  last = last[:, 0]
  size = tokens.shape[1]

  def part(before, after):
    if isinstance(after, KVCache):
      rows = lambda a: jax.lax.dynamic_slice_in_dim(a, before.lengths[0], size, axis=1)
      return BlockRows(rows(after.key), rows(after.value))
    return after

  entry = tuple(part(b, a) for b, a in zip(cache, new))
  return _pick(last, key, temperature), new, entry, decode_key


@functools.partial(jax.jit, static_argnames=("graphdef", "cache_size", "temperature", "block"))
def _whole_program(graphdef, state, tokens, length, key, cache_size, temperature, block):
  """A prompt with nothing cached in one prefill (`state_every` = block): (the token after it,
  the cache, its J = T // block entries stacked [J, ...], the decode loop's key)."""
  key, decode_key = jax.random.split(key)
  model = nnx.merge(graphdef, state)
  logits, cache, blocks = model.prefill(tokens, length, cache_size, state_every=block)
  last = jnp.take_along_axis(logits, (length - 1)[:, None, None], axis=1)[:, 0]
  count = tokens.shape[1] // block

  def entries(c, b):
    if isinstance(c, KVCache):
      rows = lambda a: jnp.moveaxis(
        a[:, : count * block].reshape((1, count, block) + a.shape[2:]), 1, 0
      )
      return BlockRows(rows(c.key), rows(c.value))
    return jax.tree.map(lambda a: jnp.moveaxis(a, 1, 0), b)  # [J, 1, ...]

  return _pick(last, key, temperature), cache, tuple(map(entries, cache, blocks)), decode_key


@jax.jit
def _entry(entries, j):
  return jax.tree.map(lambda a: a[j], entries)


@jax.jit
def _load_program(cache, entry, block):
  """`cache` with a cached block's entry put in: an attention layer's rows at block * N, a delta
  layer's state and convolution inputs replaced."""

  def put(c, e):
    if isinstance(c, KVCache):
      start = block * e.key.shape[1]
      upd = lambda a, rows: jax.lax.dynamic_update_slice_in_dim(a, rows.astype(a.dtype), start, 1)
      size = jnp.full_like(c.lengths, start + e.key.shape[1])
      return KVCache(upd(c.key, e.key), upd(c.value, e.value), size)
    return e

  return tuple(put(c, e) for c, e in zip(cache, entry))


@functools.partial(jax.jit, static_argnames=("page_size",))
def _paged_program(cache, page_size):
  return tuple(to_paged(c, page_size) if isinstance(c, KVCache) else c for c in cache)


class PrefixCache:
  """The caches of one `HybridLM` at the block boundaries of the prompts it has read, for
  `generate(model, [prompt], n, prefix_cache=cache)` (docs/inference.md#prefix-caching).

  block_tokens: N, the tokens per block (a multiple of the model's chunk_size keeps the chunked
    operator's chunks whole); a prompt of L tokens stores L // N entries and reuses at most
    (L - 1) // N (its last token is always computed: its logits give the first new token).
  max_entries: the most blocks kept; the least recently used go first (a prompt's deepest
    blocks before its first ones, so that what stays is a usable prefix).
  tokens_per_call: the new tokens of one `HybridLM.step_tokens` call within a block (default
    min(64, block_tokens)): an attention layer reads them as Tq * G query rows of one tile of
    the decode kernel (docs/inference.md#several-new-tokens-per-sequence), so keep it small.

  Counters (plain ints, never reset but by `clear`): `computed_tokens`, the prompt tokens run
  through the model; `reused_tokens`, those read from the cache; `hits`, calls that reused a
  block. One model per cache (another model is a ValueError); after changing the model's
  parameters call `clear()`.
  """

  def __init__(
    self, block_tokens: int = 256, max_entries: int = 1024, tokens_per_call: int | None = None
  ) -> None:
    per_call = min(64, block_tokens) if tokens_per_call is None else tokens_per_call
    for name, value in (
      ("block_tokens", block_tokens),
      ("max_entries", max_entries),
      ("tokens_per_call", per_call),
    ):
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    self.block_tokens, self.max_entries, self.tokens_per_call = block_tokens, max_entries, per_call
    self._entries: collections.OrderedDict[bytes, tuple] = collections.OrderedDict()
    self._model: Any = None
    self.computed_tokens = self.reused_tokens = self.hits = 0

  def __len__(self) -> int:
    return len(self._entries)

  def clear(self) -> None:
    """Forget every entry, the model and the counters."""
    self._entries.clear()
    self._model = None
    self.computed_tokens = self.reused_tokens = self.hits = 0

  def bind(self, model: Any) -> None:
    """Tie the cache to `model` (a ValueError if it already serves another one)."""
    owner = None if self._model is None else self._model()
    if owner is not None and owner is not model:
      raise ValueError(
        "this PrefixCache holds another model's caches: use one PrefixCache per model "
        "(or clear() it first)"
      )
    self._model = weakref.ref(model)

  def keys(self, tokens: np.ndarray) -> list[bytes]:
    """The keys of a prompt's whole blocks: key j hashes tokens [0, (j + 1) N) (chained)."""
    n = self.block_tokens
    ids = np.asarray(tokens, np.int32).reshape(-1).astype("<i4")
    keys, digest = [], b""
    for j in range(len(ids) // n):
      digest = hashlib.blake2b(digest + ids[j * n : (j + 1) * n].tobytes(), digest_size=16).digest()
      keys.append(digest)
    return keys

  def cached_blocks(self, tokens: np.ndarray) -> int:
    """How many leading blocks of `tokens` the cache holds (at most (L - 1) // N)."""
    keys = self.keys(tokens)[: (len(np.reshape(tokens, -1)) - 1) // self.block_tokens]
    return next((j for j, k in enumerate(keys) if k not in self._entries), len(keys))

  def prefill(
    self,
    graphdef: Any,
    state: Any,
    tokens: np.ndarray,
    key: jax.Array,
    cache_size: int,
    temperature: float,
    page_size: int | None,
    whole: bool = False,
  ) -> tuple[jax.Array, tuple, jax.Array]:
    """One prompt `tokens` [L] through the model from its longest cached prefix, storing its new
    whole blocks: (the first new token [1], the cache after the prompt with `cache_size`
    attention slots, paged with `page_size`, the decode loop's key). generate's prefill step.
    whole: a prompt with nothing cached is read in one prefill (`HybridLM.prefill` with
    `state_every`; every delta layer a gated delta product one, N a multiple of chunk_size)."""
    n, ids = self.block_tokens, np.asarray(tokens, np.int32).reshape(-1)
    keys, reused = self.keys(ids), self.cached_blocks(ids)
    blocks = -(-len(ids) // n)
    if whole and reused == 0:
      tokens_b = np.pad(ids, (0, blocks * n - len(ids)))[None]
      length = np.array([len(ids)], np.int32)
      first, cache, stacked, decode_key = _whole_program(
        graphdef, state, tokens_b, length, key, cache_size, temperature, n
      )
      for j, k in enumerate(keys):
        self._entries[k] = _entry(stacked, np.int32(j))
      return self._finish(ids, keys, reused, first, cache, decode_key, page_size)
    cache = _init_program(graphdef, state, cache_size)
    for j in range(reused):
      cache = _load_program(cache, self._entries[keys[j]], np.int32(j))
    first = decode_key = None
    for j in range(reused, blocks):
      block = ids[j * n : (j + 1) * n]
      length = np.array([len(block)], np.int32)
      padded = np.pad(block, (0, n - len(block)))[None]
      first, cache, entry, decode_key = _block_program(
        graphdef, state, padded, length, cache, key, temperature, self.tokens_per_call
      )
      if j < len(keys):
        self._entries[keys[j]] = entry
    return self._finish(ids, keys, reused, first, cache, decode_key, page_size)

  def _finish(self, ids, keys, reused, first, cache, decode_key, page_size):
    """The entries' order and count, the counters, the paged cache: prefill's end."""
    n = self.block_tokens
    for k in reversed(keys):  # most recent: the first blocks (evicted last)
      self._entries.move_to_end(k)
    while len(self._entries) > self.max_entries:
      self._entries.popitem(last=False)
    self.computed_tokens += len(ids) - reused * n
    self.reused_tokens += reused * n
    self.hits += reused > 0
    if page_size is not None:
      cache = _paged_program(cache, page_size)
    assert first is not None and decode_key is not None  # the last block is always computed
    return first, cache, decode_key
