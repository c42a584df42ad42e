"""Several devices: the operator, its step and the layers under `jax.shard_map` (docs/sharding.md).

    mesh = jax.make_mesh((2, 4), ("data", "model"))
    sharding = ShardingConfig(mesh, batch="data", heads="model")
    o, final = sharded_gated_delta_product(q, k, v, g, beta, mask, sharding=sharding,
                                           output_final_state=True)

A `ShardingConfig` (sharding_config.py) names a mesh and the axes that split the batch, the heads
and the sequence. Batch and heads are independent problems: every device runs the single-device
operator on its own block, with no communication. The sequence is context parallel: each device
runs its piece from a zero state with its transition, the pieces are chained through an
all-gather of the small (transition, final state) pairs, and the outputs are corrected by the
incoming state (docs/sharding.md#context-parallel-the-sequence-in-n-pieces). The recurrent step
splits batch and heads only; the Flax layer and the hybrid model take a `sharding=` argument.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from gdp_jax.ops import registry, validation
from gdp_jax.ops.gated_delta_product import api as _operator
from gdp_jax.ops.gated_delta_product import context_parallel
from gdp_jax.ops.gated_delta_product.api import REGISTRY
from gdp_jax.ops.gated_delta_product.base import Problem
from gdp_jax.ops.step import api as _step
from gdp_jax.ops.step.api import REGISTRY as STEP_REGISTRY
from gdp_jax.sharding_config import ROLES, ShardingConfig

f32 = jnp.float32
__all__ = [
  "ROLES",
  "ShardingConfig",
  "piece_summary",
  "sharded_gated_delta_product",
  "sharded_gated_delta_product_step",
]

# ----------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------


def _check_config(sharding):
  if not isinstance(sharding, ShardingConfig):
    raise TypeError(
      f"sharding must be a gdp_jax.sharding.ShardingConfig or None, got {type(sharding).__name__}"
    )


def _check_divisible(sharding, what, size, role, shape_note):
  parts = sharding.size(role)
  if size % parts:
    raise ValueError(
      f"{what} = {size} ({shape_note}) is not divisible by the {parts} pieces of "
      f"the {role} mesh axes {sharding.axes(role)}"
    )


def _explicit(mesh):
  explicit = getattr(jax.sharding.AxisType, "Explicit", None)
  return explicit is not None and any(t == explicit for t in getattr(mesh, "axis_types", ()))


def _place(sharding, arrays, specs):
  """With Explicit mesh axes, reshard the inputs to the shard_map's layout (no-op when they
  already have it; with Auto axes shard_map places them itself)."""
  if not _explicit(sharding.mesh):
    return arrays
  reshard = getattr(jax.sharding, "reshard", None) or jax.reshard
  return {n: reshard(x, NamedSharding(sharding.mesh, specs[n])) for n, x in arrays.items()}


def _check_vma(implementation):
  """shard_map's type check of varying mesh axes, which also gives the cheapest transposes.
  Pallas' interpreter (kernels on CPU) cannot type kernels whose inputs vary over different mesh
  axes, so interpreted kernels run without it (JAX's autodiff stays correct, with a few more
  collectives)."""
  if not REGISTRY.is_pallas(implementation):
    return True
  return not registry.interpreted()


def _vary(x, axes, enabled):
  """x typed as varying over mesh `axes` inside shard_map (moves no data): a state created
  inside the body must match the arrays it is combined with in the operator's loops."""
  if not enabled or not axes:
    return x
  pcast = getattr(jax.lax, "pcast", None)
  if pcast is not None:
    return pcast(x, tuple(axes), to="varying")
  return jax.lax.pvary(x, tuple(axes))


def _shard_map(fn, sharding, in_specs, out_specs, check_vma):
  return jax.shard_map(
    fn, mesh=sharding.mesh, in_specs=(in_specs,), out_specs=out_specs, check_vma=check_vma
  )


# ----------------------------------------------------------------------------------------------
# The operator
# ----------------------------------------------------------------------------------------------


