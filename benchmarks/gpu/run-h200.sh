#!/bin/bash
# GPU benchmark on the lent 2×H200 machine. Call 1..3 stage vLLM (shared/notes/gpu.md); this script is call 4+:
#   bash benchmarks/gpu/run-h200.sh start            # install nixl + bpdkv (chunks 4, 5), render, start P, D, router
#   bash benchmarks/gpu/run-h200.sh bench NAME ARGS  # one `bpdkv bench` sweep into $OUT/NAME.json (+ router metrics around it)
#   bash benchmarks/gpu/run-h200.sh calibrate NAME ARGS  # `bpdkv calibrate` against P and D into $OUT/NAME.json
#   BLOCK=16 bash benchmarks/gpu/run-h200.sh restart # stop P, D and the router, start them fresh (another --block-size)
#   bash benchmarks/gpu/run-h200.sh launch NAME ARGS # the same bench in the background (setsid), files under /tmp/res
#   bash benchmarks/gpu/run-h200.sh collect NAME S   # wait up to S seconds for a launched bench to end; copy its files to $OUT
#   P_ARGS/D_ARGS: extra vLLM arguments for P/D on start/restart; P_EXTRA/D_EXTRA: JSON merged into P's/D's
#   kv_connector_extra_config
set -euo pipefail
OUT=${OUT:-/tmp/out}
PY=$(command -v python3)
export PYTHONPATH=/tmp/site
# bpdkv (CLI, router, the vLLM plugin) is imported from the staged wheel (chunk 5, built from a clean commit), never
# from the copied working tree that `python -m` would otherwise put first on sys.path.
export PYTHONSAFEPATH=1
mkdir -p /tmp/res
cmd=$1; shift
start_pd() {
  R=/tmp/render/gpu-box
  for inst in prefill-0 decode-0; do
    extra=${P_ARGS:-}; [ "$inst" = decode-0 ] && extra=${D_ARGS:-}
    sed "s#^\. /etc/bpdkv/#. $R/etc/bpdkv/#; s#--block-size [0-9]*#--block-size ${BLOCK:-128} $extra#; s#/tmp/qwen3-8b#${MODEL_DIR:-/tmp/qwen3-8b}#; s#--served-model-name qwen3-8b#--served-model-name ${MODEL_NAME:-qwen3-8b}#" "$R/opt/bpdkv/bin/$inst.sh" > /tmp/$inst.sh
    merge=${P_EXTRA:-}; [ "$inst" = decode-0 ] && merge=${D_EXTRA:-}
    if [ -n "$merge" ]; then
      python3 - "$merge" "/tmp/$inst.sh" <<'PY'
import json, re, shlex, sys
path = sys.argv[2]
text = open(path).read()
def merge(m):
    config = json.loads(shlex.split(m.group(1))[0])
    config["kv_connector_extra_config"].update(json.loads(sys.argv[1]))
    return "--kv-transfer-config " + shlex.quote(json.dumps(config))
open(path, "w").write(re.sub(r"--kv-transfer-config ('[^']*')", merge, text))
PY
    fi
    setsid timeout 3000 bash /tmp/$inst.sh > /tmp/$inst.log 2>&1 < /dev/null &
    echo $! > /tmp/$inst.pid
  done
  for i in $(seq 1 150); do
    if curl -sf localhost:8100/health >/dev/null && curl -sf localhost:8200/health >/dev/null; then echo "P and D (block ${BLOCK:-128}) healthy after $((i*2)) s"; return 0; fi
    if grep -q "EngineCore failed\|Engine core initialization failed" /tmp/prefill-0.log /tmp/decode-0.log \
      || ! kill -0 "$(cat /tmp/prefill-0.pid)" 2>/dev/null || ! kill -0 "$(cat /tmp/decode-0.pid)" 2>/dev/null; then
      echo "a server failed:"; tail -n 30 /tmp/prefill-0.log /tmp/decode-0.log; return 1
    fi
    sleep 2
  done
  echo "P or D not healthy after 300 s"; tail -n 20 /tmp/prefill-0.log /tmp/decode-0.log; return 1
}
stop_all() {
  for inst in prefill-0 decode-0 router; do kill -- -"$(cat /tmp/$inst.pid)" 2>/dev/null || kill "$(cat /tmp/$inst.pid)" 2>/dev/null || true; done
  for i in $(seq 1 60); do curl -sf localhost:8100/health >/dev/null || curl -sf localhost:8200/health >/dev/null || break; sleep 1; done
  # The next P/D need the GPUs' memory back: wait (bounded) until both are nearly empty.
  for i in $(seq 1 30); do
    used=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits 2>/dev/null | sort -n | tail -n 1)
    [ -n "$used" ] && [ "$used" -lt 2000 ] && break
    sleep 1
  done
}
start_router() {
  setsid timeout 3000 python3 -m bpdkv.cli router --config /tmp/render/gpu-box/etc/bpdkv/router-0.router.yaml --log-level warning > /tmp/router.log 2>&1 < /dev/null &
  echo $! > /tmp/router.pid
  for i in $(seq 1 20); do curl -sf localhost:8000/ready >/dev/null && break; sleep 0.5; done
}
if [ "$cmd" = restart ]; then
  # Fresh state for the next mode: P's and D's caches and the router's sessions all start empty.
  stop_all
  start_pd || { stop_all; exit 1; }
  start_router
  grep -h "KV cache size\|Maximum concurrency\|hold budget\|cross.layer\|packed KV" /tmp/prefill-0.log /tmp/decode-0.log | tail -n 8 | tee -a /tmp/res/servers.txt || true
