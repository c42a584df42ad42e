"""`implementation="mosaic_gpu"`: the Mosaic GPU forward kernels for Hopper
(pallas_kernels/mosaic_gpu/, docs/implementations.md#mosaic-gpu) behind one `jax.custom_vjp`.

A call that is not differentiated runs `pallas_kernels.mosaic_gpu.forward.forward` on the
normalised inputs of gdp_jax/ops/gated_delta_product/api.py. There is no Mosaic GPU backward yet:
under differentiation the forward rule is the Triton implementation's
(gdp_jax/ops/gated_delta_product/triton.py), which keeps the residuals its backward reads, so a
training step costs exactly what implementation="triton" costs (no recomputation) and only
forward-only calls (inference, evaluation) run the Mosaic kernels.

What the kernels take, and what this implementation refuses with a ValueError that points to
"triton": q, k, v in bfloat16 or float16; K = 64 or 128; r in 1, 2, 4, 8; no packed sequences
(cu_seqlens). Grouped value heads (HV a multiple of H) read each key head through the kernels'
index maps. The kernels use chunks of 64 // r tokens whatever
`chunk_size` is (it only sets the operator's time padding and the Triton backward's chunk).

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

from gdp_jax.ops.gated_delta_product import nonfinite
from gdp_jax.ops.gated_delta_product.base import GatedDeltaProductImplementation
from gdp_jax.ops.gated_delta_product.triton import TritonGatedDeltaProduct, _run_scaled
from pallas_kernels.common.backend import interpret_mode
from pallas_kernels.common.options import KernelOptions
from pallas_kernels.mosaic_gpu import forward as mosaic_forward
from pallas_kernels.mosaic_gpu.common import SUPPORTED_DTYPES, SUPPORTED_R

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


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9))
def _mosaic_gdp(q, k, v, g, beta, mask, h0, scale, chunk_size, impl):
  """(o, final) from the Mosaic GPU forward; differentiated, the Triton implementation's."""
  del chunk_size  # the kernels' chunk is 64 // r tokens
  interpret = impl.interpret if impl.interpret is not None else interpret_mode()
  if not interpret:
    _check_device()
  batch, t_len, heads = v.shape[:3]

  def run(k, v, g, beta, mask):
    return mosaic_forward.forward(
      q,
      k,
      v,
      g,
      beta,
      _kernel_mask(mask, batch, t_len, heads),
      scale=scale,
      initial_state=h0,
      output_final_state=True,
      interpret=plgpu.InterpretGPUParams() if interpret else None,
    )

  if not impl.guarded():
    return run(k, v, g, beta, mask)
  # The non-finite guard, as the Triton implementation's (gdp_jax/ops/gated_delta_product/
  # nonfinite.py): the kernels run once on cleaned inputs and selects mark what a bad token
  # spoils. q stays as it is: a bad q spoils only its own token's output, which is marked.
  cleaned, marks = nonfinite.clean(q, k, v, g, beta, mask)
  return nonfinite.mark(*run(*cleaned[1:]), marks)


def _mosaic_gdp_fwd(q, k, v, g, beta, mask, h0, scale, chunk_size, impl):
  # No Mosaic GPU backward yet: the Triton forward, whose vjp (a pytree holding its residuals)
  # is this rule's residual.
  triton = impl.triton()
  return jax.vjp(lambda *x: triton(*x, scale, chunk_size), q, k, v, g, beta, mask, h0)


def _mosaic_gdp_bwd(scale, chunk_size, impl, vjp, cotangents):
  return vjp(cotangents)


_mosaic_gdp.defvjp(_mosaic_gdp_fwd, _mosaic_gdp_bwd)


def _forward(q, k, v, g, beta, mask, initial_state, scale, chunk_size, *, impl):
  return _mosaic_gdp(q, k, v, g, beta, mask, initial_state, scale, chunk_size, impl)


@dataclasses.dataclass(frozen=True)
class MosaicGpuGatedDeltaProduct(GatedDeltaProductImplementation):
  """The Mosaic GPU forward kernels (Hopper) with the Triton implementation's backward.

  "pallas" and None pick it on Hopper with `fallback=True` (gdp_jax/ops/dispatch.py).
  Differentiated, the forward is the Triton one (its residuals feed the Triton backward): a
  training step costs what "triton" costs; forward-only calls run the Mosaic kernels.

  options, precision, nonfinite_guard, backward: the Triton implementation's config, as in
    `TritonGatedDeltaProduct` (the Mosaic forward takes half-precision inputs only and has no
    float32 matmuls to set); the non-finite guard (on unless `nonfinite_guard` or
    `options.nonfinite_guard` turns it off) wraps the Mosaic forward the same way.
  fallback: False (an explicit `implementation="mosaic_gpu"`): inputs the kernels cannot take
    are a ValueError naming the argument. True: they run the Triton implementation instead
    (packed sequences too).
  interpret: None follows pallas_kernels/common/backend.py (the Mosaic GPU interpreter off a
    GPU); False lowers the kernels for the GPU, True interprets them.
  """

  name: ClassVar[str] = "mosaic_gpu"
  summary: ClassVar[str] = (
    "Pallas Mosaic GPU forward for Hopper, Triton when differentiated (interpreted off a GPU)"
  )
  platforms: ClassVar[tuple[str, ...]] = ("gpu",)
  pallas: ClassVar[bool] = True

  options: KernelOptions | None = None
  precision: str | None = None
  nonfinite_guard: bool | None = None
  backward: str = "pallas"
  interpret: bool | None = None
  fallback: bool = False

  def guarded(self) -> bool:
    """Whether the non-finite guard wraps the forward (the Triton implementation's rule)."""
    if self.nonfinite_guard is not None:
      return self.nonfinite_guard
    return self.options is None or self.options.nonfinite_guard

  def triton(self) -> TritonGatedDeltaProduct:
    """The Triton implementation with this one's backward config (what the backward runs)."""
    return TritonGatedDeltaProduct(
      options=self.options,
      precision=self.precision,
      nonfinite_guard=self.nonfinite_guard,
      backward=self.backward,
    )

  def __call__(self, q, k, v, g, beta, mask, initial_state, scale, chunk_size):
    reason = unsupported(q, k, v, mask)
    if reason is not None:
      if self.fallback:
        return self.triton()(q, k, v, g, beta, mask, initial_state, scale, chunk_size)
      raise ValueError(reason)
    args = (q, k, v, g, beta, mask, initial_state)
    return _run_scaled(_forward, args, scale, (chunk_size,), dict(impl=self))

  def varlen(self, q, k, v, g, beta, mask, initial_state, scale, chunk_size, cu_seqlens):
    if self.fallback:
      args = (q, k, v, g, beta, mask, initial_state, scale, chunk_size, cu_seqlens)
      return self.triton().varlen(*args)
    raise ValueError(
      f"cu_seqlens: packed sequences (cu_seqlens shape {tuple(cu_seqlens.shape)}) are not "
      f'supported by implementation="mosaic_gpu"; {USE_TRITON}'
    )
