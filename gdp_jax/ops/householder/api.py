"""`householder_delta_product` and its step: DeltaProduct (Siems et al. 2025), the Householder
form of the gated delta product (docs/operator.md, docs/layers.md).

Each token applies `n_h` rank-1 delta steps to the state, each with its own key, value and write
strength: its log-decay once before the first, its output read after the last, so its transition
is a product of n_h factors (I - beta_i k_i k_i^T), which can rotate the state. The layout is
flash-linear-attention's `chunk_gated_delta_product`: q [B, T, H, K], k [B, T*n_h, H, K],
v [B, T*n_h, H, V], beta [B, T*n_h, H], g [B, T, H].

The chunked implementations run the r = 1 operator `gated_delta_product` over the T*n_h
sub-steps (g on each token's first sub-step, q on its last) and keep the last sub-steps'
outputs; "reference" is a recurrence of its own. Packed sequences (`cu_seqlens`, docs/varlen.md)
run the operator's packed form over the sub-steps.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from gdp_jax.ops.gated_delta_product import varlen
from gdp_jax.ops.gated_delta_product.api import REGISTRY, gated_delta_product
from gdp_jax.ops.gated_delta_product.base import Problem
from gdp_jax.ops.householder import mosaic_gpu as householder_mosaic
from gdp_jax.ops.householder.reference import householder_reference
from gdp_jax.ops.step.api import REGISTRY as STEP_REGISTRY
from gdp_jax.ops.step.api import gated_delta_product_step
from gdp_jax.ops.validation import (
  CHUNK_SIZES,
  check_cu_seqlens,
  check_cu_seqlens_values,
  check_float,
  check_gate_values,
  check_scale,
  check_shape,
)
from pallas_kernels.common.backend import resolve_precision

HIGHEST = jax.lax.Precision.HIGHEST


# ----------------------------------------------------------------------------------------------
# Checks
# ----------------------------------------------------------------------------------------------


def _shape(x):
  return tuple(np.shape(x))


def check_num_householder(num_householder):
  """A TypeError unless a Python int, a ValueError unless >= 1; returns it."""
  if isinstance(num_householder, bool) or not isinstance(num_householder, (int, np.integer)):
    raise TypeError(
      f"num_householder must be an int (the number of Householder steps per "
      f"token, n_h >= 1), got {num_householder!r} of type "
      f"{type(num_householder).__name__}"
    )
  if num_householder < 1:
    raise ValueError(
      f"num_householder must be >= 1 (Householder steps per token), got {num_householder}"
    )
  return int(num_householder)


def _check_implementation(implementation, q, v, packed):
  """The implementation's name, as the operator resolves it for the r = 1 sub-step calls."""
  problem = Problem(jnp.asarray(q).dtype, q.shape[-1], v.shape[-1], 1, packed)
  return REGISTRY.resolve(implementation, problem=problem).name


