"""Shared pytest set-up: the GPU switch and the `gpu` marker.

Kernels run compiled on a GPU backend and in the Pallas interpreter elsewhere (CI's CPUs). Tests
marked `gpu` need a compiled GPU run (large shapes that would take hours interpreted) and are
skipped, with that reason, on a CPU.
"""

from __future__ import annotations

import jax
import pytest

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
