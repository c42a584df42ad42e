"""Time the Householder DeltaProduct beside flash-linear-attention's (GPU; not a test).

  python benchmarks/bench_householder.py --out householder.json [--shape 8,4096,16,128,128]
      [--nh 1,2,3] [--reps 15]

For each n_h: ours (`gdp_jax.householder_delta_product`, implementation "pallas") and
flash-linear-attention's `chunk_gated_delta_product` on the same inputs (made in PyTorch, copied
to JAX), forward and forward + backward (the gradient of sum(o) with respect to q, k, v, g and
beta), median ms; and the relative RMS difference of the two outputs. Writes JSON with the date,
the jax version, the GPU name and the command (docs/performance.md).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from gdp_jax import householder_delta_product  # noqa: E402
from gdp_jax.bench import command_line, time_jax  # noqa: E402


def torch_inputs(shape, nh, seed=0):
  """fla's layout in bf16 on the GPU: unit keys, beta in (0, 1), log-decays near 0."""
  import torch

  B, T, H, K, V = shape
  torch.manual_seed(seed)
  dev, bf = "cuda", torch.bfloat16
  unit = lambda *s: torch.nn.functional.normalize(torch.randn(*s, device=dev), dim=-1).to(bf)
  return dict(
    q=unit(B, T, H, K),
    k=unit(B, T * nh, H, K),
    v=torch.randn(B, T * nh, H, V, device=dev).to(bf),
    g=torch.nn.functional.logsigmoid(torch.randn(B, T, H, device=dev) + 4.0).float(),
    beta=torch.sigmoid(torch.randn(B, T * nh, H, device=dev)).to(bf),
  )


def to_jax(x):
  dtype = jnp.bfloat16 if str(x.dtype) == "torch.bfloat16" else jnp.float32
  return jnp.asarray(x.detach().float().cpu().numpy()).astype(dtype)


def ours(nh, mode):
  def fwd(q, k, v, g, beta):
    return householder_delta_product(q, k, v, g, beta, num_householder=nh, implementation="pallas")[
      0
    ]

  if mode == "fwd":
    return jax.jit(fwd)
  loss = lambda *a: jnp.sum(fwd(*a).astype(jnp.float32))
  return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))


def fla_time(inputs, nh, mode, reps):
  import torch
  import triton
  from fla.ops.gated_delta_product import chunk_gated_delta_product

  x = {n: t.detach().clone() for n, t in inputs.items()}
  if mode == "fwd":
    fn = lambda: chunk_gated_delta_product(**x, num_householder=nh)
  else:
    for t in x.values():
      t.requires_grad_(True)

    def fn():
      o, _ = chunk_gated_delta_product(**x, num_householder=nh)
      o.float().sum().backward()

  fn()
  torch.cuda.synchronize()
  ms = triton.testing.do_bench(fn, warmup=50, rep=max(200, reps * 10), return_mode="median")
  return float(ms)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--out", required=True)
  p.add_argument("--shape", default="8,4096,16,128,128", help="B,T,H,K,V (T tokens, T*n_h steps)")
  p.add_argument("--nh", default="1,2,3")
  p.add_argument("--reps", type=int, default=15)
  p.add_argument("--inner", type=int, default=3)
  args = p.parse_args(argv)
  shape = tuple(int(s) for s in args.shape.split(","))
  import fla.ops.common.chunk_o as fla_chunk_o

  # flash-linear-attention 0.6.0 refuses its gated backward on Hopper with triton < 3.7.1; for
  # timing only we let it run (docs/performance.md#peers-for-side-by-side-timing).
  fla_chunk_o.TRITON_ABOVE_3_7_1 = True
  result = dict(
    what="householder_delta_product (pallas) vs flash-linear-attention chunk_gated_delta_product",
    date=datetime.date.today().isoformat(),
    jax=jax.__version__,
    device=jax.devices()[0].device_kind,
    command=command_line(),
    shape=dict(zip("BTHKV", shape)),
    dtype="bfloat16",
    runs=[],  # not "cases": that key marks `python -m gdp_jax bench` files
  )
  for nh in (int(n) for n in args.nh.split(",")):
    inputs = torch_inputs(shape, nh)
    jin = [to_jax(inputs[n]) for n in ("q", "k", "v", "g", "beta")]
    case = dict(num_householder=nh)
    try:
      import torch
      from fla.ops.gated_delta_product import chunk_gated_delta_product

      o_fla, _ = chunk_gated_delta_product(**inputs, num_householder=nh)
      o_ours = np.asarray(ours(nh, "fwd")(*jin).astype(jnp.float32))
      o_fla = o_fla.float().cpu().numpy()
      case["rel_rms_ours_vs_fla"] = float(
        np.sqrt(np.mean((o_ours - o_fla) ** 2) / np.mean(o_fla**2))
      )
      del o_fla, o_ours
      torch.cuda.empty_cache()
    except Exception as e:  # keep timing the rest
      case["check_error"] = repr(e)[:300]
    result["runs"].append(case)

    def save():  # after every figure: a run cut short keeps what it measured
      print(json.dumps(case), flush=True)
      with open(args.out, "w") as f:
        json.dump(result, f, indent=1)

    save()
    for mode in ("fwd", "fwdbwd"):
      case[f"ours_{mode}_ms"] = time_jax(ours(nh, mode), jin, args.reps, args.inner)[0]
      save()
      case[f"fla_{mode}_ms"] = fla_time(inputs, nh, mode, args.reps)
      case[f"ratio_{mode}"] = case[f"ours_{mode}_ms"] / case[f"fla_{mode}_ms"]
      save()
  return 0


if __name__ == "__main__":
  sys.exit(main())
