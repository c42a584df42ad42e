"""Greedy speculative decoding with two `gdp_jax.models.HybridLM`s (docs/inference.md
#verifying-draft-tokens): a draft proposes k tokens step by step, the target scores them in one
`step_tokens` call, and the prefix both agree on is kept with the target's next token: plain
greedy decoding's tokens, with fewer target calls.

    python examples/speculative.py                   # a CPU, under a minute
    python examples/speculative.py --new-tokens 64 --draft-tokens 6

The draft is the target's first layers with its embedding, final norm and head (layer skip);
the untrained target's later layers are scaled by `--late-scale` (small residual contributions)
so that the pair agrees often. Only the public API of `gdp_jax.models` is used: a rejected draft
is rolled back by recomputing the target's cache over the accepted tokens (caches are values).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gdp_jax.models import HybridConfig, HybridLM, generate


@dataclasses.dataclass
class Counts:
  """Model calls: prefills, target `step_tokens` calls (verify and rollback), draft steps."""

  target_prefill: int = 0
  target_verify: int = 0
  target_rollback: int = 0
  draft_prefill: int = 0
  draft_steps: int = 0
  accepted: int = 0
  proposed: int = 0

  @property
  def target_calls(self) -> int:
    return self.target_prefill + self.target_verify + self.target_rollback


@functools.partial(jax.jit, static_argnums=(0, 4))
def _prefill(graphdef, state, tokens, lengths, cache_size):
  model = nnx.merge(graphdef, state)
  logits, cache = model.prefill(tokens, lengths, cache_size)
  last = jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0]
  return jnp.argmax(last, -1).astype(jnp.int32), cache


@functools.partial(jax.jit, static_argnums=0)
def _step(graphdef, state, token, cache):
  logits, cache = nnx.merge(graphdef, state).step(token, cache)
  return jnp.argmax(logits, -1).astype(jnp.int32), cache


@functools.partial(jax.jit, static_argnums=0)
def _step_tokens(graphdef, state, tokens, cache):
  logits, cache = nnx.merge(graphdef, state).step_tokens(tokens, cache)
  return jnp.argmax(logits, -1).astype(jnp.int32), cache


def speculative_generate(
  target: HybridLM,
  draft: HybridLM,
  prompts: np.ndarray,
  lengths: np.ndarray,
  max_new_tokens: int,
  draft_tokens: int = 4,
) -> tuple[np.ndarray, Counts]:
  """Greedy tokens [B, max_new_tokens] of `target` after right-padded prompts [B, T] of
  `lengths`, with `draft` proposing `draft_tokens` (k) tokens per round. Every row keeps the
  same number of draft tokens per round (the smallest any row accepts), so the caches stay in
  step. Returns the tokens and the model calls (`Counts`)."""
  k = draft_tokens
  counts = Counts()
  t_graph, t_state = nnx.split(target)
  d_graph, d_state = nnx.split(draft)
  cache_size = prompts.shape[1] + max_new_tokens + k + 2
  lengths_j = jnp.asarray(lengths, jnp.int32)
  cur, t_cache = _prefill(t_graph, t_state, jnp.asarray(prompts), lengths_j, cache_size)
  _, d_cache = _prefill(d_graph, d_state, jnp.asarray(prompts), lengths_j, cache_size)
  counts.target_prefill += 1
  counts.draft_prefill += 1
  out = [np.asarray(cur)]  # committed tokens, [B] each; cur is in neither model's cache yet
  pending = [cur]  # what the draft has not read yet
  while len(out) < max_new_tokens:
    # the draft proposes d_1..d_k; d_caches[i]: its cache after reading cur, d_1, ..., d_i
    for token in pending:
      proposal, d_cache = _step(d_graph, d_state, token, d_cache)
      counts.draft_steps += 1
    drafts, d_caches = [proposal], [d_cache]
    for _ in range(k - 1):
      proposal, d_cache = _step(d_graph, d_state, drafts[-1], d_cache)
      counts.draft_steps += 1
      drafts.append(proposal)
      d_caches.append(d_cache)
    # the target scores cur, d_1..d_k at once: preds[:, i] is its token after d_i (cur at i = 0)
    tokens = jnp.stack([cur, *drafts], axis=1)
    preds, verified = _step_tokens(t_graph, t_state, tokens, t_cache)
    counts.target_verify += 1
    agree = np.cumprod(np.asarray(preds[:, :k] == tokens[:, 1:]), axis=1)
    m = int(agree.sum(axis=1).min())  # draft tokens every row accepts
    counts.proposed += k
    counts.accepted += m
    nxt = preds[:, m]
    out.extend(np.asarray(d) for d in drafts[:m])
    out.append(np.asarray(nxt))
    if m == k:
      t_cache = verified
      d_cache, pending = d_caches[k - 1], [drafts[k - 1], nxt]
    else:  # roll back: the target's cache over cur, d_1..d_m from the cache before the call
      _, t_cache = _step_tokens(t_graph, t_state, tokens[:, : m + 1], t_cache)
      counts.target_rollback += 1
      d_cache, pending = d_caches[m], [nxt]
    cur = nxt
  return np.stack(out[:max_new_tokens], axis=1), counts


def layer_skip_draft(target: HybridLM, layers: int) -> HybridLM:
  """A draft that is `target`'s first `layers` layers with its embedding, final norm and head
  (the same parameters, copied)."""
  config = dataclasses.replace(target.config, layer_pattern=target.config.layer_pattern[:layers])
  draft = HybridLM(config, rngs=nnx.Rngs(0))
  t_state = nnx.state(target)
  d_state: Any = nnx.state(draft)
  for name in ("embed", "final_norm", "lm_head"):
    if name in d_state:
      d_state[name] = t_state[name]
  for i in range(layers):
    d_state["blocks"][i] = t_state["blocks"][i]
  nnx.update(draft, d_state)
  return draft


def scale_layers(model: HybridLM, first: int, scale: float) -> None:
  """Multiply the parameters of `model`'s layers from `first` on by `scale` (in place)."""
  state: Any = nnx.state(model, nnx.Param)
  for i in range(first, len(model.config.layer_pattern)):
    state["blocks"][i] = jax.tree.map(lambda x: x * scale, state["blocks"][i])
  nnx.update(model, state)


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--new-tokens", type=int, default=24)
  parser.add_argument("--draft-tokens", type=int, default=4)
  parser.add_argument("--pattern", default="DDDA", help="the target's layer_pattern")
  parser.add_argument("--draft-layers", type=int, default=2)
  parser.add_argument("--late-scale", type=float, default=0.5)
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args(argv)
  config = HybridConfig(vocab_size=64, hidden_size=64, layer_pattern=args.pattern, chunk_size=16)
  target = HybridLM(config, rngs=nnx.Rngs(args.seed))
  scale_layers(target, args.draft_layers, args.late_scale)
  draft = layer_skip_draft(target, args.draft_layers)
  rng = np.random.default_rng(args.seed)
  lengths = np.array([11, 7], np.int32)
  prompts = np.zeros((2, 16), np.int32)
  for b, n in enumerate(lengths):
    prompts[b, :n] = rng.integers(0, config.vocab_size, n)
  tokens, counts = speculative_generate(
    target, draft, prompts, lengths, args.new_tokens, args.draft_tokens
  )
  plain = np.asarray(generate(target, prompts, args.new_tokens, lengths=lengths, pad_to=16))
  result = dict(
    equal_to_greedy=bool(np.array_equal(tokens, plain)),
    target_calls=counts.target_calls,
    plain_greedy_target_calls=args.new_tokens,  # one prefill, then one step per further token
    **dataclasses.asdict(counts),
  )
  print(result)
  return result


if __name__ == "__main__":
  main()
