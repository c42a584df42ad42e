"""GPU test matrix: every shape the Pallas operator accepts compiles, runs and matches "xla".

  python scripts/gpu_matrix.py --out gpu_matrix.json           # the whole matrix (NVIDIA GPU)
  python scripts/gpu_matrix.py --only r=8 --dtype bf16 --out m.json    # a slice
  python scripts/gpu_matrix.py --shard 0/4 --jobs 1 --out m0.json      # a quarter of it
  python scripts/gpu_matrix.py --list [--only K=96]                    # what would run
  python scripts/gpu_matrix.py --tiny --out /tmp/m.json    # three small configs (CPU, interpret)

One configuration is (dtype of q, k, v) x (K, V) x r x (mask shape) [x float32 precision]:
  dtype      bf16, f16, f32
  K, V       K = V in 16, 32, 64, 96, 128, 256, and the pairs 64:128, 128:64, 256:64, 32:96
  r          1, 2, 4, 8 (K % r == 0 and a key block K / r >= 1)
  mask       shared ([r, r]; None when r = 1), head ([H, r, r]), token ([B, T, H, r, r])
  precision  float32 only: "ieee" and the default (TF32); half types use the default
at B = 1, T = 256, H = 2 (small: the run is compile-bound). For each one it lowers and compiles
(`jax.jit(f).lower(...).compile()`, timed) and runs the forward of
`gated_delta_product(implementation="pallas")` (o and the final state) and its backward
(`jax.grad` of <o, do> + <final, dfinal> with respect to every array input), and compares them with
`implementation="xla"` (the float32 chunked jnp form at HIGHEST precision; `--against
reference`: the jnp recurrence, equally exact, a smaller program to compile): relative error
max|x - ref| / max|ref| per output and per gradient, against the tolerances of tests/cases.py
(docs/precision.md), or the TF32 ones below for float32 at the default precision.

The compilation cache is persistent (`--cache-dir`, default `.jax_cache/` in the repository,
git-ignored; every compilation is stored), so a second run on the same machine loads executables
instead of compiling them; a configuration's first compile time is then read back from the cache
entry (whole seconds) and reported as `first_compile_s`. `--jobs N` runs N processes side by
side on one GPU (compiling is CPU work; each process allocates GPU memory on demand,
XLA_PYTHON_CLIENT_PREALLOCATE=false): they take the shapes (the float32 precisions of one shape
together, sharing their reference) from a queue of claim files, the slowest first (largest r,
then K + V), so the last ones to finish are quick. Compile times are then measured with N
compiles competing for the CPU (`--jobs 1` for clean timings). `--shard I/N` splits the plan
across separate commands (each may use --jobs). A CUDA fault (illegal address) poisons the rest
of its process: rerun the configurations after it with `--only`. Per configuration the JSON keeps
each stage's lower, compile and first-run seconds (`fwd`, `bwd`: `lower_s`, `compile_s`, `run_s`)
and the reference's (`reference_compile_s`, `reference_run_s`, their sum `reference_s`) in the
record of the configuration that computed it. The reference is compiled with
REFERENCE_COMPILER_OPTIONS (XLA's GEMM autotuner off, its matmuls on cuBLAS; `--reference-autotune`
for XLA's defaults); the JSON keeps them and XLA_FLAGS (`xla_flags`).

Writes a JSON (`--out`, rewritten after every configuration: date, jax version, GPU, command, one
record per configuration, a summary: failures, slowest compiles, configurations whose compile
took over 60 s), prints a table and exits 1 when any configuration failed (an error, or an error
over tolerance), 2 when none failed but some did not run (`--time-limit`, an interruption).
`--tiny` runs three small configurations in interpret mode on the CPU (a test:
tests/test_gpu_matrix.py); `--self-check` plants a mismatch in the first configuration's Pallas
output, which the run must report.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time
import traceback

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from gdp_jax import gated_delta_product  # noqa: E402
from pallas_kernels.common import backend  # noqa: E402
from tests.cases import (
  GRAD_TOLERANCE,
  TOLERANCE,
  cotangents,
  make_inputs,  # noqa: E402
  present_arrays,
)

SCHEMA = "gdp-gpu-matrix/1"
DTYPES = {"bf16": jnp.bfloat16, "f16": jnp.float16, "f32": jnp.float32}
DIMS = "16,32,64,96,128,256,64:128,128:64,256:64,32:96"
MASKS = ("shared", "head", "token")
# TF32 rounds every float32 dot operand to 11 significant bits (10 stored) and accumulates in
# float32. The float16 path rounds every dot operand to float16, also 11 significant bits (the
# kernels cast an operand to the input dtype just before its dot, docs/precision.md), and
# accumulates in float32 too: the same rounding at the same places, so the float16 tolerances of
# tests/cases.py apply (TF32 keeps float32's exponent range: no float16 overflow or underflow on
# top). For scale: docs/precision.md reports a 4.7e-4 relative RMS error of TF32 against IEEE at
# the benchmark shape, and the GPU test in tests/test_pallas_forward.py allows 5e-3 on o.
TF32_TOLERANCE = TOLERANCE[jnp.float16]
TF32_GRAD_TOLERANCE = GRAD_TOLERANCE[jnp.float16]
SLOW_COMPILE_S = 60.0
# A planted mismatch (--self-check): the first configuration's Pallas o is scaled by this.
PLANTED_SCALE = 1.25
TINY = dict(shape="1,32,1", chunk_size=16)
TINY_CONFIGS = (
  ("f32", 16, 16, 1, "shared", "ieee"),
  ("bf16", 16, 32, 2, "head", None),
  ("f32", 16, 16, 2, "token", "tf32"),
)


@dataclasses.dataclass(frozen=True)
class Config:
  dtype: str
  K: int
  V: int
  r: int
  mask: str  # shared / head / token ("shared" is None when r = 1)
  precision: str | None  # float32: "ieee" or "tf32" (the default); None for half types

  @property
  def key(self) -> str:
    mask = "none" if self.mask == "shared" and self.r == 1 else self.mask
    prec = f" {self.precision}" if self.precision else ""
    return f"{self.dtype}{prec} K={self.K} V={self.V} r={self.r} mask={mask}"

  @property
  def group(self) -> tuple:
    """Configurations that share a reference (the float32 precisions of one shape)."""
    return (self.dtype, self.K, self.V, self.r, self.mask)

  def fields(self) -> dict:
    return dict(
      key=self.key,
      dtype=self.dtype,
      K=self.K,
      V=self.V,
      r=self.r,
      mask="none" if self.mask == "shared" and self.r == 1 else self.mask,
      precision=self.precision,
    )

  def tolerances(self) -> tuple[float, float]:
    if self.precision == "tf32":
      return TF32_TOLERANCE, TF32_GRAD_TOLERANCE
    dtype = DTYPES[self.dtype]
    return TOLERANCE[dtype], GRAD_TOLERANCE[dtype]


# ---- the plan -----------------------------------------------------------------------------------


def parse_dims(text):
  """ "16,32,64:128" -> [(16, 16), (32, 32), (64, 128)] (K = V, or K:V)."""
  pairs = []
  for item in text.split(","):
    item = item.strip()
    if not item:
      continue
    try:
      kv = [int(x) for x in item.split(":")]
    except ValueError:
      raise SystemExit(f"--dims: {item!r} is not K or K:V (integers)") from None
    if len(kv) not in (1, 2) or min(kv) < 1:
      raise SystemExit(f"--dims: {item!r} is not K or K:V with positive sizes")
    pairs.append((kv[0], kv[-1]))
  return pairs


def parse_only(items):
  """--only KEY=A,B (repeatable) -> {key: set of strings}; keys are Config fields."""
  allowed = ("dtype", "K", "V", "r", "mask", "precision")
  filters = {}
  for item in items or ():
    name, sep, values = item.partition("=")
    if not sep or name not in allowed or not values:
      raise SystemExit(
        f"--only {item!r}: expected KEY=VALUE[,VALUE...] with KEY one of "
        f"{', '.join(allowed)} (e.g. --only r=8 --only K=64,128)"
      )
    filters.setdefault(name, set()).update(v.strip() for v in values.split(","))
  return filters


def matches(config, filters):
  fields = config.fields()
  for name, values in filters.items():
    value = fields[name]
    shown = {str(value)} | ({"shared"} if name == "mask" and value == "none" else set())
    if name == "precision" and value is None:
      shown = {"default", "none"}
    if not shown & values:
      return False
  return True


def parse_shard(text):
  try:
    index, count = (int(x) for x in text.split("/"))
  except ValueError:
    raise SystemExit(f"--shard {text!r}: expected I/N, e.g. 0/4") from None
  if not 0 <= index < count:
    raise SystemExit(f"--shard {text!r}: need 0 <= I < N")
  return index, count


def plan(args, shard=None):
  """The configurations to run, in order: the matrix, filtered, then this shard's share (whole
  groups, round robin, so the float32 precisions of one shape share their reference)."""
  if args.tiny:
    configs = [Config(*c) for c in TINY_CONFIGS]
  else:
    configs = []
    try:
      rs = [int(x) for x in args.rs.split(",")]
    except ValueError:
      raise SystemExit(f"--rs {args.rs!r}: expected integers, e.g. 1,2,4") from None
    for dtype in args.dtype.split(","):
      if dtype not in DTYPES:
        raise SystemExit(f"--dtype: {dtype!r} is not one of {', '.join(DTYPES)}")
      precisions = args.precisions.split(",") if dtype == "f32" else [None]
      for dim_k, dim_v in parse_dims(args.dims):
        for r in rs:
          if dim_k % r or dim_k // r < 1:
            continue
          for mask in args.masks.split(","):
            if mask not in MASKS:
              raise SystemExit(f"--masks: {mask!r} is not one of {', '.join(MASKS)}")
            for prec in precisions:
              if prec not in (None, "ieee", "tf32"):
                raise SystemExit(f"--precisions: {prec!r} is not ieee or tf32")
              configs.append(Config(dtype, dim_k, dim_v, r, mask, prec))
  filters = parse_only(args.only)
  configs = [c for c in configs if matches(c, filters)]
  index, count = parse_shard(args.shard if shard is None else shard)
  groups = list(dict.fromkeys(c.group for c in configs))
  mine = set(groups[index::count])
  return [c for c in configs if c.group in mine]


def slowest_first(groups):
  """Groups (dtype, K, V, r, mask) ordered by expected compile and run time, the slowest first:
  larger r, then larger K + V, float32 (two precisions) before the half types."""
  return sorted(groups, key=lambda g: (-g[3], -(g[1] + g[2]), g[0] != "f32"))


def claimed(configs, queue):
  """The configurations of the groups this process claims from the queue folder, group by group
  in `slowest_first` order: a group is claimed by creating its file (O_EXCL: exactly one process
  wins it). A generator: a group is claimed only when the previous one is done."""
  groups = list(dict.fromkeys(c.group for c in configs))
  index = {g: i for i, g in enumerate(groups)}
  for group in slowest_first(groups):
    try:
      os.close(os.open(os.path.join(queue, f"group{index[group]}"), os.O_CREAT | os.O_EXCL))
    except FileExistsError:
      continue
    yield from (c for c in configs if c.group == group)


# ---- one configuration --------------------------------------------------------------------------


class CacheEvents:
  """Counts persistent-cache hits and sums the stored compile times of the entries read back
  (jax.monitoring events of jax's compiler)."""

  def __init__(self):
    self.hits = 0
    self.saved_s = 0.0
    jax.monitoring.register_event_listener(self._event)
    jax.monitoring.register_event_duration_secs_listener(self._duration)

  def _event(self, event, **_):
    if event == "/jax/compilation_cache/cache_hits":
      self.hits += 1

  def _duration(self, event, duration, **_):
    # compile_time_saved = stored compile time - retrieval time; both are reported.
    if event in (
      "/jax/compilation_cache/compile_time_saved_sec",
      "/jax/compilation_cache/cache_retrieval_time_sec",
    ):
      self.saved_s += duration


def error_text(exc):
  return f"{type(exc).__name__}: {exc}"[:3000]


def compile_and_run(fn, args, events):
  """Lower, compile and run jax.jit(fn)(*args). Returns (outputs or None, record)."""
  rec = dict(
    lower_s=None,
    compile_s=None,
    run_s=None,
    cache_hit=None,
    first_compile_s=None,
    ok=False,
    error=None,
    phase=None,
  )
  phase = "lower"
  try:
    t0 = time.perf_counter()
    lowered = jax.jit(fn).lower(*args)
    rec["lower_s"] = round(time.perf_counter() - t0, 3)
    phase = "compile"
    hits, saved = events.hits, events.saved_s
    t0 = time.perf_counter()
    compiled = lowered.compile()
    rec["compile_s"] = round(time.perf_counter() - t0, 3)
    rec["cache_hit"] = events.hits > hits
    # Compile time of the executable when it was first built (stored with it, whole seconds).
    rec["first_compile_s"] = (
      round(events.saved_s - saved, 1) if rec["cache_hit"] else rec["compile_s"]
    )
    phase = "run"
    t0 = time.perf_counter()
    out = jax.block_until_ready(compiled(*args))
    rec["run_s"] = round(time.perf_counter() - t0, 4)  # the first run (compiled already)
    rec["ok"] = True
    return out, rec
  except Exception as exc:  # noqa: BLE001  (a configuration that fails is a result)
    rec.update(error=error_text(exc), phase=phase, traceback=traceback.format_exc()[-4000:])
    return None, rec


def host_rel_err(x, ref):
  """tests/cases.py's measure, max|x - ref| / max(max|ref|, 1e-6), on the host (nan when x is
  not finite)."""
  x = np.asarray(x).astype(np.float64)
  ref = np.asarray(ref).astype(np.float64)
  if x.shape != ref.shape:
    raise ValueError(f"shape {x.shape} against the reference's {ref.shape}")
  if not np.all(np.isfinite(x)):
    return float("nan")
  return float(np.max(np.abs(x - ref)) / max(np.max(np.abs(ref)), 1e-6))


def functions(config, names, args, planted):
  """forward(impl, arrays) -> (o, final); grads(impl, arrays, do, dfinal) -> the gradient of
  <o, do> + <final, dfinal> for each array (with (o, final) beside it when with_outputs)."""

  def forward(impl, arrays):
    kw = dict(zip(names, arrays))
    precision = config.precision if impl == "pallas" and config.precision != "tf32" else None
    o, final = gated_delta_product(
      **kw,
      implementation=impl,
      precision=precision,
      chunk_size=args.chunk_size,
      output_final_state=True,
    )
    if planted and impl == "pallas":
      o = o * jnp.asarray(PLANTED_SCALE, o.dtype)
    return o, final

  def grads(impl, arrays, do, dfinal, with_outputs=False):
    def loss(arrays):
      o, final = forward(impl, arrays)
      return jnp.sum(o.astype(jnp.float32) * do) + jnp.sum(final * dfinal), (o, final)

    dx, out = jax.grad(loss, has_aux=True)(arrays)
    return (dx, out) if with_outputs else dx

  return forward, grads


def inputs_for(config, args):
  B, T, H = args.B, args.T, args.H
  mask_kind = None if (config.mask == "shared" and config.r == 1) else config.mask
  inputs = make_inputs(
    0,
    B=B,
    T=T,
    H=H,
    K=config.K,
    V=config.V,
    r=config.r,
    mask_kind=mask_kind,
    dtype=DTYPES[config.dtype],
  )
  names, _ = present_arrays(inputs)
  arrays = tuple(inputs[n] for n in names)
  do, dfinal = cotangents(0, (B, T, H, config.V), (B, H, config.K, config.V))
  return names, arrays, do, dfinal


# XLA options of the reference's program (`reference`): its matmuls go to cuBLAS (no Triton GEMM
# fusions) and are not autotuned. The reference only has to be right (float32 at HIGHEST either
# way); at r = 8 its large fusions otherwise spent minutes each in XLA's GEMM autotuner
# (docs/performance.md#compile-time). `--reference-autotune` keeps XLA's defaults.
REFERENCE_COMPILER_OPTIONS = {"xla_gpu_autotune_level": 0, "xla_gpu_enable_triton_gemm": False}


def reference(config, args):
  """The reference's forward and gradients (or an error text) for a configuration's group, and
  its seconds: (lower + compile, run) of its one program (the gradients with the outputs)."""
  names, arrays, do, dfinal = inputs_for(config, args)
  forward, grads = functions(config, names, args, planted=False)
  options = None if getattr(args, "reference_autotune", False) else REFERENCE_COMPILER_OPTIONS
  t0 = time.perf_counter()
  compile_s = None
  try:
    fn = functools.partial(grads, args.against, with_outputs=True)
    compiled = jax.jit(fn).lower(arrays, do, dfinal).compile(compiler_options=options)
    compile_s = round(time.perf_counter() - t0, 2)
    t1 = time.perf_counter()
    dx, out = jax.block_until_ready(compiled(arrays, do, dfinal))
    run_s = round(time.perf_counter() - t1, 3)
    return jax.device_get((out, dx)), None, (compile_s, run_s)
  except Exception as exc:  # noqa: BLE001
    return None, error_text(exc), (compile_s, round(time.perf_counter() - t0, 2))


def run_config(config, args, events, ref, planted=False, reference_s=None):
  t_start = time.perf_counter()
  names, arrays, do, dfinal = inputs_for(config, args)
  forward, grads = functions(config, names, args, planted)
  tol_fwd, tol_grad = config.tolerances()
  rec = dict(
    config.fields(),
    mask_shape=list(arrays[names.index("mask")].shape) if "mask" in names else None,
    tolerance=dict(forward=tol_fwd, gradient=tol_grad),
    planted=planted,
    # the reference's (compile, run) seconds, in the record of the configuration that computed it
    reference_s=None if reference_s is None else sum(x or 0 for x in reference_s),
    reference_compile_s=None if reference_s is None else reference_s[0],
    reference_run_s=None if reference_s is None else reference_s[1],
  )
  failures = []
  out, rec["fwd"] = compile_and_run(functools.partial(forward, "pallas"), (arrays,), events)
  dx = None
  if not args.fwd_only:
    dx, rec["bwd"] = compile_and_run(
      functools.partial(grads, "pallas"), (arrays, do, dfinal), events
    )
  for what in ("fwd", "bwd"):
    if what in rec and not rec[what]["ok"]:
      failures.append(f"{what} {rec[what]['phase']}: {rec[what]['error'][:300]}")
  ref_out, ref_error = ref
  rec["reference_error"] = ref_error
  if ref_error:
    failures.append(f"xla reference: {ref_error[:300]}")
  errors = {}
  checks = []
  if out is not None and ref_out is not None:
    checks += [
      ("o", out[0], ref_out[0][0], tol_fwd),
      ("final_state", out[1], ref_out[0][1], tol_fwd),
    ]
  if dx is not None and ref_out is not None:
    checks += [(f"d{n}", x, y, tol_grad) for n, x, y in zip(names, dx, ref_out[1])]
  for name, x, y, bound in checks:
    try:
      err = host_rel_err(x, y)
    except ValueError as exc:
      failures.append(f"{name}: {exc}")
      continue
    errors[name] = err
    if not err <= bound:  # nan (non-finite output) fails too
      failures.append(f"{name}: relative error {err:.3g} > {bound:.3g}")
  rec.update(
    errors=errors,
    status="fail" if failures else "pass",
    failures=failures,
    seconds=round(time.perf_counter() - t_start, 2),
  )
  return rec


# ---- report -------------------------------------------------------------------------------------


def summarize(records):
  compiles = []
  for rec in records:
    for what in ("fwd", "bwd"):
      stage = rec.get(what)
      if stage and stage.get("compile_s") is not None:
        compiles.append(
          dict(
            key=rec["key"],
            stage=what,
            compile_s=stage["compile_s"],
            first_compile_s=stage["first_compile_s"],
            cache_hit=stage["cache_hit"],
          )
        )
  slowest = sorted(compiles, key=lambda c: -max(c["compile_s"], c["first_compile_s"] or 0))
  failures = [dict(key=r["key"], failures=r["failures"]) for r in records if r["status"] != "pass"]
  over = [c for c in slowest if max(c["compile_s"], c["first_compile_s"] or 0) > SLOW_COMPILE_S]
  worst = {}
  for rec in records:
    for name, err in rec["errors"].items():
      bound = rec["tolerance"]["forward" if name in ("o", "final_state") else "gradient"]
      ratio = err / bound if np.isfinite(err) else float("inf")
      if ratio > worst.get(rec["precision"] or rec["dtype"], (0, None))[0]:
        worst[rec["precision"] or rec["dtype"]] = (ratio, f"{rec['key']} {name} {err:.3g}")
  # Seconds summed over the configurations, per part (where a matrix run's time goes).
  totals: dict[str, float] = {}
  for rec in records:
    for what in ("fwd", "bwd"):
      for part in ("lower_s", "compile_s", "run_s"):
        value = (rec.get(what) or {}).get(part)
        totals[f"{what}_{part}"] = totals.get(f"{what}_{part}", 0.0) + (value or 0.0)
    for part in ("reference_compile_s", "reference_run_s"):
      totals[part] = totals.get(part, 0.0) + (rec.get(part) or 0.0)
  return dict(
    configs=len(records),
    totals={name: round(value, 2) for name, value in totals.items()},
    passed=len(records) - len(failures),
    failed=len(failures),
    failures=failures,
    slowest_compiles=slowest[:10],
    over_60s=over,
    compiles=len(compiles),
    cache_hits=sum(bool(c["cache_hit"]) for c in compiles),
    worst_error_over_tolerance={
      k: dict(ratio=round(v[0], 4), where=v[1]) for k, v in sorted(worst.items())
    },
  )


def fmt_s(stage):
  if not stage:
    return "-"
  if stage.get("compile_s") is None:
    return "ERR"
  hit = "c" if stage["cache_hit"] else " "
  first = f"({stage['first_compile_s']:.0f})" if stage["cache_hit"] else ""
  return f"{stage['compile_s']:6.2f}{hit}{first}"


def table(records):
  lines = [
    f"{'configuration':42s} {'fwd compile':>13s} {'bwd compile':>13s} {'max err/tol':>11s}  status"
  ]
  for rec in records:
    ratios = [
      err / rec["tolerance"]["forward" if n in ("o", "final_state") else "gradient"]
      for n, err in rec["errors"].items()
    ]
    worst = max(ratios, default=float("nan"))
    status = "ok" if rec["status"] == "pass" else "FAIL " + "; ".join(rec["failures"])[:120]
    lines.append(
      f"{rec['key']:42s} {fmt_s(rec.get('fwd')):>13s} {fmt_s(rec.get('bwd')):>13s} "
      f"{worst:11.3g}  {status}"
    )
  lines.append("compile s: 'c' = loaded from the persistent cache, (first compile, s)")
  return "\n".join(lines)


def command_line(argv):
  """The command relative to the repository: python scripts/gpu_matrix.py ARGS."""
  return " ".join(["python", "scripts/gpu_matrix.py"] + list(argv))


def environment(args):
  dev = jax.devices()[0]
  import jaxlib

  cache = args.cache_dir
  if cache and pathlib.Path(cache).resolve().is_relative_to(ROOT):
    cache = str(pathlib.Path(cache).resolve().relative_to(ROOT))
  return dict(
    schema=SCHEMA,
    date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    jax_version=jax.__version__,
    jaxlib_version=jaxlib.__version__,
    gpu=getattr(dev, "device_kind", str(dev)) if dev.platform == "gpu" else None,
    device=getattr(dev, "device_kind", str(dev)),
    platform=dev.platform,
    interpret_mode=backend.interpret_mode(),
    default_precision=backend.resolve_precision(None),
    shape=dict(B=args.B, T=args.T, H=args.H),
    chunk_size=args.chunk_size,
    cache_dir=cache,
    jobs=args.jobs,
    xla_flags=os.environ.get("XLA_FLAGS", ""),
    against=args.against,
    reference_compiler_options=None if args.reference_autotune else REFERENCE_COMPILER_OPTIONS,
    tf32_tolerance=dict(forward=TF32_TOLERANCE, gradient=TF32_GRAD_TOLERANCE),
    tolerances={
      name: dict(forward=TOLERANCE[d], gradient=GRAD_TOLERANCE[d]) for name, d in DTYPES.items()
    },
  )


def write_json(path, obj):
  """Write atomically (a reader never sees half a file)."""
  tmp = f"{path}.tmp{os.getpid()}"
  with open(tmp, "w") as f:
    json.dump(obj, f, indent=1)
  os.replace(tmp, path)


def run_here(args, configs, save):
  """Run the configurations in this process (with --queue: those of the groups it claims);
  save(records) after each one. Stops starting new ones at the deadline (--time-limit)."""
  events = CacheEvents()
  records = []
  ref_group, ref, ref_s = None, None, None
  todo = claimed(configs, args.queue) if args.queue else configs
  label = args.shard if args.job is None else f"job {args.job}"
  for i, config in enumerate(todo):
    if args.deadline and time.time() > args.deadline:
      break
    reference_s = None
    if config.group != ref_group:
      ref_group, (*ref, ref_s) = config.group, reference(config, args)
      reference_s = ref_s
    rec = run_config(
      config, args, events, ref, planted=config.key == args.planted, reference_s=reference_s
    )
    records.append(rec)
    save(records)
    ok = "ok" if rec["status"] == "pass" else "FAIL"
    print(
      f"[{label} {i + 1}/{len(configs)}] {rec['key']:42s} "
      f"fwd {fmt_s(rec.get('fwd')):>13s} bwd {fmt_s(rec.get('bwd')):>13s} "
      f"{rec['seconds']:6.1f}s {ok}",
      flush=True,
    )
  return records


def run_jobs(args, argv):
  """Run the plan in args.jobs processes that take its groups from a queue (`claimed`; each
  rewrites its JSON in OUT.parts/ after every configuration), then merge their records in plan
  order. On SIGTERM or Ctrl-C the processes are stopped and what they finished is kept."""
  strip = {"--jobs", "--workers", "--out", "--time-limit"}
  child_argv, skip = [], False
  for item in argv:
    if skip:
      skip = False
      continue
    name = item.split("=", 1)[0]
    if name in strip:
      skip = "=" not in item
      continue
    child_argv.append(item)
  parts = pathlib.Path(f"{args.out}.parts")
  queue = parts / "queue"
  shutil.rmtree(queue, ignore_errors=True)
  queue.mkdir(parents=True)
  # the children stop starting configurations at the parent's deadline
  limit = [] if not args.deadline else ["--time-limit", f"{args.deadline - time.time():.1f}"]
  procs, outs = [], []
  for j in range(args.jobs):
    out = parts / f"job{j}.json"
    out.unlink(missing_ok=True)
    cmd = (
      [sys.executable, str(pathlib.Path(__file__).resolve())]
      + child_argv
      + limit
      + ["--jobs", "1", "--out", str(out), "--child", "--queue", str(queue), "--job", str(j)]
    )
    procs.append(subprocess.Popen(cmd, cwd=ROOT))
    outs.append(out)
  interrupted = False
  previous = signal.signal(signal.SIGTERM, _raise_interrupt)
  try:
    for proc in procs:
      proc.wait()
  except KeyboardInterrupt:
    interrupted = True
    for proc in procs:
      if proc.poll() is None:
        proc.terminate()
    for proc in procs:
      proc.wait()
  finally:
    signal.signal(signal.SIGTERM, previous)
  records, lost = [], []
  for j, out in enumerate(outs):
    try:
      records += json.loads(out.read_text())["configs"]
      out.unlink()
    except (OSError, ValueError):
      lost.append(f"process {j} (exit {procs[j].returncode}) wrote no results")
  shutil.rmtree(queue, ignore_errors=True)
  try:
    parts.rmdir()  # empty unless a process left a half-written file
  except OSError:
    pass
  if interrupted:
    lost.append("interrupted")
  order = {c.key: i for i, c in enumerate(plan(args))}
  records.sort(key=lambda r: order.get(r["key"], len(order)))
  return records, lost


def _raise_interrupt(*_):
  raise KeyboardInterrupt


def main(argv=None):
  argv = list(sys.argv[1:] if argv is None else argv)
  p = argparse.ArgumentParser(
    description=__doc__.split("\n")[0],
    formatter_class=argparse.RawDescriptionHelpFormatter,
    epilog="\n".join(__doc__.split("\n")[2:8]),
  )
  p.add_argument("--out", default="gpu_matrix.json", help="JSON file (default gpu_matrix.json)")
  p.add_argument("--dtype", default="bf16,f16,f32", help="q, k, v dtypes: bf16,f16,f32")
  p.add_argument("--dims", default=DIMS, help=f"K (= V) or K:V, comma separated ({DIMS})")
  p.add_argument("--rs", default="1,2,4,8", help="key blocks r")
  p.add_argument("--masks", default=",".join(MASKS), help="mask shapes: shared,head,token")
  p.add_argument(
    "--precisions",
    default="ieee,tf32",
    help="float32 kernel precisions (tf32 = the default, precision=None)",
  )
  p.add_argument(
    "--only",
    action="append",
    metavar="KEY=V[,V]",
    help="keep configurations whose KEY (dtype, K, V, r, mask, precision) is one "
    "of the values; repeatable (e.g. --only r=8 --only mask=token)",
  )
  p.add_argument("--shard", default="0/1", help="I/N: run the I-th of N interleaved parts")
  p.add_argument(
    "--jobs",
    "--workers",
    type=int,
    default=None,
    help="worker processes side by side (default: one per CPU core, at most 16, on a GPU; "
    "1 elsewhere)",
  )
  p.add_argument("--shape", default="1,256,2", help="B,T,H")
  p.add_argument("--chunk-size", type=int, default=64)
  p.add_argument("--fwd-only", action="store_true", help="skip the backward")
  p.add_argument(
    "--against",
    default="xla",
    choices=("xla", "reference"),
    help="the implementation compared with (float32, HIGHEST precision; default xla)",
  )
  p.add_argument(
    "--reference-autotune",
    action="store_true",
    help="compile the reference with XLA's default GEMM handling (autotuned Triton GEMMs) "
    "instead of REFERENCE_COMPILER_OPTIONS",
  )
  p.add_argument(
    "--time-limit",
    type=float,
    default=None,
    metavar="S",
    help="start no configuration after S seconds (the rest are listed as not run)",
  )
  p.add_argument(
    "--cache-dir",
    default=str(ROOT / ".jax_cache"),
    help="persistent compilation cache ('' for none; default .jax_cache/)",
  )
  p.add_argument("--list", action="store_true", help="print the configurations and exit")
  p.add_argument(
    "--tiny",
    action="store_true",
    help="three small configurations, T = 32 (interpret mode on a CPU: a test)",
  )
  p.add_argument(
    "--self-check",
    action="store_true",
    help=f"scale the first configuration's Pallas o by {PLANTED_SCALE}: that "
    f"configuration must fail (the comparison works)",
  )
  p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
  p.add_argument("--queue", default=None, help=argparse.SUPPRESS)  # a child's claim folder
  p.add_argument("--job", type=int, default=None, help=argparse.SUPPRESS)  # a child's number
  args = p.parse_args(argv)
  if args.tiny:  # the tiny values become the defaults; flags given still win
    p.set_defaults(shape=TINY["shape"], chunk_size=TINY["chunk_size"])
    args = p.parse_args(argv)
  try:
    args.B, args.T, args.H = (int(x) for x in args.shape.split(","))
  except ValueError:
    raise SystemExit(f"--shape {args.shape!r}: expected B,T,H") from None
  if args.tiny:  # interpret mode on the CPU, also on a GPU machine
    jax.config.update("jax_platforms", "cpu")
  configs = plan(args)
  whole = plan(args, shard="0/1")
  # --self-check: the first configuration of the whole (unsharded) plan gets the planted error.
  args.planted = whole[0].key if args.self_check and whole else None
  if args.list:
    for c in configs:
      print(c.key)
    print(f"{len(configs)} configurations")
    return 0
  if not configs:
    raise SystemExit("no configuration matches the selection (see --list)")
  if args.jobs is None:
    # compiling is CPU work: one process per core (at most 16) on a GPU machine
    args.jobs = min(16, os.cpu_count() or 1) if jax.default_backend() == "gpu" else 1
  args.jobs = max(1, min(args.jobs, len({c.group for c in configs}) or 1))
  if args.cache_dir:
    jax.config.update("jax_compilation_cache_dir", args.cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  args.deadline = time.time() + args.time_limit if args.time_limit else None
  if not args.child:
    print(
      f"{len(configs)} configurations on {jax.devices()[0].device_kind} "
      f"({jax.default_backend()}, jax {jax.__version__}), {args.jobs} process(es), "
      f"cache {args.cache_dir or 'off'}",
      flush=True,
    )
  t0 = time.perf_counter()
  env = environment(args)

  def result(records, lost=()):
    done = {r["key"] for r in records}
    summary = summarize(records)
    summary["not_run"] = [c.key for c in configs if c.key not in done]
    summary["lost"] = list(lost)
    return dict(
      env,
      command=command_line(argv),
      wall_s=round(time.perf_counter() - t0, 1),
      configs=records,
      summary=summary,
    )

  records, lost = [], []
  try:
    if args.jobs > 1:
      records, lost = run_jobs(args, argv)
    else:
      records = run_here(args, configs, lambda recs: write_json(args.out, result(recs)))
  except KeyboardInterrupt:  # run_here saved every finished configuration
    if args.child:
      return 130
    lost = ["interrupted"]
    if os.path.exists(args.out):
      records = json.loads(pathlib.Path(args.out).read_text())["configs"]
  final = result(records, lost)
  write_json(args.out, final)
  if args.child:
    return 0
  summary = final["summary"]
  print(table(records))
  print(
    f"\n{summary['passed']}/{len(configs)} passed in {final['wall_s']:.0f} s; "
    f"{summary['cache_hits']}/{summary['compiles']} compiles from the cache"
  )
  print("  seconds summed over the configurations:", summary["totals"])
  for c in summary["slowest_compiles"][:5]:
    print(
      f"  slow compile: {c['key']} {c['stage']} {c['compile_s']:.1f} s "
      f"(first {c['first_compile_s']:.0f} s)"
    )
  for c in summary["over_60s"]:
    print(f"  OVER {SLOW_COMPILE_S:.0f} s: {c['key']} {c['stage']}")
  for f in summary["failures"]:
    print(f"  FAILED {f['key']}: {'; '.join(f['failures'])[:400]}")
  for line in summary["lost"]:
    print(f"  LOST {line}")
  if summary["not_run"]:
    print(f"  NOT RUN: {len(summary['not_run'])} configuration(s) (time limit or interruption)")
  print(f"wrote {args.out}")
  if summary["failures"]:
    return 1
  return 2 if summary["not_run"] or summary["lost"] else 0


if __name__ == "__main__":
  sys.exit(main())
