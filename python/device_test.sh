#!/usr/bin/env bash
# Builds the Python package with the CUDA backend and runs tests/python on the GPU machine.
# Usage (repository root):  bash python/device_test.sh [build|test|all]   (default: all)
# The package goes to build-py/site-cuda (an ignored folder, kept between calls on a warm
# machine); the pytest log goes to $OUT/python-tests-<gpu>.txt when $OUT is set.
set -euo pipefail
cd "$(dirname "$0")/.."
phase="${1:-all}"
site=build-py/site-cuda
if [ "$phase" = build ] || [ "$phase" = all ]; then
  start=$(date +%s)
  FLASHPORT_CUDA=1 FLASHPORT_CUDA_ARCHS="${FLASHPORT_CUDA_ARCHS:-90}" \
    python3 -m pip install -q --disable-pip-version-check --no-build-isolation --no-deps \
    --upgrade --target "$site" .
  echo "== built in $(( $(date +%s) - start )) s"
fi
if [ "$phase" = test ] || [ "$phase" = all ]; then
  gpu=$({ nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null || true; } | head -1 | tr ' ' '-')
  log="${OUT:-build-py}/python-tests-${gpu:-nogpu}.txt"
  {
    echo "# tests/python on ${gpu:-no GPU}, $(date -u +%FT%TZ), commit ${FP_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo ?)}"
    echo "# command: bash python/device_test.sh $phase"
    PYTHONPATH="$site" python3 -c "import flashport, torch; print('backends:', [b.name for b in flashport.available_backends()], 'torch', torch.__version__, 'cuda', torch.cuda.is_available())"
    PYTHONPATH="$site" python3 -m pytest -q -rxs tests/python
  } 2>&1 | tee "$log"
  exit "${PIPESTATUS[0]}"
fi