def sharded_gated_delta_product(
  q,
  k,
  v,
  g=None,
  beta=None,
  mask=None,
  *,
  sharding,
  scale=None,
  initial_state=None,
  output_final_state=False,
  chunk_size=64,
  implementation=None,
  precision=None,
  backward="pallas",
  options=None,
):
  """`gated_delta_product` with its arrays split over a device mesh (module docstring).

  Same arguments and results as `gdp_jax.gated_delta_product` (`implementation`, `precision`,
  `backward` and `options` apply to every device's call), plus `sharding`: a
  `ShardingConfig`, or None for the single-device operator. B must be divisible by the batch
  axes' size, H by the heads axes' size and T by the sequence axes' size (each device then runs
  T / n tokens; a multiple of `chunk_size` wastes no padding). Works eagerly and under
  `jax.jit`, on arrays placed anywhere (XLA moves them to the layout; `ShardingConfig.put` places
  them there up front). `scale` must be a Python number.

  Returns:
    (o [B, T, H, V] in q.dtype, split like q; final_state [B, H, K, V] float32 split over batch
    and heads, or None).
  """
  if sharding is None:
    return _operator.gated_delta_product(
      q,
      k,
      v,
      g,
      beta,
      mask,
      scale=scale,
      initial_state=initial_state,
      output_final_state=output_final_state,
      chunk_size=chunk_size,
      implementation=implementation,
      precision=precision,
      backward=backward,
      options=options,
    )
  _check_config(sharding)
  batch, t_len, heads, dim_k, dim_v, _, r = validation.check_inputs(
    q, k, v, g, beta, mask, initial_state
  )
  problem = Problem(jnp.asarray(q).dtype, dim_k, dim_v, r, False)
  impl = REGISTRY.resolve(implementation, sharding.mesh.devices.flat[0], problem)
  registry.check_backward(backward, impl)
  implementation = impl.name
  chunk_size = validation.check_chunk_size(chunk_size)
  output_final_state = validation.check_bool("output_final_state", output_final_state)
  shape = f"q has shape {tuple(q.shape)} = [B, T, H, K]"
  _check_divisible(sharding, "B", batch, "batch", shape)
  _check_divisible(sharding, "H", heads, "heads", shape)
  _check_divisible(sharding, "T", t_len, "sequence", shape)
  if scale is None:
    scale = dim_k**-0.5
  if isinstance(scale, jax.Array) or not isinstance(scale, (int, float)):
    raise TypeError(
      f"scale must be a Python number for the sharded operator, got {type(scale).__name__}"
    )
  scale = float(scale)

  arrays = dict(q=q, k=k, v=v, g=g, beta=beta, mask=mask, initial_state=initial_state)
  arrays = {n: x for n, x in arrays.items() if x is not None}
  specs = {n: sharding.spec_for(n, x.ndim) for n, x in arrays.items()}
  arrays = _place(sharding, arrays, specs)
  vma = _check_vma(implementation)
  run = dict(scale=scale, chunk_size=chunk_size, implementation=implementation, precision=precision)
  if impl.pallas:
    run.update(backward=backward, options=options)
  out_specs = (sharding.spec_for("o", 4), sharding.spec_for("state", 4))
  if sharding.size("sequence") > 1:
    body = lambda a: _context_parallel_piece(a, sharding, vma, **run)
  else:
    body = lambda a: _independent_piece(a, sharding, vma, **run)
  o, final = _shard_map(body, sharding, specs, out_specs, vma)(arrays)
  return o, (final if output_final_state else None)


def _zero_state(q, v, sharding, vma, width=None):
  bl, _, hl, dk = q.shape
  s = jnp.zeros((bl, hl, dk, v.shape[-1] if width is None else width), f32)
  return _vary(s, sharding.axes("batch") + sharding.axes("heads") + sharding.axes("sequence"), vma)


def _independent_piece(a, sharding, vma, **run):
  """Batch and head parallel: the single-device operator on this device's rows and heads."""
  h0 = a.get("initial_state")
  if h0 is None:
    h0 = _zero_state(a["q"], a["v"], sharding, vma)
  else:  # a sequence axis of size 1 still types q as varying over it
    h0 = _vary(h0, sharding.axes("sequence"), vma)
  return _operator.gated_delta_product(
    a["q"],
    a["k"],
    a["v"],
    a.get("g"),
    a["beta"],
    a.get("mask"),
    initial_state=h0,
    output_final_state=True,
    **run,
  )


def piece_summary(
  q,
  k,
  v,
  g,
  beta,
  mask,
  *,
  scale,
  chunk_size,
  implementation,
  state=None,
  split=False,
  **operator_kwargs,
):
  """One piece of the sequence from a zero state, with its transition (docs/sharding.md).

  Runs the operator on values widened to [v | 0_K] from the state [0_{K x V} | I_K]: every value
  column evolves on its own under the same per-token maps S -> A_t S + b_t, so the first V
  columns are the piece from zero and the last K columns follow S_t = A_t ... A_1 = P_t.
  `split=True` makes the two halves two calls of the operator (v from zero, then 0_K from I_K):
  each call then has the value width of an ordinary one (the Pallas kernels' backward does not
  fit a 256-wide value in shared memory at K = V = 128). `state` is the widened starting state
  when the caller builds it ([B, H, K, V + K] float32); `operator_kwargs` (precision, backward,
  options) go to `gated_delta_product`.

  Returns:
    o0 [B, T, H, V] (the outputs from a zero state, q.dtype), qp [B, T, H, K] (scale q_t^T P_t,
    q.dtype), final0 [B, H, K, V] (the final state from zero) and transition [B, H, K, K]
    (P = P_T), both float32.
  """
  if state is None:
    state = context_parallel.widened_state(q.shape[0], v.shape[2], q.shape[-1], v.shape[-1])
  operator = _piece_operator(
    q,
    k,
    g,
    beta,
    mask,
    scale=scale,
    chunk_size=chunk_size,
    implementation=implementation,
    **operator_kwargs,
  )
  return context_parallel.summarise(operator, q, v, state, split)


