"""`gated_delta_product`: the public function: argument checks, normalisation, dispatch.

The public operator (docs/operator.md). Every implementation receives the same normalised inputs:
T padded to a multiple of the chunk (padding tokens have beta = 0, g = 0: exact no-ops; on
several devices the partitioning wrapper pads each device's block instead, partitioning.py), the
mask as a 5-D array [Bm, Tm, Hm, r, r] that broadcasts against [B, T, HV, r, r], and a float32
state. q and k keep their H key heads (grouped value heads: v, g, beta, the mask and the state
have HV = a multiple of H; each implementation maps them with `expand_key_heads`), see base.py. With
`cu_seqlens` (packed variable-length sequences, docs/varlen.md) T is not padded: the
implementation's `varlen` method ("gated_delta_product_varlen" in gdp_jax/ops/dispatch.py) gets
the offsets and an initial state per sequence, [N, HV, K, V].
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from gdp_jax.ops import dispatch
from gdp_jax.ops.gated_delta_product import partitioning
from gdp_jax.ops.validation import (
  check_bool,
  check_chunk_size,
  check_cu_seqlens,
  check_cu_seqlens_values,
  check_inputs,
  check_scale,
  shape_of,
)
from pallas_kernels.common.backend import resolve_precision
from pallas_kernels.common.options import KernelOptions

IMPLEMENTATIONS = dispatch.implementations("gated_delta_product")


def _pad_time(x, t_pad):
  if x.shape[1] == t_pad:
    return x
  widths = [(0, 0)] * x.ndim
  widths[1] = (0, t_pad - x.shape[1])
  return jnp.pad(x, widths)


# ----------------------------------------------------------------------------------------------
# The operator
# ----------------------------------------------------------------------------------------------


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
) -> tuple[jax.Array, jax.Array | None]:
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
      e.g. a learned scale under `jax.jit`; differentiable).
    initial_state: [B, HV, K, V] ([N, HV, K, V] with cu_seqlens) or None (zeros).
    output_final_state: True to also return the final state [B, HV, K, V] float32 (a bool).
    chunk_size: tokens per chunk of the chunked forms, one of 16, 32, 64.
    implementation: "reference" (recurrence over time), "xla" (chunked jnp), "triton" (the
      Pallas GPU kernels through Triton; interpreted on CPU, slowly), "pallas" (the best Pallas
      backend for the device: "mosaic_gpu" on Hopper, "triton" on other GPUs), or None for the
      fastest one available on the device (the Pallas backend on a supported GPU, "xla"
      elsewhere; gdp_jax/ops/dispatch.py), with cu_seqlens too (the kernels' packed form,
      docs/varlen.md). "mosaic_gpu" (Hopper): the Mosaic GPU forward, the Triton kernels when
      differentiated; named, bf16/fp16 and K = 64 or 128 only
      (docs/implementations.md#mosaic-gpu).
    precision: float32 matmuls of the Pallas kernels: None follows
      `jax.default_matmul_precision` (TF32 by default, as XLA's float32 dots on these GPUs),
      "highest" gives tf32x3 (close to float32), "ieee" full float32 on the CUDA cores
      (docs/precision.md). Half-precision inputs always use bf16/f16 tensor-core products with
      float32 accumulation. The "reference" and "xla" implementations compute in float32 at
      HIGHEST precision (the ground truth) whatever this says. Overrides `options.precision`.
    backward: with a Pallas implementation: "pallas" (its kernels) or "xla" (the jnp backward of
      the chunked form behind the Pallas forward: a debugging switch).
    options: with a Pallas implementation: a `pallas_kernels.common.options.KernelOptions`
      (matmul precision and launch parameters); None picks them by heuristic.
    cu_seqlens: None, or int32 [N + 1] offsets of N sequences packed back to back in one row
      (docs/varlen.md): B must be 1, sequence n holds tokens [cu_seqlens[n], cu_seqlens[n + 1]),
      offsets start at 0, end at T and never decrease (two equal offsets: an empty sequence,
      whose final state is its initial state). Every sequence starts from its own initial state
      (zeros if none) and nothing crosses a boundary. May be traced under `jax.jit`: new
      boundaries with the same N and T do not recompile. Concrete offsets are checked; invalid
      traced ones are undefined behaviour (they are repaired, `gdp_jax.varlen.sanitize`, so
      nothing reads out of bounds, but the result means nothing).

  Returns:
    (o [B, T, HV, V] in q.dtype, final_state [B, HV, K, V] ([N, HV, K, V] with cu_seqlens)
    float32 or None).

  Derivatives: every implementation supports reverse mode (`jax.grad`, `jax.vjp`) in every
  input; "reference" and "xla" also forward mode and higher orders (JAX differentiates their
  jnp code), "pallas" raises a NotImplementedError for those (its backward is a custom_vjp).
  With grouped value heads dq and dk sum over each group.

  Values: g = -inf (a reset) gives the recurrence's result in every implementation. A nan or
  inf at token t leaves the outputs before t and their gradients unchanged in every
  implementation but "mosaic_gpu" (docs/precision.md#non-finite-inputs; "pallas" through a guard
  that reads the inputs once); with cu_seqlens it spoils its own sequence only.

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
  function = "gated_delta_product" if cu_seqlens is None else "gated_delta_product_varlen"
  requested, implementation = implementation, dispatch.resolve(function, implementation)
  dispatch.check_backward(backward, implementation)
  # None with explicit options keeps options.precision; else None follows jax's default.
  kernel_precision = (
    None if (precision is None and options is not None) else (resolve_precision(precision))
  )
  if scale is None:
    scale = dim_k**-0.5
  if g is None:
    g = jnp.zeros((batch, t_len, heads_v), jnp.float32)
  if initial_state is None:
    states = batch if num_seqs is None else num_seqs
    initial_state = jnp.zeros((states, heads_v, dim_k, dim_v), jnp.float32)
  initial_state = initial_state.astype(jnp.float32)

  config = dispatch.automatic_config(function, requested, implementation)
  if dispatch.is_pallas(implementation):
    config.update(options=options, backward=backward, precision=kernel_precision)
  run = dispatch.entry(function, implementation, **config)
  if dispatch.is_pallas(implementation) and cu_seqlens is None and partitioning.partitions():
    # Sharded inputs under jax.jit: the kernels run per device on their block of batch rows and
    # heads, or context parallel on their piece of the sequence, each device padding its own
    # block to whole chunks (docs/sharding.md#under-plain-jaxjit).
    o, final = partitioning.partitioned(
      run, q, k, v, g, beta, mask5, initial_state, scale, chunk_size
    )
  elif implementation == "xla" and cu_seqlens is None and partitioning.partitions():
    # The jnp chunked form: the same per-device calls, differentiable in every mode.
    o, final = partitioning.differentiable(
      run, q, k, v, g, beta, mask5, initial_state, scale, chunk_size
    )
  elif cu_seqlens is not None:
    o, final = run(
      q, k, v, g, beta, mask5, initial_state, scale, chunk_size, jnp.asarray(cu_seqlens)
    )
  elif not getattr(dispatch.implementation(function, implementation), "pads_time", True):
    o, final = run(q, k, v, g, beta, mask5, initial_state, scale, chunk_size)
  else:
    t_pad = -(-t_len // chunk_size) * chunk_size
    padded = [_pad_time(x, t_pad) for x in (q, k, v, g, beta)]
    mask_p = mask5 if mask5.shape[1] == 1 else _pad_time(mask5, t_pad)
    o, final = run(*padded, mask_p, initial_state, scale, chunk_size)
    o = o[:, :t_len]
  return o.astype(q.dtype), (final if output_final_state else None)
