"""Where a first call's time goes: tracing, lowering, XLA compilation, per public entry point.

  python benchmarks/compile_profile.py --out compile.json [--entries operator,layer,generate]
      [--impls pallas,xla] [--rs 1,2,4,8]
  python benchmarks/compile_profile.py --entries generate,generate-xla-default,\
      generate-no-autotune --impls pallas --phases cold,warm --out generate.json

Each entry point is timed in three phases, each in a fresh process: `cold` (an empty persistent
compilation cache), `warm` (the same cache again: what a notebook restart costs) and, for the jnp
implementation, `no-autotune` (cold with `--xla_gpu_autotune_level=0`: the share of XLA's GEMM
autotuner). Per entry and phase: the jitted function's trace, lower and compile times, the first
and the second call, the number of Pallas kernels in its jaxpr, and jax's own monitoring events
(backend compile, persistent-cache hits). `generate` (and its variants with other XLA options,
GENERATE_OPTIONS) is split per program (prefill, decode loop): trace, lower and backend compile
of each in the first call, and what each holds (matmuls, loops, Pallas kernels; fusions and GEMMs
after XLA). `chunk-fwd`: the Triton chunk_fwd alone in its two forms ("blocks" unrolled, "loop"),
f32 and bf16, per r: compile and run time. Each entry runs in its own processes and caches.

  python benchmarks/compile_profile.py --entries kernels --rs 1,2 --phases cold --out k.json
  python benchmarks/compile_profile.py --entries kernels --lower-only   # any machine, no GPU

`kernels`: each kernel alone (benchmarks/kernel_alone.py: the four Mosaic GPU kernels of the
operator's training step, the operator's forward and training step, the flash
attention), each case in a fresh process with an empty persistent cache: trace, lower, compile,
first and second call of a jit holding that one kernel, and each kernel call's size in the
lowered text (its serialized module); --kernels picks cases. --lower-only lowers them for an
H200 without compiling. docs/performance.md#compile-time explains the figures.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
SHAPE = dict(B=8, T=4096, H=16, K=128, V=128)


def _count_pallas_calls(jaxpr) -> int:
  """Pallas kernels in a jaxpr: Triton's `pallas_call`s and Mosaic GPU's (`mpmd_map`)."""
  count = 0
  for eqn in jaxpr.eqns:
    if eqn.primitive.name in ("pallas_call", "mpmd_map"):
      count += 1
      continue
    for value in eqn.params.values():
      for item in value if isinstance(value, tuple | list) else (value,):
        inner = getattr(item, "jaxpr", None)
        if inner is not None and hasattr(inner, "eqns"):
          count += _count_pallas_calls(inner)
        elif hasattr(item, "eqns"):
          count += _count_pallas_calls(item)
  return count


def _operator_case(impl, r, mode):
  import jax
  import jax.numpy as jnp

  from gdp_jax import gated_delta_product

  B, T, H, K, V = (SHAPE[n] for n in "BTHKV")
  keys = jax.random.split(jax.random.key(0), 6)
  dt = jnp.bfloat16
  q = jax.random.normal(keys[0], (B, T, H, K), dt)
  k = jax.random.normal(keys[1], (B, T, H, K), dt) / jnp.sqrt(K / r).astype(dt)
  v = jax.random.normal(keys[2], (B, T, H, V), dt)
  g = -jax.nn.softplus(jax.random.normal(keys[3], (B, T, H), jnp.float32))
  beta = jax.nn.sigmoid(jax.random.normal(keys[4], (B, T, H), jnp.float32)).astype(dt)
  mask = None if r == 1 else jnp.tril(jnp.ones((r, r), jnp.float32))

  def forward(q, k, v, g, beta):
    return gated_delta_product(q, k, v, g, beta, mask, implementation=impl)[0]

  if mode == "fwd":
    return forward, (q, k, v, g, beta)

  def loss(q, k, v, g, beta):
    return jnp.sum(forward(q, k, v, g, beta).astype(jnp.float32))

  return jax.grad(loss, argnums=(0, 1, 2, 3, 4)), (q, k, v, g, beta)


def _layer_case(impl):
  import jax
  import jax.numpy as jnp
  from flax import nnx

  from gdp_jax.layers import GatedDeltaProduct

  layer = GatedDeltaProduct(
    2048, 16, 128, num_blocks=2, implementation=impl, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)
  )
  graphdef, state = nnx.split(layer)
  x = jax.random.normal(jax.random.key(1), (1, 4096, 2048), jnp.bfloat16)

  def loss(state, x):
    return jnp.sum(nnx.merge(graphdef, state)(x).astype(jnp.float32))

  return jax.grad(loss), (state, x)


def _profile(fn, args):
  """Trace, lower, compile and two calls of jax.jit(fn), with jax's monitoring events."""
  import jax

  events: list[tuple[str, float]] = []
  jax.monitoring.register_event_duration_secs_listener(
    lambda name, secs, **_: events.append((name, secs))
  )
  jitted = jax.jit(fn)
  t0 = time.perf_counter()
  traced = jitted.trace(*args)
  t1 = time.perf_counter()
  lowered = traced.lower()
  t2 = time.perf_counter()
  lowered.compile()
  t3 = time.perf_counter()
  jax.block_until_ready(jitted(*args))
  t4 = time.perf_counter()
  jax.block_until_ready(jitted(*args))
  t5 = time.perf_counter()
  totals: dict[str, float] = {}
  for name, secs in events:
    totals[name] = totals.get(name, 0.0) + secs
  return dict(
    trace_s=t1 - t0,
    lower_s=t2 - t1,
    compile_s=t3 - t2,
    first_call_s=t4 - t3,
    second_call_s=t5 - t4,
    pallas_kernels=_count_pallas_calls(traced.jaxpr.jaxpr),
    events={name: round(secs, 4) for name, secs in sorted(totals.items())},
  )


