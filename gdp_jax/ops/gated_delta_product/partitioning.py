"""The operator's Pallas implementations (and "xla") partitioned under plain `jax.jit`
(docs/sharding.md#under-plain-jaxjit).

`partitioned(run, q, k, v, g, beta, mask, initial_state, scale, chunk_size)` runs an
implementation on each device's block of batch rows and heads (each device padding its own
block), with no all-gather, or context parallel when the sequence is split: the forward and the
backward are each a per-shard call (gdp_jax/ops/partitioning.py) inside one `jax.custom_vjp`, the
forward saving the residuals of the implementation's pullback per device (`vjp_specs`,
partitioning_vjp.py). An implementation whose residuals cannot be labelled gets a backward that
runs the forward again on the device's block. Labels: q, k "bth-"; v, o "btv-"; g, beta "btv";
the state "bv--"; the mask "btv--" (with "1" for broadcast dimensions). An array scale is
applied outside (o is linear in it).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar

import jax
import jax.numpy as jnp

from gdp_jax.ops.autodiff import in_forward_mode
from gdp_jax.ops.gated_delta_product import context_parallel, xla
from gdp_jax.ops.gated_delta_product.base import run_padded
from gdp_jax.ops.partitioning import ShardSpec, every_axis_manual, per_shard_call
from gdp_jax.ops.partitioning_jvp import every_mode_call
from gdp_jax.ops.partitioning_vjp import (
  pullback_residuals,
  saved_pullback,
  sequence_vjp,
  vjp_specs,
)

TOKENS = ("bth-", "bth-", "btv-", "btv", "btv")  # q, k, v, g, beta
STATE = "bv--"
OUTPUT = "btv-"


def _mask_labels(mask) -> str:
  """[Bm, Tm, Hm, r, r]: each of the first three is either full ("b", "t", "v") or size 1."""
  full = "btv"
  return "".join(la if mask.shape[d] != 1 else "1" for d, la in enumerate(full)) + "--"


@dataclasses.dataclass(frozen=True)
class _Forward:
  """The implementation's forward: (q, k, v, g, beta, mask, h0) -> (o, final); with
  `sequence` (mesh axes) this device's piece of a split sequence, context parallel.

  Differentiated with the sequence split (gdp_jax/ops/partitioning.py's `split_forward`,
  `split_backward`): the forward saves, in the unsplit form's residual slots, the residuals of
  its first call (the piece's outputs from a zero state), and its final state F (`split_extra`);
  the backward runs the second call (the transition) again and differentiates it with the
  chain, then that first call's pullback from the saved residuals. Where the first call's
  residuals do not fit the slots (a piece that is not whole chunks), nothing is saved and the
  backward differentiates the whole split forward again."""

  run: object
  scale: float
  chunk_size: int
  split_extra: ClassVar[tuple[str, ...]] = (STATE,)  # F of this device's piece

  def __call__(self, *primals, sequence=(), blocks=()):
    if sequence:
      return _context_parallel(self, sequence, *primals)
    return tuple(self.padded(*primals))

  def split_extra_avals(self, *primals):
    return (jax.ShapeDtypeStruct(primals[6].shape, jnp.float32),)  # F, like the state

  def _first_call_saves(self, sources, residual_shapes, primals):
    """Whether the first call's residuals at `primals` fill slots of `residual_shapes`."""
    if primals[0].shape[1] % self.chunk_size:
      return False
    found = []

    def residuals(*p):
      _, saved, got, _ = pullback_residuals(self, p)
      found.append(got)
      return saved

    shapes = [tuple(r.shape) for r in jax.eval_shape(residuals, *primals)]
    return found[0] == sources and shapes == [tuple(b) for b in residual_shapes]

  def _second_call(self, sequence, o0, final0, q, k, v, g, beta, mask, h0):
    """The transition call (0_K values from I_K) and the chain: (o, final) given the first
    call's o0 and F."""
    bl, _, hv, _ = v.shape
    dk = q.shape[-1]
    eye = jnp.broadcast_to(jnp.eye(dk, dtype=jnp.float32), (bl, hv, dk, dk))
    zeros = jnp.zeros(v.shape[:3] + (dk,), v.dtype)
    qp, transition = self.padded(q, k, zeros, g, beta, mask, eye)
    return context_parallel.combine(o0, qp, final0, transition, h0, sequence, q.dtype)

  def split_forward(self, sequence, sources, residual_blocks, q, k, v, g, beta, mask, h0):
    first = (q, k, v, g, beta, mask, jnp.zeros_like(h0))
    if not self._first_call_saves(sources, residual_blocks, first):
      return None
    (o0, final0), residuals, _, _ = pullback_residuals(self, first)
    o, final = self._second_call(sequence, o0, final0, q, k, v, g, beta, mask, h0)
    return (o, final), residuals, (final0,)

  def split_backward(self, sequence, sources, primals, residuals, extras, cotangents):
    q, k, v, g, beta, mask, h0 = primals
    first = (q, k, v, g, beta, mask, jnp.zeros_like(h0))
    if not self._first_call_saves(sources, [r.shape for r in residuals], first):
      return None
    do, dfinal = cotangents
    # the final state is the same on every device along the sequence: its cotangent enters once
    dfinal = jnp.where(jax.lax.axis_index(sequence) == 0, dfinal, jnp.zeros_like(dfinal))
    o_aval = jax.eval_shape(self, *first)[0]
    second = lambda o0, final0, q, k, g, beta, mask, h0: self._second_call(
      sequence, o0, final0, q, k, v, g, beta, mask, h0
    )
    o0 = jnp.zeros(o_aval.shape, o_aval.dtype)  # o is linear in o0: its value is not read
    _, pullback = jax.vjp(second, o0, extras[0], q, k, g, beta, mask, h0)
    do0, dfinal0, dq, dk, dg, dbeta, dmask, dh0 = pullback((do, dfinal))
    pullback = saved_pullback(self, first, sources, residuals)
    dq1, dk1, dv, dg1, dbeta1, dmask1, _ = pullback((do0, dfinal0))
    return dq + dq1, dk + dk1, dv, dg + dg1, dbeta + dbeta1, dmask + dmask1, dh0

  def padded(self, q, k, values, g, beta, mask, start):
    """The implementation on a block or piece whose length need not be a multiple of the chunk
    (`padded_run`)."""
    return run_padded(self.run, q, k, values, g, beta, mask, start, self.scale, self.chunk_size)


def _context_parallel(forward, sequence, q, k, v, g, beta, mask, h0):
  """This device's piece of a sequence split over the mesh axes `sequence`: the per-device
  function of `gdp_jax.sharding`'s context parallelism (context_parallel.py; the kernels as two
  calls of the ordinary width), every device returning the same final state."""
  operator = lambda values, start: forward.padded(q, k, values, g, beta, mask, start)
  return context_parallel.piece_outputs(operator, q, v, h0, sequence, split=True)


@dataclasses.dataclass(frozen=True)
class _Backward:
  """(q, k, v, g, beta, mask, h0, do, dfinal) -> the seven gradients: the vjp of the
  implementation (its forward is recomputed on the device's block)."""

  run: object
  scale: float
  chunk_size: int

  def __call__(self, *arrays, sequence=(), blocks=()):
    primals, cotangents = arrays[:7], arrays[7:]
    forward = _Forward(self.run, self.scale, self.chunk_size)
    if sequence:
      return sequence_vjp(forward, sequence, (OUTPUT, STATE), primals, cotangents)
    _, vjp = jax.vjp(lambda *p: forward(*p), *primals)
    return tuple(vjp(tuple(cotangents)))


def _operands(mask):
  return (*TOKENS, _mask_labels(mask), STATE)


@functools.lru_cache(maxsize=256)
def _saving_specs(run, scale, chunk_size, avals):
  """The per-shard forward that saves the residuals of the implementation's pullback and the
  backward that uses them (`vjp_specs`), or None (then `_recomputing_specs`): also when T is
  not a multiple of the chunk, where each device pads its own block, so the residuals (of the
  padded block) have no layout that follows the inputs' split and probing them with T doubled
  would meet another pullback (one with no padding)."""
  q, _, v, _, _, mask, _ = avals
  if q.shape[1] % chunk_size:
    return None
  heads = q.shape[2]
  return vjp_specs(
    _Forward(run, scale, chunk_size),
    _operands(mask),
    (OUTPUT, STATE),
    heads,
    v.shape[2] // heads,
    *avals,
  )


def _recomputing_specs(run, scale, chunk_size, q, v, mask):
  heads = q.shape[2]
  common = dict(heads=heads, group=v.shape[2] // heads)
  operands = _operands(mask)
  forward = ShardSpec(_Forward(run, scale, chunk_size), operands, (OUTPUT, STATE), **common)
  backward = ShardSpec(
    _Backward(run, scale, chunk_size), (*operands, OUTPUT, STATE), operands, sums=True, **common
  )
  return forward, backward


def _avals(*arrays):
  return tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in arrays)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _operator(run, scale, chunk_size, q, k, v, g, beta, mask, h0):
  forward, _ = _recomputing_specs(run, scale, chunk_size, q, v, mask)
  return per_shard_call(forward, q, k, v, g, beta, mask, h0)


def _operator_fwd(run, scale, chunk_size, *primals):
  specs = _saving_specs(run, scale, chunk_size, _avals(*primals))
  if specs is None:
    return _operator(run, scale, chunk_size, *primals), (primals, ())
  o, final, *residuals = per_shard_call(specs.forward, *primals)
  return (o, final), (primals, tuple(residuals))


def _operator_bwd(run, scale, chunk_size, saved, cotangents):
  primals, residuals = saved
  specs = _saving_specs(run, scale, chunk_size, _avals(*primals))
  if specs is None:
    q, _, v, _, _, mask, _ = primals
    _, backward = _recomputing_specs(run, scale, chunk_size, q, v, mask)
  else:
    backward = specs.backward
  return per_shard_call(backward, *primals, *residuals, *cotangents)


_operator.defvjp(_operator_fwd, _operator_bwd)


def partitioned(run, q, k, v, g, beta, mask, initial_state, scale, chunk_size):
  """run(q, k, v, g, beta, mask, initial_state, scale, chunk_size) -> (o, final), per device
  on its block of batch rows and heads under `jax.jit` (module docstring). T need not be a
  multiple of the chunk: each device pads its own block (`padded_run`). `run` must be
  hashable (an implementation instance) and differentiable with `jax.vjp`."""
  primals = (q, k, v, g, beta, mask, initial_state)
  # inside shard_map (this device's block already), or forward mode: the implementation itself,
  # unpartitioned (its derivative, or its clear error while tracing)
  if every_axis_manual() or in_forward_mode((primals, scale)):
    return run_padded(run, *primals, scale, chunk_size)
  if not isinstance(scale, (int, float)):
    o, final = partitioned(run, *primals, 1.0, chunk_size)
    return (o.astype(jnp.float32) * scale).astype(o.dtype), final
  return _operator(run, float(scale), chunk_size, *primals)


def differentiable(run, q, k, v, g, beta, mask, initial_state, scale, chunk_size):
  """`partitioned` for an implementation that JAX differentiates in every mode ("xla"): the
  same per-shard calls (batch and heads per device, a split sequence context parallel), the
  implementation run under `xla.Saving` (residuals of a layout that does not change with the
  block's sizes), inside a `jax.custom_jvp` whose tangent is a linear primitive
  (gdp_jax/ops/partitioning_jvp.py), so forward mode and higher orders keep working. Where the
  residuals have no layout of their own (T not a multiple of the chunk, or residuals
  `vjp_specs` cannot label) the implementation runs as it is and XLA partitions it."""
  if every_axis_manual():
    return run_padded(run, q, k, v, g, beta, mask, initial_state, scale, chunk_size)
  if not isinstance(scale, (int, float)):
    o, final = differentiable(run, q, k, v, g, beta, mask, initial_state, 1.0, chunk_size)
    return (o.astype(jnp.float32) * scale).astype(o.dtype), final
  primals = (q, k, v, g, beta, mask, initial_state)
  specs = _saving_specs(xla.Saving(run), float(scale), chunk_size, _avals(*primals))
  if specs is None:
    return run_padded(run, *primals, scale, chunk_size)
  return every_mode_call(specs, *primals)


def partitions() -> bool:
  """Whether the implementations are wrapped (`partitioned`): not in a process with one device,
  where there is nothing to partition (and the Mosaic GPU interpreter's callbacks could not
  pass through custom_partitioning's lowering)."""
  return jax.device_count() > 1
