"""Old path of the inference steps (now gdp_jax/ops/gqa_decode/api.py and
gdp_jax/ops/step/api.py), kept for the modules that still import them from here."""

from gdp_jax.ops.gqa_decode.api import gqa_decode, paged_gqa_decode
from gdp_jax.ops.step.api import gated_delta_product_step

__all__ = ["gated_delta_product_step", "gqa_decode", "paged_gqa_decode"]