# generate's variants per entry: (its prefill mode, compiler_options of models.generate,
# chunk_fwd.LOOP_ROWS or None to keep it). As shipped ("auto": the profile's prompts, padded to 64
# tokens, read by the decode step in the decode loop's program); the chunked prefill (two
# programs) as shipped, with XLA's defaults for both programs, with the autotuner off for both,
# and with the Triton chunk_fwd's row-block loop from 64 rows (r = 2 here: its unrolled form is a
# 6,700-line Triton module).
NO_AUTOTUNE = {"xla_gpu_autotune_level": 0}
GENERATE_OPTIONS = {
  "generate": ("auto", None, None),
  "generate-chunked": ("chunked", None, None),
  "generate-xla-default": ("chunked", ({}, {}), None),
  "generate-no-autotune": ("chunked", (NO_AUTOTUNE, NO_AUTOTUNE), None),
  "generate-loop-forward": ("chunked", None, 64),
}


def _hlo_counts(lowered, compiled) -> dict:
  """What a program gives XLA to compile: in the lowered StableHLO the matmuls, loops and kernel
  custom calls (Pallas: Triton or Mosaic GPU); in the compiled HLO the fusions and the GEMMs
  (cuBLAS or Triton GEMM fusions: what XLA's GEMM autotuner tunes)."""
  text = lowered.as_text()
  try:
    hlo = compiled.as_text() or ""
  except Exception:  # noqa: BLE001  (some backends keep no text)
    hlo = ""
  return dict(
    stablehlo_lines=text.count("\n"),
    dot_general=text.count("stablehlo.dot_general"),
    while_loops=text.count("stablehlo.while"),
    kernel_calls=text.count("stablehlo.custom_call"),
    hlo_lines=hlo.count("\n"),
    fusions=hlo.count(" fusion("),
    gemm_custom_calls=hlo.count('custom_call_target="__cublas'),
    triton_gemm_fusions=hlo.count('"kind":"__triton_gemm'),
    hlo_dots=hlo.count(" dot("),
  )


# jax's monitoring events of one compilation, in the order they come for each program.
STAGE_EVENTS = {
  "/jax/core/compile/jaxpr_trace_duration": "trace_s",
  "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower_s",
  "/jax/core/compile/backend_compile_duration": "backend_compile_s",
}


def _split_by_program(events, names):
  """The (event, seconds, function name) events of a call, summed per program: a program is
  named by the first of `names` its function's name holds ("prefill" in "_prefill_program"),
  else by that name (an eager op compiled on the way). Per program its trace, lower and
  backend-compile seconds and the persistent-cache events."""
  programs: dict[str, dict] = {}
  name = "unnamed"
  for event, secs, fun in events:
    if fun is not None:  # (the persistent cache's events name none: the current program's)
      name = next((n for n in names if n in fun), fun)
    record = programs.setdefault(name, {})
    stage = STAGE_EVENTS.get(event, event.rsplit("/", 1)[-1])
    record[stage] = round(record.get(stage, 0.0) + secs, 4)
  order = [n for n in names if n in programs] + [n for n in programs if n not in names]
  return [dict(program=n, **programs[n]) for n in order]


