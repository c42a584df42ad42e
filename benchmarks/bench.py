"""`python -m benchmarks.bench` (from the repository root): time `gated_delta_product` forward
and forward + backward, side by side with other implementations, and report milliseconds,
TFLOP/s and GB/s.

  python -m benchmarks.bench                   # the H200 shape on a GPU, a small one on CPU
  python -m benchmarks.bench --tiny            # a smoke run (seconds, any machine)
  python -m benchmarks.bench --shape 8,4096,16,128,128 --rs 1,2,4 --dtype bf16 \
      --impls pallas,xla,fla,jla --out bench.json

Several devices (`--devices N`): ours timed on one device and sharded over N devices
(`gdp_jax.sharding`): batch / head parallel (N = nb x nh devices, nb dividing B and nh dividing
H, as many on the batch as divide it) and context parallel (the sequence in N pieces); the impl
column reads e.g. `pallas bh2x4` or `pallas cp8`. Off a GPU the N devices are simulated CPU
devices (set up before jax starts; the figures then say nothing about speed). TFLOP/s and GB/s
count the whole problem (all devices together); the forward output is compared with the
one-device output of the same implementation (and with xla's when xla runs).

  python -m benchmarks.bench --devices 8 --shape 8,4096,16,128,128 --rs 1 --impls pallas

Implementations (`--impls`, comma separated; default `auto`):
  pallas     ours, the Pallas kernels the device prefers (compiled on GPU; interpreted on CPU,
             slowly): "mosaic_gpu" on Hopper, else "triton"
  mosaic_gpu ours, the Mosaic GPU kernels for Hopper, forward and backward
             (docs/implementations.md#mosaic-gpu)
  triton     ours, the Pallas kernels through the Triton lowering, forward and backward
  xla        ours, the chunked form in jnp
  reference  ours, the token-by-token recurrence (a `lax.scan`); forward + backward only where
             the scan's saved states fit (`--reference-max-gb`)
  fla        flash-linear-attention's `chunk_gated_delta_rule` (PyTorch + Triton, CUDA only;
             the same math as r = 1), when importable
  jla        jax-linear-attention's Gated DeltaNet (`impl="mosaic_gpu"` on GPU, its chunked jnp
             form elsewhere; r = 1), when importable
`auto` is pallas, mosaic_gpu, triton, xla, reference, fla, jla on a GPU and xla, reference, jla
elsewhere. A peer that is not installed, or a case it does not cover (r > 1), is recorded as
"skipped" with the reason; a case that fails records its error and the run goes on.

Timing: per case, the jitted function is compiled and run twice, then `--reps` timed runs of
`--inner` back-to-back calls each; the figure is the median over the runs of the time per call.

What the figures count (the same nominal count for every implementation, so TFLOP/s and GB/s rank
exactly like time): see `FLOPS_DOC` and `BYTES_DOC` below; both texts are also written into the
JSON.

Outputs: a table on stdout, a JSON file (`--out`) and a PNG bar chart (`--plot`, needs
matplotlib; skipped with a message when it is not installed).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

try:
  import tqdm
except ModuleNotFoundError:  # the `bench` extra: main() says what to install
  tqdm = None

from gdp_jax.testing import SHAPES, random_inputs

SCHEMA = "gdp_jax.bench/1"
DTYPES = {"bf16": jnp.bfloat16, "f16": jnp.float16, "f32": jnp.float32}
MODES = ("fwd", "fwdbwd")
ALL_IMPLS = ("pallas", "mosaic_gpu", "triton", "xla", "reference", "fla", "jla")
OURS = ("pallas", "mosaic_gpu", "triton", "xla", "reference")
GPU_SHAPE = ",".join(map(str, SHAPES["h200"]))  # the H200 benchmark shape (docs/performance.md)
CPU_SHAPE = ",".join(map(str, SHAPES["cpu"]))  # default when no GPU: seconds, not hours
TINY_SHAPE = ",".join(map(str, SHAPES["tiny"]))
FLOP_ROWS = 64  # rows per chunk (C * r) in the nominal FLOP count

FLOPS_DOC = (
  "Nominal matmul FLOPs of the chunked (WY) form (docs/chunked_form.md), the same for every "
  "implementation. Chunks of C = max(16, 64 // r) tokens (N = C*r = 64 rows for r <= 4, as "
  "the Pallas kernels use), dk = K / r, per chunk and (batch, head): "
  "KKT 2*N*N*dk + triangular inverse N^3/3 + w and u 2*N*N*(K + V) "
  "+ state 2*N*K*V + 2*N*dk*V + output 2*C*K*V + 2*C*C*K + 2*C*N*V; "
  "times B * H * ceil(T / C). Forward + backward counts 3x the forward (the usual "
  "backward = 2x forward convention)."
)
BYTES_DOC = (
  "Minimal memory traffic: every input read once and every output written once, at the "
  "arrays' own dtypes. Forward: q, k, v, g, beta, mask read, o written. Forward + backward: "
  "those inputs and the cotangent do read, and one gradient per input written (o and the "
  "state are not counted)."
)


# ----------------------------------------------------------------------------------------------
# Counts
# ----------------------------------------------------------------------------------------------


def flop_chunk(r: int) -> int:
  """Tokens per chunk in the nominal FLOP count: 64 rows, at least 16 tokens."""
  return max(16, FLOP_ROWS // r)


def forward_flops(B: int, T: int, H: int, K: int, V: int, r: int) -> float:
  """The nominal forward FLOP count (FLOPS_DOC)."""
  c = flop_chunk(r)
  n = c * r
  dk = K / r
  per_chunk = (
    2 * n * n * dk  # KKT
    + n**3 / 3  # unit lower-triangular inverse
    + 2 * n * n * (K + V)  # w = Aw W~, u = Au U~
    + 2 * n * K * V
    + 2 * n * dk * V  # v_new = u - w S0; state update
    + 2 * c * K * V
    + 2 * c * c * K
    + 2 * c * n * V
  )  # output
  return float(per_chunk * B * H * math.ceil(T / c))


def flops(mode: str, B, T, H, K, V, r) -> float:
  fwd = forward_flops(B, T, H, K, V, r)
  return fwd if mode == "fwd" else 3 * fwd


def traffic_bytes(
  mode: str, B, T, H, K, V, r, dtype, gate_dtype=jnp.float32, mask_dtype=jnp.float32
) -> float:
  """Minimal bytes moved (BYTES_DOC). The mask is [r, r] (none for r = 1)."""
  item = jnp.dtype(dtype).itemsize
  gate = jnp.dtype(gate_dtype).itemsize
  inputs = (2 * B * T * H * K + B * T * H * V) * item + 2 * B * T * H * gate
  if r > 1:
    inputs += r * r * jnp.dtype(mask_dtype).itemsize
  out = B * T * H * V * item
  if mode == "fwd":
    return float(inputs + out)
  return float(2 * inputs + out)  # inputs + do read, gradients written


# ----------------------------------------------------------------------------------------------
# Inputs and implementations
# ----------------------------------------------------------------------------------------------


def make_inputs(B, T, H, K, V, r, dtype, seed=0):
  """Operator inputs for a bench case (gdp_jax/testing.py's regime): a shared [r, r] mask (none
  for r = 1), no initial state."""
  return random_inputs(
    seed,
    B=B,
    T=T,
    H=H,
    K=K,
    V=V,
    r=r,
    dtype=dtype,
    mask_kind=None if r == 1 else "shared",
    with_state=False,
  )


def time_jax(fn, args, reps, inner, tick=None):
  """Median ms per call of fn(*args) over `reps` runs of `inner` calls, after compile + warm-up."""
  jax.block_until_ready(fn(*args))
  for _ in range(2):
    jax.block_until_ready(fn(*args))
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    for _ in range(inner):
      out = fn(*args)
    jax.block_until_ready(out)
    times.append((time.perf_counter() - t0) / inner * 1e3)
    if tick:
      tick()
  return statistics.median(times), times


def ours(impl, mode, inputs, sharding=None):
  """(jitted fn, args) for gated_delta_product: the output, or every input's gradient; with a
  `gdp_jax.sharding.ShardingConfig`, the sharded operator on inputs placed on its mesh."""
  from gdp_jax.sharding import sharded_gated_delta_product

  names = ("q", "k", "v", "g", "beta", "mask")
  present = tuple(n for n in names if inputs[n] is not None)
  args = tuple(inputs[n] for n in present)
  if sharding is not None:
    placed = sharding.put(**dict(zip(present, args)))
    args = tuple(placed[n] for n in present)

  def fwd(*a):
    o, _ = sharded_gated_delta_product(
      **dict(zip(present, a)), implementation=impl, sharding=sharding
    )
    return o

  if mode == "fwd":
    return jax.jit(fwd), args
  return jax.jit(training_step(fwd, args[present.index("v")].shape, len(present))), args


def output_weights(shape):
  """The fixed random weighting of o that a training step's loss reads (float32)."""
  return jax.random.normal(jax.random.key(7), shape, jnp.float32)


