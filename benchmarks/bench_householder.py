"""Time the Householder DeltaProduct beside flash-linear-attention's (GPU; not a test).

  python benchmarks/bench_householder.py --out householder.json [--shape 8,4096,16,128,128]
      [--nh 1,2,3] [--reps 15] [--no-fla] [--dump DIR] [--packed N] [--modes fwd,fwdbwd]
      [--no-extras]

For each n_h: ours (`gdp_jax.householder_delta_product`, implementation "pallas") and
flash-linear-attention's `chunk_gated_delta_product` on the same inputs (made in PyTorch, copied
to JAX), forward and a training step (the gradient with respect to q, k, v, g and beta of a loss
that reads o's values: benchmarks/bench.py `training_step`, `jax.value_and_grad` for ours, the
same weighting of o for flash-linear-attention's), median ms; and the relative RMS difference of
the two outputs.

Beside them, what ours should cost, measured in the same run: the r = 1 operator
`gated_delta_product` (pallas) over the T*n_h sub-steps on sub-step inputs built beforehand
(`r1_*`: the same kernels as ours, without the sub-step conversion and the output slice), the
two conversions alone (`substeps_ms`: q and g to the sub-step layout; `slice_ms`: the output of
each token's last sub-step), and once the r = 1 operator at T tokens (`r1_at_T`: the operator
benchmark's figure, for the scaling from T to T*n_h). Then ours / r1 (`gap_*`) says what the
Householder form adds to the operator it runs.

--modes: the modes timed (default both); --no-extras: no sub-step, slice and r1_at_T timings.
--no-fla: no PyTorch at all (inputs made with jax.random in the same regime), to time ours alone
in the process. --dump DIR: the GPU's optimised HLO of the forward of ours and of r1 (which
fusions and copies surround the kernels). Off a GPU the kernels are interpreted (slow): for a
smoke run only, e.g. `--shape 1,32,2,16,16 --nh 2 --reps 1 --inner 1 --no-fla`.

--packed N: the B*T tokens (and their sub-steps) in one row as N packed sequences (`cu_seqlens`;
N = B: B sequences of T tokens, else N random lengths, seed 0, from
`benchmarks/bench_varlen.random_lengths`), ours and flash-linear-attention's call with
`cu_seqlens`, forward and the training step, with the unpacked figures of ours beside them in
the same run (`unpacked_*`).

Writes JSON with the date, the jax version, the GPU name and the command (docs/performance.md),
after every figure.
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

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from benchmarks.bench import command_line, output_weights, time_jax, training_step  # noqa: E402
from benchmarks.bench_varlen import cu_of, random_lengths  # noqa: E402
from gdp_jax import gated_delta_product, householder_delta_product  # noqa: E402
from gdp_jax.ops.householder.api import to_substeps  # noqa: E402

NAMES = ("q", "k", "v", "g", "beta")


def torch_inputs(shape, nh, seed=0):
  """fla's layout in bf16 on the GPU: unit keys, beta in (0, 1), log-decays near 0."""
  import torch

  B, T, H, K, V = shape
  torch.manual_seed(seed)
  dev, bf = "cuda", torch.bfloat16
  unit = lambda *s: torch.nn.functional.normalize(torch.randn(*s, device=dev), dim=-1).to(bf)
  return dict(
    q=unit(B, T, H, K),
    k=unit(B, T * nh, H, K),
    v=torch.randn(B, T * nh, H, V, device=dev).to(bf),
    g=torch.nn.functional.logsigmoid(torch.randn(B, T, H, device=dev) + 4.0).float(),
    beta=torch.sigmoid(torch.randn(B, T * nh, H, device=dev)).to(bf),
  )


