"""`gqa_decode` and `paged_gqa_decode`: the public functions (docs/inference.md): argument checks,
normalisation and their implementations in order of preference (gdp_jax/ops/registry.py):
"triton" (the Pallas kernels of `pallas_kernels/triton/inference/`, interpreted on CPU, slowly),
"xla" (jnp, any backend; the ground truth for the kernels) and, paged, "reference";
`implementation=None` picks the Pallas backend on a supported GPU and "xla" elsewhere.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from gdp_jax.ops import registry
from gdp_jax.ops.gqa_decode import partitioning
from gdp_jax.ops.gqa_decode.reference import ReferencePagedGqaDecode
from gdp_jax.ops.gqa_decode.triton import TritonGqaDecode, TritonPagedGqaDecode
from gdp_jax.ops.gqa_decode.xla import XlaGqaDecode, XlaPagedGqaDecode
from gdp_jax.ops.validation import (
  check_float,
  check_int32_values,
  check_shape,
  static_scale,
)

CACHE_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
REGISTRY = registry.Registry("gqa_decode", (TritonGqaDecode(), XlaGqaDecode()))
PAGED_REGISTRY = registry.Registry(
  "paged_gqa_decode", (TritonPagedGqaDecode(), XlaPagedGqaDecode(), ReferencePagedGqaDecode())
)


# ----------------------------------------------------------------------------------------------
# Checks
# ----------------------------------------------------------------------------------------------


def _check_query(query):
  check_float("query", query)
  if query.ndim not in (3, 4):
    raise ValueError(
      f"query must be [B, Hq, D] (rank 3) or [B, Tq, Hq, D] (rank 4: Tq new tokens per "
      f"sequence), got shape {tuple(query.shape)}"
    )
  batch, q_heads, dim = query.shape[0], query.shape[-2], query.shape[-1]
  tq = 1 if query.ndim == 3 else query.shape[1]
  return batch, tq, q_heads, dim


def _check_cache_pair(names, query, key, value, layout, expected):
  """Shape and dtype checks of a key/value pair; `expected` the full key shape."""
  check_shape(names[0], key, expected, f"{layout} as query {tuple(query.shape)}")
  check_shape(names[1], value, key.shape, f"{names[1]} must match {names[0]}: {layout}")
  if key.dtype != value.dtype:
    raise TypeError(
      f"{names[0]} and {names[1]} must share one dtype, got {names[0]} "
      f"{key.dtype} and {names[1]} {value.dtype}"
    )
  if not any(key.dtype == d for d in CACHE_DTYPES):
    raise TypeError(
      f"{names[0]} and {names[1]} must be float32, bfloat16 or float16, got "
      f"{key.dtype} with shape {tuple(key.shape)}"
    )


def _check_heads(query, q_heads, key, key_name):
  kv_heads = key.shape[-2]
  if kv_heads < 1:
    raise ValueError(
      f"{key_name} has Hkv = {kv_heads} heads (shape {tuple(key.shape)}); need Hkv >= 1"
    )
  if q_heads % kv_heads != 0:
    raise ValueError(
      f"the number of query heads Hq = {q_heads} (query shape "
      f"{tuple(query.shape)}) must be a multiple of the number of cache heads "
      f"Hkv = {kv_heads} ({key_name} shape {tuple(key.shape)})"
    )


def _check_lengths(lengths, batch):
  if not hasattr(lengths, "dtype"):
    lengths = np.asarray(lengths)
  if not jnp.issubdtype(lengths.dtype, jnp.integer):
    raise TypeError(
      f"lengths must have an integer dtype (int32), got {lengths.dtype} with "
      f"shape {tuple(np.shape(lengths))}"
    )
  check_shape("lengths", lengths, (batch,), f"[B] = [{batch}]: one length per sequence")
  check_int32_values("lengths", lengths)
  return lengths


def _concrete(x):
  """x as a NumPy array, or None when it is traced."""
  return None if isinstance(x, jax.core.Tracer) else np.asarray(x)


def _check_new_tokens(query, tq, lengths, capacity, cache_name):
  """Multi-token queries: Tq <= the capacity, and concrete lengths either 0 or >= Tq."""
  if tq <= 1:
    return
  if tq > capacity:
    raise ValueError(
      f"query has Tq = {tq} new tokens (shape {tuple(query.shape)}) but {cache_name} holds "
      f"only {capacity} positions: the new tokens must be in the cache"
    )
  values = _concrete(lengths)
  if values is None:
    return
  clipped = np.clip(values.astype(np.int64), 0, capacity)
  bad = np.flatnonzero((clipped > 0) & (clipped < tq))
  if bad.size:
    b = int(bad[0])
    raise ValueError(
      f"lengths[{b}] = {int(values[b])} is smaller than the Tq = {tq} new tokens of query "
      f"(shape {tuple(query.shape)}): token i sits at position lengths[b] - Tq + i, so a "
      f"length must be 0 (an idle sequence: zero rows) or at least Tq"
    )


def _as_tokens(query):
  """[B, Hq, D] -> [B, 1, Hq, D]; [B, Tq, Hq, D] unchanged (what the implementations take)."""
  return query[:, None] if query.ndim == 3 else query


def _prepare_scale(scale, dim):
  static, dynamic = static_scale(scale, dim**-0.5)
  return static if dynamic is None else dynamic


# ----------------------------------------------------------------------------------------------
# Grouped-query decode step
# ----------------------------------------------------------------------------------------------


def gqa_decode(
  query: jax.Array,
  key_cache: jax.Array,
  value_cache: jax.Array,
  lengths: jax.Array,
  *,
  scale: float | jax.Array | None = None,
  implementation: str | None = None,
) -> jax.Array:
  """Attention of the new tokens of each sequence over a grouped-query KV cache.

  For sequence b, query head h (cache head h // G, G = Hq / Hkv) and new token t (Tq of them,
  at positions L - Tq + t with L = lengths[b], already written into the cache):
    s_j = scale * q_t . K_j,  w = softmax over j <= L - Tq + t,  o_t = sum_j w_j V_j.
  With one token (Tq = 1, or a [B, Hq, D] query) that is a softmax over j < L.

  Args:
    query: [B, Hq, D] (one new token per sequence) or [B, Tq, Hq, D] (Tq new tokens:
      speculative verification, chunked prefill), any float dtype (computed in float32).
    key_cache, value_cache: [B, S, Hkv, D], one dtype: float32, bfloat16 or float16.
    lengths: [B] integers, may be traced under `jax.jit` (a new set of lengths never
      recompiles; the Pallas kernel's work follows the lengths, not S). Slots j >= lengths[b]
      get exactly zero weight whatever they hold. lengths[b] <= 0 gives a zero output row;
      lengths[b] > S behaves as S (int64 values too; concrete values outside int32 are an
      error rather than wrapping around). With Tq > 1 a concrete length must be 0 or >= Tq
      (else ValueError); under `jax.jit` a token at a negative position gets a zero row.
    scale: score scale, default D ** -0.5 (a number, or an array: then folded in at run time).
    implementation: "xla", "triton", "pallas" (the best Pallas backend) or None (the Pallas
      backend on a supported GPU, else "xla").

  Returns:
    float32 in the query's shape: [B, Hq, D] or [B, Tq, Hq, D].

  Derivatives: "xla" is plain jnp (JAX differentiates it); "pallas" raises NotImplementedError.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from gdp_jax import gqa_decode
    >>> query = jnp.ones((2, 4, 16))
    >>> cache = jnp.ones((2, 32, 2, 16), jnp.bfloat16)
    >>> gqa_decode(query, cache, cache, jnp.array([5, 32])).shape
    (2, 4, 16)
  """
  for name, x in (("query", query), ("key_cache", key_cache), ("value_cache", value_cache)):
    check_float(name, x)
  batch, tq, q_heads, dim = _check_query(query)
  if key_cache.ndim != 4:
    raise ValueError(
      f"key_cache must be [B, S, Hkv, D] (rank 4), got shape {tuple(key_cache.shape)}"
    )
  seq_len, kv_heads = key_cache.shape[1], key_cache.shape[2]
  _check_cache_pair(
    ("key_cache", "value_cache"),
    query,
    key_cache,
    value_cache,
    f"[B, S, Hkv, D] with B = {batch} and D = {dim}",
    (batch, seq_len, kv_heads, dim),
  )
  _check_heads(query, q_heads, key_cache, "key_cache")
  lengths = _check_lengths(lengths, batch)
  _check_new_tokens(query, tq, lengths, seq_len, "key_cache")
  run = REGISTRY.resolve(implementation)
  query, key_cache, value_cache = (jnp.asarray(x) for x in (query, key_cache, value_cache))
  # Clipped before the cast: an int64 length (x64) beyond int32 behaves as S, never wraps.
  lengths = jnp.clip(jnp.asarray(lengths), 0, seq_len).astype(jnp.int32)
  if 0 in (batch, tq, q_heads, dim, seq_len):
    return jnp.zeros(query.shape, jnp.float32)
  if run.pallas:
    # Inputs sharded over batch and heads under jax.jit: the kernels run per device
    # (docs/sharding.md#under-plain-jaxjit).
    run = partitioning.per_device(run, paged=False)
  out = run(_as_tokens(query), key_cache, value_cache, lengths, _prepare_scale(scale, dim))
  return out.reshape(query.shape)


# ----------------------------------------------------------------------------------------------
# Grouped-query decode over a paged KV cache
# ----------------------------------------------------------------------------------------------


def _check_block_tables(block_tables, batch, num_pages, lengths, capacity, page_size):
  """Dtype and shape of the table; with concrete tables and lengths, the used entries' range."""
  dtype = getattr(block_tables, "dtype", None)
  if dtype is None:
    block_tables = np.asarray(block_tables)
    dtype = block_tables.dtype
  if not jnp.issubdtype(dtype, jnp.integer):
    raise TypeError(
      f"block_tables must have an integer dtype (int32 page ids), got {dtype} with shape "
      f"{tuple(np.shape(block_tables))}"
    )
  shape = tuple(np.shape(block_tables))
  if len(shape) != 2 or shape[0] != batch:
    raise ValueError(
      f"block_tables must be [B, max_pages] = [{batch}, max_pages] (the page ids of each "
      f"sequence), got shape {shape}"
    )
  table, lens = _concrete(block_tables), _concrete(lengths)
  if table is None or lens is None or table.size == 0:
    return block_tables
  used = -(-np.clip(lens.astype(np.int64), 0, capacity) // page_size)  # pages holding tokens
  for b in range(batch):
    ids = table[b, : used[b]]
    bad = np.flatnonzero((ids < 0) | (ids >= num_pages))
    if bad.size:
      i = int(bad[0])
      raise ValueError(
        f"block_tables[{b}, {i}] = {int(ids[i])} is not a page id: key_pages has "
        f"num_pages = {num_pages}, and lengths[{b}] = {int(lens[b])} uses the first "
        f"{int(used[b])} entries of the row (unused entries may hold anything)"
      )
  return block_tables


def paged_gqa_decode(
  query: jax.Array,
  key_pages: jax.Array,
  value_pages: jax.Array,
  block_tables: jax.Array,
  lengths: jax.Array,
  *,
  scale: float | jax.Array | None = None,
  implementation: str | None = None,
) -> jax.Array:
  """`gqa_decode` over a paged KV cache (docs/inference.md#paged-kv-cache).

  Sequence b's cache position p is slot p % page_size of page block_tables[b, p // page_size]
  (vLLM's block-table layout, heads inside the page). Pages may be shared across sequences
  (a common prefix) and lie in any order. The result equals `gqa_decode` on the dense cache
  key_pages[block_tables].reshape(B, max_pages * page_size, Hkv, D).

  Args:
    query: [B, Hq, D] or [B, Tq, Hq, D] (Tq new tokens at positions lengths[b] - Tq + t,
      already written into the pages), any float dtype (computed in float32).
    key_pages, value_pages: [num_pages, page_size, Hkv, D], one dtype: float32, bfloat16 or
      float16; page_size a power of two >= 16.
    block_tables: [B, max_pages] integer page ids (int32), may be traced: a new table never
      recompiles. Only the first ceil(lengths[b] / page_size) entries of row b are read; the
      others may hold anything (e.g. -1). Concrete tables and lengths are checked (a used entry
      outside [0, num_pages) is a ValueError); traced entries are clamped into [0, num_pages).
    lengths: [B] integers, may be traced; as in `gqa_decode`, with the capacity
      max_pages * page_size in place of S (longer lengths behave as the capacity; <= 0 gives
      zero rows; with Tq > 1 a concrete length must be 0 or >= Tq).
    scale: score scale, default D ** -0.5 (a number, or an array: then folded in at run time).
    implementation: "reference", "xla", "triton", "pallas" (the best Pallas backend) or None
      (the Pallas backend on a supported GPU, else "xla").

  Returns:
    float32 in the query's shape: [B, Hq, D] or [B, Tq, Hq, D].

  Derivatives: "xla" and "reference" are plain jnp; "pallas" raises NotImplementedError.

  Example:
    >>> import jax.numpy as jnp
    >>> from gdp_jax import paged_gqa_decode
    >>> pages = jnp.ones((6, 16, 2, 32), jnp.bfloat16)  # 6 pages of 16 positions
    >>> tables = jnp.array([[4, 0, -1], [2, 5, 1]])  # sequence 0 uses 2 pages, 1 uses 3
    >>> out = paged_gqa_decode(jnp.ones((2, 4, 32)), pages, pages, tables, jnp.array([20, 40]))
    >>> out.shape
    (2, 4, 32)
  """
  for name, x in (("query", query), ("key_pages", key_pages), ("value_pages", value_pages)):
    check_float(name, x)
  batch, tq, q_heads, dim = _check_query(query)
  if key_pages.ndim != 4:
    raise ValueError(
      f"key_pages must be [num_pages, page_size, Hkv, D] (rank 4), got shape "
      f"{tuple(key_pages.shape)}"
    )
  num_pages, page_size, kv_heads = key_pages.shape[:3]
  _check_cache_pair(
    ("key_pages", "value_pages"),
    query,
    key_pages,
    value_pages,
    f"[num_pages, page_size, Hkv, D] with D = {dim}",
    (num_pages, page_size, kv_heads, dim),
  )
  if page_size < 16 or page_size & (page_size - 1):
    raise ValueError(
      f"page_size (key_pages.shape[1], shape {tuple(key_pages.shape)}) must be a power of two "
      f">= 16, got {page_size}"
    )
  _check_heads(query, q_heads, key_pages, "key_pages")
  lengths = _check_lengths(lengths, batch)
  max_pages = np.shape(block_tables)[1] if np.ndim(block_tables) == 2 else 0
  capacity = max_pages * page_size
  block_tables = _check_block_tables(block_tables, batch, num_pages, lengths, capacity, page_size)
  _check_new_tokens(query, tq, lengths, capacity, "block_tables (max_pages * page_size)")
  run = PAGED_REGISTRY.resolve(implementation)
  query, key_pages, value_pages = (jnp.asarray(x) for x in (query, key_pages, value_pages))
  lengths = jnp.clip(jnp.asarray(lengths), 0, capacity).astype(jnp.int32)
  if 0 in (batch, tq, q_heads, dim, capacity, num_pages):
    return jnp.zeros(query.shape, jnp.float32)
  # Clamped (and then cast: int64 ids never wrap): a bad traced id reads a real page.
  block_tables = jnp.clip(jnp.asarray(block_tables), 0, num_pages - 1).astype(jnp.int32)
  if run.pallas:
    # Inputs sharded over batch and heads under jax.jit: the kernels run per device
    # (docs/sharding.md#under-plain-jaxjit).
    run = partitioning.per_device(run, paged=True)
  out = run(
    _as_tokens(query), key_pages, value_pages, block_tables, lengths, _prepare_scale(scale, dim)
  )
  return out.reshape(query.shape)
