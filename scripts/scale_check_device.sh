#!/usr/bin/env bash
# The scale check on a lent 16-core machine (no Java, no network): one prepared command.
#   run: bash scripts/scale_check_device.sh      (writes under $OUT; ends within ~8 min)
# What the machine lacks travels as wheels in device-wheels/ (carry it): fetch them here with
#   pip download --only-binary :all: --python-version 3.12 -d device-wheels scipy
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench-out/scale}
mkdir -p "$OUT"
for pair in scipy:scipy yaml:pyyaml PIL:pillow; do  # module:package
  if ! python -c "import ${pair%%:*}" 2>/dev/null; then
    pip install --quiet --no-index --find-links device-wheels "${pair#*:}"
  fi
done
lscpu > "$OUT/lscpu.txt" 2>&1 || true
# Budgets sized for 16 cores and two full-size models in ~8 minutes.
PYTHONPATH=$PWD timeout 500 python -m packrat.bench.scale --out "$OUT" --models resnet50,bert-base \
  --profile-budget-s 100 --point-budget-s 2 --measure-s 2 --rounds 2
