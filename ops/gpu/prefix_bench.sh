#!/usr/bin/env bash
# Prefix caching on the GPU (issue 16): `appliance serve MODEL_DIR --load-format dummy` with prefix
# caching, then ops/bench/bench_prefix.py hitmiss (TTFT of an 8k shared prefix + 128 new tokens,
# hit vs miss) and replay (32 conversations x 5 turns, ~1k new tokens per turn; token ids through
# /v1/completions, then messages through /v1/chat/completions); then the token-id replay (and the
# misses) against a server started with --no-prefix-caching.
#   MODEL_DIR=.cache/serve27b TAG=27b bash ops/gpu/prefix_bench.sh
# MODEL_DIR holds config.json, the tokenizer and generation_config.json; SERVE_ARGS pass through.
# CPU smoke (tiny sizes): MODEL_DIR=<tiny ckpt> PREFIX_LEN=256 NEW_LEN=16 CONVERSATIONS=2 TURNS=2 \
#   TURN_LEN=64 OUTPUT_LEN=4 BENCH_ARGS="--vocab-size 1900" SERVE_ARGS="--snapshot-interval 128" \
#   bash ops/gpu/prefix_bench.sh
set -u
OUT=${OUT:-./gpu-out}
TAG=${TAG:-prefix}
PORT=${PORT:-8124}
mkdir -p "$OUT"
bench() { python3 ops/bench/bench_prefix.py "$@" --base-url "http://127.0.0.1:$PORT"; }
serve() {  # serve NAME FLAGS...: start, wait for /health
  local name=$1
  shift
  log="$OUT/serve_${TAG}_$name.log"
  python3 -m appliance.cli serve "$MODEL_DIR" --load-format dummy --no-vision --port "$PORT" \
    --max-num-seqs 64 "$@" ${SERVE_ARGS:-} >"$log" 2>&1 &
  pid=$!
  local t0=$SECONDS
  until python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$PORT/health', timeout=2)" 2>/dev/null; do
    if ! kill -0 $pid 2>/dev/null; then echo "server exited"; tail -30 "$log"; return 1; fi
    if [ $((SECONDS - t0)) -gt "${START_S:-300}" ]; then echo "not ready"; tail -30 "$log"; kill $pid; return 1; fi
    sleep 1
  done
  echo "[$name] ready in $((SECONDS - t0)) s"; grep -E "memory:|pools:|CUDA graphs:" "$log" | cut -c1-260
}
stop() { kill -TERM $pid; wait $pid; echo "server exit $?"; grep "appliance.stats" "$log" | tail -3 | cut -c1-260; }
REPLAY="--conversations ${CONVERSATIONS:-32} --turns ${TURNS:-5} --first-len ${TURN_LEN:-1024}
  --turn-len ${TURN_LEN:-1024} --output-len ${OUTPUT_LEN:-128} ${BENCH_ARGS:-}"
HITMISS="--prefix-len ${PREFIX_LEN:-8192} --new-len ${NEW_LEN:-128} ${BENCH_ARGS:-}"

serve on && {
  bench hitmiss $HITMISS --repeats 5 --json "$OUT/prefix_${TAG}_hitmiss.json"
  bench replay $REPLAY --json "$OUT/prefix_${TAG}_replay_on.json"
  # the same through /v1/chat/completions: the template re-renders each past answer
  bench replay $REPLAY --chat --json "$OUT/prefix_${TAG}_replay_chat_on.json"
  stop
}
serve off --no-prefix-caching && {
  bench hitmiss $HITMISS --repeats 3 --json "$OUT/prefix_${TAG}_hitmiss_off.json"
  bench replay $REPLAY --json "$OUT/prefix_${TAG}_replay_off.json"
  stop
}
