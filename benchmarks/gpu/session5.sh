#!/bin/bash
# GPU session 5 (2×H200, dummy Qwen3-32B): (c) again with the read fence, both modes 10 minutes, one device call per step,
# issued back to back.
#   a: stage part a of the vLLM wheel                           (carry .gpu-stage/s4a)
#   b: the rest of the wheel + bpdkv (commit e182706) + orjson   (carry .gpu-stage/s5b), installed into /tmp/site
#   c: vLLM's deps + NIXL (carry .gpu-stage/s4c); P (KV capped) + D + router; warm-up and the fence check (P's pins
#      granted, D's fence listening, no "lacks the read hooks"); the 10-minute reuse-on run launched with setsid
#   d: wait for it; fresh P/D/router; warm-up; the 10-minute reuse-off run at the same load, launched with setsid
#   e: wait for it and collect; then (a) again (P cache off, reuse on vs off, fresh servers each) in the time left
# Each call packs what it made under /tmp/res into $OUT/<step>.tgz.
set -uo pipefail
step=$1
. benchmarks/gpu/session-common.sh
# Session 4's load (16 conversations, 8 turns, 8.2k-11.3k prompts, think time median 8 s) with fresh prompts (seed 9)
# and the client marking each conversation's last turn (X-Bpdkv-Last-Turn: D holds nothing for it).
BC="--conversations 16 --turns 8 --system-tokens 2000 --start-history 6000 --new-tokens 150 --output-tokens 300 --concurrency 16 --think-median 8 --think-sigma 1 --prefill-cache on --seed 9 --mark-last-turn"
# (a): session 4's (d) workload (10 conversations, 5 turns, 8.2k-10.4k prompts, P cache off = salted)
A="--conversations 10 --turns 5 --system-tokens 2000 --start-history 6000 --new-tokens 150 --output-tokens 150 --concurrency 10 --prefill-cache off"
fence_check() {
  echo "== fence check ($1)"
  grep -h "bpdkv fence\|lacks the read hooks\|bpdkv plugin\|hold budget" /tmp/prefill-0.log /tmp/decode-0.log | head -n 8
  curl -s localhost:8100/metrics | grep -E "^vllm:bpdkv_(pin_|verified)" | grep -v _created
  curl -s localhost:8200/metrics | grep -E "^vllm:bpdkv_(fence_|hold_released)" | grep -v _created
}
case $step in
  a|b)
    stage_vllm "$step"
    ;;
  c)
    $PIP .gpu-stage/s4c/*.whl && echo "deps + nixl installed" || exit 1
    OUT=/tmp/res P_ARGS=$P_CAP $RUN start || { pack; exit 1; }
    OUT=/tmp/res $RUN bench bc-warmup-on $W --reuse on --prefill-cache on > /dev/null
    fence_check "after the reuse-on warm-up" | tee /tmp/res/fence-check-on.txt
    $RUN launch bc-on $BC --duration 10 --reuse on
    while [ $SECONDS -lt 560 ]; do sleep 5; done
    tail -n 3 /tmp/res/bc-on.launch.log; fence_check "reuse-on run, minute ~7"
    pack
    ;;
  d)
    OUT=/tmp/collected $RUN collect bc-on 240
    fence_check "end of the reuse-on run" | tee /tmp/res/fence-check-on-end.txt
    tail -n 25 /tmp/res/bc-on.txt
    P_ARGS=$P_CAP $RUN restart || { pack; exit 1; }
    OUT=/tmp/res $RUN bench bc-warmup-off $W --reuse off --prefill-cache on > /dev/null
    $RUN launch bc-off $BC --duration 10 --reuse off
    while [ $SECONDS -lt 560 ]; do sleep 5; done
    tail -n 3 /tmp/res/bc-off.launch.log
    pack
    ;;
  e)
    OUT=/tmp/collected $RUN collect bc-off 330
    tail -n 25 /tmp/res/bc-off.txt
    pack
    # (a) again with the fenced plugin, with what device time is left: P cache off, reuse on vs off, fresh servers each
    $RUN restart || exit 1
    OUT=/tmp/res $RUN bench a-on-warmup $W --reuse on --prefill-cache off > /dev/null
    OUT=/tmp/res $RUN bench a-on $A --reuse on --seed 11 | tail -n 12
    pack
    $RUN restart || exit 1
    OUT=/tmp/res $RUN bench a-off-warmup $W --reuse off --prefill-cache off > /dev/null
    OUT=/tmp/res $RUN bench a-off $A --reuse off --seed 11 | tail -n 12
    pack
    ;;
esac