def training_step(fwd, o_shape, num_args):
  """`jax.value_and_grad` of a loss that reads o's values (a fixed random weighting of o), as a
  training step runs: with `jax.grad` of `sum(o)` the loss is unused and XLA may drop a peer's
  output kernel. Every implementation and peer is timed this way."""
  weights = output_weights(o_shape)
  loss = lambda *a: jnp.sum(fwd(*a).astype(jnp.float32) * weights)
  return jax.value_and_grad(loss, argnums=tuple(range(num_args)))


def reference_fits(mode, B, T, H, K, V, max_gb):
  """The scan's backward keeps every step's state: B*T*H*K*V float32."""
  return mode == "fwd" or B * T * H * K * V * 4 <= max_gb * 1e9


def fla_case(mode, shape, dtype, reps, tick=None, cu_seqlens=None):
  """flash-linear-attention 0.6.0's chunk_gated_delta_rule (r = 1), timed with triton's do_bench.

  cu_seqlens: None, or the [N + 1] offsets of N sequences packed in one row (B = 1), passed to
  fla as its `cu_seqlens` (benchmarks/bench_varlen.py)."""
  import torch

  if not torch.cuda.is_available():
    raise _Skip("flash-linear-attention needs CUDA (PyTorch sees no GPU)")
  import fla.ops.common.chunk_o as fla_chunk_o
  import triton
  from fla.ops.gated_delta_rule import chunk_gated_delta_rule

  # flash-linear-attention 0.6.0 refuses its gated backward on Hopper with triton < 3.7.1 (a
  # compiler bug); for timing only (never as a reference) we let it run
  # (docs/performance.md#peers-for-side-by-side-timing).
  fla_chunk_o.TRITON_ABOVE_3_7_1 = True
  B, T, H, K, V = shape
  tdt = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[
    jnp.dtype(dtype).name
  ]
  dev = "cuda"
  torch.manual_seed(0)
  q = torch.nn.functional.normalize(torch.randn(B, T, H, K, device=dev), dim=-1).to(tdt)
  k = torch.nn.functional.normalize(torch.randn(B, T, H, K, device=dev), dim=-1).to(tdt)
  v = torch.randn(B, T, H, V, device=dev).to(tdt)
  g = torch.nn.functional.logsigmoid(torch.randn(B, T, H, device=dev) + 4.0).float()
  beta = torch.sigmoid(torch.randn(B, T, H, device=dev)).to(tdt)
  extra = {}
  if cu_seqlens is not None:
    extra["cu_seqlens"] = torch.as_tensor(
      [int(c) for c in cu_seqlens], dtype=torch.long, device=dev
    )
  if mode == "fwd":
    fn = lambda: chunk_gated_delta_rule(q, k, v, g, beta, **extra)
  else:
    for x in (q, k, v, g, beta):
      x.requires_grad_(True)
    # the same fixed random weighting of o as the JAX cases' loss (`training_step`)
    weights = torch.as_tensor(np.asarray(output_weights((B, T, H, V))), device=dev)

    def fn():
      o, _ = chunk_gated_delta_rule(q, k, v, g, beta, **extra)
      loss = (o.float() * weights).sum()
      loss.backward()
      return loss

  fn()
  torch.cuda.synchronize()
  ms = triton.testing.do_bench(fn, warmup=50, rep=max(200, reps * 10), return_mode="median")
  if tick:
    tick(reps)
  return float(ms), None


