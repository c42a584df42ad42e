"""A per-shard call with every derivative: forward mode, reverse mode, higher orders
(docs/sharding.md#under-plain-jaxjit).

A `jax.custom_vjp` around per-shard calls serves reverse mode only (under `jax.jvp` JAX stages a
`custom_lin` that fails when lowered). `every_mode_call(specs, *primals)` is a `jax.custom_jvp`
instead: its primal is the per-shard forward; its jvp runs the saving forward and gives the
tangents by `tangent_p`, a primitive linear in the tangents whose lowering is a per-shard call of
the function's jvp (forward mode), whose transpose is the per-shard backward from the saved
residuals (reverse mode), whose batching rule is the unpartitioned jvp under `jax.vmap`, and
whose own jvp is the unpartitioned jvp's (second order). The residuals are its operands only so
that its transpose can read them.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from gdp_jax.ops.partitioning import ShardSpec, per_shard_call
from gdp_jax.ops.partitioning_vjp import VjpSpecs


@dataclasses.dataclass(frozen=True)
class _Tangents:
  """(*primals, *residuals, *tangents) -> the jvp of `fn` at the primals (the residuals are not
  read); with `sequence`, of this device's piece (context parallel)."""

  fn: Callable
  primals: int
  residuals: int

  def __call__(self, *arrays, sequence=(), blocks=()):
    primals = arrays[: self.primals]
    tangents = arrays[self.primals + self.residuals :]
    run = (lambda *p: tuple(self.fn(*p, sequence=sequence))) if sequence else self._plain
    return tuple(jax.jvp(run, primals, tangents)[1])

  def _plain(self, *primals):
    return tuple(self.fn(*primals))


def _tangent_spec(specs: VjpSpecs) -> ShardSpec:
  forward, backward = specs.forward, specs.backward
  operands = backward.results  # the primals' labels
  residuals = forward.results[specs.outputs :]
  return ShardSpec(
    _Tangents(specs.fn, len(operands), len(residuals)),
    (*operands, *residuals, *operands),
    forward.results[: specs.outputs],
    forward.heads,
    forward.group,
  )


tangent_p = Primitive("gdp_partitioned_tangents")
tangent_p.multiple_results = True


def _unpartitioned(specs, *arrays):
  return _tangent_spec(specs).fn(*arrays)


@tangent_p.def_abstract_eval
def _abstract(*arrays, specs, out_avals):
  return [jax.core.ShapedArray(a.shape, a.dtype) for a in out_avals]


def _per_shard(*arrays, specs, out_avals):
  return per_shard_call(_tangent_spec(specs), *arrays)


tangent_p.def_impl(_per_shard)
mlir.register_lowering(tangent_p, mlir.lower_fun(_per_shard, multiple_results=True))


def _transpose(cotangents, *arrays, specs, out_avals):
  primals = len(specs.backward.results)
  residuals = len(specs.forward.results) - specs.outputs
  fixed = arrays[: primals + residuals]
  cotangents = [ad.instantiate_zeros(ct) for ct in cotangents]
  grads = per_shard_call(specs.backward, *fixed, *cotangents)
  out = [None] * (primals + residuals)
  for tangent, grad in zip(arrays[primals + residuals :], grads):
    out.append(grad if ad.is_undefined_primal(tangent) else None)
  return out


ad.primitive_transposes[tangent_p] = _transpose


def _jvp(arrays, tangents, *, specs, out_avals):
  tangents = [ad.instantiate_zeros(t) for t in tangents]
  outs, douts = jax.jvp(functools.partial(_unpartitioned, specs), tuple(arrays), tuple(tangents))
  return outs, douts


ad.primitive_jvps[tangent_p] = _jvp


def _batched(arrays, dims, *, specs, out_avals):
  outs = jax.vmap(functools.partial(_unpartitioned, specs), in_axes=tuple(dims))(*arrays)
  return outs, (0,) * len(outs)


batching.primitive_batchers[tangent_p] = _batched


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def every_mode_call(specs: VjpSpecs, *primals):
  """The function of `specs` (`vjp_specs`) at the primals, per device on its block (module
  docstring), differentiable in every mode."""
  forward = specs.forward
  plain = dataclasses.replace(forward, fn=specs.fn, results=forward.results[: specs.outputs])
  return per_shard_call(plain, *primals)


@every_mode_call.defjvp
def _every_mode_jvp(specs, primals, tangents):
  outs = per_shard_call(specs.forward, *primals)
  outputs, residuals = outs[: specs.outputs], outs[specs.outputs :]
  out_avals = tuple(jax.ShapeDtypeStruct(o.shape, o.dtype) for o in outputs)
  douts = tangent_p.bind(*primals, *residuals, *tangents, specs=specs, out_avals=out_avals)
  return tuple(outputs), tuple(douts)