def _generate_case(impl, entry="generate"):
  """HybridLM.generate (vocab 256, width 512, "DDA", 8 x 64 tokens): the first call, split into
  its two programs (prefill, decode loop: trace, lower, backend compile each), the second call,
  and what each program gives XLA (`_hlo_counts`, from a lowering and compile after the calls:
  the persistent cache's). `entry` picks the XLA options (GENERATE_OPTIONS)."""
  import jax
  from flax import nnx

  from gdp_jax import models

  config = models.HybridConfig(
    vocab_size=256, hidden_size=512, layer_pattern="DDA", num_heads=4, head_dim=128,
    implementation=impl,
  )  # fmt: skip
  model = models.HybridLM(config, rngs=nnx.Rngs(0))
  prompts = [[(7 * b + i) % 256 for i in range(16 + 5 * b)] for b in range(8)]
  prefill, options, loop_rows = GENERATE_OPTIONS[entry]
  if loop_rows is not None:
    from pallas_kernels.triton.forward import chunk_fwd

    chunk_fwd.LOOP_ROWS = loop_rows
  events: list[tuple[str, float, str | None]] = []
  jax.monitoring.register_event_duration_secs_listener(
    lambda name, secs, fun_name=None, **_: events.append((name, secs, fun_name))
  )
  t0 = time.perf_counter()
  run = functools.partial(models.generate, compiler_options=options, prefill=prefill)
  jax.block_until_ready(run(model, prompts, 64))
  t1 = time.perf_counter()
  first_events = list(events)
  jax.block_until_ready(run(model, prompts, 64))
  t2 = time.perf_counter()
  second_compiles = [n for n, _, _ in events[len(first_events) :] if n in STAGE_EVENTS]
  # the prefill by steps is one program, "_prompt_decode_program": named decode
  programs = _split_by_program(first_events, ("prefill", "decode"))
  # What each program holds (a second lowering and compile, outside the timings above).
  call = models.generate_call(model, prompts, 64, compiler_options=options, prefill=prefill)
  if call.prefill is None:
    calls = [(call.decode, (), call.decode_args)]
  else:
    first, cache, key = call.prefill(**call.prefill_args)
    graphdef, state = call.prefill_args["graphdef"], call.prefill_args["state"]
    calls = [
      (call.prefill, (), call.prefill_args),
      (call.decode, (graphdef, state, first, cache, key), call.decode_args),
    ]
  named = [p for p in programs if p["program"] in ("prefill", "decode")]
  for record, (fn, args, kwargs) in zip(named, calls):
    traced = fn.trace(*args, **kwargs)
    lowered = traced.lower()
    record.update(
      pallas_kernels=_count_pallas_calls(traced.jaxpr.jaxpr),
      **_hlo_counts(lowered, lowered.compile()),
    )
  return dict(
    prefill=prefill,
    options=None if options is None else [dict(o) for o in options],
    chunk_fwd_loop_rows=loop_rows,
    first_call_s=round(t1 - t0, 3),
    second_call_s=round(t2 - t1, 4),
    second_call_compile_events=len(second_compiles),
    backend_compile_s=round(sum(p.get("backend_compile_s", 0.0) for p in programs), 3),
    programs=programs,
  )


def _chunk_fwd_case(r, form, dtype_name):
  """The Triton chunk_fwd alone at the operator's shape in form "blocks" or "loop"
  (pallas_kernels/triton/forward/chunk_fwd.py): its compile, and its run time (median of 10)."""
  import jax
  import jax.numpy as jnp

  from gdp_jax.ops.gated_delta_product.triton import pallas_chunk
  from pallas_kernels.triton.forward import chunk_fwd

  B, T, H, K, V = (SHAPE[n] for n in "BTHKV")
  dtype = dict(f32=jnp.float32, bf16=jnp.bfloat16)[dtype_name]
  keys = jax.random.split(jax.random.key(0), 4)
  k = (jax.random.normal(keys[0], (B, T, H, K)) / jnp.sqrt(K / r)).astype(dtype)
  v = jax.random.normal(keys[1], (B, T, H, V)).astype(dtype)
  g = -jax.nn.softplus(jax.random.normal(keys[2], (B, H, T)))
  beta = jax.nn.sigmoid(jax.random.normal(keys[3], (B, H, T)))
  mask = jnp.tril(jnp.ones((r, r), jnp.float32))[None, None, None]

  def fn(k, v, g, beta):
    return chunk_fwd.chunk_fwd(
      k, v, g, beta, mask, key_blocks=r, chunk=pallas_chunk(64, r), save_ai=True, form=form
    )

  record = _profile(fn, (k, v, g, beta))
  jitted = jax.jit(fn)
  times = []
  for _ in range(10):
    t0 = time.perf_counter()
    jax.block_until_ready(jitted(k, v, g, beta))
    times.append(time.perf_counter() - t0)
  return dict(record, form=form, dtype=dtype_name, run_ms=round(1e3 * sorted(times)[5], 4))


