#!/usr/bin/env bash
# The project's GPU run, on a machine with an NVIDIA GPU (CI never has one).
#
#   scripts/gpu_check.sh SECTION...   (default: all; `scripts/gpu_check.sh list` names them)
#
# Each section below is sized to finish in one 10-minute command on a cold cache (one H200):
#   tests           the kernel tests with compiled kernels (the tests CI runs in interpret mode,
#                   plus the large shapes marked gpu), in TEST_JOBS pytest processes (pytest-xdist)
#   tests-forward   tests/test_pallas_forward.py only   } the same tests as `tests`, in three
#   tests-backward  tests/test_pallas_backward.py only  } parts, for a slower machine
#   tests-decode    tests/test_decode.py, tests/test_paged_decode.py, tests/test_step.py only
#   matrix          scripts/gpu_matrix.py over the issue's matrix: dtype {bf16, f16, f32 (TF32,
#                   the default precision)} x K = V in {16, 32, 64, 128, 256} x r in {1, 2, 4, 8}
#                   x mask shape, forward and gradients against "xla", compile times, in
#                   MATRIX_JOBS processes
#   matrix-ieee     the same dims and r for float32 at precision "ieee" (the rest of
#   matrix-dims     gpu_matrix.py's default plan, in two parts: K = V = 96 and the K != V pairs,
#                   every dtype and precision; a second run, from the cache, finishes what the
#                   time limit left)
#   bench           `python -m benchmarks.bench`: forward and forward + backward at the H200 shape,
#                   ours side by side with flash-linear-attention and jax-linear-attention
#   stages          each forward and backward kernel timed alone (benchmarks/profile_stages.py)
#   memory          peak GPU memory of one training step (benchmarks/memory_step.py)
#   decode          gqa_decode and the recurrent step (benchmarks/bench_decode.py)
#   compile         the compile-time profile (benchmarks/compile_profile.py, COMPILE_ARGS; its
#                   own cold and warm caches; the whole default profile takes longer than 10 min)
#   compile-generate  the part of it sized for a few minutes: HybridLM.generate's first call split
#                   per program as shipped (cold and warm: short prompts read by the decode step in
#                   the decode loop's program), and cold with the chunked prefill (prefill and
#                   decode loop) as shipped, with XLA's GEMM autotuner off in both programs and
#                   with the Triton chunk_fwd's row-block loop from 64 rows; and chunk_fwd's two
#                   forms alone at r = 1, 2, 4 (compile and run time)
#   packed          packed sequences on the Hopper kernels (`implementation="mosaic_gpu"`, forward and
#                   backward) against xla and timed beside the unpacked call and flash-linear-
#                   attention (benchmarks/bench_varlen.py --impl mosaic_gpu), then the Householder
#                   form with 64 packed sequences (benchmarks/bench_householder.py --packed 64)
#   reproducible    bitwise reproducibility of "mosaic_gpu" and "triton" compiled: two runs, and a
#                   row alone vs within a batch, outputs and gradients
#                   (scripts/check_reproducible_gpu.py, docs/precision.md#reproducibility)
#   serving         block states and the verify step (benchmarks/bench_serving.py), then generate
#                   with a prefix cache and the speculative example (benchmarks/bench_prefix_cache.py)
#   qwen            Qwen3.5 against transformers on this GPU (scripts/check_qwen3_5_gpu.py; with
#                   flash-linear-attention installed transformers takes its Triton kernels), then
#                   the Qwen3.5-shaped layer timed against the JAX model zoos' core
#                   (benchmarks/bench_qwen3_5_layer.py)
#   all             tests matrix bench stages memory decode (several commands' worth)
#
# Compilation: every section uses jax's persistent compilation cache in .jax_cache/ in the
# repository (git-ignored; JAX_CACHE_DIR= to move it, JAX_CACHE_DIR=off for none), so a second
# run loads what the first compiled. The correctness sections (tests*, matrix*) turn XLA's GEMM
# autotuner off (`--xla_gpu_autotune_level=0`: the jnp references' large fusions otherwise spend
# minutes in it; the Pallas kernels are not autotuned by XLA, and the results are the same at the
# same precision); XLA_AUTOTUNE=default keeps XLA's default there. A pytest or matrix section
# stops itself after SECTION_TIME_LIMIT seconds (default 540) and keeps what it finished.
# Everything lands in $OUT (default /tmp/gdp_gpu_out): logs and JSON files. Extra arguments:
# TEST_ARGS (pytest), MATRIX_ARGS (gpu_matrix.py, e.g. "--only r=8", or "--against reference":
# the jnp recurrence as the reference, a smaller program to compile than "xla"), BENCH_ARGS,
# COMPILE_ARGS; TEST_JOBS (default half the cores, at most 8), MATRIX_JOBS (the cores, at most 16).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/gdp_gpu_out}"
PY="${PY:-python3}"
SECTIONS_KNOWN="tests tests-forward tests-backward tests-decode matrix matrix-ieee matrix-dims"
SECTIONS_KNOWN+=" bench stages memory decode compile compile-generate packed reproducible"
SECTIONS_KNOWN+=" serving qwen"
sections="${*:-all}"
if [[ " $sections " == *" list "* ]]; then
  echo "$SECTIONS_KNOWN all"
  exit 0
