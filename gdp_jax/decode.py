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


def _check_gqa(query, key_cache, value_cache, lengths):
  for name, x in (("query", query), ("key_cache", key_cache), ("value_cache", value_cache)):
    check_float(name, x)
  if query.ndim != 3:
    raise ValueError(f"query must be [B, Hq, D] (rank 3), got shape {tuple(query.shape)}")
  if key_cache.ndim != 4:
    raise ValueError(
      f"key_cache must be [B, S, Hkv, D] (rank 4), got shape {tuple(key_cache.shape)}"
    )
  batch, q_heads, dim = query.shape
  _, seq_len, kv_heads, _ = key_cache.shape
  check_shape(
    "key_cache",
    key_cache,
    (batch, seq_len, kv_heads, dim),
    f"[B, S, Hkv, D] with B = {batch} and D = {dim} as query {tuple(query.shape)}",
  )
  check_shape(
    "value_cache", value_cache, key_cache.shape, "value_cache must match key_cache: [B, S, Hkv, D]"
  )
  if key_cache.dtype != value_cache.dtype:
    raise TypeError(
      f"key_cache and value_cache must share one dtype, got key_cache "
      f"{key_cache.dtype} and value_cache {value_cache.dtype}"
    )
  if not any(key_cache.dtype == d for d in CACHE_DTYPES):
    raise TypeError(
      f"key_cache and value_cache must be float32, bfloat16 or float16, got "
      f"{key_cache.dtype} with shape {tuple(key_cache.shape)}"
    )
  if kv_heads < 1:
    raise ValueError(
      f"key_cache has Hkv = {kv_heads} heads (shape {tuple(key_cache.shape)}); need Hkv >= 1"
    )
  if q_heads % kv_heads != 0:
    raise ValueError(
      f"the number of query heads Hq = {q_heads} (query shape "
      f"{tuple(query.shape)}) must be a multiple of the number of cache heads "
      f"Hkv = {kv_heads} (key_cache shape {tuple(key_cache.shape)})"
    )
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
  """The jnp version: query [B, Hq, D], caches [B, S, Hkv, D], lengths [B] int -> f32 [B, Hq, D].

  Scores of slots j >= lengths[b] are set to -inf before the softmax and their values to 0
  (a `where`, so even an inf in a stale slot cannot make a NaN).
  """
  f32 = jnp.float32
  batch, q_heads, dim = query.shape
  _, seq_len, kv_heads, _ = key_cache.shape
  group = q_heads // kv_heads
  q = query.astype(f32).reshape(batch, kv_heads, group, dim)
  valid = jnp.arange(seq_len, dtype=jnp.int32)[None, :] < lengths[:, None]  # [B, S]
  s = jnp.einsum("bkgd,bskd->bkgs", q, key_cache.astype(f32), precision=HIGHEST) * scale
  s = jnp.where(valid[:, None, None, :], s, -jnp.inf)
  m = jnp.max(s, axis=-1, keepdims=True)
  p = jnp.exp(s - jnp.where(m == -jnp.inf, 0.0, m))  # stale: 0
  total = jnp.sum(p, axis=-1)
  v = jnp.where(valid[:, :, None, None], value_cache.astype(f32), 0.0)
  o = jnp.einsum("bkgs,bskd->bkgd", p, v, precision=HIGHEST)
  o = o / jnp.where(total > 0, total, 1.0)[..., None]
  return o.reshape(batch, q_heads, dim)


def gqa_decode(
  query: jax.Array,
  key_cache: jax.Array,
  value_cache: jax.Array,
  lengths: jax.Array,
  *,
  scale: float | jax.Array | None = None,
  implementation: str | None = None,
) -> jax.Array:
  """Attention of one new token per sequence over a grouped-query KV cache.

  For sequence b and query head h (cache head h // G, G = Hq / Hkv):
    s_j = scale * q . K_j,  w = softmax over j < lengths[b],  o = sum_{j < lengths[b]} w_j V_j.

  Args:
    query: [B, Hq, D], any float dtype (computed in float32).
    key_cache, value_cache: [B, S, Hkv, D], one dtype: float32, bfloat16 or float16.
    lengths: [B] integers, may be traced under `jax.jit` (a new set of lengths never
      recompiles; the Pallas kernel's work follows the lengths, not S). Slots j >= lengths[b]
      get exactly zero weight whatever they hold. lengths[b] <= 0 gives a zero output row;
      lengths[b] > S behaves as S (int64 values too; concrete values outside int32 are an
      error rather than wrapping around).
    scale: score scale, default D ** -0.5 (a number, or an array: then folded in at run time).
    implementation: "xla", "pallas" or None ("pallas" on a supported GPU, else "xla").

  Returns:
    float32 [B, Hq, D].

  Derivatives: "xla" is plain jnp (JAX differentiates it); "pallas" raises NotImplementedError.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from gdp_jax import gqa_decode
    >>> query = jnp.ones((2, 4, 16))
    >>> cache = jnp.ones((2, 32, 2, 16), jnp.bfloat16)
    >>> gqa_decode(query, cache, cache, jnp.array([5, 32])).shape
    (2, 4, 16)
  """
  lengths = _check_gqa(query, key_cache, value_cache, lengths)
  implementation = dispatch.resolve("gqa_decode", implementation)
  query, key_cache, value_cache = (jnp.asarray(x) for x in (query, key_cache, value_cache))
  # Clipped before the cast: an int64 length (x64) beyond int32 behaves as S, never wraps.
  lengths = jnp.clip(jnp.asarray(lengths), 0, key_cache.shape[1]).astype(jnp.int32)
  batch, q_heads, dim = query.shape
  seq_len = key_cache.shape[1]
  if 0 in (batch, q_heads, dim, seq_len):
    return jnp.zeros((batch, q_heads, dim), jnp.float32)
  static, dynamic = _static_scale(scale, dim**-0.5)
  run = dispatch.entry("gqa_decode", implementation)
  return run(query, key_cache, value_cache, lengths, static if dynamic is None else dynamic)


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
    implementation: "xla", "pallas" or None ("pallas" on a supported GPU, else "xla").
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
