"""`gated_delta_product`: the public function (docs/operator.md): argument checks, what every
implementation shares, and the registry of its implementations in order of preference
(docs/implementations.md#choosing-an-implementation).

Every implementation receives the same normalised inputs (base.py): T padded with no-op tokens
to its `time_multiple` (on several devices each device pads its own block, partitioning.py), g
clamped at RESET_LOG_DECAY, the mask as a 5-D array [Bm, Tm, Hm, r, r], a float32 state and a
Python-number scale (an array scale multiplies o afterwards: o is linear in it). With
`cu_seqlens` (docs/varlen.md) T is not padded: the implementation's `varlen` method gets the
offsets and an initial state per sequence, [N, HV, K, V].
"""

from __future__ import annotations

from typing import cast, overload

import jax
import jax.numpy as jnp

from gdp_jax.ops import registry
from gdp_jax.ops.gated_delta_product import block_states, partitioning
from gdp_jax.ops.gated_delta_product.base import (
  RESET_LOG_DECAY,
  GatedDeltaProductImplementation,
  Problem,
  run_padded,
)
from gdp_jax.ops.gated_delta_product.mosaic_gpu import MosaicGpuGatedDeltaProduct
from gdp_jax.ops.gated_delta_product.reference import ReferenceGatedDeltaProduct
from gdp_jax.ops.gated_delta_product.triton import TritonGatedDeltaProduct
from gdp_jax.ops.gated_delta_product.xla import XlaGatedDeltaProduct
from gdp_jax.ops.validation import (
  check_bool,
  check_chunk_size,
  check_cu_seqlens,
  check_cu_seqlens_values,
  check_inputs,
  check_options,
  check_scale,
  check_state_every,
  shape_of,
)
from pallas_kernels.common.backend import resolve_precision
from pallas_kernels.common.device import describe_capability
from pallas_kernels.common.options import KernelOptions

# In order of preference: None and "pallas" take the first that serves the device and the call.
REGISTRY = registry.Registry(
  "gated_delta_product",
  (
    MosaicGpuGatedDeltaProduct(),
    TritonGatedDeltaProduct(),
    XlaGatedDeltaProduct(),
    ReferenceGatedDeltaProduct(),
  ),
)
IMPLEMENTATIONS = REGISTRY.accepted()


def describe_runtime(device=None) -> str:
  """One line naming the device and the implementation `None` picks there (for notebooks/logs)."""
  device = registry.default_device() if device is None else device
  if device.platform == "gpu":
    where = f"{device.device_kind} (compute capability {describe_capability(device)})"
  else:
    where = f"{device.platform.upper()} ({device.device_kind})"
  return f"{where}: implementation=None runs {REGISTRY.resolve(None, device).name!r}"


# ----------------------------------------------------------------------------------------------
# The operator
# ----------------------------------------------------------------------------------------------


@overload
def gated_delta_product(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  g: jax.Array | None = None,
  beta: jax.Array | None = None,
  mask: jax.Array | None = None,
  *,
  scale: float | jax.Array | None = None,
  initial_state: jax.Array | None = None,
  output_final_state: bool = False,
  chunk_size: int = 64,
  implementation: str | None = None,
  precision: str | None = None,
  backward: str = "pallas",
  options: KernelOptions | None = None,
  cu_seqlens: jax.Array | None = None,
  state_every: None = None,
) -> tuple[jax.Array, jax.Array | None]: ...


@overload
def gated_delta_product(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  g: jax.Array | None = None,
  beta: jax.Array | None = None,
  mask: jax.Array | None = None,
  *,
  scale: float | jax.Array | None = None,
  initial_state: jax.Array | None = None,
  output_final_state: bool = False,
  chunk_size: int = 64,
  implementation: str | None = None,
  precision: str | None = None,
  backward: str = "pallas",
  options: KernelOptions | None = None,
  cu_seqlens: jax.Array | None = None,
  state_every: int,
) -> tuple[jax.Array, jax.Array | None, jax.Array]: ...


