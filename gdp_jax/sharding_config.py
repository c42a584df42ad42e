"""Which mesh axes split the batch, the heads and the sequence: `ShardingConfig`, and the
layout (a `PartitionSpec`) of each named array of the operator, its step and the model's inputs
under it (docs/sharding.md#the-api). `gdp_jax.sharding` runs the operator, the step and the
layers with it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

__all__ = ["ROLES", "ShardingConfig"]

ROLES = ("batch", "heads", "sequence")

# The mesh axes of each dimension of each named array ("b" batch, "t" sequence, "h" heads, "-"
# not split), by name and rank. Size-1 broadcast axes of the masks are never split.
_LAYOUTS = {
  ("q", 4): "bth-",
  ("k", 4): "bth-",
  ("v", 4): "bth-",
  ("g", 3): "bth",
  ("beta", 3): "bth",
  ("mask", 2): "--",
  ("mask", 3): "h--",
  ("mask", 5): "bth--",
  ("initial_state", 4): "bh--",
  ("state", 4): "bh--",
  ("o", 4): "bth-",
  # the one-token step
  ("q", 3): "bh-",
  ("k", 3): "bh-",
  ("v", 3): "bh-",
  ("g", 2): "bh",
  ("beta", 2): "bh",
  ("mask", 4): "bh--",
  # model inputs: tokens [B, T], activations [B, T, D]
  ("tokens", 2): "bt",
  ("tokens", 1): "b",
  ("x", 3): "bt-",
}
_ROLE_OF = {"b": "batch", "t": "sequence", "h": "heads"}


def _as_axes(role, value, mesh):
  """A role's axes as a tuple of mesh axis names (empty for None)."""
  if value is None:
    return ()
  names = (value,) if isinstance(value, str) else value
  if not isinstance(names, tuple) or not all(isinstance(n, str) for n in names):
    raise TypeError(
      f"ShardingConfig.{role} must be a mesh axis name, a tuple of names or None, got {value!r}"
    )
  for n in names:
    if n not in mesh.axis_names:
      raise ValueError(
        f"ShardingConfig.{role} names mesh axis {n!r}, but the mesh has axes "
        f"{tuple(mesh.axis_names)}"
      )
  return names


@dataclasses.dataclass(frozen=True)
class ShardingConfig:
  """Which mesh axes split the batch, the heads and the sequence.

  Args:
    mesh: a `jax.sharding.Mesh` (Auto or Explicit axes; with Explicit axes the inputs are
      resharded to the layout below, which is a no-op when they already have it).
    batch, heads, sequence: a mesh axis name, a tuple of names (split over their product) or
      None (not split). An axis may serve one role only. Mesh axes that no role names hold
      replicas (each computes the same thing).

  Layout of the operator's arrays: q, k, v, o split as [batch, sequence, heads, -]; g, beta as
  [batch, sequence, heads]; the state as [batch, heads, -, -]; a mask [r, r] is replicated,
  [H, r, r] split over heads, [B, T, H, r, r] like g.
  """

  mesh: Any
  batch: Any = None
  heads: Any = None
  sequence: Any = None

  def __post_init__(self):
    if not isinstance(self.mesh, jax.sharding.Mesh):
      raise TypeError(
        f"ShardingConfig.mesh must be a jax.sharding.Mesh, got {type(self.mesh).__name__}"
      )
    seen = {}
    for role in ROLES:
      for name in _as_axes(role, getattr(self, role), self.mesh):
        if name in seen:
          raise ValueError(
            f"mesh axis {name!r} is named by both ShardingConfig.{seen[name]} and "
            f"ShardingConfig.{role}; an axis may split one dimension only"
          )
        seen[name] = role

  def axes(self, role: str) -> tuple[str, ...]:
    """The mesh axes of `role` ("batch", "heads" or "sequence") as a tuple (empty: not split)."""
    if role not in ROLES:
      raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    return _as_axes(role, getattr(self, role), self.mesh)

  def size(self, role: str) -> int:
    """Number of pieces `role` is split into (the product of its mesh axes' sizes)."""
    return math.prod(self.mesh.shape[n] for n in self.axes(role))

  def _entry(self, role):
    axes = self.axes(role)
    if not axes:
      return None
    return axes[0] if len(axes) == 1 else axes

  def spec(self, layout: str) -> PartitionSpec:
    """A PartitionSpec from a layout string: one letter per dimension, "b" batch, "t" sequence,
    "h" heads, "-" not split (e.g. "bth-" for q)."""
    bad = set(layout) - set("bth-")
    if bad:
      raise ValueError(f"layout {layout!r} has letters {sorted(bad)}; use b, t, h and -")
    return PartitionSpec(*(None if c == "-" else self._entry(_ROLE_OF[c]) for c in layout))

  def spec_for(self, name: str, ndim: int) -> PartitionSpec:
    """The PartitionSpec of an argument of the operator or the step by name and rank (q, k, v,
    g, beta, mask, initial_state, state, o), or of model inputs (tokens [B, T], x [B, T, D])."""
    layout = _LAYOUTS.get((name, ndim))
    if layout is None:
      known = sorted({n for n, _ in _LAYOUTS})
      raise ValueError(
        f"no layout for an array named {name!r} of rank {ndim}; known names: {known}"
      )
    return self.spec(layout)

  def named_sharding(self, name: str, ndim: int) -> NamedSharding:
    """`NamedSharding(mesh, spec_for(name, ndim))`."""
    return NamedSharding(self.mesh, self.spec_for(name, ndim))

  def put(self, **arrays):
    """`jax.device_put` each named array (see `spec_for`) to its layout; None stays None.
    Returns a dict with the same keys."""
    return {
      n: None if x is None else jax.device_put(x, self.named_sharding(n, jnp.ndim(x)))
      for n, x in arrays.items()
    }
