"""Sweep the fused forward kernels' chunk and launch parameters (GPU tuning; not a test).

  python benchmarks/sweep_fused.py --out sweep_fused.json [--rs 1,2,4] [--chunks 16,32,64]
  python benchmarks/sweep_fused.py --tiny --out /tmp/sweep.json      # smoke run, any machine

For each r and chunk (N = chunk * r rows <= --max-rows) it times, as median ms of repeated loops:
  chunk_fwd            alone, for each (inverse, num_warps, num_stages) of the grid
                       (save_ai=False), and the best of them again with save_ai=True (what a
                       training step runs);
  chunk_state_output   alone, for each (block_v, num_warps, num_stages) of the grid;
  forward              the whole forward (the triton implementation's forward at this chunk, both
                       kernels at their best parameters) and its relative error against the
                       chunked jnp form.
It prints one line per case and rewrites the JSON (--out) after each, with the date, the jax
version, the GPU name and the command, so an interrupted sweep keeps what it measured. The
launches chosen go to the tuning table (pallas_kernels/triton/tuning/h200.json, docs/kernels.md).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import sys
import traceback

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from benchmarks.bench import DTYPES, make_inputs, time_jax  # noqa: E402
from gdp_jax.ops.gated_delta_product import triton as gdp_triton  # noqa: E402
from gdp_jax.ops.gated_delta_product import xla  # noqa: E402
from gdp_jax.ops.validation import normalize_mask  # noqa: E402
from pallas_kernels.common.options import DEFAULT, Launch  # noqa: E402
from pallas_kernels.triton.forward import chunk_fwd, chunk_state_output  # noqa: E402
from tests.cases import rel_err  # noqa: E402

TINY = dict(
  shape="1,32,2,64,32",
  rs="1,2",
  chunks="16",
  fwd_warps="4",
  inverses="substitution,squaring-x3",
  fwd_stages="1",
  block_v="32",
  so_warps="4",
  so_stages="2",
  reps=1,
  inner=1,
)


def whole_forward(*arrays, scale, bt, opts):
  """the triton implementation's forward without gradient (no Ai written) at chunk bt: the
  output."""
  return gdp_triton._forward(*arrays, None, scale, bt, opts, False)[0]


def kernel_args(params):
  """A sweep point {inverse, num_warps, num_stages} as chunk_fwd's keyword arguments."""
  return dict(
    inverse=params["inverse"],
    launch=Launch(num_warps=params["num_warps"], num_stages=params["num_stages"]),
  )


