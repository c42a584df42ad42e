"""gdp-jax: gated delta product linear attention for JAX (docs/operator.md)."""

from gdp_jax.decode import gated_delta_product_step, gqa_decode
from gdp_jax.householder import householder_delta_product, householder_delta_product_step
from gdp_jax.operator import gated_delta_product

__all__ = ["gated_delta_product", "gated_delta_product_step", "gqa_decode",
           "householder_delta_product", "householder_delta_product_step"]
__version__ = "0.1.0"
