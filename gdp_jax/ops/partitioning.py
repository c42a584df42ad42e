"""Per-shard calls under plain `jax.jit`: a function that is independent across batch rows and
heads (or runs context parallel over the sequence) run by XLA's partitioner on each device's
block (docs/sharding.md#under-plain-jaxjit).

XLA cannot split a Pallas kernel (a custom call it does not understand): called on sharded
inputs under `jax.jit` it would be given the whole arrays, all-gathered onto every device.
`per_shard_call(spec, *arrays)` wraps the call in `jax.experimental.custom_partitioning` with a
Shardy sharding rule built from `spec`'s dimension labels (`ShardSpec`); the differentiable form,
a forward and a backward call inside one custom_vjp, is `partitioning_vjp.py`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

SPLIT_LABELS = ("b", "h", "v", "t")
LABELS = (*SPLIT_LABELS, "1", "-")


@dataclasses.dataclass(frozen=True)
class ShardSpec:
  """A per-shard call: `fn(*arrays) -> tuple of arrays`, with the dimension labels of each
  operand and each result, the number of key heads and the group size (value heads per key
  head). Hashable: `fn` must be too (a frozen dataclass, a module-level function). sums: the
  results are gradients, and one with no batch (head) dimension while the batch (heads) are
  split is the sum of the devices' values over those axes (a gradient of a broadcast input);
  otherwise such a result is the device's own value (a forward's scalar).

  Labels, one string per array, one character per dimension:

    "b"  the batch: may be split over mesh axes (the batch axes)
    "h"  the (key) heads: may be split over mesh axes (the head axes)
    "v"  the value heads, HV = H * group: value head i reads key head i // group (grouped value
         heads), so they split over the head axes together with the key heads
    "t"  the sequence (T tokens): may be split over mesh axes (the sequence axes) for a `spec.fn`
         that takes them: it is then called with `sequence=` the tuple of those axes and runs
         context parallel (collectives over them inside; docs/sharding.md)
    "1"  a size-1 broadcast dimension; "-" any other dimension: never split (a split one is
         gathered first: the feature dims, r, the sequence of a spec with no "t")

  The partition step keeps the batch axes of the first array with a "b" dimension, the head
  axes of the first one with an "h" (or "v") dimension and the sequence axes of the first one
  with a "t" when they divide B, H (the key heads) and T (else that dimension is gathered), asks
  every array for exactly that layout (the partitioner moves what differs) and runs `spec.fn` on
  each device's block. With `spec.sums` (gradients) a result that has no "b" (no "h"/"v", no "t")
  dimension while the batch (heads, sequence) are split is a sum over the blocks (the gradient of
  a broadcast input, e.g. a mask shared by every row, or the initial state along the sequence):
  it is summed over those axes (psum in float32). With the sequence split, `spec.fn` is also given
  `blocks=` (the shape of each result's block on this device). `spec.fn` may return fewer results
  than `spec.results`: the rest are zeros of their blocks' shapes (placeholders for residuals that
  only the other form, split or unsplit, saves). Under `jax.vmap` the call runs `spec.fn` vmapped,
  unpartitioned (custom_vmap); on one device, or inside `jax.shard_map` with every axis manual,
  `custom_partitioning` runs `spec.fn` directly.
  """

  fn: Callable
  operands: tuple[str, ...]
  results: tuple[str, ...]
  heads: int
  group: int = 1
  sums: bool = False

  def __post_init__(self):
    for labels in (*self.operands, *self.results):
      bad = set(labels) - set(LABELS)
      if bad:
        raise ValueError(f"dimension labels must be among {LABELS}, got {labels!r}")


def _axes(entry) -> tuple[str, ...]:
  if entry is None:
    return ()
  return (entry,) if isinstance(entry, str) else tuple(entry)


def _entry(sharding, dim) -> tuple[str, ...]:
  spec = getattr(sharding, "spec", None)
  if spec is None or dim >= len(spec):
    return ()
  return _axes(spec[dim])


def _size(mesh, axes) -> int:
  return math.prod(mesh.shape[a] for a in axes)


@dataclasses.dataclass(frozen=True)
class _Split:
  """The mesh axes chosen for the batch, the heads and the sequence (each a tuple, () unsplit)."""

  batch: tuple[str, ...] = ()
  heads: tuple[str, ...] = ()
  sequence: tuple[str, ...] = ()

  def axes(self, label: str) -> tuple[str, ...]:
    if label == "b":
      return self.batch
    if label in ("h", "v"):
      return self.heads
    if label == "t":
      return self.sequence
    return ()


def _choose_axes(spec: ShardSpec, mesh, arg_shapes) -> _Split:
  """The axes of the first operand with a batch (head, sequence) dimension that is split, kept
  when their device count divides B (H, the key heads; T), else ()."""
  found: dict[str, tuple[str, ...]] = {}
  sizes: dict[str, int] = {"h": spec.heads}
  for labels, arg in zip(spec.operands, arg_shapes):
    for dim, label in enumerate(labels):
      role = "h" if label == "v" else label
      if role not in ("b", "h", "t"):
        continue
      if role != "h":
        sizes.setdefault(role, arg.shape[dim])
      found[role] = found.get(role) or _entry(arg.sharding, dim)
  if not isinstance(mesh, jax.sharding.Mesh) or mesh.empty:
    return _Split()
  chosen: dict[str, tuple[str, ...]] = {}
  taken: set[str] = set()
  for role in ("b", "h", "t"):
    axes = tuple(a for a in found.get(role, ()) if a not in taken)
    if role not in sizes or sizes[role] % _size(mesh, axes):
      axes = ()
    chosen[role] = axes
    taken.update(axes)
  return _Split(chosen["b"], chosen["h"], chosen["t"])


def _pspec(labels: str, split: _Split) -> PartitionSpec:
  def entry(label):
    axes = split.axes(label)
    if not axes:
      return None
    return axes[0] if len(axes) == 1 else axes

  return PartitionSpec(*(entry(label) for label in labels))


def _summed_axes(labels: str, split: _Split) -> tuple[str, ...]:
  """The split axes a result does not vary over: it is a sum over their blocks."""
  missing = () if "b" in labels else split.batch
  missing += () if ("h" in labels or "v" in labels) else split.heads
  return missing + (() if "t" in labels else split.sequence)


def _layout(spec: ShardSpec, mesh, arg_shapes, result_shape):
  split = _choose_axes(spec, mesh, arg_shapes)
  arg_shardings = tuple(NamedSharding(mesh, _pspec(la, split)) for la in spec.operands)
  result_shardings = tuple(NamedSharding(mesh, _pspec(la, split)) for la in spec.results)
  return split, arg_shardings, result_shardings


def _partition(spec: ShardSpec, mesh, arg_shapes, result_shape):
  split, arg_shardings, result_shardings = _layout(spec, mesh, arg_shapes, result_shape)
  blocks = [s.shard_shape(r.shape) for s, r in zip(result_shardings, result_shape)]

  def per_device(*arrays):
    if split.sequence:
      outs = tuple(spec.fn(*arrays, sequence=split.sequence, blocks=tuple(blocks)))
    else:
      outs = tuple(spec.fn(*arrays))
    # placeholders for the results this mode does not compute (module docstring)
    outs += tuple(
      jnp.zeros(block, r.dtype) for block, r in zip(blocks[len(outs) :], result_shape[len(outs) :])
    )
    summed = []
    for labels, out in zip(spec.results, outs):
      axes = _summed_axes(labels, split) if spec.sums else ()
      if axes:
        out = jax.lax.psum(out.astype(jnp.float32), axes).astype(out.dtype)
      summed.append(out)
    return tuple(summed)

  return mesh, per_device, result_shardings, arg_shardings


def _infer_from_operands(spec: ShardSpec, mesh, arg_shapes, result_shape):
  # The GSPMD partitioner's propagation (jax_use_shardy_partitioner=False).
  return _layout(spec, mesh, arg_shapes, result_shape)[2]


def _sharding_rule(spec: ShardSpec, mesh, operand_types, result_types):
  """The Shardy rule: "b", "t" and the head labels are factors shared by every array ("v" is
  the compound (h group) when heads are grouped); every other dimension is its own factor that
  must stay replicated."""
  replicated = []
  has_key_heads = any("h" in la for la in (*spec.operands, *spec.results))

  def mapping(labels, name):
    dims = []
    for dim, label in enumerate(labels):
      if label in ("b", "t"):
        dims.append(label)
      elif label == "h" or (label == "v" and spec.group == 1):
        dims.append("h")
      elif label == "v":
        dims.append("(h group)")
      else:
        factor = f"{name}d{dim}"
        replicated.append(factor)
        dims.append(factor)
    return " ".join(dims)

  operands = ", ".join(mapping(la, f"x{i}") for i, la in enumerate(spec.operands))
  results = ", ".join(mapping(la, f"y{i}") for i, la in enumerate(spec.results))
  sizes = {}
  if any("v" in la for la in (*spec.operands, *spec.results)) and spec.group > 1:
    sizes["group"] = spec.group
    if not has_key_heads:
      sizes["h"] = spec.heads
  return f"{operands} -> {results}", dict(need_replication_factors=tuple(replicated), **sizes)


def _apply(spec: ShardSpec, *arrays):
  return tuple(spec.fn(*arrays))


_partitioned = custom_partitioning(_apply, static_argnums=(0,))
_partitioned.def_partition(
  partition=_partition,
  infer_sharding_from_operands=_infer_from_operands,
  sharding_rule=_sharding_rule,
)


def every_axis_manual() -> bool:
  """True while tracing inside `jax.shard_map` with every mesh axis manual: each device already
  holds its own block, and custom_partitioning would only run the function as it is (after the
  wrapper's own tracing work)."""
  mesh = jax.sharding.get_abstract_mesh()
  manual = jax.sharding.AxisType.Manual
  return not mesh.empty and all(t == manual for t in mesh.axis_types)


def per_shard_call(spec: ShardSpec, *arrays):
  """`spec.fn(*arrays)` (a tuple), run per device on its block of batch rows and heads when the
  arrays are sharded under `jax.jit` (`ShardSpec`). Under `jax.vmap` it is `spec.fn`
  vmapped; differentiated (custom_partitioning has no autodiff rule), `spec.fn`'s own
  derivative, unpartitioned (or the clear error of a kernel that has none)."""

  @jax.custom_batching.custom_vmap
  def partitioned(*arrays):
    return _partitioned(spec, *arrays)

  @partitioned.def_vmap
  def _vmapped(axis_size, in_batched, *arrays):
    axes = tuple(0 if batched else None for batched in in_batched)
    outs = jax.vmap(lambda *a: _apply(spec, *a), in_axes=axes)(*arrays)
    return outs, tuple(True for _ in outs)

  call = jax.custom_jvp(lambda *a: partitioned(*a))

  @call.defjvp
  def _jvp(primals, tangents):
    return jax.jvp(lambda *a: _apply(spec, *a), primals, tangents)

  return call(*arrays)
