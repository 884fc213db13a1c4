#!/bin/bash
# vLLM 0.33.0 probe on ONE H200 (kind nvidia-h200): P and D of a dummy Qwen3-8B share GPU 0. Three device calls, back to
# back (the machine is given back 30 s after a call ends, and /tmp with it):
#   here, once:  ../shared/tools/gpu-stage/build-chunks-0.33.sh .gpu-stage-033   (git-ignored; ~170 MB)
#                git worktree add --detach /tmp/wt HEAD && (cd /tmp/wt && pip wheel --no-deps --no-build-isolation -w W .)
#                mkdir -p .gpu-stage-033/w && cp W/bpdkv-*.whl .gpu-stage-033/w/    (bpdkv from a clean commit)
#   call 1, carry .gpu-stage-033/1:                      bash benchmarks/gpu/h200-033.sh 1   (copy vLLM part 0)
#   call 2, carry .gpu-stage-033/2:                      bash benchmarks/gpu/h200-033.sh 2   (vLLM + pycountry installed)
#   call 3, carry .gpu-stage-033/3 and .gpu-stage-033/w: bash benchmarks/gpu/h200-033.sh 3   (deps + NIXL + bpdkv; the probe)
# Call 3: plain-NIXL reads between two processes on the one GPU under several UCX settings (nixl_one_gpu.py) while P and
# D start; the plugin's start-up lines (or its traceback, then a fallback to upstream NixlConnector); D's stream shape
# (stream_shape.py); a short `bpdkv bench` reuse on vs off through the router; P's and D's NIXL/bpdkv metrics; UCX's
# protocol lines. Everything goes to /tmp/res, packed into $OUT/<step>.tgz (the tool returns at most 8 files).
# Env: PROBE_ONLY=1 skips vLLM (only the NIXL probe); SKIP_PROBE=1 skips the NIXL probe; PD_ENV="VAR=VALUE ..." extra
# env for P and D; AB_ENV="VAR=VALUE ...": after the first bench, fresh P and D with that env and the same bench again
# (files a-* and b-*); AGENTIC="ARGS": then on the b servers issue 22's agentic bench (paths both, then reuse off); LIMIT (default 380) is the call's own deadline in seconds (keep it below the call's timeout_s).
# The one-GPU transport fix found by calls 4 and 5 (ucx, getz): UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y. A final run:
#   calls 1 and 2 as above, then call 3 with
#   SKIP_PROBE=1 LIMIT=540 AB_ENV=UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y bash benchmarks/gpu/h200-033.sh 3   (timeout_s 580)
set -uo pipefail
step=$1
OUT=${OUT:-/tmp/out}
S=.gpu-stage-033
PIP="python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site"
export PYTHONPATH=/tmp/site PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
LIMIT=${LIMIT:-380}
RES=/tmp/res
R=/tmp/render/gpu-box
mkdir -p "$RES" "$OUT"
pack() { tar czf "$OUT/$step.tgz" -C "$RES" . ; echo "packed $(ls "$RES" | wc -l) files at ${SECONDS}s"; }
left() { echo $((LIMIT - SECONDS)); }

probe() {  # probe LABEL [VAR=VALUE ...]: one target + one reader process on cuda:0, with these env settings on both
  local label=$1 d=/tmp/probe-$1; shift
  rm -rf "$d"; mkdir -p "$d"
  env "$@" timeout "${PT:-80}" python3 benchmarks/gpu/nixl_one_gpu.py target "$d" --mib "${MIB:-1024}" > "$d/target.log" 2>&1 &
  env "$@" timeout "${PT:-80}" python3 benchmarks/gpu/nixl_one_gpu.py reader "$d" --mib "${MIB:-1024}" --label "$label" > "$d/reader.log" 2>&1
  wait $!
  grep '^{' "$d/reader.log" >> "$RES/nixl-probe.jsonl" || { echo "== $label"; tail -n 8 "$d/reader.log" "$d/target.log"; } >> "$RES/nixl-probe-errors.txt"
  grep -h -i "cuda_ipc\|cuda_copy\|tcp\|rndv\|+--\||" "$d/reader.log" | grep -v '^{' | head -n 60 > "$RES/ucx-$label.txt" || true
  # The endpoint configurations UCX chose (one line each) and anything it says about cuda_ipc.
  grep -h "cfg#\|cuda_ipc\|UCX  version\|unreachable\|not reachable\|ucp_context.*version" "$d/reader.log" "$d/target.log" \
    | grep -v "^.*| " | cut -c1-400 | sort | uniq -c | sort -rn | head -n 80 > "$RES/ucx-lanes-$label.txt" || true
}

