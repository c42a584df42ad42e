"""Non-finite inputs stay causal: a `nan` or `inf` at token t changes nothing before t, outputs
or gradients (docs/precision.md#non-finite-inputs).

The chunked form mixes the tokens of a chunk in its products, where `0 * nan = nan` would carry
a bad value to the earlier tokens of its chunk. So the implementations run on cleaned inputs and
mark the affected outputs afterwards, with selects only: `clean` (non-finite entries become 0; a
`nan` or `+inf` g becomes 0, `g = -inf` stays a reset) and `mark` (per batch row and head, the
outputs from the first bad token on and the final state become `nan`; a bad q spoils its own
token only). Their vjps, `mark_cotangents` and `clean_gradients`, serve the jnp backward
(xla_backward.py); the Pallas implementations wrap their kernels in the same two steps.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp


class Marks(NamedTuple):
  """Where the outputs are non-finite. o: [B, T, H] bool; final: [B, H] bool; state: [B, T, H]
  bool, the state after token t (the block states of block_states.py; a bad q spoils o only)."""

  o: jax.Array
  final: jax.Array
  state: jax.Array | None = None


def _finite(x):
  return jnp.isfinite(x)


def bad_rows(x, batch, t_len, heads, local=False):
  """[B, T, H, ...] (or broadcastable mask [Bm, Tm, Hm, r, r]) -> [B, T, H]: any non-finite.
  With grouped value heads, q and k have fewer heads than H: key head j // (H // Hk) serves
  value head j (docs/varlen.md#grouped-value-heads). local: x is whole on this device (`clean`)."""
  bad = ~_finite(x)
  if bad.ndim > 3 and local:
    # Over rows of the flattened array, into a 1-D result behind an optimization barrier: XLA
    # on a GPU otherwise fuses this reduction into the transpose of a consumer (the flags in
    # [B, H, T] order), which reads x at a fraction of the memory bandwidth; a 1-D array has
    # one layout, so the reduction reads x as it lies.
    lead = bad.shape[:3]
    flat = jnp.any(bad.reshape(math.prod(lead), -1), axis=1)
    bad = jax.lax.optimization_barrier(flat).reshape(lead)
  elif bad.ndim > 3:
    bad = jnp.any(bad, axis=tuple(range(3, bad.ndim)))
  if bad.shape[2] not in (1, heads):
    bad = jnp.repeat(bad, heads // bad.shape[2], axis=2)
  return jnp.broadcast_to(bad, (batch, t_len, heads))


def bad_tokens(q, k, v, g, beta, mask, *, local=False, substeps=1):
  """(bad_state, bad_q), each [B, T, H] bool: the tokens whose k, v, beta, mask (any of their
  `substeps` sub-steps) or g spoil the state from them on (g: nan or +inf; -inf is a reset),
  and those whose q is non-finite (their own output only). Arguments as `clean`'s."""
  batch, t_sub, heads = v.shape[:3]
  t_len = t_sub // substeps
  sub_rows = lambda x: bad_rows(x, batch, t_sub, heads, local)
  bad_sub = sub_rows(k) | sub_rows(v) | sub_rows(beta)
  if mask is not None:
    bad_sub = bad_sub | sub_rows(mask)
  if substeps > 1:
    bad_sub = jnp.any(bad_sub.reshape(batch, t_len, substeps, heads), axis=2)
  bad_state = bad_sub | jnp.isnan(g) | (g == jnp.inf)
  return bad_state, bad_rows(q, batch, t_len, heads, local)


def zero_nonfinite(x):
  """x with its non-finite entries 0."""
  return jnp.where(_finite(x), x, jnp.zeros((), x.dtype))


def cleaned(q, k, v, g, beta, mask):
  """The inputs with non-finite entries 0 (a nan or +inf g too; g = -inf stays a reset)."""
  zero = zero_nonfinite
  g = jnp.where(jnp.isnan(g) | (g == jnp.inf), jnp.zeros((), g.dtype), g)
  mask = None if mask is None else zero(mask)
  return zero(q), zero(k), zero(v), g, zero(beta), mask


def clean(q, k, v, g, beta, mask, *, local=False, substeps=1, with_state=False):
  """(cleaned (q, k, v, g, beta, mask), Marks) for the operator's normalised inputs:
  q, k [B, T, Hk, K] (Hk = H, or a divisor of H: grouped value heads); v [B, T, H, V];
  g, beta [B, T, H]; mask [Bm, Tm, Hm, r, r] (or None). Marks are per value head.

  local: the arrays are whole on this device (the Pallas kernels' guard, which runs per device:
  gdp_jax/ops/gated_delta_product/partitioning.py), so the reductions may flatten them (a
  flattened sharded array would be gathered first).
  substeps: the Householder form's n_h (householder_delta_product): k, v and beta hold T n_h
  sub-steps, n_h per token, and a bad sub-step spoils the state from its token on.
  with_state: also fill `Marks.state` (else None: no residual more for the kernels' backward)."""
  t_len = q.shape[1]
  bad_state, bad_q = bad_tokens(q, k, v, g, beta, mask, local=local, substeps=substeps)
  # The state is bad from the first bad token on. One reduction over time finds it (a running
  # "or", `lax.cummax`, is a scan of many small kernels on a GPU).
  t = jax.lax.broadcasted_iota(jnp.int32, bad_state.shape, 1)
  first_bad = jnp.min(jnp.where(bad_state, t, t_len), axis=1)  # [B, H]; t_len: none
  spoiled = t >= first_bad[:, None, :]
  marks = Marks(spoiled | bad_q, first_bad < t_len, spoiled if with_state else None)
  return cleaned(q, k, v, g, beta, mask), marks


def mark(o, final, marks):
  """o [B, T, H, V] and final [B, H, K, V] with the marked entries set to nan."""
  o = jnp.where(marks.o[..., None], jnp.array(jnp.nan, o.dtype), o)
  return o, mark_final(final, marks)


def mark_final(final, marks):
  """final [B, H, K, V] set to nan where marked (for a kernel that marks o itself)."""
  return jnp.where(marks.final[..., None, None], jnp.array(jnp.nan, final.dtype), final)


def mark_cotangents(do, dfinal, marks):
  """The vjp of `mark`: zero cotangents for the marked outputs (dfinal may be None)."""
  do = jnp.where(marks.o[..., None], jnp.zeros((), do.dtype), do)
  if dfinal is not None:
    dfinal = jnp.where(marks.final[..., None, None], jnp.zeros((), dfinal.dtype), dfinal)
  return do, dfinal


def clean_gradients(grads, inputs):
  """The vjp of `clean`: zero gradients where an input was non-finite (g: nan or +inf).

  grads and inputs: (dq, dk, dv, dg, dbeta, dmask) and (q, k, v, g, beta, mask)."""
  out = []
  for name, d, x in zip(("q", "k", "v", "g", "beta", "mask"), grads, inputs):
    keep = ~(jnp.isnan(x) | (x == jnp.inf)) if name == "g" else _finite(x)
    out.append(jnp.where(keep, d, jnp.zeros((), d.dtype)))
  return tuple(out)
