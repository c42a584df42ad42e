"""Layers of one configuration compiled once: `HybridLM`'s blocks run under `jax.lax.scan` over
their parameters stacked at call time (docs/train_lm.md#compile-time).

A layer pattern is a unit repeated R times ("DDDADDDADDDA" = "DDDA" x 3) and the unit runs of
one letter ("DDDA" = "D" x 3 + "A"). With R > 1 one scan runs the R units, the unit's layers one
after another in its body; with R = 1 each run of several layers is a scan of its own. Scans are
never nested (a nested scan's residuals are copied again into the outer scan's), and a scan's
body is checkpointed so that only matmul and kernel outputs cross from the forward to the
backward (`SAVED`): the rest is recomputed in the backward's body. The parameters stay one entry
per layer (checkpoints, sharding annotations and `model.blocks[i]` as unrolled); a call stacks
them (one copy of the parameters per call, its gradient a slice).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

# What a scanned layer keeps for its backward: the outputs of matmuls and of Pallas kernels
# (the operator's and attention's saved states, inverses, log-sum-exps), and of any call that
# runs a kernel (the operator's forward under its custom_jvp). Norms, activations, gates and
# masks are recomputed from them in the backward (elementwise work XLA fuses), where stacking
# them per layer would write and read several times the activations' bytes.
SAVED = frozenset({"dot_general"})
KERNELS = frozenset({"pallas_call", "mpmd_map"})


def _runs_kernel(params: dict) -> bool:
  """Whether a jaxpr among an equation's parameters (a call's body) runs a Pallas kernel."""
  for value in params.values():
    for item in value if isinstance(value, (tuple, list)) else (value,):
      eqns: Any = getattr(getattr(item, "jaxpr", item), "eqns", None)
      if eqns and any(e.primitive.name in KERNELS or _runs_kernel(e.params) for e in eqns):
        return True
  return False


def saveable(primitive, *_, **params) -> bool:
  """The scanned body's checkpoint policy (`SAVED`, `KERNELS` and the calls that run one)."""
  name = primitive.name
  return name in SAVED or name in KERNELS or (name != "jit" and _runs_kernel(params))


class LayerPlan(NamedTuple):
  """`pattern` = unit * repeats, unit = runs of one letter: ((letter, count), ...)."""

  repeats: int
  runs: tuple[tuple[str, int], ...]

  @property
  def shares(self) -> bool:
    """Whether two layers have one configuration (scanning compiles fewer layers)."""
    return self.repeats > 1 or any(n > 1 for _, n in self.runs)

  def scans(self) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """The layers in order as scans: per scan its rows (iterations), per row its layers. With
    R > 1 one scan of R rows, the unit's layers; else one scan per run, one layer per row."""
    unit = sum(n for _, n in self.runs)
    if self.repeats > 1:
      return (tuple(tuple(r * unit + i for i in range(unit)) for r in range(self.repeats)),)
    starts = [sum(n for _, n in self.runs[:j]) for j in range(len(self.runs))]
    return tuple(tuple((s + i,) for i in range(n)) for s, (_, n) in zip(starts, self.runs))


def layer_plan(pattern: str) -> LayerPlan:
  """The shortest unit whose repeats make `pattern`, and the unit's runs of one letter."""
  size = next(u for u in range(1, len(pattern) + 1) if pattern == pattern[:u] * (len(pattern) // u))
  runs: list[tuple[str, int]] = []
  for letter in pattern[:size]:
    if runs and runs[-1][0] == letter:
      runs[-1] = (letter, runs[-1][1] + 1)
    else:
      runs.append((letter, 1))
  return LayerPlan(len(pattern) // size, tuple(runs))


def _stack(trees):
  return jax.tree.map(lambda *a: jnp.stack(a), *trees)


def same_programs(blocks: Sequence[nnx.Module], plan: LayerPlan) -> bool:
  """Whether the layers that `plan` runs at one place of a scan's body have one graph
  definition."""
  for rows in plan.scans():
    for place in zip(*rows):
      first = nnx.graphdef(blocks[place[0]])
      if any(nnx.graphdef(blocks[i]) != first for i in place[1:]):
        return False
  return True


def scan_blocks(
  blocks: Sequence[nnx.Module],
  plan: LayerPlan,
  fn: Callable[[Any, jax.Array, Any], tuple[jax.Array, Any]],
  x: jax.Array,
  per_layer: Sequence[Any] | None = None,
) -> tuple[jax.Array, tuple]:
  """`x` through `blocks` in order, `fn(block, x, per_layer[l]) -> (x, out_l)` per layer, scanned
  by `plan`: (x, (out_0, ..., out_{L-1})), the same as the loop over the layers. The per-layer
  inputs and outputs (decode caches) of the layers at one place of a scan's body must share
  their structure."""
  inputs = tuple(per_layer) if per_layer is not None else (None,) * len(blocks)
  result: list[Any] = [None] * len(blocks)
  for rows in plan.scans():
    graphdefs = [nnx.graphdef(blocks[i]) for i in rows[0]]

    def body(x, xs, graphdefs=graphdefs):
      outs = []
      for graphdef, state, inp in zip(graphdefs, *xs):
        x, out = fn(nnx.merge(graphdef, state), x, inp)
        outs.append(out)
      return x, tuple(outs)

    if len(rows) == 1:  # a run of one layer: no loop
      x, outs = body(x, ([nnx.state(blocks[i]) for i in rows[0]], [inputs[i] for i in rows[0]]))
      for i, out in zip(rows[0], outs):
        result[i] = out
      continue
    xs = tuple(
      tuple(_stack([pick(i) for i in place]) for place in zip(*rows))
      for pick in (lambda i: nnx.state(blocks[i]), lambda i: inputs[i])
    )
    body = jax.checkpoint(body, policy=saveable, prevent_cse=False)
    x, outs = jax.lax.scan(body, x, xs)
    for place, out in zip(zip(*rows), outs):
      for r, i in enumerate(place):
        result[i] = jax.tree.map(lambda a, r=r: a[r], out)
  return x, tuple(result)
