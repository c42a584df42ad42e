"""Per-shard calls under plain `jax.jit`: a function that is independent across batch rows and
heads, run by XLA's partitioner on each device's block of rows and heads
(docs/sharding.md#under-plain-jaxjit).

XLA cannot split a Pallas kernel (a custom call it does not understand), so a kernel called on
sharded inputs under `jax.jit` would be given the whole arrays: XLA all-gathers them onto every
device. `per_shard_call(spec, *arrays)` wraps the call in `jax.experimental.custom_partitioning`
with a Shardy sharding rule built from `spec`'s dimension labels, one string per array, one
character per dimension:

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
  operand and each result (module docstring), the number of key heads and the group size
  (value heads per key head). Hashable: `fn` must be too (a frozen dataclass, a module-level
  function). sums: the results are gradients, and one with no batch (head) dimension while the
  batch (heads) are split is the sum of the devices' values over those axes (a gradient of a
  broadcast input); otherwise such a result is the device's own value (a forward's scalar).
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
  arrays are sharded under `jax.jit` (module docstring). Under `jax.vmap` it is `spec.fn`
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


# ---- differentiable per-shard calls: the forward saves the vjp's residuals per device ----------
#
# custom_partitioning has no autodiff rule, so a differentiable function is split into two
# per-shard calls inside one custom_vjp: the forward returns the outputs and the residuals of
# `jax.vjp(fn)` (the arrays its pullback closes over), the backward takes them back and runs the
# pullback. Each residual needs labels too: they are found from its shape at the inputs' shapes,
# with the batch doubled and with the heads doubled (a dimension that doubles with the batch and
# equals B is the batch, one that doubles with the heads and equals H or HV the key or value
# heads, one that changes with neither is never split). A residual that is one of the inputs is
# not returned again (the backward gets the inputs). A residual with no batch or head dimension
# (a constant, or the non-finite guard's flag, which is each device's own) is declared replicated:
# it only passes from the forward call to the backward call on the same device, and nothing
# reads it across devices. Residuals of another kind (a dimension that
# grows otherwise) leave `vjp_specs` returning None: the caller then recomputes the forward in
# the backward.
#
# A function whose operands have a sequence ("t") dimension may also run with the sequence split
# (context parallel: `fn(*primals, sequence=axes)`, collectives over those axes inside). Its
# pullback is then another function's, so by default the split forward saves nothing (its
# residual results are zero placeholders, their sequence dimensions split: probed with T
# doubled, "t" where a dimension equals T, one that otherwise grows with T folded into
# [T, size / T] where it is a multiple of T, a count of chunks of m tokens folded with the
# dimensions after it into [T, their size / m] (`_fold`), else never split) and the split
# backward recomputes the split forward and differentiates it (`sequence_vjp`). A fn may do
# better with four attributes: `split_extra` (the labels of residuals that only its split form
# saves, placeholders in the unsplit form), `split_extra_avals(*primals)` (their shapes and
# dtypes at these primals), `split_forward(sequence, sources, residual_blocks,
# *primals)` -> (outputs, residuals in the unsplit form's slots, extras) or None (then the
# default), and `split_backward(sequence, sources, primals, residuals, extras, cotangents)` ->
# the gradients or None (the default; it must decide as `split_forward` did, from the residuals'
# shapes). Both calls choose the split from q's sharding, so they agree; should they not, a
# residual after the unsplit form's, 1 from the unsplit forward and 0 from the split one, makes
# a backward that reads residuals of the other form return NaN gradients rather than wrong
# ones.


def sequence_vjp(fn, sequence, result_labels, primals, cotangents):
  """The gradients of `fn(*primals, sequence=sequence)` on this device's block (inside a
  per-device function whose mesh axes are named). A result with no "t" dimension is the same on
  every device along the sequence axes (each computes it from the gathered pieces): its
  cotangent, one value, enters through the first device's copy only. The gradient of an input
  with no "t" dimension is this device's part of the sum (`ShardSpec.sums` adds them up)."""
  first = jax.lax.axis_index(sequence) == 0
  cotangents = tuple(
    ct if "t" in labels else jnp.where(first, ct, jnp.zeros_like(ct))
    for labels, ct in zip(result_labels, cotangents)
  )
  _, pullback = jax.vjp(lambda *p: tuple(fn(*p, sequence=sequence)), *primals)
  return tuple(pullback(cotangents))


