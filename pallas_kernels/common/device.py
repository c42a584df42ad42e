"""Facts about the device the kernels run on, read from the device itself."""

from __future__ import annotations

import jax


def compute_capability(device=None) -> tuple[int, int] | None:
  """(major, minor) of an NVIDIA GPU (the first device when None); None for other devices."""
  device = jax.devices()[0] if device is None else device
  try:
    major, minor = str(device.compute_capability).split(".")[:2]
    return int(major), int(minor)
  except (AttributeError, TypeError, ValueError):
    return None
