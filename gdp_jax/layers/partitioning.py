"""The partitioning annotations of the layers' parameters: logical axis names on every parameter
(`nnx.with_partitioning`), the default rules that map them onto a ("data", "model") mesh, and
whether a layer runs its projections split for a mesh (docs/sharding.md#annotated-parameters).

Every parameter carries `out_sharding` metadata with one logical name (or None) per dimension:
"embed" the model width D, "heads" a dimension that holds whole heads (the heads axis of
`A_log` [HV], or H * K projection columns laid out head by head), "kv_heads" attention's
key/value heads, "mlp" the SwiGLU hidden units, "vocab" the vocabulary; None is never split.
`nnx.get_partition_spec(state)` under `nnx.logical_axis_rules(rules)` turns them into mesh
`PartitionSpec`s, as in flax's own examples.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from flax import nnx
from flax.core import spmd as flax_spmd

EMBED = "embed"
HEADS = "heads"
KV_HEADS = "kv_heads"
MLP = "mlp"
VOCAB = "vocab"
BATCH = "batch"  # activations' batch dimension (not a parameter's)

# Tensor parallel over "model" (heads, key/value heads, the MLP's hidden units), data parallel
# over "data"; the model width and the vocabulary are not split (map "embed" to "data" for
# parameters sharded FSDP-style).
LOGICAL_AXIS_RULES: tuple[tuple[str, Any], ...] = (
  (BATCH, "data"),
  (EMBED, None),
  (HEADS, "model"),
  (KV_HEADS, "model"),
  (MLP, "model"),
  (VOCAB, None),
)

Names = tuple[str | None, ...]


def _eager() -> bool:
  """Shard a parameter as it is created only where flax would (eager sharding on) and the
  logical names can be resolved: a mesh is set and logical axis rules are given. Elsewhere (one
  device, no mesh) the names are metadata only, for `nnx.get_partition_spec`."""
  return (
    nnx.using_eager_sharding()
    and not jax.sharding.get_abstract_mesh().empty
    and bool(flax_spmd.get_logical_axis_rules())
  )


def partitioned(init: Callable[..., Any], names: Names) -> Callable[..., Any]:
  """`nnx.with_partitioning(init, names)`, sharded at creation only under a mesh with logical
  axis rules (`_eager`); without a mesh the parameter is created as usual."""

  def init_fn(key, shape, dtype=jax.numpy.float32):
    return nnx.with_partitioning(init, names, eager_sharding=_eager())(key, shape, dtype)

  return init_fn


def param(value: jax.Array, names: Names) -> nnx.Param:
  """An `nnx.Param` of `value` annotated with the logical axis `names` (see `partitioned`)."""
  return nnx.Param(value, out_sharding=names, eager_sharding=_eager())


def mesh_is_set() -> bool:
  """True while tracing under a mesh of several devices (`jax.set_mesh`): the delta layers then
  compute q, k and v with three matmuls, whose outputs split along heads like their kernels,
  instead of one matmul over the kernels side by side, whose q | k | v columns no head split
  follows (docs/sharding.md#annotated-parameters)."""
  mesh = jax.sharding.get_abstract_mesh()
  return not mesh.empty and mesh.size > 1