kv_config() {  # kv_config FILE PYTHON-EXPR: rewrite the launch script's --kv-transfer-config JSON (c = the dict)
  python3 - "$1" "$2" <<'PY'
import json, re, shlex, sys
path, expr = sys.argv[1], sys.argv[2]
text = open(path).read()
def edit(m):
    c = json.loads(shlex.split(m.group(1))[0])
    exec(expr, {"c": c})
    return "--kv-transfer-config " + shlex.quote(json.dumps(c))
open(path, "w").write(re.sub(r"--kv-transfer-config ('[^']*')", edit, text))
PY
}

start_pd() {  # start_pd [VAR=VALUE ...]: extra env for both servers
  for inst in prefill-0 decode-0; do
    sed "s#^\. /etc/bpdkv/#. /tmp/$inst.env.d/#" "$R/opt/bpdkv/bin/$inst.sh" > "/tmp/$inst.sh"
    mkdir -p "/tmp/$inst.env.d"
    # P and D on the one GPU: D was rendered on GPU 1 (the topology refuses two instances on one GPU).
    sed "s#^CUDA_VISIBLE_DEVICES=.*#CUDA_VISIBLE_DEVICES=0#" "$R/etc/bpdkv/$inst.env" > "/tmp/$inst.env.d/$inst.env"
    for kv in UCX_PROTO_INFO=y "$@"; do echo "$kv" >> "/tmp/$inst.env.d/$inst.env"; done
    [ -n "${KV_EDIT:-}" ] && kv_config "/tmp/$inst.sh" "$KV_EDIT"
    setsid timeout 900 bash "/tmp/$inst.sh" > "/tmp/$inst.log" 2>&1 < /dev/null &
    echo $! > "/tmp/$inst.pid"
  done
}

wait_pd() {  # wait_pd SECONDS: 0 when both answer /health
  local end=$((SECONDS + $1))
  while [ $SECONDS -lt $end ]; do
    if curl -sf localhost:8100/health >/dev/null && curl -sf localhost:8200/health >/dev/null; then echo "P and D healthy at ${SECONDS}s"; return 0; fi
    if grep -q "EngineCore failed\|Engine core initialization failed" /tmp/prefill-0.log /tmp/decode-0.log \
      || ! kill -0 "$(cat /tmp/prefill-0.pid)" 2>/dev/null || ! kill -0 "$(cat /tmp/decode-0.pid)" 2>/dev/null; then
      sleep 3; echo "a server failed at ${SECONDS}s"; return 1
    fi
    sleep 2
  done
  echo "P or D not healthy at ${SECONDS}s"; return 1
}

stop_pd() {
  for inst in prefill-0 decode-0 router; do [ -e "/tmp/$inst.pid" ] && kill -- -"$(cat /tmp/$inst.pid)" 2>/dev/null; done
  for i in $(seq 1 30); do
    used=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | head -n 1)
    [ "$used" -lt 2000 ] && break; sleep 1
  done
}

logs_of() {  # logs_of TAG: tracebacks, plugin lines and tails of both servers
  for inst in prefill-0 decode-0; do
    { echo "== $inst: tracebacks"; grep -n -B2 -A40 "Traceback" "/tmp/$inst.log" | head -n 120
      echo "== $inst: bpdkv / connector / NIXL lines"; grep -n -i "bpdkv\|connector\|nixl\|hold budget\|fence\|ucx\|backend" "/tmp/$inst.log" | grep -v "^.*| " | head -n 60
      echo "== $inst: tail"; tail -n 25 "/tmp/$inst.log"; } > "$RES/$1-$inst.log"
  done
}

