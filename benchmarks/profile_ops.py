"""Where a jitted operator call's device time goes: jax's profiler, kernel by kernel.

  python benchmarks/profile_ops.py --out ops.json [--impls pallas,triton] [--modes fwd,fwdbwd]
      [--guard on,off] [--r 1] [--shape 8,4096,16,128,128] [--calls 10] [--top 25]
      [--layouts unpacked,packed64,long30k]

For each case the jitted `gated_delta_product` call (forward, or a training step: the loss
reading o) runs `--calls` times under `jax.profiler.trace`; the trace's device events (the GPU
planes' kernel lines) are summed by name and divided by the number of calls: the time of each
kernel and XLA fusion per call, the largest first. `jla` in --impls profiles
jax-linear-attention's Gated DeltaNet (r = 1, no guard) the same way. `--layouts` also profiles
the B x T tokens packed into one row (benchmarks/bench_varlen.py's layouts: 64 random lengths,
one 30k sequence). Kept with the date, jax version, GPU and command.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import glob
import json
import os
import sys
import tempfile

import jax

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, ROOT)
from benchmarks.bench import DTYPES, make_inputs, training_step  # noqa: E402
from gdp_jax import gated_delta_product  # noqa: E402
from pallas_kernels.common.options import heuristic_options  # noqa: E402

NAMES = ("q", "k", "v", "g", "beta", "mask")


def jla_program(mode, inputs):
  """jax-linear-attention's Gated DeltaNet (r = 1), as benchmarks/bench.py times it."""
  import jla.ops

  names = ("q", "k", "v", "g", "beta")
  args = [inputs[n] for n in names]
  args[-1] = args[-1].astype(inputs["q"].dtype)

  def fwd(*a):
    out = jla.ops.linear_attention("gated_deltanet", *a[:3], g=a[3], beta=a[4], impl="mosaic_gpu")
    return out[0] if isinstance(out, tuple) else out

  return _timed(fwd, mode), args


def program(impl, mode, inputs, guard, cu_seqlens=None):
  if impl == "jla":
    return jla_program(mode, inputs)
  names = [n for n in NAMES if inputs[n] is not None]
  r = 1 if inputs["mask"] is None else inputs["mask"].shape[-1]
  q, v = inputs["q"], inputs["v"]
  options = heuristic_options(r=r, dim_k=q.shape[-1], dim_v=v.shape[-1], dtype=q.dtype)
  options = options.replace(nonfinite_guard=guard)

  def fwd(*a):
    o, _ = gated_delta_product(
      **dict(zip(names, a)), cu_seqlens=cu_seqlens, implementation=impl, options=options
    )
    return o

  return _timed(fwd, mode), [inputs[n] for n in names]


def _timed(fwd, mode):
  """jit of fwd, or of a training step (`benchmarks/bench.py training_step`: the loss reads o's
  values, so no output kernel is dropped)."""
  if mode == "fwd":
    return jax.jit(fwd)

  def step(*a):
    return training_step(fwd, jax.eval_shape(fwd, *a).shape, len(a))(*a)

  return jax.jit(step)


def device_times(trace_dir, calls):
  """({event name: ms per call} over the device planes' stream lines of the trace in
  trace_dir, the names of every device line seen)."""
  from jax.profiler import ProfileData

  totals: dict[str, float] = collections.defaultdict(float)
  seen = set()
  for path in glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True):
    data = ProfileData.from_file(path)
    for plane in data.planes:
      if not plane.name.startswith("/device:GPU"):
        continue
      for line in plane.lines:
        seen.add(line.name)
        if "kernel" not in line.name.lower() and "stream" not in line.name.lower():
          continue
        for event in line.events:
          totals[event.name] += event.duration_ns / 1e6 / calls
  return dict(sorted(totals.items(), key=lambda kv: -kv[1])), sorted(seen)


def cases(args):
  """(layout, impl, mode, guard) in the order they run."""
  for layout in args.layouts.split(","):
    for impl in args.impls.split(","):
      for mode in args.modes.split(","):
        for guard in args.guard.split(",") if impl != "jla" else ["n/a"]:
          yield layout, impl, mode, guard


def packed_inputs(inputs, layout, shape):
  """(inputs, cu_seqlens or None): the B x T tokens in one row as `layout` packs them
  (benchmarks/bench_varlen.py)."""
  if layout == "unpacked":
    return inputs, None
  from benchmarks.bench_varlen import layout_inputs

  names = ("q", "k", "v", "g", "beta")
  args, cu, _ = layout_inputs(layout, inputs, shape, 64, shape[2])
  return {**inputs, **dict(zip(names, args[:5]))}, args[5]


def main(argv=None):
  argv = sys.argv[1:] if argv is None else list(argv)
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--out", required=True)
  p.add_argument("--impls", default="pallas")
  p.add_argument("--modes", default="fwd,fwdbwd")
  p.add_argument("--guard", default="on,off")
  p.add_argument("--r", type=int, default=1)
  p.add_argument("--shape", default="8,4096,16,128,128")
  p.add_argument("--calls", type=int, default=10)
  p.add_argument("--top", type=int, default=25)
  p.add_argument("--layouts", default="unpacked", help="unpacked, packed64, long30k (r = 1)")
  args = p.parse_args(argv)
  B, T, H, K, V = (int(x) for x in args.shape.split(","))
  inputs = make_inputs(B, T, H, K, V, args.r, DTYPES["bf16"])
  result = dict(
    date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    jax_version=jax.__version__,
    gpu=jax.devices()[0].device_kind,
    command=" ".join(["python", "benchmarks/profile_ops.py", *argv]),
    profiles=[],  # not "cases": that key marks `python -m benchmarks.bench` files
  )
  for layout, impl, mode, guard in cases(args):
    case_inputs, cu = packed_inputs(inputs, layout, (B, T, H, K, V))
    fn, fn_args = program(impl, mode, case_inputs, guard == "on", cu)
    jax.block_until_ready(fn(*fn_args))
    with tempfile.TemporaryDirectory() as trace_dir:
      with jax.profiler.trace(trace_dir):
        for _ in range(args.calls):
          out = fn(*fn_args)
        jax.block_until_ready(out)
      times, lines = device_times(trace_dir, args.calls)
    top = dict(list(times.items())[: args.top])
    case = dict(impl=impl, mode=mode, guard=guard, layout=layout)
    case["total_ms"] = round(sum(times.values()), 4)
    case["device_lines"] = lines
    case["ms"] = {name: round(ms, 4) for name, ms in top.items()}
    result["profiles"].append(case)
    print(json.dumps(case), flush=True)
    with open(args.out, "w") as f:
      json.dump(result, f, indent=1)


if __name__ == "__main__":
  main()
