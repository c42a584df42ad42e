"""Argument checks shared by the public functions of every op (docs/operator.md).

Below the public API modules (gdp_jax/ops/*/api.py), which call these; implementations never
import an api module. Each check raises a TypeError or ValueError that names the argument, its
shape and what was expected.
"""

from __future__ import annotations

import contextlib
import contextvars
import numbers

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

from pallas_kernels.common.options import KernelOptions

CHUNK_SIZES = (16, 32, 64)

# The value contract (docs/operator.md#values): the log-decay g <= 0 and the write strength beta in
# [0, 2]. Concrete arrays are checked on every call; traced ones only inside `value_checks()`.
BETA_RANGE = (0.0, 2.0)
_CHECK_TRACED = contextvars.ContextVar("gdp_jax_value_checks", default=False)


@contextlib.contextmanager
def value_checks():
  """Check traced g and beta too (under `jax.jit`, `jax.grad`, ...), through
  `jax.experimental.checkify`: calls traced inside this context add `checkify.check`s, so wrap
  the function in `checkify.checkify` and call `err.throw()` on its error:

    with gdp_jax.value_checks():
      err, out = jax.jit(checkify.checkify(f))(*args)
    err.throw()  # a ValueError-like JaxRuntimeError naming the argument when a value is bad
  """
  token = _CHECK_TRACED.set(True)
  try:
    yield
  finally:
    _CHECK_TRACED.reset(token)


def _check_range(name, x, low, high, what):
  """Every finite value of x in [low, high] (nan and inf are the non-finite contract's,
  docs/precision.md#non-finite-inputs)."""
  if isinstance(x, jax.core.Tracer):
    if _CHECK_TRACED.get():
      xf = x.astype(jnp.float32)
      ok = jnp.all(~jnp.isfinite(xf) | ((xf >= low) & (xf <= high)))
      checkify.check(ok, f"{name} holds finite values outside [{low:g}, {high:g}] ({what})")
    return
  values = np.asarray(jax.device_get(x), np.float32)
  bad = np.isfinite(values) & ((values < low) | (values > high))
  if bad.any():
    where = tuple(int(i) for i in np.argwhere(bad)[0])
    raise ValueError(
      f"{name}{list(where)} = {values[where]:g} is outside [{low:g}, {high:g}] ({what}); "
      f"{int(bad.sum())} value(s) of {name} (shape {shape_of(x)}) are"
    )


def check_gate_values(g, beta):
  """The value contract of g (log-decay <= 0; -inf is a reset) and beta (in [0, 2])."""
  if g is not None:
    _check_range("g", g, -np.inf, 0.0, "the log-decay: exp(g) is the state's decay")
  _check_range("beta", beta, *BETA_RANGE, "the write strength")


def shape_of(x):
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
      f"got {dtype} with shape {shape_of(x)}"
    )
  if jax.dtypes.canonicalize_dtype(dtype) == jnp.float64:
    raise TypeError(
      f"{name} is float64 (shape {shape_of(x)}): not supported, every "
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
  """None, a real number (-> float) or a scalar float array, traced ones included (-> float32).

  The scale must be finite and > 0 (nan makes every output nan, a negative one flips their
  sign): a number or a concrete array is checked here, a traced one inside `value_checks()`.
  """
  if scale is None:
    return None
  if isinstance(scale, (bool, np.bool_)) or isinstance(scale, (str, bytes)):
    raise TypeError(
      f"scale must be a number or a scalar float array, got {scale!r} ({type(scale).__name__})"
    )
  if isinstance(scale, numbers.Real):
    _check_scale_value(float(scale))
    return float(scale)
  dtype = getattr(scale, "dtype", None)
  if dtype is None or not (
    jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer)
  ):
    raise TypeError(
      f"scale must be a number or a scalar float array, got "
      f"{type(scale).__name__}" + (f" of dtype {dtype}" if dtype else "")
    )
  if shape_of(scale) != ():
    raise ValueError(
      f"scale must be a scalar (one output scale for every head), got shape {shape_of(scale)}"
    )
  if not isinstance(scale, jax.core.Tracer):
    _check_scale_value(float(np.asarray(jax.device_get(scale), np.float32)))
  elif _CHECK_TRACED.get():
    value = jnp.asarray(scale, jnp.float32)
    checkify.check(jnp.isfinite(value) & (value > 0), "scale must be finite and > 0")
  return jnp.asarray(scale, jnp.float32)


