"""The dense Qwen3.5 text model in Flax on gdp-jax's operators (docs/qwen3_5.md).

    model = Qwen3_5LM(Qwen3_5Config(...), rngs=nnx.Rngs(0))    # or loader.load(folder)
    logits = model(tokens)                                     # [B, T, vocab] float32

Three Gated DeltaNet blocks to one gated attention block (config.layer_types), each followed by
a SwiGLU MLP, with zero-centred RMSNorms ((1 + w) x / rms(x)). The Gated DeltaNet block is
`gdp_jax.layers.GatedDeltaProduct` with mask_mode="ones", key_norm="full" and grouped value
heads: exactly transformers' block (docs/layers.md#qwen35s-gated-deltanet-block), running
`gated_delta_product` over a sequence and `gated_delta_product_step` per token. The attention
block (output gate, per-head q/k RMSNorm, partial RoPE, grouped-query heads) runs causal
attention over a sequence and `gqa_decode` per token. In bf16 every block rounds where
transformers' does (docs/qwen3_5.md#bf16). Parameter names follow transformers'.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.typing import DTypeLike

from gdp_jax.layers import GatedDeltaProductCache, KVCache, Linear
from gdp_jax.layers.common import as_f32, round_to, rounded
from gdp_jax.ops.gqa_decode.api import gqa_decode
from gdp_jax.qwen3_5.config import Qwen3_5Config
from gdp_jax.qwen3_5.delta_net import GatedDeltaNet

f32 = jnp.float32
DECODE_IMPLEMENTATIONS = ("xla", "triton", "pallas")  # gqa_decode's; others: its default


class ZeroCenteredRMSNorm(nnx.Module):
  """RMSNorm with weight 1 + w (w starts at zero), computed in float32, returned in x's dtype."""

  def __init__(self, num_features: int, *, eps: float = 1e-6, param_dtype: DTypeLike = f32):
    self.eps = eps
    self.weight = nnx.Param(jnp.zeros((num_features,), param_dtype))

  def __call__(self, x):
    y = as_f32(x)
    y = y * jax.lax.rsqrt(jnp.mean(y * y, axis=-1, keepdims=True) + self.eps)
    return rounded(y * (1.0 + self.weight[...].astype(f32)), x.dtype)


def add(x, y):
  """The residual sum x + y in x's dtype (rounded once, as transformers' bf16 sum)."""
  return rounded(as_f32(x) + as_f32(y), x.dtype)


