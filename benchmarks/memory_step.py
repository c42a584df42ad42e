"""Peak GPU memory of one training step (forward + backward) of gated_delta_product.

  python benchmarks/memory_step.py --out mem.json [--shape B,T,H,K,V] [--rs 1,2,4]
      [--impls pallas,triton,xla,jla]

`jla` is jax-linear-attention's Gated DeltaNet (r = 1 only, its Mosaic GPU kernels).

Each case runs in a fresh subprocess so `peak_bytes_in_use` belongs to that case alone; the
figure includes the inputs and the gradients (each as large as its input), so the residuals'
share is peak - inputs - gradients.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys

CASE = r"""
import json, os, sys
os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
sys.path.insert(0, {root!r})
import jax, jax.numpy as jnp
from benchmarks.bench import make_inputs, DTYPES
from gdp_jax import gated_delta_product
B, T, H, K, V = {shape}
inputs = make_inputs(B, T, H, K, V, {r}, DTYPES["bf16"])
names = [n for n in ("q", "k", "v", "g", "beta", "mask") if inputs[n] is not None]
def loss(*a):
  x = dict(zip(names, a))
  if {impl!r} == "jla":  # jax-linear-attention's Gated DeltaNet (r = 1), its GPU kernels
    import jla.ops
    beta = x["beta"].astype(x["q"].dtype)
    out = jla.ops.linear_attention("gated_deltanet", x["q"], x["k"], x["v"], g=x["g"],
                                   beta=beta, impl="mosaic_gpu")
    o = out[0] if isinstance(out, tuple) else out
  else:
    o, _ = gated_delta_product(**x, implementation={impl!r})
  return jnp.sum(o.astype(jnp.float32))
step = jax.jit(jax.grad(loss, argnums=tuple(range(len(names)))))
args = [inputs[n] for n in names]
jax.block_until_ready(args)
before = jax.devices()[0].memory_stats() or dict()
grads = jax.block_until_ready(step(*args))
stats = jax.devices()[0].memory_stats() or dict()
in_bytes = sum(a.nbytes for a in args)
print(json.dumps(dict(impl={impl!r}, r={r}, peak_bytes=stats.get("peak_bytes_in_use"),
                      gpu=jax.devices()[0].device_kind, jax_version=jax.__version__,
                      inputs_bytes=in_bytes, grads_bytes=sum(g.nbytes for g in grads),
                      before_bytes=before.get("bytes_in_use"))))
"""


def main(argv=None):
  p = argparse.ArgumentParser()
  p.add_argument("--out", required=True)
  p.add_argument("--shape", default="8,4096,16,128,128")
  p.add_argument("--rs", default="1,2,4")
  p.add_argument("--impls", default="pallas,xla")
  args = p.parse_args(argv)
  root = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
  shape = tuple(int(x) for x in args.shape.split(","))
  results = []
  for impl in args.impls.split(","):
    for r in (int(x) for x in args.rs.split(",")):
      code = CASE.format(root=root, shape=shape, r=r, impl=impl)
      proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300
      )
      lines = [l for l in proc.stdout.splitlines() if l.startswith("{")]
      rec = json.loads(lines[-1]) if lines else dict(impl=impl, r=r, error=proc.stderr[-2000:])
      if "peak_bytes" in rec and rec["peak_bytes"]:
        rec["peak_gib"] = rec["peak_bytes"] / 2**30
        rec["inputs_gib"] = rec["inputs_bytes"] / 2**30
      results.append(rec)
      print(
        impl,
        r,
        {
          k: (round(v, 3) if isinstance(v, float) else v)
          for k, v in rec.items()
          if k in ("peak_gib", "inputs_gib", "error")
        },
        flush=True,
      )
  first = next((rec for rec in results if "gpu" in rec), {})
  meta = dict(
    date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    jax_version=first.get("jax_version"),
    gpu=first.get("gpu"),
    command=" ".join(["python", "benchmarks/memory_step.py"] + sys.argv[1:]),
  )
  with open(args.out, "w") as f:
    json.dump(dict(**meta, shape=args.shape, results=results), f, indent=1)


if __name__ == "__main__":
  main()
