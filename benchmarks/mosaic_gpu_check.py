"""Check and time the Mosaic GPU forward (pallas_kernels/mosaic_gpu/) on an sm_90 GPU.

  PYTHONPATH=. python benchmarks/mosaic_gpu_check.py --out mosaic_gpu_check.json
  PYTHONPATH=. python benchmarks/mosaic_gpu_check.py --tiny --out /tmp/tiny.json   # CPU smoke run

Three phases, each case caught and recorded on its own (one failing kernel does not stop the rest),
the JSON rewritten after every case so an interrupted run keeps what it measured. The cases run in
groups, each group in its own process (a CUDA fault such as a misaligned address kills the
process's context and every later case in it), in the order compile, check r=1, r=2, time r=1, 2,
4, sweep, check r=4, r=8; `--group NAME` runs one group in this process. `--budget` (seconds,
default 280) bounds the whole run:
1. compile: each kernel (chunk_inverse, state_walk_ws) alone at the benchmark shape (B=8, T=4096,
   H=16, K=V=128, bf16) for r = 1, 2, 4, 8, with its compile time;
2. check: the forward against `gdp_jax.gated_delta_product(..., implementation="xla")` on the same
   16-bit inputs, relative RMS of the output and of the final state, over r, mask shapes (none,
   shared, per head, per token), initial state on/off, an odd T and float16; the issue's bar is
   5e-3;
3. time: the forward at the benchmark shape for r = 1, 2, 4 (median ms of repeated jitted calls,
   each run `--inner` back-to-back calls then block_until_ready) ("mosaic_gpu"), each kernel
   alone, beside implementation="pallas" (the Triton kernels) and, when importable,
   jax-linear-attention's Gated DeltaNet (`impl="mosaic_gpu"`, r = 1 only), with the output's
   relative RMS against xla;
4. sweep: chunk_inverse's launch parameter (chunks per program) at r = 1, 2, 4, its time alone;
5. operator: `gated_delta_product(..., implementation="mosaic_gpu")` (the Mosaic forward and
   reverse walk, then the chunk-parallel gradients, one custom_vjp): output, final
   state and every gradient against xla (`OPERATOR_CHECKS`: r = 1, 2, 4, mask shapes, grouped
   value heads; bars `GRAD_BARS`). Its speed beside the peers: `benchmarks/bench.py`.
The table printed last summarises all three. `--tiny` runs small shapes in the Mosaic GPU
interpreter on a CPU (lowering instead of compiling, no timing of peers): a check of the script.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
# The Mosaic GPU interpreter (--tiny) runs warpgroups as threads of XLA's CPU client, whose pool
# has one thread per core unless NPROC says otherwise; three warpgroups need three.
os.environ.setdefault("NPROC", "8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import gdp_jax  # noqa: E402
from pallas_kernels.mosaic_gpu import chunk_inverse as chunk_inverse_mod  # noqa: E402
from pallas_kernels.mosaic_gpu import common, walk_ws  # noqa: E402
from pallas_kernels.mosaic_gpu import forward as forward_mod

F32 = jnp.float32
BENCH = dict(batch=8, t_len=4096, heads=16, key_dim=128, value_dim=128)
CHECK = dict(batch=2, t_len=1024, heads=4, key_dim=128, value_dim=128)
TINY = dict(batch=1, t_len=128, heads=2, key_dim=64, value_dim=64)
BAR = 5e-3  # relative RMS against xla, bf16 (issue 29)


class OutOfTime(Exception):
  """The run's --budget seconds are spent: the remaining cases are recorded as skipped."""


# ----------------------------------------------------------------------------------------------
# Inputs