def jla_case(mode, inputs, reps, inner, tick=None):
  """jax-linear-attention's Gated DeltaNet (r = 1): Mosaic GPU kernels on a GPU, else chunked."""
  import jla.ops

  impl = "mosaic_gpu" if jax.default_backend() == "gpu" else "chunked"
  args = (
    inputs["q"],
    inputs["k"],
    inputs["v"],
    inputs["g"],
    inputs["beta"].astype(inputs["q"].dtype),
  )

  def fwd(q, k, v, g, beta):
    out = jla.ops.linear_attention("gated_deltanet", q, k, v, g=g, beta=beta, impl=impl)
    return out[0] if isinstance(out, tuple) else out

  if mode == "fwd":
    fn = jax.jit(fwd)
  else:
    fn = jax.jit(training_step(fwd, inputs["v"].shape, len(args)))
  ms, all_ms = time_jax(fn, args, reps, inner, tick)
  return ms, all_ms, impl


class _Skip(Exception):
  """A case that does not apply here (peer not installed, r > 1 for an r = 1 peer, ...)."""


# ----------------------------------------------------------------------------------------------
# Table
# ----------------------------------------------------------------------------------------------


def case_label(c):
  return (
    f"{c['mode']:6s} B={c['B']} T={c['T']} H={c['H']} K={c['K']} V={c['V']} r={c['r']} "
    f"{c['dtype']:8s} {c['impl']}"
  )


