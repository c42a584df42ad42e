"""Time the Pallas kernels' guard for non-finite inputs (docs/precision.md#non-finite-inputs).

  python benchmarks/bench_nonfinite.py --out nonfinite.json           # GPU: bf16, r = 1
  python benchmarks/bench_nonfinite.py --smoke --out /tmp/smoke.json   # a tiny run, any machine

`gated_delta_product(..., implementation="pallas")` at B, T, H, K, V = 8, 4096, 16, 128, 128
(`--shape`), bfloat16, r = 1, forward (o) and forward + backward (the gradient of sum(o * do) in
q, k, v, g and beta), each
  guarded:   as shipped (the Triton kernels: the inputs cleaned with selects, the kernels once,
             the spoiled outputs marked; the Hopper kernels: the reductions that find the marks,
             the cleaning inside the kernels' loads, docs/mosaic_gpu.md#the-guard-in-the-loads),
  unguarded: the kernels alone (`options=...replace(nonfinite_guard=False)`),
  nan in k:  guarded, with one nan in k (the same program: it should cost what "guarded" costs),
the median ms per call over `--reps` loops of `--inner` calls (`benchmarks.bench.time_jax`), the
compiled program's temporary memory, and the guard's overhead over the unguarded time. The JSON
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
import numpy as np

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, ROOT)
from benchmarks.bench import DTYPES, make_inputs, time_jax  # noqa: E402
from gdp_jax import gated_delta_product  # noqa: E402
from pallas_kernels.common.options import heuristic_options  # noqa: E402

SHAPE = "8,4096,16,128,128"
SMOKE_SHAPE = "1,64,1,16,16"
NAMES = ("q", "k", "v", "g", "beta")


def command(argv):
  """The command, the script's path relative to the repository."""
  script = os.path.relpath(os.path.abspath(__file__), ROOT)
  return " ".join(["python", script, *argv])


def compiled(mode, inputs, guard):
  """The compiled forward or forward + backward of implementation="pallas" over NAMES, the
  guard on or off (it is read while tracing, hence compiled here)."""

  q, v = inputs["q"], inputs["v"]
  r = inputs["mask"].shape[-1] if inputs.get("mask") is not None else 1
  options = heuristic_options(r=r, dim_k=q.shape[-1], dim_v=v.shape[-1], dtype=q.dtype)
  options = options.replace(nonfinite_guard=guard)

  def fwd(*a):
    o, _ = gated_delta_product(*a, implementation="pallas", options=options)
    return o

  if mode == "fwd":
    fn = jax.jit(fwd)
  else:
    do = jnp.ones_like(inputs["v"])
    loss = lambda *a: jnp.sum(fwd(*a).astype(jnp.float32) * do)
    fn = jax.jit(jax.grad(loss, argnums=tuple(range(len(NAMES)))))
  args = tuple(inputs[n] for n in NAMES)
  return fn.lower(*args).compile()


def with_nan_in_k(inputs):
  """One nan in k, in the middle of the sequence of batch row 0, head 0."""
  t = inputs["k"].shape[1] // 2
  return dict(inputs, k=inputs["k"].at[0, t, 0, 0].set(jnp.nan)), t


def guard_pieces(inputs, reps, inner):
  """The guard's two passes timed alone: `clean` (the forward's, q left as it is, and the
  training forward's, every input) and `mark` on the output."""
  from gdp_jax.ops.gated_delta_product import nonfinite

  q, k, v, g, beta = (inputs[n] for n in ("q", "k", "v", "g", "beta"))
  mask = jnp.ones((1, 1, 1, 1, 1), jnp.float32)
  clean = jax.jit(lambda *a: nonfinite.clean(*a, local=True))  # as the kernels run it
  _, marks = clean(q, k, v, g, beta, mask)
  mark = jax.jit(nonfinite.mark)
  final = jnp.zeros((v.shape[0], v.shape[2], k.shape[-1], v.shape[-1]), jnp.float32)
  runs = []
  for case, fn, fn_args in (
    ("clean (every input)", clean, (q, k, v, g, beta, mask)),
    ("clean (q kept)", jax.jit(lambda *a: clean(*a)[0][1:]), (q, k, v, g, beta, mask)),
    ("mark", mark, (v, final, marks)),
  ):
    ms, all_ms = time_jax(fn, fn_args, reps, inner)
    runs.append(
      dict(mode="pieces", case=case, ms=round(ms, 4), all_ms=[round(x, 4) for x in all_ms])
    )
    print(json.dumps(runs[-1]), flush=True)
  return runs