elif [ "$cmd" = launch ]; then
  name=$1; shift
  mkdir -p /tmp/res
  OUT=/tmp/res setsid timeout 1700 bash "$0" bench "$name" "$@" > "/tmp/res/$name.launch.log" 2>&1 < /dev/null &
  echo "launched $name (pid $!)"
elif [ "$cmd" = collect ]; then
  name=$1; limit=$2
  for i in $(seq 1 "$limit"); do [ -e "/tmp/res/$name.done" ] && break; sleep 1; done
  [ -e "/tmp/res/$name.done" ] && echo "$name ended" || echo "$name still running after $limit s"
  mkdir -p "$OUT"; cp /tmp/res/"$name"* "$OUT"/ 2>/dev/null || true
elif [ "$cmd" = calibrate ]; then
  name=$1; shift
  mkdir -p "$OUT"
  python3 -m bpdkv.cli calibrate --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --model "${MODEL_NAME:-qwen3-8b}" --block-size "${BLOCK:-128}" --out "$OUT/$name.json" --write-override "$OUT/$name.override.yaml" "$@" | tee "$OUT/$name.txt"
elif [ "$cmd" = start ]; then
  # Chunks 4 and 5 when they travel with this call (session 4 installs them in earlier calls: session4.sh).
  if ls .gpu-stage/4/*.whl .gpu-stage/5/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu-stage/4/*.whl .gpu-stage/5/*.whl
  fi
  mkdir -p /tmp/gpuvenv/bin /tmp/qwen3-8b
  # A wrapper, not a symlink: through a symlink Python would miss the real interpreter's venv (and its torch).
  rm -f /tmp/gpuvenv/bin/python
  printf '#!/bin/sh\nexec %s "$@"\n' "$PY" > /tmp/gpuvenv/bin/python && chmod +x /tmp/gpuvenv/bin/python
  cat > /tmp/qwen3-8b/config.json <<'JSON'
{"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 4096, "intermediate_size": 12288,
 "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
 "max_position_embeddings": 40960, "rms_norm_eps": 1e-06, "rope_theta": 1000000, "torch_dtype": "bfloat16",
 "tie_word_embeddings": false, "hidden_act": "silu", "attention_bias": false, "bos_token_id": 151643, "eos_token_id": 151645}
JSON
  # Qwen3-32B shape (shared/notes/gpu.md's physical reference uses it); selected with MODEL_DIR=/tmp/qwen3-32b MODEL_NAME=qwen3-32b.
  mkdir -p /tmp/qwen3-32b
  sed 's/"hidden_size": 4096, "intermediate_size": 12288/"hidden_size": 5120, "intermediate_size": 25600/; s/"num_hidden_layers": 36, "num_attention_heads": 32/"num_hidden_layers": 64, "num_attention_heads": 64/' /tmp/qwen3-8b/config.json > /tmp/qwen3-32b/config.json
  python3 -m bpdkv.cli render benchmarks/gpu/h200x2-qwen3-8b-dummy.yaml --out /tmp/render
  R=/tmp/render/gpu-box
  start_pd || { stop_all; exit 1; }
  start_router
  curl -sf localhost:8000/ready || echo "router not ready"; echo
  mkdir -p /tmp/res
  grep -h "KV cache size\|Maximum concurrency\|hold budget\|cross.layer\|packed KV" /tmp/prefill-0.log /tmp/decode-0.log | tail -n 8 | tee -a /tmp/res/servers.txt || true
  grep -h "bpdkv\|Backend\|UCX\|cuda_ipc" /tmp/prefill-0.log | head -5 || true
  mkdir -p "$OUT"; cp /tmp/render -r "$OUT/render"; tail -n 20 /tmp/prefill-0.log > "$OUT/prefill-start.log"; tail -n 20 /tmp/decode-0.log > "$OUT/decode-start.log"
elif [ "$cmd" = bench ]; then
  name=$1; shift
  mkdir -p "$OUT"
  curl -s localhost:8000/metrics | grep "^bpdkv_router_upstream_seconds_\|^bpdkv_router_ttft_seconds_" > "$OUT/$name.router-before.txt" || true
  python3 -m bpdkv.cli bench http://127.0.0.1:8000 --prefill-metrics http://127.0.0.1:8100 --decode-metrics http://127.0.0.1:8200 --out "$OUT/$name.json" "$@" | tee "$OUT/$name.txt" || echo "bench exit $?" | tee -a "$OUT/$name.txt"
  curl -s localhost:8000/metrics | grep "^bpdkv_router_upstream_seconds_\|^bpdkv_router_ttft_seconds_" > "$OUT/$name.router-after.txt" || true
  series="^vllm:(prompt_tokens_by_source|nixl_|bpdkv_|num_requests|kv_cache_usage|prefix_cache|num_preemptions|request_(queue|prefill|decode|inference)_time_seconds_(sum|count)|time_to_first_token_seconds_(sum|count)|inter_token_latency_seconds_(sum|count))"
  curl -s localhost:8100/metrics | grep -E "$series" | grep -v "_created\|_bucket" > "$OUT/$name.prefill-metrics.txt" || true
  curl -s localhost:8200/metrics | grep -E "$series" | grep -v "_created\|_bucket" > "$OUT/$name.decode-metrics.txt" || true
  tail -n 30 /tmp/prefill-0.log > "$OUT/$name.prefill.log"; tail -n 30 /tmp/decode-0.log > "$OUT/$name.decode.log"; tail -n 30 /tmp/router.log > "$OUT/$name.router.log"
  touch "$OUT/$name.done"
fi
