"""Old path of the Householder form (now gdp_jax/ops/householder/api.py), kept for the modules
that still import it from here."""

from gdp_jax.ops.householder.api import householder_delta_product, householder_delta_product_step

__all__ = ["householder_delta_product", "householder_delta_product_step"]