fi
for s in $sections; do
  if [[ " $SECTIONS_KNOWN all " != *" $s "* ]]; then
    echo "gpu_check.sh: unknown section '$s' (known: $SECTIONS_KNOWN all)" >&2
    exit 64
  fi
done
want() { [[ " $sections " == *" $1 "* ]] || { [[ " $sections " == *" all "* ]] && [[ " tests matrix bench stages memory decode " == *" $1 "* ]]; }; }

mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
# Several processes share the GPU (pytest-xdist, gpu_matrix.py --jobs): no process may take it
# all up front.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
JAX_CACHE_DIR="${JAX_CACHE_DIR:-$PWD/.jax_cache}"
if [ "$JAX_CACHE_DIR" != off ]; then
  mkdir -p "$JAX_CACHE_DIR"
  export JAX_COMPILATION_CACHE_DIR="$JAX_CACHE_DIR"
  export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
  export JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=0
fi
SECTION_TIME_LIMIT="${SECTION_TIME_LIMIT:-540}"
CPUS="$(nproc 2>/dev/null || echo 2)"
JOBS_DEFAULT=$((CPUS / 2 < 1 ? 1 : (CPUS / 2 > 8 ? 8 : CPUS / 2)))
TEST_JOBS="${TEST_JOBS:-$JOBS_DEFAULT}"
# the matrix's shapes are tiny (compile-bound): one process per core, at most 16
MATRIX_JOBS="${MATRIX_JOBS:-$((CPUS > 16 ? 16 : CPUS))}"
# The correctness sections' XLA flags (the autotuner off unless XLA_AUTOTUNE=default).
CHECK_XLA_FLAGS="${XLA_FLAGS:-}"
if [ "${XLA_AUTOTUNE:-off}" != default ]; then
  CHECK_XLA_FLAGS="$CHECK_XLA_FLAGS --xla_gpu_autotune_level=0"
fi

if ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/gdp_site .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/gdp_site"
fi
{
  date
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used,memory.total --format=csv
  "$PY" -c "import jax, jaxlib; print('jax', jax.__version__, jax.devices())"
  "$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" 2>&1
  echo "sections: $sections; cache: $JAX_CACHE_DIR; correctness XLA_FLAGS: $CHECK_XLA_FLAGS"
  echo "cpus: $CPUS; TEST_JOBS=$TEST_JOBS MATRIX_JOBS=$MATRIX_JOBS SECTION_TIME_LIMIT=$SECTION_TIME_LIMIT"
} | tee "$OUT/env.txt"

