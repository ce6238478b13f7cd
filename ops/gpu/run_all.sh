#!/usr/bin/env bash
# One GPU session: model checks with the Triton kernels, then the static MTP benchmark on real
# configs (dummy weights). Results land in $OUT (or ./gpu-out).
set -u
OUT=${OUT:-./gpu-out}; mkdir -p "$OUT"
SITE=$(mktemp -d)
# msgspec (our message types) is not on the GPU machine: carried as a wheel in .gpu-payload/
python3 -m pip install -q --no-index --no-deps --target "$SITE" .gpu-payload/*.whl
export PYTHONPATH=$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
git rev-parse HEAD 2>/dev/null | tee "$OUT/commit.txt"
timeout ${CHECK_S:-150} python ops/gpu/check_model.py 2>&1 | grep -v "^\[transformers\]" | tee "$OUT/check_model.txt"
for cfg in ${CONFIGS:-qwen3_5_27b qwen3_5_35b_a3b}; do
  timeout ${BENCH_S:-170} python ops/bench/bench_static.py --config ops/bench/configs/$cfg.json \
    --batch 1 16 64 --mtp 0 1 2 3 --prompt-len 256 --steps 6 --json "$OUT/static_$cfg.json" \
    2>&1 | grep -v " INFO " | tee "$OUT/static_$cfg.txt"
done