def format_table(cases):
  """The results as a fixed-width text table."""
  head = (
    f"{'mode':6s} {'B':>3s} {'T':>6s} {'H':>3s} {'K':>4s} {'V':>4s} {'r':>2s} "
    f"{'dtype':8s} {'impl':13s} {'ms':>10s} {'TFLOP/s':>8s} {'GB/s':>8s}  note"
  )
  lines = [head, "-" * len(head)]
  for c in cases:
    left = (
      f"{c['mode']:6s} {c['B']:3d} {c['T']:6d} {c['H']:3d} {c['K']:4d} {c['V']:4d} "
      f"{c['r']:2d} {c['dtype']:8s} {c['impl']:13s}"
    )
    if c["status"] == "ok":
      note = c.get("peer_impl", "")
      if "max_abs_diff_vs_xla" in c:
        note = f"|o - xla| {c['max_abs_diff_vs_xla']:.1e}"
      if "max_abs_diff_vs_one_device" in c:
        note += f"{'; ' if note else ''}|o - 1 device| {c['max_abs_diff_vs_one_device']:.1e}"
      lines.append(f"{left} {c['ms']:10.3f} {c['tflops']:8.2f} {c['gbps']:8.1f}  {note}")
    else:
      why = c.get("reason") or c.get("error", "")
      lines.append(f"{left} {'-':>10s} {'-':>8s} {'-':>8s}  {c['status']}: {why[:90]}")
  return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# Plot
# ----------------------------------------------------------------------------------------------


def plot(results, path):
  """A bar chart of ms per case (one panel per mode); returns the path, or None without
  matplotlib."""
  try:
    import matplotlib  # noqa: F401
  except ImportError:
    print("plot skipped: matplotlib is not installed (pip install matplotlib)")
    return None
  fig = plot_figure(results)  # a bare Figure: no pyplot, no change of backend
  fig.savefig(path, dpi=120, bbox_inches="tight")
  return path


def plot_figure(results, plt=None, title=None):
  """The bench figure for a results dict (also used by notebooks/04_benchmarks.ipynb).

  With `plt` (matplotlib.pyplot) the figure is made by pyplot (shown inline in a notebook);
  without, it is a bare matplotlib Figure (for saving).
  """
  cases = [c for c in normalize_cases(results) if c.get("status", "ok") == "ok" and "ms" in c]
  modes = [m for m in MODES if any(c["mode"] == m for c in cases)] or ["fwd"]
  size = (6 * len(modes), 4)
  if plt is None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=size)
    axes = fig.subplots(1, len(modes), squeeze=False)
  else:
    fig, axes = plt.subplots(1, len(modes), figsize=size, squeeze=False)
  impls = [i for i in ALL_IMPLS if any(c["impl"] == i for c in cases)]
  impls += sorted({c["impl"] for c in cases} - set(impls))
  colors = {impl: f"C{i}" for i, impl in enumerate(impls)}
  labelled = set()
  for ax, mode in zip(axes[0], modes):
    groups = []
    for c in cases:
      key = (c["B"], c["T"], c["H"], c["K"], c["V"], c["r"], c["dtype"])
      if c["mode"] == mode and key not in groups:
        groups.append(key)
    for i, key in enumerate(groups):
      here = [
        c
        for impl in impls
        for c in cases
        if c["mode"] == mode
        and c["impl"] == impl
        and (c["B"], c["T"], c["H"], c["K"], c["V"], c["r"], c["dtype"]) == key
      ]
      width = 0.8 / max(3, len(here))
      for j, c in enumerate(here):
        x = i + (j - (len(here) - 1) / 2) * width
        bars = ax.bar(
          [x],
          [c["ms"]],
          width,
          color=colors[c["impl"]],
          label=c["impl"] if (mode, c["impl"]) not in labelled else None,
        )
        labelled.add((mode, c["impl"]))
        ax.bar_label(bars, labels=[f"{c['ms']:.3g}"], fontsize=7)
    ax.set_xlim(-0.6, len(groups) - 0.4)
    ax.set_xticks(range(len(groups)))
    multi_shape = len({k[:5] for k in groups}) > 1
    ax.set_xticklabels(
      [
        (f"{k[0]}x{k[1]}x{k[2]}x{k[3]}x{k[4]}\n" if multi_shape else "") + f"r={k[5]} {k[6]}"
        for k in groups
      ],
      fontsize=8,
    )
    ax.set_ylabel("ms (median, lower is better)")
    ax.set_yscale("log")
    _plain_log_ticks(ax)
    ax.set_title({"fwd": "forward", "fwdbwd": "training step (value_and_grad)"}[mode])
    ax.legend(fontsize=8)
  if title is None:
    shape = results.get("shape") or {}
    device = results.get("device_kind") or results.get("device", "?")
    title = f"gated_delta_product on {device}"
    if shape and len({(c["B"], c["T"], c["H"], c["K"], c["V"]) for c in cases}) <= 1:
      title += " (B={B}, T={T}, H={H}, K={K}, V={V})".format(**shape)
    title += f", {results.get('date', '')[:10]}"
  fig.suptitle(title)
  fig.tight_layout()
  return fig


