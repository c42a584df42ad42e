"""Context parallelism: each device runs its piece of the sequence, and the pieces are chained
through their transitions (docs/sharding.md#context-parallel-the-sequence-in-n-pieces).

`piece_outputs(operator, q, v, initial_state, axes, split=...)` is the per-device function of
both context-parallel paths: `gdp_jax.sharding` (inside `jax.shard_map`) and the operator's own
partitioning under plain `jax.jit` (partitioning.py next to this file). It runs inside a context
where the mesh `axes` that split the sequence are named (shard_map's body, or custom_partitioning's
per-device function). `operator(values, start) -> (o, final)` is the single-device operator on
this device's piece (its q, k, g, beta and mask fixed) with other values and another starting
state; any implementation works, since only the values and the state change.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

f32 = jnp.float32
HIGHEST = jax.lax.Precision.HIGHEST


def widened_state(batch, heads, dim_k, dim_v):
  """[0_{K x V} | I_K] for every row and head: [batch, heads, K, V + K] float32."""
  eye = jnp.broadcast_to(jnp.eye(dim_k, dtype=f32), (batch, heads, dim_k, dim_k))
  return jnp.concatenate([jnp.zeros((batch, heads, dim_k, dim_v), f32), eye], axis=-1)


def summarise(operator, q, v, state, split):
  """The piece from a zero state, with its transition (docs/sharding.md#one-call-of-the-operator-
  gives-all-four): the operator on the values widened to [v | 0_K] from `state` = [0 | I_K]
  (`widened_state`). split=True makes the two halves two calls of the ordinary width.

  Returns o0 [B, T, HV, V] (outputs from zero), qp [B, T, HV, K] (scale q_t^T P_t), in the
  operator's output dtype, and final0 [B, HV, K, V], transition [B, HV, K, K] (float32).
  """
  bl, tl, hv, dv = v.shape
  zeros = jnp.zeros((bl, tl, hv, q.shape[-1]), v.dtype)
  if split:
    o0, final0 = operator(v, state[..., :dv])
    qp, transition = operator(zeros, state[..., dv:])
    return o0, qp, final0, transition
  o_ext, fin_ext = operator(jnp.concatenate([v, zeros], axis=-1), state)
  return o_ext[..., :dv], o_ext[..., dv:], fin_ext[..., :dv], fin_ext[..., dv:]


def chain_states(transitions, finals, initial_state):
  """The incoming state of every piece: S_in(0) = initial_state, S_in(j+1) = P_j S_in(j) + F_j.

  transitions [n, B, H, K, K], finals [n, B, H, K, V], initial_state [B, H, K, V] (float32).
  Returns (incoming [n, B, H, K, V], the state after the last piece [B, H, K, V]).
  """
  s = initial_state.astype(f32)
  incoming = []
  for j in range(transitions.shape[0]):
    incoming.append(s)
    s = jnp.einsum("bhij,bhjv->bhiv", transitions[j], s, precision=HIGHEST) + finals[j]
  return jnp.stack(incoming), s


def piece_outputs(operator, q, v, initial_state, axes, *, split, state=None):
  """This device's outputs and the final state of the whole sequence (every device computes
  the same one), its piece chained with the others over the mesh `axes` (a tuple of names).

  q [B, T/n, H, K] and v [B, T/n, HV, V] are this device's piece (only their shapes and q's
  dtype are read: `operator` holds the inputs); initial_state [B, HV, K, V] float32 or None;
  `state` the widened starting state when the caller builds it (`widened_state`, e.g. typed as
  varying inside shard_map). The only collective is the all-gather of the per-piece [P | F]
  pairs, [n, B, HV, K, K + V] float32.
  """
  bl, _, hv, dv = v.shape
  dk = q.shape[-1]
  if state is None:
    state = widened_state(bl, hv, dk, dv)
  o0, qp, final0, transition = summarise(operator, q, v, state, split)
  if initial_state is None:
    initial_state = jnp.zeros((bl, hv, dk, dv), f32)
  return combine(o0, qp, final0, transition, initial_state, axes, q.dtype)


def combine(o0, qp, final0, transition, initial_state, axes, dtype):
  """(o in `dtype`, the final state) from this piece's `summarise` results: the all-gather of
  the [P | F] pairs over `axes`, the chain from `initial_state` and the correction."""
  dk = transition.shape[-1]
  pieces = jax.lax.all_gather(jnp.concatenate([transition, final0], axis=-1), axes)
  incoming, final = chain_states(pieces[..., :dk], pieces[..., dk:], initial_state)
  me = jax.lax.axis_index(axes)
  s_in = jax.lax.dynamic_index_in_dim(incoming, me, axis=0, keepdims=False)
  # o_t = o0_t + scale q_t^T P_t S_in (docs/sharding.md#correcting-the-outputs); qp carries the
  # scale.
  o = o0.astype(f32) + jnp.einsum("bthk,bhkv->bthv", qp.astype(f32), s_in, precision=HIGHEST)
  return o.astype(dtype), final
