"""The non-finite guard's cost on clean inputs: the operator's forward and forward + backward with
the guard on and off, per Pallas implementation, in one process.

  PYTHONPATH=. python benchmarks/guard_cost.py --out guard_cost.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp

from gdp_jax.ops import dispatch
from gdp_jax.testing import random_inputs


def timed(fn, args, reps, inner):
  for _ in range(2):
    jax.block_until_ready(fn(*args))
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    for _ in range(inner):
      out = fn(*args)
    jax.block_until_ready(out)
    times.append((time.perf_counter() - t0) / inner * 1e3)
  return statistics.median(times)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--out", required=True)
  parser.add_argument("--impls", default="triton,mosaic_gpu")
  parser.add_argument("--shape", default="8,4096,16,128,128")
  parser.add_argument("--r", type=int, default=1)
  parser.add_argument("--modes", default="fwd,fwdbwd")
  parser.add_argument("--reps", type=int, default=7)
  parser.add_argument("--inner", type=int, default=3)
  args = parser.parse_args(argv)
  batch, t_len, heads, dim_k, dim_v = (int(x) for x in args.shape.split(","))
  x = random_inputs(0, batch, t_len, heads, dim_k, dim_v, args.r, "head", jnp.bfloat16, False)
  mask5 = x["mask"][None, None]  # the normalised [1, 1, H, r, r] the implementations take
  h0 = jnp.zeros((batch, heads, dim_k, dim_v), jnp.float32)
  arrays = (x["q"], x["k"], x["v"], x["g"], x["beta"], mask5)
  record = dict(
    env=dict(
      date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
      command=" ".join(
        ["python", "benchmarks/guard_cost.py"]
        + [os.path.basename(a) if os.path.isabs(a) else a for a in (argv or sys.argv[1:])]
      ),
      jax=jax.__version__,
      device=jax.devices()[0].device_kind,
    ),
    cases=[],
  )
  for impl in args.impls.split(","):
    for guard in (True, False):
      for mode in args.modes.split(","):
        run = dispatch.entry("gated_delta_product", impl, nonfinite_guard=guard)

        def fwd(*a, run=run):
          return run(*a, h0, dim_k**-0.5, 64)[0]

        fn = (
          jax.jit(fwd)
          if mode == "fwd"
          else jax.jit(jax.grad(lambda *a, f=fwd: jnp.sum(f(*a).astype(jnp.float32)), range(6)))
        )
        case = dict(impl=impl, guard=guard, mode=mode, r=args.r)
        try:
          case["ms"] = timed(fn, arrays, args.reps, args.inner)
        except Exception as e:  # noqa: BLE001
          case["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        record["cases"].append(case)
        print(case, flush=True)
        with open(args.out, "w") as f:
          json.dump(record, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
