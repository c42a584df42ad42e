"""In-kernel helpers for the chunk matrices' (t, a) row layout (docs/chunked_form.md#notation).

A chunk of BT tokens and r key blocks has N = BT * r rows, ordered token-major: row (t, a) is
t * r + a. Tiles are built by broadcasting a [BT, ...] token tile to [BT, r, ...] and merging the
two leading axes (a reshape that does not reorder, which the Triton lowering accepts).
These run inside kernels only; they never slice a loaded value (docs/pallas_triton.md).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

f32 = jnp.float32


def per_row(x, r):
  """[BT] per-token values -> [BT * r] per-row values (each repeated r times)."""
  if r == 1:
    return x
  bt = x.shape[0]
  return jnp.broadcast_to(x[:, None], (bt, r)).reshape(bt * r)


def block_indicator(r, dim_k):
  """E[a, c] = 1 where column c of the key belongs to block a: [r, K] float32."""
  dk = dim_k // r
  col_block = jax.lax.broadcasted_iota(jnp.int32, (r, dim_k), 1) // dk
  return (col_block == jax.lax.broadcasted_iota(jnp.int32, (r, dim_k), 0)).astype(f32)


def key_block_columns(x, a, r):
  """x [BT, K] with only key block a's columns kept (the others 0); `a` may be traced (the
  kernels' key-block loop form, pallas_kernels/common/options.py)."""
  dim_k = x.shape[-1]
  col_block = jax.lax.broadcasted_iota(jnp.int32, (1, dim_k), 1) // (dim_k // r)
  return jnp.where(col_block == a, x, jnp.zeros_like(x))


def expanded_mask(mask_ref, r, dim_k, tokens=slice(None)):
  """Mexp[x, a, c] = M_x[a, block(c)] from a mask tile [X, r, r] (X = 1 or BT): [X, r, K].

  `tokens` selects rows of the tile (a `pl.ds`) in the same load (the Triton lowering takes one
  indexer per ref access, so the selection cannot be a `ref.at[...]` view).
  """
  dk = dim_k // r
  col_block = jax.lax.broadcasted_iota(jnp.int32, (1, 1, dim_k), 2) // dk
  out = None
  for b in range(r):
    col = mask_ref[tokens, :, b].astype(f32)  # M[:, :, b]: [X, r]
    term = col[:, :, None] * (col_block == b).astype(f32)
    out = term if out is None else out + term
  return out


def masked_keys(k, mask_ref, r, tokens=slice(None)):
  """Kw: row (t, a) = [M_t[a, 0] k_t^(0), ..., M_t[a, r-1] k_t^(r-1)]: [BT * r, K] float32.

  `tokens`: the rows of the mask tile that go with k (see expanded_mask).
  """
  bt, dim_k = k.shape
  k = k.astype(f32)
  if r == 1:
    return k * mask_ref[tokens, :, 0].astype(f32)  # [X, 1] broadcasts over [BT, K]
  kw = k[:, None, :] * expanded_mask(mask_ref, r, dim_k, tokens)
  return kw.reshape(bt * r, dim_k)


def block_keys(k, r):
  """Kb: row (t, a) = k_t with only block a kept (other columns 0): [BT * r, K] float32."""
  bt, dim_k = k.shape
  k = k.astype(f32)
  if r == 1:
    return k
  kb = k[:, None, :] * block_indicator(r, dim_k)[None]
  return kb.reshape(bt * r, dim_k)


def repeat_rows(x, r):
  """[BT, D] -> [BT * r, D]: row (t, a) = x_t."""
  if r == 1:
    return x
  bt, d = x.shape
  return jnp.broadcast_to(x[:, None, :], (bt, r, d)).reshape(bt * r, d)


def chunk_end_decay(g):
  """g [C]: a chunk's cumulative log gates (non-increasing) -> (g_last, [C, 1] exp(g_last - g)):
  the chunk's last gate and each token's decay to the chunk's end (at most 1: no overflow), what a
  state update scales its keys by (docs/chunked_form.md)."""
  last = jax.lax.broadcasted_iota(jnp.int32, g.shape, 0) == g.shape[0] - 1
  g_last = jnp.sum(jnp.where(last, g, 0.0))
  return g_last, jnp.exp(g_last - g)[:, None]


def causal_decay(g_i, g_j, tok_i, tok_j, strict):
  """exp(g_i - g_j) where token i > token j (>= if not strict), else exactly 0: [I, J].

  The exponent is masked before `exp`: a positive argument is never exponentiated
  (docs/chunked_form.md#safe-exp).
  """
  causal = (tok_i[:, None] > tok_j[None, :]) if strict else (tok_i[:, None] >= tok_j[None, :])
  return jnp.exp(jnp.where(causal, g_i[:, None] - g_j[None, :], -jnp.inf))


def row_tokens(n, r):
  """Token index of each of n rows: [n] int32."""
  return jax.lax.broadcasted_iota(jnp.int32, (n,), 0) // r
