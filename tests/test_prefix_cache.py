"""`generate(..., prefix_cache=PrefixCache(...))`: the tokens of a call without the cache, and a
prompt sharing cached blocks with an earlier one computes only its own tokens
(docs/inference.md#prefix-caching)."""

from __future__ import annotations

import numpy as np
import pytest
from flax import nnx

from gdp_jax.models import HybridConfig, HybridLM, PrefixCache, generate, prefix

VOCAB = 17


def tiny(seed=0, pattern="DA"):
  # the delta layers over the operator's recurrence ("reference"): what is checked is the
  # prefix cache's reuse of blocks, and its programs compile fastest
  config = HybridConfig(
    vocab_size=VOCAB,
    hidden_size=16,
    layer_pattern=pattern,
    num_heads=2,
    head_dim=8,
    attn_num_heads=2,
    attn_num_kv_heads=1,
    mlp_ratio=2,
    chunk_size=16,
    implementation="reference",
  )
  return HybridLM(config, rngs=nnx.Rngs(seed))


@pytest.mark.parametrize(
  "pattern, page_size, per_call",
  [("DA", None, 8), pytest.param("DHA", 16, None, marks=pytest.mark.slow)],  # slow: 7 s
)
def test_prefix_cache_same_tokens_fewer_computed(pattern, page_size, per_call):
  model = tiny(pattern=pattern)
  rng = np.random.default_rng(0)
  shared = rng.integers(0, VOCAB, 32)
  first = np.concatenate([shared, rng.integers(0, VOCAB, 8)])  # 40 tokens: 2 whole blocks
  second = np.concatenate([shared, rng.integers(0, VOCAB, 9)])  # the same 2 blocks, then 9
  cache = PrefixCache(block_tokens=16, max_entries=8, tokens_per_call=per_call)
  whole = prefix._whole_program._cache_size()
  programs = []
  for prompt, computed, reused in ((first, 40, 0), (second, 49, 32), (first, 57, 64)):
    plain = generate(model, [prompt], 5, pad_to=16, page_size=page_size)
    cached = generate(model, [prompt], 5, pad_to=16, page_size=page_size, prefix_cache=cache)
    np.testing.assert_array_equal(np.asarray(cached), np.asarray(plain))
    assert (cache.computed_tokens, cache.reused_tokens) == (computed, reused)
    programs.append((prefix._block_program._cache_size(), prefix._load_program._cache_size()))
  assert programs[1] == programs[2]  # every block of every prompt: the programs compiled once
  # the first prompt (nothing cached) in one prefill with state_every, but with a DeltaProduct
  # layer (no state_every) block by block
  assert (prefix._whole_program._cache_size() > whole) == (pattern == "DA")
  assert len(cache) == 2 and cache.hits == 2  # the two prompts share their whole blocks


def test_prefix_cache_evicts_deepest_blocks_first():
  cache = PrefixCache(block_tokens=2, max_entries=3)
  keys = cache.keys(np.arange(7))
  assert len(keys) == 3 and len(set(keys)) == 3
  assert cache.keys(np.arange(4)) == keys[:2]  # a block's key hashes the whole prefix
  assert cache.keys([9, 1, 2, 3])[1] != keys[1]
  # through generate (the programs of the test above): of a prompt's 2 blocks, the first stays
  cache = PrefixCache(block_tokens=16, max_entries=1, tokens_per_call=8)
  prompt = np.arange(40) % VOCAB
  generate(tiny(), [prompt], 5, pad_to=16, prefix_cache=cache)
  assert len(cache) == 1 and cache.cached_blocks(prompt) == 1


def test_prefix_cache_errors():
  model = tiny()
  with pytest.raises(ValueError, match="block_tokens"):
    PrefixCache(block_tokens=0)
  with pytest.raises(ValueError, match="tokens_per_call"):
    PrefixCache(tokens_per_call=1.5)  # type: ignore[arg-type]
  cache = PrefixCache(block_tokens=16)
  with pytest.raises(ValueError, match="one prompt per call"):
    generate(model, [[1, 2], [3, 4]], 2, prefix_cache=cache)
  with pytest.raises(ValueError, match="prefill must be 'auto'"):
    generate(model, [[1, 2]], 2, prefix_cache=cache, prefill="chunked")
  with pytest.raises(TypeError, match="PrefixCache"):
    generate(model, [[1, 2]], 2, prefix_cache={})  # type: ignore[arg-type]
  cache.bind(model)
  with pytest.raises(ValueError, match="another model"):
    cache.bind(tiny(1))
