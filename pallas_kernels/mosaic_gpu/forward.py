"""The Mosaic GPU forward: input preparation (XLA) and the two kernels
(docs/mosaic_gpu.md#the-forward-in-two-kernels).

`forward(q, k, v, g, beta, mask, ...)` takes the operator's arguments (docs/operator.md, shapes
`[B, T, H, ...]`) and returns `(o, final_state)`. It pads the time axis to whole chunks with no-op
tokens and the value axis to whole 64-column tiles (docs/chunked_form.md#padding), forms the
chunk-local cumulative log-decay `gamma` (docs/chunked_form.md#gamma) and the mask rows the
kernels read, then runs `chunk_inverse` and `state_walk_ws`. `householder_forward` does the same
for the Householder form (n_h sub-steps per token, `householder_delta_product`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels.common.gates import RESET_LOG_DECAY
from pallas_kernels.mosaic_gpu.chunk_inverse import chunk_inverse
from pallas_kernels.mosaic_gpu.common import (
  F32,
  ROWS_PER_CHUNK,
  SUPPORTED_DIMS,
  SUPPORTED_DTYPES,
  chunk_tokens,
)
from pallas_kernels.mosaic_gpu.walk_ws import state_walk_ws

N = ROWS_PER_CHUNK
BLOCK_V = 64


def mask_rows(mask: jax.Array | None, batch: int, t_len: int, heads: int, padded: int, r: int):
  """The mask as the kernels read it: `[Bm, Hm, NCm, r, N]` float32, entry `[.., d, (a, t)]` is
  `M_t[a, d]` for block-major row `(a, t)` of a chunk (`common.py`)."""
  c = chunk_tokens(r)
  if mask is None:
    return jnp.ones((1, 1, 1, 1, N), F32)
  m = mask.astype(F32)
  if m.ndim == 2:  # [r, r] shared
    return jnp.broadcast_to(m.T[:, :, None], (r, r, c)).reshape(1, 1, 1, r, N)
  if m.ndim == 3:  # [H, r, r] per head
    rows = jnp.broadcast_to(jnp.swapaxes(m, 1, 2)[..., None], (heads, r, r, c))
    return rows.reshape(1, heads, 1, r, N)
  # [B, T, H, r, r] per token: no-op tokens of the padding get a zero mask.
  m = jnp.pad(m, [(0, 0), (0, padded - t_len), (0, 0), (0, 0), (0, 0)])
  m = m.reshape(batch, padded // c, c, heads, r, r)  # [B, NC, t, H, a, d]
  m = jnp.transpose(m, (0, 3, 1, 5, 4, 2))  # [B, H, NC, d, a, t]
  return m.reshape(batch, heads, padded // c, r, N)


def block_rows(x_hm: jax.Array, r: int) -> jax.Array:
  """`[B, H, Tp]` per-token values to `[B, H, NC * N]`: entry `(a, t)` of each chunk's block-major
  rows is the value of token `t` (`common.py`)."""
  batch, heads, padded = x_hm.shape
  c = chunk_tokens(r)
  x = x_hm.reshape(batch, heads, padded // c, 1, c)
  return jnp.broadcast_to(x, (batch, heads, padded // c, r, c)).reshape(batch, heads, padded * r)


def check_inputs(q, k, v, g, beta, mask, initial_state) -> int:
  """Validates the arguments; returns r."""
  if q.ndim != 4 or k.shape != q.shape:
    raise ValueError(f"q, k: shapes {q.shape}, {k.shape}, expected one [B, T, H, K]")
  batch, t_len, key_heads, key_dim = q.shape
  if v.ndim != 4 or v.shape[:2] != (batch, t_len) or v.shape[2] % key_heads:
    raise ValueError(
      f"v: shape {v.shape}, expected [B, T, H, V] = [{batch}, {t_len}, H, V] with H a multiple "
      f"of the {key_heads} key heads"
    )
  heads = v.shape[2]
  if q.dtype != k.dtype or q.dtype != v.dtype or jnp.dtype(q.dtype) not in SUPPORTED_DTYPES:
    raise TypeError(f"q, k, v: dtypes {q.dtype}, {k.dtype}, {v.dtype}: one of bfloat16, float16")
  for name, x in (("g", g), ("beta", beta)):
    if x is not None and x.shape != (batch, t_len, heads):
      raise ValueError(f"{name}: shape {x.shape}, expected {(batch, t_len, heads)}")
  if beta is None:
    raise ValueError("beta: required")
  r = 1 if mask is None else mask.shape[-1]
  chunk_tokens(r)
  if mask is not None and mask.shape not in ((r, r), (heads, r, r), (batch, t_len, heads, r, r)):
    raise ValueError(f"mask: shape {mask.shape}, expected [r, r], [H, r, r] or [B, T, H, r, r]")
  if key_dim % r or key_dim not in SUPPORTED_DIMS:
    raise ValueError(f"q, k: K={key_dim} must be 64 or 128 and a multiple of r={r}")
  if initial_state is not None and initial_state.shape != (batch, heads, key_dim, v.shape[-1]):
    raise ValueError(f"initial_state: shape {initial_state.shape}, expected [B, H, K, V]")
  return r


@dataclasses.dataclass(frozen=True)
class Operands:
  """The inputs as the kernels read them (`prepare`)."""

  q: jax.Array  # [B, Tp, Hk, K]
  k: jax.Array
  v: jax.Array | None  # [B, Tp, H, Vp]
  gamma: jax.Array  # [B, H, Tp] float32, chunk-local cumulative log-decay
  gamma_rows: jax.Array  # [B, H, NC * N] float32 per block-major row
  beta_rows: jax.Array
  mask_rows: jax.Array  # [Bm, Hm, NCm, r, N] float32
  scale: jax.Array  # [4] float32, the scale in entry 0
  padded: int  # Tp
  value_padded: int  # Vp


def pad_axes(x: jax.Array, time: int, last: int = 0) -> jax.Array:
  """x with `time` zero rows after axis 1 and `last` zero columns after the last axis."""
  widths = [(0, 0)] * x.ndim
  widths[1] = (0, time)
  if last:
    widths[-1] = (0, last)
  return jnp.pad(x, widths) if time or last else x


def state_t(initial_state: jax.Array | None, value_padded: int) -> jax.Array | None:
  """The initial state `[B, H, K, V]` as the walk takes it: transposed, float32, V padded to
  `value_padded` columns (or None)."""
  if initial_state is None:
    return None
  h0_t = jnp.swapaxes(initial_state.astype(F32), 2, 3)  # [B, H, V, K]
  extra = value_padded - h0_t.shape[2]
  return jnp.pad(h0_t, [(0, 0), (0, 0), (0, extra), (0, 0)]) if extra > 0 else h0_t


def chunk_gamma(g, shape, padded: int, c: int) -> jax.Array:
  """`[B, H, Tp]` float32: the chunk-local cumulative log-decay of g `[B, T, H]` (or None: zeros)
  over chunks of `c` tokens, after the padding (docs/chunked_form.md#gamma)."""
  batch, t_len, heads = shape
  g32 = jnp.zeros(shape, F32) if g is None else g.astype(F32)
  g32 = jnp.maximum(g32, RESET_LOG_DECAY)  # keeps gamma finite: docs/chunked_form.md#resets
  g_hm = jnp.swapaxes(pad_axes(g32, padded - t_len), 1, 2)  # [B, H, Tp]
  return jnp.cumsum(g_hm.reshape(batch, heads, padded // c, c), axis=-1).reshape(g_hm.shape)


def prepare(q, k, v, g, beta, mask, scale) -> Operands:
  """Pads the time axis to whole chunks with no-op tokens and V to whole 64-column tiles
  (docs/chunked_form.md#padding) and forms gamma (docs/chunked_form.md#gamma), the per-row
  gates and the mask rows. v may be None (the backward reads do instead)."""
  r = 1 if mask is None else mask.shape[-1]
  batch, t_len, _, key_dim = q.shape
  heads = beta.shape[2]
  c = chunk_tokens(r)
  padded = -(-t_len // c) * c
  pt = padded - t_len
  vp = 0
  if v is not None:
    vp = -(-v.shape[-1] // BLOCK_V) * BLOCK_V
    v = pad_axes(v, pt, vp - v.shape[-1])
  gamma = chunk_gamma(g, (batch, t_len, heads), padded, c)
  beta_hm = jnp.swapaxes(pad_axes(beta.astype(F32), pt), 1, 2)
  if scale is None:
    scale = key_dim**-0.5
  return Operands(
    q=pad_axes(q, pt),
    k=pad_axes(k, pt),
    v=v,
    gamma=gamma,
    gamma_rows=block_rows(gamma, r),
    beta_rows=block_rows(beta_hm, r),
    mask_rows=mask_rows(mask, batch, t_len, heads, padded, r),
    scale=jnp.broadcast_to(jnp.asarray(scale, F32), (4,)),
    padded=padded,
    value_padded=vp,
  )


def forward(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  g: jax.Array | None,
  beta: jax.Array,
  mask: jax.Array | None = None,
  *,
  scale: float | jax.Array | None = None,
  initial_state: jax.Array | None = None,
  output_final_state: bool = False,
  return_inverse: bool = False,
  store_states: bool = False,
  seq_table: jax.Array | None = None,
  pieces: jax.Array | None = None,
  guard_marks: jax.Array | None = None,
  state_every_chunks: int | None = None,
  transitions: bool = False,
  interpret=None,
):
  """`o [B, T, H, V]` (dtype of q) and the final state `[B, H, K, V]` float32 (or None); with
  `return_inverse` also the chunks' gate-free inverses T0 `[B, H, NC * N, N]` (`chunk_inverse`,
  block-major rows; the Triton backward's residual, gdp_jax/ops/gated_delta_product/mosaic_gpu.py);
  with `store_states` (T a multiple of the chunk, V of 64) after them the per-chunk states and
  v_new, transposed (`state_walk_ws`): the residuals of the Mosaic backward (`backward.py`).

  seq_table: None, or packed sequences in the chunk-aligned padded layout (B = 1, docs/varlen.md):
    int32 `[N, 4]` (first chunk, chunk count, 0, 0) per sequence (`state_walk_ws`); the initial and
    final states are then `[N, H, K, V]`.
  pieces: None, or with seq_table the packed row read in place (docs/mosaic_gpu.md
    #packed-sequences-in-place): the bounds `[S]` int32, the table's rows pieces
    (`state_walk_ws`); the "final states" `[S, H, K, V]` the states entering each bound.
  guard_marks: None, or the non-finite guard in the kernels' loads (unpacked rows;
    docs/mosaic_gpu.md#the-guard-in-the-loads): `[B, T, H]` bool, the tokens whose output is to be
    nan (nonfinite.py's `Marks.o`); the kernels clean k and v as they land.
  state_every_chunks: None, or e: last, the float32 state after every e chunks `[B, H, NC // e,
    K, V]` (unpacked rows; `state_walk_ws`).
  transitions: with pieces cut inside sequences (pieces.split_table), also the pieces'
    transitions (`state_walk_ws`): the initial state `[P, H, K, V + K]` per piece, the slots'
    states with V + K columns; then returns `(o, slots, o_id [H, Tp, K], the state after each
    piece [P, H, K, V + K])`.
  interpret: None on an sm_90 GPU, or `plgpu.InterpretGPUParams()` for the Mosaic GPU interpreter.
    The interpreter runs the walk's three warpgroups as threads of XLA's CPU client: on a machine
    with fewer than 3 cores set NPROC (for example NPROC=8) before jax starts, or they starve.
  """
  check_inputs(q, k, v, g, beta, mask, initial_state if seq_table is None else None)
  t_len, value_dim = q.shape[1], v.shape[-1]
  ops = prepare(q, k, v, g, beta, mask, scale)
  vp = ops.value_padded
  if store_states and (ops.padded != t_len or vp != value_dim):
    raise ValueError(f"store_states: T={t_len} and V={value_dim} must be whole chunks and tiles")
  h0_t = state_t(initial_state, vp)
  assert ops.v is not None  # prepare was given v
  if guard_marks is not None and seq_table is not None and pieces is None:
    raise ValueError("guard_marks: one row (chunk-aligned packed rows are cleaned by the caller)")
  marks = None
  if guard_marks is not None:  # [B, T, H] -> [B, H, Tp] float32, the padding unmarked
    marks = jnp.swapaxes(pad_axes(guard_marks.astype(F32), ops.padded - t_len), 1, 2)
  clean = marks is not None
  t0 = chunk_inverse(ops.k, ops.beta_rows, ops.mask_rows, clean=clean, interpret=interpret)
  o, s_t, *states = state_walk_ws(
    ops.q,
    ops.k,
    ops.v,
    t0,
    ops.gamma,
    ops.gamma_rows,
    ops.beta_rows,
    ops.mask_rows,
    ops.scale,
    h0_t,
    block_v=BLOCK_V,
    output_final_state=output_final_state,
    store_states=store_states,
    seq_table=seq_table,
    pieces=pieces,
    marks=marks,
    state_every_chunks=state_every_chunks,
    transitions=transitions,
    interpret=interpret,
  )
  o = o[:, :t_len, :, :value_dim]
  if transitions:  # V and K need no padding (SUPPORTED_DIMS)
    o_id, ends_t = states
    return o, jnp.swapaxes(s_t, 2, 3), o_id, jnp.swapaxes(ends_t, 2, 3)
  final = None
  if s_t is not None:
    final = jnp.swapaxes(s_t, 2, 3)[..., :value_dim]
  if state_every_chunks is not None:  # the block states, back to [B, H, J, K, V]
    states[-1] = jnp.swapaxes(states[-1], -1, -2)[..., :value_dim]
  extra = ((t0,) if return_inverse else ()) + tuple(states)
  return (o, final, *extra) if extra else (o, final)


def householder_forward(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  g: jax.Array | None,
  beta: jax.Array,
  *,
  scale: float | jax.Array | None = None,
  initial_state: jax.Array | None = None,
  output_final_state: bool = False,
  seq_table: jax.Array | None = None,
  pieces: jax.Array | None = None,
  interpret=None,
):
  """The Householder form's forward on the Mosaic GPU kernels: `(o [B, T, H, V], final state
  [B, H, K, V] float32 or None)`; with `seq_table` and `pieces` the packed row read in place as
  `forward`'s (B = 1; the "final states" `[S, H, K, V]` the states entering each bound).

  q `[B, T, Hk, K]`, g `[B, T, H]` (or None) one row per token; k `[B, T n_h, Hk, K]`, v
  `[B, T n_h, H, V]`, beta `[B, T n_h, H]` the `n_h` sub-steps of every token, sub-step `a` of
  token `t` at `t n_h + a` (flash-linear-attention's `chunk_gated_delta_product` layout). The
  kernels take the sub-steps as the `r = n_h` rows of a token (`chunk_inverse`, `walk_ws`): chunks
  of `64 / n_h` tokens, the sub-steps never laid out as tokens of their own.
  """
  batch, t_len, key_heads, key_dim = q.shape
  heads, value_dim = v.shape[2], v.shape[-1]
  n_h = k.shape[1] // t_len
  c = chunk_tokens(n_h)
  if k.shape != (batch, t_len * n_h, key_heads, key_dim) or v.shape[:2] != k.shape[:2]:
    raise ValueError(f"k, v: shapes {k.shape}, {v.shape}, expected [B, T n_h, H, .], T = {t_len}")
  if q.dtype != k.dtype or q.dtype != v.dtype or jnp.dtype(q.dtype) not in SUPPORTED_DTYPES:
    raise TypeError(f"q, k, v: dtypes {q.dtype}, {k.dtype}, {v.dtype}: one of bfloat16, float16")
  if key_dim not in SUPPORTED_DIMS:
    raise ValueError(f"q, k: K={key_dim} must be 64 or 128")
  padded = -(-t_len // c) * c
  pt = padded - t_len
  vp = -(-value_dim // BLOCK_V) * BLOCK_V
  k5 = pad_axes(k.reshape(batch, t_len, n_h, key_heads, key_dim), pt)
  v5 = pad_axes(v.reshape(batch, t_len, n_h, heads, value_dim), pt, vp - value_dim)
  gamma = chunk_gamma(g, (batch, t_len, heads), padded, c)
  # beta per block-major row (a, t): sub-step a of token t
  beta_hm = pad_axes(beta.astype(F32).reshape(batch, t_len, n_h, heads), pt)
  beta_rows = jnp.transpose(beta_hm.reshape(batch, padded // c, c, n_h, heads), (0, 4, 1, 3, 2))
  beta_rows = beta_rows.reshape(batch, heads, padded * n_h)
  ones = jnp.ones((1, 1, 1, n_h, N), F32)  # no mask: its rows only say r
  if scale is None:
    scale = key_dim**-0.5
  h0_t = state_t(initial_state, vp)
  t0 = chunk_inverse(k5, beta_rows, ones, interpret=interpret)
  o, s_t = state_walk_ws(
    pad_axes(q, pt),
    k5,
    v5,
    t0,
    gamma,
    block_rows(gamma, n_h),
    beta_rows,
    ones,
    jnp.broadcast_to(jnp.asarray(scale, F32), (4,)),
    h0_t,
    block_v=BLOCK_V,
    output_final_state=output_final_state,
    seq_table=seq_table,
    pieces=pieces,
    interpret=interpret,
  )
  o = o[:, :t_len, :, :value_dim]
  final = None if s_t is None else jnp.swapaxes(s_t, 2, 3)[..., :value_dim]
  return o, final
