"""`implementation="triton"`: the chunked form (docs/chunked_form.md) as Pallas kernels through the
Triton lowering (pallas_kernels/triton/, docs/kernels.md), one `jax.custom_vjp` for the plain and
the packed form.

Here the inputs are also padded in the feature axes so every tile is a power of two of at least
16 (zeros change nothing), and the kernels chunk BT = min(chunk_size, 64 // r) tokens, at least 16.
The forward is two fused kernels (chunk_fwd, chunk_state_output); a call without gradient writes
neither the inverses nor the states. The backward recomputes w, u, h and v_new from the residuals
gamma and Ai. Grouped value heads are read through the kernels' index maps (dq, dk summed per
group). Packed sequences (docs/varlen.md): the forward reads the packed row in place, the backward
gathers into the chunk-aligned layout. Non-finite inputs (docs/precision.md#non-finite-inputs):
a guard runs the kernels once on cleaned inputs and marks the spoiled outputs (`_gdp_guarded`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from gdp_jax.ops.autodiff import raise_if_differentiated, raise_if_forward_mode
from gdp_jax.ops.gated_delta_product import nonfinite, varlen, xla_backward
from gdp_jax.ops.gated_delta_product.base import GatedDeltaProductImplementation, packed_states
from gdp_jax.ops.gated_delta_product.xla_backward import reduce_dmask
from gdp_jax.ops.heads import sum_key_heads
from gdp_jax.ops.once import jitted_kernels
from pallas_kernels.common import cumsum
from pallas_kernels.common import options as kernel_options
from pallas_kernels.common.options import MAX_CHUNK_ROWS, KernelOptions
from pallas_kernels.triton.backward import bwd_dhu, bwd_dqkwg, bwd_dv_local, bwd_wy
from pallas_kernels.triton.forward import chunk_fwd, chunk_h, chunk_state_output, wy

NO_HIGHER_DERIVATIVES = (
  "gated_delta_product with implementation='pallas' supports reverse-mode first derivatives "
  "only (jax.grad, jax.vjp, jax.value_and_grad: its backward is a custom_vjp of Pallas "
  "kernels); forward mode (jax.jvp, jax.jacfwd, jax.linearize) and second or higher "
  "derivatives (jax.hessian, a grad of a grad) need implementation='xla' (or 'reference'), "
  "which JAX differentiates directly"
)


def pallas_chunk(chunk_size: int, r: int) -> int:
  """Tokens per chunk the kernels use for a requested chunk size and r key blocks."""
  return max(16, min(chunk_size, MAX_CHUNK_ROWS // r))


def padded_dims(dim_k: int, dim_v: int, r: int) -> tuple[int, int]:
  """(dkp, Vp): each key block and the value dimension padded to a power of two >= 16."""
  return (max(16, pl.next_power_of_2(dim_k // r)), max(16, pl.next_power_of_2(dim_v)))


def pad_key_blocks(x, r, dkp):
  """[..., K] -> [..., r * dkp]: zero-pad each of the r key blocks to dkp columns."""
  dk = x.shape[-1] // r
  if dk == dkp:
    return x
  x = x.reshape(x.shape[:-1] + (r, dk))
  x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, dkp - dk)])
  return x.reshape(x.shape[:-2] + (r * dkp,))


def unpad_key_blocks(x, r, dk, axis):
  """Inverse of pad_key_blocks along `axis`."""
  dkp = x.shape[axis] // r
  if dk == dkp:
    return x
  x = jnp.moveaxis(x, axis, -1)
  x = x.reshape(x.shape[:-1] + (r, dkp))[..., :dk]
  return jnp.moveaxis(x.reshape(x.shape[:-2] + (r * dk,)), -1, axis)


def _pad_last(x, size):
  if x.shape[-1] == size:
    return x
  return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, size - x.shape[-1])])


def _fused_forward(q, k, v, g, beta, mask, h0, scale, bt, opts, save_ai, chunk_kw, walk_kw):
  """The fused forward's two kernels (chunk_fwd, then chunk_state_output), with chunk_kw and
  walk_kw passed to each (packed sequences: their tables). Returns (o, final, (gcum, ai))."""
  r = mask.shape[-1]
  prec = dict(precision=opts.precision)
  g_hm = jnp.moveaxis(g.astype(jnp.float32), 1, 2)  # [B, H, Tp]
  beta_hm = jnp.moveaxis(beta.astype(jnp.float32), 1, 2)
  out = chunk_fwd.chunk_fwd(
    k,
    v,
    g_hm,
    beta_hm,
    mask,
    save_ai=save_ai,
    inverse=opts.chunk_fwd_inverse,
    launch=opts.chunk_fwd,
    chunk=bt,
    key_blocks=r,
    **chunk_kw,
    **prec,
  )
  gcum, w, u = out[:3]
  o, final = chunk_state_output.chunk_state_output(
    q,
    k,
    w,
    u,
    gcum,
    h0,
    scale=scale,
    launch=opts.chunk_state_output,
    chunk=bt,
    key_blocks=r,
    **walk_kw,
    **prec,
  )
  return o, final, (gcum, out[3] if save_ai else None)


def _forward_kernels(q, k, v, g, beta, mask, h0, packing, scale, bt, opts, save_ai):
  """The forward kernels on feature-padded inputs. Returns (o, final, (gcum, ai)); ai is None
  without save_ai (a call without gradient). q and k may have fewer (key) heads than v (grouped
  value heads). packing: None, or packed sequences (`_Packing`): the inputs are then the packed
  row [1, T, ...], which chunk_fwd reads in place at each chunk's first token
  (`packing.chunks`) and chunk_state_output at each sequence's (`packing.sequences`), both with
  masked loads, and chunk_state_output writes o there; gcum and ai come back in the
  chunk-aligned layout and only a per-token mask is gathered into it."""
  if packing is None:
    return _fused_forward(q, k, v, g, beta, mask, h0, scale, bt, opts, save_ai, {}, {})
  mask = _pack_mask(mask, packing)
  chunks = dict(table=packing.chunks)
  walk = dict(table=packing.sequences, in_place=True)
  return _fused_forward(q, k, v, g, beta, mask, h0, scale, bt, opts, save_ai, chunks, walk)


# ---- the kernels' custom_vjp: one for the plain and the packed form --------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9, 10))
def _gdp_core(q, k, v, g, beta, mask, h0, packing, scale, bt, opts):
  o, final, _ = _forward(q, k, v, g, beta, mask, h0, packing, scale, bt, opts, False)
  return o, final


def _gdp_core_fwd(q, k, v, g, beta, mask, h0, packing, scale, bt, opts):
  # Residuals: the inputs as they came (the caller holds them anyway; q and k with their H key
  # heads; the packed row itself, no chunk-aligned copies), gamma ([B, HV, Tp] float32) and the
  # chunk inverses Ai ([B, HV, Tp*r, N] in the input dtype: as much memory as one [B, T, HV, N]
  # activation), both in the chunk-aligned layout, and the packing. The backward recomputes w, u
  # (wy.py) and h, v_new (chunk_h.py) from them.
  forward = raise_if_differentiated(
    lambda *a: _forward(*a, packing, scale, bt, opts, True), NO_HIGHER_DERIVATIVES
  )
  o, final, saved = forward(q, k, v, g, beta, mask, h0)
  return (o, final), (q, k, v, g, beta, mask, h0, saved, packing)


def _gdp_core_bwd(scale, bt, opts, residuals, cotangents):
  *residuals, packing = residuals
  if packing is None:
    backward = raise_if_differentiated(
      functools.partial(_backward, scale, bt, opts), NO_HIGHER_DERIVATIVES
    )
    return (*backward(tuple(residuals), cotangents), None)
  q, k, v, g, beta, mask, h0, (gcum, ai) = residuals
  do, dfinal = cotangents
  # the backward kernels work on the chunk-aligned layout: gather the inputs and do into it, and
  # the gradients of the token arrays back to the packed row
  pack = functools.partial(_pack_padded, packing=packing)
  unpack = functools.partial(_unpack_padded, packing=packing)
  padded = (*map(pack, (q, k, v, g, beta)), _pack_mask(mask, packing), h0, (gcum, ai))
  backward = raise_if_differentiated(
    lambda res, cot: _backward(scale, bt, opts, res, cot, table=packing.sequences),
    NO_HIGHER_DERIVATIVES,
  )
  # an empty sequence's initial state is its final state: the walks return its dfinal as its
  # gradient (pallas_kernels/common/packed.py)
  dq, dk, dv, dg, dbeta, dmask, dh0 = backward(padded, (pack(do), dfinal))
  if mask.shape[1] != 1:
    dmask = unpack(dmask)
  return (*map(unpack, (dq, dk, dv, dg, dbeta)), dmask, dh0, None)


def _backward_kernels(scale, bt, opts, residuals, cotangents, table=None):
  """The backward kernels. residuals: the inputs and what the forward saved, `(gcum, ai)`;
  table: the packed sequences' walk table (the residuals then in the chunk-aligned layout)."""
  q, k, v, g, beta, mask, h0, (gcum, ai) = residuals
  do, dfinal = cotangents
  # Grouped value heads: the backward kernels run over the HV value heads and read q and k at key
  # head h // group through their index maps; dq, dk come per value head, summed over each group.
  key_heads, key_dtypes = q.shape[2], (q.dtype, k.dtype)
  r = mask.shape[-1]
  common = dict(chunk=bt, key_blocks=r)
  prec = dict(precision=opts.precision)
  # packed sequences: the table goes to the state walks only
  walk = dict(common) if table is None else dict(common, table=table)
  beta_hm = jnp.moveaxis(beta.astype(jnp.float32), 1, 2)
  w, u = wy.recompute_w_u(k, v, beta_hm, mask, gcum, ai, launch=opts.wy, **common, **prec)
  h, v_new, _ = chunk_h.chunk_state(k, w, u, gcum, h0, launch=opts.chunk_h, **walk, **prec)
  dv_local = bwd_dv_local.chunk_bwd_dv_local(
    q, k, gcum, do, scale=scale, launch=opts.bwd_dv_local, out_dtype=do.dtype, **common, **prec
  )
  dh, dh0, dv_new = bwd_dhu.chunk_bwd_dhu(
    q,
    k,
    w,
    gcum,
    do,
    dv_local,
    dfinal.astype(jnp.float32),
    scale=scale,
    dh_dtype=q.dtype,
    launch=opts.bwd_dhu,
    **walk,
    **prec,
  )
  # Without grouped heads the kernels store dq, dk (bwd_wy adds bwd_dqkwg's part) and dv in the
  # input dtypes; grouped, dq and dk stay float32 for the sum over each group.
  grouped = key_heads != v.shape[2]
  dq, dk1, dw, dg1 = bwd_dqkwg.chunk_bwd_dqkwg(
    q,
    k,
    v_new,
    gcum,
    h,
    dh,
    do,
    dv_new,
    scale=scale,
    launch=opts.bwd_dqkwg,
    dq_dtype=jnp.float32 if grouped else key_dtypes[0],
    **common,
    **prec,
  )
  dk, dv, dbeta, dmask_tok, dg2 = bwd_wy.wy_bwd(
    k,
    v,
    beta_hm,
    mask,
    gcum,
    ai,
    dw,
    dv_new,
    launch=opts.bwd_wy,
    dk_in=dk1,
    dk_dtype=jnp.float32 if grouped else key_dtypes[1],
    dv_dtype=v.dtype,
    **common,
    **prec,
  )
  dg = cumsum.chunk_local_cumsum(dg1 + dg2, bt, reverse=True)
  dmask = reduce_dmask(dmask_tok, mask.shape)
  time_major = lambda x: jnp.moveaxis(x, 1, 2)  # [B, H, Tp] -> [B, Tp, H]
  if grouped:
    dq, dk = (sum_key_heads(d, key_heads) for d in (dq, dk))
  return (
    dq.astype(key_dtypes[0]),
    dk.astype(key_dtypes[1]),
    dv.astype(v.dtype),
    time_major(dg).astype(g.dtype),
    time_major(dbeta).astype(beta.dtype),
    dmask.astype(mask.dtype),
    dh0.astype(h0.dtype),
  )


