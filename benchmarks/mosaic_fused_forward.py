"""Check and time the fused Mosaic GPU forward (fused_forward.py, docs/mosaic_gpu.md) on sm_90.

  PYTHONPATH=. python benchmarks/mosaic_fused_forward.py --out fused.json
  PYTHONPATH=. python benchmarks/mosaic_fused_forward.py --tiny --out /tmp/tiny.json   # CPU smoke

Per r in 1, 2, 4 (bf16, B=8, T=4096, H=16, K=V=128), each r in its own process (a CUDA fault
kills a process's context; its output, with ptxas's report, in `OUT.rR.log`), each case recorded
on its own in the JSON: compile the fused kernel and its `--variants`; check o and the final state
against "xla" (bar 5e-3 relative RMS) and the two-kernel forward, and the operator's non-finite
guard on planted nan and inf; time the fused and two-kernel forwards and `gated_delta_product`
(defaults; without the guard; with the two-kernel forward): median ms of `--reps` runs of
`--inner` back-to-back jitted calls, all returning the final state. `--tiny`: the interpreter.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
os.environ.setdefault("NPROC", "8")  # the interpreter's warpgroups are CPU threads (--tiny)

import jax  # noqa: E402
import jax.experimental.pallas.mosaic_gpu as plgpu  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import gdp_jax  # noqa: E402
from benchmarks.mosaic_gpu_check import (  # noqa: E402
  BENCH,
  TINY,
  environment,
  make_inputs,
  rel_rms,
  summarise,
  time_fn,
)
from pallas_kernels.mosaic_gpu import forward as forward_mod  # noqa: E402
from pallas_kernels.mosaic_gpu import fused_forward  # noqa: E402

F32 = jnp.float32
BAR = 5e-3
# name: keyword arguments of fused_walk beyond the defaults
VARIANTS = {
  "default": {},
  "regs_184_128_24_176": dict(registers=(184, 128, 24, 176)),  # more for the inverse
  "regs_200_152_40_120": dict(registers=(200, 152, 40, 120)),
  "no_diag_solve": dict(diag_solve=False),
  # the output warpgroup forms the odd chunks' inverses
  "split_inverse": dict(split_inverse=True, registers=(176, 160, 24, 152)),
  # profiling only (its output is wrong: not checked): the walk with an inverse that costs nothing
  "profile_without_inverse": dict(without_inverse=True),
}
# (mask, initial state) checked per r
CHECK_MASKS = {
  1: (("none", True), ("head", False)),
  2: (("shared", False), ("token", True)),
  4: (("head", True), ("token", False)),
}


def fused_fn(interpret, **variant):
  def run(q, k, v, g, beta, mask, initial_state):
    walk = functools.partial(fused_forward.fused_walk, **variant)
    saved = forward_mod.fused_walk
    forward_mod.fused_walk = walk  # the variant inside forward's preparation
    try:
      return forward_mod.forward(
        q,
        k,
        v,
        g,
        beta,
        mask,
        initial_state=initial_state,
        output_final_state=True,
        fused=True,
        interpret=interpret,
      )
    finally:
      forward_mod.fused_walk = saved

  return jax.jit(run)


def two_kernel_fn(interpret):
  def run(q, k, v, g, beta, mask, initial_state):
    return forward_mod.forward(
      q,
      k,
      v,
      g,
      beta,
      mask,
      initial_state=initial_state,
      output_final_state=True,
      interpret=interpret,
    )

  return jax.jit(run)


def operator_fn(implementation=None):
  """The public operator, jitted; `implementation` a name, None, or a configured Mosaic GPU
  implementation (`mosaic_operator`), registered under its name while the call is traced."""
  from gdp_jax.ops.gated_delta_product.api import REGISTRY

  def call(q, k, v, g, beta, mask, initial_state, name):
    return gdp_jax.gated_delta_product(
      q, k, v, g, beta, mask, initial_state=initial_state, output_final_state=True,
      implementation=name,
    )  # fmt: skip

  def run(*args):
    if implementation is None or isinstance(implementation, str):
      return call(*args, implementation)
    original = REGISTRY.get(implementation.name)
    REGISTRY.register(implementation)
    try:
      return call(*args, implementation.name)
    finally:
      REGISTRY.register(original)

  return jax.jit(run)


def mosaic_operator(**changes):
  """implementation="mosaic_gpu" with `changes` (fused=False: the two-kernel forward;
  nonfinite_guard=False: no guard)."""
  from gdp_jax.ops.gated_delta_product.api import REGISTRY

  return REGISTRY.get("mosaic_gpu").replace(**changes)


def guard_check(r, shape, row):
  """The guard inside the fused kernel: a nan key, an inf query and a -inf value planted; the
  operator's nan pattern and its other values against xla's."""
  mask_kind = "none" if r == 1 else "token"
  x = make_inputs(5, **shape, r=r, mask_kind=mask_kind, dtype=jnp.bfloat16, state=True)
  t = shape["t_len"]
  x["k"] = x["k"].at[0, t // 3, 0, 3].set(jnp.nan)
  x["q"] = x["q"].at[1 % shape["batch"], t // 5, 1, 5].set(jnp.inf)
  x["v"] = x["v"].at[0, t // 2, 1, 100 % shape["value_dim"]].set(-jnp.inf)
  o, final = call(operator_fn("mosaic_gpu"), x)
  want_o, want_final = call(operator_fn("xla"), x)
  o, want_o = np.asarray(jnp.asarray(o, F32)), np.asarray(jnp.asarray(want_o, F32))
  fine = ~np.isnan(want_o)
  row.update(
    same_nan=bool((np.isnan(o) == ~fine).all()),
    same_final_nan=bool((np.isnan(np.asarray(final)) == np.isnan(np.asarray(want_final))).all()),
    rel_rms_o_elsewhere=rel_rms(np.where(fine, o, 0.0), np.where(fine, want_o, 0.0)),
  )
  row["ok"] = row["same_nan"] and row["same_final_nan"] and row["rel_rms_o_elsewhere"] <= BAR


def call(fn, inp):
  return fn(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], inp["mask"], inp["initial_state"])


def run_r(r, shape, tiny, reps, inner, variants, record, save):
  interpret = plgpu.InterpretGPUParams() if tiny else None

  def case(**fields):
    row = dict(r=r, **fields)
    record["runs"].append(row)
    return row

  # 1. compile each variant
  inp = make_inputs(
    0, **shape, r=r, mask_kind="none" if r == 1 else "shared", dtype=jnp.bfloat16, state=False
  )
  args = tuple(inp[n] for n in ("q", "k", "v", "g", "beta", "mask", "initial_state"))
  compiled = {}
  for name in variants:
    row = case(phase="compile", variant=name)
    t0 = time.perf_counter()
    try:
      variant = dict(VARIANTS[name])
      if tiny and "diag_solve" not in variant:
        variant["diag_solve"] = False
      fn = fused_fn(interpret, **variant)
      compiled[name] = (fn, fn if tiny else fn.lower(*args).compile())
      row.update(ok=True, seconds=round(time.perf_counter() - t0, 2))
    except Exception as e:  # noqa: BLE001 (recorded, the run goes on)
      row.update(ok=False, error=summarise(e))
    save()
  if not compiled:
    return
  best = next((n for n in compiled if n != "profile_without_inverse"), None)
  if best is None:
    return
  # 2. check against xla and the two-kernel forward
  # and once K = V = 64 (three ring stages), an odd T and grouped value heads
  small = dict(shape, key_dim=64, value_dim=64, t_len=shape["t_len"] - 23)
  checks = [(m, st, shape, None) for m, st in CHECK_MASKS[r]]
  checks.append(("head", True, small, shape["heads"] // 2))
  for mask_kind, state, shp, key_heads in checks:
    row = case(phase="check", variant=best, mask=mask_kind, initial_state=state)
    row.update(key_dim=shp["key_dim"], t_len=shp["t_len"], key_heads=key_heads)
    try:
      chk = make_inputs(
        r, **shp, r=r, mask_kind=mask_kind, dtype=jnp.bfloat16, state=state, key_heads=key_heads
      )
      o, final = call(compiled[best][0], chk)
      want_o, want_final = call(operator_fn("xla"), chk)
      two_o, two_final = call(two_kernel_fn(interpret), chk)
      row.update(
        rel_rms_o=rel_rms(o, want_o),
        rel_rms_state=rel_rms(final, want_final),
        vs_two_kernel_o=rel_rms(o, two_o),
        vs_two_kernel_state=rel_rms(final, two_final),
        two_kernel_rel_rms_o=rel_rms(two_o, want_o),
      )
      worst = max(row["rel_rms_o"], row["rel_rms_state"])
      row["ok"] = bool(np.isfinite(worst) and worst <= BAR)
    except Exception as e:  # noqa: BLE001
      row.update(ok=False, error=summarise(e))
    save()
  row = case(phase="check", variant="guard", mask="planted nan/inf")
  try:
    guard_check(r, shape, row)
  except Exception as e:  # noqa: BLE001
    row.update(ok=False, error=summarise(e))
  save()
  # 3. time: every compiled variant, the two-kernel forward, the public operator
  # the checked variant, the two kernels and the operator first; the other variants last (a fault
  # or hang there, never checked, costs only what follows it)
  fns = {f"fused:{best}": compiled[best][1], "two_kernel": two_kernel_fn(interpret)}
  if not tiny:
    fns["operator_default"] = operator_fn()
    fns["operator_fused"] = operator_fn(mosaic_operator(fused=True))
    fns["operator_two_kernel"] = operator_fn(mosaic_operator(fused=False))
    fns["operator_no_guard"] = operator_fn(mosaic_operator(nonfinite_guard=False))
  fns.update({f"fused:{name}": exe for name, (_, exe) in compiled.items() if name != best})
  ref = None
  for name, fn in fns.items():
    row = case(phase="time", impl=name, mask="none" if r == 1 else "shared")
    try:
      if name.startswith("fused:"):  # its output beside the checked variant's
        out = jax.block_until_ready(fn(*args))
        if name == f"fused:{best}":
          ref = out
        elif ref is not None:
          row["vs_checked_o"] = rel_rms(out[0], ref[0])
          row["vs_checked_state"] = rel_rms(out[1], ref[1])
      row["ms"], row["all_ms"] = time_fn(fn, args, reps, inner)
      row["ok"] = True
    except Exception as e:  # noqa: BLE001
      row.update(ok=False, error=summarise(e))
    save()


def table(record):
  lines = []
  for c in record["runs"]:
    what = c.get("variant") or c.get("impl")
    extra = ""
    if c.get("variant") == "guard":
      extra = f"nan where xla's: {c.get('same_nan')}, {c.get('same_final_nan')}"
      extra += f"; o elsewhere {c.get('rel_rms_o_elsewhere', float('nan')):.2e}"
    elif c["phase"] == "check":
      extra = (
        f"{c.get('mask')} h0={c.get('initial_state')} o={c.get('rel_rms_o', float('nan')):.2e}"
        f" S={c.get('rel_rms_state', float('nan')):.2e}"
        f" vs2k={c.get('vs_two_kernel_o', float('nan')):.2e}"
      )
    elif c["phase"] == "time":
      extra = f"{c.get('ms', float('nan')):.3f} ms"
      if "vs_checked_o" in c:
        extra += f" (o vs checked {c['vs_checked_o']:.1e})"
    elif c["phase"] == "compile":
      extra = f"{c.get('seconds', '')} s"
    err = "" if c.get("ok") else " ERROR " + c.get("error", "").splitlines()[0][:150]
    lines.append(f"r={c['r']} {c['phase']:7s} {what:24s} {extra}{err}")
  return "\n".join(lines)


def main(argv=None):
  argv = sys.argv[1:] if argv is None else argv
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--out", required=True, help="JSON file to write")
  parser.add_argument("--rs", default="1,2,4")
  parser.add_argument("--reps", type=int, default=7)
  parser.add_argument("--inner", type=int, default=10)
  parser.add_argument(
    "--variants",
    default="default,split_inverse,profile_without_inverse,no_diag_solve",
    help=",".join(VARIANTS),
  )
  parser.add_argument("--timeout", type=float, default=190, help="seconds per r's process")
  parser.add_argument("--tiny", action="store_true", help="interpreter, small shapes (CPU)")
  parser.add_argument("--one", action="store_true", help="(internal) one r in this process")
  args = parser.parse_args(argv)
  rs = [int(x) for x in args.rs.split(",")]
  shape = TINY if args.tiny else BENCH
  record = dict(environment=environment(["benchmarks/mosaic_fused_forward.py", *argv]), runs=[])
  record.update(shape=shape, reps=args.reps, inner=args.inner)

  def save():
    with open(args.out, "w") as f:
      json.dump(record, f, indent=1)

  if args.one:
    run_r(rs[0], shape, args.tiny, args.reps, args.inner, args.variants.split(","), record, save)
    save()
    return
  for r in rs:  # each r in its own process
    part = f"{args.out}.r{r}.json"
    cmd = [sys.executable, __file__, *argv, "--rs", str(r), "--one", "--out", part]
    t0 = time.perf_counter()
    # ptxas's report (registers, spills) of every Mosaic kernel the process compiles, in its log
    env = dict(os.environ, MOSAIC_GPU_DUMP_PTXAS="1")
    try:
      run = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
      code, out, err = run.returncode, run.stdout, run.stderr
    except subprocess.TimeoutExpired as e:
      code, out, err = "timeout", str(e.stdout or ""), str(e.stderr or "")
    with open(f"{args.out}.r{r}.log", "w") as f:
      f.write(out + "\n--- stderr ---\n" + err)
    try:
      with open(part) as f:
        record["runs"] += json.load(f)["runs"]
      os.remove(part)
    except Exception:  # noqa: BLE001
      pass
    if code:
      error = f"exit {code}: {err[-3000:]}"
      record["runs"].append(dict(r=r, phase="process", ok=False, impl="", error=error))
    record.setdefault("process_seconds", {})[str(r)] = round(time.perf_counter() - t0, 1)
    save()
  print(table(record))


if __name__ == "__main__":
  main()
