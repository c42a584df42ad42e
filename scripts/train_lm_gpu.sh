#!/usr/bin/env bash
# The train-lm comparison on one GPU: attention only, Gated DeltaNet, the block mask r = 2 and
# r = 4, and the Householder DeltaProduct (n_h = 2), each with the h200 preset and the same budget.
#
#   scripts/train_lm_gpu.sh OUT [--steps N | --minutes M] [--models "attention gdn ..."] [FLAGS]
#
#   OUT        folder for the results: OUT/<model>/metrics.json, curves.png, train.log, then
#              OUT/compare.png and OUT/compare.txt over every OUT/*/metrics.json there
#   --steps N  the same number of steps (the same tokens) for every model (default: the
#              preset's 1500)
#   --minutes M  instead: the same training time for every model (steps set per model from
#              its timed step; compilation and evaluation not counted)
#   --models   a subset, e.g. --models "gdn gdp-r2" (one command may be time-limited: run the
#              models in several calls with the same OUT; the comparison covers all of them)
#   FLAGS      passed on to `python -m examples.byte_lm` (e.g. --batch-size 16, --peak-tflops)
# Checkpoints are off (a 117M model's checkpoint is 1.4 GB); CKPT=1 keeps them in
# OUT/<model>/checkpoints. PY=python3 the interpreter; PRESET=tiny runs the same on a CPU in
# a few minutes (a smoke test of the script).
set -uo pipefail
if [ $# -lt 1 ] || [[ "$1" == -* ]]; then
  sed -n '2,21p' "$0"
  exit 2
fi
OUT="$1"
shift
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
PY="${PY:-python3}"
PRESET="${PRESET:-h200}"
models="attention gdn gdp-r2 gdp-r4 dp-2"
budget=()
extra=()
while [ $# -gt 0 ]; do
  case "$1" in
    --steps|--minutes) budget=("$1" "$2"); shift 2 ;;
    --models) models="$2"; shift 2 ;;
    *) extra+=("$1"); shift ;;
  esac
done
ckpt=(--no-checkpoint)
[ "${CKPT:-0}" = "1" ] && ckpt=(--checkpoint)
mkdir -p "$OUT"
{
  date
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>/dev/null
  "$PY" -c "import jax, flax, optax; print('jax', jax.__version__, jax.devices(),
             'flax', flax.__version__, 'optax', optax.__version__)"
} | tee "$OUT/env.txt"

status=0
for model in $models; do
  echo "== $model"
  mkdir -p "$OUT/$model"
  "$PY" -m examples.byte_lm --preset "$PRESET" --model "$model" --out "$OUT/$model" \
      ${budget[@]+"${budget[@]}"} "${ckpt[@]}" ${extra[@]+"${extra[@]}"} 2>&1 \
      | tee "$OUT/$model/train.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
done
shopt -s nullglob
runs=("$OUT"/*/metrics.json)
if [ ${#runs[@]} -gt 0 ]; then
  "$PY" -m examples.byte_lm --compare "${runs[@]}" --out "$OUT" | tee "$OUT/compare.txt"
fi
exit $status
