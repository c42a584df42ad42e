"""Time the inference steps: `gqa_decode`, `paged_gqa_decode` and `gated_delta_product_step`
(docs/inference.md, docs/performance.md#inference-steps).

  python benchmarks/bench_decode.py --out results.json            # the H200 shapes (minutes)
  python benchmarks/bench_decode.py --quick --out results.json    # the same cases, smaller sweeps
  python benchmarks/bench_decode.py --smoke --out /tmp/smoke.json  # tiny shapes, a CPU smoke run

Grouped-query decode, bf16 cache, Hq=32, Hkv=8, D=128, at B=32, S=32768, B=8, S=8192 and B=32,
S=8192 (`--sizes`), with every length S and every length S/2, dense and paged side by side:
  pallas     our dense kernel (`gqa_decode`: one launch, the splits combined inside)
  previous   the previous dense design (benchmarks/decode_previous.py: partials, a jnp combine,
             about 16 programs per SM), for the side-by-side table `current_vs_previous`
  xla        our jnp dense version
  jax_gqa    `jax.experimental.pallas.ops.gpu.decode_attention.gqa` (dense)
  paged      our paged kernel (`paged_gqa_decode`): the same cache cut into pages of
             `--page-size` positions, shuffled over the page pool (random block tables)
  paged_previous  the previous paged design (benchmarks/decode_previous.py)
  paged_xla  our jnp paged version (gathers the pages)
  jax_paged  `jax.experimental.pallas.ops.gpu.paged_attention.paged_attention` (its own layout,
             [Hkv, num_pages, page_size, D], same pages and tables)
in milliseconds and TB/s of cache read (bytes = the K and V bytes the lengths cover), each
checked against the jnp dense output. Then sweeps of the kernels' launch parameters: the dense
kernel (DecodeOptions: block_s, num_warps, num_stages; num_splits 1 ... 32 around the model's
choice) and the paged kernel
(PagedDecodeOptions: block_s = cache rows per inner iteration, i.e. block_s / page_size pages,
num_warps, num_stages, num_splits) at both shapes.
Recurrent step, B=64 and B=8 (`--step-batches`), H=16, K=V=128, float32 state, r in {1, 2}: TB/s
of state read + written, Pallas (in place and not) vs xla vs `implementation=None` (auto), each
also over the time of `copy` (the state read, decayed and written once: the step's floor, measured
in the same chain), and a sweep of StepOptions (block_v, num_warps, num_stages) at r = 1.

Every figure is the median over `--reps` timed runs (after warm-up) of one jitted
`lax.fori_loop` of `--inner` calls, so dispatch overhead is not counted; each call depends on the
previous one (the decode query is nudged by 1e-20 x the last output; the step carries its state,
updated in place by the aliased kernel), so nothing can be hoisted out of the loop. Each case runs
in try/except: a failure records its error text in the JSON and the run goes on. The JSON (with
the date, jax version, GPU name and command) is rewritten after every case.
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
from benchmarks import decode_previous  # noqa: E402
from gdp_jax import gated_delta_product_step, gqa_decode, paged_gqa_decode  # noqa: E402
from pallas_kernels.common import backend  # noqa: E402
from pallas_kernels.triton.inference import decode_attention as da  # noqa: E402
from pallas_kernels.triton.inference import paged_decode_attention as pda  # noqa: E402
from pallas_kernels.triton.inference import recurrent_step as rs  # noqa: E402

DTYPES = {"bf16": jnp.bfloat16, "f16": jnp.float16, "f32": jnp.float32}
PAGED_IMPLS = ("paged", "paged_previous", "paged_xla", "jax_paged")
# (current, previous) design pairs compared in `current_vs_previous`
GENERATIONS = (("pallas", "previous"), ("paged", "paged_previous"))


def median_ms(run, carry, args, reps):
  """run(carry, *args) -> carry does `inner` calls; returns (median ms per run, all ms)."""
  jax.block_until_ready(run(carry, *args))  # compile (once per jitted run)
  jax.block_until_ready(run(carry, *args))  # warm-up
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(run(carry, *args))
    times.append((time.perf_counter() - t0) * 1e3)
  return statistics.median(times), times


# --unroll: chain the calls as straight-line code in one jit instead of a fori_loop (a while
# loop whose per-iteration bookkeeping is visible next to a 50-100 us kernel).
UNROLL = False


def loop(step, inner):
  """A jitted chain of `inner` calls of step(carry, *args) -> carry (fori_loop, or unrolled)."""

  @jax.jit
  def run(carry, *args):
    if UNROLL:
      for _ in range(inner):
        carry = step(carry, *args)
      return carry
    return jax.lax.fori_loop(0, inner, lambda i, c: step(c, *args), carry)

  return run


def error_fields(e):
  return dict(error=f"{type(e).__name__}: {e}"[:2000], traceback=traceback.format_exc()[-4000:])


def jax_peer(name):
  """jax's own Pallas GPU kernel module `name`, or None if this jax has none."""
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    try:
      if name == "decode_attention":
        from jax.experimental.pallas.ops.gpu import decode_attention as module
      else:
        from jax.experimental.pallas.ops.gpu import paged_attention as module
    except ImportError:
      return None
  return module