def rope(x, positions, theta):
  """Rotary embedding (rotate-half) of x [..., T?, H, D] as transformers computes it: cos and
  sin rounded to x's dtype, then x cos and rotate_half(x) sin and their sum each rounded."""
  dim, dtype = x.shape[-1], x.dtype
  freqs = theta ** (-jnp.arange(0, dim // 2, dtype=f32) * 2.0 / dim)  # as layers.apply_rope
  angles = positions.astype(f32)[..., None] * freqs  # [..., D/2]
  cos, sin = (round_to(f(angles), dtype)[..., None, :] for f in (jnp.cos, jnp.sin))
  x1, x2 = jnp.split(as_f32(x), 2, axis=-1)
  r = lambda v: round_to(v, dtype)
  out = [r(r(x1 * cos) - r(x2 * sin)), r(r(x2 * cos) + r(x1 * sin))]
  return rounded(jnp.concatenate(out, axis=-1), dtype)


def causal_attention(q, k, v):
  """Causal softmax attention, q [B, T, H, Dh], k, v [B, T, Hkv, Dh] -> [B, T, H, Dh]. In bf16
  as flash attention (torch's SDPA) computes it: float32 scores and softmax, the unnormalised
  probabilities rounded to bf16 for P V, divided by their float32 sum after."""
  if q.dtype == f32:
    return jax.nn.dot_product_attention(q, k, v, is_causal=True)
  batch, t_len, heads, dim = q.shape
  groups = heads // k.shape[2]
  qg = q.reshape(batch, t_len, k.shape[2], groups, dim)
  s = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=f32) * dim**-0.5
  s = jnp.where(jnp.tril(jnp.ones((t_len, t_len), bool)), s, -jnp.inf)
  p = jnp.exp(s - jnp.max(s, axis=-1, keepdims=True))
  o = jnp.einsum("bkgts,bskd->btkgd", p.astype(q.dtype), v, preferred_element_type=f32)
  o = o / jnp.moveaxis(jnp.sum(p, axis=-1), 3, 1)[..., None]
  return rounded(o, q.dtype).reshape(q.shape)


def _linear(i, o, param_dtype, rngs):
  return Linear(i, o, use_bias=False, param_dtype=param_dtype, rngs=rngs)


class SwiGLU(nnx.Module):
  """down(silu(gate(x)) * up(x)); silu and the product each rounded to x's dtype."""

  def __init__(self, hidden_size: int, intermediate_size: int, *, param_dtype, rngs):
    self.gate_proj = _linear(hidden_size, intermediate_size, param_dtype, rngs)
    self.up_proj = _linear(hidden_size, intermediate_size, param_dtype, rngs)
    self.down_proj = _linear(intermediate_size, hidden_size, param_dtype, rngs)

  def __call__(self, x):
    gate = round_to(jax.nn.silu(as_f32(self.gate_proj(x))), x.dtype)
    return self.down_proj(rounded(gate * as_f32(self.up_proj(x)), x.dtype))


class GatedAttention(nnx.Module):
  """Qwen3.5's full-attention block: q_proj gives each head its query and an output gate side by
  side ([H, 2 Dh]), q and k are RMS-normalised per head (zero-centred), RoPE on their first
  `config.rotary_dim` dims, causal softmax attention with grouped key/value heads (query head h
  reads head h // (H / Hkv)), the output times sigmoid(gate), then o_proj."""

  def __init__(self, config: Qwen3_5Config, *, param_dtype: DTypeLike = f32, rngs: nnx.Rngs):
    c = config
    self.num_heads, self.num_kv_heads, self.head_dim = (
      c.num_attention_heads,
      c.num_key_value_heads,
      c.head_dim,
    )
    self.rotary_dim, self.rope_theta = c.rotary_dim, float(c.rope_theta)
    impl = c.implementation
    self.decode_implementation = impl if impl in DECODE_IMPLEMENTATIONS else None
    H, Hkv, Dh, D = self.num_heads, self.num_kv_heads, self.head_dim, c.hidden_size
    self.q_proj = _linear(D, H * 2 * Dh, param_dtype, rngs)
    self.k_proj = _linear(D, Hkv * Dh, param_dtype, rngs)
    self.v_proj = _linear(D, Hkv * Dh, param_dtype, rngs)
    self.o_proj = _linear(H * Dh, D, param_dtype, rngs)
    self.q_norm = ZeroCenteredRMSNorm(Dh, eps=c.rms_norm_eps, param_dtype=param_dtype)
    self.k_norm = ZeroCenteredRMSNorm(Dh, eps=c.rms_norm_eps, param_dtype=param_dtype)

  def _rope(self, x, positions):
    r = self.rotary_dim
    if r == 0:
      return x
    return jnp.concatenate([rope(x[..., :r], positions, self.rope_theta), x[..., r:]], -1)

  def _qkv(self, x, positions):
    """q [..., H, Dh], k, v [..., Hkv, Dh] (q, k normalised and rotated), gate [..., H * Dh]."""
    lead = x.shape[:-1]
    H, Hkv, Dh = self.num_heads, self.num_kv_heads, self.head_dim
    qg = self.q_proj(x).reshape(lead + (H, 2 * Dh))
    q, gate = self.q_norm(qg[..., :Dh]), qg[..., Dh:].reshape(lead + (H * Dh,))
    k = self.k_norm(self.k_proj(x).reshape(lead + (Hkv, Dh)))
    v = self.v_proj(x).reshape(lead + (Hkv, Dh))
    return self._rope(q, positions), self._rope(k, positions), v, gate

  def _out(self, o, gate):
    dtype = gate.dtype
    o = as_f32(o.reshape(gate.shape).astype(dtype))
    return self.o_proj(rounded(o * round_to(jax.nn.sigmoid(as_f32(gate)), dtype), dtype))

  def init_cache(self, batch_size: int, cache_size: int, dtype: DTypeLike = f32) -> KVCache:
    shape = (batch_size, cache_size, self.num_kv_heads, self.head_dim)
    zeros = jnp.zeros(shape, dtype)
    return KVCache(zeros, zeros, jnp.zeros((batch_size,), jnp.int32))

  def __call__(self, x, lengths=None, *, return_cache=False, cache_size=None):
    """x [B, T, D] -> y [B, T, D] (and the KVCache of `cache_size` slots, default T, holding
    lengths[b] tokens of row b)."""
    batch, t_len, _ = x.shape
    q, k, v, gate = self._qkv(x, jnp.arange(t_len))
    y = self._out(causal_attention(q, k, v), gate)
    if not return_cache:
      return y
    cache_size = t_len if cache_size is None else cache_size
    pad = ((0, 0), (0, cache_size - t_len), (0, 0), (0, 0))
    filled = jnp.full((batch,), t_len, jnp.int32) if lengths is None else lengths
    return y, KVCache(jnp.pad(k, pad), jnp.pad(v, pad), filled.astype(jnp.int32))

  def step(self, x, cache: KVCache):
    """One token per sequence at position cache.lengths[b]: x [B, D] -> (y [B, D], cache)."""
    batch = x.shape[0]
    pos = cache.lengths
    q, k, v, gate = self._qkv(x, pos)
    rows = jnp.arange(batch)
    key = cache.key.at[rows, pos].set(k.astype(cache.key.dtype), mode="drop")
    value = cache.value.at[rows, pos].set(v.astype(cache.value.dtype), mode="drop")
    o = gqa_decode(q, key, value, pos + 1, implementation=self.decode_implementation)
    return self._out(o, gate), KVCache(key, value, pos + 1)


class DecoderLayer(nnx.Module):
  """Pre-norm residual layer: x + mixer(norm(x)), then x + mlp(norm(x)); the mixer is
  `linear_attn` (Gated DeltaNet) or `self_attn` (GatedAttention) as transformers names them."""

  def __init__(self, config: Qwen3_5Config, layer_type: str, *, param_dtype, rngs):
    c = config
    self.layer_type = layer_type
    if layer_type == "linear_attention":
      self.linear_attn = GatedDeltaNet(
        c.hidden_size,
        c.linear_num_key_heads,
        c.linear_key_head_dim,
        num_v_heads=c.linear_num_value_heads,
        expand_v=c.linear_value_head_dim / c.linear_key_head_dim,
        num_blocks=1,
        mask_mode="ones",
        key_norm="full",
        conv_size=c.linear_conv_kernel_dim,
        use_gate=True,
        norm_eps=c.rms_norm_eps,
        chunk_size=c.chunk_size,
        implementation=c.implementation,
        param_dtype=param_dtype,
        rngs=rngs,
      )
    else:
      self.self_attn = GatedAttention(c, param_dtype=param_dtype, rngs=rngs)
    self.mlp = SwiGLU(c.hidden_size, c.intermediate_size, param_dtype=param_dtype, rngs=rngs)
    eps = c.rms_norm_eps
    self.input_layernorm = ZeroCenteredRMSNorm(c.hidden_size, eps=eps, param_dtype=param_dtype)
    self.post_attention_layernorm = ZeroCenteredRMSNorm(
      c.hidden_size, eps=eps, param_dtype=param_dtype
    )

  @property
  def mixer(self):
    return self.linear_attn if self.layer_type == "linear_attention" else self.self_attn

  def _mlp(self, x):
    return add(x, self.mlp(self.post_attention_layernorm(x)))

  def __call__(self, x, lengths=None, *, return_cache=False, cache_size=None):
    kw = dict(cache_size=cache_size) if self.layer_type == "full_attention" else {}
    out = self.mixer(self.input_layernorm(x), lengths, return_cache=return_cache, **kw)
    y, cache = out if return_cache else (out, None)
    x = self._mlp(add(x, y))
    return (x, cache) if return_cache else x

  def step(self, x, cache):
    y, cache = self.mixer.step(self.input_layernorm(x), cache)
    return self._mlp(add(x, y)), cache


def check_tokens(tokens, vocab_size, name="tokens"):
  """Integer ids; concrete ones in [0, vocab_size) (a ValueError naming the first outside)."""
  if not hasattr(tokens, "dtype"):
    tokens = np.asarray(tokens)
  if not jnp.issubdtype(tokens.dtype, jnp.integer):
    raise TypeError(f"{name} must be integer token ids, got dtype {tokens.dtype}")
  if not isinstance(tokens, jax.core.Tracer):
    ids = np.asarray(tokens)
    bad = np.argwhere((ids < 0) | (ids >= vocab_size))
    if bad.size:
      where = tuple(int(i) for i in bad[0])
      raise ValueError(
        f"{name} holds id {int(ids[where])} at position {list(where)}, outside "
        f"[0, vocab_size = {vocab_size})"
      )
  return tokens


class Qwen3_5LM(nnx.Module):
  """Qwen3.5's dense text model with its language-model head (transformers'
  Qwen3_5ForCausalLM).

  `model(tokens [B, T], lengths=None) -> logits [B, T, vocab]` float32 (lengths [B]: right
  padding); `model.prefill(tokens, lengths, cache_size) -> (logits, cache)`;
  `model.step(token [B], cache) -> (logits [B, vocab], cache)`; `model.init_cache(B, S)`. The
  cache is a tuple with one entry per layer: `GatedDeltaProductCache` (the short convolution's
  last inputs and the [B, HV, K, V] float32 state) or `KVCache` ([B, S, Hkv, Dh], S slots).

  param_dtype: the parameters' dtype, which is also the compute dtype (float32 or bfloat16):
  activations follow the embedding's dtype, norms and gates compute in float32 inside.
  """

  def __init__(
    self, config: Qwen3_5Config, *, param_dtype: DTypeLike = f32, rngs: nnx.Rngs
  ) -> None:
    if not isinstance(config, Qwen3_5Config):
      raise TypeError(f"config must be a Qwen3_5Config, got {type(config).__name__}")
    c = config
    self.config = c
    self.embed_tokens = nnx.Embed(
      c.vocab_size,
      c.hidden_size,
      dtype=param_dtype,
      param_dtype=param_dtype,
      embedding_init=nnx.initializers.normal(0.02),
      rngs=rngs,
    )
    layers = [DecoderLayer(c, t, param_dtype=param_dtype, rngs=rngs) for t in c.layer_types]
    self.layers = nnx.List(layers)
    self.norm = ZeroCenteredRMSNorm(c.hidden_size, eps=c.rms_norm_eps, param_dtype=param_dtype)
    if not c.tie_word_embeddings:
      self.lm_head = _linear(c.hidden_size, c.vocab_size, param_dtype, rngs)

  def _embed(self, tokens, name="tokens"):
    return self.embed_tokens(check_tokens(tokens, self.config.vocab_size, name))

  def _logits(self, x):
    x = self.norm(x)
    if self.config.tie_word_embeddings:
      return as_f32(x @ self.embed_tokens.embedding[...].astype(x.dtype).T)
    return as_f32(self.lm_head(x))

  def __call__(self, tokens: jax.Array, lengths: jax.Array | None = None) -> jax.Array:
    x = self._embed(tokens)
    for layer in self.layers:
      x = layer(x, lengths)
    return self._logits(x)

  def prefill(
    self, tokens: jax.Array, lengths: jax.Array | None = None, cache_size: int | None = None
  ) -> tuple[jax.Array, tuple]:
    """Right-padded prompts [B, T] (row b holds lengths[b] tokens): logits [B, T, vocab] and the
    cache after each row's tokens (attention caches of `cache_size` slots, default T)."""
    t_len = np.shape(tokens)[1]
    if cache_size is not None and cache_size < t_len:
      raise ValueError(f"cache_size = {cache_size} is smaller than the prompts (T = {t_len})")
    x = self._embed(tokens)
    caches = []
    for layer in self.layers:
      x, cache = layer(x, lengths, return_cache=True, cache_size=cache_size)
      caches.append(cache)
    return self._logits(x), tuple(caches)

  def init_cache(self, batch_size: int, cache_size: int) -> tuple:
    """The empty cache; attention layers get `cache_size` slots."""
    caches: list[KVCache | GatedDeltaProductCache] = []
    for layer in self.layers:
      if layer.layer_type == "full_attention":
        caches.append(layer.self_attn.init_cache(batch_size, cache_size))
      else:
        caches.append(layer.linear_attn.init_cache(batch_size))
    return tuple(caches)

  def step(self, token: jax.Array, cache: tuple) -> tuple[jax.Array, tuple]:
    """One token per sequence: token [B] -> (logits [B, vocab] float32, the new cache)."""
    if not isinstance(cache, tuple) or len(cache) != len(self.layers):
      raise ValueError(
        f"cache must be a tuple of {len(self.layers)} layer caches (from init_cache or "
        f"prefill), got {type(cache).__name__}"
      )
    x = self._embed(token, "token")
    new = []
    for layer, c in zip(self.layers, cache):
      x, c = layer.step(x, c)
      new.append(c)
    return self._logits(x), tuple(new)
