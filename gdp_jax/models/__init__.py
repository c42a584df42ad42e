"""A small hybrid causal language model (gated delta product, DeltaProduct and grouped-query
attention layers) and `generate` for a batch of prompts of different lengths.

    config = HybridConfig(vocab_size=256, hidden_size=128, layer_pattern="DDA")   # or e.g. "DHA"
    model = HybridLM(config, rngs=nnx.Rngs(0))
    logits = model(tokens)                                 # [B, T, vocab] float32
    new_tokens = generate(model, [[1, 2, 3], [4, 5]], 8)   # [B, 8] int32, greedy

Modules: config (HybridConfig), block (one layer), model (HybridLM), scan (layers of one
configuration compiled once, docs/train_lm.md#compile-time), paged (the paged KV cache,
docs/inference.md#paged-kv-cache), generation (`generate`'s programs, docs/inference.md).
"""

from __future__ import annotations

from gdp_jax.layers import GatedDeltaProductCache, KVCache
from gdp_jax.models import generation as _generation
from gdp_jax.models.block import Block, SwiGLU
from gdp_jax.models.config import CONFIG_MASK_MODES, LAYER_KINDS, HybridConfig
from gdp_jax.models.generation import (
  DECODE_COMPILER_OPTIONS,
  PREFILL_COMPILER_OPTIONS,
  PREFILL_MODES,
  STEP_PREFILL_TOKENS,
  GenerateCall,
  generate,
  generate_call,
  generate_programs,
)
from gdp_jax.models.model import HybridLM
from gdp_jax.models.paged import (
  PagedKVCache,
  paged_attention_step,
  paged_attention_step_tokens,
  to_paged,
)

# generate's jitted programs and helpers (read by tests and benchmarks as gdp_jax.models._prefill)
_prefill, _decode = _generation._prefill, _generation._decode
_jitted_prefill, _jitted_decode = _generation._jitted_prefill, _generation._jitted_decode
_jitted_prompt_decode, _options_key = _generation._jitted_prompt_decode, _generation._options_key

__all__ = [
  "CONFIG_MASK_MODES",
  "DECODE_COMPILER_OPTIONS",
  "LAYER_KINDS",
  "PREFILL_COMPILER_OPTIONS",
  "PREFILL_MODES",
  "STEP_PREFILL_TOKENS",
  "Block",
  "GatedDeltaProductCache",
  "GenerateCall",
  "HybridConfig",
  "HybridLM",
  "KVCache",
  "PagedKVCache",
  "SwiGLU",
  "generate",
  "generate_call",
  "generate_programs",
  "paged_attention_step",
  "paged_attention_step_tokens",
  "to_paged",
]