# one lowering of each kernel per distinct call (a model's layers: docs/train_lm.md#compile-time)
_forward = jitted_kernels(_forward_kernels, static_argnums=(8, 9, 10, 11))
_backward = jitted_kernels(_backward_kernels, static_argnums=(0, 1, 2))
_gdp_core.defvjp(_gdp_core_fwd, _gdp_core_bwd)


# ---- non-finite inputs (docs/precision.md#non-finite-inputs) ---------------------------------
#
# Inside a chunk the kernels' products mix all its tokens, and 0 * nan = nan would carry a bad
# token to the earlier ones (forward and backward). The guard therefore always runs the kernels
# on cleaned inputs (every non-finite entry 0, a nan or +inf g 0) and marks the outputs from the
# first bad token of each batch row and head on (and the final state) with nan afterwards
# (gdp_jax/ops/gated_delta_product/nonfinite.py); the backward zeroes the marked outputs'
# cotangents before the kernels' backward (a call without gradient keeps q as it is: a bad q
# spoils its own token's output only). Selects only, no `lax.cond`: each kernel appears once
# per call site (one compilation), and on finite inputs the selects change no value, so the
# result is the unguarded kernels' bit for bit. The residuals are the kernels' own (on the
# cleaned inputs) plus the marks ([B, T, H] and [B, H] booleans). The gradient of a bad entry is
# exactly 0 without a select: every output it reaches is marked, so every product that carries
# it to an input has a zero cotangent factor (and the cleaned operands are finite).
#
# `KernelOptions.nonfinite_guard` (default True) turns the guard on.


