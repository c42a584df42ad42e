"""Which implementation of an op runs where: the `Registry` each op's `api.py` keeps.

An op lists its implementations in order of preference (tokamax's layout,
docs/implementations.md#choosing-an-implementation). `implementation=None` walks that list and
takes the first one picked automatically whose device rule serves the device and whose inputs
rule takes the call; "pallas" does the same over the Pallas kernel backends only; a name is
obeyed, and a named implementation that cannot take the inputs is a ValueError saying why. This
module imports no implementation: each op builds its own registry from its own modules.
"""

from __future__ import annotations

from collections.abc import Iterable

import jax

from gdp_jax.ops.base import Implementation
from pallas_kernels.common import backend
from pallas_kernels.common.device import compute_capability, describe_capability

# Oldest compute capability the Pallas kernels support: bf16 tensor-core dots (Ampere and later).
MIN_COMPUTE_CAPABILITY = (8, 0)
SUPPORTED_GPUS = (
  "A100 / A30 (8.0)",
  "A10 / RTX 30xx (8.6)",
  "L4 / L40 / RTX 40xx (8.9)",
  "H100 / H200 (9.0)",
  "B200 (10.0)",
  "RTX 50xx / RTX PRO (12.0)",
)
PALLAS = "pallas"
# Backward passes of a Pallas forward: its own kernels, or the jnp backward of the chunked form
# (gdp_jax/ops/gated_delta_product/xla_backward.py), a debugging switch.
BACKWARDS = ("pallas", "xla")


def default_device():
  """The device `None` decides for: the first device of the default backend."""
  return jax.devices()[0]


def interpreted() -> bool:
  """Whether the Pallas kernels run in the Pallas interpreter here (off a GPU, or when asked:
  docs/implementations.md#choosing-an-implementation)."""
  return backend.interpret_mode()


def pallas_supported(device=None) -> bool:
  """True on an NVIDIA GPU whose compute capability the kernels support (any input dtype)."""
  device = default_device() if device is None else device
  if device.platform != "gpu":
    return False
  capability = compute_capability(device)
  return capability is not None and capability >= MIN_COMPUTE_CAPABILITY


def _check_gpu(name: str, device) -> None:
  if device.platform == "gpu" and not pallas_supported(device):
    have = describe_capability(device)
    need = ".".join(map(str, MIN_COMPUTE_CAPABILITY))
    raise ValueError(
      f"implementation={name!r} needs an NVIDIA GPU of compute capability >= {need} "
      f"(bfloat16 tensor cores, for every input dtype; e.g. {', '.join(SUPPORTED_GPUS)}); "
      f"this device is {device.device_kind} with compute capability {have}. Use "
      f"implementation='xla' (or None, which picks it here)."
    )


def check_backward(backward: str, implementation: Implementation) -> str:
  """`backward` for `implementation`: "pallas" always, "xla" with a Pallas backend only."""
  if backward not in BACKWARDS:
    raise ValueError(f"backward must be one of {BACKWARDS}, got {backward!r}")
  if backward != "pallas" and not implementation.pallas:
    raise ValueError(
      f"backward={backward!r} selects the backward of the Pallas forward; "
      f"implementation={implementation.name!r} has its own (autodiff)"
    )
  return backward


class Registry:
  """The implementations of one op, by name, in order of preference."""

  def __init__(self, function: str, implementations: Iterable[Implementation]):
    self.function = function
    self._table: dict[str, Implementation] = {impl.name: impl for impl in implementations}

  def names(self) -> tuple[str, ...]:
    """The implementations' names in order of preference (no "pallas" alias)."""
    return tuple(self._table)

  def pallas_names(self) -> tuple[str, ...]:
    return tuple(name for name, impl in self._table.items() if impl.pallas)

  def accepted(self) -> tuple[str, ...]:
    """Every name `implementation=` takes: the implementations, then "pallas" when there is a
    kernel backend."""
    return self.names() + ((PALLAS,) if self.pallas_names() else ())

  def is_pallas(self, name: str | None) -> bool:
    return name == PALLAS or (name in self._table and self._table[name].pallas)

  def register(self, implementation: Implementation, *, before: str | None = None) -> None:
    """Add `implementation` under its name: last in preference, or just before the
    implementation named `before`; one of the same name is replaced where it stands."""
    if before is None and implementation.name in self._table:
      self._table = {**self._table, implementation.name: implementation}
      return
    items = [(n, i) for n, i in self._table.items() if n != implementation.name]
    at = len(items) if before is None else [n for n, _ in items].index(before)
    items.insert(at, (implementation.name, implementation))
    self._table = dict(items)

  def get(self, name: str) -> Implementation:
    return self._table[name]

  def resolve(self, implementation: str | None, device=None, problem=None) -> Implementation:
    """The implementation that runs for `implementation=` (a name, "pallas" or None) on
    `device`, for the call `problem` describes (None: any call)."""
    names = self.accepted()
    if implementation is not None and (
      not isinstance(implementation, str) or implementation not in names
    ):
      raise ValueError(
        f"implementation must be one of {names} or None for {self.function}, got {implementation!r}"
      )
    device = default_device() if device is None else device
    if implementation is None and not pallas_supported(device):
      return self._table["xla"]
    if implementation in (None, PALLAS):
      if implementation == PALLAS:
        _check_gpu(PALLAS, device)
      return self._first(device, problem)
    impl = self._table[implementation]
    if impl.pallas:
      _check_gpu(implementation, device)
      capability = compute_capability(device)
      if device.platform == "gpu" and capability is not None and not impl.serves(capability):
        raise ValueError(
          f"implementation={implementation!r} does not run on {device.device_kind} (compute "
          f"capability {'.'.join(map(str, capability))}): {impl.device_rule}; use "
          f"implementation='pallas' (or None) to pick the kernels for this GPU"
        )
    reason = None if problem is None else impl.unsupported(problem, named=True)
    if reason is not None:
      raise ValueError(reason)
    return impl

  def _first(self, device, problem) -> Implementation:
    """The first Pallas backend picked automatically that serves `device` and takes `problem`;
    off a GPU the last Pallas backend (interpreted)."""
    capability = compute_capability(device) if device.platform == "gpu" else None
    pallas = [impl for impl in self._table.values() if impl.pallas and impl.automatic]
    for impl in pallas:
      if capability is None or not impl.serves(capability):
        continue
      if problem is None or impl.unsupported(problem, named=False) is None:
        return impl
    return pallas[-1]