status=0
# run_pytest NAME FILE...: the files' tests, compiled, in TEST_JOBS processes when pytest-xdist
# is installed; stopped (with pytest's summary) at SECTION_TIME_LIMIT.
run_pytest() {
  local name="$1"
  shift
  local parallel=()
  if [ "$TEST_JOBS" -gt 1 ] && "$PY" -c "import xdist" >/dev/null 2>&1; then
    parallel=(-n "$TEST_JOBS" --dist worksteal)
  fi
  local t0=$SECONDS
  XLA_FLAGS="$CHECK_XLA_FLAGS" timeout --signal=INT --kill-after=30 "$SECTION_TIME_LIMIT" \
    "$PY" -m pytest -q -p no:cacheprovider -W ignore::DeprecationWarning --durations=15 \
    ${parallel[@]+"${parallel[@]}"} "$@" ${TEST_ARGS:-} 2>&1 | tee "$OUT/pytest_$name.log" | grep -v "^E[0-9]" \
    | tail -40
  local rc="${PIPESTATUS[0]}"
  echo "section $name: exit $rc in $((SECONDS - t0)) s" | tee -a "$OUT/sections.txt"
  [ "$rc" -eq 0 ] || status=1
}
# run_matrix NAME ARGS...: scripts/gpu_matrix.py with ARGS, in MATRIX_JOBS processes.
run_matrix() {
  local name="$1"
  shift
  local t0=$SECONDS
  XLA_FLAGS="$CHECK_XLA_FLAGS" "$PY" scripts/gpu_matrix.py --out "$OUT/$name.json" \
    --jobs "$MATRIX_JOBS" --time-limit $((SECTION_TIME_LIMIT - 60)) \
    --cache-dir "$([ "$JAX_CACHE_DIR" = off ] && echo "" || echo "$JAX_CACHE_DIR")" \
    "$@" ${MATRIX_ARGS:-} 2>&1 | tee "$OUT/$name.log" | grep -v "^E[0-9]" | tail -60
  local rc="${PIPESTATUS[0]}"
  echo "section $name: exit $rc in $((SECONDS - t0)) s" | tee -a "$OUT/sections.txt"
  [ "$rc" -eq 0 ] || status=1
}

KERNEL_TESTS=(tests/test_pallas_forward.py tests/test_pallas_backward.py tests/test_decode.py
  tests/test_step.py)
MATRIX_DIMS="16,32,64,128,256"
if want tests; then
  run_pytest tests "${KERNEL_TESTS[@]}"
fi
if want tests-forward; then
  run_pytest tests-forward tests/test_pallas_forward.py
fi
if want tests-backward; then
  run_pytest tests-backward tests/test_pallas_backward.py
fi
if want tests-decode; then
  run_pytest tests-decode tests/test_decode.py tests/test_paged_decode.py tests/test_step.py
fi
if want matrix; then
  run_matrix gpu_matrix --dims "$MATRIX_DIMS" --precisions tf32
fi
if want matrix-ieee; then
  run_matrix gpu_matrix_ieee --dims "$MATRIX_DIMS" --dtype f32 --precisions ieee
fi
if want matrix-dims; then
  run_matrix gpu_matrix_dims --dims "96,64:128,128:64,256:64,32:96"
fi
if want bench; then
  "$PY" -m benchmarks.bench --shape 8,4096,16,128,128 --rs 1,2,4 --impls pallas,fla,jla,xla \
      --modes fwd,fwdbwd --no-progress --out "$OUT/bench_operator.json" ${BENCH_ARGS:-} \
      2>&1 | tee "$OUT/bench_operator.log" | grep -v "^E[0-9]" | tail -40
fi
if want stages; then
  "$PY" benchmarks/profile_stages.py --out "$OUT/stages.json" 2>&1 | grep -v "^E[0-9]" \
      | tee "$OUT/stages.log"
fi
if want memory; then
  "$PY" benchmarks/memory_step.py --out "$OUT/memory.json" 2>&1 | tee "$OUT/memory.log"
