"""`Qwen3_5Config`: the dense Qwen3.5 text model's sizes as transformers' config.json names them
(docs/qwen3_5.md#configuration), read from and written back to that dict.

A multimodal checkpoint's config.json (model_type "qwen3_5") keeps the text model's sizes under
"text_config" (its top-level tie_word_embeddings applies); `from_dict` reads either. RoPE's base
and partial factor come from "rope_parameters" (or the older top-level "rope_theta" /
"partial_rotary_factor").
"""

from __future__ import annotations

import dataclasses
from typing import Any

LAYER_TYPES = ("linear_attention", "full_attention")
TEXT_MODEL_TYPES = ("qwen3_5_text", "qwen3_5")


@dataclasses.dataclass(frozen=True)
class Qwen3_5Config:
  """Sizes of a dense Qwen3.5 text model (field names as in transformers' config.json).

  layer_types: one of "linear_attention" (a Gated DeltaNet block) or "full_attention" (the
    gated attention block) per layer. linear_*: the Gated DeltaNet blocks' heads and sizes
    (value head i reads key head i // (linear_num_value_heads // linear_num_key_heads)).
  num_attention_heads, num_key_value_heads, head_dim: the attention blocks (grouped-query),
    rotary embedding on the first int(head_dim * partial_rotary_factor) dims with base
    rope_theta.
  implementation, chunk_size: for the Gated DeltaNet operator and the decode steps (None: the
    Pallas kernels on a supported GPU, "xla" elsewhere); not part of config.json.
  """

  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_hidden_layers: int
  layer_types: tuple[str, ...]
  num_attention_heads: int
  num_key_value_heads: int
  head_dim: int
  linear_num_key_heads: int
  linear_num_value_heads: int
  linear_key_head_dim: int
  linear_value_head_dim: int
  linear_conv_kernel_dim: int = 4
  rms_norm_eps: float = 1e-6
  rope_theta: float = 10000.0
  partial_rotary_factor: float = 0.25
  max_position_embeddings: int = 32768
  tie_word_embeddings: bool = False
  implementation: str | None = None
  chunk_size: int = 64

  def __post_init__(self):
    object.__setattr__(self, "layer_types", tuple(self.layer_types))
    for name in (
      "vocab_size",
      "hidden_size",
      "intermediate_size",
      "num_hidden_layers",
      "num_attention_heads",
      "num_key_value_heads",
      "head_dim",
      "linear_num_key_heads",
      "linear_num_value_heads",
      "linear_key_head_dim",
      "linear_value_head_dim",
      "linear_conv_kernel_dim",
    ):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if len(self.layer_types) != self.num_hidden_layers:
      raise ValueError(
        f"layer_types has {len(self.layer_types)} entries, expected num_hidden_layers = "
        f"{self.num_hidden_layers}"
      )
    bad = sorted(set(self.layer_types) - set(LAYER_TYPES))
    if bad:
      raise ValueError(f"layer_types holds {bad}; each must be one of {LAYER_TYPES}")
    if self.num_attention_heads % self.num_key_value_heads:
      raise ValueError(
        f"num_attention_heads = {self.num_attention_heads} must be a multiple of "
        f"num_key_value_heads = {self.num_key_value_heads}"
      )
    if self.linear_num_value_heads % self.linear_num_key_heads:
      raise ValueError(
        f"linear_num_value_heads = {self.linear_num_value_heads} must be a multiple of "
        f"linear_num_key_heads = {self.linear_num_key_heads}"
      )
    if self.rotary_dim % 2 or self.rotary_dim > self.head_dim:
      raise ValueError(
        f"the rotary dims int(head_dim * partial_rotary_factor) = {self.rotary_dim} must be "
        f"even and at most head_dim = {self.head_dim}"
      )

  @property
  def rotary_dim(self) -> int:
    return int(self.head_dim * self.partial_rotary_factor)

  @classmethod
  def from_dict(cls, data: dict[str, Any], **overrides: Any) -> Qwen3_5Config:
    """From a transformers config.json dict (text-only or multimodal); `overrides` set the
    fields that are not in it (implementation, chunk_size) or replace others."""
    if "text_config" in data:  # a multimodal config: its own tie_word_embeddings rules the head
      outer = data
      data = dict(data["text_config"])
      if "tie_word_embeddings" in outer:
        data["tie_word_embeddings"] = outer["tie_word_embeddings"]
    model_type = data.get("model_type", "qwen3_5_text")
    if model_type not in TEXT_MODEL_TYPES:
      raise ValueError(
        f"config.json has model_type {model_type!r}; this loads a dense Qwen3.5 text model, "
        f"model_type one of {TEXT_MODEL_TYPES}"
      )
    if data.get("attention_bias", False):
      raise ValueError("attention_bias = true is not supported (Qwen3.5's projections have none)")
    if data.get("hidden_act", "silu") != "silu":
      raise ValueError(f"hidden_act must be 'silu', got {data['hidden_act']!r}")
    rope = dict(data.get("rope_parameters") or {})
    if rope.get("rope_type", "default") != "default":
      raise ValueError(f"only rope_type 'default' is supported, got {rope['rope_type']!r}")
    fields = {f.name for f in dataclasses.fields(cls)}
    kwargs = {k: v for k, v in data.items() if k in fields}
    num_layers = data["num_hidden_layers"]
    if data.get("layer_types") is None:  # transformers' default: every 4th layer attention
      interval = data.get("full_attention_interval", 4)
      kwargs["layer_types"] = [
        "full_attention" if (i + 1) % interval == 0 else "linear_attention"
        for i in range(num_layers)
      ]
    kwargs.setdefault("head_dim", data["hidden_size"] // data["num_attention_heads"])
    for name in ("rope_theta", "partial_rotary_factor"):
      if name in rope:
        kwargs[name] = rope[name]
    kwargs.update(overrides)
    return cls(**kwargs)

  def to_dict(self) -> dict[str, Any]:
    """transformers' config.json of the text model (Qwen3_5ForCausalLM)."""
    data = {
      f.name: getattr(self, f.name)
      for f in dataclasses.fields(self)
      if f.name not in ("implementation", "chunk_size", "rope_theta", "partial_rotary_factor")
    }
    data["layer_types"] = list(self.layer_types)
    data["rope_parameters"] = {
      "rope_type": "default",
      "rope_theta": self.rope_theta,
      "partial_rotary_factor": self.partial_rotary_factor,
    }
    data.update(
      architectures=["Qwen3_5ForCausalLM"],
      model_type="qwen3_5_text",
      hidden_act="silu",
      attention_bias=False,
    )
    return data