def jax_inputs(shape, nh, seed=0):
  """The same regime and dtypes as `torch_inputs`, made with jax.random (no PyTorch)."""
  B, T, H, K, V = shape
  kq, kk, kv, kg, kb = jax.random.split(jax.random.key(seed), 5)
  bf = jnp.bfloat16

  def unit(key, *s):
    x = jax.random.normal(key, s)
    return (x / jnp.linalg.norm(x, axis=-1, keepdims=True)).astype(bf)

  return [
    unit(kq, B, T, H, K),
    unit(kk, B, T * nh, H, K),
    jax.random.normal(kv, (B, T * nh, H, V)).astype(bf),
    jax.nn.log_sigmoid(jax.random.normal(kg, (B, T, H)) + 4.0),
    jax.nn.sigmoid(jax.random.normal(kb, (B, T * nh, H))).astype(bf),
  ]


def to_jax(x):
  dtype = jnp.bfloat16 if str(x.dtype) == "torch.bfloat16" else jnp.float32
  return jnp.asarray(x.detach().float().cpu().numpy()).astype(dtype)


def _timed(fwd, mode):
  """jit of fwd (the output), or of a training step: `training_step`'s loss reading o and its
  gradient in every input."""
  if mode == "fwd":
    return jax.jit(fwd)

  def step(*a):
    o_shape = jax.eval_shape(fwd, *a).shape
    return training_step(fwd, o_shape, 5)(*a)

  return jax.jit(step)


def ours(nh, mode, cu_seqlens=None, implementation="pallas"):
  def fwd(q, k, v, g, beta):
    o, _ = householder_delta_product(
      q, k, v, g, beta, num_householder=nh, cu_seqlens=cu_seqlens, implementation=implementation
    )
    return o

  return _timed(fwd, mode)


def packed_lengths(batch, t_len, count):
  """N = B: B sequences of T tokens; else `count` random lengths over the B*T tokens."""
  if count == batch:
    return [t_len] * batch
  return [int(n) for n in random_lengths(batch * t_len, count)]


def packed_inputs(inputs):
  """[B, S, ...] -> [1, B*S, ...] (every array; PyTorch or JAX)."""
  return {n: x.reshape((1, -1) + tuple(x.shape[2:])) for n, x in inputs.items()}


def r1(mode):
  """The r = 1 operator (pallas) on inputs already in its layout: q, k, v, g, beta per step."""

  def fwd(q, k, v, g, beta):
    return gated_delta_product(q, k, v, g, beta, implementation="pallas")[0]

  return _timed(fwd, mode)


def fla_time(inputs, nh, mode, reps, cu_seqlens=None):
  import torch
  import triton
  from fla.ops.gated_delta_product import chunk_gated_delta_product

  x = {n: t.detach().clone() for n, t in inputs.items()}
  kw = {}
  if cu_seqlens is not None:
    kw["cu_seqlens"] = torch.as_tensor(np.asarray(cu_seqlens), dtype=torch.long, device="cuda")
  if mode == "fwd":
    fn = lambda: chunk_gated_delta_product(**x, num_householder=nh, **kw)
  else:
    for t in x.values():
      t.requires_grad_(True)
    B, T, H = x["q"].shape[:3]
    # the same fixed weighting of o as ours (`training_step`)
    o_shape = (B, T, H, x["v"].shape[-1])
    weights = torch.as_tensor(np.asarray(output_weights(o_shape)), device="cuda")

    def fn():
      o, _ = chunk_gated_delta_product(**x, num_householder=nh, **kw)
      (o.float() * weights).sum().backward()

  fn()
  torch.cuda.synchronize()
  ms = triton.testing.do_bench(fn, warmup=50, rep=max(200, reps * 10), return_mode="median")
  return float(ms)