def gated_delta_product(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  g: jax.Array | None = None,
  beta: jax.Array | None = None,
  mask: jax.Array | None = None,
  *,
  scale: float | jax.Array | None = None,
  initial_state: jax.Array | None = None,
  output_final_state: bool = False,
  chunk_size: int = 64,
  implementation: str | None = None,
  precision: str | None = None,
  backward: str = "pallas",
  options: KernelOptions | None = None,
  cu_seqlens: jax.Array | None = None,
  state_every: int | None = None,
) -> tuple[jax.Array, jax.Array | None] | tuple[jax.Array, jax.Array | None, jax.Array]:
  """Block-masked gated delta product linear attention (docs/operator.md).

  Per batch row and value head a float32 state S [K, V] evolves as
    S' = exp(g_t) S_{t-1};  u_a = beta_t (v_t - sum_d M_t[a,d] k_t^(d)T S'^(d));
    S_t^(a) = S'^(a) + k_t^(a) u_a^T;  o_t = scale q_t^T S_t
  with the key dimension split into r blocks (r = mask size).

  Args:
    q, k: [B, T, H, K]. v: [B, T, HV, V] with HV a multiple of H (grouped value heads: value
      head i reads key head i // (HV // H); HV = H is the plain case). One dtype for all three:
      float32, bfloat16 or float16 (float64 is rejected: everything is computed in float32).
    g: [B, T, HV] log-decay (<= 0), or None for no decay.
    beta: [B, T, HV] write strength (required).
    mask: None (r = 1), [r, r], [HV, r, r] or per token [B, T, HV, r, r]; K % r == 0.
    scale: output scale, default K ** -0.5: a number, or a scalar array (traced ones included,
      e.g. a learned scale under `jax.jit`; differentiable); finite and > 0.
    initial_state: [B, HV, K, V] ([N, HV, K, V] with cu_seqlens) or None (zeros).
    output_final_state: True to also return the final state [B, HV, K, V] float32 (a bool).
    chunk_size: tokens per chunk of the chunked forms, one of 16, 32, 64.
    implementation: "reference" (recurrence over time), "xla" (chunked jnp), "triton" (the
      Pallas GPU kernels through Triton; interpreted on CPU, slowly), "mosaic_gpu" (the Hopper
      kernels: bf16/fp16, K and V in 64 and 128, r in 1, 2, 4), "pallas" (the first Pallas
      backend that serves the device and takes the call), or None for the fastest one available
      (the Pallas backend on a supported GPU, "xla" elsewhere;
      docs/implementations.md#choosing-an-implementation). A named implementation that cannot
      take the call is a ValueError saying why.
    precision: float32 matmuls of the Pallas kernels: None follows
      `jax.default_matmul_precision` (TF32 by default, as XLA's float32 dots on these GPUs),
      "highest" gives tf32x3 (close to float32), "ieee" full float32 on the CUDA cores
      (docs/precision.md). Half-precision inputs always use bf16/f16 tensor-core products with
      float32 accumulation. The "reference" and "xla" implementations compute in float32 at
      HIGHEST precision (the ground truth) whatever this says. Overrides `options.precision`.
    backward: with a Pallas implementation: "pallas" (its kernels) or "xla" (the jnp backward of
      the chunked form behind the Pallas forward: a debugging switch).
    options: None or a `pallas_kernels.common.options.KernelOptions` (matmul precision and
      launch parameters of a Pallas implementation); None picks them by heuristic.
    cu_seqlens: None, or int32 [N + 1] offsets of N sequences packed back to back in one row
      (docs/varlen.md): B must be 1, sequence n holds tokens [cu_seqlens[n], cu_seqlens[n + 1]),
      offsets start at 0, end at T and never decrease (two equal offsets: an empty sequence,
      whose final state is its initial state). Every sequence starts from its own initial state
      (zeros if none) and nothing crosses a boundary. May be traced under `jax.jit`: new
      boundaries with the same N and T do not recompile. Concrete offsets are checked; invalid
      traced ones are undefined behaviour (they are repaired, `gdp_jax.varlen.sanitize`, so
      nothing reads out of bounds, but the result means nothing).
    state_every: None, or N, a positive multiple of chunk_size: also return the state after
      every N tokens (docs/operator.md#block-boundary-states): [B, T // N, HV, K, V] float32, row
      j the state after tokens [0, (j + 1) N) (a ragged end of T % N tokens has no row: its
      state is the final state). With cu_seqlens [1, T // N, HV, K, V]: each sequence's blocks
      counted from its own start, sequence n's in rows [c[n], c[n + 1]) of
      c = `gdp_jax.varlen.block_offsets(cu_seqlens, N)`, zeros after the last. Not on
      "mosaic_gpu" (None and "pallas" pick "triton"); "triton" has no derivatives then (a
      NotImplementedError), "reference" and "xla" differentiate the states.

  Returns:
    (o [B, T, HV, V] in q.dtype, final_state [B, HV, K, V] ([N, HV, K, V] with cu_seqlens)
    float32 or None), and the block states third when state_every is given. B = 0 gives empty
    outputs.

  Derivatives: every implementation supports reverse mode (`jax.grad`, `jax.vjp`) in every
  input; "reference" and "xla" also forward mode and higher orders (JAX differentiates their
  jnp code), "pallas" raises a NotImplementedError for those (its backward is a custom_vjp).
  With grouped value heads dq and dk sum over each group.

  Values: g = -inf (a reset) gives the recurrence's result in every implementation. A nan or
  inf at token t leaves the outputs before t and their gradients unchanged in every
  implementation (docs/precision.md#non-finite-inputs); with cu_seqlens it spoils its own
  sequence only.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from gdp_jax import gated_delta_product
    >>> q = k = jnp.ones((1, 8, 2, 16)) / 4.0
    >>> v = jnp.ones((1, 8, 2, 16))
    >>> beta = jnp.full((1, 8, 2), 0.5)
    >>> o, state = gated_delta_product(q, k, v, None, beta, output_final_state=True)
    >>> o.shape, state.shape
    ((1, 8, 2, 16), (1, 2, 16, 16))
  """
  num_seqs = None
  if cu_seqlens is not None:
    cu_seqlens, num_seqs = check_cu_seqlens(cu_seqlens)
  batch, t_len, heads_v, dim_k, dim_v, mask5, r = check_inputs(
    q, k, v, g, beta, mask, initial_state, grouped=True, num_states=num_seqs
  )
  if cu_seqlens is not None:
    if batch != 1:
      raise ValueError(
        f"with cu_seqlens the batch size must be 1 (the N = {num_seqs} sequences packed back "
        f"to back in one row), got B = {batch} (q shape {shape_of(q)})"
      )
    check_cu_seqlens_values(cu_seqlens, t_len)
  # NumPy arrays in JAX's dtypes from here (float64 NumPy input is float32 without x64).
  q, k, v, beta, mask5 = (jnp.asarray(x) for x in (q, k, v, beta, mask5))
  g = None if g is None else jnp.asarray(g)
  initial_state = None if initial_state is None else jnp.asarray(initial_state)
  output_final_state = check_bool("output_final_state", output_final_state)
  chunk_size = check_chunk_size(chunk_size)
  scale = check_scale(scale)
  state_every = check_state_every(state_every, chunk_size)
  check_options(options)
  problem = Problem(q.dtype, dim_k, dim_v, r, cu_seqlens is not None, state_every)
  impl = cast(GatedDeltaProductImplementation, REGISTRY.resolve(implementation, problem=problem))
  registry.check_backward(backward, impl)
  # None with explicit options keeps options.precision; else None follows jax's default.
  kernel_precision: str | None = resolve_precision(precision)
  if precision is None and options is not None:
    kernel_precision = None
  if batch == 0:  # an empty batch: empty outputs, as jnp's functions give
    o = jnp.zeros((0, t_len, heads_v, dim_v), q.dtype)
    final = jnp.zeros((0, heads_v, dim_k, dim_v), jnp.float32) if output_final_state else None
    if state_every is None:
      return o, final
    return o, final, jnp.zeros((0, t_len // state_every, heads_v, dim_k, dim_v), jnp.float32)
  if impl.pallas:
    impl = impl.replace(options=options, backward=backward, precision=kernel_precision)
  if scale is None:
    scale = dim_k**-0.5
  if g is None:
    g = jnp.zeros((batch, t_len, heads_v), jnp.float32)
  # a reset (g = -inf) as the chunked forms take it (pallas_kernels/common/gates.py); nan stays
  g = jnp.maximum(g, jnp.asarray(RESET_LOG_DECAY, g.dtype))
  no_initial_state = initial_state is None  # a packed call then passes None (packed_states)
  if initial_state is None:
    states = batch if num_seqs is None else num_seqs
    initial_state = jnp.zeros((states, heads_v, dim_k, dim_v), jnp.float32)
  initial_state = initial_state.astype(jnp.float32)
  array_scale = None
  if not isinstance(scale, (int, float)):  # a traced or learned scale: o is linear in it
    array_scale, scale = scale, 1.0
  args = (q, k, v, g, beta, mask5, initial_state, float(scale), chunk_size)
  states = None
  if state_every is not None:  # unpartitioned (docs/operator.md#block-boundary-states)
    cu = None if cu_seqlens is None else jnp.asarray(cu_seqlens)
    o, final, states = block_states.run(impl, *args, state_every, cu)
  elif cu_seqlens is not None:
    h0 = None if no_initial_state else initial_state
    o, final = impl.varlen(*args[:6], h0, *args[7:], jnp.asarray(cu_seqlens))
  elif partitioning.partitions() and (impl.pallas or impl.name == "xla"):
    # Sharded inputs under jax.jit: the kernels run per device on their block of batch rows and
    # heads, or context parallel on their piece of the sequence, each device padding its own
    # block (docs/sharding.md#under-plain-jaxjit); "xla" differentiable in every mode.
    wrap = partitioning.partitioned if impl.pallas else partitioning.differentiable
    o, final = wrap(impl, *args)
  else:
    o, final = run_padded(impl, *args)
  if array_scale is not None:
    o = o.astype(jnp.float32) * array_scale
  outputs = (o.astype(q.dtype), final if output_final_state else None)
  return outputs if states is None else (*outputs, states)