def run_cases(entries, impls, rs, modes, kernel_case=None, lower_only=False):
  """One phase, in this process: every requested case, errors recorded per case."""
  import jax

  results = []
  cases = []
  for entry in entries:
    if entry == "operator":
      cases += [(entry, impl, r, mode) for impl in impls for r in rs for mode in modes]
    elif entry == "chunk-fwd":
      cases += [(entry, "pallas", r, f"{form}:{dt}") for r in rs for form in ("blocks", "loop")
                for dt in ("f32", "bf16")]  # fmt: skip
    elif entry == "kernels":
      name, _, r = kernel_case.partition(":")
      impl = "triton" if name.startswith("flash") else "mosaic_gpu"
      cases.append((entry, impl, int(r) if r else None, name))
    elif entry == "layer" or entry in GENERATE_OPTIONS:
      cases += [(entry, impl, 2 if entry == "layer" else None, "fwdbwd") for impl in impls]
    else:
      raise SystemExit(
        f"--entries: unknown entry {entry!r} (operator, layer, chunk-fwd, kernels, "
        f"{', '.join(GENERATE_OPTIONS)})"
      )
  for entry, impl, r, mode in cases:
    record = dict(entry=entry, impl=impl, r=r, mode=mode)
    try:
      if entry in GENERATE_OPTIONS:
        record.update(_generate_case(impl, entry))
      elif entry == "chunk-fwd":
        record.update(_chunk_fwd_case(r, *mode.split(":")))
      elif entry == "kernels":
        from benchmarks.kernel_alone import ATTENTION, ATTENTION_SHAPE, case, profile

        shape = tuple(SHAPE[n] for n in "BTHKV")
        if mode in ATTENTION:  # (not the operator's: the top level's)
          record["shape"] = dict(zip(("B", "T", "Hq", "Hkv", "D"), ATTENTION_SHAPE))
        record.update(profile(*case(mode, r, shape), lower_only))
      else:
        fn, args = _operator_case(impl, r, mode) if entry == "operator" else _layer_case(impl)
        record.update(_profile(fn, args))
    except Exception as error:  # noqa: BLE001  (one failing case must not stop the rest)
      record["error"] = f"{type(error).__name__}: {str(error)[:500]}"
    results.append(record)
    print(json.dumps(record), flush=True)
    jax.clear_caches()
  return results


