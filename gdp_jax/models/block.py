"""One layer of `HybridLM`: a pre-norm residual block around a token mixer (gated delta
product, DeltaProduct or grouped-query attention) and a SwiGLU MLP (docs/layers.md)."""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx

from gdp_jax.layers import (
  GatedDeltaProduct,
  GatedRMSNorm,
  GroupedQueryAttention,
  HouseholderDeltaProduct,
  Linear,
  partitioning,
)
from gdp_jax.layers.partitioning import EMBED, MLP
from gdp_jax.models.config import HybridConfig
from gdp_jax.models.paged import PagedKVCache, paged_attention_step, paged_attention_step_tokens


class SwiGLU(nnx.Module):
  def __init__(self, hidden_size, intermediate_size, *, dtype=None, rngs):
    def lin(i, o, names):  # logical axes: docs/sharding.md#annotated-parameters
      init = partitioning.partitioned(nnx.initializers.lecun_normal(), names)
      return Linear(i, o, use_bias=False, dtype=dtype, kernel_init=init, rngs=rngs)

    self.gate = lin(hidden_size, intermediate_size, (EMBED, MLP))
    self.up = lin(hidden_size, intermediate_size, (EMBED, MLP))
    self.down = lin(intermediate_size, hidden_size, (MLP, EMBED))

  def __call__(self, x):
    return self.down(jax.nn.silu(self.gate(x)) * self.up(x))


class Block(nnx.Module):
  """Pre-norm residual block: x + mixer(norm(x)), then x + mlp(norm(x))."""

  def __init__(self, kind: str, c: HybridConfig, *, rngs: nnx.Rngs, sharding=None):
    self.kind = kind
    self.mixer_norm = GatedRMSNorm(c.hidden_size, eps=c.norm_eps)
    self.mixer: GatedDeltaProduct | HouseholderDeltaProduct | GroupedQueryAttention
    delta: dict[str, Any] = dict(  # the settings both delta layers take
      expand_v=c.expand_v,
      use_short_conv=c.use_short_conv,
      use_gate=c.use_gate,
      allow_neg_eigval=c.allow_neg_eigval,
      norm_eps=c.norm_eps,
      chunk_size=c.chunk_size,
      implementation=c.implementation,
      dtype=c.dtype,
      rngs=rngs,
    )
    if kind == "H" or (kind == "D" and c.mask_mode == "householder"):
      if sharding is not None:
        raise ValueError(
          "sharding is not supported with DeltaProduct layers ('H' in layer_pattern, or "
          "mask_mode='householder') yet; use sharding=None or 'D' layers with a block mask"
        )
      self.mixer = HouseholderDeltaProduct(
        c.hidden_size, c.num_heads, c.head_dim, num_householder=c.num_householder, **delta
      )
    elif kind == "D":
      self.mixer = GatedDeltaProduct(
        c.hidden_size,
        c.num_heads,
        c.head_dim,
        num_blocks=c.num_blocks,
        mask_mode=c.mask_mode,
        key_norm=c.key_norm,
        beta_norm=c.beta_norm,
        sharding=sharding,
        **delta,
      )
    else:
      self.mixer = GroupedQueryAttention(
        c.hidden_size,
        c.attn_num_heads,
        c.attn_num_kv_heads,
        c.attn_head_dim,
        rope_theta=c.rope_theta,
        implementation=None if c.implementation == "reference" else c.implementation,
        attention_impl=c.attn_impl,
        dtype=c.dtype,
        rngs=rngs,
      )
    self.use_mlp = bool(c.mlp_ratio)
    if self.use_mlp:
      self.mlp_norm = GatedRMSNorm(c.hidden_size, eps=c.norm_eps)
      self.mlp = SwiGLU(c.hidden_size, c.mlp_ratio * c.hidden_size, dtype=c.dtype, rngs=rngs)

  def _mlp(self, x):
    return x + self.mlp(self.mlp_norm(x)) if self.use_mlp else x

  def __call__(self, x, lengths=None, *, segment_ids=None, return_cache=False, cache_size=None):
    kw = dict(cache_size=cache_size) if self.kind == "A" and return_cache else {}
    if segment_ids is not None:
      kw["segment_ids"] = segment_ids
    out = self.mixer(self.mixer_norm(x), lengths, return_cache=return_cache, **kw)
    y, cache = out if return_cache else (out, None)
    x = self._mlp(x + y.astype(x.dtype))
    return (x, cache) if return_cache else x

  def step(self, x, cache):
    if isinstance(cache, PagedKVCache):
      y, cache = paged_attention_step(self.mixer, self.mixer_norm(x), cache)
    else:
      y, cache = self.mixer.step(self.mixer_norm(x), cache)
    return self._mlp(x + y.astype(x.dtype)), cache

  def step_tokens(self, x, cache):
    if isinstance(cache, PagedKVCache):
      y, cache = paged_attention_step_tokens(self.mixer, self.mixer_norm(x), cache)
    else:
      y, cache = self.mixer.step_tokens(self.mixer_norm(x), cache)
    return self._mlp(x + y.astype(x.dtype)), cache
