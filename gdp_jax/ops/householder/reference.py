"""`implementation="reference"` of the Householder form: a plain recurrence over the sub-steps,
independent of the operator (the math: householder_delta_product's docstring; docs/operator.md)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from gdp_jax.ops.gated_delta_product import varlen

HIGHEST = jax.lax.Precision.HIGHEST


def _token(state, q_t, k_t, v_t, g_t, beta_t, scale, n_h):
  """One token: decay, its n_h sub-steps in order, the output. q_t [B, H, K], k_t [B, n_h, H, K],
  v_t [B, n_h, H, V], g_t [B, H], beta_t [B, n_h, H], state [B, H, K, V]; float32."""
  state = jnp.exp(g_t)[..., None, None] * state
  for j in range(n_h):
    kj = k_t[:, j]
    pred = jnp.einsum("bhk,bhkv->bhv", kj, state, precision=HIGHEST)  # k^T S
    err = beta_t[:, j][..., None] * (v_t[:, j] - pred)
    state = state + kj[..., :, None] * err[..., None, :]
  o = jnp.einsum("bhk,bhkv->bhv", q_t, state, precision=HIGHEST)
  return state, scale * o


def householder_reference(q, k, v, g, beta, initial_state, scale, n_h, cu_seqlens=None):
  """Token by token (`lax.scan`), the n_h sub-steps of a token in order, float32 throughout.

  q [B, T, H, K], k [B, T*n_h, H, K], v [B, T*n_h, H, V], g [B, T, H], beta [B, T*n_h, H],
  initial_state [B, H, K, V] float32. Returns (o [B, T, H, V] float32, final state float32).

  With cu_seqlens [N + 1] (offsets over the T tokens; B = 1, initial_state [N, H, K, V]): at a
  sequence's first token the state becomes that sequence's initial state, after its last token
  it is recorded as its final state; an empty sequence keeps its initial state. Returns
  (o [1, T, H, V], final [N, H, K, V]).
  """
  f32 = jnp.float32
  batch, t_len, heads, dim_k = q.shape
  per_token = lambda x: x.astype(f32).reshape((batch, t_len, n_h) + x.shape[2:])
  k, v, beta = per_token(k), per_token(v), per_token(beta)
  time_major = lambda x: jnp.moveaxis(x, 1, 0)
  xs = tuple(time_major(x) for x in (q.astype(f32), k, v, g.astype(f32), beta))
  h0 = initial_state.astype(f32)

  if cu_seqlens is None:

    def token(state, xs):
      return _token(state, *xs, scale, n_h)

    final, o = jax.lax.scan(token, h0, xs)
    return jnp.moveaxis(o, 0, 1), final

  cu = varlen.sanitize(cu_seqlens, t_len)
  seq, first, last = varlen.token_boundaries(cu, t_len)

  def packed_token(carry, xs):
    state, finals = carry
    *inputs, n, is_first, is_last = xs
    state = jnp.where(is_first, h0[n][None], state)  # a sequence starts from its own state
    state, o = _token(state, *inputs, scale, n_h)
    finals = finals.at[n].set(jnp.where(is_last, state[0], finals[n]))
    return (state, finals), o

  (_, final), o = jax.lax.scan(packed_token, (h0[:1], h0), xs + (seq, first, last))
  return jnp.moveaxis(o, 0, 1), final