def _cleaner(packing):
  """The guard's `clean` for the plain form, or per sequence for packed sequences."""
  if packing is None:  # the kernels run per device: their inputs are whole here
    return functools.partial(nonfinite.clean, local=True)
  return _packed_cleaner(packing)


@functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9, 10))
def _gdp_guarded(q, k, v, g, beta, mask, h0, packing, scale, bt, opts):
  """`_gdp_core` causal under non-finite inputs (the section's comment); per sequence with
  packed sequences."""
  cleaned, marks = _cleaner(packing)(q, k, v, g, beta, mask)
  # Without a gradient q stays as it is (one select pass less): a bad q spoils only its own
  # token's output, which is marked anyway (the backward needs it clean: `_gdp_guarded_fwd`).
  o, final = _gdp_core(q, *cleaned[1:], h0, packing, scale, bt, opts)
  return nonfinite.mark(o, final, marks)


def _gdp_guarded_fwd(q, k, v, g, beta, mask, h0, packing, scale, bt, opts):
  cleaned, marks = _cleaner(packing)(q, k, v, g, beta, mask)
  (o, final), residuals = _gdp_core_fwd(*cleaned, h0, packing, scale, bt, opts)
  return nonfinite.mark(o, final, marks), (residuals, marks)


def _gdp_guarded_bwd(scale, bt, opts, residuals, cotangents):
  residuals, marks = residuals
  cotangents = nonfinite.mark_cotangents(*cotangents, marks)
  return _gdp_core_bwd(scale, bt, opts, residuals, cotangents)


