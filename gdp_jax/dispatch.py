"""The implementations of every public function, and which one runs where: one table.

Each public function (`gated_delta_product`, `gated_delta_product_step`, `gqa_decode`,
`paged_gqa_decode`, and the layers that call them) resolves its `implementation=` argument here.
`None` means the fastest one that works on the default device: "pallas" on an NVIDIA GPU the
kernels support (compute capability >= 8.0: bfloat16 tensor cores, see
docs/implementations.md#supported-gpus), "xla" everywhere else, whatever the input dtype (float16
too: an older GPU such as the T4 runs "xla").
An explicit "pallas" on a CPU runs the kernels in the Pallas interpreter (slow, for tests); on an
unsupported GPU it is an error that names the GPU.

`gated_delta_product` with `cu_seqlens` (packed sequences, docs/varlen.md) looks up
"gated_delta_product_varlen", with the same default.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Mapping

import jax

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


@dataclasses.dataclass(frozen=True)
class Implementation:
  """One implementation: where it runs natively and its entry point per public function.

  entry_points maps a public function's name to "module:attribute", imported on first use (the
  kernels are imported only when asked for).
  """

  name: str
  summary: str
  native_platforms: tuple[str, ...]
  entry_points: Mapping[str, str]

  def entry(self, function: str) -> Callable:
    module, attribute = self.entry_points[function].split(":")
    return getattr(importlib.import_module(module), attribute)


TABLE: dict[str, Implementation] = {
  "reference": Implementation(
    "reference",
    "the definitions in float32 (the recurrence over time; paged decode position by position): "
    "the ground truth",
    ("cpu", "gpu", "tpu"),
    {
      "gated_delta_product": "gdp_jax.reference:gated_delta_product_reference",
      "gated_delta_product_varlen": "gdp_jax.reference:gated_delta_product_reference_varlen",
      "paged_gqa_decode": "gdp_jax.decode:paged_gqa_decode_reference",
    },
  ),
  "xla": Implementation(
    "xla",
    "the chunked WY form and the steps in jnp (any backend)",
    ("cpu", "gpu", "tpu"),
    {
      "gated_delta_product": "gdp_jax.xla:gated_delta_product_xla",
      "gated_delta_product_varlen": "gdp_jax.xla:gated_delta_product_xla_varlen",
      "gated_delta_product_step": "gdp_jax.decode:gated_delta_product_step_xla",
      "gqa_decode": "gdp_jax.decode:gqa_decode_xla",
      "paged_gqa_decode": "gdp_jax.decode:paged_gqa_decode_xla",
    },
  ),
  "pallas": Implementation(
    "pallas",
    "Pallas GPU kernels through the Triton lowering (interpreted off a GPU)",
    ("gpu",),
    {
      "gated_delta_product": "gdp_jax.pallas_impl:gated_delta_product_pallas",
      "gated_delta_product_varlen": "gdp_jax.pallas_impl:gated_delta_product_pallas_varlen",
      "gated_delta_product_step": "gdp_jax.decode:gated_delta_product_step_pallas",
      "gqa_decode": "gdp_jax.decode:gqa_decode_pallas",
      "paged_gqa_decode": "gdp_jax.decode:paged_gqa_decode_pallas",
    },
  ),
}

# Backward passes of the Pallas forward: its own kernels, or the jnp backward of the chunked form
# (gdp_jax/xla_backward.py), a debugging switch.
BACKWARDS = ("pallas", "xla")


def implementations(function: str) -> tuple[str, ...]:
  """Names of the implementations that offer `function`, in table order."""
  return tuple(name for name, impl in TABLE.items() if function in impl.entry_points)


def default_device():
  """The device `None` decides for: the first device of the default backend."""
  return jax.devices()[0]


def _capability(device) -> tuple[int, int] | None:
  try:
    major, minor = str(device.compute_capability).split(".")[:2]
    return int(major), int(minor)
  except (AttributeError, TypeError, ValueError):
    return None


def pallas_supported(device=None) -> bool:
  """True on an NVIDIA GPU whose compute capability the kernels support (any input dtype)."""
  device = default_device() if device is None else device
  if device.platform != "gpu":
    return False
  capability = _capability(device)
  return capability is not None and capability >= MIN_COMPUTE_CAPABILITY


def default_implementation(device=None) -> str:
  """ "pallas" on a supported GPU, "xla" anywhere else."""
  return "pallas" if pallas_supported(device) else "xla"


def describe_runtime(device=None) -> str:
  """One line naming the device and the implementation `None` picks there (for notebooks/logs)."""
  device = default_device() if device is None else device
  if device.platform == "gpu":
    where = (
      f"{device.device_kind} (compute capability {getattr(device, 'compute_capability', '?')})"
    )
  else:
    where = f"{device.platform.upper()} ({device.device_kind})"
  return f"{where}: implementation=None runs {default_implementation(device)!r}"


def resolve(function: str, implementation: str | None, device=None) -> str:
  """Validate `implementation` for `function` (None -> the default) and return its name."""
  names = implementations(function)
  if implementation is None:
    implementation = default_implementation(device)
    return implementation if implementation in names else "xla"
  if implementation not in names:
    raise ValueError(
      f"implementation must be one of {names} or None for {function}, got {implementation!r}"
    )
  if implementation == "pallas":
    device = default_device() if device is None else device
    if device.platform == "gpu" and not pallas_supported(device):
      have = getattr(device, "compute_capability", "unknown")
      need = ".".join(map(str, MIN_COMPUTE_CAPABILITY))
      raise ValueError(
        f"implementation='pallas' needs an NVIDIA GPU of compute capability >= {need} "
        f"(bfloat16 tensor cores, for every input dtype; e.g. {', '.join(SUPPORTED_GPUS)}); "
        f"this device is "
        f"{device.device_kind} with compute capability {have}. Use implementation='xla' "
        f"(or None, which picks it here)."
      )
  return implementation


def entry(function: str, implementation: str) -> Callable:
  """The entry point of `implementation` for `function` (after `resolve`)."""
  return TABLE[implementation].entry(function)


def raise_if_differentiated(fn: Callable, message: str) -> Callable:
  """fn unchanged when evaluated; differentiating it (any mode) raises
  NotImplementedError(message), a clear error instead of one deep inside the Pallas lowering."""
  fn = jax.custom_jvp(fn)

  def jvp(primals, tangents):
    raise NotImplementedError(message)

  fn.defjvp(jvp)
  return fn


def check_backward(backward: str, implementation: str) -> str:
  if backward not in BACKWARDS:
    raise ValueError(f"backward must be one of {BACKWARDS}, got {backward!r}")
  if backward != "pallas" and implementation != "pallas":
    raise ValueError(
      f"backward={backward!r} selects the backward of the Pallas forward; "
      f"implementation={implementation!r} has its own (autodiff)"
    )
  return backward
