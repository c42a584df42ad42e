"""Launch parameters and matmul precision of the kernels: one frozen options object.

`KernelOptions` carries everything a kernel launch needs besides its arrays: the float32 matmul
precision and, per stage, the Triton launch parameters (warps, pipeline stages, V tile). It is
frozen (hashable: it can be a static argument of `jax.jit` and of `jax.custom_vjp`).
`heuristic_options(...)` picks it from the problem (r, K, V, dtype) and the device (SM count,
shared memory); callers override single fields with `dataclasses.replace`. The defaults below
come from the H200 sweeps kept in `benchmarks/results/` (see docs/kernels.md for the command that
chose each one).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from absl import logging

from pallas_kernels.common import backend


@dataclasses.dataclass(frozen=True)
class Launch:
  """Triton launch parameters of one kernel. `block_v`: V tile of kernels that split V."""

  num_warps: int = 4
  num_stages: int = 2
  block_v: int | None = None


@dataclasses.dataclass(frozen=True)
class DeviceInfo:
  """What the launch heuristics need to know about the GPU (or the CPU, in interpret mode)."""

  platform: str = "cpu"
  name: str = "cpu"
  compute_capability: tuple[int, int] | None = None
  sm_count: int = 132
  shared_memory_per_block: int = 227 * 1024


# Opt-in shared memory per thread block by compute capability (bytes), from NVIDIA's CUDA
# programming guide (table of technical specifications per compute capability).
_SHARED_MEMORY = {
  (7, 0): 96 * 1024,
  (7, 5): 64 * 1024,
  (8, 0): 163 * 1024,
  (8, 6): 99 * 1024,
  (8, 7): 163 * 1024,
  (8, 9): 99 * 1024,
  (9, 0): 227 * 1024,
  (10, 0): 227 * 1024,
  (10, 3): 227 * 1024,
  (12, 0): 99 * 1024,
}


def _parse_capability(text) -> tuple[int, int] | None:
  try:
    major, minor = str(text).split(".")[:2]
    return int(major), int(minor)
  except (TypeError, ValueError):
    return None


@functools.cache
def device_info(device=None) -> DeviceInfo:
  """DeviceInfo of `device` (default: the first device of the default backend)."""
  device = jax.devices()[0] if device is None else device
  if device.platform != "gpu":
    return DeviceInfo(platform=device.platform, name=str(device.device_kind))
  capability = _parse_capability(getattr(device, "compute_capability", None))
  smem = _SHARED_MEMORY.get(capability, 99 * 1024) if capability else 99 * 1024
  return DeviceInfo(
    platform="gpu",
    name=str(device.device_kind),
    compute_capability=capability,
    sm_count=int(getattr(device, "core_count", 0) or 132),
    shared_memory_per_block=smem,
  )


@dataclasses.dataclass(frozen=True)
class KernelOptions:
  """Precision and launch parameters of the chunked operator's kernels.

  precision: float32 matmuls: "tf32", "tf32x3" or "ieee" (docs/precision.md). Half-precision
    operands always run on the tensor cores with float32 accumulation.
  fused: the forward as two fused kernels (chunk_fwd, chunk_state_output) or as the five-kernel
    pipeline (kkt, solve_tril, wy, chunk_h, chunk_o); chunk_fwd_merge / chunk_fwd_inverse pick
    the fused kernel's variants (pallas_kernels/forward/chunk_fwd.py).
  Each stage field is the `Launch` of the kernel of the same name (docs/kernels.md).
  """

  precision: str = "tf32"
  fused: bool = True
  chunk_fwd: Launch = Launch(num_warps=2, num_stages=1)
  chunk_fwd_merge: str = "blocks"
  chunk_fwd_inverse: str = "auto"
  chunk_state_output: Launch = Launch(num_warps=4, num_stages=3, block_v=64)
  kkt: Launch = Launch(num_warps=4)
  solve_tril: Launch = Launch(num_warps=1)
  wy: Launch = Launch(num_warps=4)
  chunk_h: Launch = Launch(num_warps=4, num_stages=3, block_v=64)
  chunk_o: Launch = Launch(num_warps=4, num_stages=2, block_v=128)
  bwd_dv_local: Launch = Launch(num_warps=4)
  bwd_dhu: Launch = Launch(num_warps=4, num_stages=2, block_v=64)
  bwd_dqkwg: Launch = Launch(num_warps=8, num_stages=2)
  bwd_wy: Launch = Launch(num_warps=8, num_stages=2)

  def __post_init__(self):
    if self.precision not in backend.PRECISIONS:
      raise ValueError(f"precision must be one of {backend.PRECISIONS}, got {self.precision!r}")

  def replace(self, **changes) -> KernelOptions:
    return dataclasses.replace(self, **changes)


DEFAULT = KernelOptions()


@functools.cache
def heuristic_options(
  *,
  r: int,
  dim_k: int,
  dim_v: int,
  dtype,
  precision: str = "tf32",
  device: DeviceInfo | None = None,
) -> KernelOptions:
  """The launch configuration for a problem on a device (H200-tuned, scaled down elsewhere).

  Today the tuned values do not depend on (r, K, V); the V tiles shrink where a device has less
  shared memory than an H200, and float32 operands (twice the bytes per tile) get the narrower
  tile too.
  """
  device = device_info() if device is None else device
  opts = DEFAULT.replace(precision=precision)
  small_smem = device.shared_memory_per_block < 160 * 1024
  if small_smem or (jnp.dtype(dtype) == jnp.float32 and max(dim_k, dim_v) > 128):
    opts = opts.replace(
      chunk_o=dataclasses.replace(opts.chunk_o, block_v=64),
      chunk_h=dataclasses.replace(opts.chunk_h, block_v=32),
      bwd_dhu=dataclasses.replace(opts.bwd_dhu, block_v=32),
    )
  if jnp.dtype(dtype) == jnp.float32:
    # Float32 q, k, w tiles are twice the bytes: three pipeline stages of chunk_state_output
    # asked for 290 KB at K = V = 128 on an H200 (227 KB per block); one stage fits.
    opts = opts.replace(
      chunk_state_output=dataclasses.replace(opts.chunk_state_output, num_stages=1)
    )
  logging.vlog(
    1,
    "gdp kernel options for r=%d K=%d V=%d %s on %s: %s",
    r,
    dim_k,
    dim_v,
    jnp.dtype(dtype).name,
    device.name,
    opts,
  )
  return opts


@dataclasses.dataclass(frozen=True)
class DecodeOptions:
  """Launch parameters of the grouped-query decode kernel (pallas_kernels/inference)."""

  block_s: int = 64
  num_warps: int = 4
  num_stages: int = 3
  programs_per_sm: int = 16  # enough programs for a few waves and a short tail
  min_blocks_per_split: int = 4


@dataclasses.dataclass(frozen=True)
class StepOptions:
  """Launch parameters of the recurrent step kernel (pallas_kernels/inference)."""

  block_v: int = 64
  num_warps: int = 4
  num_stages: int = 1


@dataclasses.dataclass(frozen=True)
class PagedDecodeOptions:
  """Launch parameters of the paged grouped-query decode kernel (pallas_kernels/inference).

  block_s: cache rows per inner iteration, gathered through the block table (a block may span
  several pages, or a part of one); the other fields as in DecodeOptions.
  """

  block_s: int = 64
  num_warps: int = 4
  num_stages: int = 3
  programs_per_sm: int = 16
  min_blocks_per_split: int = 4