# ---- grouped-query decode --------------------------------------------------------------------


def make_cache(B, S, Hq, Hkv, D, dtype, seed=0):
  k0, k1, k2 = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(k0, (B, Hq, D), jnp.float32)
  kc = jax.random.normal(k1, (B, S, Hkv, D), dtype)
  vc = jax.random.normal(k2, (B, S, Hkv, D), dtype)
  return q, kc, vc


def make_pages(kc, vc, page_size, seed=1):
  """The dense cache cut into pages, scattered over a shuffled page pool: page
  block_tables[b, i] holds positions [i * page_size, (i + 1) * page_size) of sequence b."""
  B, S, Hkv, D = kc.shape
  P = S // page_size
  perm = jax.random.permutation(jax.random.key(seed), B * P).astype(jnp.int32)
  tables = perm.reshape(B, P)

  def scatter(c):
    pages = jnp.zeros((B * P, page_size, Hkv, D), c.dtype)
    return pages.at[perm].set(c.reshape(B * P, page_size, Hkv, D))

  return jax.jit(scatter)(kc), jax.jit(scatter)(vc), tables


def decode_fn(impl, D, smoke, knobs=None):
  """The function to time: dense impls take (q f32, kc, vc, lengths), paged ones
  (q f32, key_pages, value_pages, tables, lengths); each returns f32 [B, Hq, D]."""
  if impl == "pallas":
    if knobs:
      return lambda q, kc, vc, n: da.gqa_decode(q, kc, vc, n, scale=D**-0.5, **knobs)
    return lambda q, kc, vc, n: gqa_decode(q, kc, vc, n, implementation="pallas")
  if impl == "previous":
    return lambda q, kc, vc, n: decode_previous.gqa_decode(q, kc, vc, n, scale=D**-0.5)
  if impl == "paged_previous":
    return lambda q, kp, vp, t, n: decode_previous.paged_gqa_decode(q, kp, vp, t, n, scale=D**-0.5)
  if impl == "xla":
    return lambda q, kc, vc, n: gqa_decode(q, kc, vc, n, implementation="xla")
  if impl == "paged":
    if knobs:
      return lambda q, kp, vp, t, n: pda.paged_gqa_decode(q, kp, vp, t, n, scale=D**-0.5, **knobs)
    return lambda q, kp, vp, t, n: paged_gqa_decode(q, kp, vp, t, n, implementation="pallas")
  if impl == "paged_xla":
    return lambda q, kp, vp, t, n: paged_gqa_decode(q, kp, vp, t, n, implementation="xla")
  if impl == "jax_gqa":
    module = jax_peer("decode_attention")
    if module is None:
      raise ImportError("this jax has no jax.experimental.pallas.ops.gpu.decode_attention")
    extra = dict(interpret=True, k_splits=4) if smoke else {}

    def f(q, kc, vc, n):
      # Its kernel dots q with the cache tile: both must share the cache's dtype.
      out = module.gqa(q.astype(kc.dtype), kc, vc, kv_seq_len=n, **extra)
      return out.astype(jnp.float32)

    return f
  if impl == "jax_paged":
    module = jax_peer("paged_attention")
    if module is None:
      raise ImportError("this jax has no jax.experimental.pallas.ops.gpu.paged_attention")
    extra = dict(interpret=True, k_splits=2, pages_per_compute_block=2) if smoke else {}

    def f(q, kp, vp, t, n):
      # Its layout puts the heads first: kp, vp [Hkv, num_pages, page_size, D] (made once,
      # outside the timed loop); q in the pages' dtype, as for jax_gqa. It has no score scale:
      # the query carries it.
      q = (q * D**-0.5).astype(kp.dtype)
      out = module.paged_attention(q, kp, vp, t, n, **extra)
      return out.astype(jnp.float32)

    return f
  raise ValueError(f"unknown implementation {impl}")