def _vjp_leaves(fn, primals):
  """(outputs, the pullback's array leaves that are not inputs, for each leaf the index of the
  input it is or None, the pullback's tree)."""
  outputs, pullback = jax.vjp(fn, *primals)
  leaves, tree = jax.tree.flatten(pullback)
  sources = tuple(next((i for i, p in enumerate(primals) if leaf is p), None) for leaf in leaves)
  residuals = tuple(leaf for leaf, src in zip(leaves, sources) if src is None)
  return outputs, residuals, sources, tree


def _probe(fn, avals):
  def residual_shapes(*primals):
    _, residuals, sources, _ = _vjp_leaves(fn, primals)
    return residuals, sources

  sources = []

  def shapes(*primals):
    residuals, src = residual_shapes(*primals)
    sources.append(src)
    return residuals

  out = jax.eval_shape(shapes, *avals)
  return out, sources[0]


def _grown(avals, labels, grow):
  def one(aval, la):
    shape = tuple(2 * n if label in grow else n for n, label in zip(aval.shape, la))
    return jax.ShapeDtypeStruct(shape, aval.dtype)

  return [one(a, la) for a, la in zip(avals, labels)]


def _residual_labels(base, by_batch, by_heads, by_time, batch, heads, heads_v, time):
  labels = []
  for n, nb, nh, nt in zip(base.shape, by_batch.shape, by_heads.shape, by_time.shape):
    if nb == 2 * n and nh == n and nt == n and n == batch:
      labels.append("b")
    elif nh == 2 * n and nb == n and nt == n and n in (heads, heads_v):
      labels.append("h" if n == heads else "v")
    elif nt == 2 * n and nb == n and nh == n and n == time:
      labels.append("t")
    elif nt == 2 * n and nb == n and nh == n and time % n == 0:
      labels.append("c")  # T / n pieces of n tokens: chunks
    elif nt != n and nb == n and nh == n:
      labels.append("s")
    elif nb == n and nh == n:
      labels.append("-")
    else:
      return None
  return "".join(labels)


