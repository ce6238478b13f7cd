#!/usr/bin/env bash
# What users see: `appliance serve MODEL_DIR --load-format dummy` on the GPU, then
# ops/bench/bench_serving.py at each concurrency (random prompts, fixed lengths, ignore_eos).
#   MODEL_DIR=.cache/serve27b CONCURRENCY="1 16 64" TTFT_LENS="1024 8192" TAG=27b \
#     bash ops/gpu/serve_bench.sh
# MODEL_DIR holds config.json, the tokenizer and generation_config.json; SERVE_ARGS pass through,
# BENCH_EXTRA to bench_serving.py (e.g. "--temperature 0.7 --top-k 20 --top-p 0.95").
# Structured outputs (issue 18): FORMATS="text json_schema" runs every concurrency once per format
# (bench_serving --response-format; json files get a _json_schema suffix), then the grammar compile
# benchmark (ops/bench/bench_grammar.py) on MODEL_DIR's tokenizer.
set -u
OUT=${OUT:-./gpu-out}
TAG=${TAG:-serve}
PORT=${PORT:-8123}
log="$OUT/serve_$TAG.log"
python3 -m appliance.cli serve "$MODEL_DIR" --load-format dummy --no-vision --port "$PORT" \
  --max-num-seqs 64 ${SERVE_ARGS:-} >"$log" 2>&1 &
pid=$!
t0=$SECONDS
healthy() { python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$PORT/health', timeout=2)" 2>/dev/null; }
until healthy; do
  if ! kill -0 $pid 2>/dev/null; then echo "server exited"; tail -30 "$log"; exit 1; fi
  if [ $((SECONDS - t0)) -gt "${START_S:-240}" ]; then echo "not ready"; tail -30 "$log"; kill $pid; exit 1; fi
  sleep 1
done
echo "ready in $((SECONDS - t0)) s"; grep -E "memory:|CUDA graphs:|ready in" "$log" | cut -c1-200
nvidia-smi --query-gpu=memory.used,memory.total --format=csv,noheader  # the device while serving
for fmt in ${FORMATS:-text}; do
  sfx=""; [ "$fmt" != text ] && sfx="_$fmt"
  for c in ${CONCURRENCY:-1 16}; do
    n=$(( c < 4 ? 4 : 2 * c ))
    [ "$c" -ge 64 ] && n=$c
    python3 ops/bench/bench_serving.py --base-url "http://127.0.0.1:$PORT" --concurrency "$c" \
      --num-prompts "$n" --input-len "${INPUT_LEN:-1024}" --output-len "${OUTPUT_LEN:-256}" \
      --vocab-size 240000 --ignore-eos --warmup 1 --response-format "$fmt" ${BENCH_EXTRA:-} \
      --json "$OUT/serving_${TAG}${sfx}_c$c.json" 2>&1 | tail -16
  done
done
for len in ${TTFT_LENS:-}; do  # prefill-bound: TTFT of one long prompt at a time
  python3 ops/bench/bench_serving.py --base-url "http://127.0.0.1:$PORT" --concurrency 1 \
    --num-prompts 3 --input-len "$len" --output-len 8 --vocab-size 240000 --ignore-eos \
    --warmup 1 --json "$OUT/serving_${TAG}_ttft$len.json" 2>&1 | grep -E "TTFT|completed"
done
kill -TERM $pid; wait $pid
echo "server exit $?"
case " ${FORMATS:-text} " in *" json"*)
  PYTHONPATH=".:${PYTHONPATH:-}" python3 ops/bench/bench_grammar.py --tokenizer "$MODEL_DIR" --fields 500 \
    --json "$OUT/grammar_compile_$TAG.json" ;;
esac
