"""The verify step of speculative decoding for `HybridLM` (`HybridLM.verify_tokens` and
`HybridLM.rollback`): Tq draft tokens run through every layer keeping what a rollback to any
accepted length needs, so a rejected draft costs no recomputation
(docs/inference.md#rolling-back-a-model).

Per layer: a gated delta product layer's state through `gated_delta_product_verify(compact=True)`
(a DeltaProduct layer's through its step, token by token, every state kept), and its short
convolution's inputs before and of the Tq tokens; an attention layer writes the Tq keys and
values and keeps its length before them (a rollback lowers it).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from gdp_jax.layers import GatedDeltaProduct, GatedDeltaProductCache, KVCache
from gdp_jax.models.paged import PagedKVCache, paged_attention_step_tokens
from gdp_jax.ops.step.api import gated_delta_product_verify, select_state


class DeltaRecord(NamedTuple):
  """What rolls a delta layer back: `window` [B, conv_size - 1 + Tq, C] the short convolution's
  inputs before and of the Tq tokens (None without it), `states` the `CompactStates` record of
  the verify step (or every token's state, [B, Tq, HV, K, V]) and the state before the tokens."""

  window: Any
  states: Any
  initial_state: jax.Array


class AttentionRecord(NamedTuple):
  """What rolls an attention layer back: its cache after the Tq tokens (`KVCache` or
  `PagedKVCache`) and the lengths before them [B]."""

  cache: Any
  start: jax.Array


def delta_verify(layer: Any, x: jax.Array, cache: GatedDeltaProductCache):
  """Tq tokens x [B, Tq, D] through a delta layer from `cache`: (y [B, Tq, D], DeltaRecord)."""
  layer._check_step_cache(cache, x.shape[0])
  if layer.dtype is not None:
    x = x.astype(layer.dtype)
  pre = layer._project_in(x)
  window = None
  if layer.use_short_conv:
    qkv, _ = layer.conv.step_tokens(pre, cache.conv)
    window = jnp.concatenate([cache.conv, pre.astype(cache.conv.dtype)], axis=1)
  else:
    qkv = jax.nn.silu(pre)
  q, k, v = layer._split_qkv(qkv)
  g, beta = layer._gates(x)
  if isinstance(layer, GatedDeltaProduct):
    mask = layer._mask(x)
    beta = layer._scale_beta(beta, mask)
    o, states = gated_delta_product_verify(q, k, v, g, beta, mask, cache.state, compact=True)
  else:  # DeltaProduct: its step token by token, every state kept
    state, outs, kept = cache.state, [], []
    for t in range(x.shape[1]):
      o_t, state = layer._mix_step(x[:, t], q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state)
      outs.append(o_t)
      kept.append(state)
    o, states = jnp.stack(outs, axis=1), jnp.stack(kept, axis=1)
  return layer._output(o, x), DeltaRecord(window, states, cache.state)


def block_verify(block: Any, x: jax.Array, cache: Any):
  """Tq tokens x [B, Tq, D] through a `Block` from its cache: (x after it, its record)."""
  h = block.mixer_norm(x)
  if isinstance(cache, PagedKVCache):
    y, new = paged_attention_step_tokens(block.mixer, h, cache)
    record: Any = AttentionRecord(new, cache.lengths)
  elif isinstance(cache, KVCache):
    y, new = block.mixer.step_tokens(h, cache)
    record = AttentionRecord(new, cache.lengths)
  else:
    y, record = delta_verify(block.mixer, h, cache)
  return block._mlp(x + y.astype(x.dtype)), record


def rollback_layer(record: Any, accepted: jax.Array) -> Any:
  """One layer's cache after the first accepted[b] (in [0, Tq], may be traced) verified tokens."""
  if isinstance(record, AttentionRecord):
    return record.cache._replace(lengths=record.start + accepted)
  conv = None
  if record.window is not None:
    size = record.window.shape[1] - _tokens(record)
    idx = accepted[:, None] + jnp.arange(size)[None, :]
    conv = jnp.take_along_axis(record.window, idx[:, :, None], axis=1)
  state = select_state(record.states, accepted, record.initial_state)
  return GatedDeltaProductCache(conv, state)


def _tokens(record: DeltaRecord) -> int:
  states = record.states
  return states.gamma.shape[-1] if hasattr(states, "gamma") else states.shape[1]
