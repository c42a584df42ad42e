#!/usr/bin/env bash
# The project's GPU run (NVIDIA H200 through the device tool; CI never has a GPU).
#
#   scripts/gpu_check.sh [tests] [bench] [decode] [all]    (default: all)
#
# Runs the test suite with compiled kernels (the same tests CI runs in interpret mode, plus the
# large shapes marked gpu_only) and the benchmarks, side by side with the peers installed from
# wheels in .whl/ (flash-linear-attention, jax-linear-attention; see README "GPU checks").
# Everything lands in $OUT (default /tmp/gdp_gpu_out): pytest logs, benchmark JSON files.
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
  "$PY" -m pytest -q -p no:cacheprovider -W ignore::DeprecationWarning tests \
      2>&1 | tee "$OUT/pytest.log" | tail -40
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
if want bench; then
  "$PY" benchmarks/bench_operator.py --out "$OUT/bench_operator.json" ${BENCH_ARGS:-} \
      2>&1 | tee "$OUT/bench_operator.log" | grep -v "^E[0-9]" | tail -40
fi
if want decode && [ -f benchmarks/bench_decode.py ]; then
  "$PY" benchmarks/bench_decode.py --out "$OUT/bench_decode.json" 2>&1 \
      | tee "$OUT/bench_decode.log" | tail -30
fi
exit $status
