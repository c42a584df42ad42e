"""The implementations of every public function, and which one runs where: one table.

Each public function (`gated_delta_product`, `gated_delta_product_step`, `gqa_decode`,
`paged_gqa_decode`, and the layers that call them) resolves its `implementation=` argument here
(docs/implementations.md#supported-gpus). The table maps each function to its implementations,
instances of `gdp_jax.ops.base.Implementation` with their default config, by name:

  "reference"  the definitions in float32, the ground truth
  "xla"        jnp (any backend)
  "triton"     the Pallas kernels through the Triton lowering (interpreted off a GPU)
  "mosaic_gpu" gated_delta_product only: the Mosaic GPU forward for Hopper with the Triton
               backward (interpreted off a GPU)

Two more names are accepted everywhere: "pallas", the best Pallas kernel backend for the device
(`pallas_backend`: a backend registered with a device rule, in `PALLAS_PREFERENCE` order:
"mosaic_gpu" for gated_delta_product on compute capability 9.0, with the inputs its kernels cannot
take sent to "triton" (`automatic_config`); "triton" everywhere else), and None, the best of
all: the Pallas backend on an NVIDIA GPU the kernels support (compute capability >= 8.0:
bfloat16 tensor cores), "xla" everywhere else, whatever the input
dtype (float16 too: an older GPU such as the T4 runs "xla"). An explicit kernel backend on a CPU
runs the kernels in the Pallas interpreter (slow, for tests); on an unsupported GPU it is an error
that names the GPU.

`gated_delta_product` with `cu_seqlens` (packed sequences, docs/varlen.md) looks up
"gated_delta_product_varlen": the same implementations' `varlen` method.
"""

from __future__ import annotations

from collections.abc import Callable

import jax

from gdp_jax.ops.autodiff import raise_if_differentiated  # noqa: F401 (re-exported)
from gdp_jax.ops.base import Implementation
from gdp_jax.ops.gated_delta_product import mosaic_gpu as gdp_mosaic_gpu
from gdp_jax.ops.gated_delta_product import reference as gdp_reference
from gdp_jax.ops.gated_delta_product import triton as gdp_triton
from gdp_jax.ops.gated_delta_product import xla as gdp_xla
from gdp_jax.ops.gqa_decode import reference as decode_reference
from gdp_jax.ops.gqa_decode import triton as decode_triton
from gdp_jax.ops.gqa_decode import xla as decode_xla
from gdp_jax.ops.step import triton as step_triton
from gdp_jax.ops.step import xla as step_xla

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

# function -> {name: instance with the default config}, in the order the docs list them.
TABLE: dict[str, dict[str, Implementation]] = {
  "gated_delta_product": {
    "reference": gdp_reference.ReferenceGatedDeltaProduct(),
    "xla": gdp_xla.XlaGatedDeltaProduct(),
    "triton": gdp_triton.TritonGatedDeltaProduct(),
    "mosaic_gpu": gdp_mosaic_gpu.MosaicGpuGatedDeltaProduct(),
  },
  "gated_delta_product_step": {
    "xla": step_xla.XlaStep(),
    "triton": step_triton.TritonStep(),
  },
  "gqa_decode": {
    "xla": decode_xla.XlaGqaDecode(),
    "triton": decode_triton.TritonGqaDecode(),
  },
  "paged_gqa_decode": {
    "reference": decode_reference.ReferencePagedGqaDecode(),
    "xla": decode_xla.XlaPagedGqaDecode(),
    "triton": decode_triton.TritonPagedGqaDecode(),
  },
}
# Functions served by a method of another function's implementations.
_METHODS = {"gated_delta_product_varlen": ("gated_delta_product", "varlen")}


def _capability(device) -> tuple[int, int] | None:
  try:
    major, minor = str(device.compute_capability).split(".")[:2]
    return int(major), int(minor)
  except (AttributeError, TypeError, ValueError):
    return None


# The Pallas backends in order of preference, each with the compute capabilities it serves: the
# first one registered for a function whose rule accepts the device is what "pallas" means there.
# "mosaic_gpu" (gated_delta_product only) comes first on Hopper: the Mosaic forward, the Triton
# backward (docs/implementations.md#mosaic-gpu).
Preference = tuple[str, Callable[[tuple[int, int]], bool]]
MOSAIC_GPU_PREFERENCE: Preference = ("mosaic_gpu", lambda capability: capability in ((9, 0),))
PALLAS_PREFERENCE: tuple[Preference, ...] = (
  MOSAIC_GPU_PREFERENCE,
  ("triton", lambda capability: capability >= MIN_COMPUTE_CAPABILITY),
)


def register(function: str, implementation: Implementation) -> None:
  """Add (or replace) `implementation` under its name for `function`."""
  TABLE[function][implementation.name] = implementation


def _table(function: str) -> dict[str, Implementation]:
  op, _ = _METHODS.get(function, (function, None))
  if op not in TABLE:
    raise ValueError(f"unknown function {function!r}; known: {(*TABLE, *_METHODS)}")
  return TABLE[op]