def packed_case(case, nh, inputs, jin, lengths, timed, args, save):
  """--packed: ours and flash-linear-attention's with cu_seqlens, ours unpacked beside them."""
  cu = cu_of(lengths)
  packed = [x.reshape((1, -1) + x.shape[2:]) for x in jin]
  o_ours = np.asarray(ours(nh, "fwd", cu, args.impl)(*packed).astype(jnp.float32))
  if inputs is not None:
    import torch
    from fla.ops.gated_delta_product import chunk_gated_delta_product

    cu_t = torch.as_tensor(cu, dtype=torch.long, device="cuda")
    o_fla, _ = chunk_gated_delta_product(
      **packed_inputs(inputs), num_householder=nh, cu_seqlens=cu_t
    )
    o_fla = o_fla.float().cpu().numpy()
    case["rel_rms_ours_vs_fla"] = float(np.sqrt(np.mean((o_ours - o_fla) ** 2) / np.mean(o_fla**2)))
  save(case)
  for mode in ("fwd", "fwdbwd"):
    timed(case, f"ours_{mode}_ms", ours(nh, mode, cu, args.impl), packed)
    timed(case, f"unpacked_{mode}_ms", ours(nh, mode, None, args.impl), jin)
  if inputs is not None:
    for mode in ("fwd", "fwdbwd"):
      case[f"fla_{mode}_ms"] = fla_time(packed_inputs(inputs), nh, mode, args.reps, cu)
      case[f"ratio_{mode}"] = case[f"ours_{mode}_ms"] / case[f"fla_{mode}_ms"]
      save(case)


