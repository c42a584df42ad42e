"""Inference steps (docs/inference.md): grouped-query decode over a KV cache, and one
recurrent token of the gated delta product.

Public functions check their arguments, normalise them and dispatch to an implementation:
"xla" (jnp, any backend; the ground truth for the kernels) or "pallas" (GPU kernels in
`pallas_kernels/inference/`, interpreted on CPU, slowly), through the table in
gdp_jax/dispatch.py: `implementation=None` picks "pallas" on a supported GPU and "xla" elsewhere.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from gdp_jax import dispatch
from gdp_jax.operator import (
  check_bool,
  check_float,
  check_int32_values,
  check_scale,
  check_shape,
  expand_key_heads,
  normalize_mask,
)
from gdp_jax.reference import recurrent_step as _recurrent_step
from pallas_kernels.common.backend import resolve_precision

CACHE_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
HIGHEST = jax.lax.Precision.HIGHEST


def _static_scale(scale, default):
  """(Python float, None) for a static scale, or (1.0, array) for a traced/array scale."""
  scale = check_scale(scale)
  if scale is None:
    return float(default), None
  if isinstance(scale, float):
    return scale, None
  return 1.0, scale


def _no_gradients(function):
  return (
    f"{function} with implementation='pallas' has no derivatives (an inference kernel); "
    f"use implementation='xla' to differentiate it (JAX differentiates its jnp code)"
  )


# ----------------------------------------------------------------------------------------------
# Grouped-query decode step
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
  static, dynamic = _static_scale(scale, dim**-0.5)
  return static if dynamic is None else dynamic


def gqa_decode_pallas(query, key_cache, value_cache, lengths, scale):
  """The Pallas kernel (pallas_kernels/inference/decode_attention.py); scale a float or array."""
  from pallas_kernels.inference import decode_attention

  if isinstance(scale, jax.Array):
    query = query.astype(jnp.float32) * scale
    scale = 1.0
  kernel = dispatch.raise_if_differentiated(
    lambda *a: decode_attention.gqa_decode(*a, scale=scale), _no_gradients("gqa_decode")
  )
  return kernel(query, key_cache, value_cache, lengths)


def gqa_decode_xla(query, key_cache, value_cache, lengths, scale):
  """The jnp version: query [B, Tq, Hq, D], caches [B, S, Hkv, D], lengths [B] int (clipped to
  [0, S]) -> f32 [B, Tq, Hq, D].

  Token t of sequence b sees slots j <= lengths[b] - Tq + t. Other scores are set to -inf before
  the softmax, and values of slots j >= lengths[b] to 0 (a `where`, so even an inf in a stale
  slot cannot make a NaN).
  """
  f32 = jnp.float32
  batch, tq, q_heads, dim = query.shape
  _, seq_len, kv_heads, _ = key_cache.shape
  group = q_heads // kv_heads
  q = query.astype(f32).reshape(batch, tq, kv_heads, group, dim)
  pos = jnp.arange(seq_len, dtype=jnp.int32)
  limit = lengths[:, None] - (tq - 1) + jnp.arange(tq, dtype=jnp.int32)  # [B, Tq], exclusive
  visible = pos[None, None, :] < limit[:, :, None]  # [B, Tq, S]
  s = jnp.einsum("btkgd,bskd->btkgs", q, key_cache.astype(f32), precision=HIGHEST) * scale
  s = jnp.where(visible[:, :, None, None, :], s, -jnp.inf)
  m = jnp.max(s, axis=-1, keepdims=True)
  p = jnp.exp(s - jnp.where(m == -jnp.inf, 0.0, m))  # invisible: 0
  total = jnp.sum(p, axis=-1)
  stale = pos[None, :] >= lengths[:, None]  # [B, S]
  v = jnp.where(stale[:, :, None, None], 0.0, value_cache.astype(f32))
  o = jnp.einsum("btkgs,bskd->btkgd", p, v, precision=HIGHEST)
  o = o / jnp.where(total > 0, total, 1.0)[..., None]
  return o.reshape(batch, tq, q_heads, dim)


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
    implementation: "xla", "pallas" or None ("pallas" on a supported GPU, else "xla").

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
  implementation = dispatch.resolve("gqa_decode", implementation)
  query, key_cache, value_cache = (jnp.asarray(x) for x in (query, key_cache, value_cache))
  # Clipped before the cast: an int64 length (x64) beyond int32 behaves as S, never wraps.
  lengths = jnp.clip(jnp.asarray(lengths), 0, seq_len).astype(jnp.int32)
  if 0 in (batch, tq, q_heads, dim, seq_len):
    return jnp.zeros(query.shape, jnp.float32)
  run = dispatch.entry("gqa_decode", implementation)
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


def paged_gqa_decode_pallas(query, key_pages, value_pages, block_tables, lengths, scale):
  """The Pallas kernel (pallas_kernels/inference/paged_decode_attention.py)."""
  from pallas_kernels.inference import paged_decode_attention

  if isinstance(scale, jax.Array):
    query = query.astype(jnp.float32) * scale
    scale = 1.0
  kernel = dispatch.raise_if_differentiated(
    lambda *a: paged_decode_attention.paged_gqa_decode(*a, scale=scale),
    _no_gradients("paged_gqa_decode"),
  )
  return kernel(query, key_pages, value_pages, block_tables, lengths)


def paged_gqa_decode_xla(query, key_pages, value_pages, block_tables, lengths, scale):
  """The jnp version: gather each sequence's pages into a dense [B, max_pages * page_size,
  Hkv, D] cache (reads every page of the table: XLA cannot follow the lengths), then
  `gqa_decode_xla`. Table entries are in [0, num_pages) (clipped by the caller)."""
  num_pages, page_size, kv_heads, dim = key_pages.shape
  batch, max_pages = block_tables.shape
  dense_shape = (batch, max_pages * page_size, kv_heads, dim)
  key = jnp.take(key_pages, block_tables, axis=0).reshape(dense_shape)
  value = jnp.take(value_pages, block_tables, axis=0).reshape(dense_shape)
  return gqa_decode_xla(query, key, value, lengths, scale)


def paged_gqa_decode_reference(query, key_pages, value_pages, block_tables, lengths, scale):
  """The definition, position by position: sequence b's position p is slot p % page_size of
  page block_tables[b, p // page_size]; token t attends to positions p <= lengths[b] - Tq + t
  with a plain masked softmax (float32)."""
  f32 = jnp.float32
  batch, tq, q_heads, _ = query.shape
  _, page_size, kv_heads, _ = key_pages.shape
  pos = jnp.arange(block_tables.shape[1] * page_size)
  page = block_tables[:, pos // page_size]  # [B, C]
  key = key_pages[page, pos % page_size].astype(f32)  # [B, C, Hkv, D]
  value = value_pages[page, pos % page_size].astype(f32)
  head = jnp.arange(q_heads) // (q_heads // kv_heads)  # cache head of each query head
  key, value = key[:, :, head], value[:, :, head]  # [B, C, Hq, D]
  sees = pos[None, None, :] <= (lengths[:, None] - tq + jnp.arange(tq))[:, :, None]  # [B, Tq, C]
  sees = sees[:, :, None, :]  # [B, Tq, 1, C]
  s = jnp.einsum("bthd,bchd->bthc", query.astype(f32), key, precision=HIGHEST) * scale
  w = jax.nn.softmax(jnp.where(sees, s, -jnp.inf), axis=-1, where=sees)
  w = jnp.where(sees, w, 0.0)  # rows that see nothing: zeros
  value = jnp.where((pos[None, :] < lengths[:, None])[:, :, None, None], value, 0.0)
  return jnp.einsum("bthc,bchd->bthd", w, value, precision=HIGHEST)


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
    implementation: "reference", "xla", "pallas" or None ("pallas" on a supported GPU, else
      "xla").

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
  implementation = dispatch.resolve("paged_gqa_decode", implementation)
  query, key_pages, value_pages = (jnp.asarray(x) for x in (query, key_pages, value_pages))
  lengths = jnp.clip(jnp.asarray(lengths), 0, capacity).astype(jnp.int32)
  if 0 in (batch, tq, q_heads, dim, capacity, num_pages):
    return jnp.zeros(query.shape, jnp.float32)
  # Clamped (and then cast: int64 ids never wrap): a bad traced id reads a real page.
  block_tables = jnp.clip(jnp.asarray(block_tables), 0, num_pages - 1).astype(jnp.int32)
  run = dispatch.entry("paged_gqa_decode", implementation)
  out = run(
    _as_tokens(query), key_pages, value_pages, block_tables, lengths, _prepare_scale(scale, dim)
  )
  return out.reshape(query.shape)


# ----------------------------------------------------------------------------------------------
# Recurrent step of the gated delta product
# ----------------------------------------------------------------------------------------------


def _step_mask(mask, batch, heads, dim_k):
  """Check a step mask and return it as [Bm, Hm, r, r] (Bm in {1, B}, Hm in {1, H}) plus r."""
  if mask is None:
    return jnp.ones((1, 1, 1, 1), jnp.float32), 1
  check_float("mask", mask)
  shape = tuple(mask.shape)
  if len(shape) == 4:
    if shape[:2] != (batch, heads):
      raise ValueError(
        f"mask has shape {shape}; a per-sequence mask must be [B, H, r, r] = "
        f"[{batch}, {heads}, r, r]"
      )
    mask5, r = normalize_mask(mask[:, None], batch, 1, heads, dim_k)
  elif len(shape) in (2, 3):
    mask5, r = normalize_mask(mask, batch, 1, heads, dim_k)
  else:
    raise ValueError(
      f"mask has shape {shape}; expected [r, r], [H, r, r] = [{heads}, r, r] "
      f"or [B, H, r, r] = [{batch}, {heads}, r, r]"
    )
  return mask5[:, 0], r


def _check_step(q, k, v, g, beta, mask, state, grouped=False):
  """Validate the step's arguments; returns (B, HV, K, V, mask [Bm, Hm, r, r], r). grouped:
  allow HV value heads (v, g, beta, the mask, the state) for H key heads (q, k), HV % H == 0;
  without it HV must equal H."""
  for name, x in (("q", q), ("k", k), ("v", v)):
    check_float(name, x)
  if q.ndim != 3:
    raise ValueError(
      f"q must be [B, H, K] (rank 3: one token per sequence), got shape {tuple(q.shape)}"
    )
  batch, heads, dim_k = q.shape
  check_shape("k", k, q.shape, "k must match q: [B, H, K]")
  if not grouped:
    if v.ndim != 3 or tuple(v.shape[:2]) != (batch, heads):
      raise ValueError(
        f"v has shape {tuple(v.shape)}, expected [B, H, V] = [{batch}, {heads}, V] (B, H as q)"
      )
  else:
    if v.ndim != 3 or v.shape[0] != batch:
      raise ValueError(
        f"v has shape {tuple(v.shape)}, expected [B, HV, V] = [{batch}, HV, V] (B as q; HV "
        f"a multiple of H = {heads})"
      )
    if heads < 1 or v.shape[1] < 1 or v.shape[1] % heads != 0:
      raise ValueError(
        f"v has shape {tuple(v.shape)}, expected [B, H, V] = [{batch}, {heads}, V] or, with "
        f"grouped value heads, [B, HV, V] with HV a positive multiple of H = {heads} (the key "
        f"heads of q and k, shape {tuple(q.shape)}; value head i reads key head i // (HV // H))"
      )
  heads_v = v.shape[1]
  h = "HV" if grouped else "H"
  if not (q.dtype == k.dtype == v.dtype):
    raise TypeError(f"q, k and v must share one dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
  dim_v = v.shape[-1]
  if beta is None:
    raise ValueError(f"beta is required: the write strength, shape [B, {h}] = [{batch}, {heads_v}]")
  check_float("beta", beta)
  check_shape("beta", beta, (batch, heads_v), f"[B, {h}] as v")
  if g is not None:
    check_float("g", g)
    check_shape("g", g, (batch, heads_v), f"[B, {h}] as v: the log-decay")
  mask4, r = _step_mask(mask, batch, heads_v, dim_k)
  if state is not None:
    check_float("state", state)
    check_shape("state", state, (batch, heads_v, dim_k, dim_v), f"[B, {h}, K, V]")
  return batch, heads_v, dim_k, dim_v, mask4, r


# implementation=None: the Pallas step up to this many state elements (8 MiB of float32), XLA's
# fused jnp step above. On an H200 (H=16, K=V=128, r = 1 and 2) the kernel is faster up to B = 8
# (4.9 vs 11.8 us at B = 1, 8-10 vs 9-14 us at B = 8) and XLA from B = 16 on (11.1 vs 12.6 us;
# 38 vs 47 us at B = 64): `python benchmarks/bench_decode.py --sections step --no-sweep --unroll
# --step-batches 1,2,4,16,32,128`, benchmarks/results/h200_2026-11-29_step_batches.json.
PALLAS_STEP_MAX_STATE = 8 * 16 * 128 * 128


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
    implementation: "xla", "pallas" or None: "pallas" on a supported GPU for a state of at most
      `PALLAS_STEP_MAX_STATE` elements (B * HV * K * V), else "xla" (docs/inference.md).
    precision: accepted as in `gated_delta_product` (validated); one token has no matmul to
      speed up, so both implementations compute the step in full float32 whatever it says.
    in_place: "pallas" only: write the new state into the state's buffer (no copy when the state
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
  batch, heads, dim_k, dim_v, mask4, r = _check_step(q, k, v, g, beta, mask, state, grouped=True)
  q, k, v, beta, mask4 = (jnp.asarray(x) for x in (q, k, v, beta, mask4))
  # grouped value heads: both implementations run on q and k repeated across each group
  q, k = (expand_key_heads(x, heads) for x in (q, k))
  g = None if g is None else jnp.asarray(g)
  if implementation is None and batch * heads * dim_k * dim_v > PALLAS_STEP_MAX_STATE:
    implementation = "xla"  # a large state: XLA's fused step reads it faster (see below)
  implementation = dispatch.resolve("gated_delta_product_step", implementation)
  resolve_precision(precision)  # a clear error for a bad value
  if g is None:
    g = jnp.zeros((batch, heads), jnp.float32)
  if state is None:
    state = jnp.zeros((batch, heads, dim_k, dim_v), jnp.float32)
  state = jnp.asarray(state).astype(jnp.float32)
  static, dynamic = _static_scale(scale, dim_k**-0.5)
  run = dispatch.entry("gated_delta_product_step", implementation)
  return run(
    q, k, v, g, beta, mask4, state, static if dynamic is None else dynamic, in_place=in_place
  )


def gated_delta_product_step_xla(q, k, v, g, beta, mask, state, scale, *, in_place=True):
  """The jnp step (gdp_jax/reference.py's recurrent_step); in_place has no meaning here."""
  del in_place
  batch, heads = q.shape[:2]
  r = mask.shape[-1]
  mask_b = jnp.broadcast_to(mask, (batch, heads, r, r))
  o, new = _recurrent_step(q, k, v, g, beta, mask_b, state, scale)
  return o.astype(q.dtype), new


def gated_delta_product_step_pallas(q, k, v, g, beta, mask, state, scale, *, in_place=True):
  """The Pallas kernel (pallas_kernels/inference/recurrent_step.py); scale a float or array."""
  from pallas_kernels.inference import recurrent_step as _kernel

  message = _no_gradients("gated_delta_product_step")
  if not isinstance(scale, jax.Array):
    kernel = dispatch.raise_if_differentiated(
      lambda *a: _kernel.recurrent_step(*a, scale=scale, in_place=in_place), message
    )
    return kernel(q, k, v, g, beta, mask, state)
  kernel = dispatch.raise_if_differentiated(
    lambda *a: _kernel.recurrent_step(*a, scale=1.0, out_dtype=jnp.float32, in_place=in_place),
    message,
  )
  o, new = kernel(q, k, v, g, beta, mask, state)
  return (o * scale).astype(q.dtype), new
