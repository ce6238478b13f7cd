#!/usr/bin/env bash
# One consolidated GPU call: install the carried optional packages, then run the steps named in
# STEPS (space-separated, in order), each under its own time limit, logs in $OUT.
#
#   STEPS="probe tests bench model vision graphs static static_moe profile" bash ops/gpu/session.sh
#
# Carried (git-ignored) payload: .gpu-payload/*.whl (msgspec, fla-core, tvm-ffi ...) and
# .gpu-payload/*.tar.xz (flashinfer / sglang-kernel / tilelang+flash-qla, see ../shared/gpu).
# Step limits (seconds): PROBE_S TESTS_S BENCH_S MODEL_S VISION_CHECK_S VISION_BENCH_S STATIC_S
# GRAPHS_S PROFILE_S PREFIX_S PREFILL_S VERIFY_S GEMV_S (prefill: a prefix hit's step, profiled;
# verify: the tests of code not yet run on the GPU, kernels (VERIFY_KERNELS: the files) then
# engine, each VERIFY_S; VERIFY_MARK=gpu: only the kernels' full-size cases, which the limit
# otherwise cuts at the end of a file)
# (verify_engine: the engine's alone, VERIFY_ENGINE_FILES: which; VERIFY_ENGINE=0: the kernels'
# alone); kv_fp8: fp8 against bf16 KV decode attention (KV_FP8_S; KV_FP8_ARGS=--sweep: the fp8
# tiles); rows: the tensor-core rows GEMV's sweep (ROWS_S, ROWS_ARGS); pdl_probe: which PDL +
# cuBLAS sequences capture (PDL_PROBE_S); gemv_probe: the one-row fp8 GEMV's stages, row
# accumulator and register prefetch (GEMV_PROBE_S, GEMV_PROBE_ARGS); prefetch_probe: a bulk-copy
# GEMV (nvcc) whose weight is in flight before its PDL wait, alone and as the 27B step's chain of
# GEMVs (PREFETCH_PROBE_S, PREFETCH_PROBE_ARGS); moe_probe: per-pair against
# grouped decode MoE
# (MOE_PROBE_S, MOE_PROBE_ARGS, e.g. "--static --config ... --batch 1 16 --moe-pairs 16 256");
# serve: ops/gpu/serve_bench.sh (SERVE_S; TAG, SERVE_ARGS,
# CONCURRENCY pass through); mtp_limit: ops/gpu/mtp_batch_limit.sh (MTP_LIMIT_S; VARIANTS,
# CONCURRENCY, OUTPUT_LEN pass through: served MTP with its verify policy against verify always);
# static_fp8: the 27B step with QUANT=fp8|block weights);
# profile: PROFILE_CONFIG, PROFILE_BATCH, PROFILE_ARGS (e.g. "--modes graphs --top 25");
# PROBE_ARGS, BENCH_ARGS and PYTEST_ARGS pass through. The vision steps also need the wheels in
# .cache/vision-wheels (pillow, httpx and its deps: not on the GPU machine).
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-./gpu-out}
mkdir -p "$OUT"
SITE=$(mktemp -d)
python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" \
  $(ls .gpu-payload/*.whl .gpu-payload/serve/*.whl 2>/dev/null)
