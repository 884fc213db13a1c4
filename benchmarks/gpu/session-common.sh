# Shared by benchmarks/gpu/session*.sh (sourced after `step=$1`): paths, the staged-wheel install, P's KV cap, the
# warm-up workload, the staging calls and the packing of a call's results.
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
# Calls a and b: vLLM 0.24's wheel in two parts (.gpu-stage/s4a, then .gpu-stage/s5b with bpdkv and its deps),
# installed into /tmp/site; the calls after them install vLLM's deps and NIXL (.gpu-stage/s4c).
stage_vllm() {
  if [ "$1" = a ]; then
    mkdir -p /tmp/stage && cp .gpu-stage/s4a/* /tmp/stage/ && nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv
  else
    cat /tmp/stage/vllm.part.a .gpu-stage/s5b/vllm.part.b > /tmp/stage/vllm-0.24.0-cp38-abi3-manylinux_2_28_x86_64.whl
    sha256sum /tmp/stage/vllm-0.24.0-*.whl .gpu-stage/s5b/bpdkv-*.whl
    $PIP /tmp/stage/vllm-0.24.0-*.whl .gpu-stage/s5b/*.whl && echo "vllm + bpdkv installed"
  fi
}