metrics() {  # metrics TAG: P's and D's NIXL / bpdkv series, the router's
  series="^vllm:(nixl_|bpdkv_|prompt_tokens_by_source|num_preemptions|kv_cache_usage|request_prefill_time_seconds_(sum|count))"
  for port in 8100 8200; do curl -s "localhost:$port/metrics" | grep -E "$series" | grep -v "_created\|_bucket"; done > "$RES/$1-metrics.txt" 2>&1
  curl -s localhost:8000/metrics | grep "^bpdkv_router_" | grep -v "_created\|_bucket" > "$RES/$1-router-metrics.txt" 2>&1 || true
}

bench() {  # bench NAME ARGS...
  [ "$(left)" -gt 60 ] || { echo "no time left for bench $1 at ${SECONDS}s"; return 1; }
  timeout "$(( $(left) - 25 ))" python3 -m bpdkv.cli bench http://127.0.0.1:8000 --prefill-metrics http://127.0.0.1:8100 \
    --decode-metrics http://127.0.0.1:8200 --out "$RES/$1.json" "${@:2}" > "$RES/$1.txt" 2>&1
  echo "bench $1 exit $? at ${SECONDS}s"; tail -n 25 "$RES/$1.txt"
}

serve_and_bench() {  # serve_and_bench TAG: router, D's stream shape, the short bench reuse on vs off, metrics and logs
  local tag=$1
  logs_of "$tag-started"
  grep -h "bpdkv\|hold budget\|fence\|lacks the read hooks\|KV cache size\|Maximum concurrency" "$RES/$tag-started-prefill-0.log" "$RES/$tag-started-decode-0.log" | head -n 16
  setsid timeout 900 python3 -m bpdkv.cli router --config "$R/etc/bpdkv/router-0.router.yaml" --log-level warning > /tmp/router.log 2>&1 < /dev/null &
  echo $! > /tmp/router.pid
  for i in $(seq 1 20); do curl -sf localhost:8000/ready >/dev/null && break; sleep 0.5; done
  timeout 60 python3 benchmarks/gpu/stream_shape.py http://127.0.0.1:8100 http://127.0.0.1:8200 qwen3-8b "$RES/$tag-stream-shape.json" > "$RES/$tag-stream-shape.txt" 2>&1
  echo "stream shape exit $?"; cut -c1-300 "$RES/$tag-stream-shape.txt" | head -n 40
  metrics "$tag-before"
  pack
  # Issue 21's workload, shortened: 4 conversations x 3 turns, 2,000-token system prompt + 6,000-token history, 150 new
  # and 100 output tokens per turn, P's cache off (salted), concurrency 1; both modes on the same servers, own prompts.
  bench "$tag-bench-both" --conversations 4 --turns 3 --system-tokens 2000 --start-history 6000 --new-tokens 150 \
    --output-tokens 100 --concurrency 1 --prefill-cache off --reuse both --allow-warm --seed 11 --mark-last-turn
  metrics "$tag-after"
  logs_of "$tag-after-bench"
  grep -h "bpdkv\|fence\|expired\|Traceback\|Error" /tmp/prefill-0.log /tmp/decode-0.log | grep -v "| " | tail -n 20
  grep -h "^vllm:\(nixl_\(xfer_time_seconds\|bytes_transferred\|num_descriptors\|num_kv_expired\|num_failed\)\|bpdkv_\)" "$RES/$tag-after-metrics.txt" | head -n 50
  grep -h -i "cuda_ipc\|cuda_copy\|rndv\|tcp" /tmp/prefill-0.log | head -n 40 > "$RES/$tag-ucx-vllm-prefill.txt"
  tail -n 30 /tmp/router.log > "$RES/$tag-router.log"
  pack
}

