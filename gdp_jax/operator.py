"""Old path of `gated_delta_product` and its checks (now gdp_jax/ops/gated_delta_product/api.py
and gdp_jax/ops/validation.py), kept for the modules that still import it from here."""

from gdp_jax.ops.gated_delta_product.api import gated_delta_product
from gdp_jax.ops.validation import CHUNK_SIZES, check_cu_seqlens, check_cu_seqlens_values

__all__ = ["CHUNK_SIZES", "check_cu_seqlens", "check_cu_seqlens_values", "gated_delta_product"]
