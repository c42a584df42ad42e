"""The first compile of train-lm's training step, evaluation step and `generate`, split into
tracing, lowering (where Pallas lowers its kernels) and XLA compilation, the persistent cache off.

  python benchmarks/compile_model.py --preset h200 --cases gpu --jobs 2   # an NVIDIA GPU
  python benchmarks/compile_model.py --preset tiny --cases cpu --out /tmp/compile
  python benchmarks/compile_model.py --lower-only --cases train-gdp-r2-unrolled-L12  # any CPU

A case is `train-<model>-<scan|unrolled>-L<layers>` (the training step, then the evaluation step,
in one process as in train-lm) or `generate-<model>-<scan|unrolled>-L<layers>-<bf16|f32>-T<prompt>`
(`generate`'s programs for --gen-batch prompts of T tokens and --new-tokens new ones); models as
train-lm's --model, layers a multiple of the preset's repeated unit ("DDDA" for h200). Each case
runs in a fresh process; --lower-only lowers for an H200 without compiling, on any machine. Writes
<device>_<date>_compile_model.json and .md into --out (default $OUT, else benchmarks/results/).
docs/train_lm.md#compile-time explains the figures.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import os
import re
import subprocess
import sys
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
CASE = re.compile(
  r"^(train|generate)-(attention|gdn|gdp-r2|gdp-r4|dp-2)-(scan|unrolled)-L(\d+)"
  r"(?:-(bf16|f32)-T(\d+))?$"
)
GROUPS = {
  # one H200, preset h200, --jobs 2: every first compile (the 24-layer cases apart, for memory)
  "gpu": [
    "train-gdp-r2-unrolled-L12",
    "train-gdp-r2-scan-L12",
    "train-gdp-r2-unrolled-L24",
    "train-gdp-r2-unrolled-L4",
    "train-gdp-r2-scan-L4",
    "train-attention-unrolled-L12",
    "train-attention-scan-L12",
    "train-gdp-r2-scan-L24",
    "generate-gdp-r2-unrolled-L12-bf16-T100",
    "generate-gdp-r2-unrolled-L12-f32-T100",
    "generate-gdp-r2-unrolled-L12-bf16-T2048",
    "generate-gdp-r2-unrolled-L12-f32-T2048",
    "generate-gdp-r2-scan-L12-bf16-T2048",
  ],
  # one H200, --jobs 1: the 12-layer training steps timed alone
  "steps": [
    "train-gdp-r2-unrolled-L12",
    "train-gdp-r2-scan-L12",
    "train-attention-unrolled-L12",
    "train-attention-scan-L12",
  ],
  # a CPU, preset tiny ("DA" unit): what scanning changes, in a few minutes
  "cpu": [
    "train-gdp-r2-scan-L4",
    "train-gdp-r2-unrolled-L4",
    "train-gdp-r2-scan-L12",
    "train-gdp-r2-unrolled-L12",
    "train-attention-scan-L4",
    "generate-gdp-r2-scan-L12-f32-T100",
    "generate-gdp-r2-unrolled-L12-f32-T100",
  ],
}


def _pattern(preset_layers: str, model: str, layers: int) -> str:
  from gdp_jax.models.scan import layer_plan

  plan = layer_plan(preset_layers)
  unit = "A" if model == "attention" else "".join(c * n for c, n in plan.runs)
  if layers % len(unit):
    raise SystemExit(f"L{layers}: not a multiple of the preset's unit {unit!r}")
  return unit * (layers // len(unit))


LOWER_ONLY = False  # --lower-only: lowered for an H200 (`_as_h200`), not compiled


def _as_h200() -> None:
  """Trace and lower as on an H200 from any machine (tests/triton_lowering.py's way): the
  kernels compiled for the GPU (not interpreted), the registry choosing for compute capability
  9.0, Triton's lowering given the H200's description."""
  from types import SimpleNamespace

  from gdp_jax.ops import registry
  from gdp_jax.ops.gated_delta_product.api import REGISTRY
  from pallas_kernels.common import backend, compat

  backend.interpret_mode = lambda: False
  h200 = SimpleNamespace(platform="gpu", compute_capability="9.0", device_kind="NVIDIA H200")
  registry.default_device = lambda: h200
  internals = compat.triton_lowering_internals()
  info = internals.gpu_info.get_gpu_info_from_version(internals.gpu_info.GpuVersion.H200)
  internals.registration.gpu_info_lib.get_gpu_info = lambda: info
  REGISTRY.register(REGISTRY.get("mosaic_gpu").replace(interpret=False))


def _stages(jitted, args, kwargs=None) -> tuple[dict, object, object]:
  """Trace, lower and compile of `jitted` (seconds), the traced and the compiled (None with
  --lower-only)."""
  t0 = time.perf_counter()
  traced = jitted.trace(*args, **(kwargs or {}))
  t1 = time.perf_counter()
  lowered = traced.lower(lowering_platforms=("cuda",)) if LOWER_ONLY else traced.lower()
  t2 = time.perf_counter()
  compiled = None if LOWER_ONLY else lowered.compile()
  t3 = time.perf_counter()
  from benchmarks.compile_profile import _count_pallas_calls

  text = lowered.as_text()
  record = dict(
    trace_s=round(t1 - t0, 3),
    lower_s=round(t2 - t1, 3),
    compile_s=round(t3 - t2, 3),
    total_s=round(t3 - t0, 3),
    pallas_kernels=_count_pallas_calls(traced.jaxpr.jaxpr),
    stablehlo_lines=text.count("\n"),
    # kernel calls in the lowered program: one per distinct kernel when layers share them
    mosaic_gpu_calls=text.count("custom_call @mosaic_gpu"),
    triton_calls=text.count("custom_call @__gpu$xla.gpu.triton"),
  )
  return record, traced, compiled


def _median_ms(fn, reps):
  import jax

  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - t0)
  return round(1e3 * sorted(times)[len(times) // 2], 3)


def run_case(name: str, preset: str, gen_batch: int, new_tokens: int, reps: int) -> dict:
  """One case in this process (the persistent cache off)."""
  from gdp_jax import compilation_cache

  compilation_cache.disable()
  if LOWER_ONLY:
    _as_h200()
  import jax
  import numpy as np
  from flax import nnx

  from examples.byte_lm import train_lm as tl
  from gdp_jax import models

  what, model, scan, layers, dtype, prompt = CASE.match(name).groups()
  cfg = tl.preset_config(preset, model=model, dtype=dtype or "bf16")
  cfg.layers = _pattern(cfg.layers, model, int(layers))
  cfg.scan_layers = scan == "scan"
  if LOWER_ONLY:
    cfg.attn_impl = "flash"  # what "auto" picks on a GPU
  mc = tl.model_config(cfg)
  lm = models.HybridLM(mc, rngs=nnx.Rngs(0))
  record = dict(
    case=name,
    layer_pattern=mc.layer_pattern,
    scanned=lm.scan_plan is not None,
    parameters=tl.count_params(nnx.state(lm, nnx.Param)),
  )
  graphdef, params = nnx.split(lm)
  if what == "train":
    b, t = cfg.batch_size, cfg.seq_len
    batch = tuple(np.zeros((b, t), np.int32) for _ in range(3))
    hp = tl.Hyper(cfg.lr, cfg.min_lr_ratio, cfg.warmup_steps, cfg.steps, cfg.weight_decay, cfg.b1,
                  cfg.b2, cfg.clip_norm)  # fmt: skip
    opt_state = tl.optimizer(hp).init(params)
    train = jax.jit(tl._train_step, static_argnums=(0, 1))
    dynamic = (hp.schedule_array(), params, opt_state, *batch)
    record["train"], _, compiled = _stages(train, (graphdef, hp.static(), *dynamic))
    if reps and compiled is not None:
      record["train"]["step_ms"] = _median_ms(lambda: compiled(*dynamic), reps)
    evaluate = jax.jit(tl._loss_sums, static_argnums=(0,))
    record["eval"], _, _ = _stages(evaluate, (graphdef, params, *batch))
    return record
  prompts = np.asarray(
    [[(7 * i + 3 * j) % 256 for j in range(int(prompt))] for i in range(gen_batch)], np.int32
  )
  call = models.generate_call(lm, prompts, new_tokens)
  record["prefill_mode"] = "steps" if call.prefill is None else "chunked"
  programs = {}
  if call.prefill is None:
    programs["decode"], _, _ = _stages(call.decode, (), call.decode_args)
  else:
    programs["prefill"], traced, _ = _stages(call.prefill, (), call.prefill_args)
    first, cache, key = traced.out_info
    args = (call.prefill_args["graphdef"], call.prefill_args["state"], first, cache, key)
    programs["decode"], _, _ = _stages(call.decode, args, call.decode_args)
  record["generate"] = dict(
    {k: round(sum(p[k] for p in programs.values()), 3) for k in ("trace_s", "lower_s")},
    compile_s=round(sum(p["compile_s"] for p in programs.values()), 3),
    total_s=round(sum(p["total_s"] for p in programs.values()), 3),
    programs=programs,
  )
  return record


def _slug(device_kind: str) -> str:
  m = re.search(r"[A-Z]\d{2,4}", device_kind)
  return m.group(0).lower() if m else re.sub(r"\W+", "-", device_kind.lower()).strip("-")


def _row(rec: dict, part: str) -> str:
  p = rec.get(part)
  if not p:
    return ""
  extra = f", step {p['step_ms']:.1f} ms" if "step_ms" in p else ""
  calls = [p.get(k, 0) for k in ("mosaic_gpu_calls", "triton_calls")]
  for program in p.get("programs", {}).values():  # generate's: prefill and decode
    calls = [n + program.get(k, 0) for n, k in zip(calls, ("mosaic_gpu_calls", "triton_calls"))]
  extra += f"; kernel calls {calls[0]} Mosaic GPU, {calls[1]} Triton"
  return (
    f"{p['total_s']:.1f} s ({p['trace_s']:.1f} + {p['lower_s']:.1f} + {p['compile_s']:.1f}{extra})"
  )


def markdown(meta: dict, records: list[dict]) -> str:
  lines = [
    f"# First compile of train-lm's model ({meta['device_kind']}, preset {meta['preset']})",
    "",
    f"{meta['date']}, jax {meta['jax_version']}, persistent compilation cache off. Command: "
    f"`{meta['command']}`. Each cell: total (trace + lower + XLA compile), seconds"
    + (" (lowered for an H200, not compiled)." if meta.get("lower_only") else "."),
    "",
    "| case | layers | scanned | parameters | training step | evaluation step | generate |",
    "| --- | --- | --- | --- | --- | --- | --- |",
  ]
  for r in records:
    if "error" in r:
      lines.append(f"| {r['case']} | error: {r['error'][:120]} | | | | | |")
      continue
    gen = _row(r, "generate")
    if gen:
      gen += f" [{r['prefill_mode']} prefill]"
    lines.append(
      f"| {r['case']} | {r['layer_pattern']} | {r['scanned']} | {r['parameters'] / 1e6:.2f}M | "
      f"{_row(r, 'train')} | {_row(r, 'eval')} | {gen} |"
    )
  return "\n".join(lines) + "\n"


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--preset", default="h200", help="train-lm's preset (h200, tiny)")
  p.add_argument("--cases", default="gpu", help=f"groups ({', '.join(GROUPS)}) or case names")
  p.add_argument("--out", default=None, help="folder (default $OUT, else benchmarks/results)")
  p.add_argument("--gen-batch", type=int, default=8, help="generate: prompts per call")
  p.add_argument("--new-tokens", type=int, default=32, help="generate: new tokens per prompt")
  p.add_argument("--step-reps", type=int, default=5, help="timed training steps (0: none)")
  p.add_argument("--timeout", type=float, default=900, help="seconds per case")
  p.add_argument(
    "--jobs",
    type=int,
    default=1,
    help="cases run at once, each its own process (compiles are CPU-bound; 2 on a 16-core "
    "host; step times then share the device)",
  )
  p.add_argument(
    "--lower-only",
    action="store_true",
    help="lower for an H200 without compiling (any machine, a CPU too): lowering times and "
    "the kernel calls of each program",
  )
  p.add_argument("--child", default=None, help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  global LOWER_ONLY
  LOWER_ONLY = args.lower_only
  if args.child:  # one case, in this fresh process: its record as one JSON line
    try:
      rec = run_case(args.child, args.preset, args.gen_batch, args.new_tokens, args.step_reps)
    except Exception as error:  # noqa: BLE001  (recorded; the parent goes on)
      rec = dict(case=args.child, error=f"{type(error).__name__}: {str(error)[:500]}")
    print("RECORD " + json.dumps(rec), flush=True)
    return 0
  cases = [c for g in args.cases.split(",") for c in GROUPS.get(g, [g])]
  bad = [c for c in cases if not CASE.match(c)]
  if bad:
    raise SystemExit(f"--cases: unknown {bad}; groups {list(GROUPS)} or names like {CASE.pattern}")
  import jax

  device = jax.devices()[0]
  kind = getattr(device, "device_kind", device.platform)
  meta = dict(
    date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    jax_version=jax.__version__,
    device_kind=kind,
    backend=jax.default_backend(),
    preset=args.preset,
    jobs=args.jobs,
    lower_only=args.lower_only,
    # --lower-only: the GPU lowered for, on this machine (nothing compiled or run on it)
    gpu="NVIDIA H200 (lowered for)" if args.lower_only else kind,
    # as run from the repository, --out by its folder's name (no machine paths)
    command="python benchmarks/compile_model.py "
    + " ".join(os.path.basename(a) if a == args.out else a for a in (argv or sys.argv[1:])),
  )
  out = args.out or os.environ.get("OUT") or os.path.join(ROOT, "benchmarks", "results")
  os.makedirs(out, exist_ok=True)
  stem = f"{_slug(kind)}_{meta['date'][:10]}_compile_model" + "_lowered_for_h200" * args.lower_only
  stem = os.path.join(out, stem)
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  env["JAX_ENABLE_COMPILATION_CACHE"] = "false"
  if args.jobs > 1:  # processes side by side on one device: no preallocation
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
  done: dict[str, dict] = {}

  def one(case: str) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", case, "--preset", args.preset,
           "--gen-batch", str(args.gen_batch), "--new-tokens", str(args.new_tokens),
           "--step-reps", str(args.step_reps)] + ["--lower-only"] * args.lower_only  # fmt: skip
    t0 = time.perf_counter()
    try:
      proc = subprocess.run(
        cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=args.timeout
      )
      lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RECORD ")]
      rec = json.loads(lines[-1][7:]) if lines else dict(case=case, error=proc.stderr[-800:])
    except subprocess.TimeoutExpired:
      rec = dict(case=case, error=f"over --timeout {args.timeout:g} s")
    rec["process_s"] = round(time.perf_counter() - t0, 1)
    return rec

  def save(rec: dict) -> list[dict]:  # after every case: a run cut short keeps its cases
    done[rec["case"]] = rec
    records = [done[c] for c in cases if c in done]
    print(json.dumps(rec), flush=True)
    with open(stem + ".json", "w") as f:
      json.dump(dict(meta, results=records), f, indent=1)
    with open(stem + ".md", "w") as f:
      f.write(markdown(meta, records))
    return records

  records: list[dict] = []
  with concurrent.futures.ThreadPoolExecutor(max(1, args.jobs)) as pool:
    for future in concurrent.futures.as_completed([pool.submit(one, c) for c in cases]):
      records = save(future.result())
  print(markdown(meta, records))
  print(f"wrote {stem}.json and .md")
  return 0


if __name__ == "__main__":
  sys.exit(main())