def check_householder_inputs(q, k, v, g, beta, initial_state, n_h, num_states=None):
  """Validate the sequence form's arguments; returns (B, T, H, K, V).

  num_states: the initial state's leading axis (N, the sequences of cu_seqlens), default B."""
  for name, x in (("q", q), ("k", k), ("v", v)):
    check_float(name, x)
  if q.ndim != 4:
    raise ValueError(f"q must be [B, T, H, K] (rank 4), got shape {_shape(q)}")
  batch, t_len, heads, dim_k = q.shape
  if t_len < 1:
    raise ValueError(f"q has T = {t_len} tokens (shape {_shape(q)}); need T >= 1")
  steps = t_len * n_h
  check_shape(
    "k",
    k,
    (batch, steps, heads, dim_k),
    f"[B, T*n_h, H, K]: n_h = num_householder = {n_h} keys per token of q {_shape(q)}",
  )
  if v.ndim != 4 or v.shape[:3] != (batch, steps, heads):
    raise ValueError(
      f"v has shape {_shape(v)}, expected [B, T*n_h, H, V] = "
      f"[{batch}, {steps}, {heads}, V] (n_h = num_householder = {n_h} values "
      f"per token of q {_shape(q)})"
    )
  if not (q.dtype == k.dtype == v.dtype):
    raise TypeError(f"q, k and v must share one dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
  dim_v = v.shape[-1]
  if beta is None:
    raise ValueError(
      f"beta is required: the write strength of each sub-step, shape "
      f"[B, T*n_h, H] = [{batch}, {steps}, {heads}]"
    )
  check_float("beta", beta)
  check_shape(
    "beta",
    beta,
    (batch, steps, heads),
    f"[B, T*n_h, H]: one write strength per sub-step, n_h = {n_h}",
  )
  if g is not None:
    check_float("g", g)
    check_shape(
      "g",
      g,
      (batch, t_len, heads),
      "[B, T, H] as q: one log-decay per token, applied before its first sub-step",
    )
  check_gate_values(g, beta)
  if initial_state is not None:
    check_float("initial_state", initial_state)
    if num_states is None:
      states, what = batch, "[B, H, K, V]"
    else:
      states = num_states
      what = f"[N, H, K, V]: one state per sequence of cu_seqlens (N = {num_states})"
    check_shape("initial_state", initial_state, (states, heads, dim_k, dim_v), what)
  return batch, t_len, heads, dim_k, dim_v


# ----------------------------------------------------------------------------------------------
# Sub-step layout for the r = 1 operator
# ----------------------------------------------------------------------------------------------


def to_substeps(q, g, n_h):
  """q [B, T, H, K] on each token's last sub-step, g [B, T, H] on its first; zeros elsewhere.
  Returns (q [B, T*n_h, H, K], g [B, T*n_h, H] or None)."""
  batch, t_len = q.shape[:2]
  q_sub = jnp.pad(q[:, :, None], ((0, 0), (0, 0), (n_h - 1, 0), (0, 0), (0, 0)))
  q_sub = q_sub.reshape((batch, t_len * n_h) + q.shape[2:])
  if g is None:
    return q_sub, None
  g_sub = jnp.pad(g[:, :, None], ((0, 0), (0, 0), (0, n_h - 1), (0, 0)))
  return q_sub, g_sub.reshape((batch, t_len * n_h) + g.shape[2:])


# ----------------------------------------------------------------------------------------------
# Public functions
# ----------------------------------------------------------------------------------------------


def householder_delta_product(
  q,
  k,
  v,
  g,
  beta,
  *,
  num_householder,
  scale=None,
  initial_state=None,
  output_final_state=False,
  cu_seqlens=None,
  implementation=None,
  precision=None,
  chunk_size=64,
):
  """Gated DeltaProduct: n_h Householder delta steps per token (Siems et al. 2025).

  Per batch row and head, token t decays the state once, then applies its n_h sub-steps
  i = t*n_h + j in order, then reads the output:
    S <- exp(g_t) S;  S <- S + beta_i k_i (v_i - k_i^T S)^T  (j = 0 .. n_h-1);  o_t = scale q_t^T S

  The layout is flash-linear-attention's `chunk_gated_delta_product`.

  Args:
    q: [B, T, H, K]. k: [B, T*n_h, H, K]. v: [B, T*n_h, H, V]; one floating dtype for the three.
      Sub-step j of token t sits at index t*n_h + j.
    g: [B, T, H] log-decay (<= 0), one per token, applied before its first sub-step; or None.
    beta: [B, T*n_h, H] write strength of each sub-step (required; (0, 2) allows negative
      eigenvalues with unit keys).
    num_householder: n_h >= 1, the sub-steps per token.
    scale: output scale, default K ** -0.5.
    initial_state: [B, H, K, V] ([N, H, K, V] with cu_seqlens) or None (zeros).
    output_final_state: also return the final state [B, H, K, V] ([N, H, K, V]) float32.
    cu_seqlens: None, or int32 [N + 1] offsets of N sequences packed back to back in one row
      (flash-linear-attention's convention, docs/varlen.md): B must be 1, sequence n holds the
      tokens [cu_seqlens[n], cu_seqlens[n + 1]) of q and their sub-steps
      [n_h cu_seqlens[n], n_h cu_seqlens[n + 1]) of k, v and beta; offsets start at 0, end at T
      (tokens, not sub-steps) and never decrease (equal neighbours: an empty sequence, which
      keeps its initial state). Each sequence starts from its own initial state and nothing
      crosses a boundary. May be traced under `jax.jit` (new boundaries with the same N and T
      do not recompile); concrete offsets are checked, invalid traced ones are undefined
      behaviour, as in `gated_delta_product`.
    implementation: "reference" (a recurrence over the sub-steps, float32), "xla", "triton" or
      "pallas" (the best Pallas backend): the r = 1 operator `gated_delta_product` over the T*n_h
      sub-steps, the chunked jnp form or the Pallas kernels, forward and backward; or None for the
      fastest one available on the backend (the Pallas backend on a GPU, "xla" elsewhere). With
      cu_seqlens the operator's packed form runs, over the sub-steps, in the same choices.
    precision: the float32 matmul precision of the Pallas kernels, as in `gated_delta_product`
      (None follows jax.default_matmul_precision: TF32; "highest": tf32x3; "ieee"); the
      "reference" and "xla" implementations compute at HIGHEST.
    chunk_size: sub-steps per chunk of the chunked forms, one of 16, 32, 64.

  Returns:
    (o [B, T, H, V] in q.dtype, final_state [B, H, K, V] ([N, H, K, V] with cu_seqlens) float32
    or None).
  """
  n_h = check_num_householder(num_householder)
  num_seqs = None
  if cu_seqlens is not None:
    cu_seqlens, num_seqs = check_cu_seqlens(cu_seqlens)
  batch, t_len, heads, dim_k, dim_v = check_householder_inputs(
    q, k, v, g, beta, initial_state, n_h, num_states=num_seqs
  )
  if cu_seqlens is not None:
    if batch != 1:
      raise ValueError(
        f"with cu_seqlens the batch size must be 1 (the N = {num_seqs} sequences packed back "
        f"to back in one row), got B = {batch} (q shape {_shape(q)})"
      )
    check_cu_seqlens_values(cu_seqlens, t_len)  # over the T tokens of q
  implementation = _check_implementation(implementation, q, v, cu_seqlens is not None)
  resolve_precision(precision)  # a clear error for a bad value
  if chunk_size not in CHUNK_SIZES:
    raise ValueError(f"chunk_size must be one of {CHUNK_SIZES}, got {chunk_size!r}")
  check_scale(scale)  # finite and > 0 (a TypeError / ValueError)
  if scale is None:
    scale = dim_k**-0.5

  if implementation == "reference":
    if g is None:
      g = jnp.zeros((batch, t_len, heads), jnp.float32)
    if initial_state is None:
      states = batch if num_seqs is None else num_seqs
      initial_state = jnp.zeros((states, heads, dim_k, dim_v), jnp.float32)
    cu = None if cu_seqlens is None else jnp.asarray(cu_seqlens)
    o, final = householder_reference(q, k, v, g, beta, initial_state, scale, n_h, cu)
    return o.astype(q.dtype), (final if output_final_state else None)

  substeps = functools.partial(
    _substep_path,
    n_h=n_h,
    scale=scale,
    output_final_state=output_final_state,
    chunk_size=chunk_size,
    implementation=implementation,
    precision=precision,
  )
  if implementation == "mosaic_gpu" and householder_mosaic.supported(
    q, k, v, n_h, chunk_size, cu_seqlens, initial_state
  ):
    return householder_mosaic.householder_mosaic_gpu(
      q,
      k,
      v,
      g,
      beta,
      initial_state,
      scale=scale,
      n_h=n_h,
      output_final_state=output_final_state,
      substeps=functools.partial(substeps, cu_seqlens=cu_seqlens),
      cu_seqlens=cu_seqlens,
    )
  return substeps(q, k, v, g, beta, initial_state, cu_seqlens=cu_seqlens)


def _substep_path(
  q,
  k,
  v,
  g,
  beta,
  initial_state,
  *,
  n_h,
  scale,
  output_final_state,
  chunk_size,
  implementation,
  precision,
  cu_seqlens=None,
):
  """The r = 1 operator `gated_delta_product` over the T*n_h sub-steps (`to_substeps`)."""
  batch, t_len, heads, dim_v = q.shape[0], q.shape[1], v.shape[2], v.shape[3]
  q_sub, g_sub = to_substeps(q, g, n_h)
  cu_sub = None
  if cu_seqlens is not None:
    # token offsets -> sub-step offsets (sequence n: sub-steps [n_h cu[n], n_h cu[n + 1]));
    # traced ones repaired first, as the operator would (`varlen.sanitize`), so that the two
    # implementations see the same boundaries
    if isinstance(cu_seqlens, jax.core.Tracer):
      cu_sub = varlen.sanitize(cu_seqlens, t_len) * n_h
    else:
      cu_sub = np.asarray(cu_seqlens, np.int64) * n_h
  o, final = gated_delta_product(
    q_sub,
    k,
    v,
    g_sub,
    beta,
    None,
    scale=scale,
    initial_state=initial_state,
    output_final_state=output_final_state,
    chunk_size=chunk_size,
    implementation=implementation,
    precision=precision,
    cu_seqlens=cu_sub,
  )
  o = o.reshape((batch, t_len, n_h, heads, dim_v))[:, :, -1]  # read after the last step
  return o, final


def householder_delta_product_step(
  q, k, v, g, beta, state, *, num_householder, scale=None, implementation=None
):
  """One token of the gated DeltaProduct for every sequence (decoding).

  The token's n_h sub-steps run as n_h `gated_delta_product_step` calls (r = 1), the decay on
  the first only, the output read after the last.

  Args:
    q: [B, H, K]. k: [B, n_h, H, K]. v: [B, n_h, H, V]. One floating dtype for the three.
    g: [B, H] log-decay or None. beta: [B, n_h, H] (required).
    state: [B, H, K, V] (computed in float32), or None for zeros.
    num_householder: n_h >= 1 (k.shape[1]).
    scale: output scale, default K ** -0.5.
    implementation: "xla", "pallas" or None ("pallas" on a supported GPU, else "xla").

  Returns:
    (o [B, H, V] in q.dtype, new_state [B, H, K, V] float32).
  """
  n_h = check_num_householder(num_householder)
  for name, x in (("q", q), ("k", k), ("v", v)):
    check_float(name, x)
  if q.ndim != 3:
    raise ValueError(f"q must be [B, H, K] (rank 3: one token per sequence), got shape {_shape(q)}")
  batch, heads, dim_k = q.shape
  check_shape(
    "k",
    k,
    (batch, n_h, heads, dim_k),
    f"[B, n_h, H, K]: n_h = num_householder = {n_h} keys for the token of q {_shape(q)}",
  )
  if v.ndim != 4 or v.shape[:3] != (batch, n_h, heads):
    raise ValueError(
      f"v has shape {_shape(v)}, expected [B, n_h, H, V] = "
      f"[{batch}, {n_h}, {heads}, V] (n_h = num_householder = {n_h})"
    )
  if beta is None:
    raise ValueError(
      f"beta is required: the write strength of each sub-step, shape "
      f"[B, n_h, H] = [{batch}, {n_h}, {heads}]"
    )
  check_float("beta", beta)
  check_shape("beta", beta, (batch, n_h, heads), f"[B, n_h, H] with n_h = {n_h}")
  if implementation is not None:
    STEP_REGISTRY.resolve(implementation)  # a clear error if unknown
  # gated_delta_product_step checks the rest (dtypes, g, state) on the first sub-step.
  o = None
  for j in range(n_h):
    o, state = gated_delta_product_step(
      q,
      k[:, j],
      v[:, j],
      g if j == 0 else None,
      beta[:, j],
      None,
      state,
      scale=scale,
      implementation=implementation,
    )
  return o, state
