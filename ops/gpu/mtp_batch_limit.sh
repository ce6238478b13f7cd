#!/usr/bin/env bash
# The served 27B (dummy weights) with MTP: the verify policy's default (auto: the verify costs
# measured at startup against the accept length seen, no verify past the largest graphed verify
# batch; paused steps decode one row per request and draft through the draft graphs) against
# "never" (--mtp-disable-batch-size 64 = max_num_seqs: every step verifies, eagerly past the
# verify graphs) and MTP off, each its own server, at each CONCURRENCY.
#   MODEL_DIR=.cache/serve27b CONCURRENCY="1 32" OUTPUT_LEN=128 bash ops/gpu/mtp_batch_limit.sh
# Needs the serving wheels on PYTHONPATH (ops/gpu/session.sh installs them). Dummy weights accept
# no drafts, so "never" shows a verify's whole cost and "auto" the paused steps' (plain + drafts,
# a probing verify every 16th step); the startup log holds the measured costs.
set -u
OUT=${OUT:-./gpu-out}
MTP=${MTP:-"--mtp-step 3 --mtp-draft-vocab 32768"}
for variant in ${VARIANTS:-off auto never}; do
  case $variant in
    off) args="" ;;
    auto) args="$MTP" ;;
    never) args="$MTP --mtp-disable-batch-size 64" ;;
  esac
  echo "=== $variant: ${args:-MTP off}"
  TAG="mtp_$variant" SERVE_ARGS="$args ${SERVE_EXTRA:-}" bash ops/gpu/serve_bench.sh
  grep -E "MTP verify step time|MTP: |MTP verify off|MTP accept len" "$OUT/serve_mtp_$variant.log" \
    | tail -4 | cut -c1-240
done
