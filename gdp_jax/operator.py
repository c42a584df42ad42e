"""`gated_delta_product`: argument checks, normalisation and implementation dispatch.

The public operator (docs/operator.md). Every implementation receives the same normalised inputs:
T padded to a multiple of the chunk (padding tokens have beta = 0, g = 0: exact no-ops), the mask
as a 5-D array [Bm, Tm, Hm, r, r] that broadcasts against [B, T, H, r, r], and a float32 state.
"""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp
import numpy as np

from gdp_jax import dispatch
from pallas_kernels.common.backend import resolve_precision
from pallas_kernels.common.options import KernelOptions

IMPLEMENTATIONS = dispatch.implementations("gated_delta_product")
CHUNK_SIZES = (16, 32, 64)


# ----------------------------------------------------------------------------------------------
# Checks
# ----------------------------------------------------------------------------------------------


def _shape(x):
  return tuple(np.shape(x))


def check_float(name, x):
  """A TypeError unless x is an array of float32, bfloat16 or float16.

  float64 is rejected (with x64 enabled; without it JAX turns float64 NumPy arrays into float32
  anyway): every implementation computes in float32 with a float32 state, so a float64 result
  would only look more precise than it is (docs/precision.md#the-state-is-float32).
  """
  dtype = getattr(x, "dtype", None)
  if dtype is None:
    raise TypeError(f"{name} must be an array, got {type(x).__name__}")
  if not jnp.issubdtype(dtype, jnp.floating):
    raise TypeError(
      f"{name} must have a floating dtype (float32, bfloat16 or float16), "
      f"got {dtype} with shape {_shape(x)}"
    )
  if jax.dtypes.canonicalize_dtype(dtype) == jnp.float64:
    raise TypeError(
      f"{name} is float64 (shape {_shape(x)}): not supported, every "
      f"implementation computes in float32 with a float32 state; cast it to "
      f"float32 (or bfloat16 / float16)"
    )


def check_bool(name, value):
  """A TypeError unless value is a bool (a string such as "no" would read as true)."""
  if not isinstance(value, (bool, np.bool_)):
    raise TypeError(f"{name} must be True or False, got {value!r} ({type(value).__name__})")
  return bool(value)


def check_chunk_size(chunk_size):
  if isinstance(chunk_size, (bool, np.bool_)) or not isinstance(chunk_size, (int, np.integer)):
    raise TypeError(
      f"chunk_size must be an int, one of {CHUNK_SIZES}, got {chunk_size!r} "
      f"({type(chunk_size).__name__})"
    )
  if chunk_size not in CHUNK_SIZES:
    raise ValueError(f"chunk_size must be one of {CHUNK_SIZES}, got {chunk_size!r}")
  return int(chunk_size)


def check_scale(scale):
  """None, a real number (-> float) or a scalar float array, traced ones included (-> float32)."""
  if scale is None:
    return None
  if isinstance(scale, (bool, np.bool_)) or isinstance(scale, (str, bytes)):
    raise TypeError(
      f"scale must be a number or a scalar float array, got {scale!r} ({type(scale).__name__})"
    )
  if isinstance(scale, numbers.Real):
    return float(scale)
  dtype = getattr(scale, "dtype", None)
  if dtype is None or not (
    jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer)
  ):
    raise TypeError(
      f"scale must be a number or a scalar float array, got "
      f"{type(scale).__name__}" + (f" of dtype {dtype}" if dtype else "")
    )
  if _shape(scale) != ():
    raise ValueError(
      f"scale must be a scalar (one output scale for every head), got shape {_shape(scale)}"
    )
  return jnp.asarray(scale, jnp.float32)


def check_int32_values(name, x):
  """A ValueError if a concrete integer array holds values outside int32 (which JAX would wrap
  silently when it converts them); traced values pass through (they are int32 already unless
  x64 is on, and the callers clip before casting)."""
  if isinstance(x, jax.core.Tracer):
    return
  values = np.asarray(x)
  if values.size and (
    values.min() < np.iinfo(np.int32).min or values.max() > np.iinfo(np.int32).max
  ):
    raise ValueError(
      f"{name} holds values outside int32 (min {values.min()}, max "
      f"{values.max()}); they would wrap around"
    )


def check_shape(name, x, expected, what):
  if _shape(x) != tuple(expected):
    raise ValueError(f"{name} has shape {_shape(x)}, expected {tuple(expected)} ({what})")


