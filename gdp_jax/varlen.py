"""`gdp_jax.varlen` is gdp_jax/ops/gated_delta_product/varlen.py (packed sequences,
docs/varlen.md; the same module object)."""

import sys

from gdp_jax.ops.gated_delta_product import varlen as _varlen
from gdp_jax.ops.gated_delta_product.varlen import *  # noqa: F403 (the names, for type checkers)

sys.modules[__name__] = _varlen
