"""Bitwise reproducibility of `gated_delta_product` (docs/precision.md#reproducibility).

  OUT=/tmp/out python scripts/check_reproducible_gpu.py           # on a machine with an NVIDIA GPU
  python scripts/check_reproducible_gpu.py --implementations triton --tiny   # CPU, interpret mode

For each implementation and case, `check` runs o, the final state and the gradients of
<o, do> + <final, dfinal> in every array input (one jitted program) and reports:
  runs_identical  two calls of the same program give the same bits;
  row_identical   one row computed alone (B = 1) gives the same bits as that row within the
                  batch (its inputs and cotangents sliced out of the batch's);
with the names of the arrays that differ and their largest difference. The cases: "mosaic_gpu"
(the Hopper kernels: bfloat16, K = V = 128, r = 1 and 2) and "triton" compiled (bfloat16 and
float32, K = V = 64, r = 2), at B = 8, T = 1000 (a ragged last chunk), H = 4. The JSON goes to
$OUT/reproducible.json (or --out); the exit code is 1 when a check fails.
`--implementations xla` adds the jnp chunked form (docs/precision.md#reproducibility).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from gdp_jax import gated_delta_product  # noqa: E402
from gdp_jax.testing import random_inputs  # noqa: E402

ARRAYS = ("q", "k", "v", "g", "beta", "mask", "initial_state")
CASES = {
  "mosaic_gpu": [
    dict(dtype="bfloat16", K=128, V=128, r=1),
    dict(dtype="bfloat16", K=128, V=128, r=2),
  ],
  "triton": [dict(dtype="bfloat16", K=64, V=64, r=2), dict(dtype="float32", K=64, V=64, r=2)],
  "xla": [dict(dtype="float32", K=64, V=64, r=2)],  # not by default: no batch invariance promised
}
SHAPE = dict(B=8, T=1000, H=4)
TINY = dict(B=3, T=40, H=2)
TINY_DIMS = dict(K=32, V=16)


def _program(implementation, chunk_size):
  """(o, final, gradients) of <o, do> + <final, dfinal> in every array input: one program."""

  def loss(arrays, do, dfinal):
    o, final = gated_delta_product(
      *arrays[:6],
      initial_state=arrays[6],
      output_final_state=True,
      chunk_size=chunk_size,
      implementation=implementation,
    )
    value = jnp.sum(o.astype(jnp.float32) * do) + jnp.sum(final * dfinal)
    return value, (o, final)

  return jax.jit(jax.grad(loss, has_aux=True))


def _bits(x):
  return np.ascontiguousarray(np.asarray(x)).tobytes()


def _compare(a: dict, b: dict) -> dict:
  """{name: largest |a - b|} of the arrays whose bits differ."""
  out = {}
  for name in a:
    if _bits(a[name]) != _bits(b[name]):
      diff = np.abs(np.asarray(a[name], np.float64) - np.asarray(b[name], np.float64))
      out[name] = float(np.nanmax(diff)) if np.isfinite(diff).any() else float("nan")
  return out


def check(implementation, *, dtype="float32", B=8, T=1000, H=4, K=64, V=64, r=2, row=1, seed=0,
          chunk_size=64) -> dict:  # fmt: skip
  """The two reproducibility checks (module docstring) for one implementation and case."""
  mask_kind = "token" if r > 1 else None  # per token: every gradient is per row
  inp = random_inputs(seed, B=B, T=T, H=H, K=K, V=V, r=r, mask_kind=mask_kind, dtype=dtype)
  arrays = tuple(inp[n] for n in ARRAYS)
  rng = np.random.default_rng(seed + 1)
  do = jnp.asarray(rng.standard_normal((B, T, H, V)), jnp.float32)
  dfinal = jnp.asarray(rng.standard_normal((B, H, K, V)), jnp.float32)
  program = _program(implementation, chunk_size)

  def results(arrays, do, dfinal):
    grads, (o, final) = program(arrays, do, dfinal)
    grads = {f"d{n}": d for n, d in zip(ARRAYS, grads) if d is not None}
    out = {"o": o, "final": final, **grads}
    return {k: np.asarray(v) for k, v in out.items()}

  first = results(arrays, do, dfinal)
  second = results(arrays, do, dfinal)
  one = lambda x: None if x is None else x[row : row + 1]
  alone = results(tuple(map(one, arrays)), one(do), one(dfinal))
  in_batch = {name: one(x) for name, x in first.items()}
  runs, rows = _compare(first, second), _compare(in_batch, alone)
  return dict(
    implementation=implementation,
    dtype=dtype,
    shape=dict(B=B, T=T, H=H, K=K, V=V, r=r, chunk_size=chunk_size),
    row=row,
    runs_identical=not runs,
    runs_differ=runs,
    row_identical=not rows,
    row_differs=rows,
  )


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--implementations", default="mosaic_gpu,triton")
  parser.add_argument("--tiny", action="store_true", help="small shapes (CPU, interpret mode)")
  parser.add_argument("--out", default=None, help="the JSON file (default $OUT/reproducible.json)")
  args = parser.parse_args(argv)
  records = []
  for implementation in args.implementations.split(","):
    for case in CASES[implementation]:
      case = dict(case, **TINY_DIMS) if args.tiny else case
      shape = TINY if args.tiny else SHAPE
      try:
        record = check(implementation, **case, **shape)
      except Exception as error:  # a case that cannot run here is reported, the others still run
        record = dict(
          implementation=implementation, **case, error=f"{type(error).__name__}: {error}"
        )
      print(json.dumps(record), flush=True)
      records.append(record)
  out = pathlib.Path(args.out or os.path.join(os.environ.get("OUT", "."), "reproducible.json"))
  out.parent.mkdir(parents=True, exist_ok=True)
  device = jax.devices()[0]
  summary = dict(
    jax_version=jax.__version__,
    device=f"{device.platform}: {device.device_kind}",
    xla_flags=os.environ.get("XLA_FLAGS", ""),
    records=records,
  )
  out.write_text(json.dumps(summary, indent=1) + "\n")
  ok = all(r.get("runs_identical") and r.get("row_identical") for r in records)
  print(f"{'all identical' if ok else 'NOT identical (or failed)'}; wrote {out}")
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
