"""Time the inference steps: `gqa_decode` and `gated_delta_product_step`
(docs/inference.md, docs/performance.md#inference-steps).

  python benchmarks/bench_decode.py --out results.json            # the H200 shapes
  python benchmarks/bench_decode.py --tiny --out /tmp/tiny.json   # a smoke run on CPU

Grouped-query decode, bf16 cache, Hq=32, Hkv=8, D=128, at B=32, S=32768 and B=8, S=8192, with
every length S and every length S/2: our Pallas kernel, our jnp version ("xla") and
`jax.experimental.pallas.ops.gpu.decode_attention.gqa`, in milliseconds and effective GB/s of
cache read (bytes = the K and V cache bytes the lengths cover). Then a small sweep of the
kernel's knobs (block_s, num_warps, num_stages, num_splits) at the large shape.
Recurrent step, B=64, H=16, K=V=128, float32 state, r in {1, 2}: GB/s of state read + written,
Pallas (in place and not) vs xla, and a sweep of block_v / num_warps.

Every figure is the median over `--reps` timed runs (after warm-up) of one jitted
`lax.fori_loop` of `--inner` calls, so dispatch overhead is not counted; each call depends on the
previous one (the decode query is nudged by 1e-20 x the last output; the step carries its state,
updated in place by the aliased kernel), so nothing can be hoisted out of the loop. Each case runs
in try/except: a failure records its error text in the JSON and the run goes on. The JSON is
rewritten after every case.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
import warnings

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from gdp_jax import gated_delta_product_step, gqa_decode  # noqa: E402
from pallas_kernels.common import backend  # noqa: E402
from pallas_kernels.inference import decode_attention as da  # noqa: E402
from pallas_kernels.inference import recurrent_step as rs  # noqa: E402

DTYPES = {"bf16": jnp.bfloat16, "f16": jnp.float16, "f32": jnp.float32}


def median_ms(run, carry, args, reps):
  """run(carry, *args) -> carry does `inner` calls; returns (median ms per run, all ms)."""
  jax.block_until_ready(run(carry, *args))  # compile
  jax.block_until_ready(run(carry, *args))  # warm-up
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(run(carry, *args))
    times.append((time.perf_counter() - t0) * 1e3)
  return statistics.median(times), times


def loop(step, inner):
  """A jitted fori_loop of `inner` calls of step(carry, *args) -> carry."""

  @jax.jit
  def run(carry, *args):
    return jax.lax.fori_loop(0, inner, lambda i, c: step(c, *args), carry)

  return run


# ---- grouped-query decode --------------------------------------------------------------------


def make_cache(B, S, Hq, Hkv, D, dtype, seed=0):
  k0, k1, k2 = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(k0, (B, Hq, D), jnp.float32)
  kc = jax.random.normal(k1, (B, S, Hkv, D), dtype)
  vc = jax.random.normal(k2, (B, S, Hkv, D), dtype)
  return q, kc, vc


def decode_fn(impl, D, tiny, knobs=None):
  """(q f32, kc, vc, lengths) -> f32 [B, Hq, D] for one implementation."""
  if impl == "pallas":
    if knobs:
      return lambda q, kc, vc, n: da.gqa_decode(q, kc, vc, n, scale=D**-0.5, **knobs)
    return lambda q, kc, vc, n: gqa_decode(q, kc, vc, n, implementation="pallas")
  if impl == "xla":
    return lambda q, kc, vc, n: gqa_decode(q, kc, vc, n, implementation="xla")
  if impl == "jax_gqa":
    with warnings.catch_warnings():
      warnings.simplefilter("ignore", DeprecationWarning)
      from jax.experimental.pallas.ops.gpu import decode_attention as jax_da
    extra = dict(interpret=True, k_splits=4) if tiny else {}

    def f(q, kc, vc, n):
      # Its kernel dots q with the cache tile: both must share the cache's dtype.
      out = jax_da.gqa(q.astype(kc.dtype), kc, vc, kv_seq_len=n, **extra)
      return out.astype(jnp.float32)

    return f
  raise ValueError(f"unknown implementation {impl}")


def time_decode(fn, q, kc, vc, lengths, reps, inner):
  def step(qc, kc, vc, n):
    return qc + 1e-20 * fn(qc, kc, vc, n)  # a real dependency between calls

  ms, all_ms = median_ms(loop(step, inner), q, (kc, vc, lengths), reps)
  return ms / inner, [t / inner for t in all_ms]


def cache_bytes(lengths, S, Hkv, D, dtype):
  covered = int(np.sum(np.minimum(np.maximum(np.asarray(lengths), 0), S)))
  return 2 * covered * Hkv * D * jnp.dtype(dtype).itemsize


def decode_section(results, save, shapes, dtype, impls, reps, inner, tiny):
  Hq, Hkv, D = shapes["heads"]
  for B, S in shapes["sizes"]:
    try:
      q, kc, vc = make_cache(B, S, Hq, Hkv, D, dtype)
    except Exception as e:
      results["decode"].append(dict(B=B, S=S, error=f"{type(e).__name__}: {e}"[:2000]))
      save()
      continue
    for frac_name, L in (("full", S), ("half", S // 2)):
      lengths = jnp.full((B,), L, jnp.int32)
      nbytes = cache_bytes(lengths, S, Hkv, D, dtype)
      try:
        ref = jax.jit(decode_fn("xla", D, tiny))(q, kc, vc, lengths)
      except Exception:
        ref = None
      for impl in impls:
        case = dict(
          section="decode",
          impl=impl,
          B=B,
          S=S,
          Hq=Hq,
          Hkv=Hkv,
          D=D,
          dtype=jnp.dtype(dtype).name,
          lengths=frac_name,
          length=L,
          cache_bytes_read=nbytes,
        )
        try:
          fn = decode_fn(impl, D, tiny)
          case["ms"], case["all_ms"] = time_decode(fn, q, kc, vc, lengths, reps, inner)
          case["GBps"] = nbytes / (case["ms"] * 1e-3) / 1e9
          if ref is not None and impl != "xla":
            out = jax.jit(fn)(q, kc, vc, lengths)
            case["max_abs_diff_vs_xla"] = float(jnp.max(jnp.abs(out - ref)))
          if impl == "pallas":
            case["num_splits"] = da.default_num_splits(B, Hkv, S)
            case["defaults"] = dict(
              block_s=da.DEFAULTS.block_s,
              num_warps=da.DEFAULTS.num_warps,
              num_stages=da.DEFAULTS.num_stages,
            )
        except Exception as e:
          case["error"] = f"{type(e).__name__}: {e}"[:2000]
          case["traceback"] = traceback.format_exc()[-4000:]
        results["decode"].append(case)
        save()
        show(case)
    # lengths S/2 should take about half the time of lengths S
    for impl in impls:
      by = {
        c["lengths"]: c
        for c in results["decode"]
        if c.get("impl") == impl and c.get("B") == B and c.get("S") == S and "ms" in c
      }
      if "full" in by and "half" in by:
        ratio = by["half"]["ms"] / by["full"]["ms"]
        results["half_over_full"].append(dict(impl=impl, B=B, S=S, ratio=ratio))
        print(f"  {impl:8s} B={B} S={S}: time(lengths S/2) / time(lengths S) = {ratio:.2f}")
    save()
    del q, kc, vc, ref


def decode_sweep(results, save, shape, dtype, configs, reps, inner):
  Hq, Hkv, D = shape["heads"]
  B, S = shape["size"]
  q, kc, vc = make_cache(B, S, Hq, Hkv, D, dtype)
  lengths = jnp.full((B,), S, jnp.int32)
  nbytes = cache_bytes(lengths, S, Hkv, D, dtype)
  ref = jax.jit(decode_fn("xla", D, False))(q, kc, vc, lengths)
  for knobs in configs:
    case = dict(
      section="decode_sweep",
      impl="pallas",
      B=B,
      S=S,
      Hq=Hq,
      Hkv=Hkv,
      D=D,
      dtype=jnp.dtype(dtype).name,
      knobs=knobs,
      cache_bytes_read=nbytes,
    )
    try:
      fn = decode_fn("pallas", D, False, knobs)
      case["ms"], case["all_ms"] = time_decode(fn, q, kc, vc, lengths, reps, inner)
      case["GBps"] = nbytes / (case["ms"] * 1e-3) / 1e9
      case["max_abs_diff_vs_xla"] = float(jnp.max(jnp.abs(jax.jit(fn)(q, kc, vc, lengths) - ref)))
    except Exception as e:
      case["error"] = f"{type(e).__name__}: {e}"[:2000]
      case["traceback"] = traceback.format_exc()[-4000:]
    results["decode_sweep"].append(case)
    save()
    show(case, label=str(knobs))
  del q, kc, vc, ref


# ---- recurrent step --------------------------------------------------------------------------


def make_step(B, H, K, V, r, seed=1):
  ks = jax.random.split(jax.random.key(seed), 7)
  q = jax.random.normal(ks[0], (B, H, K), jnp.float32)
  k = jax.random.normal(ks[1], (B, H, K), jnp.float32)
  kb = k.reshape(B, H, r, K // r)
  k = (kb / jnp.linalg.norm(kb, axis=-1, keepdims=True)).reshape(B, H, K)
  v = jax.random.normal(ks[2], (B, H, V), jnp.float32)
  g = jax.nn.log_sigmoid(jax.random.normal(ks[3], (B, H)) + 4.0)
  beta = jax.nn.sigmoid(jax.random.normal(ks[4], (B, H)))
  mask = jnp.eye(r) * 0.5 + 0.5
  state = jax.random.normal(ks[5], (B, H, K, V), jnp.float32) * 0.1
  return (
    q.astype(jnp.bfloat16),
    k.astype(jnp.bfloat16),
    v.astype(jnp.bfloat16),
    g,
    beta,
    mask,
    state,
  )


def step_fn(impl, K, knobs=None):
  """(state, o) , q, k, v, g, beta, mask -> (new state, o): o rides in the loop carry so it
  stays live without an extra pass over the state."""
  if impl in ("pallas", "pallas_copy") and knobs:

    def f(carry, q, k, v, g, beta, mask):
      o, new = rs.recurrent_step(
        q, k, v, g, beta, mask[None, None], carry[0], scale=K**-0.5, **knobs
      )
      return new, o

    return f
  in_place = impl != "pallas_copy"
  name = "xla" if impl == "xla" else "pallas"

  def f(carry, q, k, v, g, beta, mask):
    o, new = gated_delta_product_step(
      q, k, v, g, beta, mask, carry[0], implementation=name, in_place=in_place
    )
    return new, o

  return f


def step_section(results, save, shape, rs_list, impls, sweep, reps, inner):
  B, H, K, V = shape
  state_bytes = B * H * K * V * 4
  for r in rs_list:
    args = make_step(B, H, K, V, r)
    state, rest = args[-1], args[:-1]
    carry = (state, jnp.zeros((B, H, V), rest[0].dtype))
    ref = None
    cases = [(impl, None) for impl in impls] + [("pallas", kn) for kn in (sweep if r == 1 else [])]
    for impl, knobs in cases:
      case = dict(
        section="step" if knobs is None else "step_sweep",
        impl=impl,
        B=B,
        H=H,
        K=K,
        V=V,
        r=r,
        knobs=knobs,
        state_bytes_read_written=2 * state_bytes,
      )
      try:
        fn = step_fn(impl, K, knobs)
        ms, all_ms = median_ms(loop(fn, inner), carry, rest, reps)
        case["ms"], case["all_ms"] = ms / inner, [t / inner for t in all_ms]
        case["GBps"] = 2 * state_bytes / (case["ms"] * 1e-3) / 1e9
        new, o = jax.jit(fn)(carry, *rest)
        if impl == "xla":
          ref = (new, o)
        if ref is not None:
          case["max_abs_diff_vs_xla"] = max(
            float(jnp.max(jnp.abs(new - ref[0]))),
            float(jnp.max(jnp.abs(o.astype(jnp.float32) - ref[1].astype(jnp.float32)))),
          )
        if impl.startswith("pallas") and knobs is None:
          case["defaults"] = dict(
            block_v=rs.DEFAULTS.block_v,
            num_warps=rs.DEFAULTS.num_warps,
            num_stages=rs.DEFAULTS.num_stages,
          )
      except Exception as e:
        case["error"] = f"{type(e).__name__}: {e}"[:2000]
        case["traceback"] = traceback.format_exc()[-4000:]
      results["step"].append(case)
      save()
      show(case, label=f"r={r}" + (f" {knobs}" if knobs else ""))
    del args, state, rest, ref, carry


# ---- output ----------------------------------------------------------------------------------


def show(case, label=""):
  head = case.get("section", "")
  if head.startswith("decode"):
    what = f"B={case['B']:<3d} S={case['S']:<6d} L={case.get('lengths', 'full'):4s}"
  else:
    what = f"B={case['B']} H={case['H']} K={case['K']} V={case['V']}"
  name = f"{head:12s} {case['impl']:11s} {what} {label}"
  if "ms" in case:
    extra = ""
    if "max_abs_diff_vs_xla" in case:
      extra = f"  |diff vs xla| {case['max_abs_diff_vs_xla']:.2e}"
    print(f"{name:70s} {case['ms']:9.4f} ms {case['GBps']:9.1f} GB/s{extra}", flush=True)
  else:
    print(f"{name:70s} ERROR {case['error'][:300]}", flush=True)


def summary(results):
  best = {}
  for sec in ("decode", "decode_sweep", "step"):
    for c in results.get(sec, []):
      if "GBps" not in c:
        continue
      key = (
        c["section"].replace("_sweep", ""),
        c["impl"],
        c.get("B"),
        c.get("S"),
        c.get("r"),
        c.get("lengths", "full"),
      )
      if key not in best or c["GBps"] > best[key]["GBps"]:
        best[key] = dict(GBps=c["GBps"], ms=c["ms"], knobs=c.get("knobs"))
  results["best"] = [
    dict(zip(("section", "impl", "B", "S", "r", "lengths"), k), **v)
    for k, v in sorted(best.items(), key=lambda kv: str(kv[0]))
  ]
  print("\nbest per case (GB/s):")
  for row in results["best"]:
    print(
      f"  {row['section']:7s} {row['impl']:11s} B={row['B']} S={row['S']} r={row['r']} "
      f"L={row['lengths']}: {row['GBps']:8.1f} GB/s  {row['ms']:.4f} ms  {row['knobs'] or ''}"
    )


def main(argv=None):
  p = argparse.ArgumentParser()
  p.add_argument("--out", required=True)
  p.add_argument("--tiny", action="store_true", help="small shapes for a CPU smoke run")
  p.add_argument("--reps", type=int, default=7)
  p.add_argument("--inner", type=int, default=50)
  p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
  p.add_argument("--impls", default="pallas,xla,jax_gqa")
  p.add_argument("--step-impls", default="xla,pallas,pallas_copy")
  p.add_argument("--no-sweep", action="store_true")
  p.add_argument("--sections", default="decode,sweep,step")
  args = p.parse_args(argv)
  dtype = DTYPES[args.dtype]
  sections = args.sections.split(",")

  if args.tiny:
    args.reps, args.inner = 2, 2
    shapes = dict(heads=(8, 2, 32), sizes=[(2, 256), (1, 128)])
    sweep_shape = dict(heads=(8, 2, 32), size=(2, 256))
    decode_configs = [
      dict(block_s=16, num_warps=4, num_stages=2, num_splits=2),
      dict(block_s=32, num_warps=4, num_stages=3, num_splits=1),
    ]
    step_shape = (2, 2, 32, 32)
    step_configs = [dict(block_v=16, num_warps=4), dict(block_v=32, num_warps=4)]
  else:
    shapes = dict(heads=(32, 8, 128), sizes=[(32, 32768), (8, 8192)])
    sweep_shape = dict(heads=(32, 8, 128), size=(32, 32768))
    ns = da.default_num_splits(32, 8, 32768)
    decode_configs = [
      dict(block_s=bs, num_warps=w, num_stages=st)
      for bs in (32, 64, 128)
      for w in (4, 8)
      for st in (2, 3)
    ]
    decode_configs += [
      dict(
        block_s=da.DEFAULTS.block_s,
        num_warps=da.DEFAULTS.num_warps,
        num_stages=da.DEFAULTS.num_stages,
        num_splits=n,
      )
      for n in sorted({max(1, ns // 4), max(1, ns // 2), ns * 2})
    ]
    step_shape = (64, 16, 128, 128)
    step_configs = [
      dict(block_v=bv, num_warps=w)
      for bv in (16, 32, 64, 128)
      for w in (2, 4, 8)
      if not (bv == 128 and w == 2)
    ]  # that one spills registers
  if args.no_sweep:
    decode_configs, step_configs = [], []

  results = dict(
    device=str(jax.devices()[0]),
    backend=jax.default_backend(),
    jax_version=jax.__version__,
    interpret_mode=backend.interpret_mode(),
    date=time.strftime("%Y-%m-%d %H:%M:%S"),
    command=" ".join(sys.argv),
    reps=args.reps,
    inner=args.inner,
    bars=dict(decode_GBps_at_B32_S32768=3000, step_GBps_at_B64_H16_K128_V128=2500),
    decode=[],
    half_over_full=[],
    decode_sweep=[],
    step=[],
  )

  def save():
    with open(args.out, "w") as f:
      json.dump(results, f, indent=1)

  impls = args.impls.split(",")
  for section in sections:
    try:
      if section == "decode":
        decode_section(results, save, shapes, dtype, impls, args.reps, args.inner, args.tiny)
      elif section == "sweep" and decode_configs:
        decode_sweep(results, save, sweep_shape, dtype, decode_configs, args.reps, args.inner)
      elif section == "step":
        step_section(
          results,
          save,
          step_shape,
          (1, 2),
          args.step_impls.split(","),
          step_configs,
          args.reps,
          args.inner,
        )
    except Exception as e:  # a whole section failing (e.g. out of memory): record, go on
      results.setdefault("errors", []).append(
        dict(
          section=section,
          error=f"{type(e).__name__}: {e}"[:2000],
          traceback=traceback.format_exc()[-4000:],
        )
      )
      print(f"section {section}: ERROR {e}"[:400], flush=True)
    save()
  summary(results)
  save()
  return 0


if __name__ == "__main__":
  sys.exit(main())
