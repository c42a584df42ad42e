#!/usr/bin/env bash
# The project's GPU run, on a machine with an NVIDIA GPU (CI never has one).
#
#   scripts/gpu_check.sh [tests] [matrix] [bench] [stages] [memory] [decode] [all]  (default: all)
#
#   tests   the kernel tests with compiled kernels (the tests CI runs in interpret mode, plus
#           the large shapes marked gpu_only); compiling every small variant takes minutes
#   matrix  scripts/gpu_matrix.py: every dtype x (K, V) x r x mask shape compiled, forward and
#           gradients against "xla", compile times (persistent cache in .jax_cache/: a second
#           run on the same machine takes minutes); MATRIX_ARGS slices it (e.g. "--only r=8",
#           "--shard 0/2", "--time-limit 540")
#   bench   `python -m gdp_jax bench`: forward and forward + backward at the H200 shape, ours
#           side by side with flash-linear-attention and jax-linear-attention (from .whl/)
#   stages  each forward and backward kernel timed alone (benchmarks/profile_stages.py)
#   memory  peak GPU memory of one training step (benchmarks/memory_step.py)
#   decode  gqa_decode and the recurrent step (benchmarks/bench_decode.py)
# Everything lands in $OUT (default /tmp/gdp_gpu_out): logs and JSON files. Sections can be run
# a few at a time where commands are time-limited.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/gdp_gpu_out}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
PY="${PY:-python3}"
sections="${*:-all}"
want() { [[ " $sections " == *" all "* || " $sections " == *" $1 "* ]]; }

if ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/gdp_site .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/gdp_site"
fi
{
  date
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used,memory.total --format=csv
  "$PY" -c "import jax, jaxlib; print('jax', jax.__version__, jax.devices())"
  "$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" 2>&1
} | tee "$OUT/env.txt"

status=0
if want tests; then
  "$PY" -m pytest -q -p no:cacheprovider -W ignore::DeprecationWarning --durations=10 \
      tests/test_pallas_forward.py tests/test_pallas_backward.py tests/test_decode.py \
      tests/test_step.py ${TEST_ARGS:-} 2>&1 | tee "$OUT/pytest.log" | grep -v "^E[0-9]" | tail -40
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
if want matrix; then
  "$PY" scripts/gpu_matrix.py --out "$OUT/gpu_matrix.json" ${MATRIX_ARGS:-} 2>&1 \
      | tee "$OUT/gpu_matrix.log" | grep -v "^E[0-9]" | tail -60
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
if want bench; then
  "$PY" -m gdp_jax bench --shape 8,4096,16,128,128 --rs 1,2,4 --impls pallas,fla,jla,xla \
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
exit $status