def decode_step(fn):
  def step(qc, *args):
    return qc + 1e-20 * fn(qc, *args)  # a real dependency between calls

  return step


def cache_bytes(lengths, S, Hkv, D, dtype):
  covered = int(np.sum(np.minimum(np.maximum(np.asarray(lengths), 0), S)))
  return 2 * covered * Hkv * D * jnp.dtype(dtype).itemsize


def rate(case, nbytes, ms, all_ms, inner):
  case["ms"], case["all_ms"] = ms / inner, [t / inner for t in all_ms]
  case["GBps"] = nbytes / (case["ms"] * 1e-3) / 1e9
  case["TBps"] = case["GBps"] / 1e3


def decode_inputs(impl, dense, paged, jax_pages):
  """The cache arguments of `impl` (after q): dense (kc, vc), or paged (kp, vp, tables)."""
  if impl == "jax_paged":
    return (*jax_pages, paged[2])
  return paged if impl in PAGED_IMPLS else dense


def decode_section(results, save, shapes, dtype, impls, reps, inner, smoke, page_size):
  Hq, Hkv, D = shapes["heads"]
  for B, S in shapes["sizes"]:
    try:
      q, kc, vc = make_cache(B, S, Hq, Hkv, D, dtype)
      paged = jax_pages = None
      if any(i in PAGED_IMPLS for i in impls):
        paged = make_pages(kc, vc, page_size)
      if "jax_paged" in impls:
        to_heads_first = jax.jit(lambda p: p.transpose(2, 0, 1, 3))
        jax_pages = (to_heads_first(paged[0]), to_heads_first(paged[1]))
    except Exception as e:
      results["decode"].append(dict(B=B, S=S, **error_fields(e)))
      save()
      continue
    refs = {}
    for frac_name, L in (("full", S), ("half", S // 2)):
      try:
        lengths = jnp.full((B,), L, jnp.int32)
        refs[frac_name] = jax.jit(decode_fn("xla", D, smoke))(q, kc, vc, lengths)
      except Exception:
        refs[frac_name] = None
    for impl in impls:
      try:
        fn = decode_fn(impl, D, smoke)
        run = loop(decode_step(fn), inner)  # one compilation for both sets of lengths
        args = decode_inputs(impl, (kc, vc), paged, jax_pages)
      except Exception as e:
        results["decode"].append(dict(section="decode", impl=impl, B=B, S=S, **error_fields(e)))
        save()
        continue
      for frac_name, L in (("full", S), ("half", S // 2)):
        lengths = jnp.full((B,), L, jnp.int32)
        nbytes = cache_bytes(lengths, S, Hkv, D, dtype)
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
        if impl in PAGED_IMPLS:
          case["page_size"] = page_size
        try:
          ms, all_ms = median_ms(run, q, (*args, lengths), reps)
          rate(case, nbytes, ms, all_ms, inner)
          if refs[frac_name] is not None and impl != "xla":
            out = jax.jit(fn)(q, *args, lengths)
            case["max_abs_diff_vs_xla"] = float(jnp.max(jnp.abs(out - refs[frac_name])))
          if impl == "pallas":
            case["num_splits"] = da.default_num_splits(B, Hkv, S)
            case["defaults"] = dict(
              block_s=da.DEFAULTS.block_s,
              num_warps=da.DEFAULTS.num_warps,
              num_stages=da.DEFAULTS.num_stages,
            )
          if impl in ("previous", "paged_previous"):
            defaults = da.DEFAULTS if impl == "previous" else pda.DEFAULTS
            block_s = da.default_block_s(dtype, S, defaults)
            case["num_splits"] = decode_previous.num_splits(B, Hkv, S, block_s, defaults)
          if impl == "paged":
            case["num_splits"] = da.default_num_splits(B, Hkv, S, defaults=pda.DEFAULTS)
            case["defaults"] = dict(
              block_s=pda.DEFAULTS.block_s,
              num_warps=pda.DEFAULTS.num_warps,
              num_stages=pda.DEFAULTS.num_stages,
            )
        except Exception as e:
          case.update(error_fields(e))
        results["decode"].append(case)
        save()
        show(case)
    ratios(results, B, S, impls)
    save()
    del q, kc, vc, paged, jax_pages, refs


def ratios(results, B, S, impls):
  """Half lengths over full lengths (should be about 0.5), and paged over dense time."""
  by = {
    (c["impl"], c["lengths"]): c
    for c in results["decode"]
    if c.get("B") == B and c.get("S") == S and "ms" in c
  }
  for impl in impls:
    if (impl, "full") in by and (impl, "half") in by:
      ratio = by[impl, "half"]["ms"] / by[impl, "full"]["ms"]
      results["half_over_full"].append(dict(impl=impl, B=B, S=S, ratio=ratio))
      print(f"  {impl:9s} B={B} S={S}: time(lengths S/2) / time(lengths S) = {ratio:.2f}")
  for current, previous in GENERATIONS:
    for frac in ("full", "half"):
      if (current, frac) in by and (previous, frac) in by:
        now, before = by[current, frac], by[previous, frac]
        row = dict(
          current=current,
          previous=previous,
          B=B,
          S=S,
          lengths=frac,
          TBps=now["TBps"],
          previous_TBps=before["TBps"],
          ms=now["ms"],
          previous_ms=before["ms"],
          speedup=before["ms"] / now["ms"],
          num_splits=now.get("num_splits"),
          previous_num_splits=before.get("num_splits"),
        )
        results["current_vs_previous"].append(row)
        print(
          f"  {current:6s} B={B} S={S} L={frac}: {now['TBps']:.3f} TB/s "
          f"(splits {row['num_splits']}) vs previous {before['TBps']:.3f} TB/s "
          f"(splits {row['previous_num_splits']}): {row['speedup']:.3f}x"
        )
  for paged, dense in (("paged", "pallas"), ("paged_xla", "xla"), ("jax_paged", "jax_gqa")):
    for frac in ("full", "half"):
      if (paged, frac) in by and (dense, frac) in by:
        ratio = by[paged, frac]["ms"] / by[dense, frac]["ms"]
        results["paged_over_dense"].append(
          dict(paged=paged, dense=dense, B=B, S=S, lengths=frac, ratio=ratio)
        )
        print(f"  {paged:9s} / {dense:7s} B={B} S={S} L={frac}: time ratio {ratio:.3f}")


def decode_sweep(results, save, shape, dtype, configs, reps, inner, kind, page_size):
  """Launch-parameter sweep of our dense (kind "pallas") or paged (kind "paged") kernel."""
  Hq, Hkv, D = shape["heads"]
  B, S = shape["size"]
  q, kc, vc = make_cache(B, S, Hq, Hkv, D, dtype)
  lengths = jnp.full((B,), S, jnp.int32)
  nbytes = cache_bytes(lengths, S, Hkv, D, dtype)
  ref = jax.jit(decode_fn("xla", D, False))(q, kc, vc, lengths)
  args = (kc, vc)
  if kind == "paged":
    args = make_pages(kc, vc, page_size)
    del kc, vc
  for knobs in configs:
    case = dict(
      section=f"{kind}_sweep" if kind == "paged" else "decode_sweep",
      impl=kind,
      B=B,
      S=S,
      Hq=Hq,
      Hkv=Hkv,
      D=D,
      dtype=jnp.dtype(dtype).name,
      knobs=knobs,
      cache_bytes_read=nbytes,
    )
    if kind == "paged":
      case["page_size"] = page_size
      block_s = knobs.get("block_s", pda.DEFAULTS.block_s)
      case["pages_per_block"] = block_s / page_size
    try:
      fn = decode_fn(kind, D, False, knobs)
      ms, all_ms = median_ms(loop(decode_step(fn), inner), q, (*args, lengths), reps)
      rate(case, nbytes, ms, all_ms, inner)
      out = jax.jit(fn)(q, *args, lengths)
      case["max_abs_diff_vs_xla"] = float(jnp.max(jnp.abs(out - ref)))
    except Exception as e:
      case.update(error_fields(e))
    results["decode_sweep"].append(case)
    save()
    show(case, label=str(knobs))
  del q, args, ref


def decode_configs(quick, B, S, Hkv, defaults):
  """Launch configurations to sweep: (block_s, warps, stages) grid, then num_splits from 1 to 32
  (each split at least `min_blocks_per_split` blocks) beside the model's choice."""
  if quick:
    grid = [(bs, w, 3) for bs in (32, 64, 128) for w in (4, 8)]
  else:
    grid = [(bs, w, st) for bs in (32, 64, 128) for w in (4, 8) for st in (2, 3, 4)]
  configs = [dict(block_s=bs, num_warps=w, num_stages=st) for bs, w, st in grid]
  ns = da.default_num_splits(B, Hkv, S, defaults.block_s, defaults=defaults)
  most = max(1, S // (defaults.min_blocks_per_split * defaults.block_s))
  splits = {1, 2, 4, 8, 16, 32} if quick else {1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32}
  splits = {n for n in splits if n <= most}
  configs += [
    dict(
      block_s=defaults.block_s,
      num_warps=defaults.num_warps,
      num_stages=defaults.num_stages,
      num_splits=n,
    )
    for n in sorted(splits - {ns})
  ]
  return configs


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
  if impl == "copy":  # the state read and written once (one decay), the step's floor

    def f(carry, q, k, v, g, beta, mask):
      new = carry[0] * jnp.exp(g.astype(jnp.float32))[..., None, None]
      # a barrier per call: an unrolled chain of these would otherwise fuse into one pass
      return jax.lax.optimization_barrier((new, carry[1]))

    return f
  in_place = impl != "pallas_copy"
  name = {"xla": "xla", "auto": None}.get(impl, "pallas")

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
    ref = copy_ms = None
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
        rate(case, 2 * state_bytes, ms, all_ms, inner)
        if impl == "copy":
          copy_ms = case["ms"]
        elif copy_ms:
          case["over_measured_copy_time"] = case["ms"] / copy_ms
        # the time to read and write the state once at the copy bandwidth (about 4.3 TB/s)
        case["over_copy_time_at_4.3TBps"] = case["ms"] / (2 * state_bytes / 4.3e12 * 1e3)
        new, o = jax.jit(fn)(carry, *rest)
        if impl == "xla":
          ref = (new, o)
        if ref is not None and impl != "copy":
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
        case.update(error_fields(e))
      results["step"].append(case)
      save()
      show(case, label=f"r={r}" + (f" {knobs}" if knobs else ""))
    del args, state, rest, ref, carry


def step_configs(quick, smoke):
  """StepOptions to sweep: (block_v, num_warps, num_stages)."""
  if smoke:
    grid = [(16, 4, 1), (32, 4, 2)]
  elif quick:
    grid = [(32, 4, 1), (64, 4, 1), (64, 8, 1), (16, 4, 1)]
  else:
    grid = [(bv, w, 1) for bv, w in ((32, 4), (64, 4), (64, 8), (128, 4), (128, 8))]
    # narrow tiles and few warps: more programs in flight at small batches
    grid += [(bv, w, 1) for bv, w in ((16, 2), (16, 4), (32, 2), (64, 2))]
    # num_stages should change nothing (no dots, so no software pipelining): a check
    grid += [(64, 4, 2)]
  return [dict(block_v=bv, num_warps=w, num_stages=st) for bv, w, st in grid]


# ---- output ----------------------------------------------------------------------------------


def show(case, label=""):
  head = case.get("section", "")
  if head.startswith(("decode", "paged")):
    what = f"B={case['B']:<3d} S={case['S']:<6d} L={case.get('lengths', 'full'):4s}"
  else:
    what = f"B={case['B']} H={case['H']} K={case['K']} V={case['V']}"
  name = f"{head:12s} {case['impl']:11s} {what} {label}"
  if "ms" in case:
    extra = ""
    if "max_abs_diff_vs_xla" in case:
      extra = f"  |diff vs xla| {case['max_abs_diff_vs_xla']:.2e}"
    print(f"{name:70s} {case['ms']:9.4f} ms {case['TBps']:7.3f} TB/s{extra}", flush=True)
  else:
    print(f"{name:70s} ERROR {case['error'][:300]}", flush=True)


def summary(results):
  best = {}
  for sec in ("decode", "decode_sweep", "step"):
    for c in results.get(sec, []):
      if "GBps" not in c:
        continue
      key = (
        c["section"].replace("_sweep", "").replace("paged", "decode"),
        c["impl"],
        c.get("B"),
        c.get("S"),
        c.get("r"),
        c.get("lengths", "full"),
      )
      if key not in best or c["GBps"] > best[key]["GBps"]:
        best[key] = dict(GBps=c["GBps"], TBps=c["TBps"], ms=c["ms"], knobs=c.get("knobs"))
  results["best"] = [
    dict(zip(("section", "impl", "B", "S", "r", "lengths"), k), **v)
    for k, v in sorted(best.items(), key=lambda kv: str(kv[0]))
  ]
  print("\nbest per case (TB/s):")
  for row in results["best"]:
    print(
      f"  {row['section']:7s} {row['impl']:11s} B={row['B']} S={row['S']} r={row['r']} "
      f"L={row['lengths']}: {row['TBps']:7.3f} TB/s  {row['ms']:.4f} ms  {row['knobs'] or ''}"
    )


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--out", required=True, help="the JSON file to write")
  p.add_argument("--smoke", "--tiny", action="store_true", help="tiny shapes: a CPU smoke run")
  p.add_argument("--quick", action="store_true", help="fewer repetitions and smaller sweeps")
  p.add_argument("--reps", type=int, default=None, help="timed runs (default 7, quick 5)")
  p.add_argument("--inner", type=int, default=None, help="calls per run (default 50, quick 20)")
  p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
  p.add_argument("--page-size", type=int, default=16, help="positions per page (paged cases)")
  p.add_argument(
    "--impls", default="pallas,previous,xla,jax_gqa,paged,paged_previous,paged_xla,jax_paged"
  )
  p.add_argument(
    "--sizes",
    default="32:32768,8:8192,32:8192",
    help="decode cases as B:S pairs (the sweeps run at each)",
  )
  p.add_argument(
    "--step-impls",
    default="copy,xla,pallas,pallas_copy,auto",
    help="copy: the state read and written once; auto: implementation=None",
  )
  p.add_argument("--step-batches", default="64,8", help="batch sizes of the step cases")
  p.add_argument("--no-sweep", action="store_true")
  p.add_argument("--unroll", action="store_true", help="chain the calls unrolled, not in a loop")
  p.add_argument("--sections", default="decode,sweep,paged_sweep,step")
  args = p.parse_args(argv)
  global UNROLL
  UNROLL = args.unroll
  dtype = DTYPES[args.dtype]
  sections = args.sections.split(",")
  reps = args.reps or (2 if args.smoke else 5 if args.quick else 7)
  inner = args.inner or (2 if args.smoke else 20 if args.quick else 50)

  if args.smoke:
    heads = (8, 2, 32)
    sizes = [(2, 256), (1, 128)]
    sweep_sizes = [(2, 256)]
    step_shapes = [(2, 2, 32, 32)]
    dense_cfgs = lambda B, S: [
      dict(block_s=16, num_warps=4, num_stages=2, num_splits=2),
      dict(block_s=32, num_warps=4, num_stages=3, num_splits=1),
    ]
    paged_cfgs = dense_cfgs
  else:
    heads = (32, 8, 128)
    sizes = [tuple(int(x) for x in pair.split(":")) for pair in args.sizes.split(",")]
    sweep_sizes = sizes
    step_shapes = [(int(b), 16, 128, 128) for b in args.step_batches.split(",")]
    dense_cfgs = lambda B, S: decode_configs(args.quick, B, S, heads[1], da.DEFAULTS)
    paged_cfgs = lambda B, S: decode_configs(args.quick, B, S, heads[1], pda.DEFAULTS)
  step_cfgs = step_configs(args.quick, args.smoke)
  if args.no_sweep:
    dense_cfgs = paged_cfgs = lambda B, S: []
    step_cfgs = []

  device = jax.devices()[0]
  results = dict(
    device=str(device),
    gpu_name=str(device.device_kind),
    backend=jax.default_backend(),
    jax_version=jax.__version__,
    interpret_mode=backend.interpret_mode(),
    date=time.strftime("%Y-%m-%d %H:%M:%S"),
    command=" ".join(
      ["python", "benchmarks/bench_decode.py"] + list(sys.argv[1:] if argv is None else argv)
    ),
    reps=reps,
    inner=inner,
    unrolled=args.unroll,
    page_size=args.page_size,
    jax_peers=dict(
      decode_attention=jax_peer("decode_attention") is not None,
      paged_attention=jax_peer("paged_attention") is not None,
    ),
    goals=dict(
      decode_TBps_at_B32_S32768=4.3,
      decode_TBps_at_B8_S8192=3.5,
      decode_B32_no_slower_than_previous=True,
      paged_over_dense_time=1.1,
      step_TBps_at_B64_H16_K128_V128=3.0,
      step_B8_over_copy_time=2.0,
    ),
    decode=[],
    half_over_full=[],
    paged_over_dense=[],
    current_vs_previous=[],
    decode_sweep=[],
    step=[],
    seconds={},
  )

  def save():
    with open(args.out, "w") as f:
      json.dump(results, f, indent=1)

  impls = args.impls.split(",")
  shapes = dict(heads=heads, sizes=sizes)
  for section in sections:
    t0 = time.perf_counter()
    try:
      if section == "decode":
        decode_section(results, save, shapes, dtype, impls, reps, inner, args.smoke, args.page_size)
      elif section in ("sweep", "paged_sweep"):
        kind = "pallas" if section == "sweep" else "paged"
        make = dense_cfgs if section == "sweep" else paged_cfgs
        for B, S in sweep_sizes:
          configs = make(B, S)
          if configs:
            shape = dict(heads=heads, size=(B, S))
            decode_sweep(results, save, shape, dtype, configs, reps, inner, kind, args.page_size)
      elif section == "step":
        for shape in step_shapes:
          step_section(
            results, save, shape, (1, 2), args.step_impls.split(","), step_cfgs, reps, inner
          )
      else:
        raise ValueError(f"unknown section {section!r}")
    except Exception as e:  # a whole section failing (e.g. out of memory): record, go on
      results.setdefault("errors", []).append(dict(section=section, **error_fields(e)))
      print(f"section {section}: ERROR {e}"[:400], flush=True)
    results["seconds"][section] = round(time.perf_counter() - t0, 1)
    save()
  summary(results)
  save()
  return 0


if __name__ == "__main__":
  sys.exit(main())
