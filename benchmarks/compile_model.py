"""The first compile of train-lm's model: the training step, the evaluation step and `generate`'s
first call, each split into tracing (Python -> jaxpr), lowering (jaxpr -> StableHLO, where Pallas
lowers its kernels) and XLA compilation, with the persistent compilation cache off.

  python benchmarks/compile_model.py --preset h200 --cases gpu --jobs 2   # an NVIDIA GPU, ~6 min
  python benchmarks/compile_model.py --preset tiny --cases cpu --out /tmp/compile
  python benchmarks/compile_model.py --preset tiny --cases train-gdp-r2-scan-L4,cpu

A case is `train-<model>-<scan|unrolled>-L<layers>` (the training step, then the evaluation step,
in one process as in train-lm) or `generate-<model>-<scan|unrolled>-L<layers>-<bf16|f32>-T<prompt>`
(`generate`'s programs for --gen-batch prompts of T tokens and --new-tokens new ones); models as
train-lm's --model, layers a multiple of the preset's repeated unit ("DDDA" for h200; "A" for
attention). Each case runs in a fresh process (no in-process cache of another case). Writes
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
  # one H200, preset h200, --jobs 2: about 6 minutes cold (the unrolled gdp-r2 case alone about
  # 3.5, beside the others)
  "gpu": [
    "train-gdp-r2-unrolled-L12",
    "train-gdp-r2-scan-L12",
    "train-attention-scan-L12",
    "train-gdp-r2-scan-L4",
    "train-gdp-r2-scan-L24",
    "generate-gdp-r2-scan-L12-bf16-T100",
    "generate-gdp-r2-scan-L12-f32-T100",
    "generate-gdp-r2-scan-L12-bf16-T2048",
    "generate-gdp-r2-scan-L12-f32-T2048",
    "train-attention-unrolled-L12",
    "generate-gdp-r2-unrolled-L12-f32-T100",
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


def _stages(jitted, args, kwargs=None) -> tuple[dict, object, object]:
  """Trace, lower and compile of `jitted` (seconds), the traced and the compiled."""
  t0 = time.perf_counter()
  traced = jitted.trace(*args, **(kwargs or {}))
  t1 = time.perf_counter()
  lowered = traced.lower()
  t2 = time.perf_counter()
  compiled = lowered.compile()
  t3 = time.perf_counter()
  from benchmarks.compile_profile import _count_pallas_calls

  record = dict(
    trace_s=round(t1 - t0, 3),
    lower_s=round(t2 - t1, 3),
    compile_s=round(t3 - t2, 3),
    total_s=round(t3 - t0, 3),
    pallas_kernels=_count_pallas_calls(traced.jaxpr.jaxpr),
    stablehlo_lines=lowered.as_text().count("\n"),
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
  import jax
  import numpy as np
  from flax import nnx

  from examples.byte_lm import train_lm as tl
  from gdp_jax import models

  what, model, scan, layers, dtype, prompt = CASE.match(name).groups()
  cfg = tl.preset_config(preset, model=model, dtype=dtype or "bf16")
  cfg.layers = _pattern(cfg.layers, model, int(layers))
  cfg.scan_layers = scan == "scan"
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
    if reps:
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
  return (
    f"{p['total_s']:.1f} s ({p['trace_s']:.1f} + {p['lower_s']:.1f} + {p['compile_s']:.1f}{extra})"
  )


def markdown(meta: dict, records: list[dict]) -> str:
  lines = [
    f"# First compile of train-lm's model ({meta['device_kind']}, preset {meta['preset']})",
    "",
    f"{meta['date']}, jax {meta['jax_version']}, persistent compilation cache off. Command: "
    f"`{meta['command']}`. Each cell: total (trace + lower + XLA compile), seconds.",
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
  p.add_argument("--child", default=None, help=argparse.SUPPRESS)
  args = p.parse_args(argv)
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
    # as run from the repository, --out by its folder's name (no machine paths)
    command="python benchmarks/compile_model.py "
    + " ".join(os.path.basename(a) if a == args.out else a for a in (argv or sys.argv[1:])),
  )
  out = args.out or os.environ.get("OUT") or os.path.join(ROOT, "benchmarks", "results")
  os.makedirs(out, exist_ok=True)
  stem = os.path.join(out, f"{_slug(kind)}_{meta['date'][:10]}_compile_model")
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  env["JAX_ENABLE_COMPILATION_CACHE"] = "false"
  if args.jobs > 1:  # processes side by side on one device: no preallocation
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
  done: dict[str, dict] = {}

  def one(case: str) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", case, "--preset", args.preset,
           "--gen-batch", str(args.gen_batch), "--new-tokens", str(args.new_tokens),
           "--step-reps", str(args.step_reps)]  # fmt: skip
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