def normalize_mask(mask, batch, t_len, heads, dim_k):
  """Check a mask and return it as [Bm, Tm, Hm, r, r] plus r.

  Accepted: None (r = 1), [r, r] (shared), [H, r, r] (per head), [B, T, H, r, r] (per token).
  """
  if mask is None:
    return jnp.ones((1, 1, 1, 1, 1), jnp.float32), 1
  check_float("mask", mask)
  shape = _shape(mask)
  if len(shape) not in (2, 3, 5):
    raise ValueError(
      f"mask has shape {shape}; expected [r, r], [H, r, r] = [{heads}, r, r] "
      f"or [B, T, H, r, r] = [{batch}, {t_len}, {heads}, r, r]"
    )
  r = shape[-1]
  if shape[-2] != r:
    raise ValueError(f"mask must be square in its last two axes (r x r), got shape {shape}")
  if r < 1:
    raise ValueError(f"mask has r = {r}; need r >= 1")
  if len(shape) == 3 and shape[0] != heads:
    raise ValueError(
      f"mask has shape {shape}; a per-head mask must be [H, r, r] = [{heads}, {r}, {r}]"
    )
  if len(shape) == 5 and shape[:3] != (batch, t_len, heads):
    raise ValueError(
      f"mask has shape {shape}; a per-token mask must be [B, T, H, r, r] = "
      f"[{batch}, {t_len}, {heads}, {r}, {r}]"
    )
  if dim_k % r != 0:
    raise ValueError(
      f"the key dimension K = {dim_k} (q and k last axis) must be divisible by "
      f"the number of key blocks r = {r} (mask shape {shape})"
    )
  if len(shape) == 2:
    mask = mask[None, None, None]
  elif len(shape) == 3:
    mask = mask[None, None]
  return mask, r