def ints(text):
  return [int(x) for x in text.split(",") if x]


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--out", required=True, help="JSON file written after every case")
  p.add_argument("--shape", default="8,4096,16,128,128", help="B,T,H,K,V")
  p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
  p.add_argument("--rs", default="1,2,4")
  p.add_argument("--chunks", default="16,32,64", help="tokens per chunk to try for each r")
  p.add_argument("--max-rows", type=int, default=128, help="skip chunk * r above this")
  p.add_argument(
    "--inverses",
    default="substitution,squaring-x3,squaring-tf32",
    help="chunk_fwd diagonal-inverse variants",
  )
  p.add_argument("--fwd-warps", default="1,2,4,8")
  p.add_argument("--fwd-stages", default="1,2")
  p.add_argument("--block-v", default="32,64,128")
  p.add_argument("--so-warps", default="4,8")
  p.add_argument("--so-stages", default="1,2,3")
  p.add_argument("--reps", type=int, default=7)
  p.add_argument("--inner", type=int, default=5)
  p.add_argument("--no-check", action="store_true", help="skip the error against jnp")
  p.add_argument(
    "--tiny",
    action="store_true",
    help="a small shape, one variant each, one rep (a smoke test; interpret mode on CPU)",
  )
  args = p.parse_args(argv)
  if args.tiny:  # the tiny values become the defaults; flags given still win
    p.set_defaults(**TINY)
    args = p.parse_args(argv)
  B, T, H, K, V = ints(args.shape)
  dtype = DTYPES[args.dtype]
  dev = jax.devices()[0]
  record = dict(
    date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    jax=jax.__version__,
    device=getattr(dev, "device_kind", str(dev)),
    platform=dev.platform,
    command=" ".join([os.path.basename(sys.executable)] + sys.argv),
    shape=args.shape,
    dtype=args.dtype,
    results=[],
  )

  def save():
    with open(args.out, "w") as f:
      json.dump(record, f, indent=1)

  def case(rec, fn, fargs):
    try:
      rec["ms"] = time_jax(fn, fargs, args.reps, args.inner)[0]
    except Exception as e:  # noqa: BLE001  (a variant that does not compile is a result too)
      rec["error"] = f"{type(e).__name__}: {e}"[:2000]
      rec["traceback"] = traceback.format_exc()[-4000:]
    shown = {k: v for k, v in rec.items() if k not in ("error", "traceback")}
    tail = f"ERROR {rec['error'][:300]}" if "error" in rec else ""
    print(
      " ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in shown.items()),
      tail,
      flush=True,
    )
    record["results"].append(rec)
    save()
    return rec.get("ms", float("inf"))

  scale = K**-0.5
  for r in ints(args.rs):
    inputs = make_inputs(B, T, H, K, V, r, dtype)
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    mask, _ = normalize_mask(inputs["mask"], B, T, H, K)
    g = jnp.moveaxis(inputs["g"], 1, 2)
    beta = jnp.moveaxis(inputs["beta"], 1, 2)
    h0 = jnp.zeros((B, H, K, V), jnp.float32)
    o_ref = None
    if not args.no_check:
      o_ref, _ = jax.jit(xla.gated_delta_product_xla, static_argnums=(7, 8))(
        q, k, v, inputs["g"], inputs["beta"], mask, h0, scale, 64 if T % 64 == 0 else 16
      )
    for chunk in ints(args.chunks):
      if chunk * r > args.max_rows or chunk * r > chunk_fwd.MAX_ROWS or T % chunk:
        continue
      base = dict(r=r, chunk=chunk)
      fwd_best, fwd_ms = None, float("inf")
      for inverse in args.inverses.split(","):
        for nw in ints(args.fwd_warps):
          for ns in ints(args.fwd_stages):
            params = dict(inverse=inverse, num_warps=nw, num_stages=ns)
            fn = jax.jit(
              functools.partial(
                chunk_fwd.chunk_fwd, key_blocks=r, chunk=chunk, **kernel_args(params)
              )
            )
            ms = case(dict(base, kernel="chunk_fwd", **params), fn, (k, v, g, beta, mask))
            if ms < fwd_ms:
              fwd_best, fwd_ms = params, ms
      if fwd_best is None:
        continue
      fwd = functools.partial(
        chunk_fwd.chunk_fwd, key_blocks=r, chunk=chunk, **kernel_args(fwd_best)
      )
      case(
        dict(base, kernel="chunk_fwd+ai", **fwd_best),
        jax.jit(functools.partial(fwd, save_ai=True)),
        (k, v, g, beta, mask),
      )
      gamma, w, u = jax.jit(fwd)(k, v, g, beta, mask)
      so_best, so_ms = None, float("inf")
      for bv in ints(args.block_v):
        if bv > V:
          continue
        for nw in ints(args.so_warps):
          for ns in ints(args.so_stages):
            params = dict(block_v=bv, num_warps=nw, num_stages=ns)
            fn = jax.jit(
              functools.partial(
                chunk_state_output.chunk_state_output,
                key_blocks=r,
                chunk=chunk,
                scale=scale,
                launch=Launch(**params),
              )
            )
            ms = case(
              dict(base, kernel="chunk_state_output", **params), fn, (q, k, w, u, gamma, h0)
            )
            if ms < so_ms:
              so_best, so_ms = params, ms
      if so_best is None:
        continue
      best = DEFAULT.replace(
        chunk_fwd=Launch(num_warps=fwd_best["num_warps"], num_stages=fwd_best["num_stages"]),
        chunk_fwd_inverse=fwd_best["inverse"],
        chunk_state_output=Launch(**so_best),
      )
      fn = jax.jit(functools.partial(whole_forward, scale=scale, bt=chunk, opts=best))
      fargs = (q, k, v, inputs["g"], inputs["beta"], mask, h0)
      rec = dict(base, kernel="forward", chunk_fwd=fwd_best, chunk_state_output=so_best)
      if o_ref is not None:
        try:
          rec["rel_err"] = rel_err(fn(*fargs), o_ref)
        except Exception as e:  # noqa: BLE001  (case() below records the error)
          print(f"no error check: {type(e).__name__}", flush=True)
      case(rec, fn, fargs)
  save()
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