def _piece_operator(q, k, g, beta, mask, **run):
  """(values, start) -> (o, final): the public operator on this piece's q, k, g, beta, mask."""

  def operator(values, start):
    return _operator.gated_delta_product(
      q, k, values, g, beta, mask, initial_state=start, output_final_state=True, **run
    )

  return operator


chain_states = context_parallel.chain_states


def _context_parallel_piece(a, sharding, vma, **run):
  """Context parallel: this device's piece of the sequence, chained with the others
  (gdp_jax/ops/gated_delta_product/context_parallel.py)."""
  q, v = a["q"], a["v"]
  bl, _, hl, dk = q.shape
  seq = sharding.axes("sequence")
  state = _vary(
    context_parallel.widened_state(bl, hl, dk, v.shape[-1]),
    sharding.axes("batch") + sharding.axes("heads") + seq,
    vma,
  )
  operator = _piece_operator(q, a["k"], a.get("g"), a["beta"], a.get("mask"), **run)
  # Pallas: two calls of the ordinary width; the others: one widened call (docs/sharding.md).
  split = REGISTRY.is_pallas(run["implementation"])
  o, final = context_parallel.piece_outputs(
    operator, q, v, a.get("initial_state"), seq, split=split, state=state
  )
  # Every device has the same final state; the last piece's copy, summed over the axis, is
  # typed as replicated over it.
  me = jax.lax.axis_index(seq)
  final = jax.lax.psum(jnp.where(me == sharding.size("sequence") - 1, final, 0.0), seq)
  return o, final


# ----------------------------------------------------------------------------------------------
# The one-token step
# ----------------------------------------------------------------------------------------------


def sharded_gated_delta_product_step(
  q,
  k,
  v,
  g=None,
  beta=None,
  mask=None,
  state=None,
  *,
  sharding,
  scale=None,
  implementation=None,
  precision=None,
  in_place=True,
):
  """`gated_delta_product_step` with batch and heads split over a device mesh.

  Same arguments and results as `gdp_jax.gated_delta_product_step`, plus `sharding` (a
  `ShardingConfig`, or None for one device). B must be divisible by the batch axes' size and H
  by the heads axes' size; the sequence axes are not used (devices along them compute the same
  step). Returns (o [B, H, V], new_state [B, H, K, V] float32), split over batch and heads.
  """
  if sharding is None:
    return _step.gated_delta_product_step(
      q,
      k,
      v,
      g,
      beta,
      mask,
      state,
      scale=scale,
      implementation=implementation,
      precision=precision,
      in_place=in_place,
    )
  _check_config(sharding)
  batch, heads, dim_k, dim_v, _, _ = validation.check_step_inputs(q, k, v, g, beta, mask, state)
  implementation = STEP_REGISTRY.resolve(implementation, sharding.mesh.devices.flat[0]).name
  shape = f"q has shape {tuple(q.shape)} = [B, H, K]"
  _check_divisible(sharding, "B", batch, "batch", shape)
  _check_divisible(sharding, "H", heads, "heads", shape)
  if state is None:
    state = jnp.zeros((batch, heads, dim_k, dim_v), f32)
  arrays = dict(q=q, k=k, v=v, g=g, beta=beta, mask=mask, state=state)
  arrays = {n: jnp.asarray(x) for n, x in arrays.items() if x is not None}
  specs = {n: sharding.spec_for(n, x.ndim) for n, x in arrays.items()}
  if isinstance(scale, jax.Array):
    arrays["scale"], specs["scale"] = scale, PartitionSpec()
  arrays = _place(sharding, arrays, specs)
  vma = _check_vma(implementation)

  def body(a):
    return _step.gated_delta_product_step(
      a["q"],
      a["k"],
      a["v"],
      a.get("g"),
      a["beta"],
      a.get("mask"),
      a["state"],
      scale=a.get("scale", scale),
      implementation=implementation,
      precision=precision,
      in_place=in_place,
    )

  out_specs = (sharding.spec("bh-"), sharding.spec_for("state", 4))
  return _shard_map(body, sharding, specs, out_specs, vma)(arrays)
