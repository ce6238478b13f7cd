#!/usr/bin/env bash
# GPU check for appliance_kernels/: the kernel tests (small and full-size `gpu` cases) and the per-op benchmark.
# Run on the H200 machine from the repo root: `bash ops/gpu/check_kernels.sh`; logs and the benchmark
# table go to $OUT (default /tmp/kernel-check). Optional peers: wheels in .cache/gpu-wheels/ (e.g.
# fla-core) are installed into a private site dir first.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/kernel-check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
if ls .cache/gpu-wheels/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/kernel-site \
    .cache/gpu-wheels/*.whl && export PYTHONPATH=$PWD:/tmp/kernel-site
fi
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
date -u +"date %Y-%m-%dT%H:%MZ"
# --confcutdir: the repo-wide conftest builds tiny checkpoints the kernel tests do not need
timeout "${TEST_TIMEOUT:-240}" python3 -m pytest tests/kernels -q -p no:cacheprovider \
  --confcutdir=tests/kernels -rfE --durations=15 ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/tests.log"
echo "tests exit ${PIPESTATUS[0]}"
timeout "${BENCH_TIMEOUT:-300}" python3 ops/bench/bench_ops.py --out "$OUT/bench.md" ${BENCH_ARGS:-} \
  2>&1 | tee "$OUT/bench.log"
echo "bench exit ${PIPESTATUS[0]}"