def _check_scale_value(value: float):
  if not (np.isfinite(value) and value > 0):
    raise ValueError(
      f"scale must be finite and > 0 (the output scale, default K ** -0.5), got {value:g}"
    )


def check_options(options):
  """None or a `pallas_kernels.common.options.KernelOptions` (a dict or a string is a
  TypeError on every implementation, not ignored)."""
  if options is not None and not isinstance(options, KernelOptions):
    raise TypeError(
      f"options must be None or a pallas_kernels.common.options.KernelOptions (the Pallas "
      f"kernels' precision and launch parameters), got {options!r} ({type(options).__name__})"
    )


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
  if shape_of(x) != tuple(expected):
    raise ValueError(f"{name} has shape {shape_of(x)}, expected {tuple(expected)} ({what})")


def normalize_mask(mask, batch, t_len, heads, dim_k):
  """Check a mask and return it as [Bm, Tm, Hm, r, r] plus r.

  Accepted: None (r = 1), [r, r] (shared), [H, r, r] (per head), [B, T, H, r, r] (per token).
  """
  if mask is None:
    return jnp.ones((1, 1, 1, 1, 1), jnp.float32), 1
  check_float("mask", mask)
  shape = shape_of(mask)
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
    raise ValueError(f"q must be [B, T, H, K] (rank 4), got shape {shape_of(q)}")
  batch, t_len, heads, dim_k = q.shape
  if dim_k < 1:
    raise ValueError(f"q has K = {dim_k} features (shape {shape_of(q)}); need K >= 1")
  check_shape("k", k, q.shape, "k must match q: [B, T, H, K]")
  if not grouped:
    if v.ndim != 4 or v.shape[:3] != q.shape[:3]:
      raise ValueError(
        f"v has shape {shape_of(v)}, expected [B, T, H, V] = "
        f"[{batch}, {t_len}, {heads}, V] (B, T, H as q)"
      )
  else:
    if v.ndim != 4 or v.shape[:2] != q.shape[:2]:
      raise ValueError(
        f"v has shape {shape_of(v)}, expected [B, T, HV, V] = "
        f"[{batch}, {t_len}, HV, V] (B, T as q; HV a multiple of H = {heads})"
      )
    if heads < 1 or v.shape[2] % heads != 0 or v.shape[2] < 1:
      raise ValueError(
        f"v has shape {shape_of(v)}, expected [B, T, H, V] = [{batch}, {t_len}, {heads}, V] or, "
        f"with grouped value heads, [B, T, HV, V] with HV a positive multiple of H = {heads} "
        f"(the key heads of q and k, shape {shape_of(q)}; value head i reads key head "
        f"i // (HV // H))"
      )
  heads_v = v.shape[2]
  h = "HV" if grouped else "H"
  if not (q.dtype == k.dtype == v.dtype):
    raise TypeError(f"q, k and v must share one dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
  if t_len < 1:
    raise ValueError(f"q has T = {t_len} tokens (shape {shape_of(q)}); need T >= 1")
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
  check_gate_values(g, beta)
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
      f"cu_seqlens must have an integer dtype (int32), got {dtype} with shape "
      f"{shape_of(cu_seqlens)}"
    )
  if len(shape_of(cu_seqlens)) != 1 or shape_of(cu_seqlens)[0] < 2:
    raise ValueError(
      f"cu_seqlens must be [N + 1] (rank 1, N >= 1 sequences: 0, the end of sequence 0, ..., "
      f"T), got shape {shape_of(cu_seqlens)}"
    )
  if not isinstance(cu_seqlens, jax.core.Tracer):
    cu_seqlens = np.asarray(cu_seqlens)
  return cu_seqlens, shape_of(cu_seqlens)[0] - 1


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