case $step in
  1)
    mkdir -p /tmp/stage && cp $S/1/* /tmp/stage/ && ls -la /tmp/stage
    nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv
    ;;
  2)
    cp $S/2/vllm.part.* /tmp/stage/ && cat /tmp/stage/vllm.part.0 $(ls /tmp/stage/vllm.part.0b 2>/dev/null) /tmp/stage/vllm.part.1 > /tmp/stage/vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl
    sha256sum /tmp/stage/vllm-0.33.0-*.whl
    $PIP /tmp/stage/vllm-0.33.0-*.whl $S/2/*.whl && echo "vllm 0.33.0 installed at ${SECONDS}s"
    ;;
  ucx)
    # Call 4 (optional, carry .gpu-stage-033/n = the two nixl wheels of chunk 3): why UCX takes tcp/cuda_copy for two processes on one GPU. Only NIXL;
    # 256 MiB reads, 30 s per setting.
    export MIB=256 PT=30
    $PIP $S/n/nixl*.whl || exit 1
    { df -h /dev/shm; ls -la /dev/shm | head -n 5; cat /proc/sys/kernel/shmmax /proc/sys/kernel/shmall; ls -la /dev/nvidia* ;
      nvidia-smi topo -m; nvidia-smi -q | grep -i -A2 "MIG\|Virtualization\|Persistence\|Compute Mode"; } > "$RES/machine.txt" 2>&1
    timeout 120 python3 benchmarks/gpu/cuda_ipc_copy.py --mib 1024 | tee "$RES/cuda-ipc-copy.json"
    probe debug UCX_LOG_LEVEL=debug
    probe same-process UCX_CUDA_IPC_ENABLE_SAME_PROCESS=y UCX_LOG_LEVEL=info
    probe proto-v1 UCX_PROTO_ENABLE=n UCX_LOG_LEVEL=info
    probe only-ipc UCX_TLS=sm,self,cuda_ipc,cuda_copy UCX_LOG_LEVEL=info
    probe rndv-get UCX_RNDV_SCHEME=get_zcopy UCX_LOG_LEVEL=info
    cat "$RES/nixl-probe.jsonl" 2>/dev/null | cut -c1-200; cat "$RES/nixl-probe-errors.txt" 2>/dev/null | tail -n 30
    head -n 30 "$RES/ucx-lanes-debug.txt"
    pack
    ;;
  getz)
    # Call 5 (optional, carry .gpu-stage-033/n): UCX 1.23 disables cuda_ipc get zcopy (NIXL READ) when it detects no
    # NVLink ("cuda-ipc get zcopy disabled as no nvlinks detected"), so reads fall back to tcp/lo emulation. Force it on.
    export PT=40
    $PIP $S/n/nixl*.whl || exit 1
    MIB=1024 probe get-zcopy-on UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y UCX_LOG_LEVEL=info
    MIB=256 probe default-256 UCX_LOG_LEVEL=info
    cat "$RES/nixl-probe.jsonl" 2>/dev/null | cut -c1-230; cat "$RES/nixl-probe-errors.txt" 2>/dev/null | tail -n 20
    grep -h "cfg#" "$RES"/ucx-lanes-*.txt | cut -c1-260
    pack
    ;;
  3)
    $PIP $S/3/*.whl $S/w/*.whl || exit 1
    python3 -c "
import importlib.metadata as m
for p in ('vllm', 'torch', 'nixl', 'nixl_cu13', 'bpdkv'):
    try:
        print(p, m.version(p))
    except Exception as exc:
        print(p, '?', exc)" | tee "$RES/versions.txt"
    nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv >> "$RES/versions.txt"
    echo "installed at ${SECONDS}s"
    [ -n "${PROBE_ONLY:-}" ] || grep -q "^vllm 0.33" "$RES/versions.txt" \
      || { echo "vLLM is not installed: a fresh machine (the last one went back after call 2); run calls 1 and 2 again"; pack; exit 1; }
    if [ -z "${PROBE_ONLY:-}" ]; then
      mkdir -p /tmp/gpuvenv/bin /tmp/qwen3-8b
      printf '#!/bin/sh\nexec %s "$@"\n' "$(command -v python3)" > /tmp/gpuvenv/bin/python && chmod +x /tmp/gpuvenv/bin/python
      cat > /tmp/qwen3-8b/config.json <<'JSON'
{"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 4096, "intermediate_size": 12288,
 "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
 "max_position_embeddings": 40960, "rms_norm_eps": 1e-06, "rope_theta": 1000000, "torch_dtype": "bfloat16",
 "tie_word_embeddings": false, "hidden_act": "silu", "attention_bias": false, "bos_token_id": 151643, "eos_token_id": 151645}
JSON
      python3 -m bpdkv.cli render benchmarks/gpu/h200-033-qwen3-8b-dummy.yaml --out /tmp/render | head -n 1
      cp "$R/opt/bpdkv/bin/prefill-0.sh" "$RES/rendered-prefill-0.sh"; cp "$R/etc/bpdkv/prefill-0.env" "$RES/rendered-prefill-0.env"
      start_pd ${PD_ENV:-}
      echo "P and D starting at ${SECONDS}s (plugin connector as rendered; extra env: ${PD_ENV:-none})" | tee "$RES/a-env.txt"
    fi
    # The one-GPU transport question, while P and D start (the probe shares the GPU with their start-ups).
    [ -z "${SKIP_PROBE:-}" ] && probe default UCX_PROTO_INFO=y UCX_LOG_LEVEL=info
    [ -z "${SKIP_PROBE:-}" ] && probe tls-ipc-copy-tcp UCX_TLS=cuda_ipc,cuda_copy,tcp
    [ -z "${SKIP_PROBE:-}" ] && probe no-cuda-ipc UCX_TLS=^cuda_ipc
    [ -z "${SKIP_PROBE:-}" ] && probe vmm-alloc PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True UCX_PROTO_INFO=y
    cat "$RES/nixl-probe.jsonl" 2>/dev/null | cut -c1-260; cat "$RES/nixl-probe-errors.txt" 2>/dev/null | tail -n 20
    echo "probe done at ${SECONDS}s"
    [ -n "${PROBE_ONLY:-}" ] && { pack; exit 0; }
    mode=plugin
    if ! wait_pd $(( $(left) - 200 )); then
      logs_of start-failed-plugin
      grep -h -A3 "Error\|Traceback" "$RES/start-failed-plugin-prefill-0.log" | head -n 40
      stop_pd; pack
      echo "== fallback: upstream NixlConnector (no bpdkv plugin connector)"
      mode=upstream
      KV_EDIT='c["kv_connector"]="NixlConnector"; c.pop("kv_connector_module_path",None); c["kv_connector_extra_config"].pop("unverified_reuse",None)' start_pd ${PD_ENV:-}
      wait_pd $(( $(left) - 120 )) || { logs_of start-failed-upstream; stop_pd; pack; exit 1; }
    fi
    echo "$mode" > "$RES/mode.txt"
    serve_and_bench a
    if [ -n "${AB_ENV:-}" ]; then
      # The same workload again on fresh servers with AB_ENV (e.g. the one-GPU transport fix), same call, same machine.
      stop_pd
      if [ "$(left)" -gt 240 ]; then
        start_pd $AB_ENV
        echo "P and D restarting at ${SECONDS}s with: $AB_ENV" | tee "$RES/b-env.txt"
        wait_pd $(( $(left) - 150 )) && serve_and_bench b || { logs_of start-failed-b; echo "b: no servers"; }
        if [ -n "${AGENTIC:-}" ] && curl -sf localhost:8000/ready >/dev/null; then
          # Issue 22 on the b servers (AB_ENV, same P/D/router, own prompts per mode): the agentic workload, paths auto vs
          # pull-only (reuse on), then reuse off. AGENTIC="ARGS..." sizes it (e.g. --scale 0.5 --conversations 4).
          bench b-agentic-paths --workload agentic --paths both --reuse on --allow-warm --seed 21 $AGENTIC
          metrics b-agentic-paths-after
          bench b-agentic-off --workload agentic --paths pull-only --reuse off --allow-warm --seed 22 $AGENTIC
          metrics b-agentic-after
        fi
      else
        echo "no time left for the AB_ENV run at ${SECONDS}s" | tee "$RES/b-env.txt"
      fi
    fi
    pack
    ;;
esac
