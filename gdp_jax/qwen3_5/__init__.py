"""Qwen3.5's dense text model on gdp-jax's operators (docs/qwen3_5.md): `Qwen3_5Config`,
`Qwen3_5LM`, `load` / `save` of transformers checkpoints and `generate`."""

from gdp_jax.qwen3_5.config import Qwen3_5Config
from gdp_jax.qwen3_5.loader import load, save
from gdp_jax.qwen3_5.model import Qwen3_5LM

__all__ = ["Qwen3_5Config", "Qwen3_5LM", "load", "save"]
