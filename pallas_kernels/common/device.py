"""Facts about the device the kernels run on: compute capability, multiprocessor count and shared
memory per thread block, read from the device (docs/implementations.md#choosing-an-implementation).

jax reports a GPU's compute capability and multiprocessor count (`Device.compute_capability`,
`Device.core_count`) but not its shared memory per block, which comes from a table by compute
capability. Off a GPU (the Pallas interpreters, lowering for cuda on a CPU) the figures are those
of the GPU the kernels' launches were tuned on, an H200 (`INTERPRET`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax

KB = 1024
HOPPER = (9, 0)  # H100, H200: the Mosaic GPU kernels' target (wgmma, TMA)

# Opt-in shared memory per thread block by compute capability (bytes): NVIDIA's CUDA programming
# guide, table of technical specifications per compute capability (docs/implementations.md).
SHARED_MEMORY_PER_BLOCK = {
  (7, 0): 96 * KB,
  (7, 5): 64 * KB,
  (8, 0): 163 * KB,
  (8, 6): 99 * KB,
  (8, 7): 163 * KB,
  (8, 9): 99 * KB,
  (9, 0): 227 * KB,
  (10, 0): 227 * KB,
  (10, 3): 227 * KB,
  (12, 0): 99 * KB,
}
UNKNOWN_SHARED_MEMORY = 99 * KB  # a capability missing from the table: the smallest of 8.0+


@dataclasses.dataclass(frozen=True)
class DeviceInfo:
  """What the launch heuristics need to know about the GPU (or the CPU, in interpret mode)."""

  platform: str = "cpu"
  name: str = "cpu"
  compute_capability: tuple[int, int] | None = None
  sm_count: int = 132  # an H200's (`INTERPRET`)
  shared_memory_per_block: int = SHARED_MEMORY_PER_BLOCK[HOPPER]


# Off a GPU: the H200 the launches were tuned on (pallas_kernels/triton/tuning/h200.json).
INTERPRET = DeviceInfo()


def compute_capability(device=None) -> tuple[int, int] | None:
  """(major, minor) of an NVIDIA GPU (the first device when None); None for other devices."""
  device = jax.devices()[0] if device is None else device
  try:
    major, minor = str(device.compute_capability).split(".")[:2]
    return int(major), int(minor)
  except (AttributeError, TypeError, ValueError):
    return None


def describe_capability(device) -> str:
  """The compute capability as messages print it ("9.0"), or "unknown"."""
  capability = compute_capability(device)
  return "unknown" if capability is None else ".".join(map(str, capability))


@functools.cache
def device_info(device=None) -> DeviceInfo:
  """DeviceInfo of `device` (default: the first device of the default backend); `INTERPRET`'s
  figures with the device's platform and name off a GPU."""
  device = jax.devices()[0] if device is None else device
  if device.platform != "gpu":
    return dataclasses.replace(INTERPRET, platform=device.platform, name=str(device.device_kind))
  capability = compute_capability(device)
  smem = SHARED_MEMORY_PER_BLOCK.get(capability) if capability else None
  return DeviceInfo(
    platform="gpu",
    name=str(device.device_kind),
    compute_capability=capability,
    sm_count=int(getattr(device, "core_count", 0) or INTERPRET.sm_count),
    shared_memory_per_block=smem or UNKNOWN_SHARED_MEMORY,
  )


def sm_count(device=None) -> int:
  """Streaming multiprocessors of `device` (default: the first device)."""
  return device_info(device).sm_count


def shared_memory_per_block(device=None) -> int:
  """Opt-in shared memory per thread block of `device` in bytes (default: the first device)."""
  return device_info(device).shared_memory_per_block
