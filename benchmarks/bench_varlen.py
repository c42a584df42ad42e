"""Packed variable-length sequences and grouped value heads on a GPU: correctness and speed of
the Pallas kernels' packed form (docs/varlen.md) against the chunked jnp form and the unpacked
call (GPU; not a test).

  python benchmarks/bench_varlen.py --out varlen.json                     # both sections
  python benchmarks/bench_varlen.py --out varlen.json --sections speed --reps 9 --inner 3
  python benchmarks/bench_varlen.py --out /tmp/v.json --smoke --impl xla  # tiny, any machine

Section `correct`: `gated_delta_product(..., implementation="pallas")` against
`implementation="xla"` on the same inputs: the output, the final states and the gradient of
<o, do> + <final, dfinal> with respect to every array input (q, k, v, g, beta, the mask, the
initial states), for
  packed    T = 2048 tokens in one row as 8 sequences of lengths `CORRECT_LENGTHS` (1 token, an
            empty sequence, one of 64 tokens, the others off the chunk grid), one initial state
            each, H = 4, K = V = 128, r = 1 and r = 2 (a per-head mask), float32 inputs with
            precision "highest" (TF32 x 3: the float32 "ieee" backward at r = 1 asks more shared
            memory than an H200 has) and bfloat16 inputs; and each again without initial
            states ("... in place": the Hopper kernels then read the packed row in place,
            docs/mosaic_gpu.md#packed-sequences-in-place);
  grouped   unpacked, B = 2, T = 1024, H = 4 key heads, HV = 8 value heads (float32 r = 1,
            bfloat16 r = 2).
Each array records its relative RMS error sqrt(sum (x - ref)^2 / sum ref^2) and its relative
max error max|x - ref| / max|ref|; an array passes when the max error is within the tolerance of
tests/cases.py for its dtype (TOLERANCE for o and the final states, GRAD_TOLERANCE for
gradients: the same measure and bounds as the test suite and scripts/gpu_matrix.py).

Section `speed`: bfloat16, 8 x 4096 tokens, H = 16, K = V = 128, r = 1; forward (the output) and
a training step (`jax.value_and_grad` of a loss that reads o's values, with respect to q, k, v,
g and beta: benchmarks/bench.py `training_step`, as for every peer), each under
`jax.jit`, median ms over `--reps` runs of `--inner` calls (benchmarks/bench.py `time_jax`), for
  unpacked         B = 8 rows of 4096;
  packed8          the same tokens in one row as 8 sequences of 4096 (`cu_seqlens`);
  packed64         the same tokens in one row as 64 sequences of random lengths (seed 0);
  long30k          one sequence of 30720 tokens beside 64 of random lengths in the other 2048;
  grouped          B = 8, H = 8 key heads, HV = 16 value heads (against `unpacked`: H = HV = 16,
                   separate keys);
and flash-linear-attention's `chunk_gated_delta_rule` (when `fla` and torch import, on CUDA) for
unpacked, packed8, packed64 and long30k (its own `cu_seqlens`; benchmarks/bench.py `fla_case`,
triton's do_bench). `cu_seqlens` is an argument of the jitted function (traced, as in training).
Ratios (the goals of the packed form and of grouped heads): packed / unpacked <= 1.10,
long30k / unpacked <= 1.2, grouped / separate <= 1.1. `--impl mosaic_gpu` runs the Hopper
kernels: their packed forward, and under differentiation the kernels the operator picks then
(docs/mosaic_gpu.md#packed-sequences); every correctness case also checks the plain forward
(jit without `jax.grad`), since under differentiation the custom_vjp runs its own forward.

Case names (for `--only`, which keeps the cases whose name contains one of its comma-separated
strings): "packed f32 r=1" ... "grouped bf16 r=2"; "<layout> <mode> <impl>", e.g.
"packed64 fwdbwd ours" or "unpacked fwd fla". `--impl xla` checks and times the chunked jnp form
instead of the kernels (the smoke test: its correctness is then the reference against itself).

Every case runs inside a time budget (`--time-limit`, default 220 s from the start): a case that
would start after it is recorded as not run. The JSON (`--out`) is rewritten after every case,
so a run cut short keeps what it measured: date, jax version, GPU (device_kind), the command
(relative to the repository), `correctness` and `speed` records, `ratios` and `goals` (no
"cases" key: that marks `python -m benchmarks.bench` files). `--smoke` uses tiny shapes (a CPU run
in interpret mode: tests/test_bench.py).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # share the GPU with torch (fla)

import json  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, ROOT)
from benchmarks.bench import _Skip, fla_case, make_inputs, time_jax, training_step  # noqa: E402
from gdp_jax import gated_delta_product  # noqa: E402
from gdp_jax.ops.gated_delta_product import pieces  # noqa: E402
from pallas_kernels.common import backend as kernel_backend  # noqa: E402
from tests.cases import GRAD_TOLERANCE, TOLERANCE, cotangents  # noqa: E402
from tests.cases import make_inputs as random_inputs  # noqa: E402

SCHEMA = "gdp_jax.bench_varlen/1"
SECTIONS = ("correct", "speed")
DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16}
GOALS = dict(packed_over_unpacked=1.10, long_over_unpacked=1.2, grouped_over_separate=1.1)
LAYOUTS = ("unpacked", "packed8", "packed64", "long30k")  # the token layouts fla also runs
# 8 sequences, 2048 tokens: one token, an empty one, one of exactly 64 (the r = 1 chunk), the
# others off the chunk grid.
CORRECT_LENGTHS = (1, 130, 0, 577, 64, 389, 200, 687)
SMOKE_LENGTHS = (1, 0, 23, 20)
ARRAYS = ("q", "k", "v", "g", "beta", "mask", "initial_state")
TIME_ARRAYS = ("q", "k", "v", "g", "beta")


def command_line(argv):
  """The command relative to the repository, with an absolute --out reduced to its file name
  (bench.json rather than a machine's own directories)."""
  words = list(argv)
  for i, word in enumerate(words):
    if word == "--out" and i + 1 < len(words) and os.path.isabs(words[i + 1]):
      words[i + 1] = os.path.basename(words[i + 1])
    elif word.startswith("--out=") and os.path.isabs(word[len("--out=") :]):
      words[i] = "--out=" + os.path.basename(word[len("--out=") :])
  return " ".join(["python", "benchmarks/bench_varlen.py"] + words)


def random_lengths(total, count, seed=0):
  """`count` positive lengths summing to `total` (cut points drawn without replacement)."""
  rng = np.random.default_rng(seed)
  cuts = np.sort(rng.choice(np.arange(1, total), size=count - 1, replace=False))
  return tuple(int(x) for x in np.diff(np.concatenate([[0], cuts, [total]])))


def cu_of(lengths):
  return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def errors(x, ref):
  """(relative RMS error, relative max error) of x against ref, in float64."""
  x = np.asarray(jnp.asarray(x, jnp.float32), np.float64)
  ref = np.asarray(jnp.asarray(ref, jnp.float32), np.float64)
  if x.shape != ref.shape:
    raise ValueError(f"shape {x.shape} against the reference's {ref.shape}")
  diff = x - ref
  rms = float(np.sqrt(np.sum(diff**2) / max(np.sum(ref**2), 1e-30)))
  mx = float(np.max(np.abs(diff)) / max(np.max(np.abs(ref)), 1e-6)) if diff.size else 0.0
  return rms, mx


# ---- correctness ------------------------------------------------------------------------------


def correct_plan(smoke):
  """[(name, config)]: the packed and grouped correctness cases."""
  if smoke:
    dims = dict(H=2, K=32, V=32)
    grouped = dict(B=1, T=32, H=1, HV=2, K=32, V=32)
    lengths = SMOKE_LENGTHS
  else:
    dims = dict(H=4, K=128, V=128)
    grouped = dict(B=2, T=1024, H=4, HV=8, K=128, V=128)
    lengths = CORRECT_LENGTHS
  plan = []
  for r in (1, 2):
    for dname in ("f32", "bf16"):
      cfg = dict(kind="packed", dtype=dname, r=r, lengths=list(lengths), **dims)
      plan.append((f"packed {dname} r={r}", cfg))
      if not smoke:  # without initial states: the Hopper kernels read the row in place
        plan.append((f"packed {dname} r={r} in place", dict(cfg, initial_state=False)))
  for dname, r in (("f32", 1), ("bf16", 2)):
    plan.append((f"grouped {dname} r={r}", dict(kind="grouped", dtype=dname, r=r, **grouped)))
  return plan


def correct_inputs(cfg, seed=0):
  """Operator inputs for a correctness case, cu_seqlens (None when unpacked), the cotangents."""
  dtype = DTYPES[cfg["dtype"]]
  r, K, V, H = cfg["r"], cfg["K"], cfg["V"], cfg["H"]
  mask_kind = None if r == 1 else "head"
  if cfg["kind"] == "packed":
    lengths = cfg["lengths"]
    T, N, HV = sum(lengths), len(lengths), H
    inputs = random_inputs(
      seed, B=1, T=T, H=HV, K=K, V=V, r=r, mask_kind=mask_kind, dtype=dtype, with_state=False
    )
    rng = np.random.default_rng(seed + 7)
    if cfg.get("initial_state", True):
      h0 = 0.5 * rng.standard_normal((N, HV, K, V))
      inputs["initial_state"] = jnp.asarray(h0, jnp.float32)
    cu = jnp.asarray(cu_of(lengths))
    o_shape, state_shape = (1, T, HV, V), (N, HV, K, V)
  else:
    B, T, HV = cfg["B"], cfg["T"], cfg["HV"]
    inputs = random_inputs(seed, B=B, T=T, H=HV, K=K, V=V, r=r, mask_kind=mask_kind, dtype=dtype)
    inputs["q"], inputs["k"] = inputs["q"][:, :, :H], inputs["k"][:, :, :H]  # H key heads
    cu = None
    o_shape, state_shape = (B, T, HV, V), (B, HV, K, V)
  do, dfinal = cotangents(seed, o_shape, state_shape)
  return inputs, cu, (do, dfinal)


def outputs_and_grads(impl, inputs, cu, cots, precision):
  """jit of (o, final, {name: gradient of <o, do> + <final, dfinal>}) for one implementation."""
  names = [n for n in ARRAYS if inputs.get(n) is not None]
  do, dfinal = cots

  def loss(arrays, cu_seqlens):
    kw = dict(inputs, **dict(zip(names, arrays)))
    o, final = gated_delta_product(
      **kw,
      cu_seqlens=cu_seqlens,
      output_final_state=True,
      implementation=impl,
      precision=precision,
    )
    return jnp.sum(o.astype(jnp.float32) * do) + jnp.sum(final * dfinal), (o, final)

  fn = jax.jit(jax.grad(loss, has_aux=True))
  grads, (o, final) = fn([inputs[n] for n in names], cu)
  out = dict(o=o, final_state=final)
  out.update({f"d{n}": gr for n, gr in zip(names, grads)})
  return jax.block_until_ready(out)


def plain_forward(impl, inputs, cu, precision):
  """jit of (o, final) without differentiation: the forward a served model runs (under
  `jax.grad` a custom_vjp runs its own forward rule, which may take other kernels)."""

  def forward(inputs, cu_seqlens):
    return gated_delta_product(
      **inputs,
      cu_seqlens=cu_seqlens,
      output_final_state=True,
      implementation=impl,
      precision=precision,
    )

  o, final = jax.jit(forward)(inputs, cu)
  return jax.block_until_ready({"o (plain forward)": o, "final_state (plain forward)": final})


def correct_case(name, cfg, impl):
  """Compare `impl` with "xla" for one configuration; returns the record."""
  dtype = DTYPES[cfg["dtype"]]
  precision = "highest" if cfg["dtype"] == "f32" else None
  tol_fwd, tol_grad = TOLERANCE[dtype], GRAD_TOLERANCE[dtype]
  rec = dict(
    name=name,
    impl=impl,
    reference="xla",
    precision=precision,
    tolerance=dict(forward=tol_fwd, gradient=tol_grad, measure="max|x - ref| / max|ref|"),
    **cfg,
  )
  inputs, cu, cots = correct_inputs(cfg)
  t0 = time.perf_counter()
  ref = outputs_and_grads("xla", inputs, cu, cots, None)
  rec["xla_s"] = round(time.perf_counter() - t0, 2)
  ref["o (plain forward)"], ref["final_state (plain forward)"] = ref["o"], ref["final_state"]
  if impl == "xla":  # a smoke run of the script: the reference against itself (errors 0)
    got = ref
    rec["note"] = "impl is the reference: errors are 0 by construction"
  else:
    t0 = time.perf_counter()
    got = outputs_and_grads(impl, inputs, cu, cots, precision)
    got.update(plain_forward(impl, inputs, cu, precision))
    rec["impl_s"] = round(time.perf_counter() - t0, 2)  # compile + one run
  arrays, failed = {}, []
  for key, value in ref.items():
    rms, mx = errors(got[key], value)
    bound = tol_fwd if not key.startswith("d") else tol_grad
    ok = bool(np.isfinite(rms) and np.isfinite(mx) and mx <= bound)
    arrays[key] = dict(rel_rms=rms, rel_max=mx, tolerance=bound, ok=ok)
    if not ok:
      failed.append(key)
  rec["arrays"] = arrays
  rec["failed"] = failed
  rec["status"] = "pass" if not failed else "fail"
  return rec


# ---- speed ------------------------------------------------------------------------------------


def speed_shapes(smoke):
  """(B, T, H, K, V), the number of random-length sequences, the grouped key heads."""
  if smoke:
    return (2, 32, 2, 32, 32), 4, 1
  return (8, 4096, 16, 128, 128), 64, 8


def speed_fn(impl, mode, o_shape):
  """The jitted fn of (q, k, v, g, beta, cu_seqlens): the output, or a training step (the loss
  reading o and its gradient with respect to q, k, v, g and beta; `training_step`)."""

  def fwd(q, k, v, g, beta, cu):
    o, _ = gated_delta_product(q, k, v, g, beta, cu_seqlens=cu, implementation=impl)
    return o

  if mode == "fwd":
    return jax.jit(fwd)

  def step(q, k, v, g, beta, cu):
    return training_step(lambda *a: fwd(*a, cu), o_shape, 5)(q, k, v, g, beta)

  return jax.jit(step)


def speed_plan(smoke, with_fla):
  """[(name, layout, mode, impl)] in the order they run."""
  plan = []
  for mode in ("fwd", "fwdbwd"):
    for layout in LAYOUTS:
      plan.append((layout, mode, "ours"))
  for mode in ("fwd", "fwdbwd"):
    plan.append(("grouped", mode, "ours"))
  if with_fla:
    for mode in ("fwd", "fwdbwd"):
      for layout in LAYOUTS:
        plan.append((layout, mode, "fla"))
  return plan


def layout_inputs(layout, base, shape, n_random, key_heads):
  """(args for speed_fn, cu_seqlens list or None, record fields) for one layout of the tokens
  of `base` (B rows of T)."""
  B, T, H, K, V = shape
  args = [base[n] for n in TIME_ARRAYS]
  if layout in ("unpacked", "grouped"):
    if layout == "grouped":
      args[0], args[1] = args[0][:, :, :key_heads], args[1][:, :, :key_heads]
    fields = dict(B=B, T=T, H=args[0].shape[2], HV=H, K=K, V=V, sequences=B)
    return args + [None], None, fields
  if layout == "packed8":
    lengths = [T] * B
  elif layout == "packed64":
    lengths = list(random_lengths(B * T, n_random))
  else:  # long30k: one long sequence beside n_random short ones in 1/16 of the tokens
    short = B * T // 16
    lengths = [B * T - short] + list(random_lengths(short, n_random))
  packed = [x.reshape((1, B * T) + x.shape[2:]) for x in args]
  cu = cu_of(lengths)
  fields = dict(B=1, T=B * T, H=H, HV=H, K=K, V=V, sequences=len(lengths))
  fields.update(min_length=min(lengths), max_length=max(lengths))
  return packed + [jnp.asarray(cu)], [int(c) for c in cu], fields


def speed_case(layout, mode, impl, base, shape, n_random, key_heads, reps, inner, ours_impl):
  B, T, H, K, V = shape
  args, cu, fields = layout_inputs(layout, base, shape, n_random, key_heads)
  rec = dict(layout=layout, mode=mode, impl=impl, dtype="bfloat16", r=1, **fields)
  t0 = time.perf_counter()
  if impl == "fla":
    try:
      import fla  # noqa: F401
      import torch  # noqa: F401
    except ImportError as e:
      raise _Skip(f"flash-linear-attention is not installed ({e})") from None
    fla_shape = (fields["B"], fields["T"], H, K, V)
    rec["ms"], _ = fla_case(mode, fla_shape, jnp.bfloat16, reps, cu_seqlens=cu)
    rec["peer_impl"] = "flash-linear-attention chunk_gated_delta_rule"
  else:
    rec["implementation"] = ours_impl
    fn = speed_fn(ours_impl, mode, args[2].shape)
    rec["ms"], rec["all_ms"] = time_jax(fn, args, reps, inner)
  rec["seconds"] = round(time.perf_counter() - t0, 2)
  rec["tokens_per_s"] = B * T / (rec["ms"] * 1e-3)
  return rec


def ratios(results):
  """packed / unpacked and grouped / separate (ours and fla), from the speed records."""
  ms = {(c["layout"], c["mode"], c["impl"]): c["ms"] for c in results["speed"] if "ms" in c}
  out = {}
  for impl in ("ours", "fla"):
    for mode in ("fwd", "fwdbwd"):
      base = ms.get(("unpacked", mode, impl))
      if base is None:
        continue
      for layout, goal in (
        ("packed8", GOALS["packed_over_unpacked"]),
        ("packed64", GOALS["packed_over_unpacked"]),
        ("long30k", GOALS["long_over_unpacked"]),
        ("grouped", GOALS["grouped_over_separate"]),
      ):
        if (layout, mode, impl) in ms:
          value = ms[(layout, mode, impl)] / base
          key = f"{impl} {layout}/{'separate' if layout == 'grouped' else 'unpacked'} {mode}"
          out[key] = dict(ratio=value, goal=goal, meets_goal=bool(value <= goal))
      if impl == "ours":
        for layout in LAYOUTS:
          if (layout, mode, "fla") in ms and (layout, mode, "ours") in ms:
            out[f"ours/fla {layout} {mode}"] = dict(
              ratio=ms[(layout, mode, "ours")] / ms[(layout, mode, "fla")]
            )
  return out


# ---- the run ----------------------------------------------------------------------------------


def error_fields(e):
  return dict(error=f"{type(e).__name__}: {e}"[:2000], traceback=traceback.format_exc()[-4000:])


def main(argv=None):
  p = argparse.ArgumentParser(
    description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
  )
  p.add_argument("--out", required=True, help="the JSON file to write (after every case)")
  p.add_argument("--smoke", action="store_true", help="tiny shapes: a CPU smoke run")
  p.add_argument("--sections", default="correct,speed", help="comma separated: correct, speed")
  p.add_argument("--reps", type=int, default=None, help="timed runs per case (default 15; 2)")
  p.add_argument("--inner", type=int, default=None, help="calls per timed run (default 5; 1)")
  p.add_argument(
    "--impl",
    default="pallas",
    choices=("pallas", "mosaic_gpu", "xla"),
    help="the implementation checked and timed (default pallas; mosaic_gpu: the Hopper kernels' "
    "packed forward; xla for a quick smoke run)",
  )
  p.add_argument(
    "--only",
    default="",
    help="run only the cases whose name contains one of "
    "these comma-separated strings (e.g. 'packed f32 r=1,packed8')",
  )
  p.add_argument("--no-fla", action="store_true", help="leave flash-linear-attention out")
  p.add_argument(
    "--programs-per-sm",
    type=float,
    default=None,
    help="the in-place packed walks' pieces aim at this many programs per multiprocessor "
    "(gdp_jax/ops/gated_delta_product/pieces.py; default its PROGRAMS_PER_MULTIPROCESSOR)",
  )
  p.add_argument(
    "--time-limit",
    type=float,
    default=220.0,
    help="seconds from the start after which no case starts (default 220)",
  )
  argv = list(sys.argv[1:] if argv is None else argv)
  args = p.parse_args(argv)
  if args.programs_per_sm is not None:  # read when a call is traced
    pieces.PROGRAMS_PER_MULTIPROCESSOR = args.programs_per_sm
  start = time.perf_counter()
  sections = [s.strip() for s in args.sections.split(",") if s.strip()]
  for s in sections:
    if s not in SECTIONS:
      raise SystemExit(f"--sections: unknown section {s!r}; choose from {', '.join(SECTIONS)}")
  reps = args.reps or (2 if args.smoke else 15)
  inner = args.inner or (1 if args.smoke else 5)
  only = [s.strip() for s in args.only.split(",") if s.strip()]
  wanted = lambda name: not only or any(s in name for s in only)

  dev = jax.devices()[0]
  results = dict(
    schema=SCHEMA,
    date=time.strftime("%Y-%m-%d %H:%M:%S"),
    jax_version=jax.__version__,
    device=str(dev),
    device_kind=getattr(dev, "device_kind", str(dev)),
    backend=jax.default_backend(),
    interpret_mode=kernel_backend.interpret_mode(),
    command=command_line(argv),
    impl=args.impl,
    reps=reps,
    inner=inner,
    time_limit_s=args.time_limit,
    timing="median over reps of (wall time of `inner` back-to-back calls) / inner, after compile "
    "and 2 warm-up calls; ms per call (fla: triton do_bench median)",
    goals=GOALS,
    correctness=[],
    speed=[],
    ratios={},
    not_run=[],
    seconds={},
  )
  if os.path.dirname(args.out):
    os.makedirs(os.path.dirname(args.out), exist_ok=True)

  def save():
    with open(args.out, "w") as f:
      json.dump(results, f, indent=1)

  def over_time(name):
    if time.perf_counter() - start > args.time_limit:
      results["not_run"].append(dict(case=name, reason=f"--time-limit {args.time_limit:g} s"))
      save()
      return True
    return False

  save()
  for section in sections:
    t_section = time.perf_counter()
    if section == "correct":
      for name, cfg in correct_plan(args.smoke):
        if not wanted(name) or over_time(name):
          continue
        try:
          rec = correct_case(name, cfg, args.impl)
        except Exception as e:  # record and go on
          rec = dict(name=name, status="error", **cfg, **error_fields(e))
        results["correctness"].append(rec)
        worst = max(
          (a["rel_max"] / a["tolerance"] for a in rec.get("arrays", {}).values()),
          default=float("nan"),
        )
        print(
          f"correct {name:20s} {rec['status']:5s} worst error / tolerance {worst:.3g}"
          f"{'  ' + rec['error'][:200] if 'error' in rec else ''}",
          flush=True,
        )
        save()
    else:
      shape, n_random, key_heads = speed_shapes(args.smoke)
      base = make_inputs(*shape, 1, jnp.bfloat16)
      for layout, mode, impl in speed_plan(args.smoke, not args.no_fla):
        name = f"{layout} {mode} {impl}"
        if not wanted(name) or over_time(name):
          continue
        try:
          rec = speed_case(
            layout, mode, impl, base, shape, n_random, key_heads, reps, inner, args.impl
          )
          rec["status"] = "ok"
        except _Skip as e:
          rec = dict(layout=layout, mode=mode, impl=impl, status="skipped", reason=str(e))
        except Exception as e:  # record and go on
          rec = dict(layout=layout, mode=mode, impl=impl, status="error", **error_fields(e))
        results["speed"].append(rec)
        results["ratios"] = ratios(results)
        shown = f"{rec['ms']:.3f} ms" if "ms" in rec else rec["status"]
        note = rec.get("reason") or rec.get("error", "")
        print(f"speed   {name:24s} {shown}  {note[:200]}", flush=True)
        save()
      base = None
    results["seconds"][section] = round(time.perf_counter() - t_section, 1)
    save()
  results["seconds"]["total"] = round(time.perf_counter() - start, 1)
  for key, value in results["ratios"].items():
    goal = f" (goal <= {value['goal']})" if "goal" in value else ""
    print(f"ratio   {key:36s} {value['ratio']:.3f}{goal}")
  save()
  print(f"wrote {args.out}")
  failed = [c["name"] for c in results["correctness"] if c["status"] != "pass"]
  if failed:
    print(f"correctness not passed: {', '.join(failed)}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
