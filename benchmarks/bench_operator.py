"""Time `gated_delta_product` forward and forward + backward, side by side with peers.

  python benchmarks/bench_operator.py --out results.json            # the H200 shapes
  python benchmarks/bench_operator.py --tiny --out /tmp/tiny.json   # a smoke run on CPU

Implementations: ours ("pallas", "xla"), and when importable, flash-linear-attention 0.6.0's
`chunk_gated_delta_rule` (PyTorch + Triton; the same math as r = 1) and jax-linear-attention's
Gated DeltaNet (Mosaic GPU). Each figure is the median over repeated timed loops after warm-up;
a case that fails records its error and the run goes on.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # share the GPU with PyTorch

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from gdp_jax import gated_delta_product  # noqa: E402

DTYPES = {"bf16": jnp.bfloat16, "f16": jnp.float16, "f32": jnp.float32}


def make_inputs(B, T, H, K, V, r, dtype, seed=0):
  keys = jax.random.split(jax.random.key(seed), 6)
  q = jax.random.normal(keys[0], (B, T, H, K), jnp.float32)
  k = jax.random.normal(keys[1], (B, T, H, K), jnp.float32)
  kb = k.reshape(B, T, H, r, K // r)
  k = (kb / jnp.linalg.norm(kb, axis=-1, keepdims=True)).reshape(B, T, H, K)
  q = q / jnp.linalg.norm(q, axis=-1, keepdims=True)
  v = jax.random.normal(keys[2], (B, T, H, V), jnp.float32)
  g = jax.nn.log_sigmoid(jax.random.normal(keys[3], (B, T, H)) + 4.0)
  beta = jax.nn.sigmoid(jax.random.normal(keys[4], (B, T, H)))
  mask = jnp.eye(r) * 0.5 + 0.5
  return dict(q=q.astype(dtype), k=k.astype(dtype), v=v.astype(dtype), g=g, beta=beta,
              mask=mask if r > 1 else None)


def time_jax(fn, args, reps, inner):
  out = fn(*args)
  jax.block_until_ready(out)
  for _ in range(2):
    jax.block_until_ready(fn(*args))
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    for _ in range(inner):
      out = fn(*args)
    jax.block_until_ready(out)
    times.append((time.perf_counter() - t0) / inner * 1e3)
  return statistics.median(times), times


def ours(impl, mode, inputs):
  names = ("q", "k", "v", "g", "beta", "mask")
  args = tuple(inputs[n] for n in names)

  def fwd(*a):
    kw = dict(zip(names, a))
    o, _ = gated_delta_product(**kw, implementation=impl)
    return o

  if mode == "fwd":
    return jax.jit(fwd), args
  do = jnp.ones_like(inputs["v"])

  def loss(*a):
    return jnp.sum(fwd(*a).astype(jnp.float32) * do)
  argnums = tuple(i for i, n in enumerate(names) if inputs[n] is not None)
  grad = jax.grad(lambda *a: loss(*a), argnums=argnums)
  return jax.jit(lambda *a: grad(*a)), args


def fla_case(mode, shape, reps):
  import torch
  from fla.ops.gated_delta_rule import chunk_gated_delta_rule
  import fla.ops.common.chunk_o as fla_chunk_o
  # flash-linear-attention 0.6.0 refuses its gated backward on Hopper with triton < 3.7.1 (a
  # compiler bug); for timing only (never as a reference) we let it run (DESIGN §5).
  fla_chunk_o.TRITON_ABOVE_3_7_1 = True
  import triton
  B, T, H, K, V = shape
  dev = "cuda"
  torch.manual_seed(0)
  q = torch.nn.functional.normalize(torch.randn(B, T, H, K, device=dev), dim=-1).bfloat16()
  k = torch.nn.functional.normalize(torch.randn(B, T, H, K, device=dev), dim=-1).bfloat16()
  v = torch.randn(B, T, H, V, device=dev).bfloat16()
  g = torch.nn.functional.logsigmoid(torch.randn(B, T, H, device=dev) + 4.0).float()
  beta = torch.sigmoid(torch.randn(B, T, H, device=dev)).bfloat16()
  if mode == "fwd":
    fn = lambda: chunk_gated_delta_rule(q, k, v, g, beta)
  else:
    for x in (q, k, v, g, beta):
      x.requires_grad_(True)
    do = torch.ones(B, T, H, V, device=dev, dtype=torch.bfloat16)

    def fn():
      o, _ = chunk_gated_delta_rule(q, k, v, g, beta)
      o.backward(do)
  fn()
  torch.cuda.synchronize()
  ms = triton.testing.do_bench(fn, warmup=50, rep=max(200, reps * 10), return_mode="median")
  return ms


def jla_case(mode, inputs, reps, inner):
  import jla
  args = (inputs["q"], inputs["k"], inputs["v"], inputs["g"], inputs["beta"].astype(
      inputs["q"].dtype))

  def fwd(q, k, v, g, beta):
    out = jla.ops.linear_attention("gated_deltanet", q, k, v, g=g, beta=beta, impl="mosaic_gpu")
    return out[0] if isinstance(out, tuple) else out

  if mode == "fwd":
    fn = jax.jit(fwd)
  else:
    fn = jax.jit(jax.grad(lambda *a: jnp.sum(fwd(*a).astype(jnp.float32)), argnums=(0, 1, 2, 3, 4)))
  return time_jax(fn, args, reps, inner)[0]


def main(argv=None):
  p = argparse.ArgumentParser()
  p.add_argument("--out", required=True)
  p.add_argument("--shape", default="8,4096,16,128,128", help="B,T,H,K,V")
  p.add_argument("--rs", default="1,2,4")
  p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
  p.add_argument("--modes", default="fwd,fwdbwd")
  p.add_argument("--impls", default="pallas,xla,fla,jla")
  p.add_argument("--reps", type=int, default=15)
  p.add_argument("--inner", type=int, default=5)
  p.add_argument("--tiny", action="store_true", help="a small shape for a CPU smoke run")
  args = p.parse_args(argv)
  if args.tiny:
    args.shape, args.reps, args.inner = "1,64,2,32,32", 2, 1
  shape = tuple(int(x) for x in args.shape.split(","))
  B, T, H, K, V = shape
  dtype = DTYPES[args.dtype]
  results = dict(device=str(jax.devices()[0]), backend=jax.default_backend(),
                 jax_version=jax.__version__, shape=dict(B=B, T=T, H=H, K=K, V=V),
                 dtype=args.dtype, date=time.strftime("%Y-%m-%d %H:%M:%S"),
                 command=" ".join(sys.argv), cases=[])
  for mode in args.modes.split(","):
    for r in (int(x) for x in args.rs.split(",")):
      inputs = make_inputs(B, T, H, K, V, r, dtype)
      for impl in args.impls.split(","):
        case = dict(impl=impl, mode=mode, r=r)
        try:
          if impl in ("pallas", "xla"):
            fn, fargs = ours(impl, mode, inputs)
            case["ms"], case["all_ms"] = time_jax(fn, fargs, args.reps, args.inner)
          elif impl == "fla":
            if r != 1:
              continue
            case["ms"] = fla_case(mode, shape, args.reps)
          elif impl == "jla":
            if r != 1:
              continue
            case["ms"] = jla_case(mode, inputs, args.reps, args.inner)
          else:
            raise ValueError(f"unknown implementation {impl}")
        except Exception as e:  # record and go on
          case["error"] = f"{type(e).__name__}: {e}"[:2000]
          case["traceback"] = traceback.format_exc()[-4000:]
        results["cases"].append(case)
        print(f"{mode:7s} r={r} {impl:7s} " +
              (f"{case['ms']:9.3f} ms" if "ms" in case else "ERROR " + case["error"][:300]),
              flush=True)
  with open(args.out, "w") as f:
    json.dump(results, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
