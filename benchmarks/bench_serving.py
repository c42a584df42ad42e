"""Time what serving asks of the operator (docs/operator.md#block-boundary-states,
docs/inference.md#verifying-draft-tokens).

  python benchmarks/bench_serving.py --out $OUT/serving.json          # GPU
  python benchmarks/bench_serving.py --smoke --out /tmp/serving.json   # a tiny run, any machine

states: the forward of `gated_delta_product` (o and the final state) at B, T, H, K, V =
  8, 4096, 16, 128, 128 (`--shape`), bfloat16, r = 1, `implementation="triton"`, `"pallas"`
  (what None picks) and `"mosaic_gpu"` (its walk writing them), without and with
  `state_every=N` for N in `--every` (256, 1024): the states' overhead over the forward without
  them.
verify: `gated_delta_product_verify` over Tq tokens (`--tq`: 1, 2, 4, 8) against one
  `gated_delta_product_step` call, B in `--batches` (8, 64), H = 16, K = V = 128, a float32 state,
  each implementation ("triton", "xla"), and "xla-compact" / "triton-compact": compact=True and
  `select_state` to Tq - 1 tokens (verify and rollback; the verify alone as ms_verify_alone).
Median ms per call over `--reps` loops of `--inner` calls (`benchmarks.bench.time_jax`); the JSON
("runs") holds the date, the jax version, the GPU name and the command.
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

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, ROOT)
from benchmarks.bench import DTYPES, make_inputs, time_jax  # noqa: E402
from gdp_jax import (  # noqa: E402
  gated_delta_product,
  gated_delta_product_step,
  gated_delta_product_verify,
  select_state,
)

SHAPE, SMOKE_SHAPE = "8,4096,16,128,128", "1,128,1,16,16"


def states_runs(shape, dtype, everies, implementations, reps, inner):
  B, T, H, K, V = shape
  inputs = make_inputs(B, T, H, K, V, 1, DTYPES[dtype])
  args = tuple(inputs[n] for n in ("q", "k", "v", "g", "beta"))
  runs = []
  for impl in implementations:
    base = None
    for every in [None, *everies]:
      kw = dict(implementation=impl, output_final_state=True)
      kw.update({} if every is None else dict(state_every=every))
      fn = jax.jit(lambda *a, kw=kw: gated_delta_product(*a, **kw))
      ms, all_ms = time_jax(fn, args, reps, inner)
      base = ms if every is None else base
      run = dict(section="states", implementation=impl, state_every=every, ms=round(ms, 4))
      run.update(overhead=None if every is None else round(ms / base - 1, 4))
      run.update(all_ms=[round(x, 4) for x in all_ms])
      print(json.dumps(run), flush=True)
      runs.append(run)
  return runs


def verify_runs(batches, tqs, heads, dim, reps, inner, implementations):
  runs = []
  for B in batches:
    for impl in implementations:
      key = jax.random.split(jax.random.key(0), 6)
      state = jax.random.normal(key[0], (B, heads, dim, dim), jnp.float32) * 0.1
      for tq in [0, *tqs]:  # 0: one single-token step
        shape = (B, max(tq, 1), heads, dim)
        q, k, v = (jax.random.normal(key[i], shape, jnp.bfloat16) * 0.1 for i in (1, 2, 3))
        beta = jnp.full(shape[:3], 0.5, jnp.float32)
        compact = impl.endswith("-compact")
        base = impl.removesuffix("-compact")
        only_verify = None
        if tq == 0:
          step_impl = base
          fn = jax.jit(
            lambda q, k, v, b, s: gated_delta_product_step(
              q[:, 0], k[:, 0], v[:, 0], None, b[:, 0], None, s, implementation=step_impl
            )
          )
        elif compact:  # verify, then the rollback to Tq - 1 tokens (and the verify alone)
          lengths = jnp.full((B,), tq - 1, jnp.int32)
          verify = lambda q, k, v, b, s: gated_delta_product_verify(
            q, k, v, None, b, None, s, compact=True, implementation=base
          )

          def fn(q, k, v, b, s, lengths=lengths, verify=verify):
            return select_state(verify(q, k, v, b, s)[1], lengths)

          fn = jax.jit(fn)
          only_verify = jax.jit(verify)
        else:
          fn = jax.jit(
            lambda q, k, v, b, s: gated_delta_product_verify(
              q, k, v, None, b, None, s, implementation=impl
            )
          )
        ms, all_ms = time_jax(fn, (q, k, v, beta, state), reps, inner)
        run = dict(section="verify", implementation=impl, B=B, tq=tq, ms=round(ms, 4))
        if only_verify is not None:
          run["ms_verify_alone"] = round(
            time_jax(only_verify, (q, k, v, beta, state), reps, inner)[0], 4
          )
        run.update(all_ms=[round(x, 4) for x in all_ms])
        print(json.dumps(run), flush=True)
        runs.append(run)
  return runs


def main(argv=None):
  argv = sys.argv[1:] if argv is None else list(argv)
  p = argparse.ArgumentParser(prog="bench_serving.py", description=__doc__.split("\n")[0])
  p.add_argument("--out", required=True, help="the JSON file to write")
  p.add_argument("--smoke", action="store_true", help=f"shape {SMOKE_SHAPE}, one rep")
  p.add_argument("--shape", default=None, help=f"B,T,H,K,V (default {SHAPE})")
  p.add_argument("--every", default="256,1024")
  p.add_argument("--tq", default="1,2,4,8")
  p.add_argument("--batches", default="8,64")
  p.add_argument("--sections", default="states,verify")
  p.add_argument("--reps", type=int, default=None, help="timed loops (default 20; smoke 1)")
  p.add_argument("--inner", type=int, default=None, help="calls per loop (default 10; smoke 1)")
  args = p.parse_args(argv)
  shape = tuple(int(s) for s in (args.shape or (SMOKE_SHAPE if args.smoke else SHAPE)).split(","))
  reps = args.reps or (1 if args.smoke else 20)
  inner = args.inner or (1 if args.smoke else 10)
  gpu = jax.default_backend() == "gpu"
  dtype = "bf16" if gpu else "f32"
  everies = [64] if args.smoke else [int(x) for x in args.every.split(",")]
  result = dict(
    date=datetime.datetime.now().isoformat(timespec="seconds"),
    jax_version=jax.__version__,
    device=jax.devices()[0].device_kind,
    command=" ".join(["python", "benchmarks/bench_serving.py", *argv]),
    shape=dict(zip("BTHKV", shape)),
    dtype=dtype,
    timing="median over reps of (wall time of `inner` back-to-back calls) / inner, ms per call",
    runs=[],
  )
  sections = args.sections.split(",")
  if "states" in sections:
    impls = ["triton", "pallas", "mosaic_gpu"] if gpu else ["xla"]
    result["runs"] += states_runs(shape, dtype, everies, impls, reps, inner)
  if "verify" in sections:
    batches = [1] if args.smoke else [int(x) for x in args.batches.split(",")]
    tqs = [2] if args.smoke else [int(x) for x in args.tq.split(",")]
    dim, heads = (16, 1) if args.smoke else (128, 16)
    impls = ["triton", "xla", "xla-compact", "triton-compact"] if gpu else ["xla", "xla-compact"]
    result["runs"] += verify_runs(batches, tqs, heads, dim, reps, inner, impls)
  with open(args.out, "w") as f:
    json.dump(result, f, indent=1)
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
