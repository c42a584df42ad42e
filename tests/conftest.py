"""Shared pytest set-up: the GPU switch, the `gpu` marker and the CPU compile level.

Kernels run compiled on a GPU backend and in the Pallas interpreter elsewhere (CI's CPUs). Tests
marked `gpu` need a compiled GPU run (large shapes that would take hours interpreted) and are
skipped, with that reason, on a CPU.

On a CPU-only machine (no jax GPU plugin, or JAX_PLATFORMS=cpu) the tests compile with XLA's
backend optimization level 0: the CPU tests run tiny shapes, so nearly all their time is XLA
compiling (LLVM's optimisation of the generated code), not running it; level 0 compiles about a
third faster and computes the same float32 results (no fast-math either way). The flag goes into
XLA_FLAGS before jax starts its backend, so the subprocesses the tests start (sharding checks,
notebook kernels, scripts) inherit it. An XLA_FLAGS that already sets the level is left alone.
"""

from __future__ import annotations

import importlib.util
import os
import pkgutil

CPU_COMPILE_FLAG = "--xla_backend_optimization_level=0"


def _cpu_only() -> bool:
  platforms = os.environ.get("JAX_PLATFORMS", "")
  if platforms:
    return platforms.split(",") == ["cpu"]
  # GPU plugins (CUDA, ROCm) install modules in the jax_plugins namespace package.
  spec = importlib.util.find_spec("jax_plugins")
  if spec is None or not spec.submodule_search_locations:
    return True
  return not any(True for _ in pkgutil.iter_modules(spec.submodule_search_locations))


if _cpu_only() and "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + CPU_COMPILE_FLAG).strip()

import jax  # noqa: E402  (after XLA_FLAGS: XLA reads them when the backend starts)
import pytest  # noqa: E402

ON_GPU = jax.default_backend() == "gpu"


def pytest_configure(config):
  config.addinivalue_line("markers", "gpu: large shapes, run compiled on a GPU only")


def pytest_collection_modifyitems(config, items):
  if ON_GPU:
    return
  skip = pytest.mark.skip(reason="large shapes run compiled on the GPU only")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)
