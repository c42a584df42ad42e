#!/usr/bin/env bash
# Several GPUs (gdp_jax.sharding): the sharding checks on the real devices with the compiled
# Pallas kernels, and `python -m benchmarks.bench --devices N` at the H200 shape.
#
#   scripts/multi_gpu_check.sh [checks] [partition] [bench] [all]   (default: all)
#
#   checks  tests/sharding_checks.py --real --impl pallas: the sharded operator (forward, final
#           state, every gradient; r = 1, 2, 4; every mask shape), the step, the layer with the
#           sequence split and a hybrid training step against one device, and the compiled
#           programs' collectives. Layouts shrink to the GPUs there are (8 simulated CPU devices
#           in CI; here 2 GPUs give batch 2 / heads 2 / sequence 2 splits).
#   partition  tests/partitioning_checks.py --real: plain jax.jit on inputs sharded over batch and
#           heads, the compiled kernels per device (operator with gradients, step, GQA decode);
#           cases that need more GPUs than there are are skipped.
#   bench   one device, batch/head parallel and context parallel over all N GPUs, r = 1, 2, 4,
#           bf16, forward and forward + backward (BENCH_ARGS adds flags, e.g. --rs 1)
# Everything lands in $OUT (default /tmp/gdp_multi_gpu_out). A device command may run 10
# minutes at most: call the script one section at a time.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/gdp_multi_gpu_out}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
PY="${PY:-python3}"
sections="${*:-all}"
want() { [[ " $sections " == *" all "* || " $sections " == *" $1 "* ]]; }

{
  date
  nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv
  nvidia-smi topo -m 2>/dev/null | head -12
  "$PY" -c "import jax; print('jax', jax.__version__, jax.devices())"
} 2>&1 | tee "$OUT/env.txt"
N=$("$PY" -c "import jax; print(jax.device_count())" 2>/dev/null | tail -1)

status=0
if want checks; then
  "$PY" tests/sharding_checks.py --real --impl pallas ${CHECK_GROUPS:-operator_a operator_b \
      step model bench} 2>&1 | tee "$OUT/sharding_checks.jsonl" \
      | grep '"group"' | cut -c1-300
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
if want partition; then
  "$PY" tests/partitioning_checks.py --real 2>&1 | tee "$OUT/partitioning_checks.jsonl" \
      | grep '"name"' | cut -c1-300
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
if want bench; then
  "$PY" -m benchmarks.bench --devices "$N" --shape 8,4096,16,128,128 --rs 1,2,4 --impls pallas \
      --modes fwd,fwdbwd --no-progress --out "$OUT/bench_devices.json" ${BENCH_ARGS:-} \
      2>&1 | tee "$OUT/bench_devices.log" | grep -v "^E[0-9]" | tail -30
fi
exit $status