def dump_hlo(directory, name, fn, args):
  """The backend's optimised HLO of fn(*args) (after fusion and layout assignment)."""
  os.makedirs(directory, exist_ok=True)
  with open(os.path.join(directory, f"{name}.hlo.txt"), "w") as f:
    f.write(fn.lower(*args).compile().as_text())


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--out", required=True)
  p.add_argument("--shape", default="8,4096,16,128,128", help="B,T,H,K,V (T tokens, T*n_h steps)")
  p.add_argument("--nh", default="1,2,3")
  p.add_argument("--reps", type=int, default=15)
  p.add_argument("--inner", type=int, default=3)
  p.add_argument("--no-fla", action="store_true", help="ours and the r = 1 operator only")
  p.add_argument("--dump", default=None, help="write the forward's optimised HLO here")
  p.add_argument("--packed", type=int, default=0, help="N packed sequences (cu_seqlens)")
  p.add_argument("--modes", default="fwd,fwdbwd", help="fwd, fwdbwd or both")
  p.add_argument("--no-extras", action="store_true", help="no sub-step, slice and r1_at_T timings")
  p.add_argument(
    "--impl",
    default="pallas",
    choices=("pallas", "mosaic_gpu", "triton"),
    help="our implementation (mosaic_gpu: the Hopper kernels, packed sequences too)",
  )
  args = p.parse_args(argv)
  modes = args.modes.split(",")
  shape = tuple(int(s) for s in args.shape.split(","))
  B, T, H, K, V = shape
  if not args.no_fla:
    import fla.ops.common.chunk_o as fla_chunk_o

    # flash-linear-attention 0.6.0 refuses its gated backward on Hopper with triton < 3.7.1; for
    # timing only we let it run (docs/performance.md#peers-for-side-by-side-timing).
    fla_chunk_o.TRITON_ABOVE_3_7_1 = True
  result = dict(
    what=f"householder_delta_product ({args.impl}) vs flash-linear-attention "
    "chunk_gated_delta_product",
    date=datetime.date.today().isoformat(),
    jax=jax.__version__,
    device=jax.devices()[0].device_kind,
    command=command_line(),
    shape=dict(zip("BTHKV", shape)),
    dtype="bfloat16",
    expected="r1_*: the r = 1 operator (pallas) over the T*n_h sub-steps, inputs prepared",
    runs=[],  # not "cases": that key marks `python -m benchmarks.bench` files
  )
  if args.packed:
    lengths = packed_lengths(B, T, args.packed)
    result["packed_lengths"] = lengths

  def save(case):  # after every figure: a run cut short keeps what it measured
    print(json.dumps({k: v for k, v in case.items() if k != "all_ms"}), flush=True)
    with open(args.out, "w") as f:
      json.dump(result, f, indent=1)

  def timed(case, key, fn, fn_args):
    ms, times = time_jax(fn, fn_args, args.reps, args.inner)
    case[key] = ms
    case.setdefault("all_ms", {})[key] = times
    save(case)
    return ms

  for nh in (int(n) for n in args.nh.split(",")):
    case = dict(num_householder=nh)
    result["runs"].append(case)
    inputs = None
    if args.no_fla:
      jin = jax_inputs(shape, nh)
    else:
      inputs = torch_inputs(shape, nh)
      jin = [to_jax(inputs[n]) for n in NAMES]
    if args.packed:
      packed_case(case, nh, inputs, jin, lengths, timed, args, save)
      continue
    q, k, v, g, beta = jin
    q_sub, g_sub = jax.block_until_ready(jax.jit(to_substeps, static_argnums=2)(q, g, nh))
    sub = [q_sub, k, v, g_sub, beta]  # the r = 1 operator's inputs over the T*n_h sub-steps
    o_ours = np.asarray(ours(nh, "fwd", None, args.impl)(*jin).astype(jnp.float32))
    o_r1 = r1("fwd")(*sub)
    o_last = np.asarray(o_r1.reshape(B, T, nh, H, V)[:, :, -1].astype(jnp.float32))
    case["rel_rms_ours_vs_r1"] = float(
      np.sqrt(np.mean((o_ours - o_last) ** 2) / np.mean(o_last**2))
    )
    if not args.no_fla:
      try:
        import torch
        from fla.ops.gated_delta_product import chunk_gated_delta_product

        o_fla, _ = chunk_gated_delta_product(**inputs, num_householder=nh)
        o_fla = o_fla.float().cpu().numpy()
        case["rel_rms_ours_vs_fla"] = float(
          np.sqrt(np.mean((o_ours - o_fla) ** 2) / np.mean(o_fla**2))
        )
        del o_fla
        torch.cuda.empty_cache()
      except Exception as e:  # keep timing the rest
        case["check_error"] = repr(e)[:300]
    del o_ours, o_last
    save(case)
    if args.dump:
      dump_hlo(args.dump, f"ours_fwd_nh{nh}", ours(nh, "fwd", None, args.impl), jin)
      dump_hlo(args.dump, f"r1_fwd_nh{nh}", r1("fwd"), sub)
    # JAX figures first (nothing of PyTorch's runs between them), then flash-linear-attention's
    for mode in modes:
      timed(case, f"ours_{mode}_ms", ours(nh, mode, None, args.impl), jin)
      timed(case, f"r1_{mode}_ms", r1(mode), sub)
      case[f"gap_{mode}"] = case[f"ours_{mode}_ms"] / case[f"r1_{mode}_ms"]
    if not args.no_fla:
      for mode in modes:
        case[f"fla_{mode}_ms"] = fla_time(inputs, nh, mode, args.reps)
        case[f"ratio_{mode}"] = case[f"ours_{mode}_ms"] / case[f"fla_{mode}_ms"]
        save(case)
    if args.no_extras:
      continue
    to_sub = jax.jit(lambda q, g: to_substeps(q, g, nh))
    timed(case, "substeps_ms", to_sub, (q, g))
    last = jax.jit(lambda o: o.reshape(B, T, nh, H, V)[:, :, -1])
    timed(case, "slice_ms", last, (o_r1,))
    del o_r1
    if "r1_at_T" not in result:  # the operator at T tokens (the operator benchmark's figure)
      at_t = dict(tokens=T)
      result["r1_at_T"] = at_t
      first = [q, k[:, :T], v[:, :T], g, beta[:, :T]]
      for mode in modes:
        timed(at_t, f"{mode}_ms", r1(mode), first)
  return 0


if __name__ == "__main__":
  sys.exit(main())