fi
if want decode && [ -f benchmarks/bench_decode.py ]; then
  "$PY" benchmarks/bench_decode.py --out "$OUT/bench_decode.json" 2>&1 \
      | tee "$OUT/bench_decode.log" | tail -30
fi
if want compile-generate; then
  t0=$SECONDS
  "$PY" benchmarks/compile_profile.py --out "$OUT/compile_generate.json" --impls pallas \
      --entries generate --phases cold,warm 2>&1 \
      | tee "$OUT/compile_generate.log" | grep -v "^E[0-9]" | tail -8
  "$PY" benchmarks/compile_profile.py --out "$OUT/compile_generate_variants.json" \
      --impls pallas --phases cold \
      --entries generate-chunked,generate-no-autotune,generate-loop-forward 2>&1 \
      | tee "$OUT/compile_generate_variants.log" | grep -v "^E[0-9]" | tail -12
  "$PY" benchmarks/compile_profile.py --out "$OUT/compile_chunk_fwd.json" --entries chunk-fwd \
      --rs 1,2,4 --phases cold 2>&1 | tee "$OUT/compile_chunk_fwd.log" | grep -v "^E[0-9]" | tail -14
  echo "section compile-generate: done in $((SECONDS - t0)) s" | tee -a "$OUT/sections.txt"
fi
if want packed; then
  "$PY" benchmarks/bench_varlen.py --impl mosaic_gpu --reps 7 --inner 3 \
      --time-limit $((SECTION_TIME_LIMIT / 2)) --out "$OUT/varlen_mosaic.json" 2>&1 \
      | tee "$OUT/varlen_mosaic.log" | grep -v "^E[0-9]" | tail -40
  timeout --signal=INT $((SECTION_TIME_LIMIT / 2)) "$PY" benchmarks/bench_householder.py \
      --nh 2,4 --packed 64 --impl mosaic_gpu --reps 5 --no-extras \
      --out "$OUT/householder_packed_mosaic.json" 2>&1 | grep -v "^E[0-9]" | tail -12
fi
if want compile; then
  "$PY" benchmarks/compile_profile.py --out "$OUT/compile_profile.json" ${COMPILE_ARGS:-} 2>&1 \
      | tee "$OUT/compile_profile.log" | tail -40
fi
if want serving; then
  timeout --signal=INT $((SECTION_TIME_LIMIT / 2)) "$PY" benchmarks/bench_serving.py \
      --reps 10 --inner 5 --out "$OUT/bench_serving.json" 2>&1 \
      | tee "$OUT/bench_serving.log" | grep -v "^E[0-9]" | tail -12
  timeout --signal=INT $((SECTION_TIME_LIMIT / 2)) "$PY" benchmarks/bench_prefix_cache.py \
      --reps 3 --out "$OUT/prefix_cache.json" 2>&1 | tee "$OUT/prefix_cache.log" | tail -12
fi
if want qwen; then
  timeout --signal=INT $((SECTION_TIME_LIMIT * 2 / 3)) "$PY" scripts/check_qwen3_5_gpu.py \
      --out "$OUT/qwen3_5_gpu.json" 2>&1 | tee "$OUT/qwen3_5_gpu.log" | tail -6
  timeout --signal=INT $((SECTION_TIME_LIMIT / 3)) "$PY" benchmarks/bench_qwen3_5_layer.py \
      --out "$OUT/bench_qwen3_5_layer.json" 2>&1 | tail -6
fi
if want reproducible; then
  t0=$SECONDS
  timeout --signal=INT --kill-after=30 "$SECTION_TIME_LIMIT" "$PY" \
      scripts/check_reproducible_gpu.py --out "$OUT/reproducible.json" 2>&1 \
      | tee "$OUT/reproducible.log" | grep -v "^E[0-9]" | tail -12
  rc="${PIPESTATUS[0]}"
  echo "section reproducible: exit $rc in $((SECONDS - t0)) s" | tee -a "$OUT/sections.txt"
  [ "$rc" -eq 0 ] || status=1
fi
exit $status