def _plain_log_ticks(ax):
  """Tick labels 0.5, 1, 2 rather than 5x10^-1 on a log axis."""
  from matplotlib.ticker import FuncFormatter

  fmt = FuncFormatter(lambda y, _: f"{y:g}")
  ax.yaxis.set_major_formatter(fmt)
  ax.yaxis.set_minor_formatter(fmt)
  ax.tick_params(axis="y", which="minor", labelsize=7)


def normalize_cases(results):
  """Cases with full fields (shape, dtype, status, counts), also for the older bench_operator
  JSON format (one shape and dtype at the top level, no counts)."""
  out = []
  top = results.get("shape") or {}
  top_dtype = results.get("dtype", "bf16")
  for c in results.get("cases", []):
    c = dict(c)
    for key in ("B", "T", "H", "K", "V"):
      c.setdefault(key, top.get(key))
    dt = c.get("dtype", top_dtype)
    c["dtype"] = jnp.dtype(DTYPES.get(dt, dt)).name
    c.setdefault("status", "ok" if "ms" in c else "error")
    if c["status"] == "ok" and "tflops" not in c:
      dims = (c["B"], c["T"], c["H"], c["K"], c["V"], c["r"])
      c["flops"] = flops(c["mode"], *dims)
      c["bytes"] = traffic_bytes(c["mode"], *dims, c["dtype"])
      c["tflops"] = c["flops"] / (c["ms"] * 1e-3) / 1e12
      c["gbps"] = c["bytes"] / (c["ms"] * 1e-3) / 1e9
    out.append(c)
  return out


# ----------------------------------------------------------------------------------------------
# The run
# ----------------------------------------------------------------------------------------------


def record_diffs(outs):
  """max |o - o_xla| into each forward case of ours once the xla output is there."""
  if "xla" not in outs:
    return
  ref = outs["xla"][1].astype(jnp.float32)
  for impl, (case, out) in outs.items():
    if impl != "xla" and "max_abs_diff_vs_xla" not in case:
      case["max_abs_diff_vs_xla"] = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref)))


def parse_shapes(specs):
  shapes = []
  for spec in specs:
    for one in spec.replace(";", " ").split():
      dims = tuple(int(x) for x in one.split(","))
      if len(dims) != 5 or min(dims) < 1:
        raise SystemExit(f"--shape wants B,T,H,K,V (five positive integers), got {one!r}")
      shapes.append(dims)
  return shapes


def simulate_cpu_devices(n):
  """Ask for n CPU devices (jax's own setting; read when the CPU backend starts, so before
  anything touches a device). A GPU machine keeps its GPUs as the default devices."""
  try:
    jax.config.update("jax_num_cpu_devices", max(n, 1))
  except Exception:  # the backend already started (e.g. bench called from a live session)
    pass


