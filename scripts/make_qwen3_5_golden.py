"""Make the golden files of a tiny random Qwen3.5 text model (docs/qwen3_5.md#golden-files).

Needs torch, transformers (with `models/qwen3_5`), safetensors and numpy, not gdp_jax:

    python scripts/make_qwen3_5_golden.py [--out tests/data/qwen3_5_tiny]

Writes into --out: the model's config.json and model.safetensors (float32, as transformers'
`save_pretrained` writes them), and golden.npz: input_ids [2, T], transformers' float32 logits
[2, T, vocab], its bf16 logits (the model loaded in bf16 on the CPU, `logits_bf16`), a greedy
continuation [2, 32] (transformers' `generate`), its smallest top-1 margin and the versions,
also in golden.json. The weights are drawn at a scale that makes the logits
spread (transformers' own initialisation gives near-uniform logits, too weak a test).
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib

import numpy as np
import safetensors.numpy
import torch
import transformers

TINY = dict(
  vocab_size=256,
  hidden_size=64,
  intermediate_size=96,
  num_hidden_layers=4,
  layer_types=["linear_attention"] * 3 + ["full_attention"],
  num_attention_heads=4,
  num_key_value_heads=2,
  head_dim=16,
  linear_num_key_heads=2,
  linear_num_value_heads=4,
  linear_key_head_dim=16,
  linear_value_head_dim=16,
  linear_conv_kernel_dim=4,
  rms_norm_eps=1e-6,
  max_position_embeddings=256,
  rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25),
  tie_word_embeddings=False,
)


def randomise(model: torch.nn.Module, seed: int) -> None:
  """Every parameter drawn afresh at a scale where each layer matters."""
  gen = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in model.named_parameters():
      shape = p.shape
      if name.endswith("A_log"):
        value = torch.empty(shape).uniform_(0.5, 8.0, generator=gen).log()
      elif name.endswith("dt_bias") or "norm" in name:
        value = 0.3 * torch.randn(shape, generator=gen)
      elif "conv1d" in name:
        value = torch.empty(shape).uniform_(-0.5, 0.5, generator=gen)
      elif "embed_tokens" in name:
        value = torch.randn(shape, generator=gen)
      else:  # projections [out, in]
        gain = 2.0 if name.startswith("lm_head") else 1.0
        value = gain * torch.randn(shape, generator=gen) / math.sqrt(shape[-1])
      p.copy_(value)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default="tests/data/qwen3_5_tiny")
  parser.add_argument("--seed", type=int, default=4, help="4: a wide greedy margin")
  parser.add_argument("--tokens", type=int, default=20, help="prompt length T")
  parser.add_argument("--new", type=int, default=32, help="greedy tokens to generate")
  args = parser.parse_args()
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  torch.manual_seed(args.seed)
  config = transformers.Qwen3_5TextConfig(**TINY)
  model = transformers.Qwen3_5ForCausalLM(config).float().eval()
  randomise(model, args.seed)
  model.save_pretrained(out, safe_serialization=True)
  rng = np.random.default_rng(args.seed)
  ids = rng.integers(0, TINY["vocab_size"], (2, args.tokens)).astype(np.int64)
  with torch.no_grad():
    logits = model(torch.from_numpy(ids)).logits.float().numpy()
    new = model.generate(
      torch.from_numpy(ids),
      attention_mask=torch.ones(ids.shape, dtype=torch.long),
      max_new_tokens=args.new,
      min_new_tokens=args.new,
      do_sample=False,
      eos_token_id=None,
      pad_token_id=0,
    )[:, ids.shape[1] :]
    full = torch.cat([torch.from_numpy(ids), new], dim=1)
    path_logits = model(full).logits.float().numpy()[:, ids.shape[1] - 1 : -1]
  bf16 = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16).eval()
  with torch.no_grad():
    logits_bf16 = bf16(torch.from_numpy(ids)).logits.float().numpy()
  top2 = np.sort(path_logits, axis=-1)[..., -2:]
  margin = float(np.min(top2[..., 1] - top2[..., 0]))
  meta = dict(
    transformers=transformers.__version__,
    torch=torch.__version__,
    seed=args.seed,
    greedy_min_margin=margin,
    config=TINY,
  )
  np.savez_compressed(
    out / "golden.npz",
    input_ids=ids.astype(np.int32),
    logits=logits.astype(np.float32),
    logits_bf16=logits_bf16.astype(np.float32),
    greedy=new.numpy().astype(np.int32),
  )
  (out / "golden.json").write_text(json.dumps(meta, indent=1) + "\n")
  names = sorted(safetensors.numpy.load_file(out / "model.safetensors"))
  print(f"wrote {out}: {len(names)} weights, logits {logits.shape}, greedy {tuple(new.shape)}")
  print(f"transformers {transformers.__version__}; smallest greedy margin {margin:.4f}")


if __name__ == "__main__":
  main()
