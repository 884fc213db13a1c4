# Shared by benchmarks/gpu/session*.sh (sourced after `step=$1`): paths, the staged-wheel install, P's KV cap, the
# warm-up workload and the packing of a call's results.
OUT=${OUT:-/tmp/out}
RUN="bash benchmarks/gpu/run-h200.sh"
export MODEL_DIR=/tmp/qwen3-32b MODEL_NAME=qwen3-32b
PIP="python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site"
# P's KV cache for (b)/(c): 800 blocks × 128 = 102,400 tokens (the fair re-measure); D keeps vLLM's own size.
P_CAP="--num-gpu-blocks-override 800"
# Warm-up on fresh servers, with prompts no measured mode sends.
W="--conversations 2 --turns 2 --system-tokens 500 --new-tokens 100 --output-tokens 10 --concurrency 2 --seed 99"
# The device tool returns at most 8 files: each call packs what it made under /tmp/res into $OUT/<step>.tgz.
pack() { mkdir -p "$OUT" /tmp/res; tar czf "$OUT/$step.tgz" -C /tmp/res . ; ls -la /tmp/res | tail -n 30; }