for a in .gpu-payload/*.tar.xz; do [ -s "$a" ] && tar -xJf "$a" -C "$SITE"; done
export PYTHONPATH=$PWD:$SITE PYTHONUNBUFFERED=1
export FLASHINFER_CUDA_ARCH_LIST=9.0a MAX_JOBS=16 HOME=${HOME:-/root}
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
python3 -c "
import importlib.util as u
print('optional:', [m for m in ('fla','flashinfer','sgl_kernel','flash_qla') if u.find_spec(m)])"
date -u +"date %Y-%m-%dT%H:%MZ"

step() {  # step NAME LIMIT CMD...
  local name=$1 limit=$2
  shift 2
  local t0=$SECONDS
  echo "=== $name (limit ${limit}s)"
  timeout "$limit" "$@" 2>&1 | grep --line-buffered -v "^\[transformers\]" | tee "$OUT/$name.log"
  echo "=== $name exit ${PIPESTATUS[0]} in $((SECONDS - t0)) s"
}

for s in ${STEPS:-probe tests bench}; do
  case $s in
    probe) step probe "${PROBE_S:-150}" python3 ops/gpu/gdn_probe.py ${PROBE_ARGS:-} ;;
    tests) step tests "${TESTS_S:-200}" python3 -m pytest tests/kernels -q -p no:cacheprovider \
      --confcutdir=tests/kernels -rfE --durations=10 ${PYTEST_ARGS:-} ;;
    bench) step bench "${BENCH_S:-200}" python3 ops/bench/bench_ops.py --out "$OUT/bench.md" \
      ${BENCH_ARGS:-} ;;
    model) step model "${MODEL_S:-150}" python3 ops/gpu/check_model.py ;;
    vision)  # wheels carried in .cache/vision-wheels (pillow, httpx, ...): install those whose
      # module does not import yet; then the check and the benchmark, each under its own limit
      # (VISION_CHECK_S, VISION_BENCH_S), the benchmark whatever the check's exit status
      vsite=$(mktemp -d) vnew=""
      for vw in .cache/vision-wheels/*.whl; do
        [ -s "$vw" ] || continue
        vm=$(basename "$vw"); vm=${vm%%-*}; [ "$vm" = pillow ] && vm=PIL
        python3 -c "import importlib.util as u, sys; sys.exit(u.find_spec('$vm') is None)" \
          2>/dev/null && continue
        PIP_ROOT_USER_ACTION=ignore python3 -m pip install -q --no-index --no-deps --no-compile \
          --target "$vsite" "$vw" && vnew="$vnew $vm"
      done
      echo "vision wheels installed:${vnew:- none needed}"
      step vision_check "${VISION_CHECK_S:-200}" env PYTHONPATH="$PYTHONPATH:$vsite" \
        python3 ops/gpu/check_vision.py --json "$OUT/check_vision.json"
      step vision_bench "${VISION_BENCH_S:-200}" env PYTHONPATH="$PYTHONPATH:$vsite" \
        python3 ops/bench/bench_vit.py --json "$OUT/vit.json" ;;
    static) step static "${STATIC_S:-240}" python3 ops/bench/bench_static.py \
      --config ops/bench/configs/qwen3_5_27b.json --batch ${STATIC_BATCH:-1 16 64} --mtp ${STATIC_MTP:-0} \
      --graphs ${STATIC_GRAPHS:-on off} --fused ${STATIC_FUSED:-on off} --prompt-len 256 --steps 8 ${STATIC_ARGS:-} --json "$OUT/static.json" ;;
    static_moe) step static_moe "${STATIC_S:-240}" python3 ops/bench/bench_static.py \
      --config ops/bench/configs/qwen3_5_35b_a3b.json --batch ${STATIC_BATCH:-1 16 64} \
      --mtp ${STATIC_MTP:-0} --graphs ${STATIC_GRAPHS:-on off} --fused ${STATIC_FUSED:-on off} --prompt-len 256 --steps 8 ${STATIC_ARGS:-} --json "$OUT/static_moe.json" ;;
    graphs) step graphs "${GRAPHS_S:-200}" python3 -m pytest tests/appliance/engine/test_graphs.py \
      tests/appliance/engine/test_mtp_graphs.py -q -s -p no:cacheprovider -m gpu -rfE ;;
    verify)  # the newest first (a time limit cuts the last): kernel tests run on CUDA whole,
      # the engine's only their `gpu` cases
      step verify "${VERIFY_S:-300}" python3 -m pytest -q -p no:cacheprovider -rfE \
        ${VERIFY_MARK:+-m "$VERIFY_MARK"} \
        ${VERIFY_KERNELS:-tests/kernels/test_fp8_gemv.py tests/kernels/test_moe_route.py \
        tests/kernels/test_token_bitmask.py tests/kernels/test_moe_gemv.py \
        tests/kernels/test_fp8_splitk.py tests/kernels/test_moe.py tests/kernels/test_fp8.py \
        tests/kernels/test_fp8_block.py} ;;&
    verify|verify_engine)
      [ "$s" = verify ] && [ "${VERIFY_ENGINE:-1}" = 0 ] && continue
      step verify_engine "${VERIFY_S:-300}" python3 -m pytest -q -p no:cacheprovider -m gpu -rfE \
        ${VERIFY_ENGINE_FILES:-tests/appliance/engine/test_prefill_graphs.py \
        tests/appliance/engine/test_graphs.py tests/appliance/engine/test_mtp_graphs.py \
        tests/appliance/engine/test_prompt_logprobs.py} ;;
    static_fp8) step static_fp8 "${STATIC_S:-240}" python3 ops/bench/bench_static.py \
      --config ops/bench/configs/qwen3_5_27b.json --batch ${STATIC_BATCH:-1 16} --mtp 0 --graphs on \
      --quantization "${QUANT:-fp8}" ${STATIC_ARGS:-} --json "$OUT/static_fp8.json" ;;
    prefix) step prefix "${PREFIX_S:-580}" env MODEL_DIR="${MODEL_DIR:-.cache/serve27b}" \
      bash ops/gpu/prefix_bench.sh ;;
    prefill) step prefill "${PREFILL_S:-200}" python3 ops/gpu/profile_prefill.py \
      --config ops/bench/configs/qwen3_5_27b.json --repeats 2 ;;
    rows) step rows "${ROWS_S:-240}" python3 ops/bench/bench_gemv_rows.py ${ROWS_ARGS:-} \
      --json "$OUT/rows.json" ;;
    moe_probe) step moe_probe "${MOE_PROBE_S:-300}" python3 ops/gpu/moe_pairs_probe.py \
      ${MOE_PROBE_ARGS:-} ;;
    pdl_probe) step pdl_probe "${PDL_PROBE_S:-120}" python3 ops/gpu/pdl_probe.py ;;
    gemv_probe) step gemv_probe "${GEMV_PROBE_S:-200}" python3 ops/gpu/gemv_probe.py \
      ${GEMV_PROBE_ARGS:-} ;;
    prefetch_probe) step prefetch_probe "${PREFETCH_PROBE_S:-300}" \
      python3 ops/gpu/prefetch_gemv_probe.py ${PREFETCH_PROBE_ARGS:-} ;;
    gemv) step gemv "${GEMV_S:-200}" python3 ops/bench/bench_fp8_gemv.py ${GEMV_ARGS:-} \
      --json "$OUT/gemv.json" ;;
    kv_fp8) step kv_fp8 "${KV_FP8_S:-150}" python3 ops/bench/bench_kv_fp8.py --contexts 8192,32768 \
      --batches 1,16,64 ${KV_FP8_ARGS:-} ;;  # KV_FP8_ARGS last: its --batches / --layouts win
    serve) step "serve_${TAG:-serve}" "${SERVE_S:-300}" env MODEL_DIR="${MODEL_DIR:-.cache/serve27b}" \
      bash ops/gpu/serve_bench.sh ;;
    mtp_limit) step mtp_limit "${MTP_LIMIT_S:-420}" env MODEL_DIR="${MODEL_DIR:-.cache/serve27b}" \
      OUT="$OUT" bash ops/gpu/mtp_batch_limit.sh ;;
    profile) step profile "${PROFILE_S:-200}" python3 ops/gpu/profile_step.py \
      --config "${PROFILE_CONFIG:-ops/bench/configs/qwen3_5_27b.json}" --batch ${PROFILE_BATCH:-1 16 64} \
      --out "$OUT" ${PROFILE_ARGS:-} ;;
    *) echo "unknown step $s" ;;
  esac
done
