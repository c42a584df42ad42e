"""The jax versions gdp-jax supports and the jax names that differ between them
(docs/implementations.md#jax-versions).

pyproject.toml takes jax from `OLDEST` through `NEWEST`; CI runs the whole suite on `OLDEST` and the
Mosaic GPU lowering and interpreter tests on `NEWEST` (`make test-jax-newest`). The public Pallas
and Mosaic GPU names the kernels use (`jax.experimental.pallas`, its `mosaic_gpu` and `triton`
modules, `jax.experimental.mosaic.gpu`) are the same across the range. What jax keeps private and
the tests reach (the Mosaic GPU interpreter's race record, the Pallas Triton lowering's internals)
is imported here only, so a release that moves it is one fix in this module.
"""

from __future__ import annotations

import re
import types

import jax

OLDEST = "0.11.2"
NEWEST = "0.12.0.1"


def version_tuple(version: str) -> tuple[int, ...]:
  """ "0.12.0.1" -> (0, 12, 0, 1); a suffix such as ".dev20260101" or "rc1" is dropped."""
  return tuple(int(part) for part in re.findall(r"\d+", version.split("rc")[0].split(".dev")[0]))


def supported(version: str | None = None) -> bool:
  """Whether `version` (default: the installed jax) lies in OLDEST..NEWEST."""
  have = version_tuple(jax.__version__ if version is None else version)
  return version_tuple(OLDEST) <= have <= version_tuple(NEWEST)


def interpreter_races():
  """The Mosaic GPU interpreter's record of data races of its last run with
  `InterpretGPUParams(detect_races=True)` (`.races_found`)."""
  from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import get_races

  return get_races()


def triton_lowering_internals() -> types.SimpleNamespace:
  """The Pallas Triton lowering's modules that tests/triton_lowering.py patches to lower for an
  H200 on a CPU: `gpu_info`, `lowering` and `registration` (pallas_call_registration)."""
  from jax._src.pallas.triton import gpu_info, lowering
  from jax._src.pallas.triton import pallas_call_registration as registration

  return types.SimpleNamespace(gpu_info=gpu_info, lowering=lowering, registration=registration)


def pallas_call_name(eqn) -> str:
  """The kernel name of a `pallas_call` equation of a jaxpr (its `name` parameter, a string in
  every supported jax; older ones kept it in `name_and_src_info`)."""
  return str(eqn.params["name"])