def check_inputs(q, k, v, g, beta, mask, initial_state):
  """Validate the operator's arguments; returns (B, T, H, K, V, normalised mask, r)."""
  for name, x in (("q", q), ("k", k), ("v", v)):
    check_float(name, x)
  if q.ndim != 4:
    raise ValueError(f"q must be [B, T, H, K] (rank 4), got shape {_shape(q)}")
  batch, t_len, heads, dim_k = q.shape
  if dim_k < 1:
    raise ValueError(f"q has K = {dim_k} features (shape {_shape(q)}); need K >= 1")
  check_shape("k", k, q.shape, "k must match q: [B, T, H, K]")
  if v.ndim != 4 or v.shape[:3] != q.shape[:3]:
    raise ValueError(
      f"v has shape {_shape(v)}, expected [B, T, H, V] = "
      f"[{batch}, {t_len}, {heads}, V] (B, T, H as q)"
    )
  if not (q.dtype == k.dtype == v.dtype):
    raise TypeError(f"q, k and v must share one dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
  if t_len < 1:
    raise ValueError(f"q has T = {t_len} tokens (shape {_shape(q)}); need T >= 1")
  dim_v = v.shape[-1]
  if beta is None:
    raise ValueError(
      f"beta is required: the write strength, shape [B, T, H] = [{batch}, {t_len}, {heads}]"
    )
  check_float("beta", beta)
  check_shape("beta", beta, (batch, t_len, heads), "[B, T, H] as q")
  if g is not None:
    check_float("g", g)
    check_shape("g", g, (batch, t_len, heads), "[B, T, H] as q: the log-decay")
  mask5, r = normalize_mask(mask, batch, t_len, heads, dim_k)
  if initial_state is not None:
    check_float("initial_state", initial_state)
    check_shape("initial_state", initial_state, (batch, heads, dim_k, dim_v), "[B, H, K, V]")
  return batch, t_len, heads, dim_k, dim_v, mask5, r


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
) -> tuple[jax.Array, jax.Array | None]:
  """Block-masked gated delta product linear attention (docs/operator.md).

  Per batch row and head a float32 state S [K, V] evolves as
    S' = exp(g_t) S_{t-1};  u_a = beta_t (v_t - sum_d M_t[a,d] k_t^(d)T S'^(d));
    S_t^(a) = S'^(a) + k_t^(a) u_a^T;  o_t = scale q_t^T S_t
  with the key dimension split into r blocks (r = mask size).

  Args:
    q, k: [B, T, H, K]. v: [B, T, H, V]. One dtype for all three: float32, bfloat16 or
      float16 (float64 is rejected: everything is computed in float32).
    g: [B, T, H] log-decay (<= 0), or None for no decay.
    beta: [B, T, H] write strength (required).
    mask: None (r = 1), [r, r], [H, r, r] or per token [B, T, H, r, r]; K % r == 0.
    scale: output scale, default K ** -0.5: a number, or a scalar array (traced ones included,
      e.g. a learned scale under `jax.jit`; differentiable).
    initial_state: [B, H, K, V] or None (zeros).
    output_final_state: True to also return the final state [B, H, K, V] float32 (a bool).
    chunk_size: tokens per chunk of the chunked forms, one of 16, 32, 64.
    implementation: "reference" (recurrence over time), "xla" (chunked jnp), "pallas" (GPU
      kernels; interpreted on CPU, slowly), or None for the fastest one available on the
      device ("pallas" on a supported GPU, "xla" elsewhere; see gdp_jax/dispatch.py).
    precision: float32 matmuls of the Pallas kernels: None follows
      `jax.default_matmul_precision` (TF32 by default, as XLA's float32 dots on these GPUs),
      "highest" gives tf32x3 (close to float32), "ieee" full float32 on the CUDA cores
      (docs/precision.md). Half-precision inputs always use bf16/f16 tensor-core products with
      float32 accumulation. The "reference" and "xla" implementations compute in float32 at
      HIGHEST precision (the ground truth) whatever this says. Overrides `options.precision`.
    backward: with implementation "pallas": "pallas" (its kernels) or "xla" (the jnp backward of
      the chunked form behind the Pallas forward: a debugging switch).
    options: with implementation "pallas": a `pallas_kernels.common.options.KernelOptions`
      (matmul precision and launch parameters); None picks them by heuristic.

  Returns:
    (o [B, T, H, V] in q.dtype, final_state [B, H, K, V] float32 or None).

  Derivatives: every implementation supports reverse mode (`jax.grad`, `jax.vjp`) in every
  input; "reference" and "xla" also forward mode and higher orders (JAX differentiates their
  jnp code), "pallas" raises a NotImplementedError for those (its backward is a custom_vjp).

  Values: g = -inf (a reset) gives the recurrence's result in every implementation. A nan or
  inf at token t leaves the outputs before t and their gradients unchanged in "reference" and
  "xla" (docs/precision.md#non-finite-inputs).

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
  batch, t_len, heads, dim_k, dim_v, mask5, r = check_inputs(q, k, v, g, beta, mask, initial_state)
  # NumPy arrays in JAX's dtypes from here (float64 NumPy input is float32 without x64).
  q, k, v, beta, mask5 = (jnp.asarray(x) for x in (q, k, v, beta, mask5))
  g = None if g is None else jnp.asarray(g)
  initial_state = None if initial_state is None else jnp.asarray(initial_state)
  output_final_state = check_bool("output_final_state", output_final_state)
  chunk_size = check_chunk_size(chunk_size)
  scale = check_scale(scale)
  implementation = dispatch.resolve("gated_delta_product", implementation)
  dispatch.check_backward(backward, implementation)
  # None with explicit options keeps options.precision; else None follows jax's default.
  kernel_precision = (
    None if (precision is None and options is not None) else (resolve_precision(precision))
  )
  if scale is None:
    scale = dim_k**-0.5
  if g is None:
    g = jnp.zeros((batch, t_len, heads), jnp.float32)
  if initial_state is None:
    initial_state = jnp.zeros((batch, heads, dim_k, dim_v), jnp.float32)
  initial_state = initial_state.astype(jnp.float32)

  run = dispatch.entry("gated_delta_product", implementation)
  if implementation == "reference":
    o, final = run(q, k, v, g, beta, mask5, initial_state, scale)
  else:
    t_pad = -(-t_len // chunk_size) * chunk_size
    padded = [_pad_time(x, t_pad) for x in (q, k, v, g, beta)]
    mask_p = mask5
    if mask5.shape[1] != 1:
      mask_p = _pad_time(mask5, t_pad)
    extra = {}
    if implementation == "pallas":
      extra = dict(options=options, backward=backward, precision=kernel_precision)
    o, final = run(*padded, mask_p, initial_state, scale, chunk_size, **extra)
    o = o[:, :t_len]
  return o.astype(q.dtype), (final if output_final_state else None)
