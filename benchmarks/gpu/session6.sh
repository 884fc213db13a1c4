#!/bin/bash
# GPU session 6 (2×H200, dummy Qwen3-32B) — PREPARED, NOT RUN: the session's device time had 202 s left, less than
# staging takes. (d) one change to measure — D computes a tail shorter than one block itself
# instead of pulling it from P. Why: on turns >= 2 D's prefix cache holds the history and D pulls at most P's last
# block (≤ 1.2 ms of transfer), but an async pull is noticed only at the end of the engine step it ran in, so the
# request waits one more decode step (~30 ms with 10 conversations decoding) before its first token. The change is
# D's kv_recompute_threshold 64 → 256 (> one 128-token block); P's pulls (~8.7k tokens) are unaffected.
# Each mode on freshly started P, D and router, (a)'s workload (P cache off, reuse on), the same prompts within a pair,
# pairs alternating which mode goes first (session 4 saw 16 % between two runs of the same settings).
#   a: stage part a of the vLLM wheel                           (carry .gpu-stage/s4a)
#   b: the rest of the wheel + bpdkv (commit e182706) + orjson   (carry .gpu-stage/s5b), installed into /tmp/site
#   c: vLLM's deps + NIXL (carry .gpu-stage/s4c); pair 1: default, then D threshold 256 (seed 21)
#   d: pair 2 (D threshold 256 first, seed 22), then pair 3 (default first, seed 23) while the call has time
# Each call packs what it made under /tmp/res into $OUT/<step>.tgz.
set -uo pipefail
step=$1
. benchmarks/gpu/session-common.sh
A="--conversations 10 --turns 5 --system-tokens 2000 --start-history 6000 --new-tokens 150 --output-tokens 150 --concurrency 10 --prefill-cache off"
D256='{"kv_recompute_threshold": 256}'
mode() {  # NAME SEED [D_EXTRA]: fresh P, D and router; warm-up; the measured run
  D_EXTRA=${3:-} $RUN restart || return 1
  OUT=/tmp/res $RUN bench "$1-warmup" $W --reuse on --prefill-cache off > /dev/null
  OUT=/tmp/res $RUN bench "$1" $A --reuse on --seed "$2" | tail -n 6
  grep -E "nixl_xfer_time_seconds_count|external_kv_transfer" "/tmp/res/$1.decode-metrics.txt"
}
case $step in
  a|b)
    stage_vllm "$step"
    ;;
  c)
    $PIP .gpu-stage/s4c/*.whl && echo "deps + nixl installed" || exit 1
    OUT=/tmp/res $RUN start || { pack; exit 1; }
    OUT=/tmp/res $RUN bench d-t64-1-warmup $W --reuse on --prefill-cache off > /dev/null
    OUT=/tmp/res $RUN bench d-t64-1 $A --reuse on --seed 21 | tail -n 6
    mode d-t256-1 21 "$D256"
    pack
    ;;
  d)
    mode d-t256-2 22 "$D256" && mode d-t64-2 22
    pack
    if [ $SECONDS -lt 300 ]; then mode d-t64-3 23 && mode d-t256-3 23 "$D256"; pack; fi
    ;;
esac
