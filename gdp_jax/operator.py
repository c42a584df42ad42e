"""`gated_delta_product`: argument checks, normalisation and implementation dispatch.

The public operator (docs/operator.md). Every implementation receives the same normalised inputs:
T padded to a multiple of the chunk (padding tokens have beta = 0, g = 0: exact no-ops), the mask
as a 5-D array [Bm, Tm, Hm, r, r] that broadcasts against [B, T, HV, r, r], and a float32 state.
q and k keep their H key heads (grouped value heads: v, g, beta, the mask and the state have
HV = a multiple of H; each implementation maps them with `expand_key_heads`). With `cu_seqlens`
(packed variable-length sequences, docs/varlen.md) T is not padded: the implementation's varlen
entry point ("gated_delta_product_varlen" in gdp_jax/dispatch.py) gets the offsets and an
initial state per sequence, [N, HV, K, V].
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


def _state_what(num_states, batch, heads, grouped):
  h = "HV" if grouped else "H"
  if num_states is None:
    return f"[B, {h}, K, V]"
  return f"[N, {h}, K, V]: one state per sequence of cu_seqlens (N = {num_states})"


def check_inputs(q, k, v, g, beta, mask, initial_state, *, grouped=False, num_states=None):
  """Validate the operator's arguments; returns (B, T, HV, K, V, normalised mask, r).

  grouped: allow HV value heads (v, g, beta, the mask, the state) for H key heads (q, k) with
  HV % H == 0 (value head i reads key head i // (HV // H)); without it HV must equal H.
  num_states: the initial state's leading axis (N, the sequences of cu_seqlens), default B.
  """
  for name, x in (("q", q), ("k", k), ("v", v)):
    check_float(name, x)
  if q.ndim != 4:
    raise ValueError(f"q must be [B, T, H, K] (rank 4), got shape {_shape(q)}")
  batch, t_len, heads, dim_k = q.shape
  if dim_k < 1:
    raise ValueError(f"q has K = {dim_k} features (shape {_shape(q)}); need K >= 1")
  check_shape("k", k, q.shape, "k must match q: [B, T, H, K]")
  if not grouped:
    if v.ndim != 4 or v.shape[:3] != q.shape[:3]:
      raise ValueError(
        f"v has shape {_shape(v)}, expected [B, T, H, V] = "
        f"[{batch}, {t_len}, {heads}, V] (B, T, H as q)"
      )
  else:
    if v.ndim != 4 or v.shape[:2] != q.shape[:2]:
      raise ValueError(
        f"v has shape {_shape(v)}, expected [B, T, HV, V] = "
        f"[{batch}, {t_len}, HV, V] (B, T as q; HV a multiple of H = {heads})"
      )
    if heads < 1 or v.shape[2] % heads != 0 or v.shape[2] < 1:
      raise ValueError(
        f"v has shape {_shape(v)}, expected [B, T, H, V] = [{batch}, {t_len}, {heads}, V] or, "
        f"with grouped value heads, [B, T, HV, V] with HV a positive multiple of H = {heads} "
        f"(the key heads of q and k, shape {_shape(q)}; value head i reads key head "
        f"i // (HV // H))"
      )
  heads_v = v.shape[2]
  h = "HV" if grouped else "H"
  if not (q.dtype == k.dtype == v.dtype):
    raise TypeError(f"q, k and v must share one dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
  if t_len < 1:
    raise ValueError(f"q has T = {t_len} tokens (shape {_shape(q)}); need T >= 1")
  dim_v = v.shape[-1]
  if beta is None:
    raise ValueError(
      f"beta is required: the write strength, shape [B, T, {h}] = [{batch}, {t_len}, {heads_v}]"
    )
  check_float("beta", beta)
  check_shape("beta", beta, (batch, t_len, heads_v), f"[B, T, {h}] as v")
  if g is not None:
    check_float("g", g)
    check_shape("g", g, (batch, t_len, heads_v), f"[B, T, {h}] as v: the log-decay")
  mask5, r = normalize_mask(mask, batch, t_len, heads_v, dim_k)
  if initial_state is not None:
    check_float("initial_state", initial_state)
    states = batch if num_states is None else num_states
    check_shape(
      "initial_state",
      initial_state,
      (states, heads_v, dim_k, dim_v),
      _state_what(num_states, batch, heads_v, grouped),
    )
  return batch, t_len, heads_v, dim_k, dim_v, mask5, r


def expand_key_heads(x, value_heads):
  """[..., H, K] -> [..., HV, K]: key head i // (HV // H) for value head i (grouped value heads,
  docs/varlen.md#grouped-value-heads). Autodiff of the repeat sums the gradient over the group."""
  group = value_heads // x.shape[-2]
  return x if group == 1 else jnp.repeat(x, group, axis=-2)


def sum_key_heads(dx, heads):
  """The vjp of `expand_key_heads`: [..., HV, K] -> [..., H, K], the sum over each group."""
  group = dx.shape[-2] // heads
  if group == 1:
    return dx
  summed = dx.astype(jnp.float32).reshape(dx.shape[:-2] + (heads, group, dx.shape[-1])).sum(-2)
  return summed.astype(dx.dtype)


def check_cu_seqlens(cu_seqlens):
  """A TypeError / ValueError unless cu_seqlens is a rank-1 integer array of N + 1 >= 2 offsets;
  returns it as an array (NumPy when concrete, so that its values can be checked) and N."""
  if isinstance(cu_seqlens, (list, tuple)):
    cu_seqlens = np.asarray(cu_seqlens)
  dtype = getattr(cu_seqlens, "dtype", None)
  if dtype is None:
    raise TypeError(
      f"cu_seqlens must be an int32 array [N + 1] of offsets, got {type(cu_seqlens).__name__}"
    )
  if not jnp.issubdtype(dtype, jnp.integer):
    raise TypeError(
      f"cu_seqlens must have an integer dtype (int32), got {dtype} with shape {_shape(cu_seqlens)}"
    )
  if len(_shape(cu_seqlens)) != 1 or _shape(cu_seqlens)[0] < 2:
    raise ValueError(
      f"cu_seqlens must be [N + 1] (rank 1, N >= 1 sequences: 0, the end of sequence 0, ..., "
      f"T), got shape {_shape(cu_seqlens)}"
    )
  if not isinstance(cu_seqlens, jax.core.Tracer):
    cu_seqlens = np.asarray(cu_seqlens)
  return cu_seqlens, _shape(cu_seqlens)[0] - 1


def check_cu_seqlens_values(cu_seqlens, t_len):
  """For concrete offsets: a ValueError unless they start at 0, end at T and never decrease
  (traced ones cannot be checked: see `gdp_jax.varlen.sanitize`)."""
  if isinstance(cu_seqlens, jax.core.Tracer):
    return
  check_int32_values("cu_seqlens", cu_seqlens)
  values = np.asarray(cu_seqlens)
  shown = values.tolist() if values.size <= 16 else f"{values[:8].tolist()} ..."
  if values[0] != 0:
    raise ValueError(f"cu_seqlens must start at 0, got {shown}")
  if values[-1] != t_len:
    raise ValueError(
      f"cu_seqlens must end at T = {t_len} (the tokens of q, shape [1, T, H, K]), got "
      f"{values[-1]} (cu_seqlens = {shown})"
    )
  if np.any(np.diff(values) < 0):
    raise ValueError(
      f"cu_seqlens must be non-decreasing (equal neighbours make an empty sequence), got {shown}"
    )


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
    implementation: "reference" (recurrence over time), "xla" (chunked jnp), "pallas" (GPU
      kernels; interpreted on CPU, slowly), or None for the fastest one available on the
      device ("pallas" on a supported GPU, "xla" elsewhere; see gdp_jax/dispatch.py), with
      cu_seqlens too (the kernels' packed form, docs/varlen.md).
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
  implementation (docs/precision.md#non-finite-inputs; "pallas" through a guard that reads the
  inputs once); with cu_seqlens it spoils its own sequence only.

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
        f"to back in one row), got B = {batch} (q shape {_shape(q)})"
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
  implementation = dispatch.resolve(function, implementation)
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

  run = dispatch.entry(function, implementation)
  if cu_seqlens is not None:
    cu = jnp.asarray(cu_seqlens)
    if implementation == "reference":
      o, final = run(q, k, v, g, beta, mask5, initial_state, scale, cu)
    elif implementation == "pallas":
      extra = dict(options=options, backward=backward, precision=kernel_precision)
      o, final = run(q, k, v, g, beta, mask5, initial_state, scale, chunk_size, cu, **extra)
    else:
      o, final = run(q, k, v, g, beta, mask5, initial_state, scale, chunk_size, cu)
  elif implementation == "reference":
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