def sharded_layout(layout, n, shape):
  """(ShardingConfig or None, label, reason when None) for `layout` over the first n devices.

  "batch-head": n = nb x nh devices with nb dividing B and nh dividing H, the most on the batch;
  "context": the sequence over n devices (n must divide T)."""
  from gdp_jax.sharding import ShardingConfig

  B, T, H, _, _ = shape
  devices = jax.devices()[:n]
  AUTO = jax.sharding.AxisType.Auto
  if layout == "batch-head":
    splits = [
      (nb, n // nb) for nb in range(n, 0, -1) if n % nb == 0 and B % nb == 0 and H % (n // nb) == 0
    ]
    if not splits:
      return None, "bh", f"B = {B} and H = {H} do not split over {n} devices"
    nb, nh = splits[0]
    label = f"bh{nb}x{nh}"
    mesh = jax.make_mesh((nb, nh), ("data", "model"), axis_types=(AUTO, AUTO), devices=devices)
    return ShardingConfig(mesh, batch="data", heads="model"), label, ""
  label = f"cp{n}"
  if T % n:
    return None, label, f"T = {T} is not divisible by {n} devices"
  mesh = jax.make_mesh((n,), ("seq",), axis_types=(AUTO,), devices=devices)
  return ShardingConfig(mesh, sequence="seq"), label, ""


def resolve_impls(spec, backend, devices=None):
  if spec == "auto":
    if devices is not None:
      return ["pallas", "xla"] if backend == "gpu" else ["xla"]
    return list(ALL_IMPLS) if backend == "gpu" else ["xla", "reference", "jla"]
  impls = [s.strip() for s in spec.split(",") if s.strip()]
  for impl in impls:
    if impl not in ALL_IMPLS:
      raise SystemExit(
        f"--impls: unknown implementation {impl!r}; choose from {', '.join(ALL_IMPLS)} or auto"
      )
  return impls


def portable_traceback(text: str) -> str:
  """A traceback without the machine's paths: `File "/x/y/site-packages/jax/..."` becomes
  `File "site-packages/jax/..."`, the standard library `File "python3.12/..."`, the repository's
  files relative to it (kept results hold no machine paths)."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
  text = text.replace(root, "")
  text = re.sub(r'File "/[^"]*?/(site-packages|dist-packages)/', r'File "\1/', text)
  return re.sub(r'File "/[^"]*?/(python3\.\d+)/', r'File "\1/', text)


def command_line():
  """The command as typed: `python -m benchmarks.bench ...` rather than the path of bench.py."""
  argv = list(sys.argv)
  # Output files by name: an absolute path names a machine, not the repository.
  argv[1:] = [os.path.basename(a) if os.path.isabs(a) else a for a in argv[1:]]
  typed = list(getattr(sys, "orig_argv", []))
  if "-m" in typed[1:-1]:  # python -m <module>: sys.argv[0] is the module's file
    return " ".join(["python", "-m", typed[typed.index("-m", 1) + 1]] + argv[1:])
  if argv and os.path.isabs(argv[0]):  # a script by its full path: relative to the repository
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if os.path.abspath(argv[0]).startswith(root + os.sep):
      argv[0] = os.path.relpath(os.path.abspath(argv[0]), root)
  return " ".join(["python"] + argv)


def add_arguments(p, out_required=False):
  p.add_argument(
    "--out",
    required=out_required,
    default=None if out_required else "bench.json",
    help="JSON file to write" + ("" if out_required else " (default: bench.json)"),
  )
  p.add_argument(
    "--plot",
    default=None,
    help="PNG file for the bar chart (default: --out with .png; needs matplotlib)",
  )
  p.add_argument("--no-plot", action="store_true", help="do not draw the PNG")
  p.add_argument(
    "--shape",
    action="append",
    default=None,
    help=f"B,T,H,K,V; repeat (or separate with ';') for several (default "
    f"{GPU_SHAPE} on a GPU, {CPU_SHAPE} elsewhere)",
  )
  p.add_argument("--rs", default="1,2,4", help="key blocks r (mask r x r), comma separated")
  p.add_argument(
    "--dtype",
    default="bf16",
    help=f"dtype of q, k, v: {', '.join(DTYPES)}; comma separated for several",
  )
  p.add_argument(
    "--modes",
    default="fwd,fwdbwd",
    help="fwd, fwdbwd (a training step: value_and_grad of a loss reading o)",
  )
  p.add_argument(
    "--impls",
    default="auto",
    help=f"comma separated from {', '.join(ALL_IMPLS)}, or auto (default)",
  )
  p.add_argument(
    "--reps",
    type=int,
    default=None,
    help="timed runs per case, the median is kept (default 15 on a GPU, 5 elsewhere)",
  )
  p.add_argument(
    "--inner", type=int, default=None, help="calls per timed run (default 5 on a GPU, 1 elsewhere)"
  )
  p.add_argument(
    "--reference-max-gb",
    type=float,
    default=8.0,
    help="run the reference's forward + backward only when its saved states "
    "(B*T*H*K*V float32) fit in this many GB",
  )
  p.add_argument(
    "--devices",
    type=int,
    default=None,
    help="also time ours sharded over this many devices: batch / head parallel and "
    "context parallel (simulated CPU devices off a GPU)",
  )
  p.add_argument(
    "--tiny", action="store_true", help=f"a smoke run: shape {TINY_SHAPE}, reps 2, inner 1"
  )
  p.add_argument(
    "--key-block-form",
    choices=("auto", "blocks", "loop"),
    default="auto",
    help="the Triton kernels' key-block form at every r: auto (as shipped: loops from r = 8, "
    "chunk_fwd from 128 rows), blocks (unrolled) or loop (docs/kernels.md#chunk_h)",
  )
  p.add_argument("--no-progress", action="store_true", help="no progress bar")
  p.add_argument(
    "--progress",
    action="store_true",
    help="draw the progress bar even when stderr is not a terminal",
  )


def set_key_block_form(form: str) -> None:
  """Where the Triton kernels switch to their loop forms: as shipped ("auto"), never ("blocks")
  or from one key block / row block on ("loop"); read when a kernel is built."""
  from pallas_kernels.common import options
  from pallas_kernels.triton.forward import chunk_fwd

  if form != "auto":
    options.LOOP_KEY_BLOCKS = 1 if form == "loop" else 1 << 30
    chunk_fwd.LOOP_ROWS = 0 if form == "loop" else 1 << 30


def run(args) -> int:
  # Share the GPU with PyTorch (fla): read when the backend starts, which is after this.
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  import gdp_jax
  from pallas_kernels.common import backend as kernel_backend

  if args.devices is not None:
    if args.devices < 1:
      raise SystemExit(f"--devices must be a positive integer, got {args.devices}")
    simulate_cpu_devices(args.devices)
  backend = jax.default_backend()
  if args.reps is None:
    args.reps = 15 if backend == "gpu" else 5
  if args.inner is None:
    args.inner = 5 if backend == "gpu" else 1
  if args.tiny:
    args.shape, args.reps, args.inner = [TINY_SHAPE], 2, 1
  set_key_block_form(args.key_block_form)
  shapes = parse_shapes(args.shape or [GPU_SHAPE if backend == "gpu" else CPU_SHAPE])
  rs = [int(x) for x in str(args.rs).split(",") if x.strip()]
  dtypes = [d.strip() for d in args.dtype.split(",") if d.strip()]
  for d in dtypes:
    if d not in DTYPES:
      raise SystemExit(f"--dtype: unknown dtype {d!r}; choose from {', '.join(DTYPES)}")
  modes = [m.strip() for m in args.modes.split(",") if m.strip()]
  for m in modes:
    if m not in MODES:
      raise SystemExit(f"--modes: unknown mode {m!r}; choose from {', '.join(MODES)}")
  impls = resolve_impls(args.impls, backend, args.devices)
  if args.devices is not None and jax.device_count() < args.devices:
    raise SystemExit(
      f"--devices {args.devices}: only {jax.device_count()} {backend} device(s) here"
    )
  for _B, _T, _H, K, _V in shapes:
    for r in rs:
      if r < 1 or K % r:
        raise SystemExit(f"--rs: K = {K} must be divisible by r = {r}")
  if not args.shape and not args.tiny and backend != "gpu":
    print(f"no GPU: using the small shape {CPU_SHAPE} (pass --shape to choose)")

  dev = jax.devices()[0]
  results = dict(
    schema=SCHEMA,
    tool="python -m benchmarks.bench",
    command=command_line(),
    date=time.strftime("%Y-%m-%d %H:%M:%S"),
    device=str(dev),
    device_kind=getattr(dev, "device_kind", str(dev)),
    backend=backend,
    jax_version=jax.__version__,
    gdp_jax_version=gdp_jax.__version__,
    interpret_mode=kernel_backend.interpret_mode(),
    key_block_form=args.key_block_form,
    reps=args.reps,
    inner=args.inner,
    shapes=[dict(zip("BTHKV", s)) for s in shapes],
    rs=rs,
    dtypes=dtypes,
    modes=modes,
    impls=impls,
    timing=(
      "median over reps of (wall time of `inner` back-to-back calls) / "
      "inner, after compile and 2 warm-up calls; ms per call"
    ),
    flops_counted=FLOPS_DOC,
    bytes_counted=BYTES_DOC,
    # The first shape and dtype, as the older bench_operator JSON had them.
    shape=dict(zip("BTHKV", shapes[0])),
    dtype=dtypes[0],
    cases=[],
  )
  layouts: list[str | None] = [None]
  if args.devices is not None:
    results["devices"] = args.devices
    layouts = [None, "batch-head", "context"]

  plan = [
    (m, s, r, d, i, lay)
    for s in shapes
    for d in dtypes
    for r in rs
    for m in modes
    for i in impls
    for lay in (layouts if i in ("pallas", "xla", "reference") else [None])
  ]
  # tqdm draws on a terminal; --progress forces it into a log, --no-progress turns it off.
  disable = True if args.no_progress else (False if args.progress else None)
  bar = tqdm.tqdm(
    total=len(plan) * args.reps, disable=disable, leave=False, unit="run", dynamic_ncols=True
  )

  if args.out and os.path.dirname(args.out):
    os.makedirs(os.path.dirname(args.out), exist_ok=True)

  def save():
    if args.out:
      with open(args.out, "w") as f:
        json.dump(results, f, indent=1)

  print(
    f"{len(plan)} cases on {results['device_kind']} ({backend}, jax {jax.__version__}); "
    f"median of {args.reps} runs x {args.inner} calls",
    flush=True,
  )
  fwd_outs: dict = {}  # inputs key -> {impl: forward output} (ours), for the diff against xla
  inputs_key, inputs = None, None
  for mode, shape, r, dname, impl, layout in plan:
    B, T, H, K, V = shape
    dtype = DTYPES[dname]
    case = dict(
      impl=impl, mode=mode, B=B, T=T, H=H, K=K, V=V, r=r, dtype=jnp.dtype(dtype).name, status="ok"
    )
    sharding = None
    if args.devices is not None and layout is None and impl in ("pallas", "xla", "reference"):
      case.update(base_impl=impl, parallel="none", devices=1)
    if layout is not None:
      sharding, label, why = sharded_layout(layout, args.devices, shape)
      case.update(impl=f"{impl} {label}", base_impl=impl, parallel=layout, devices=args.devices)
      if sharding is not None:
        case["mesh"] = dict(sharding.mesh.shape)
    bar.set_description(case_label(case))
    done_before = bar.n
    try:
      if (shape, r, dname) != inputs_key:
        inputs_key, inputs = None, None
        fwd_outs.clear()
        inputs = make_inputs(B, T, H, K, V, r, dtype)
        inputs_key = (shape, r, dname)
      if impl in OURS:
        if impl == "reference" and not reference_fits(mode, B, T, H, K, V, args.reference_max_gb):
          raise _Skip(
            f"the scan's backward would keep {B * T * H * K * V * 4 / 1e9:.1f} GB "
            f"of states (> --reference-max-gb {args.reference_max_gb:g})"
          )
        if layout is not None and sharding is None:
          raise _Skip(why)
        fn, fargs = ours(impl, mode, inputs, sharding)
        case["ms"], case["all_ms"] = time_jax(fn, fargs, args.reps, args.inner, bar.update)
        if mode == "fwd":
          outs = fwd_outs.setdefault(inputs_key, {})
          outs[case["impl"]] = (case, fn(*fargs))
          record_diffs(outs)
          if layout is not None and impl in outs:  # against the same impl on one device
            one = outs[impl][1].astype(jnp.float32)
            case["max_abs_diff_vs_one_device"] = float(
              jnp.max(jnp.abs(outs[case["impl"]][1].astype(jnp.float32) - one))
            )
      elif impl == "fla":
        if r != 1:
          raise _Skip("flash-linear-attention's chunk_gated_delta_rule is the r = 1 case")
        try:
          import fla  # noqa: F401
          import torch  # noqa: F401
        except ImportError as e:
          raise _Skip(f"flash-linear-attention is not installed ({e})") from None
        case["ms"], case["all_ms"] = fla_case(mode, shape, dtype, args.reps, bar.update)
        case["peer_impl"] = "flash-linear-attention chunk_gated_delta_rule"
      elif impl == "jla":
        if r != 1:
          raise _Skip("jax-linear-attention's Gated DeltaNet is the r = 1 case")
        try:
          import jla.ops  # noqa: F401
        except ImportError as e:
          raise _Skip(f"jax-linear-attention is not installed ({e})") from None
        case["ms"], case["all_ms"], which = jla_case(
          mode, inputs, args.reps, args.inner, bar.update
        )
        case["peer_impl"] = f"jax-linear-attention gated_deltanet impl={which}"
    except _Skip as e:
      case["status"], case["reason"] = "skipped", str(e)
    except Exception as e:  # record and go on
      case["status"] = "error"
      case["error"] = f"{type(e).__name__}: {e}"[:2000]
      case["traceback"] = portable_traceback(traceback.format_exc())[-4000:]
    if case["status"] == "ok":
      if case.get("all_ms") is None:
        case.pop("all_ms", None)
      case["flops"] = flops(mode, B, T, H, K, V, r)
      case["bytes"] = traffic_bytes(mode, B, T, H, K, V, r, dtype)
      case["tflops"] = case["flops"] / (case["ms"] * 1e-3) / 1e12
      case["gbps"] = case["bytes"] / (case["ms"] * 1e-3) / 1e9
    bar.update(args.reps - (bar.n - done_before))
    results["cases"].append(case)
    save()
  bar.close()
  inputs = None
  fwd_outs.clear()

  print(format_table(results["cases"]))
  print(f"\nms: {results['timing']}.")
  print(f"TFLOP/s: {FLOPS_DOC}")
  print(f"GB/s: {BYTES_DOC}")
  if args.out:
    save()
    print(f"\nwrote {args.out}")
  if not args.no_plot and (args.plot or args.out):
    path = args.plot or os.path.splitext(args.out)[0] + ".png"
    if plot(results, path):
      print(f"wrote {path}")
  n_err = sum(c["status"] == "error" for c in results["cases"])
  if n_err:
    print(f"{n_err} case(s) failed; their errors are in the JSON")
  return 0


def main(argv=None, prog="python -m benchmarks.bench", out_required=False) -> int:
  if tqdm is None:
    print(
      f"{prog} needs 'tqdm', from the `bench` extra: pip install -e \".[bench]\"", file=sys.stderr
    )
    return 2
  p = argparse.ArgumentParser(
    prog=prog,
    description=__doc__.split("\n\n")[0],
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  add_arguments(p, out_required=out_required)
  return run(p.parse_args(argv))


if __name__ == "__main__":
  from gdp_jax import compilation_cache

  compilation_cache.enable()  # jax's persistent cache (docs/train_lm.md#compile-time)
  sys.exit(main())