def _fold(labels: str, shape, time):
  """A residual dimension that grows with the sequence but is not it is passed between the
  calls folded into a dimension of T, so that it splits with the sequence as q does (the Shardy
  rule ties it to q's T; a dimension of its own would be gathered between the calls):

  - "s", a multiple of T (e.g. chunks x rows): [T, size / T] ("t-"), fold ("rows", dim, size / T);
  - "c", T / m chunks of m tokens, followed only by dimensions never split whose size is a
    multiple of m (e.g. a state per chunk, [.., T / m, K, V]): these dimensions together as
    [T, their size / m] ("t-"), fold ("chunks", dim, m, their shape), so that a device's piece
    of whole chunks holds its own chunks' entries.

  Returns (labels, fold or None); other such dimensions are never split ("-")."""
  never = lambda la: la.replace("s", "-").replace("c", "-")
  for dim, (label, n) in enumerate(zip(labels, shape)):
    if label == "s" and time and n % time == 0:
      return never(labels[:dim]) + "t-" + never(labels[dim + 1 :]), ("rows", dim, n // time)
    tail = tuple(shape[dim + 1 :])
    if label == "c" and set(labels[dim + 1 :]) <= {"-"} and math.prod(tail) % (time // n) == 0:
      return never(labels[:dim]) + "t-", ("chunks", dim, time // n, tail)
  return never(labels), None


def _folded(x, fold):
  if fold is None:
    return x
  kind, dim, ratio, *_ = fold
  if kind == "rows":
    return x.reshape(x.shape[:dim] + (x.shape[dim] // ratio, ratio) + x.shape[dim + 1 :])
  tokens = x.shape[dim] * ratio
  return x.reshape(x.shape[:dim] + (tokens, math.prod(x.shape[dim + 1 :]) // ratio))


def _unfolded_shape(shape, fold):
  """The shape of a folded block unfolded; for a block of chunks that are not whole, a shape
  no residual has (-1)."""
  shape = tuple(shape)
  if fold is None:
    return shape
  kind, dim, ratio, *tail = fold
  if kind == "rows":
    return shape[:dim] + (shape[dim] * shape[dim + 1],) + shape[dim + 2 :]
  count = shape[dim] // ratio if shape[dim] % ratio == 0 else -1
  return shape[:dim] + (count, *tail[0])


def _unfolded(x, fold):
  """A folded block unfolded, or as it is when it holds chunks that are not whole (the split
  forward saved nothing in it: its shape then matches no residual)."""
  shape = _unfolded_shape(x.shape, fold)
  return x if -1 in shape else x.reshape(shape)


# The pullback's tree (its structure and static data, no arrays: `jax.vjp`'s result is a pytree
# that may cross jit boundaries) on a device's block, kept by the forward call for the backward
# call, keyed by fn and the block's shapes. Without it the backward traces the forward again
# (nothing of it is used; XLA removes it).
_PULLBACK_TREES: dict = {}
_MAX_TREES = 256


def _tree_key(fn, primals):
  return fn, tuple((tuple(p.shape), str(p.dtype)) for p in primals)


def pullback_residuals(fn, primals):
  """(outputs, residuals, sources, tree) of `jax.vjp(fn, *primals)` (`_vjp_leaves`), the tree kept
  for `saved_pullback` on the same shapes."""
  outputs, residuals, sources, tree = _vjp_leaves(fn, primals)
  if len(_PULLBACK_TREES) >= _MAX_TREES:
    _PULLBACK_TREES.pop(next(iter(_PULLBACK_TREES)))
  _PULLBACK_TREES[_tree_key(fn, primals)] = tree
  return outputs, residuals, sources, tree


def saved_pullback(fn, primals, sources, residuals):
  """fn's pullback at `primals` rebuilt from the residuals `pullback_residuals` returned (the
  leaves that are inputs taken from `primals`, by `sources`)."""
  tree = _PULLBACK_TREES.get(_tree_key(fn, primals))
  if tree is None:
    _, _, _, tree = _vjp_leaves(fn, primals)
  saved = iter(residuals)
  return tree.unflatten([next(saved) if src is None else primals[src] for src in sources])


@dataclasses.dataclass(frozen=True)
class _ForwardSaving:
  """fn's outputs, then the residuals of its pullback that are not inputs."""

  fn: Callable
  sources: tuple
  flag: bool = False  # a residual 1 after the others (the section's comment)
  outputs: int = 0
  folds: tuple = ()  # per residual: `_fold`'s (dim, size / T) or None

  def __call__(self, *primals, sequence=(), blocks=()):
    if sequence:  # context parallel (the section's comment)
      split = getattr(self.fn, "split_forward", None)
      count = self.sources.count(None)
      saving = None
      if split is not None:
        residual_blocks = blocks[self.outputs : self.outputs + count]
        residual_blocks = [_unfolded_shape(b, f) for b, f in zip(residual_blocks, self._folds())]
        saving = split(sequence, self.sources, residual_blocks, *primals)
      if saving is None:  # the outputs only: the residuals are placeholders
        return tuple(self.fn(*primals, sequence=sequence))
      outputs, residuals, extras = saving
      residuals = tuple(_folded(r, f) for r, f in zip(residuals, self._folds()))
      return (*outputs, *residuals, jnp.zeros((), jnp.float32), *extras)
    outputs, residuals, sources, _ = pullback_residuals(self.fn, primals)
    if sources != self.sources:
      raise RuntimeError(
        "the pullback's residuals on a device's block differ from those on the whole arrays: "
        f"{sources} vs {self.sources}"
      )
    residuals = tuple(_folded(r, f) for r, f in zip(residuals, self._folds()))
    if not self.flag:
      return (*outputs, *residuals)
    extra_avals = getattr(self.fn, "split_extra_avals", lambda *p: ())(*primals)
    extras = tuple(jnp.zeros(a.shape, a.dtype) for a in extra_avals)  # placeholders
    return (*outputs, *residuals, jnp.ones((), jnp.float32), *extras)

  def _folds(self):
    return self.folds or (None,) * self.sources.count(None)


@dataclasses.dataclass(frozen=True)
class _BackwardFromResiduals:
  """(*primals, *residuals, *cotangents) -> the gradients of the primals: fn's pullback rebuilt
  on the device's block (its tree from the forward call, `_PULLBACK_TREES`) with the saved
  residuals put in."""

  fn: Callable
  primals: int
  sources: tuple
  results: tuple[str, ...] = ()
  flag: bool = False  # the forward saves `_ForwardSaving.flag`'s residual
  extras: int = 0  # then the `split_extra` residuals
  folds: tuple = ()  # as `_ForwardSaving.folds`

  def __call__(self, *arrays, sequence=(), blocks=()):
    primals = arrays[: self.primals]
    count = self.sources.count(None)
    residuals = arrays[self.primals : self.primals + count]
    residuals = tuple(_unfolded(r, f) for r, f in zip(residuals, self.folds or (None,) * count))
    extras = arrays[
      self.primals + count + self.flag : self.primals + count + self.flag + self.extras
    ]
    cotangents = arrays[self.primals + count + self.flag + self.extras :]
    if sequence:  # context parallel (the section's comment)
      split = getattr(self.fn, "split_backward", None)
      grads = None
      if split is not None:
        grads = split(sequence, self.sources, primals, residuals, extras, cotangents)
        if grads is not None and self.flag:  # the residuals must be the split forward's
          split_forward = arrays[self.primals + count] == 0
          grads = tuple(jnp.where(split_forward, d, jnp.nan) if _floating(d) else d for d in grads)
      if grads is None:  # the split forward again, differentiated
        grads = sequence_vjp(self.fn, sequence, self.results, primals, cotangents)
      return tuple(grads)
    pullback = saved_pullback(self.fn, primals, self.sources, residuals)
    grads = tuple(pullback(tuple(cotangents)))
    if not self.flag:
      return grads
    unsplit = arrays[self.primals + count] > 0  # 0: the forward ran split, saved other things
    return tuple(jnp.where(unsplit, d, jnp.nan) if _floating(d) else d for d in grads)


def _floating(x) -> bool:
  return jnp.issubdtype(x.dtype, jnp.floating)


@dataclasses.dataclass(frozen=True)
class VjpSpecs:
  """The two per-shard calls of a differentiable function `fn`: `forward` returns its outputs
  and then the residuals, `backward` takes (*primals, *residuals, *cotangents)."""

  forward: ShardSpec
  backward: ShardSpec
  outputs: int
  fn: Callable


def vjp_specs(fn, operands, results, heads, group, *primals):
  """The `VjpSpecs` of `fn` (hashable) at these primals, or None when a residual of its pullback
  cannot be labelled (the section's comment)."""
  avals = [jax.ShapeDtypeStruct(p.shape, p.dtype) for p in primals]
  batch = next(a.shape[la.index("b")] for a, la in zip(avals, operands) if "b" in la)
  time = next((a.shape[la.index("t")] for a, la in zip(avals, operands) if "t" in la), None)
  base, sources = _probe(fn, avals)
  by_batch, _ = _probe(fn, _grown(avals, operands, "b"))
  by_heads, _ = _probe(fn, _grown(avals, operands, "hv"))
  by_time = base if time is None else _probe(fn, _grown(avals, operands, "t"))[0]
  labels, folds = [], []
  for shapes in zip(base, by_batch, by_heads, by_time):
    la = _residual_labels(*shapes, batch, heads, heads * group, time)
    if la is None:
      return None
    la, fold = _fold(la, shapes[0].shape, time)
    labels.append(la)
    folds.append(fold)
  flag = time is not None  # may run split: the flag (the section's comment)
  extra = tuple(getattr(fn, "split_extra", ())) if flag else ()
  labels = tuple(labels) + (("",) if flag else ()) + extra
  folds = tuple(folds)
  forward = ShardSpec(
    _ForwardSaving(fn, sources, flag, len(results), folds),
    operands,
    (*results, *labels),
    heads,
    group,
  )
  backward = ShardSpec(
    _BackwardFromResiduals(fn, len(primals), sources, tuple(results), flag, len(extra), folds),
    (*operands, *labels, *results),
    operands,
    heads,
    group,
    sums=True,
  )
  return VjpSpecs(forward, backward, len(results), fn)
