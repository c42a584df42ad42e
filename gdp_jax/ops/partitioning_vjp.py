"""Differentiable per-shard calls under plain `jax.jit`: a function's forward and backward as two
per-shard calls (partitioning.py) inside one custom_vjp, the forward saving the residuals of its
pullback on each device for the backward on the same device (docs/sharding.md#under-plain-jaxjit).

`vjp_specs` finds the residuals' dimension labels from their shapes; `sequence_vjp`,
`pullback_residuals` and `saved_pullback` are the pieces the operator's partitioned form
(gated_delta_product/partitioning.py) builds on. The comment below says how.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

from gdp_jax.ops.partitioning import ShardSpec

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
