#!/usr/bin/env bash
# The shipped default model's build, in ONE device call from the repository root (H200: about
# 6-7 min; training stops at --time-budget seconds whatever the step count):
#     bash ops/train/gpu_build.sh
# $OUT receives at most 5 files (the GPU tool returns 8 of <= 16 MiB): the bf16 shards (<= 15 MiB
# each), meta.tar (config, tokenizer, chat template, preprocessor config, index, eval.json) and
# train.log. Install them with ops/train/install_default.sh FOLDER.
set -euo pipefail
OUT=${OUT:?set OUT}
build=$(mktemp -d)
# BUILD_LIMIT kills a run whose held-out evaluation outlasts the call; the checkpoint is written
# before the evaluation, so its files still come back (evaluate them with ops/train/evaluate.py).
timeout "${BUILD_LIMIT:-560}" "${PYTHON:-python3}" -m ops.train.train_default --out "$build/default" \
    --seed 0 --steps 4000 --batch-size 128 --time-budget "${TIME_BUDGET:-330}" "$@" 2>&1 \
    | tee "$OUT/train.log" || echo "train_default ended early (exit $?)" | tee -a "$OUT/train.log"
cp "$build"/default/*.safetensors "$OUT"/
tar -C "$build/default" -cf "$OUT/meta.tar" --exclude='*.safetensors' .
ls -l "$OUT"