def main(argv=None):
  argv = sys.argv[1:] if argv is None else list(argv)
  p = argparse.ArgumentParser(prog="bench_nonfinite.py", description=__doc__.split("\n")[0])
  p.add_argument("--out", required=True, help="the JSON file to write")
  p.add_argument("--smoke", action="store_true", help=f"shape {SMOKE_SHAPE}, one rep")
  p.add_argument("--shape", default=None, help=f"B,T,H,K,V (default {SHAPE})")
  p.add_argument("--modes", default="fwd,fwdbwd", help="fwd and/or fwdbwd")
  p.add_argument("--reps", type=int, default=None, help="timed loops (default 20; smoke 1)")
  p.add_argument("--inner", type=int, default=None, help="calls per loop (default 10; smoke 1)")
  args = p.parse_args(argv)
  shape = tuple(int(s) for s in (args.shape or (SMOKE_SHAPE if args.smoke else SHAPE)).split(","))
  if len(shape) != 5:
    raise SystemExit(f"--shape: B,T,H,K,V (five integers), got {args.shape!r}")
  modes = args.modes.split(",")
  if not set(modes) <= {"fwd", "fwdbwd"}:
    raise SystemExit(f"--modes: fwd and/or fwdbwd, got {args.modes!r}")
  reps = args.reps or (1 if args.smoke else 20)
  inner = args.inner or (1 if args.smoke else 10)
  dtype = "bf16" if jax.default_backend() == "gpu" else "f32"  # interpreted kernels: float32
  B, T, H, K, V = shape
  inputs = make_inputs(B, T, H, K, V, 1, DTYPES[dtype])
  bad, bad_t = with_nan_in_k(inputs)
  bytes_read = sum(inputs[n].size * inputs[n].dtype.itemsize for n in NAMES)

  result = dict(
    date=datetime.datetime.now().isoformat(timespec="seconds"),
    jax_version=jax.__version__,
    device=jax.devices()[0].device_kind,
    backend=jax.default_backend(),
    command=command(argv),
    shape=dict(zip("BTHKV", shape)),
    r=1,
    dtype=dtype,
    reps=reps,
    inner=inner,
    input_bytes=bytes_read,
    timing="median over reps of (wall time of `inner` back-to-back calls) / inner, ms per call",
    runs=[],
  )
  for mode in modes:
    times = {}
    outs = {}
    programs = {guard: compiled(mode, inputs, guard) for guard in (False, True)}
    for case, guard, case_inputs in (
      ("unguarded", False, inputs),
      ("guarded", True, inputs),
      ("nan in k", True, bad),  # the same compiled program as "guarded"
    ):
      fn = programs[guard]
      fn_args = tuple(case_inputs[n] for n in NAMES)
      ms, all_ms = time_jax(fn, fn_args, reps, inner)
      mem = fn.memory_analysis()
      times[case] = ms
      outs[case] = jax.tree.map(np.asarray, fn(*fn_args))
      run = dict(
        mode=mode,
        case=case,
        guard=guard,
        ms=round(ms, 4),
        all_ms=[round(x, 4) for x in all_ms],
        temp_bytes=getattr(mem, "temp_size_in_bytes", None),
      )
      result["runs"].append(run)
      print(json.dumps(run), flush=True)
    first = lambda tree: jax.tree.leaves(tree)[0]  # o (fwd) or dq (fwdbwd)
    same = np.array_equal(first(outs["guarded"]), first(outs["unguarded"]), equal_nan=True)
    o_bad = first(outs["nan in k"])
    result["runs"].append(
      dict(
        mode=mode,
        case="summary",
        guard_overhead_ms=round(times["guarded"] - times["unguarded"], 4),
        guard_overhead_pct=round(100 * (times["guarded"] / times["unguarded"] - 1), 2),
        nan_in_k_over_unguarded=round(times["nan in k"] / times["unguarded"], 3),
        guarded_equals_unguarded=bool(same),
        # fwd: o of row 0, head 0 before the nan is finite, from it on nan
        nan_marks_ok=(
          None
          if mode != "fwd"
          else bool(
            np.all(np.isfinite(o_bad[0, :bad_t, 0])) and np.all(np.isnan(o_bad[0, bad_t:, 0]))
          )
        ),
      )
    )
    print(json.dumps(result["runs"][-1]), flush=True)
  result["runs"].extend(guard_pieces(inputs, reps, inner))
  with open(args.out, "w") as f:
    json.dump(result, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
