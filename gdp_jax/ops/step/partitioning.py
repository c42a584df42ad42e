"""The Pallas step partitioned under plain `jax.jit` (docs/sharding.md#under-plain-jaxjit).

`per_device(run)` wraps an implementation of the step (q, k, v, g, beta, mask, state, scale) ->
(o, new_state) so that inputs sharded over the batch and the heads run the kernel per device
on their block (gdp_jax/ops/partitioning.py). The step's api repeats q and k across each group
of value heads before the implementation, so every head dimension here is a value head.
Labels: q, k [B, HV, K] and v, o [B, HV, V] "bh-"; g, beta [B, HV] "bh"; the mask
[Bm, Hm, r, r] "bh--" with "1" for its size-1 broadcast dimensions; the state "bh--". A scale
that is an array is one more (replicated) operand. The kernel has no derivatives: differentiating
gives its own clear error.
"""

from __future__ import annotations

import dataclasses
import functools

import jax

from gdp_jax.ops.partitioning import ShardSpec, per_shard_call

TOKENS = ("bh-", "bh-", "bh-", "bh", "bh")  # q, k, v, g, beta
STATE = "bh--"
OUTPUT = "bh-"


def _mask_labels(mask) -> str:
  return "".join(la if mask.shape[d] != 1 else "1" for d, la in enumerate("bh")) + "--"


@dataclasses.dataclass(frozen=True)
class _Step:
  """run(q, k, v, g, beta, mask, state, scale): scale static (a float) or the last operand."""

  run: object
  scale: float | None

  def __call__(self, *arrays):
    if self.scale is None:
      *arrays, scale = arrays
    else:
      scale = self.scale
    return tuple(self.run(*arrays, scale))


def partitioned(run, q, k, v, g, beta, mask, state, scale):
  """run(q, k, v, g, beta, mask, state, scale) -> (o, new_state), per device on its block of
  batch rows and heads under `jax.jit` (module docstring)."""
  operands = (*TOKENS, _mask_labels(mask), STATE)
  arrays = [q, k, v, g, beta, mask, state]
  static = scale if isinstance(scale, (int, float)) else None
  if static is None:
    operands, arrays = (*operands, ""), [*arrays, scale]
  spec = ShardSpec(_Step(run, static), operands, (OUTPUT, STATE), heads=v.shape[1])
  return per_shard_call(spec, *arrays)


def per_device(run):
  """`run` with the same signature, partitioned (`partitioned`); `run` itself in a process with
  one device, where there is nothing to partition (and the Mosaic GPU interpreter's callbacks
  could not pass through custom_partitioning's lowering)."""
  if jax.device_count() == 1:
    return run
  return functools.partial(partitioned, run)
