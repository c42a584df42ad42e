"""The configuration of `HybridLM`: `HybridConfig`, its layer kinds and checks
(docs/inference.md, docs/train_lm.md)."""

from __future__ import annotations

import dataclasses
from typing import Any

from gdp_jax.layers import ATTENTION_IMPLS, KEY_NORMS, MASK_MODES
from gdp_jax.models.scan import layer_plan

LAYER_KINDS = {
  "D": "gated delta product",
  "H": "DeltaProduct (Householder)",
  "A": "grouped-query attention",
}
# HybridConfig.mask_mode: the block masks of `GatedDeltaProduct`, or "householder": every "D"
# layer a `HouseholderDeltaProduct` (the same as writing "H" for it).
CONFIG_MASK_MODES = (*MASK_MODES, "householder")


@dataclasses.dataclass(frozen=True)
class HybridConfig:
  """Configuration of `HybridLM`.

  layer_pattern: one letter per layer, "D" (`layers.GatedDeltaProduct` with the block mask of
    `mask_mode`), "H" (`layers.HouseholderDeltaProduct`: DeltaProduct with `num_householder`
    steps per token) or "A" (GroupedQueryAttention), e.g. "DDA" = two delta product layers
    then one attention layer, "DHA" = a block-mask layer, a DeltaProduct layer and an
    attention layer.
  Delta product layers ("D" and "H"): num_heads, head_dim (K), expand_v, use_short_conv,
    use_gate, allow_neg_eigval, chunk_size; for "D" layers num_blocks (r), mask_mode,
    key_norm, beta_norm (see `layers.GatedDeltaProduct`); num_householder (n_h) for "H" layers
    (see `layers.HouseholderDeltaProduct`). mask_mode = "householder" makes every "D" layer an
    "H" layer.
  Attention layers: attn_num_heads, attn_num_kv_heads, attn_head_dim (default
    hidden_size // attn_num_heads), rope_theta, attn_impl ("xla" or "flash": the
    whole-sequence attention, see `layers.GroupedQueryAttention`'s attention_impl).
  mlp_ratio: SwiGLU hidden size = mlp_ratio * hidden_size (0: no MLP).
  implementation: for the operator and decode steps (None: Pallas on a GPU).
  scan_layers: run the layers of one configuration under `jax.lax.scan` (the pattern's repeated
    unit and runs of one letter, e.g. "DDDA" x 3: each distinct layer traced and compiled once;
    docs/train_lm.md#compile-time); False (default): one after another, since a scanned
    training step measured slower on a GPU; None: scan when two layers share a configuration.
    The parameters and the caches are one entry per layer either way; the values the same up to
    rounding.
  """

  vocab_size: int
  hidden_size: int = 64
  layer_pattern: str = "DA"
  num_heads: int = 2
  head_dim: int = 32
  expand_v: Any = 1
  num_blocks: int = 2
  mask_mode: str = "static"
  key_norm: str = "block"
  use_short_conv: bool = True
  use_gate: bool = True
  allow_neg_eigval: bool = False
  beta_norm: bool = True
  chunk_size: int = 64
  num_householder: int = 2
  attn_num_heads: int = 2
  attn_num_kv_heads: int = 1
  attn_head_dim: int | None = None
  rope_theta: float = 10000.0
  attn_impl: str = "xla"
  mlp_ratio: int = 4
  norm_eps: float = 1e-5
  tie_embeddings: bool = False
  implementation: str | None = None
  dtype: Any = None
  scan_layers: bool | None = False

  def __post_init__(self):
    if not isinstance(self.layer_pattern, str) or not self.layer_pattern:
      raise ValueError(
        f"layer_pattern must be a non-empty string of 'D' (gated delta product), "
        f"'H' (DeltaProduct) and 'A' (attention) letters, got "
        f"{self.layer_pattern!r}"
      )
    bad = sorted(set(self.layer_pattern) - set(LAYER_KINDS))
    if bad:
      raise ValueError(
        f"layer_pattern = {self.layer_pattern!r} has unknown letters {bad}; "
        f"expected only 'D' (gated delta product), 'H' (DeltaProduct, "
        f"Householder steps) and 'A' (attention)"
      )
    for name in ("vocab_size", "hidden_size", "num_householder"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if self.mask_mode not in CONFIG_MASK_MODES:
      raise ValueError(f"mask_mode must be one of {CONFIG_MASK_MODES}, got {self.mask_mode!r}")
    if self.key_norm not in KEY_NORMS:
      raise ValueError(f"key_norm must be one of {KEY_NORMS}, got {self.key_norm!r}")
    if self.attn_impl not in ATTENTION_IMPLS:
      raise ValueError(f"attn_impl must be one of {ATTENTION_IMPLS}, got {self.attn_impl!r}")
    if not isinstance(self.mlp_ratio, int) or self.mlp_ratio < 0:
      raise ValueError(f"mlp_ratio must be a non-negative integer, got {self.mlp_ratio!r}")
    if self.scan_layers not in (None, True, False):
      raise ValueError(f"scan_layers must be None, True or False, got {self.scan_layers!r}")

  @property
  def scanned(self) -> bool:
    """Whether `HybridLM` scans its layers (`scan_layers`, None: when two layers share one
    configuration)."""
    shares = layer_plan(self.layer_pattern).shares
    return shares if self.scan_layers is None else bool(self.scan_layers) and shares