def backends(function: str) -> tuple[str, ...]:
  """Names of the implementations of `function` in the table (no "pallas" alias), in order."""
  return tuple(_table(function))


def pallas_backends(function: str) -> tuple[str, ...]:
  """The Pallas kernel backends registered for `function`."""
  return tuple(name for name, impl in _table(function).items() if impl.pallas)


def implementations(function: str) -> tuple[str, ...]:
  """Every name `function` accepts: its backends, then "pallas" when it has a kernel backend."""
  names = backends(function)
  return names + ((PALLAS,) if pallas_backends(function) else ())


def is_pallas(name: str | None) -> bool:
  """True for "pallas" and for the name of a Pallas kernel backend of any function."""
  return name == PALLAS or any(name in table and table[name].pallas for table in TABLE.values())


def default_device():
  """The device `None` decides for: the first device of the default backend."""
  return jax.devices()[0]


def pallas_supported(device=None) -> bool:
  """True on an NVIDIA GPU whose compute capability the kernels support (any input dtype)."""
  device = default_device() if device is None else device
  if device.platform != "gpu":
    return False
  capability = _capability(device)
  return capability is not None and capability >= MIN_COMPUTE_CAPABILITY


def pallas_backend(function: str = "gated_delta_product", device=None) -> str:
  """The Pallas backend "pallas" means for `function` on `device` (off a GPU: the last one in
  `PALLAS_PREFERENCE` that is registered, run interpreted)."""
  device = default_device() if device is None else device
  registered = pallas_backends(function)
  capability = _capability(device) if device.platform == "gpu" else None
  for name, serves in PALLAS_PREFERENCE:
    if name in registered and capability is not None and serves(capability):
      return name
  fallback = [name for name, _ in PALLAS_PREFERENCE if name in registered]
  return fallback[-1] if fallback else registered[0]


def default_implementation(device=None, function: str = "gated_delta_product") -> str:
  """The best Pallas backend for `function` on a supported GPU, "xla" anywhere else."""
  return pallas_backend(function, device) if pallas_supported(device) else "xla"


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


def _check_gpu(name: str, device) -> None:
  if device.platform == "gpu" and not pallas_supported(device):
    have = getattr(device, "compute_capability", "unknown")
    need = ".".join(map(str, MIN_COMPUTE_CAPABILITY))
    raise ValueError(
      f"implementation={name!r} needs an NVIDIA GPU of compute capability >= {need} "
      f"(bfloat16 tensor cores, for every input dtype; e.g. {', '.join(SUPPORTED_GPUS)}); "
      f"this device is "
      f"{device.device_kind} with compute capability {have}. Use implementation='xla' "
      f"(or None, which picks it here)."
    )


def resolve(function: str, implementation: str | None, device=None) -> str:
  """Validate `implementation` for `function` and return the name of the backend that runs:
  None -> the default for the device, "pallas" -> its best Pallas backend."""
  names = implementations(function)
  if implementation is None:
    implementation = default_implementation(device, function)
    return implementation if implementation in names else "xla"
  if not isinstance(implementation, str) or implementation not in names:
    raise ValueError(
      f"implementation must be one of {names} or None for {function}, got {implementation!r}"
    )
  if is_pallas(implementation):
    device = default_device() if device is None else device
    _check_gpu(implementation, device)
  if implementation == PALLAS:
    implementation = pallas_backend(function, device)
  return implementation


def automatic_config(function: str, requested: str | None, name: str) -> dict:
  """Config for implementation `name` when `resolve` chose it for `requested` (None or "pallas"):
  a backend picked for the device, not by name, takes every input its function takes, so one
  with a `fallback` field ("mosaic_gpu") sends the inputs its kernels cannot take to the next
  backend instead of raising."""
  if requested not in (None, PALLAS):
    return {}
  return {"fallback": True} if hasattr(implementation(function, name), "fallback") else {}


def implementation(function: str, name: str) -> Implementation:
  """The instance registered as `name` (after `resolve`) for `function`, default config."""
  return _table(function)[name]


def entry(function: str, name: str, **config) -> Callable:
  """The callable of implementation `name` (after `resolve`) for `function`, with `config`
  replacing fields of its default config."""
  impl = implementation(function, name)
  if config:
    impl = impl.replace(**config)
  _, method = _METHODS.get(function, (function, None))
  return impl if method is None else getattr(impl, method)


# Backward passes of the Pallas forward: its own kernels, or the jnp backward of the chunked form
# (gdp_jax/ops/gated_delta_product/xla_backward.py), a debugging switch.
BACKWARDS = ("pallas", "xla")


def check_backward(backward: str, implementation: str) -> str:
  if backward not in BACKWARDS:
    raise ValueError(f"backward must be one of {BACKWARDS}, got {backward!r}")
  if backward != "pallas" and not is_pallas(implementation):
    raise ValueError(
      f"backward={backward!r} selects the backward of the Pallas forward; "
      f"implementation={implementation!r} has its own (autodiff)"
    )
  return backward
