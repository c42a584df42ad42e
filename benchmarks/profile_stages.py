"""Time each Pallas stage alone (median of repeated loops) at one shape, per r.

  python benchmarks/profile_stages.py --out stages.json [--shape B,T,H,K,V] [--rs 1,2,4]
  python benchmarks/profile_stages.py --out sweep.json --launch-sweep bwd_dqkwg,bwd_wy \
      [--warps 4,8] [--num-stages 1,2,3] [--block-v 32,64] [--block-k 32,64]
  python benchmarks/profile_stages.py --out packed.json --packed 8,64 [--rs 1]

Stage times tell where the backward goes (its kernels, and the forward-stage kernels wy and
chunk_h it reruns; the fused forward's pieces: --packed, or benchmarks/sweep_fused.py).
--launch-sweep times the named backward stages instead, once per (num_warps, num_stages,
block_v, block_k) of the grid, to choose their `Launch` (the tuning table,
pallas_kernels/triton/tuning/h200.json). --packed N1,N2 times the fused forward's pieces
instead: its two kernels on the B rows (`chunk_fwd`, `chunk_state_output`), then the same tokens
as one packed row of N sequences (equal lengths when N = B, else random ones,
benchmarks/bench_varlen.py): the packing tables (`packing`,
gdp_jax/ops/gated_delta_product/triton.py), the two kernels reading the row in place, and the
whole packed forward without the non-finite guard (`forward`), beside the unpacked one.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import sys
import traceback

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from benchmarks.bench import DTYPES, command_line, make_inputs, time_jax  # noqa: E402
from gdp_jax.ops.gated_delta_product import triton as gdp_triton  # noqa: E402
from gdp_jax.ops.gated_delta_product import xla  # noqa: E402
from gdp_jax.ops.validation import normalize_mask  # noqa: E402
from pallas_kernels.common import cumsum  # noqa: E402
from pallas_kernels.common.options import DEFAULT, Launch  # noqa: E402
from pallas_kernels.triton.backward import bwd_dhu, bwd_dqkwg, bwd_dv_local, bwd_wy  # noqa: E402
from pallas_kernels.triton.forward import chunk_fwd, chunk_h, chunk_state_output, wy  # noqa: E402


def stages(inputs, r, chunk_size=64, launches=None, **overrides):
  """{stage name: (jitted fn, args)}; `launches` {backward stage: Launch} overrides the defaults."""
  launch = lambda name: dict(launch=(launches or {}).get(name, getattr(DEFAULT, name)))
  q, k, v = inputs["q"], inputs["k"], inputs["v"]
  B, T, H, K = q.shape
  mask, _ = normalize_mask(inputs["mask"], B, T, H, K)
  bt = overrides.get("bt", gdp_triton.pallas_chunk(chunk_size, r))
  cr = dict(chunk=bt, key_blocks=r)
  g = jnp.moveaxis(inputs["g"], 1, 2)
  beta = jnp.moveaxis(inputs["beta"], 1, 2)
  h0 = jnp.zeros((B, H, K, v.shape[-1]), jnp.float32)
  gcum = cumsum.chunk_local_cumsum(g, bt)
  # the chunk inverses Ai from the jnp form (the fused forward writes them in a training step)
  ai = xla.solve_tril(xla.chunk_kkt(k, beta, mask, gcum, bt), bt * r).astype(q.dtype)
  w, u = wy.recompute_w_u(k, v, beta, mask, gcum, ai, **cr)
  h, v_new, _ = chunk_h.chunk_state(k, w, u, gcum, h0, **cr)
  do = jnp.ones_like(v)
  dvl = bwd_dv_local.chunk_bwd_dv_local(q, k, gcum, do, scale=0.1, **cr)
  dh, _, dvn = bwd_dhu.chunk_bwd_dhu(q, k, w, gcum, do, dvl, h0, scale=0.1, **cr)
  dw = bwd_dqkwg.chunk_bwd_dqkwg(q, k, v_new, gcum, h, dh, do, dvn, scale=0.1, **cr)[2]
  backward = {
    "bwd_dv_local": (
      jax.jit(
        lambda *x: bwd_dv_local.chunk_bwd_dv_local(*x, scale=0.1, **cr, **launch("bwd_dv_local"))
      ),
      (q, k, gcum, do),
    ),
    "bwd_dhu": (
      jax.jit(lambda *x: bwd_dhu.chunk_bwd_dhu(*x, scale=0.1, **cr, **launch("bwd_dhu"))),
      (q, k, w, gcum, do, dvl, h0),
    ),
    "bwd_dqkwg": (
      jax.jit(lambda *x: bwd_dqkwg.chunk_bwd_dqkwg(*x, scale=0.1, **cr, **launch("bwd_dqkwg"))),
      (q, k, v_new, gcum, h, dh, do, dvn),
    ),
    "bwd_wy": (
      jax.jit(lambda *x: bwd_wy.wy_bwd(*x, **cr, **launch("bwd_wy"))),
      (k, v, beta, mask, gcum, ai, dw, dvn),
    ),
    "bwd_cumsum": (jax.jit(lambda x: cumsum.chunk_local_cumsum(x, bt, reverse=True)), (g,)),
  }
  return backward | {
    "cumsum": (jax.jit(lambda g: cumsum.chunk_local_cumsum(g, bt)), (g,)),
    "wy": (
      jax.jit(lambda k, v, b, m, gc, ai: wy.recompute_w_u(k, v, b, m, gc, ai, **cr)),
      (k, v, beta, mask, gcum, ai),
    ),
    "chunk_h": (
      jax.jit(lambda k, w, u, gc, h0: chunk_h.chunk_state(k, w, u, gc, h0, **cr)),
      (k, w, u, gcum, h0),
    ),
  }


def fused_pieces(q, k, v, g, beta, mask, h0, r, packing=None):
  """{piece: (jitted fn, args)} of the fused forward on [B, T, ...] inputs (the packed row and
  its `gdp_triton._Packing` when packing is given)."""
  bt = gdp_triton.pallas_chunk(64, r)
  cr = dict(chunk=bt, key_blocks=r)
  g_hm, beta_hm = (jnp.moveaxis(x.astype(jnp.float32), 1, 2) for x in (g, beta))
  chunk_table = {} if packing is None else dict(table=packing.chunks)
  walk_table = {} if packing is None else dict(table=packing.sequences, in_place=True)
  fwd = lambda *x: chunk_fwd.chunk_fwd(*x, **cr, **chunk_table)
  gcum, w, u = jax.jit(fwd)(k, v, g_hm, beta_hm, mask)[:3]
  so = lambda *x: chunk_state_output.chunk_state_output(*x, scale=0.1, **cr, **walk_table)
  return {
    "chunk_fwd": (jax.jit(fwd), (k, v, g_hm, beta_hm, mask)),
    "chunk_state_output": (jax.jit(so), (q, k, w, u, gcum, h0)),
  }


def packed_stages(inputs, r, num_seqs):
  """{stage: (jitted fn, args)}: the fused forward's pieces unpacked, then packed in num_seqs
  sequences (module docstring)."""
  from benchmarks.bench_varlen import random_lengths
  from gdp_jax import gated_delta_product

  q, k, v, g, beta = (inputs[n] for n in ("q", "k", "v", "g", "beta"))
  B, T, H, K = q.shape
  V = v.shape[-1]
  mask, _ = normalize_mask(inputs["mask"], B, T, H, K)
  mask = mask.astype(jnp.float32)
  fns = {
    f"unpacked {name}": fn
    for name, fn in fused_pieces(
      q, k, v, g, beta, mask, jnp.zeros((B, H, K, V), jnp.float32), r
    ).items()
  }
  row = lambda x: x.reshape((1, B * T) + x.shape[2:])
  qp, kp, vp, gp, bp = (row(x) for x in (q, k, v, g, beta))
  lengths = [T] * B if num_seqs == B else random_lengths(B * T, num_seqs)
  cu = jnp.cumsum(jnp.array([0] + list(lengths), jnp.int32)).astype(jnp.int32)
  bt = gdp_triton.pallas_chunk(64, r)
  pack = jax.jit(lambda c: gdp_triton._packing(c, B * T, bt))
  packing = pack(cu)
  h0 = jnp.zeros((num_seqs, H, K, V), jnp.float32)
  pieces = fused_pieces(qp, kp, vp, gp, bp, mask, h0, r, packing)
  fns |= {"packing": (pack, (cu,))} | {f"packed {n}": fn for n, fn in pieces.items()}
  opts = DEFAULT.replace(nonfinite_guard=False)
  call = lambda cu_seqlens, *x: gated_delta_product(
    *x, mask=inputs["mask"], cu_seqlens=cu_seqlens, implementation="pallas", options=opts
  )[0]
  fns["unpacked forward"] = (
    jax.jit(lambda *x: gated_delta_product(*x, mask=inputs["mask"], options=opts)[0]),
    (q, k, v, g, beta),
  )
  fns["packed forward"] = (jax.jit(call), (cu, qp, kp, vp, gp, bp))
  return fns


def main(argv=None):
  p = argparse.ArgumentParser()
  p.add_argument("--out", required=True)
  p.add_argument("--shape", default="8,4096,16,128,128")
  p.add_argument("--rs", default="1,2,4")
  p.add_argument("--dtype", default="bf16")
  p.add_argument("--reps", type=int, default=10)
  p.add_argument("--inner", type=int, default=5)
  p.add_argument("--launch-sweep", default="", help="backward stages to sweep, comma separated")
  p.add_argument("--warps", default="4,8", help="num_warps values of the sweep")
  p.add_argument("--num-stages", default="1,2,3", help="num_stages values of the sweep")
  p.add_argument("--block-v", default="", help="block_v values of the sweep (default: the stage's)")
  p.add_argument("--block-k", default="", help="block_k values of the sweep (default: the stage's)")
  p.add_argument("--packed", default="", help="sequence counts: time the packed forward's pieces")
  args = p.parse_args(argv)
  B, T, H, K, V = (int(x) for x in args.shape.split(","))
  res = dict(
    date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    jax=jax.__version__,
    device=jax.devices()[0].device_kind,
    command=command_line(),
    shape=args.shape,
    dtype=args.dtype,
    stages=[],
  )
  if args.launch_sweep:
    return launch_sweep(args, res, (B, T, H, K, V))
  runs = [(r, n) for r in (int(x) for x in args.rs.split(",")) for n in args.packed.split(",")]
  for r, packed in runs:
    inputs = make_inputs(B, T, H, K, V, r, DTYPES[args.dtype])
    try:
      fns = packed_stages(inputs, r, int(packed)) if packed else stages(inputs, r)
    except Exception as e:
      res["stages"].append(
        dict(r=r, error=f"{type(e).__name__}: {e}"[:3000], traceback=traceback.format_exc()[-4000:])
      )
      print(f"r={r} setup ERROR {type(e).__name__}: {str(e)[:1500]}", flush=True)
      continue
    total = 0.0
    for name, (fn, fargs) in fns.items():
      try:
        ms = time_jax(fn, fargs, args.reps, args.inner)[0]
        total += ms
        res["stages"].append(dict(r=r, stage=name, ms=ms, sequences=packed or None))
        print(f"r={r} {packed} {name:10s} {ms:8.3f} ms", flush=True)
      except Exception as e:
        res["stages"].append(dict(r=r, stage=name, error=f"{type(e).__name__}: {e}"[:3000]))
        print(f"r={r} {name:10s} ERROR {type(e).__name__}: {str(e)[:1500]}", flush=True)
    print(f"r={r} sum of stages {total:.3f} ms", flush=True)
  with open(args.out, "w") as f:
    json.dump(res, f, indent=1)


def launch_sweep(args, res, shape):
  """Each named backward stage at every (num_warps, num_stages[, block_v, block_k]); JSON
  rewritten after each."""
  values = lambda text, default: [int(x) for x in text.split(",")] if text else [default]
  for r in (int(x) for x in args.rs.split(",")):
    inputs = make_inputs(*shape, r, DTYPES[args.dtype])
    for name in args.launch_sweep.split(","):
      base = getattr(DEFAULT, name)
      grid = itertools.product(
        values(args.warps, base.num_warps),
        values(args.num_stages, base.num_stages),
        values(args.block_v, base.block_v),
        values(args.block_k, base.block_k),
      )
      for warps, num_stages, block_v, block_k in grid:
        lau = Launch(num_warps=warps, num_stages=num_stages, block_v=block_v, block_k=block_k)
        row = dict(r=r, stage=name, num_warps=warps, num_stages=num_stages)
        row.update(block_v=block_v, block_k=block_k)
        try:
          fn, fargs = stages(inputs, r, launches={name: lau})[name]
          row["ms"] = time_jax(fn, fargs, args.reps, args.inner)[0]
        except Exception as e:
          row["error"] = f"{type(e).__name__}: {e}"[:1000]
        res["stages"].append(row)
        print(json.dumps(row)[:300], flush=True)
        with open(args.out, "w") as f:
          json.dump(res, f, indent=1)


if __name__ == "__main__":
  main()