_gdp_guarded.defvjp(_gdp_guarded_fwd, _gdp_guarded_bwd)


# ---- packed sequences (cu_seqlens, docs/varlen.md) -------------------------------------------


class _Packing(NamedTuple):
  """Packed sequences at the kernels' chunk (docs/varlen.md): the chunk-aligned layout and the
  kernels' tables (int arrays; no gradient)."""

  layout: varlen.Layout
  sequences: jax.Array  # [4, N], `varlen.sequence_chunks`: the state walks' table
  chunks: jax.Array  # [2, NT], `varlen.chunk_tokens`: chunk_fwd's table in place


def _packing(cu_seqlens, t_len, bt):
  lay = varlen.layout(cu_seqlens, t_len, bt)
  return _Packing(lay, varlen.sequence_chunks(lay), varlen.chunk_tokens(lay))


def _pack_padded(x, packing):
  """[1, T, ...] -> its chunk-aligned copy [1, Tp, ...] (a gather)."""
  return varlen.pack(x, packing.layout)


def _unpack_padded(y, packing):
  """[1, Tp, ...] -> the packed row [1, T, ...] (a gather)."""
  return varlen.unpack(y, packing.layout)


def _pack_mask(mask, packing):
  """A per-token mask [1, T, ...] in the chunk-aligned layout (the kernels read it per chunk);
  a broadcast one as it is."""
  return mask if mask.shape[1] == 1 else _pack_padded(mask, packing)


