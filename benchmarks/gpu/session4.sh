#!/bin/bash
# GPU session 4 (2×H200, dummy Qwen3-32B): the exact calls, one step per device call, issued back to back.
#   a: stage part a of the vLLM wheel             (carry .gpu-stage/s4a)
#   b: the rest of the wheel + bpdkv's chunk 5    (carry .gpu-stage/s4b), installed into /tmp/site
#   c: vLLM's deps + NIXL (carry .gpu-stage/s4c); P (KV capped) + D + router; warm-up; the 10-minute sustained
#      reuse-on run launched with setsid; the call ends at ~575 s (the run goes on)
#   d: wait for it; fresh P/D/router; warm-up; the 4-minute reuse-off run at the same load
#   e: (d) one change, on vs off, each on fresh servers: NixlConnector's cross-layer KV blocks (one NIXL descriptor
#      per block for all layers instead of one per layer and K/V), P cache off (salted), reuse on, fresh prompts
#      (session 4: vLLM 0.24 did not apply it, the descriptor count stayed the same)
#   f: (d) block size 256 vs 128, each on fresh servers (run in session 4 as one command with the same lines)
# Each call packs what it made under /tmp/res into $OUT/<step>.tgz (the device tool returns at most 8 files).
set -uo pipefail
step=$1
. benchmarks/gpu/session-common.sh
BC="--conversations 16 --turns 8 --system-tokens 2000 --start-history 6000 --new-tokens 150 --output-tokens 300 --concurrency 16 --think-median 8 --think-sigma 1 --prefill-cache on --seed 4"
D="--conversations 10 --turns 5 --system-tokens 2000 --start-history 6000 --new-tokens 150 --output-tokens 150 --concurrency 10 --prefill-cache off --reuse on"
XLAYER='{"enable_cross_layers_blocks": "true"}'
case $step in
  a)
    mkdir -p /tmp/stage && cp .gpu-stage/s4a/* /tmp/stage/ && nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv
    ;;
  b)
    cat /tmp/stage/vllm.part.a .gpu-stage/s4b/vllm.part.b > /tmp/stage/vllm-0.24.0-cp38-abi3-manylinux_2_28_x86_64.whl
    sha256sum /tmp/stage/vllm-0.24.0-*.whl
    $PIP /tmp/stage/vllm-0.24.0-*.whl .gpu-stage/s4b/*.whl && echo "vllm + chunk 5 installed"
    ;;
  c)
    $PIP .gpu-stage/s4c/*.whl && echo "deps + nixl installed" || exit 1
    OUT=/tmp/res P_ARGS=$P_CAP $RUN start || { pack; exit 1; }
    OUT=/tmp/res $RUN bench bc-warmup-on $W --reuse on --prefill-cache on > /dev/null
    $RUN launch bc-on $BC --duration 10 --reuse on
    while [ $SECONDS -lt 560 ]; do sleep 5; done
    tail -n 3 /tmp/res/bc-on.launch.log; nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv
    pack
    ;;
  d)
    OUT=/tmp/collected $RUN collect bc-on 220
    P_ARGS=$P_CAP $RUN restart || { pack; exit 1; }
    OUT=/tmp/res $RUN bench bc-warmup-off $W --reuse off --prefill-cache on > /dev/null
    OUT=/tmp/res $RUN bench bc-off $BC --duration 4 --reuse off | tail -n 40
    pack
    ;;
  e)
    name=d-xlayer
    if ! P_EXTRA=$XLAYER D_EXTRA=$XLAYER $RUN restart; then
      echo "cross-layer blocks did not start: block 256 instead"; name=d-block256
      BLOCK=256 $RUN restart || { pack; exit 1; }
    fi
    OUT=/tmp/res $RUN bench "$name-warmup" $W --reuse on --prefill-cache off > /dev/null
    OUT=/tmp/res $RUN bench "$name" $D --seed 5 | tail -n 25
    $RUN restart || { pack; exit 1; }
    OUT=/tmp/res $RUN bench d-base-warmup $W --reuse on --prefill-cache off > /dev/null
    OUT=/tmp/res $RUN bench d-base $D --seed 6 | tail -n 25
    pack
    ;;
  f)
    BLOCK=256 $RUN restart && {
      OUT=/tmp/res BLOCK=256 $RUN bench d2-b256-warmup $W --reuse on --prefill-cache off > /dev/null
      OUT=/tmp/res BLOCK=256 $RUN bench d2-b256 $D --seed 7 | tail -n 14
    }
    $RUN restart && {
      OUT=/tmp/res $RUN bench d2-b128-warmup $W --reuse on --prefill-cache off > /dev/null
      OUT=/tmp/res $RUN bench d2-b128 $D --seed 8 | tail -n 14
    }
    pack
    ;;
esac
