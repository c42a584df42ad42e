"""Sweep the launch parameters of the forward-stage kernels the backward reruns, wy and chunk_h
(GPU tuning; not a test; the fused forward's kernels: benchmarks/sweep_fused.py).

  python benchmarks/sweep_forward.py --out sweep.json [--rs 1,2,4]

Prints the median time of each variant; the launches chosen go to the tuning table
(pallas_kernels/triton/tuning/h200.json).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from benchmarks.bench import DTYPES, make_inputs, time_jax  # noqa: E402
from gdp_jax.ops.gated_delta_product import triton as gdp_triton  # noqa: E402
from gdp_jax.ops.gated_delta_product import xla  # noqa: E402
from gdp_jax.ops.validation import normalize_mask  # noqa: E402
from pallas_kernels.common import cumsum  # noqa: E402
from pallas_kernels.common.options import Launch  # noqa: E402
from pallas_kernels.triton.forward import chunk_h, wy  # noqa: E402

VARIANTS = {
  "wy": [dict(num_warps=w) for w in (4, 8)],
  "chunk_h": [
    dict(block_v=bv, num_warps=w, num_stages=s)
    for bv, w, s in (
      (32, 2, 2),
      (32, 4, 2),
      (32, 4, 3),
      (64, 4, 2),
      (64, 8, 2),
      (64, 4, 3),
      (128, 8, 2),
    )
  ],
}


def main(argv=None):
  p = argparse.ArgumentParser()
  p.add_argument("--out", required=True)
  p.add_argument("--shape", default="8,4096,16,128,128")
  p.add_argument("--rs", default="1,2,4")
  p.add_argument("--stages", default=",".join(VARIANTS))
  p.add_argument("--reps", type=int, default=7)
  p.add_argument("--inner", type=int, default=5)
  args = p.parse_args(argv)
  B, T, H, K, V = (int(x) for x in args.shape.split(","))
  out = []
  for r in (int(x) for x in args.rs.split(",")):
    inputs = make_inputs(B, T, H, K, V, r, DTYPES["bf16"])
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    mask, _ = normalize_mask(inputs["mask"], B, T, H, K)
    bt = gdp_triton.pallas_chunk(64, r)
    cr = dict(chunk=bt, key_blocks=r)
    g = jnp.moveaxis(inputs["g"], 1, 2)
    beta = jnp.moveaxis(inputs["beta"], 1, 2)
    h0 = jnp.zeros((B, H, K, V), jnp.float32)
    gcum = cumsum.chunk_local_cumsum(g, bt)
    ai = xla.solve_tril(xla.chunk_kkt(k, beta, mask, gcum, bt), bt * r).astype(q.dtype)
    w, u = wy.recompute_w_u(k, v, beta, mask, gcum, ai, **cr)
    calls = {
      "wy": lambda p: (
        jax.jit(lambda *x: wy.recompute_w_u(*x, **cr, launch=Launch(**p))),
        (k, v, beta, mask, gcum, ai),
      ),
      "chunk_h": lambda p: (
        jax.jit(lambda *x: chunk_h.chunk_state(*x, **cr, launch=Launch(**p))),
        (k, w, u, gcum, h0),
      ),
    }
    for stage in args.stages.split(","):
      for params in VARIANTS[stage]:
        rec = dict(r=r, bt=bt, stage=stage, params=params)
        try:
          fn, fargs = calls[stage](params)
          rec["ms"] = time_jax(fn, fargs, args.reps, args.inner)[0]
          print(f"r={r} bt={bt} {stage:10s} {params} {rec['ms']:.3f} ms", flush=True)
        except Exception as e:
          rec["error"] = f"{type(e).__name__}: {e}"[:2000]
          print(f"r={r} {stage} {params} ERROR {rec['error'][:400]}", flush=True)
        out.append(rec)
  with open(args.out, "w") as f:
    json.dump(dict(shape=args.shape, device=str(jax.devices()[0]), results=out), f, indent=1)


if __name__ == "__main__":
  main()