def make_inputs(
  seed, batch, t_len, heads, key_dim, value_dim, r, mask_kind, dtype, state, key_heads=None
):
  """Gated DeltaNet-like inputs: unit q and k, log-sigmoid decays, sigmoid beta, and the layer's
  mask l2norm(|W|) l2norm(|W|)^T (symmetric, diagonal 1) shared, per head or per token;
  `key_heads` below `heads`: grouped value heads."""
  ks = jax.random.split(jax.random.PRNGKey(seed), 7)
  key_heads = heads if key_heads is None else key_heads

  def unit(x):
    return x / jnp.linalg.norm(x, axis=-1, keepdims=True)

  q = unit(jax.random.normal(ks[0], (batch, t_len, key_heads, key_dim))).astype(dtype)
  k = unit(jax.random.normal(ks[1], (batch, t_len, key_heads, key_dim))).astype(dtype)
  v = jax.random.normal(ks[2], (batch, t_len, heads, value_dim)).astype(dtype)
  g = jax.nn.log_sigmoid(jax.random.normal(ks[3], (batch, t_len, heads)) + 3.0)
  beta = jax.nn.sigmoid(jax.random.normal(ks[4], (batch, t_len, heads)))
  mask = None
  if mask_kind != "none":
    lead = {"shared": (), "head": (heads,), "token": (batch, t_len, heads)}[mask_kind]
    w = unit(jnp.abs(jax.random.normal(ks[5], lead + (r, r))))
    mask = jnp.einsum("...ad,...bd->...ab", w, w)
  h0 = 0.1 * jax.random.normal(ks[6], (batch, heads, key_dim, value_dim)) if state else None
  return dict(q=q, k=k, v=v, g=g, beta=beta, mask=mask, initial_state=h0)


def rel_rms(got, want):
  got = np.asarray(jnp.asarray(got, F32), np.float64)
  want = np.asarray(jnp.asarray(want, F32), np.float64)
  return float(np.sqrt(np.mean((got - want) ** 2) / max(np.mean(want**2), 1e-30)))


def ours_fn(state, interpret):
  def run(q, k, v, g, beta, mask, initial_state):
    return forward_mod.forward(
      q,
      k,
      v,
      g,
      beta,
      mask,
      initial_state=initial_state,
      output_final_state=state,
      interpret=interpret,
    )

  return jax.jit(run)


def xla_fn(state):
  def run(q, k, v, g, beta, mask, initial_state):
    return gdp_jax.gated_delta_product(
      q,
      k,
      v,
      g,
      beta,
      mask,
      initial_state=initial_state,
      output_final_state=state,
      implementation="xla",
    )

  return jax.jit(run)


def call(fn, inp):
  return fn(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], inp["mask"], inp["initial_state"])


def time_fn(fn, args, reps, inner):
  """Median ms per call over `reps` runs of `inner` back-to-back calls, after warm-up."""
  for _ in range(3 if reps > 1 else 1):
    jax.block_until_ready(fn(*args))
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    for _ in range(inner):
      out = fn(*args)
    jax.block_until_ready(out)
    times.append((time.perf_counter() - t0) / inner * 1e3)
  return statistics.median(times), times


# ----------------------------------------------------------------------------------------------
# The three phases