def _phase(phase, cache_dir, argv, save):
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  if phase == "no-autotune":
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_gpu_autotune_level=0").strip()
  cmd = [sys.executable, __file__, "--phase", phase, "--cache-dir", cache_dir, *argv]
  records = []
  with subprocess.Popen(
    cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
  ) as proc:
    for line in proc.stdout:  # streamed: a run cut short keeps the cases it finished
      if line.startswith("{"):
        records.append(dict(json.loads(line), phase=phase))
        save(records)
        print(phase, line.strip(), flush=True)
    stderr = proc.stderr.read()
  if proc.returncode != 0:
    records.append(dict(phase=phase, error=stderr[-3000:]))
  return records


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--out", help="JSON file to write")
  p.add_argument("--entries", default="operator,layer,generate")
  p.add_argument("--impls", default="pallas,xla")
  p.add_argument("--rs", help="r of the operator's cases (default 1,2,4,8; kernels: 1,2)")
  p.add_argument("--modes", default="fwd,fwdbwd", help="the operator's: fwd, fwdbwd")
  p.add_argument("--phases", default="cold,warm,no-autotune")
  p.add_argument("--shape", default="8,4096,16,128,128", help="B,T,H,K,V of the operator")
  p.add_argument("--kernels", help="the kernels entry's cases (default all: kernel_alone.py)")
  p.add_argument("--lower-only", action="store_true", help="kernels: lowered for an H200 only")
  p.add_argument("--phase", help=argparse.SUPPRESS)
  p.add_argument("--cache-dir", help=argparse.SUPPRESS)
  p.add_argument("--kernel-case", help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  SHAPE.update(zip("BTHKV", (int(x) for x in args.shape.split(","))))
  entries = args.entries.split(",")
  impls = args.impls.split(",")
  if args.rs is None:
    args.rs = "1,2" if entries == ["kernels"] else "1,2,4,8"
  rs = [int(x) for x in args.rs.split(",")]

  if args.phase:  # a child process: one phase
    import jax

    jax.config.update("jax_compilation_cache_dir", args.cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    if args.lower_only:
      from benchmarks.compile_model import _as_h200

      _as_h200()
    run_cases(entries, impls, rs, args.modes.split(","), args.kernel_case, args.lower_only)
    return
  if args.lower_only and entries != ["kernels"]:
    raise SystemExit("--lower-only: for --entries kernels only")
  if ROOT not in sys.path:  # (run as a script: benchmarks/ is on the path, not the repository)
    sys.path.insert(0, ROOT)

  common = [
    "--shape",
    args.shape,
    "--rs",
    args.rs,
    "--entries",
    args.entries,
    "--modes",
    args.modes,
  ] + ["--lower-only"] * args.lower_only
  import jax

  meta = dict(
    date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    jax_version=jax.__version__,
    gpu="NVIDIA H200 (lowered for)" if args.lower_only else jax.devices()[0].device_kind,
    # The command as run from the repository, --out by file name (no machine paths).
    command=" ".join(
      ["python benchmarks/compile_profile.py"]
      + [os.path.basename(a) if a == args.out else a for a in sys.argv[1:]]
    ),
    shape=SHAPE,
  )
  records: list[dict] = []

  def save(new):  # after every case: a run cut short keeps what it measured
    if args.out:
      with open(args.out, "w") as f:
        json.dump(dict(meta, results=records + new), f, indent=1)

  # Each entry in its own processes and caches: XLA's autotuner and the kernel compilers keep
  # in-process caches, and one entry's programs must not be found in another's persistent cache.
  for entry in entries:
    entry_common = list(common)
    entry_common[entry_common.index("--entries") + 1] = entry
    if entry == "kernels":  # each case in its own processes and cache
      from benchmarks.kernel_alone import kernel_cases

      names = None if args.kernels is None else args.kernels.split(",")
      for kernel_case in kernel_cases(names, rs):
        with tempfile.TemporaryDirectory() as cache:
          for phase in args.phases.split(","):
            if phase != "no-autotune":  # (no GEMM for XLA's autotuner in a kernel alone)
              argv = [*entry_common, "--impls", "mosaic_gpu", "--kernel-case", kernel_case]
              records += _phase(phase, cache, argv, save)
              save([])
        print(f"kernels: {kernel_case} done", flush=True)
      continue
    with tempfile.TemporaryDirectory() as cache, tempfile.TemporaryDirectory() as cache2:
      for phase in args.phases.split(","):
        if phase == "no-autotune":
          if "xla" in impls and entry in ("operator", "layer"):
            records += _phase(phase, cache2, [*entry_common, "--impls", "xla"], save)
        else:
          records += _phase(phase, cache, [*entry_common, "--impls", args.impls], save)
        save([])
        print(f"{entry}: phase {phase} done", flush=True)

  print(f"{'entry':9} {'impl':6} {'r':>2} {'mode':6} {'phase':12} {'trace':>6} {'lower':>6} "
        f"{'compile':>7} {'first':>7} kernels")  # fmt: skip
  for rec in records:
    if "error" in rec:
      print(
        rec.get("entry", ""), rec.get("impl", ""), rec.get("r") or "", rec.get("mode", ""),
        rec.get("phase"), "ERROR", rec["error"][:200],
      )  # fmt: skip
      continue
    print(
      f"{rec['entry']:9} {rec['impl']:6} {rec['r'] or '':>2} {rec['mode']:6} {rec['phase']:12} "
      f"{rec.get('trace_s', 0):6.1f} {rec.get('lower_s', 0):6.1f} {rec.get('compile_s', 0):7.1f} "
      f"{rec.get('first_call_s', 0):7.1f} {rec.get('pallas_kernels', '')}"
      + (f" run {rec['run_ms']:.3f} ms" if "run_ms" in rec else "")
      + "".join(f" {c['target']} {c['chars'] / 1e3:.0f}k" for c in rec.get("kernel_calls", ()))
    )
    for prog in rec.get("programs", ()):  # generate: its programs
      print(
        f"  {prog['program']:8} trace {prog.get('trace_s', 0):5.2f} lower "
        f"{prog.get('lower_s', 0):5.2f} backend compile {prog.get('backend_compile_s', 0):6.2f} "
        f"kernels {prog.get('pallas_kernels', '-')} dots {prog.get('dot_general', '-')} "
        f"fusions {prog.get('fusions', '-')} gemms {prog.get('gemm_custom_calls', '-')}"
        f"+{prog.get('triton_gemm_fusions', '-')}"
      )


if __name__ == "__main__":
  main()
