"""Check gdp_jax.qwen3_5 against transformers on a machine with an NVIDIA GPU, torch and
transformers (docs/qwen3_5.md#golden-files):

    python scripts/check_qwen3_5_gpu.py --out $OUT/qwen3_5_gpu.json

For the tiny golden model (tests/data/qwen3_5_tiny) and a larger random one (transformers'
Qwen3_5ForCausalLM, weights drawn as scripts/make_qwen3_5_golden.py draws them):
  - our bf16 logits (the Pallas kernels, `implementation=None`) and transformers' bf16 logits
    on the same GPU, each against transformers' float32 and against each other (relative RMS).
    Pass: ours within 1e-2 of transformers' float32, or no further from it than transformers'
    own bf16 logits are (times 1.1): on these random models bf16 weights alone move the logits
    by about 0.7e-2, and transformers' bf16 is itself about 1.4e-2 from its float32. Beside it,
    not checked (docs/qwen3_5.md#bf16): ours with the float32 core ("xla", q, k, v in float32
    as transformers' core takes them) against transformers' bf16, and transformers' bf16 on
    the GPU against its bf16 on the CPU (the same roundings, other summation orders: how far
    two bf16 runs of one model drift apart);
  - our float32 logits against transformers' float32 (JAX's float32 matmuls at "highest", as
    torch's float32 ones; pass for the tiny model: < 1e-4; not checked when
    flash-linear-attention is installed: transformers then runs its Triton kernels, whose
    float32 products are TF32, docs/qwen3_5.md#bf16);
  - the round trip: our float32 model saved (`save`) and loaded in transformers gives its
    logits unchanged (pass: relative RMS < 1e-6);
  - for the tiny model, the greedy continuation (32 tokens, float32) of ours and transformers'
    (pass: all tokens equal).
Exit status 1 if a check fails; the JSON is written either way.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import pathlib
import sys
import tempfile
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # leave room for torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import numpy as np  # noqa: E402

GOLDEN = ROOT / "tests" / "data" / "qwen3_5_tiny"
LARGER = dict(
  vocab_size=4096,
  hidden_size=1024,
  intermediate_size=2816,
  num_hidden_layers=8,
  layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 2,
  num_attention_heads=8,
  num_key_value_heads=2,
  head_dim=128,
  linear_num_key_heads=8,
  linear_num_value_heads=16,
  linear_key_head_dim=128,
  linear_value_head_dim=128,
  linear_conv_kernel_dim=4,
  rms_norm_eps=1e-6,
  max_position_embeddings=4096,
  rope_parameters=dict(rope_type="default", rope_theta=10000000.0, partial_rotary_factor=0.25),
  tie_word_embeddings=False,
)


def relative_rms(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.sqrt(np.mean((a - b) ** 2) / np.mean(b**2)))


def torch_model(folder, dtype, device=None):
  import torch
  import transformers

  model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
  device = device or ("cuda" if torch.cuda.is_available() else "cpu")
  return model.to(device).eval()


def torch_logits(model, ids):
  import torch

  device = next(model.parameters()).device
  with torch.no_grad():
    return model(torch.from_numpy(ids).long().to(device)).logits.float().cpu().numpy()


def torch_greedy(model, ids, new):
  import torch

  device = next(model.parameters()).device
  x = torch.from_numpy(ids).long().to(device)
  with torch.no_grad():
    out = model.generate(
      x,
      attention_mask=torch.ones_like(x),
      max_new_tokens=new,
      min_new_tokens=new,
      do_sample=False,
      eos_token_id=None,
      pad_token_id=0,
    )
  return out[:, ids.shape[1] :].cpu().numpy()


def our_logits(model, ids):
  from flax import nnx

  return np.asarray(nnx.jit(lambda m, t: m(t))(model, ids))


def check_folder(name, folder, ids, new_tokens, strict, float32_reference=True):
  """One model's rows; `strict`: also the greedy tokens, and the float32 bound when
  `float32_reference` (transformers' float32 is float32: no flash-linear-attention)."""
  import jax.numpy as jnp
  import torch

  from gdp_jax.qwen3_5 import load, save
  from gdp_jax.qwen3_5.generate import generate

  row: dict = {"tokens": list(ids.shape)}
  t0 = time.perf_counter()
  ref32_model = torch_model(folder, torch.float32)
  ref32 = torch_logits(ref32_model, ids)
  ref16 = torch_logits(torch_model(folder, torch.bfloat16), ids)
  try:
    ref16_cpu = torch_logits(torch_model(folder, torch.bfloat16, "cpu"), ids)
  except ValueError:  # flash-linear-attention installed: its Triton kernels take CUDA tensors only
    ref16_cpu = None
  ours16 = our_logits(load(folder, dtype=jnp.bfloat16), ids)
  ours16_xla = our_logits(load(folder, dtype=jnp.bfloat16, implementation="xla"), ids)
  ours32_model = load(folder)
  ours32 = our_logits(ours32_model, ids)
  row.update(
    bf16_ours_vs_transformers_bf16=relative_rms(ours16, ref16),
    bf16_ours_vs_transformers_f32=relative_rms(ours16, ref32),
    bf16_transformers_vs_transformers_f32=relative_rms(ref16, ref32),
    bf16_ours_xla_vs_transformers_bf16=relative_rms(ours16_xla, ref16),
    bf16_transformers_cuda_vs_cpu=None if ref16_cpu is None else relative_rms(ref16, ref16_cpu),
    f32_ours_vs_transformers_f32=relative_rms(ours32, ref32),
  )
  with tempfile.TemporaryDirectory() as tmp:
    save(ours32_model, tmp)
    again = torch_logits(torch_model(tmp, torch.float32), ids)
  row["round_trip_relative_rms"] = relative_rms(again, ref32)
  if strict:
    theirs = torch_greedy(ref32_model, ids, new_tokens)
    ours = np.asarray(generate(ours32_model, ids, new_tokens))
    row["greedy_tokens_equal"] = float(np.mean(ours == theirs))
  row["seconds"] = time.perf_counter() - t0
  checks = [
    row["bf16_ours_vs_transformers_f32"]
    <= max(1e-2, 1.1 * row["bf16_transformers_vs_transformers_f32"]),
    row["round_trip_relative_rms"] < 1e-6,
  ]
  if strict:
    checks.append(row["greedy_tokens_equal"] == 1.0)
  if strict and float32_reference:
    checks.append(row["f32_ours_vs_transformers_f32"] < 1e-4)
  row["pass"] = bool(all(checks))
  print(name, json.dumps(row), flush=True)
  return row


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "qwen3_5.json"))
  parser.add_argument("--tokens", type=int, default=256, help="T of the larger model's input")
  parser.add_argument("--skip-larger", action="store_true")
  args = parser.parse_args()
  import jax
  import torch
  import transformers

  jax.config.update("jax_default_matmul_precision", "highest")
  torch.backends.cuda.matmul.allow_tf32 = False  # float32 as float32 (conv1d goes to cuDNN)
  torch.backends.cudnn.allow_tf32 = False

  from make_qwen3_5_golden import randomise

  result: dict = dict(
    command=" ".join(sys.argv),
    jax=jax.__version__,
    torch=torch.__version__,
    transformers=transformers.__version__,
    device=jax.devices()[0].device_kind,
  )
  from gdp_jax import describe_runtime

  result["runtime"] = describe_runtime()
  # transformers runs these packages' kernels instead of its torch code where they import
  result["transformers_kernels"] = {
    name: importlib.util.find_spec(name) is not None for name in ("fla", "causal_conv1d")
  }
  result["date"] = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
  float32_reference = not result["transformers_kernels"]["fla"]
  golden = np.load(GOLDEN / "golden.npz")
  result["tiny"] = check_folder(
    "tiny", GOLDEN, golden["input_ids"], golden["greedy"].shape[1], True, float32_reference
  )
  if not args.skip_larger:
    with tempfile.TemporaryDirectory() as tmp:
      torch.manual_seed(0)
      model = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**LARGER)).float()
      randomise(model, 0)
      model.save_pretrained(tmp)
      del model
      ids = np.random.default_rng(0).integers(0, LARGER["vocab_size"], (2, args.tokens))
      result["larger"] = check_folder("larger", tmp, ids.astype(np.int32), 0, False)
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  with open(args.out, "w") as f:
    json.dump(result, f, indent=1)
  ok = all(result[k]["pass"] for k in ("tiny", "larger") if k in result)
  print("PASS" if ok else "FAIL", args.out)
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
