"""gdp-jax: gated delta product linear attention for JAX (docs/operator.md).

The operator and the inference steps are imported here (their code: gdp_jax/ops/, one folder per
op); the submodules `layers` and `models` (Flax), `sharding`, `varlen` and `ops` load on first
use, e.g. `gdp_jax.layers.GatedDeltaProduct` or `gdp_jax.layers.HouseholderDeltaProduct` after
`import gdp_jax`. The demo, the language-model example and the benchmarks live outside the
package, in the repository's `examples/` and `benchmarks/`.
"""

from __future__ import annotations

import importlib

from gdp_jax.ops.gated_delta_product.api import describe_runtime, gated_delta_product
from gdp_jax.ops.gqa_decode.api import gqa_decode, paged_gqa_decode
from gdp_jax.ops.householder.api import householder_delta_product, householder_delta_product_step
from gdp_jax.ops.step.api import gated_delta_product_step, gated_delta_product_verify, select_state
from gdp_jax.ops.validation import value_checks

__all__ = [
  "describe_runtime",
  "gated_delta_product",
  "gated_delta_product_step",
  "gated_delta_product_verify",
  "gqa_decode",
  "householder_delta_product",
  "householder_delta_product_step",
  "paged_gqa_decode",
  "select_state",
  "value_checks",
]
__version__ = "0.3.0"

# Loaded on first attribute access (flax stays out of `import gdp_jax`).
_SUBMODULES = (
  "layers",
  "models",
  "sharding",
  "varlen",
  "ops",
  "qwen3_5",
)


def __getattr__(name):
  if name in _SUBMODULES:
    return importlib.import_module(f"gdp_jax.{name}")
  raise AttributeError(f"module 'gdp_jax' has no attribute {name!r}")


def __dir__():
  return sorted(set(globals()) | set(_SUBMODULES))