def kernel_args(shape, r, dtype):
  """Abstract (or zero) arguments of the two kernels at `shape`, as `forward` passes them."""
  b, t, h, dk, dv = (shape[n] for n in ("batch", "t_len", "heads", "key_dim", "value_dim"))
  c = common.chunk_tokens(r)
  tp = -(-t // c) * c
  n = common.ROWS_PER_CHUNK
  spec = jax.ShapeDtypeStruct
  act_k = spec((b, tp, h, dk), dtype)
  act_v = spec((b, tp, h, dv), dtype)
  vec = spec((b, h, tp), F32)
  vec_rows = spec((b, h, tp * r), F32)
  rows = spec((1, 1, 1, r, n), F32)
  t0 = spec((b, h, tp // c * n, n), dtype)
  inv = (act_k, vec_rows, rows)
  wlk = (act_k, act_k, act_v, t0, vec, vec_rows, vec_rows, rows, spec((4,), F32))
  return inv, wlk


def phase_compile(record, shape, tiny, save):
  for r in common.SUPPORTED_R:
    inv_args, walk_args = kernel_args(shape, r, jnp.bfloat16)
    for name, fn, args in (
      ("chunk_inverse", chunk_inverse_mod.chunk_inverse, inv_args),
      ("state_walk_ws", walk_ws.state_walk_ws, walk_args),
    ):
      case = dict(phase="compile", kernel=name, r=r)
      t0 = time.perf_counter()
      try:
        if tiny:
          jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
        else:
          jax.jit(fn).lower(*args).compile()
        case.update(ok=True, seconds=round(time.perf_counter() - t0, 2))
        case["what"] = "lowered" if tiny else "compiled"
      except Exception as e:  # noqa: BLE001 (recorded, the run goes on)
        case.update(ok=False, error=summarise(e))
      record["checks"].append(case)
      save()


CHECKS = [  # (r, mask kind, initial/final state, dtype, odd T[, grouped value heads])
  (1, "none", False, "bfloat16", False),
  (1, "head", True, "bfloat16", False, True),
  (1, "none", True, "bfloat16", False),
  (1, "token", True, "bfloat16", True),
  (1, "none", False, "float16", False),
  (2, "shared", False, "bfloat16", False),
  (2, "head", True, "bfloat16", False),
  (2, "token", False, "bfloat16", False),
  (2, "token", True, "bfloat16", True, True),
  (2, "shared", True, "bfloat16", True),
  (4, "shared", False, "bfloat16", False),
  (4, "head", False, "bfloat16", False),
  (4, "token", True, "bfloat16", False),
  (4, "shared", False, "float16", True),
  (8, "shared", True, "bfloat16", False),
]


def phase_check(record, shape, interpret, save, checks):
  for r, mask_kind, state, dtype, odd, *grouped in checks:
    shp = dict(shape)
    if odd:
      shp["t_len"] = shp["t_len"] - 23
    case = dict(phase="check", r=r, mask=mask_kind, state=state, dtype=dtype, t_len=shp["t_len"])
    key_heads = shp["heads"] // 2 if grouped else None
    case["key_heads"] = key_heads or shp["heads"]
    try:
      inp = make_inputs(
        r, **shp, r=r, mask_kind=mask_kind, dtype=jnp.dtype(dtype), state=state, key_heads=key_heads
      )
      o, final = call(ours_fn(state, interpret), inp)
      want_o, want_final = call(xla_fn(state), inp)
      case["rel_rms_o"] = rel_rms(o, want_o)
      if state:
        case["rel_rms_state"] = rel_rms(final, want_final)
      worst = max(case["rel_rms_o"], case.get("rel_rms_state", 0.0))
      case.update(ok=bool(np.isfinite(worst) and worst <= BAR))
    except Exception as e:  # noqa: BLE001
      case.update(ok=False, error=summarise(e))
    record["checks"].append(case)
    save()


def phase_time(record, shape, reps, inner, save, interpret=None, rs=(1, 2, 4)):
  for r in rs:
    want = None
    try:
      mask_kind = "none" if r == 1 else "shared"
      inp = make_inputs(0, **shape, r=r, mask_kind=mask_kind, dtype=jnp.bfloat16, state=False)
      want = jax.block_until_ready(call(xla_fn(False), inp)[0])
    except Exception as e:  # noqa: BLE001
      record["checks"].append(dict(phase="time", r=r, impl="xla", ok=False, error=summarise(e)))
      save()
      continue
    time_case(record, r, "mosaic_gpu", ours_fn(False, interpret), inp, want, reps, inner)
    save()
    if r == 1:
      jla_case(record, inp, want, reps, inner)
      save()
    time_case(record, r, "pallas", pallas_fn(), inp, want, reps, inner)
    save()
    kernels_alone(record, r, inp, reps, inner, interpret)
    save()
    del inp, want


SWEEP = dict(chunks_per_program=(2, 4, 8), diag_solve=(False, True))


def phase_sweep(record, shape, reps, save, interpret, rs=(1, 2, 4)):
  """chunk_inverse alone per launch parameter (chunks per program, the float32 diagonal solve);
  with the default chunks per program, the forward's error and time with and without the solve
  and the largest difference between the two T0."""
  for r in rs:
    c = common.chunk_tokens(r)
    try:
      inp = make_inputs(0, **shape, r=r, mask_kind="head", dtype=jnp.bfloat16, state=False)
      b, t, h, _ = inp["k"].shape
      beta = forward_mod.block_rows(jnp.swapaxes(inp["beta"], 1, 2), r)
      rows = forward_mod.mask_rows(inp["mask"], b, t, h, t, r)
      want = jax.block_until_ready(call(xla_fn(False), inp)[0])
    except Exception as e:  # noqa: BLE001
      record["checks"].append(dict(phase="sweep", r=r, impl="inputs", ok=False, error=summarise(e)))
      save()
      continue
    t0_merge = None
    default = chunk_inverse_mod.default_chunks_per_program(b, h, t // c)
    for solve in SWEEP["diag_solve"]:
      if solve and interpret is not None:
        continue  # raw Mosaic GPU code: GPU only
      for cpp in SWEEP["chunks_per_program"]:
        if (t // c) % cpp:
          continue
        case = dict(phase="sweep", r=r, impl="chunk_inverse", chunks_per_program=cpp)
        case["diag_solve"] = solve
        inv = functools.partial(
          chunk_inverse_mod.chunk_inverse,
          chunks_per_program=cpp,
          diag_solve=solve,
          interpret=interpret,
        )
        try:
          case["ms"], case["all_ms"] = time_fn(jax.jit(inv), (inp["k"], beta, rows), reps, 3)
          if cpp == default:
            sweep_forward(case, inp, want, inv, t0_merge, reps, interpret)
            t0_merge = case.pop("t0") if t0_merge is None else t0_merge
            case.pop("t0", None)
          case["ok"] = bool(case.get("rel_rms_o", 0.0) <= BAR)
        except Exception as e:  # noqa: BLE001
          case.update(ok=False, error=summarise(e))
        record["checks"].append(case)
        save()


def sweep_forward(case, inp, want, inv, t0_merge, reps, interpret):
  """The forward with this chunk_inverse: its error against xla and its time; T0 kept."""
  k, mask = inp["k"], inp["mask"]
  b, t, h, _ = k.shape
  r = 1 if mask is None else mask.shape[-1]
  beta = forward_mod.block_rows(jnp.swapaxes(inp["beta"], 1, 2), r)
  rows = forward_mod.mask_rows(mask, b, t, h, t, r)
  t0 = jax.jit(inv)(k, beta, rows).astype(F32)
  case["t0"] = t0
  if t0_merge is not None:
    case["max_t0_diff_vs_merge"] = float(jnp.max(jnp.abs(t0 - t0_merge)))
  saved = forward_mod.chunk_inverse
  forward_mod.chunk_inverse = functools.partial(
    chunk_inverse_mod.chunk_inverse, diag_solve=inv.keywords["diag_solve"]
  )
  try:
    fn = ours_fn(False, interpret)
    case["rel_rms_o"] = rel_rms(call(fn, inp)[0], want)
    args = tuple(inp[n] for n in OPERATOR_INPUTS[:6]) + (None,)
    case["forward_ms"], _ = time_fn(fn, args, reps, 3)
  finally:
    forward_mod.chunk_inverse = saved


OPERATOR_INPUTS = ("q", "k", "v", "g", "beta", "mask", "initial_state")


def operator_loss(implementation):
  """(loss, (o, final)) of the public operator, every input differentiable."""

  def loss(*arrays):
    o, final = gdp_jax.gated_delta_product(
      **dict(zip(OPERATOR_INPUTS, arrays)),
      output_final_state=True,
      implementation=implementation,
    )
    o32 = o.astype(F32)
    return jnp.sum(o32 * jnp.cos(o32)) + jnp.sum(final**2), (o, final)

  return loss


# (r, mask kind, grouped value heads): the operator's gradients against xla
OPERATOR_CHECKS = [
  (1, "none", False),
  (1, "token", False),
  (2, "head", False),
  (2, "token", True),
  (4, "shared", False),
  (4, "token", False),
]
# bf16 relative RMS of each gradient against xla (the bars, as flash-linear-attention's
# own tests allow): the inputs' gradients, and the gates' and the mask's
GRAD_BARS = dict(q=8e-3, k=8e-3, v=8e-3, g=2e-2, beta=2e-2, mask=2e-2, initial_state=8e-3)


def phase_operator(record, check_shape, bench_shape, args, save):
  checks = [c for c in OPERATOR_CHECKS if str(c[0]) in args.operator_rs.split(",")]
  checks = checks[:1] if args.tiny else checks
  for r, mask_kind, grouped in checks:
    case = dict(phase="operator", r=r, impl="mosaic_gpu", what="check", mask=mask_kind)
    case["grouped"] = grouped
    try:
      key_heads = check_shape["heads"] // 2 if grouped else None
      inp = make_inputs(
        r, **check_shape, r=r, mask_kind=mask_kind, dtype=jnp.bfloat16, state=True,
        key_heads=key_heads,
      )  # fmt: skip
      names = [n for n in OPERATOR_INPUTS if inp[n] is not None]
      args_in = tuple(inp[n] for n in OPERATOR_INPUTS)
      wrt = tuple(i for i, n in enumerate(OPERATOR_INPUTS) if inp[n] is not None)
      got, want = (
        jax.jit(jax.value_and_grad(operator_loss(i), wrt, has_aux=True))(*args_in)
        for i in ("mosaic_gpu", "xla")
      )
      (_, (o, final)), grads = got
      (_, (o_x, final_x)), grads_x = want
      case["rel_rms_o"] = rel_rms(o, o_x)
      case["rel_rms_state"] = rel_rms(final, final_x)
      case["rel_rms_grads"] = {
        n: rel_rms(a, b) for n, a, b in zip(names, grads, grads_x, strict=True)
      }
      worst = max(case["rel_rms_o"], case["rel_rms_state"])
      case["ok"] = bool(
        worst <= BAR and all(case["rel_rms_grads"][n] <= GRAD_BARS[n] for n in names)
      )
    except Exception as e:  # noqa: BLE001
      case.update(ok=False, error=summarise(e))
    record["checks"].append(case)
    save()


def pallas_fn():
  def run(q, k, v, g, beta, mask, initial_state):
    return gdp_jax.gated_delta_product(
      q, k, v, g, beta, mask, initial_state=initial_state, implementation="pallas"
    )

  return jax.jit(run)


def time_case(record, r, impl, fn, inp, want, reps, inner):
  case = dict(phase="time", r=r, impl=impl)
  try:
    args = (inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], inp["mask"], None)
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    case["first_call_s"] = round(time.perf_counter() - t0, 2)
    if want is not None:
      case["rel_rms_o"] = rel_rms(out[0], want)
    case["ms"], case["all_ms"] = time_fn(fn, args, reps, inner)
    case["ok"] = True
  except Exception as e:  # noqa: BLE001
    case.update(ok=False, error=summarise(e))
  record["checks"].append(case)


def kernels_alone(record, r, inp, reps, inner, interpret):
  """Each kernel alone on the prepared inputs: where the forward's time goes."""
  c = common.chunk_tokens(r)
  b, t, h, _ = inp["k"].shape
  try:
    gamma = jnp.cumsum(jnp.swapaxes(inp["g"], 1, 2).reshape(b, h, t // c, c), -1).reshape(b, h, t)
    beta = forward_mod.block_rows(jnp.swapaxes(inp["beta"], 1, 2), r)
    gamma_rows = forward_mod.block_rows(gamma, r)
    rows = forward_mod.mask_rows(inp["mask"], b, t, h, t, r)
    scale = jnp.full((4,), inp["k"].shape[-1] ** -0.5, F32)
    inv = jax.jit(functools.partial(chunk_inverse_mod.chunk_inverse, interpret=interpret))
    t0 = jax.block_until_ready(inv(inp["k"], beta, rows))
    wlk_ws = jax.jit(lambda *a: walk_ws.state_walk_ws(*a, interpret=interpret)[0])
    walk_args = (inp["q"], inp["k"], inp["v"], t0, gamma, gamma_rows, beta, rows, scale)
  except Exception as e:  # noqa: BLE001
    record["checks"].append(dict(phase="time", r=r, impl="kernels", ok=False, error=summarise(e)))
    return
  for name, fn, args in (
    ("chunk_inverse", inv, (inp["k"], beta, rows)),
    ("state_walk_ws", wlk_ws, walk_args),
  ):
    case = dict(phase="time", r=r, impl=name)
    try:
      case["ms"], case["all_ms"] = time_fn(fn, args, reps, inner)
      case["ok"] = True
    except Exception as e:  # noqa: BLE001
      case.update(ok=False, error=summarise(e))
    record["checks"].append(case)


def jla_case(record, inp, want, reps, inner):
  case = dict(phase="time", r=1, impl="jla")
  try:
    import jla.ops
  except Exception as e:  # noqa: BLE001
    case.update(ok=False, skipped=True, error=f"not importable: {e}")
    record["checks"].append(case)
    return

  def run(q, k, v, g, beta):
    out = jla.ops.linear_attention("gated_deltanet", q, k, v, g=g, beta=beta, impl="mosaic_gpu")
    return out[0] if isinstance(out, tuple) else out

  try:
    fn = jax.jit(run)
    args = (inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"].astype(inp["q"].dtype))
    out = jax.block_until_ready(fn(*args))
    if want is not None:
      case["rel_rms_o"] = rel_rms(out, want)
    case["ms"], case["all_ms"] = time_fn(fn, args, reps, inner)
    case["ok"] = True
  except Exception as e:  # noqa: BLE001
    case.update(ok=False, error=summarise(e))
  record["checks"].append(case)


# ----------------------------------------------------------------------------------------------
# Report


def summarise(e: BaseException) -> str:
  text = f"{type(e).__name__}: {e}"
  lines = text.splitlines()
  head = "\n".join(lines[:12])
  tail = "\n".join(lines[-12:]) if len(lines) > 24 else ""
  tb = "".join(traceback.format_tb(e.__traceback__)[-3:])
  return (head + ("\n...\n" + tail if tail else "") + "\n" + tb)[:6000]


def environment(argv):
  dev = jax.devices()[0]
  env = dict(
    date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    # Relative to the repository; files by name (an absolute path names a machine).
    command=" ".join(["python"] + [os.path.basename(a) if os.path.isabs(a) else a for a in argv]),
    jax=jax.__version__,
    jaxlib=getattr(jax.lib, "__version__", None) or _jaxlib_version(),
    python=platform.python_version(),
    backend=jax.default_backend(),
    device=getattr(dev, "device_kind", str(dev)),
    compute_capability=getattr(dev, "compute_capability", None),
  )
  try:
    root = os.path.join(os.path.dirname(__file__), "..")
    env["git"] = subprocess.run(
      ["git", "-C", root, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10
    ).stdout.strip()
  except Exception:  # noqa: BLE001
    env["git"] = None
  return env


def _jaxlib_version():
  try:
    import jaxlib

    return jaxlib.__version__
  except Exception:  # noqa: BLE001
    return None


def table(record) -> str:
  env = record["env"]
  out = [f"{env['device']}  jax {env['jax']}  {env['date']}"]
  out += [table_row(case) for case in record["checks"]]
  return "\n".join(out)


def table_row(case) -> str:
  status = "ok" if case.get("ok") else ("skip" if case.get("skipped") else "FAIL")
  if case["phase"] == "compile":
    what = f"compile  r={case['r']} {case['kernel']:<14}"
    detail = f"{case.get('seconds', '')} s" if case.get("ok") else first_line(case)
  elif case["phase"] == "check":
    what = (
      f"check    r={case['r']} {case['mask']:<6} state={int(case['state'])} "
      f"{case['dtype']:<8} T={case['t_len']} key heads={case.get('key_heads', '')}"
    )
    if "rel_rms_o" in case:
      detail = f"o {case['rel_rms_o']:.2e}"
      if "rel_rms_state" in case:
        detail += f"  state {case['rel_rms_state']:.2e}"
    else:
      detail = first_line(case)
  elif case["phase"] == "operator":
    what = f"operator r={case['r']} {case['impl']:<11} {case['what']:<7}"
    if not case.get("ok") and "error" in case:
      detail = first_line(case)
    elif "ms" in case:
      detail = f"{case['ms']:.3f} ms"
    else:
      worst = max(case.get("rel_rms_grads", {}).values(), default=float("nan"))
      detail = f"o {case.get('rel_rms_o', float('nan')):.2e}  grads <= {worst:.2e}"
  elif case["phase"] in ("time", "sweep"):
    what = f"{case['phase']:<8} r={case['r']} {case['impl']:<14}"
    if case["phase"] == "sweep":
      what += f" cpp={case['chunks_per_program']} solve={int(case['diag_solve'])}"
    if case.get("ok"):
      detail = f"{case['ms']:.3f} ms"
      if "forward_ms" in case:
        detail += f"  forward {case['forward_ms']:.3f} ms"
      if "rel_rms_o" in case:
        detail += f"  (o {case['rel_rms_o']:.1e})"
    else:
      detail = first_line(case)
  else:
    what, detail = case["phase"], first_line(case)
  return f"{status:<4}  {what}  {detail}"


def first_line(case) -> str:
  return (case.get("error") or "").splitlines()[0][:120] if case.get("error") else ""


# Each group runs in its own process (a CUDA fault kills its context, and with it every later case
# of that process); the timings come before the r >= 4 checks.
GROUPS = [
  "compile",
  "operator",
  "check-r1",
  "check-r2",
  "time-r1",
  "time-r2",
  "time-r4",
  "sweep",
  "check-r4",
  "check-r8",
]


def run_group(args, group, record, save, interpret):
  kind, _, r_text = group.partition("-r")
  if kind == "compile":
    phase_compile(record, TINY if args.tiny else BENCH, args.tiny, save)
  elif kind == "check":
    checks = [c for c in CHECKS if c[0] == int(r_text)]
    if args.tiny:
      checks = checks[:1]
    phase_check(record, TINY if args.tiny else CHECK, interpret, save, checks)
  elif kind == "operator":
    phase_operator(record, TINY if args.tiny else CHECK, TINY if args.tiny else BENCH, args, save)
  elif kind == "sweep":
    phase_sweep(
      record, TINY if args.tiny else BENCH, 1 if args.tiny else args.reps, save, interpret
    )
  elif kind == "time":
    if args.tiny:  # the code path only: tiny shapes, interpreted, one call
      phase_time(record, TINY, 1, 1, save, interpret, rs=(int(r_text),))
    else:
      phase_time(record, BENCH, args.reps, args.inner, save, rs=(int(r_text),))
  else:
    raise ValueError(f"--group: {group!r}, expected one of {GROUPS}")


def run_groups_in_subprocesses(args, argv, record, start):
  """Runs each selected group in a child process; merges what each wrote, even after a crash."""
  phases = set(args.phases.split(","))
  groups = [g for g in GROUPS if g.split("-")[0] in phases]
  passthrough = [f"--reps={args.reps}", f"--inner={args.inner}"] + (["--tiny"] if args.tiny else [])
  passthrough.append(f"--operator-rs={args.operator_rs}")
  for group in groups:
    left = args.budget - (time.perf_counter() - start)
    if left <= 5:
      record["checks"].append(
        dict(phase=group, ok=False, skipped=True, error=f"--budget {args.budget} s spent")
      )
      continue
    part = f"{args.out}.{group}.json"
    if os.path.exists(part):
      os.remove(part)
    cmd = [sys.executable, os.path.abspath(__file__), f"--group={group}", f"--out={part}"]
    cmd += passthrough + [f"--budget={left}"]
    try:
      run = subprocess.run(cmd, capture_output=True, text=True, timeout=left + 30)
      rc, err = run.returncode, run.stderr
    except subprocess.TimeoutExpired as e:
      rc, err = "timeout", str(e.stderr or "")
    child = {}
    if os.path.exists(part):
      with open(part) as f:
        child = json.load(f)
      os.remove(part)
    for case in child.get("checks", []):
      case["group"] = group
      record["checks"].append(case)
    if rc not in (0, 1) or not child:  # 1: the child ran and some case failed
      tail = "\n".join(err.splitlines()[-15:])
      record["checks"].append(
        dict(phase=group, ok=False, error=f"process ended with {rc}: {tail}"[:6000])
      )
    print(f"[{time.perf_counter() - start:6.1f} s] group {group}: exit {rc}", file=sys.stderr)
    with open(args.out, "w") as f:
      json.dump(record, f, indent=1)


def main(argv=None):
  argv = sys.argv[1:] if argv is None else argv
  parser = argparse.ArgumentParser(prog="mosaic_gpu_check.py", description=__doc__.split("\n")[0])
  parser.add_argument("--out", required=True, help="JSON file to write")
  parser.add_argument("--reps", type=int, default=15, help="timed runs per case (median kept)")
  parser.add_argument("--inner", type=int, default=5, help="back-to-back calls per timed run")
  parser.add_argument("--phases", default="compile,check,time,sweep", help="comma-separated subset")
  parser.add_argument(
    "--budget", type=float, default=280.0, help="seconds; later cases are skipped past it"
  )
  parser.add_argument("--tiny", action="store_true", help="CPU smoke run: interpreter, tiny shapes")
  parser.add_argument("--group", help=f"run one group in this process: one of {GROUPS}")
  parser.add_argument("--operator-rs", default="1,2,4", help="r of the operator phase's checks")
  args = parser.parse_args(argv)
  interpret = None
  if args.tiny:
    import jax.experimental.pallas.mosaic_gpu as plgpu

    interpret = plgpu.InterpretGPUParams()
  elif jax.default_backend() != "gpu":
    print("no GPU: run with --tiny for the CPU smoke run", file=sys.stderr)
    return 2
  record = dict(env=environment([sys.argv[0]] + list(argv)), bar=BAR, checks=[])
  record["env"]["shapes"] = dict(bench=BENCH, check=TINY if args.tiny else CHECK)
  start = time.perf_counter()

  if args.group is None:
    run_groups_in_subprocesses(args, argv, record, start)
  else:

    def save():
      with open(args.out, "w") as f:
        json.dump(record, f, indent=1)
      if record["checks"]:
        row = table_row(record["checks"][-1])
        print(f"[{time.perf_counter() - start:6.1f} s] {row}", file=sys.stderr, flush=True)
      if time.perf_counter() - start > args.budget:
        raise OutOfTime

    try:
      run_group(args, args.group, record, save, interpret)
    except OutOfTime:
      record["checks"].append(
        dict(
          phase="budget", ok=False, skipped=True, error=f"stopped after --budget {args.budget} s"
        )
      )
  record["seconds"] = round(time.perf_counter() - start, 1)
  with open(args.out, "w") as f:
    json.dump(record, f, indent=1)
  failed = [c for c in record["checks"] if not c.get("ok") and not c.get("skipped")]
  if args.group is None:
    print(table(record))
    print(
      f"{len(record['checks'])} cases, {len(failed)} failed, {record['seconds']} s -> {args.out}"
    )
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