def _packed_cleaner(packing):
  """`varlen.clean` on the packed row: a bad token marks its own sequence from it on and that
  sequence's final state (never an empty sequence's)."""
  return lambda *inputs: varlen.clean(*inputs, packing.layout.cu_seqlens)


# ---- the entry points ------------------------------------------------------------------------


def gated_delta_product_pallas(
  q,
  k,
  v,
  g,
  beta,
  mask,
  initial_state,
  scale,
  chunk_size,
  cu_seqlens=None,
  *,
  options=None,
  precision=None,
):
  """q, k [B, Tp, H, K]; v [B, Tp, HV, V]; g, beta [B, Tp, HV]; mask [Bm, Tm, Hm, r, r];
  initial_state [B, HV, K, V] f32; scale a Python number -> (o [B, Tp, HV, V] in q's dtype,
  final [B, HV, K, V] f32).

  Differentiable in every input (jax.custom_vjp); the padding around the kernels is plain jnp.
  options: a `KernelOptions` (precision, launch parameters); None picks the heuristic's.
  precision: the kernels' float32 matmul precision ("tf32", "tf32x3", "ieee"); overrides
    options.precision when given.
  Grouped value heads (HV a multiple of H): the kernels read key head i // (HV // H) for value
  head i through their index maps (no repeated copy of q and k); dq and dk are summed over each
  group. Non-finite inputs: a nan or inf at token t changes nothing before t, forward and
  gradients (`_gdp_guarded`, docs/precision.md#non-finite-inputs).

  cu_seqlens: None, or packed sequences (docs/varlen.md): q, k [1, T, H, K]; v [1, T, HV, V];
  g, beta [1, T, HV]; mask [1, Tm, Hm, r, r]; initial_state [N, HV, K, V] float32; cu_seqlens
  [N + 1] int (T not padded) -> (o [1, T, HV, V], final [N, HV, K, V]). The forward reads the
  packed row in place; the backward gathers its operands into the chunk-aligned layout
  (`varlen.layout`); the state walks run one program per (V tile, sequence, head).
  """
  args = (q, k, v, g, beta, mask, initial_state)
  # forward mode through the custom_vjp: a clear error while tracing
  raise_if_forward_mode((args, scale), NO_HIGHER_DERIVATIVES)
  t_len, dim_k, dim_v = q.shape[1], q.shape[-1], v.shape[-1]
  r = mask.shape[-1]
  bt = pallas_chunk(chunk_size, r)
  packing = None if cu_seqlens is None else _packing(cu_seqlens, t_len, bt)
  q, k, v, h0, options = _kernel_inputs(q, k, v, initial_state, r, options, precision)
  core = _gdp_guarded if options.nonfinite_guard else _gdp_core
  mask = mask.astype(jnp.float32)
  o, final = core(q, k, v, g, beta, mask, h0, packing, scale, bt, options)
  o = o[..., :dim_v]
  final = unpad_key_blocks(final[..., :dim_v], r, dim_k // r, axis=-2)
  return o, final


def _kernel_inputs(q, k, v, initial_state, r, options, precision):
  """The kernels' operands and options: q, k and the state's key blocks padded to a power of two
  >= 16, V likewise (`padded_dims`); the options (the heuristic's when None) at `precision` when
  given. Returns (q, k, v, h0, options)."""
  dim_k, dim_v = q.shape[-1], v.shape[-1]
  dkp, vp = padded_dims(dim_k, dim_v, r)
  q = pad_key_blocks(q, r, dkp)
  k = pad_key_blocks(k, r, dkp)
  v = _pad_last(v, vp)
  h0 = _pad_last(pad_key_blocks(initial_state.swapaxes(-1, -2), r, dkp).swapaxes(-1, -2), vp)
  if options is None:
    options = kernel_options.heuristic_options(
      r=r, dim_k=dim_k, dim_v=dim_v, dtype=q.dtype, precision=precision or "tf32"
    )
  if precision is not None:
    options = options.replace(precision=precision)
  return q, k, v, h0, options


@dataclasses.dataclass(frozen=True)
class TritonGatedDeltaProduct(GatedDeltaProductImplementation):
  """The Pallas kernels through the Triton lowering (pallas_kernels/triton/, docs/kernels.md).

  options: precision and launch parameters (`KernelOptions`); None picks them per problem and
    device (`heuristics`).
  precision: float32 matmul precision ("tf32", "tf32x3", "ieee"); None keeps the options'.
  nonfinite_guard: the guard that keeps non-finite inputs causal (docs/precision.md); None keeps
    the options' (on by default).
  backward: "pallas" (the backward kernels) or "xla" (the jnp backward of the chunked form behind
    the kernels' forward: a debugging switch).
  """

  name: ClassVar[str] = "triton"
  summary: ClassVar[str] = "Pallas GPU kernels through the Triton lowering (interpreted off a GPU)"
  platforms: ClassVar[tuple[str, ...]] = ("gpu",)
  pallas: ClassVar[bool] = True

  options: KernelOptions | None = None
  precision: str | None = None
  nonfinite_guard: bool | None = None
  backward: str = "pallas"

  @staticmethod
  def heuristics(*, r: int, dim_k: int, dim_v: int, dtype, precision: str = "tf32"):
    """The launch configuration for a problem on the default device (options.heuristic_options)."""
    return kernel_options.heuristic_options(
      r=r, dim_k=dim_k, dim_v=dim_v, dtype=dtype, precision=precision
    )

  def _options(self, q, v, mask):
    options = self.options
    if self.nonfinite_guard is not None:
      if options is None:
        options = self.heuristics(
          r=mask.shape[-1],
          dim_k=q.shape[-1],
          dim_v=v.shape[-1],
          dtype=q.dtype,
          precision=self.precision or "tf32",
        )
      options = options.replace(nonfinite_guard=self.nonfinite_guard)
    return dict(options=options, precision=self.precision)

  def serves(self, capability):
    return capability >= (8, 0)

  def __call__(self, q, k, v, g, beta, mask, initial_state, scale, chunk_size):
    return self._run(q, k, v, g, beta, mask, initial_state, scale, chunk_size, None)

  def varlen(self, q, k, v, g, beta, mask, initial_state, scale, chunk_size, cu_seqlens):
    initial_state = packed_states(initial_state, q, v, cu_seqlens)
    return self._run(q, k, v, g, beta, mask, initial_state, scale, chunk_size, cu_seqlens)

  def _run(self, q, k, v, g, beta, mask, initial_state, scale, chunk_size, cu_seqlens):
    args = (q, k, v, g, beta, mask, initial_state, scale, chunk_size, cu_seqlens)
    if self.backward == "xla":
      forward = self.replace(backward="pallas")
      return xla_backward.with_xla_backward(forward, *args[:7], cu_seqlens, scale, chunk_size)
    return gated_delta_product_pallas(*args, **self._options(q, v, mask))
