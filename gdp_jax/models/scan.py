"""Layers of one configuration compiled once: `HybridLM`'s blocks run under `jax.lax.scan` over
their parameters stacked at call time (docs/train_lm.md#compile-time).

A layer pattern is a unit repeated R times ("DDDADDDADDDA" = "DDDA" x 3) and the unit runs of
one letter ("DDDA" = "D" x 3 + "A"): an outer scan over the R units, in it one inner scan per
run, so each distinct layer is traced, lowered and compiled once whatever the depth. The
parameters stay one entry per layer (checkpoints, sharding annotations and `model.blocks[i]` as
unrolled); a call stacks them (one copy of the parameters per call, its gradient a slice).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx


class LayerPlan(NamedTuple):
  """`pattern` = unit * repeats, unit = runs of one letter: ((letter, count), ...)."""

  repeats: int
  runs: tuple[tuple[str, int], ...]

  @property
  def shares(self) -> bool:
    """Whether two layers have one configuration (scanning compiles fewer layers)."""
    return self.repeats > 1 or any(n > 1 for _, n in self.runs)


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


def _first(tree):
  return jax.tree.map(lambda a: a[0], tree)


def _expand(tree):
  return jax.tree.map(lambda a: a[None], tree)


def same_programs(blocks: Sequence[nnx.Module], plan: LayerPlan) -> bool:
  """Whether the layers that `plan` runs in one scan have one graph definition."""
  unit = len(blocks) // plan.repeats
  start = 0
  for _, count in plan.runs:
    first = nnx.graphdef(blocks[start])
    for r in range(plan.repeats):
      for i in range(count):
        if nnx.graphdef(blocks[r * unit + start + i]) != first:
          return False
    start += count
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
  inputs and outputs (decode caches) of one run must share their structure."""
  num = len(blocks)
  inputs = tuple(per_layer) if per_layer is not None else (None,) * num
  unit = num // plan.repeats
  graphdefs, states, layer_inputs, layers = [], [], [], []
  start = 0
  for _, count in plan.runs:
    rows = [[r * unit + start + i for i in range(count)] for r in range(plan.repeats)]
    graphdefs.append(nnx.graphdef(blocks[start]))
    states.append(_stack([_stack([nnx.state(blocks[i]) for i in row]) for row in rows]))
    layer_inputs.append(_stack([_stack([inputs[i] for i in row]) for row in rows]))
    layers.append(rows)
    start += count

  def one_layer(graphdef):
    def body(x, state_and_input):
      state, inp = state_and_input
      return fn(nnx.merge(graphdef, state), x, inp)

    return body

  def one_unit(x, xs):
    outs = []
    for graphdef, state, inp in zip(graphdefs, *xs):
      body = one_layer(graphdef)
      if jax.tree.leaves(state)[0].shape[0] == 1:  # a run of one layer: no loop
        x, out = body(x, _first((state, inp)))
        out = _expand(out)
      else:
        x, out = jax.lax.scan(body, x, (state, inp))
      outs.append(out)
    return x, tuple(outs)

  xs = (tuple(states), tuple(layer_inputs))
  if plan.repeats == 1:
    x, outs = one_unit(x, _first(xs))
    outs = _expand(outs)
  else:
    x, outs = jax.lax.scan(one_unit, x, xs)
  result: list[Any] = [None] * num
  for rows, out in zip(layers, outs):
    for r, row in enumerate(rows):
      for i, layer in enumerate(row):
        result[layer] = jax.tree.map(lambda a, r=r, i=i: a[r, i], out)
  return x, tuple(result)
