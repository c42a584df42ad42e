"""Time the public operator of two or more checkouts of this repository side by side on one device:
the check that a change of the house left the speed alone (forward, and the training step:
`jax.value_and_grad` of a loss that reads o's values, as benchmarks/bench.py times it).

  python benchmarks/compare_versions.py --trees before=../old-checkout,after=. --rs 1,2,4 \
      --out compare.json

Each checkout runs in its own process (its `gdp_jax` first on the path), only through
`gdp_jax.gated_delta_product` with its defaults, so checkouts of any age compare; the checkouts
run in turn, `--rounds` times, and the figure is the median over every timed run of a case.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

SHAPE = "8,4096,16,128,128"  # B, T, H, K, V


def worker(shape, rs, modes, reps, inner, dtype_name):
  """Time this process's gdp_jax, printing a line `CASE {"r{r} {mode}": [ms per call of each
  run] or an error}` per case as it finishes."""
  import jax
  import jax.numpy as jnp

  from gdp_jax import gated_delta_product

  dtype = jnp.dtype(dtype_name)
  b, t, h, kd, vd = shape
  print("DEVICE " + json.dumps([jax.devices()[0].device_kind, jax.__version__]), flush=True)
  for r in rs:
    keys = jax.random.split(jax.random.key(r), 6)
    q = jax.random.normal(keys[0], (b, t, h, kd), dtype)
    k = jax.random.normal(keys[1], (b, t, h, kd), jnp.float32)
    k = (k / jnp.linalg.norm(k, axis=-1, keepdims=True)).astype(dtype)
    v = jax.random.normal(keys[2], (b, t, h, vd), dtype)
    g = -jax.nn.softplus(jax.random.normal(keys[3], (b, t, h), jnp.float32))
    beta = jax.nn.sigmoid(jax.random.normal(keys[4], (b, t, h), jnp.float32))
    mask = None if r == 1 else jnp.tril(jnp.ones((r, r), jnp.float32))
    weights = jax.random.normal(keys[5], (b, t, h, vd), jnp.float32)

    def fwd(q, k, v, g, beta):
      return gated_delta_product(q, k, v, g, beta, mask)[0]

    def loss(*a):
      return jnp.sum(fwd(*a).astype(jnp.float32) * weights)

    fns = {"fwd": jax.jit(fwd), "step": jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)))}
    for mode in modes:
      fn, args = fns[mode], (q, k, v, g, beta)
      try:
        for _ in range(3):
          jax.block_until_ready(fn(*args))
        runs = []
        for _ in range(reps):
          t0 = time.perf_counter()
          for _ in range(inner):
            res = fn(*args)
          jax.block_until_ready(res)
          runs.append((time.perf_counter() - t0) / inner * 1e3)
        res = runs
      except Exception as e:  # a failing case is recorded; the rest still run
        res = f"{type(e).__name__}: {str(e)[:300]}"
      print("CASE " + json.dumps({f"r{r} {mode}": res}), flush=True)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--trees", default="after=.", help="label=path,... (checkouts of this repository)")
  p.add_argument("--shape", default=SHAPE, help="B,T,H,K,V")
  p.add_argument("--rs", default="1,2,4")
  p.add_argument("--modes", default="fwd,step")
  p.add_argument("--rounds", type=int, default=1)
  p.add_argument("--reps", type=int, default=7)
  p.add_argument("--inner", type=int, default=10)
  p.add_argument("--dtype", default="bfloat16")
  p.add_argument("--budget-s", type=float, default=None, help="stop (keeping what ran) after this")
  p.add_argument("--out", default=None)
  p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
  a = p.parse_args(argv)
  modes = a.modes.split(",")
  shape = tuple(int(x) for x in a.shape.split(","))
  if a.worker:
    worker(shape, [int(x) for x in a.rs.split(",")], modes, a.reps, a.inner, a.dtype)
    return 0
  trees = dict(item.split("=", 1) for item in a.trees.split(","))
  start = time.perf_counter()
  result = dict(
    date=time.strftime("%Y-%m-%d"),
    jax_version=None,
    device=None,
    command="python benchmarks/compare_versions.py "
    + " ".join(sys.argv[1:] if argv is None else argv),
    shape=dict(zip("BTHKV", shape)),
    dtype=a.dtype,
    ms_median={},
    runs={label: {} for label in trees},
    errors={},
  )
  # one process per (round, r, checkout), the checkouts in turn for each r: the first cases
  # compare whole even when the budget ends the run
  for _ in range(a.rounds):
    for r in a.rs.split(","):
      for label, path in trees.items():
        left = None if a.budget_s is None else a.budget_s - (time.perf_counter() - start)
        if left is not None and left <= 0:
          result["errors"][f"{label} r{r}"] = "not run: --budget-s spent"
        else:
          _run_worker(a, r, label, path, left, result)
          _summarise(result, trees)
        if a.out:
          with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
  return 0


def _run_worker(a, r, label, path, timeout, result):
  """One worker process: its CASE lines into `result` (a killed worker keeps its earlier cases)."""
  env = dict(os.environ, PYTHONPATH=os.path.abspath(path))
  flags = dict(shape=a.shape, rs=r, modes=a.modes, reps=a.reps, inner=a.inner, dtype=a.dtype)
  cmd = [sys.executable, os.path.abspath(__file__), "--worker"]
  cmd += [str(x) for name, value in flags.items() for x in (f"--{name}", value)]
  try:
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=path, timeout=timeout)
    stdout, stderr = proc.stdout, proc.stderr
  except subprocess.TimeoutExpired as e:
    stdout = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
    stderr = "killed: --budget-s spent"
  got = False
  for line in stdout.splitlines():
    if line.startswith("DEVICE "):
      result["device"], result["jax_version"] = json.loads(line[7:])
    elif line.startswith("CASE "):
      got = True
      for case, res in json.loads(line[5:]).items():
        if isinstance(res, str):
          result["errors"][f"{label} {case}"] = res
        else:
          result["runs"][label].setdefault(case, []).extend(res)
  if not got:
    result["errors"][f"{label} r{r}"] = stderr[-2000:]


def _summarise(result, trees):
  """Median per case and checkout into result["ms_median"], printed with the ratios to the first."""
  table = {}
  for label, cases in result["runs"].items():
    for case, times in cases.items():
      table.setdefault(case, {})[label] = round(statistics.median(times), 4)
  result["ms_median"] = table
  first = next(iter(trees))
  for case, row in sorted(table.items()):
    cells = "  ".join(f"{label} {ms:.3f}" for label, ms in row.items())
    ratios = "  ".join(
      f"{label}/{first} {row[label] / row[first]:.3f}"
      for label in row
      if label != first and first in row
    )
    print(f"{case:10s} {cells}  {ratios}", flush=True)


if __name__ == "__main__":
  sys.exit(main())
