"""`HybridLM.verify_tokens` and `rollback`: the draft tokens' logits of `step_tokens`, and the
cache after any accepted length without recomputation (docs/inference.md#rolling-back-a-model)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gdp_jax.models import HybridConfig, HybridLM, KVCache
from tests.cases import assert_close

VOCAB = 13


@nnx.jit
def verify_and_rollbacks(model, tokens, cache, accepted):
  logits, records = model.verify_tokens(tokens, cache)
  return logits, [model.rollback(records, a) for a in accepted]


@nnx.jit
def step(model, token, cache):
  return model.step(token, cache)


@pytest.mark.parametrize("pattern", ["DA", pytest.param("DHA", marks=pytest.mark.slow)])
def test_verify_tokens_rolls_back_to_any_length(pattern):
  config = HybridConfig(
    vocab_size=VOCAB,
    hidden_size=16,
    layer_pattern=pattern,
    num_heads=2,
    head_dim=8,
    mask_mode="token",
    attn_num_heads=2,
    attn_num_kv_heads=1,
    mlp_ratio=2,
    chunk_size=16,
    implementation="xla",
  )
  model = HybridLM(config, rngs=nnx.Rngs(0))
  tq = 4
  tokens = jax.random.randint(jax.random.key(1), (2, 2 + tq), 0, VOCAB, jnp.int32)
  cache = model.init_cache(2, 12)
  for t in range(2):  # a cache holding two tokens
    _, cache = step(model, tokens[:, t], cache)
  draft = tokens[:, 2:]
  accepted = [jnp.array([0, tq], jnp.int32), jnp.array([1, 3], jnp.int32)]
  logits, rolled = verify_and_rollbacks(model, draft, cache, accepted)
  each, outs = [cache], []  # the cache after m = 0 .. Tq single steps
  for t in range(tq):
    out, new = step(model, draft[:, t], each[-1])
    outs.append(out)
    each.append(new)
  assert_close(logits, jnp.stack(outs, axis=1), 2e-5, "logits versus single steps")
  for acc, got in zip(accepted, rolled):
    for b, m in enumerate(np.asarray(acc)):
      want = each[m]
      for layer, (g, w) in enumerate(zip(got, want)):
        if isinstance(w, KVCache):  # slots at or past the length are stale
          n = int(w.lengths[b])
          assert int(g.lengths[b]) == n
          assert_close(g.key[b, :n], w.key[b, :n], 2e-5, f"layer {layer} keys, m = {m}")
          assert_close(g.value[b, :n], w.value[b, :n], 2e-5, f"layer {layer} values, m = {m}")
        else:
          for x, y in zip(jax.tree.leaves(g), jax.tree.leaves(w)):
            assert x.shape == y.shape and x.dtype == y.dtype
            assert_close(x[b], y[b], 2e-5, f"layer {layer} cache, m = {m}")
