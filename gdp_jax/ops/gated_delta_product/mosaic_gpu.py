"""`implementation="mosaic_gpu"`: the Mosaic GPU kernels for Hopper, forward and backward
(pallas_kernels/mosaic_gpu/, docs/implementations.md#mosaic-gpu, docs/mosaic_gpu.md).

It is the Triton implementation's operator (gdp_jax/ops/gated_delta_product/triton.py: the
normalisation, the non-finite guard, the `jax.custom_vjp`) with the forward kernels replaced by
`pallas_kernels.mosaic_gpu.forward.forward` (`gated_delta_product_pallas(
forward=MosaicForwardKernels(...))`). Differentiated, with r in 1, 2, 4 and K, V in 64, 128, the
forward walk stores its per-chunk states and the backward is the Mosaic one
(`MosaicForwardKernels.backward`: the reverse walk, then the chunk-parallel gradients). Elsewhere
the Mosaic forward returns its chunks' gate-free inverses, which `triton_inverse` turns into the
Triton backward's residual (the gated inverse in token-major rows), and the Triton backward
kernels run. With a `chunk_size` below the kernels' `64 // r` tokens the Triton backward's chunk
differs from theirs and a differentiated call runs the Triton forward and backward.

What the kernels take, and what this implementation refuses with a ValueError that points to
"triton": q, k, v in bfloat16 or float16; K = 64 or 128; r in 1, 2, 4, 8. Packed sequences
(cu_seqlens) run on the Mosaic kernels where unpacked calls do (the inputs gathered into the
chunk-aligned layout, both walks one program per sequence; docs/mosaic_gpu.md#packed-sequences),
when named explicitly: "pallas" and None keep the Triton kernels for them. Grouped value heads
(HV a multiple of H) read each key head through the kernels' index maps.
`backward="xla"` (a debugging switch) runs the Triton forward.

Off a GPU (or with GDP_PALLAS_INTERPRET=1, pallas_kernels/common/backend.py) the kernels run in
jax's Mosaic GPU interpreter: the state walk's three warpgroups run as threads of XLA's CPU pool,
which needs at least three threads (set NPROC=8 before jax starts on a machine with fewer cores;
docs/mosaic_gpu.md#testing-without-a-gpu). Compiled, they need an sm_90 GPU (H100, H200).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar

import jax
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp

from gdp_jax.ops.gated_delta_product import varlen
from gdp_jax.ops.gated_delta_product.base import GatedDeltaProductImplementation
from gdp_jax.ops.gated_delta_product.triton import (
  TritonGatedDeltaProduct,
  gated_delta_product_pallas,
)
from gdp_jax.ops.gated_delta_product.triton import _forward as triton_packed_forward
from gdp_jax.ops.gated_delta_product.triton import _fused_forward as triton_forward
from gdp_jax.ops.gated_delta_product.xla_backward import reduce_dmask
from gdp_jax.ops.heads import sum_key_heads
from pallas_kernels.common.backend import interpret_mode
from pallas_kernels.common.options import KernelOptions
from pallas_kernels.mosaic_gpu import backward_walk, chunk_grads
from pallas_kernels.mosaic_gpu import forward as mosaic_forward
from pallas_kernels.mosaic_gpu.common import SUPPORTED_DTYPES, SUPPORTED_R, chunk_tokens

SUPPORTED_KEY_DIMS = (64, 128)
COMPUTE_CAPABILITY = (9, 0)  # what the compiled kernels target (wgmma, TMA)
USE_TRITON = 'use implementation="triton"'


def unsupported(q, k, v, mask) -> str | None:
  """What the Mosaic GPU forward cannot take in these inputs, naming the argument, or None."""
  if jnp.dtype(q.dtype) not in SUPPORTED_DTYPES:
    return (
      f'q, k, v: dtype {jnp.dtype(q.dtype).name}; implementation="mosaic_gpu" takes bfloat16 '
      f"or float16 only; {USE_TRITON} (or cast the inputs)"
    )
  r = mask.shape[-1]
  if r not in SUPPORTED_R:
    return (
      f'mask: r = {r} key blocks; implementation="mosaic_gpu" takes r in {SUPPORTED_R}; '
      f"{USE_TRITON}"
    )
  if q.shape[-1] not in SUPPORTED_KEY_DIMS:
    return (
      f'q, k: K = {q.shape[-1]} (q shape {tuple(q.shape)}); implementation="mosaic_gpu" '
      f"takes K in {SUPPORTED_KEY_DIMS}; {USE_TRITON}"
    )
  return None


def _check_device() -> None:
  """Compiled kernels need an sm_90 GPU; lowering for cuda from a CPU is left alone."""
  device = jax.devices()[0]
  if device.platform != "gpu":
    return
  try:
    capability = tuple(int(x) for x in str(device.compute_capability).split(".")[:2])
  except (AttributeError, TypeError, ValueError):
    capability = None
  if capability != COMPUTE_CAPABILITY:
    raise ValueError(
      f'implementation="mosaic_gpu" compiles for compute capability 9.0 (H100, H200); this '
      f"device is {device.device_kind} with compute capability "
      f"{getattr(device, 'compute_capability', 'unknown')}; {USE_TRITON}"
    )


def _kernel_mask(mask, batch, t_len, heads):
  """The normalised mask [Bm, Tm, Hm, r, r] in a shape forward.py reads: [r, r] when shared,
  [H, r, r] per head, else [B, T, H, r, r]."""
  bm, tm, hm, r, _ = mask.shape
  if bm == 1 and tm == 1:
    return mask[0, 0, 0] if hm == 1 else mask[0, 0]
  return jnp.broadcast_to(mask, (batch, t_len, heads, r, r))


def triton_inverse(t0, gamma, r):
  """The Triton backward's residual Ai from the Mosaic chunks' gate-free inverses.

  t0: `[B, H, NC * N, N]`, `(I + A0)^-1` per chunk with block-major rows and columns `(a, t)`
  (pallas_kernels/mosaic_gpu/common.py); gamma: `[B, H, NC * C]` float32, the chunk-local
  cumulative log-decay. Ai is the gated inverse `(I + A)^-1` with token-major rows `(t, a)`
  (pallas_kernels/common/rows.py), in t0's dtype. With `D = diag(exp(gamma))` the gated matrix is
  `D A0 D^-1`, so its inverse is `D T0 D^-1`: entry `((t, a), (s, d))` is `T0 exp(gamma_t -
  gamma_s)`, nonzero for `s <= t` only, so no exp of a positive argument is formed
  (docs/chunked_form.md#w-and-u).
  """
  batch, heads, rows, n = t0.shape
  c = n // r
  chunks = rows // n
  x = t0.astype(jnp.float32).reshape(batch, heads, chunks, r, c, r, c)  # [.., a, t, d, s]
  x = jnp.transpose(x, (0, 1, 2, 4, 3, 6, 5))  # [.., t, a, s, d]
  gam = gamma.reshape(batch, heads, chunks, c)
  diff = gam[..., :, None] - gam[..., None, :]  # [.., t, s]
  causal = jnp.tril(jnp.ones((c, c), bool))
  gate = jnp.where(causal, jnp.exp(jnp.where(causal, diff, 0.0)), 0.0)
  x = x * gate[:, :, :, :, None, :, None]
  return x.reshape(batch, heads, rows, n).astype(t0.dtype)


@dataclasses.dataclass(frozen=True)
class MosaicForwardKernels:
  """The Mosaic GPU kernels in the place of the Triton forward kernels (the `forward` of
  `gated_delta_product_pallas`, with `triton._forward`'s contract): `(o, final, saved)` on the
  Triton kernels' operands. With `save_ai` (a differentiated call) `saved` is `(None, None,
  (t0, states, v_new))` where the Mosaic backward takes the call (`stores_states`; the Triton
  custom_vjp then hands its backward to `backward`), else `(gamma, ai)` with the inverses turned
  into Triton's residual by `triton_inverse`; where the call's Triton chunk is not the Mosaic
  kernels' `64 // r` tokens (a `chunk_size` below it), the Triton forward kernels run instead, so
  the residuals always fit the Triton backward.

  interpret: run the kernels in the Mosaic GPU interpreter (else compiled for an sm_90 GPU).
  """

  interpret: bool

  def __call__(self, q, k, v, g, beta, mask, h0, packing, scale, bt, opts, save_ai):
    r = mask.shape[-1]
    store = save_ai and stores_states(r, q.shape[-1], v.shape[-1])
    if packing is not None:
      if bt != chunk_tokens(r) or (save_ai and not store):  # the Triton kernels both ways
        return triton_packed_forward(q, k, v, g, beta, mask, h0, packing, scale, bt, opts, save_ai)
      return self._packed(q, k, v, g, beta, mask, h0, packing, scale, store)
    if save_ai and bt != chunk_tokens(r):
      return triton_forward(q, k, v, g, beta, mask, h0, scale, bt, opts, save_ai, {}, {})
    if not self.interpret:
      _check_device()
    batch, t_len, heads = v.shape[:3]
    out = mosaic_forward.forward(
      q,
      k,
      v,
      g,
      beta,
      _kernel_mask(mask, batch, t_len, heads),
      scale=scale,
      initial_state=h0,
      output_final_state=True,
      return_inverse=save_ai,
      store_states=store,
      interpret=self._params(),
    )
    if not save_ai:
      return (*out, (None, None))
    o, final, t0, *states = out
    if store:  # the Mosaic backward's residuals (`backward` forms its gates itself)
      return o, final, (None, None, (t0, *states))
    g_hm = jnp.moveaxis(g.astype(jnp.float32), 1, 2)  # [B, H, Tp]
    gamma = jnp.cumsum(g_hm.reshape(batch, heads, t_len // bt, bt), axis=-1)
    gamma = gamma.reshape(g_hm.shape)
    return o, final, (gamma, triton_inverse(t0, gamma, r))

  def _packed(self, q, k, v, g, beta, mask, h0, packing, scale, store):
    """Packed sequences: the inputs gathered into the chunk-aligned layout (docs/varlen.md), the
    walks one program per sequence (`seq_table`), o gathered back; with `store` (a
    differentiated call) the Mosaic backward's residuals, as `__call__` returns them."""
    if not self.interpret:
      _check_device()
    lay = packing.layout
    heads = v.shape[2]
    pack = functools.partial(varlen.pack, lay=lay)
    mask5 = mask if mask.shape[1] == 1 else pack(mask)
    o, final, *stored = mosaic_forward.forward(
      *map(pack, (q, k, v, g, beta)),
      _kernel_mask(mask5, 1, lay.t_pad, heads),
      scale=scale,
      initial_state=h0,
      output_final_state=True,
      return_inverse=store,
      store_states=store,
      seq_table=packing.sequences.T,  # the Triton walks' table, built once per call
      interpret=self._params(),
    )
    saved = (None, None, tuple(stored)) if store else (None, None)
    return varlen.unpack(o, lay), final, saved

  def _params(self):
    return plgpu.InterpretGPUParams() if self.interpret else None

  def backward(self, scale, residuals, cotangents, packing=None):
    """The Mosaic GPU backward (docs/mosaic_gpu.md#the-backward) from the forward walk's stored
    states: the reverse walk (pallas_kernels/mosaic_gpu/backward_walk.py), then the
    chunk-parallel gradients (chunk_grads.py) and their per-token sums here. Takes and returns
    what the Triton backward does (`triton._backward`): `(dq, dk, dv, dg, dbeta, dmask,
    d initial_state)`. packing: None, or packed sequences: the residuals' token arrays are then
    the packed row, gathered here into the chunk-aligned layout the forward walked; the reverse
    walk runs one program per sequence, and every per-token gradient goes back to the packed
    row before any sum over tokens (chunks of no sequence were not walked)."""
    q, k, v, g, beta, mask, h0, (_, _, (t0, states_t, vnew_t)) = residuals
    do, dfinal = cotangents
    to_row, seq_table, token_mask = (lambda x: x), None, mask
    if packing is not None:
      pack = functools.partial(varlen.pack, lay=packing.layout)
      to_row = functools.partial(varlen.unpack, lay=packing.layout)
      q, k, v, g, beta, do = map(pack, (q, k, v, g, beta, do))
      token_mask = mask if mask.shape[1] == 1 else pack(mask)
      seq_table = packing.sequences.T
    batch, t_len, heads = v.shape[:3]
    key_heads = q.shape[2]
    r = mask.shape[-1]
    c = chunk_tokens(r)
    nc = t_len // c
    kernel_mask = _kernel_mask(token_mask, batch, t_len, heads)
    ops = mosaic_forward.prepare(q, k, v, g, beta, kernel_mask, scale)
    params = self._params()
    walk_args = (ops.gamma, ops.gamma_rows, ops.beta_rows, ops.mask_rows, ops.scale)
    dh_t, dvnew_t, dh0_t = backward_walk.state_grad_walk(
      ops.q,
      ops.k,
      do,
      t0,
      *walk_args,
      jnp.swapaxes(dfinal.astype(jnp.float32), 2, 3),
      block_v=mosaic_forward.BLOCK_V,
      seq_table=seq_table,
      interpret=params,
    )
    dq, dk, dv, vec = chunk_grads.chunk_grads(
      ops.q, ops.k, ops.v, do, t0, states_t, vnew_t, dh_t, dvnew_t, *walk_args, interpret=params
    )
    # the per-row vectors to tokens: row (a, t) of chunk n is entry [n, a, t]
    per_row = lambda i: vec[:, :, :, i].reshape(batch, heads, nc, r, c)
    dgamma = jnp.sum(per_row(0) + per_row(1), axis=3) + vec[:, :, :, 4, :c]
    dgamma = dgamma.at[..., -1].add(vec[:, :, :, 5, 0])
    dg = jnp.flip(jnp.cumsum(jnp.flip(dgamma, -1), axis=-1), -1)  # gamma is a cumsum of g
    dbeta = jnp.sum(per_row(2) + per_row(3), axis=3)
    time_major = lambda x: jnp.moveaxis(x.reshape(batch, heads, t_len), 1, 2)  # -> [B, T, H]
    # dM_t[a, d] at row (a, t): vector 6 + d
    dm = jnp.stack([per_row(chunk_grads.VECTOR_ROWS + d) for d in range(r)], axis=-1)
    dm = jnp.moveaxis(dm, 3, 4).reshape(batch, heads, t_len, r, r)  # [B, H, T, a, d]
    dm = jnp.moveaxis(to_row(jnp.moveaxis(dm, 1, 2)), 1, 2)
    dmask = reduce_dmask(dm, mask.shape)
    if key_heads != heads:
      dq, dk = (sum_key_heads(x.astype(jnp.float32), key_heads) for x in (dq, dk))
    return (
      to_row(dq).astype(q.dtype),
      to_row(dk).astype(k.dtype),
      to_row(dv).astype(v.dtype),
      to_row(time_major(dg)).astype(g.dtype),
      to_row(time_major(dbeta)).astype(beta.dtype),
      dmask.astype(mask.dtype),
      jnp.swapaxes(dh0_t, 2, 3).astype(h0.dtype),
    )


def stores_states(r: int, key_dim: int, value_dim: int) -> bool:
  """Whether a differentiated call keeps the forward walk's states for the Mosaic backward (its
  kernels take r in 1, 2, 4 and K, V in 64, 128); else the forward saves the Triton backward's
  residuals, and the Triton kernels recompute the states."""
  dims = chunk_grads.SUPPORTED_DIMS
  return r in chunk_grads.SUPPORTED_R and key_dim in dims and value_dim in dims


@dataclasses.dataclass(frozen=True)
class MosaicGpuGatedDeltaProduct(GatedDeltaProductImplementation):
  """The Mosaic GPU kernels (Hopper), forward and backward.

  "pallas" and None pick it on Hopper with `fallback=True` (gdp_jax/ops/dispatch.py). Forward
  and training calls run the Mosaic forward; the backward is the Mosaic one where its kernels
  reach, else the Triton kernels' (module docstring).

  options, precision, nonfinite_guard, backward: the Triton implementation's config, as in
    `TritonGatedDeltaProduct` (the Mosaic forward takes half-precision inputs only and has no
    float32 matmuls to set); the non-finite guard (on unless `nonfinite_guard` or
    `options.nonfinite_guard` turns it off) wraps the Mosaic forward the same way.
  fallback: False (an explicit `implementation="mosaic_gpu"`): inputs the kernels cannot take
    are a ValueError naming the argument. True: they run the Triton implementation instead.
  interpret: None follows pallas_kernels/common/backend.py (the Mosaic GPU interpreter off a
    GPU); False lowers the kernels for the GPU, True interprets them.
  """

  name: ClassVar[str] = "mosaic_gpu"
  summary: ClassVar[str] = (
    "Pallas Mosaic GPU kernels for Hopper, forward and backward (interpreted off a GPU)"
  )
  platforms: ClassVar[tuple[str, ...]] = ("gpu",)
  pallas: ClassVar[bool] = True

  options: KernelOptions | None = None
  precision: str | None = None
  nonfinite_guard: bool | None = None
  backward: str = "pallas"
  interpret: bool | None = None
  fallback: bool = False

  def triton(self) -> TritonGatedDeltaProduct:
    """The Triton implementation with this one's backward config (what the backward runs)."""
    return TritonGatedDeltaProduct(
      options=self.options,
      precision=self.precision,
      nonfinite_guard=self.nonfinite_guard,
      backward=self.backward,
    )

  def __call__(self, q, k, v, g, beta, mask, initial_state, scale, chunk_size):
    args = (q, k, v, g, beta, mask, initial_state, scale, chunk_size)
    reason = unsupported(q, k, v, mask)
    if reason is not None:
      if self.fallback:
        return self.triton()(*args)
      raise ValueError(reason)
    interpret = self.interpret if self.interpret is not None else interpret_mode()
    kernels = MosaicForwardKernels(interpret=interpret)
    return gated_delta_product_pallas(*args, **self.triton()._options(q, v, mask), forward=kernels)

  def varlen(self, q, k, v, g, beta, mask, initial_state, scale, chunk_size, cu_seqlens):
    """Packed sequences on the Mosaic kernels, both walks one program per sequence
    (docs/mosaic_gpu.md#packed-sequences). Named explicitly only: "pallas" and None
    (`fallback`) keep the Triton kernels for packed sequences (their forward reads the packed row
    in place and is as fast; this path's backward has not yet run compiled on a GPU)."""
    args = (q, k, v, g, beta, mask, initial_state, scale, chunk_size, cu_seqlens)
    if self.fallback:
      return self.triton().varlen(*args)
    reason = unsupported(q, k, v, mask)
    if reason is not None:
      raise ValueError(reason)
    interpret = self.interpret if self.interpret is not None else interpret_mode()
    kernels = MosaicForwardKernels(interpret=interpret)
    return gated_delta_product_pallas(*args, **self.triton()._options(q, v, mask), forward=kernels)
