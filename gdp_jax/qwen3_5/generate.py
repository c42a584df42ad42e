"""`generate` for `Qwen3_5LM`: greedy or sampled continuation of a batch of prompts
(docs/qwen3_5.md#generating).

The prompts (right-padded to a multiple of `pad_to`) go through the model once (the chunked
`gated_delta_product` and causal attention), which leaves per layer the convolution's last
inputs and the recurrent state [B, HV, K, V] (Gated DeltaNet) or the KV cache (attention); then
a `jax.lax.fori_loop` of `Qwen3_5LM.step` (`gated_delta_product_step`, `gqa_decode`) makes the
new tokens. Prefill and loop are one jitted program, compiled once per bucket of prompt length
and of max_new_tokens (multiples of `pad_to`); the lengths and the step count are traced.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gdp_jax.qwen3_5.model import Qwen3_5LM, check_tokens


def _round_up(n: int, m: int) -> int:
  return -(-n // m) * m


def _pick(logits, key, rows, j, temperature, top_k):
  """The next token of each row: argmax, or a draw from softmax(logits / temperature) (over
  the top_k largest when given) with the key fold_in(fold_in(key, row), j)."""
  if temperature == 0.0:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  logits = logits / temperature
  if top_k is not None:
    kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
    logits = jnp.where(logits < kth, -jnp.inf, logits)
  keys = jax.vmap(lambda b: jax.random.fold_in(jax.random.fold_in(key, b), j))(rows)
  return jax.vmap(jax.random.categorical)(keys, logits).astype(jnp.int32)


@functools.partial(
  jax.jit, static_argnames=("graphdef", "capacity", "cache_size", "temperature", "top_k")
)
def _program(
  graphdef, state, tokens, lengths, key, new_tokens, capacity, cache_size, temperature, top_k
):
  model = nnx.merge(graphdef, state)
  batch = tokens.shape[0]
  rows = jnp.arange(batch)
  logits, cache = model.prefill(tokens, lengths, cache_size)
  first = _pick(logits[rows, lengths - 1], key, rows, 0, temperature, top_k)
  out = jnp.zeros((batch, capacity), jnp.int32).at[:, 0].set(first)

  def body(j, carry):
    token, cache, out = carry
    logits, cache = model.step(token, cache)
    token = _pick(logits, key, rows, j, temperature, top_k)
    return token, cache, out.at[:, j].set(token)

  _, _, out = jax.lax.fori_loop(1, new_tokens, body, (first, cache, out))
  return out


def generate(
  model: Qwen3_5LM,
  prompts: Sequence[Sequence[int]] | jax.Array | np.ndarray,
  max_new_tokens: int,
  *,
  temperature: float = 0.0,
  top_k: int | None = None,
  rng: jax.Array | None = None,
  pad_to: int = 16,
) -> jax.Array:
  """Continue a batch of prompts.

  Args:
    model: a `Qwen3_5LM`.
    prompts: a list of token-id sequences (lengths may differ, each >= 1), or an int array
      [B, T] (every row T tokens).
    max_new_tokens: tokens to generate per prompt (>= 1; no end-of-sequence stop).
    temperature: 0 (default) greedy, else sampling from softmax(logits / temperature).
    top_k: with sampling, draw among the top_k most likely tokens only (None: all).
    rng: a `jax.random` key for sampling (default key 0).
    pad_to: prompt length and max_new_tokens are rounded up to multiples of this, so calls
      within one bucket reuse the compiled program.

  Returns:
    int32 [B, max_new_tokens].
  """
  if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
    raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
  if temperature < 0:
    raise ValueError(f"temperature must be >= 0, got {temperature!r}")
  vocab = model.config.vocab_size
  if top_k is not None and not (isinstance(top_k, int) and 1 <= top_k <= vocab):
    raise ValueError(
      f"top_k must be None or an integer in [1, vocab_size = {vocab}], got {top_k!r}"
    )
  if isinstance(prompts, (jax.Array, np.ndarray)):
    tokens = np.asarray(prompts)
    if tokens.ndim != 2 or tokens.shape[1] < 1:
      raise ValueError(f"prompts as an array must be [B, T] with T >= 1, got shape {tokens.shape}")
    lengths = np.full((tokens.shape[0],), tokens.shape[1], np.int32)
  else:
    seqs = [np.asarray(p).reshape(-1) for p in prompts]
    if not seqs or min(len(s) for s in seqs) < 1:
      raise ValueError("prompts must be a non-empty list of non-empty token sequences")
    lengths = np.array([len(s) for s in seqs], np.int32)
    tokens = np.zeros((len(seqs), int(lengths.max())), np.int64)
    for i, s in enumerate(seqs):
      tokens[i, : len(s)] = s
  check_tokens(tokens, vocab, "prompts")
  t_pad = _round_up(tokens.shape[1], pad_to)
  tokens = np.pad(tokens, ((0, 0), (0, t_pad - tokens.shape[1]))).astype(np.int32)
  capacity = _round_up(max_new_tokens, pad_to)
  graphdef, state = nnx.split(model)
  out = _program(
    graphdef,
    state,
    tokens,
    lengths,
    jax.random.key(0) if rng is None else rng,
    np.int32(max_new_tokens),
    capacity=capacity,
    cache_size=t_pad + capacity,
    temperature=float(temperature),
    top_k=top_k,
  )
  return out[:, :max_new_tokens]