def step_mask(mask, batch, heads, dim_k):
  """Check a step mask and return it as [Bm, Hm, r, r] (Bm in {1, B}, Hm in {1, H}) plus r."""
  if mask is None:
    return jnp.ones((1, 1, 1, 1), jnp.float32), 1
  check_float("mask", mask)
  shape = tuple(mask.shape)
  if len(shape) == 4:
    if shape[:2] != (batch, heads):
      raise ValueError(
        f"mask has shape {shape}; a per-sequence mask must be [B, H, r, r] = "
        f"[{batch}, {heads}, r, r]"
      )
    mask5, r = normalize_mask(mask[:, None], batch, 1, heads, dim_k)
  elif len(shape) in (2, 3):
    mask5, r = normalize_mask(mask, batch, 1, heads, dim_k)
  else:
    raise ValueError(
      f"mask has shape {shape}; expected [r, r], [H, r, r] = [{heads}, r, r] "
      f"or [B, H, r, r] = [{batch}, {heads}, r, r]"
    )
  return mask5[:, 0], r


def check_step_inputs(q, k, v, g, beta, mask, state, grouped=False):
  """Validate the step's arguments; returns (B, HV, K, V, mask [Bm, Hm, r, r], r). grouped:
  allow HV value heads (v, g, beta, the mask, the state) for H key heads (q, k), HV % H == 0;
  without it HV must equal H."""
  for name, x in (("q", q), ("k", k), ("v", v)):
    check_float(name, x)
  if q.ndim != 3:
    raise ValueError(
      f"q must be [B, H, K] (rank 3: one token per sequence), got shape {shape_of(q)}"
    )
  batch, heads, dim_k = q.shape
  check_shape("k", k, q.shape, "k must match q: [B, H, K]")
  if not grouped:
    if v.ndim != 3 or tuple(v.shape[:2]) != (batch, heads):
      raise ValueError(
        f"v has shape {shape_of(v)}, expected [B, H, V] = [{batch}, {heads}, V] (B, H as q)"
      )
  else:
    if v.ndim != 3 or v.shape[0] != batch:
      raise ValueError(
        f"v has shape {shape_of(v)}, expected [B, HV, V] = [{batch}, HV, V] (B as q; HV "
        f"a multiple of H = {heads})"
      )
    if heads < 1 or v.shape[1] < 1 or v.shape[1] % heads != 0:
      raise ValueError(
        f"v has shape {shape_of(v)}, expected [B, H, V] = [{batch}, {heads}, V] or, with "
        f"grouped value heads, [B, HV, V] with HV a positive multiple of H = {heads} (the key "
        f"heads of q and k, shape {shape_of(q)}; value head i reads key head i // (HV // H))"
      )
  heads_v = v.shape[1]
  h = "HV" if grouped else "H"
  if not (q.dtype == k.dtype == v.dtype):
    raise TypeError(f"q, k and v must share one dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
  dim_v = v.shape[-1]
  if beta is None:
    raise ValueError(f"beta is required: the write strength, shape [B, {h}] = [{batch}, {heads_v}]")
  check_float("beta", beta)
  check_shape("beta", beta, (batch, heads_v), f"[B, {h}] as v")
  if g is not None:
    check_float("g", g)
    check_shape("g", g, (batch, heads_v), f"[B, {h}] as v: the log-decay")
  check_gate_values(g, beta)
  mask4, r = step_mask(mask, batch, heads_v, dim_k)
  if state is not None:
    check_float("state", state)
    check_shape("state", state, (batch, heads_v, dim_k, dim_v), f"[B, {h}, K, V]")
  return batch, heads_v, dim_k, dim_v, mask4, r


def static_scale(scale, default):
  """(Python float, None) for a static scale, or (1.0, array) for a traced/array scale."""
  scale = check_scale(scale)
  if scale is None:
    return float(default), None
  if isinstance(scale, float):
    return scale, None
  return 1.0, scale


def check_state_every(state_every, chunk_size):
  """None, or the block of `gated_delta_product(..., state_every=N)`: a positive multiple of
  chunk_size (docs/operator.md#block-boundary-states)."""
  if state_every is None:
    return None
  if isinstance(state_every, (bool, np.bool_)) or not isinstance(state_every, (int, np.integer)):
    raise TypeError(
      f"state_every must be None or an int (a positive multiple of chunk_size = {chunk_size}), "
      f"got {state_every!r} ({type(state_every).__name__})"
    )
  if state_every <= 0 or state_every % chunk_size:
    raise ValueError(
      f"state_every must be a positive multiple of chunk_size = {chunk_size} (the chunked "
      f"forms' chunk: states are taken at chunk boundaries; a smaller chunk_size allows "
      f"finer blocks), got {state_every}"
    )
  return int(state_every)
