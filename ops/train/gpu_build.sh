#!/usr/bin/env bash
# The shipped default model's build, in ONE device call from the repository root (H100 / H200:
# about 8.5 min; training stops at TIME_BUDGET seconds whatever the step count):
#     bash ops/train/gpu_build.sh
# VARIANTS="name:ARGS|name:ARGS..." trains several recipes side by side on the one GPU (each
# process leaves it mostly idle: the step is launch-bound) and keeps the one with the best held-out
# accuracy; extra arguments go to every variant. BUILD_LIMIT kills a run whose held-out evaluation
# outlasts the call (the checkpoint is written before the evaluation, so it still comes back).
# $OUT receives at most 5 files (the GPU tool returns 8 of <= 16 MiB): the chosen bf16 shards
# (<= 15 MiB each), meta.tar (config, tokenizer, chat template, preprocessor config, index,
# eval.json with the recipe's arguments) and train.log (every variant's log). Install them with
# ops/train/install_default.sh FOLDER.
set -euo pipefail
OUT=${OUT:?set OUT}
PY=${PYTHON:-python3}
build=$(mktemp -d)
IFS='|' read -ra variants <<< "${VARIANTS:-default:}"
for v in "${variants[@]}"; do
  name=${v%%:*}
  # shellcheck disable=SC2086  # a variant's arguments split on spaces
  timeout "${BUILD_LIMIT:-560}" "$PY" -m ops.train.train_default --out "$build/$name" --seed 0 \
    --steps 4000 --time-budget "${TIME_BUDGET:-455}" ${v#*:} "$@" \
    > "$build/$name.log" 2>&1 &
done
wait || true
for v in "${variants[@]}"; do
  name=${v%%:*}
  echo "=== variant $name: ${v#*:}"
  cat "$build/$name.log"
done | tee "$OUT/train.log"
best=$("$PY" - "$build" "${variants[@]%%:*}" <<'PICK'
import json, pathlib, sys
root, names = pathlib.Path(sys.argv[1]), sys.argv[2:]
def score(name):
    report = root / name / "eval.json"
    done = any((root / name).glob("*.safetensors"))
    return (done, json.loads(report.read_text())["overall"] if report.exists() else -1.0)
print(max(names, key=score))
PICK
)
echo "=== kept variant $best" | tee -a "$OUT/train.log"
cp "$build/$best"/*.safetensors "$OUT"/
tar -C "$build/$best" -cf "$OUT/meta.tar" --exclude='*.safetensors' .
ls -l "$OUT"
