"""The verify step's compact form (docs/inference.md#verifying-draft-tokens): the Tq new tokens
as one chunk of the chunked form (docs/chunked_form.md), which reads the state once, and a
record from which `rebuild` makes the state after any accepted length with one more read of it.

The state after m tokens of the chunk is
  S_m = exp(gamma_m) S_0 + sum_{t < m} exp(gamma_m - gamma_t) sum_a k_t^(a) v_new[(t, a)]^T
(gamma the cumulative log-decay, a reset zeroing what lies before it), so the record keeps the
per-token keys, corrected values v_new, gamma and reset counts: Tq (K + r V + 2) numbers per
head against Tq K V for every token's state.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from gdp_jax.ops.autodiff import no_gradients_message, raise_if_differentiated
from gdp_jax.ops.gated_delta_product import nonfinite, xla
from pallas_kernels.triton.inference import recurrent_verify

CHUNK = 16  # the chunk of the one-chunk form: the most new tokens a verify call takes
f32 = jnp.float32


class CompactStates(NamedTuple):
  """What `select_state` rebuilds any accepted length's state from (B sequences, HV heads, Tq
  tokens, r key blocks of dk = K / r): the state before the tokens, each token's key blocks and
  corrected values, the cumulative log-decay and reset counts, and where the state is spoiled by
  a non-finite input."""

  initial_state: jax.Array  # [B, HV, K, V] float32
  k: jax.Array  # [B, HV, Tq, r, dk] float32
  v_new: jax.Array  # [B, HV, Tq, r, V] float32
  gamma: jax.Array  # [B, HV, Tq] float32
  seg: jax.Array  # [B, HV, Tq] int32
  bad: jax.Array  # [B, HV, Tq] bool: the state after this token is not finite


def _pad_tokens(x):
  """[B, Tq, ...] -> [B, CHUNK, ...], zeros after the last token."""
  return jnp.pad(x, [(0, 0), (0, CHUNK - x.shape[1])] + [(0, 0)] * (x.ndim - 2))


def verify_compact(q, k, v, g, beta, mask, state, scale, kernel=False):
  """q, k [B, Tq, HV, K]; v [B, Tq, HV, V]; g, beta [B, Tq, HV]; mask [Bm, Tm, Hm, r, r];
  state [B, HV, K, V] f32 -> (o [B, Tq, HV, V] in q's dtype, CompactStates). kernel: the
  tokens one by one in the Triton kernel (recurrent_verify.py) instead of the one-chunk form."""
  t_q, r = q.shape[1], mask.shape[-1]
  (q, k, v, g, beta, mask), marks = nonfinite.clean(q, k, v, g, beta, mask, with_state=True)
  bsz, _, heads, dim_k = k.shape
  gamma, seg = xla.gate_cumsum(xla.to_head_major(_pad_tokens(g)), CHUNK)
  if kernel:
    o, v_new = _kernel_tokens(q, k, v, g, beta, mask, state, scale)
  else:
    o, v_new = _one_chunk(q, k, v, g, beta, mask, state, scale, gamma, seg)
  o = jnp.where(marks.o[..., None], jnp.nan, o)
  record = CompactStates(
    initial_state=state.astype(f32),
    k=jnp.moveaxis(k.astype(f32), 1, 2).reshape(bsz, heads, t_q, r, dim_k // r),
    v_new=v_new,
    gamma=gamma[..., :t_q],
    seg=seg[..., :t_q],
    bad=jnp.moveaxis(marks.state, 1, 2),
  )
  return o.astype(q.dtype), record


def _one_chunk(q, k, v, g, beta, mask, state, scale, gamma, seg):
  """The tokens as one chunk of the chunked form (jnp): (o [B, Tq, HV, V], v_new
  [B, HV, Tq, r, V])."""
  t_q, r = q.shape[1], mask.shape[-1]
  mask = mask if mask.shape[1] == 1 else _pad_tokens(mask)
  q, k, v, g, beta = map(_pad_tokens, (q, k, v, g, beta))  # no-op tokens after the last
  beta_hm = xla.to_head_major(beta)
  ai = xla.solve_tril(xla.chunk_kkt(k, beta_hm, mask, gamma, CHUNK, seg), CHUNK * r)
  w, u = xla.recompute_w_u(k, v, beta_hm, mask, gamma, ai, CHUNK, seg)
  h = state.astype(f32)[:, :, None]  # [B, HV, 1, K, V]: the one chunk's start state
  v_new = u - xla.einsum_f32("zyik,zykv->zyiv", w, state.astype(f32))
  o = xla.chunk_output(q, k, v_new, h, gamma, scale, CHUNK, seg)[:, :t_q]
  bsz, heads = v_new.shape[:2]
  return o, v_new.reshape(bsz, heads, CHUNK, r, -1)[:, :, :t_q]


def _kernel_tokens(q, k, v, g, beta, mask, state, scale):
  """The tokens one by one in the Triton kernel: (o [B, Tq, HV, V] float32, v_new
  [B, HV, Tq, r, V]: the values u_t^(a) each token's key blocks add)."""
  head_major = lambda x: jnp.moveaxis(x, 1, 2)
  static = not isinstance(scale, jax.Array)
  kernel = raise_if_differentiated(
    lambda *a: recurrent_verify.recurrent_verify(*a, scale=scale if static else 1.0),
    no_gradients_message("gated_delta_product_verify"),
  )
  o, u = kernel(*map(head_major, (q, k, v, g, beta, mask)), state)
  o = head_major(o)
  return (o if static else o * scale), u


def rebuild(record: CompactStates, lengths):
  """The state after the first lengths[b] (in [0, Tq]) tokens of each sequence: [B, HV, K, V]."""
  s0 = record.initial_state
  t_q = record.gamma.shape[-1]
  m = lengths[:, None]  # [B, 1]
  last = jnp.maximum(m - 1, 0)[..., None]  # [B, 1, 1]
  g_last = jnp.take_along_axis(record.gamma, jnp.broadcast_to(last, s0.shape[:2] + (1,)), -1)
  s_last = jnp.take_along_axis(record.seg, jnp.broadcast_to(last, s0.shape[:2] + (1,)), -1)
  t = jnp.arange(t_q)[None, None, :]
  reach = (t < m[..., None]) & (record.seg == s_last)  # tokens whose update reaches S_m
  weight = jnp.exp(jnp.where(reach, g_last - record.gamma, -jnp.inf))  # [B, HV, Tq]
  start = jnp.where(s_last[..., 0] == 0, jnp.exp(g_last[..., 0]), 0.0)  # exp(gamma_m)
  start = jnp.where(m > 0, start, 1.0)
  upd = xla.einsum_f32("zytad,zytav->zyadv", record.k * weight[..., None, None], record.v_new)
  state = start[..., None, None] * s0 + upd.reshape(s0.shape)
  bad = jnp.take_along_axis(record.bad, jnp.broadcast_to(last, s0.shape[:2] + (1,)), -1)[..., 0]
  return jnp.where((bad & (m > 0))[..., None, None], jnp.nan, state)
