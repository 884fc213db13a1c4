#!/bin/bash
# GPU session of 2026-12-06 (one H100 or H200, vLLM 0.34.0 staged by ../shared's build-chunks-0.34.sh, no patch): run on
# the lent machine after chunks 1-4, from the checkout root, one device call per step, back to back.
#   tier:  chunk 5's install, then the host-tier example (examples/h200-shared-qwen3-8b-host-tier.yaml) as rendered:
#          does it serve (issue 46: every request failed on "Connector 'BpdkvNixlConnector' is not registered")?
#          A short agentic load through the router, streamed and not; errors, tokens pulled, the log lines that matter.
#   wall:  the HBM wall (issue 46), one call per fleet: `wall-tier` the host-tier example, `wall-hbm` the shared example
#          (HBM only), each fresh, the same agentic load (12 conversations x 5 turns, 4-16K-token first prompts, tool
#          results, documents: histories ~2x one engine's HBM KV), reuse on with per-turn paths; `wall-hbm` then reuse off
#          on the same servers with fresh prompts (bench --reuse both).
#   seeded (written 2026-12-06, not run yet: the session's device time ran out): issue 45 item 3 — the shared-GPU example, then what `bpdkv apply` runs on P's node after its gates
#          (python -m bpdkv.deploy.linkseed: real pulls at three sizes, the seed written where the rendered P reads it),
#          then the first conversations, reuse on vs off (fresh prompts each, P's cache salted), P's decisions.
#   quiet: the shared-GPU example (h200-shared-qwen3-8b.yaml) twice, fresh engines each: bpdkv's default (NIXL's
#          progress thread waits on events) and `bpdkv_nixl_progress_delay_us: 0` (NIXL's busy poll, set by hand in the
#          rendered launch scripts): each engine's CPU (all its processes) idle and while D holds, and the pulls' NIXL
#          transfer time on the same short workload (issue 45 item 1).
# Changed by hand for the lent machine (both examples): model.path /tmp/qwen3-8b (a config.json only: dummy weights),
# vllm.venv /tmp/gpuvenv (launch-rendered.sh's wrapper of the staged site), --load-format dummy --skip-tokenizer-init
# --enforce-eager (CUDA graphs untested on the machine's torch 2.11), VLLM_USE_FLASHINFER_SAMPLER=0 (flashinfer not
# staged). P and D share the one GPU in every figure. Results under $OUT/<step>/.
set -uo pipefail
step=$1
RUN=.gpu-stage-034/run
L="bash $RUN/launch-rendered.sh"
res=$OUT/$step
mkdir -p "$res"
. /tmp/site/env.sh 2>/dev/null || true
export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages

lent() {  # lent EXAMPLE OUT: the example with the lent machine's settings
  python3 - "$1" "$2" <<'EOF'
import sys, yaml
doc = yaml.safe_load(open(sys.argv[1]))
doc.setdefault("model", {})["path"] = "/tmp/qwen3-8b"
vllm = doc.setdefault("vllm", {})
vllm["venv"] = "/tmp/gpuvenv"
vllm["extra_args"] = ["--load-format", "dummy", "--skip-tokenizer-init", "--enforce-eager"]
vllm["env"] = {"VLLM_USE_FLASHINFER_SAMPLER": "0"}
yaml.safe_dump(doc, open(sys.argv[2], "w"), sort_keys=False)
EOF
}

cpu_of() {  # cpu_of SECONDS: cores used by each instance's processes (its process group) over SECONDS
  python3 - "$1" <<'EOF'
import os, sys, time, glob
tick = os.sysconf("SC_CLK_TCK")
groups = {os.path.basename(f)[:-4]: int(open(f).read()) for f in glob.glob("/tmp/bpdkv-run/*.pid")}
def cpu():
    out = dict.fromkeys(groups, 0.0)
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            fields = open(stat).read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        for name, pgid in groups.items():
            if int(fields[2]) == pgid:
                out[name] += (int(fields[11]) + int(fields[12])) / tick
    return out
a, t = cpu(), time.monotonic()
time.sleep(float(sys.argv[1]))
b, dt = cpu(), time.monotonic() - t
print({k: round((b[k] - a[k]) / dt, 4) for k in sorted(groups)})
EOF
}

metrics() {  # metrics LABEL: the figures of P and D that matter here
  for port in 8100 8200; do
    curl -s localhost:$port/metrics | grep -E "^vllm:(prompt_tokens_by_source_total|nixl_xfer_time_seconds_(sum|count)|nixl_bytes_transferred_(sum|count)|bpdkv_(pull_decisions|verified|pin_granted|pin_refused|hold_released)[a-z_]*)" | grep -v _created | sed "s/^/$1 :$port /"
  done
}

bench() {  # bench NAME ARGS...: a short load through the router; its JSON report and its headline
  python3 -m bpdkv.cli bench http://127.0.0.1:8000 --conversations 4 --turns 3 --system-tokens 500 --start-history 3000 \
    --new-tokens 150 --output-tokens 64 --concurrency 4 --metrics http://127.0.0.1:8100,http://127.0.0.1:8200 \
    --out "$res/$1.json" "${@:2}" > "$res/$1.txt" 2>&1
  echo "bench $1: rc $?"; tail -n 25 "$res/$1.txt"
}

fleet() {  # fleet TOPOLOGY [busy]: render, (busy: NIXL's busy poll by hand), start, wait
  rm -rf /tmp/render && python3 -m bpdkv.cli render "$1" --out /tmp/render > /dev/null || return 1
  if [ "${2:-}" = busy ]; then
    sed -i 's/"kv_connector_extra_config":{"backends"/"kv_connector_extra_config":{"bpdkv_nixl_progress_delay_us":0,"backends"/' /tmp/render/gpu-box/opt/bpdkv/bin/*.sh
    grep -c bpdkv_nixl_progress_delay_us /tmp/render/gpu-box/opt/bpdkv/bin/*.sh
  fi
  MODEL_CONFIG=$RUN/qwen3-8b-config.json $L start /tmp/render/gpu-box && $L wait 420
}

keep_logs() { mkdir -p "$res/logs-$1" && cp /tmp/bpdkv-run/*.log "$res/logs-$1/" 2>/dev/null; }

case $step in
  tier)
    bash .gpu-stage-034/5/install.sh || exit 1
    . /tmp/site/env.sh
    lent examples/h200-shared-qwen3-8b-host-tier.yaml $RUN/tier.yaml
    if fleet $RUN/tier.yaml; then
      bench tier-stream --reuse on --paths auto --stream
      bench tier-nostream --reuse on --paths auto --no-stream --seed 1
      metrics tier | tee "$res/metrics.txt"
    fi
    grep -h "not registered\|Traceback\|Error\|bpdkv: NIXL progress\|hold budget\|Backend UCX\|OffloadingConnector\|MultiConnector" /tmp/bpdkv-run/*.log | sort | uniq -c | sort -rn | head -n 40
    keep_logs tier
    $L stop
    ;;
  wall-tier|wall-hbm)
    [ -f /tmp/site/env.sh ] || bash .gpu-stage-034/5/install.sh || exit 1
    . /tmp/site/env.sh
    ex=examples/h200-shared-qwen3-8b.yaml; [ $step = wall-tier ] && ex=examples/h200-shared-qwen3-8b-host-tier.yaml
    lent $ex $RUN/$step.yaml
    if fleet $RUN/$step.yaml; then
      reuse=on; [ $step = wall-hbm ] && reuse=both
      python3 -m bpdkv.cli bench http://127.0.0.1:8000 --workload agentic --conversations 12 --turns 5 --concurrency 12 \
        --output-tokens 128 --paths auto --reuse $reuse --metrics http://127.0.0.1:8100,http://127.0.0.1:8200 \
        --decode-metrics http://127.0.0.1:8200 --seed 7 --out "$res/$step.json" > "$res/$step.txt" 2>&1
      echo "bench $step: rc $?"; tail -n 40 "$res/$step.txt"
      metrics "$step" | tee "$res/metrics.txt"
    fi
    grep -h "not registered\|Traceback\|KV cache usage\|hold budget\|KV Transfer metrics" /tmp/bpdkv-run/*.log | tail -n 12 | cut -c1-400
    keep_logs "$step"
    $L stop
    ;;
  seeded)
    CHECK=0 bash .gpu-stage-034/5/install.sh || exit 1
    . /tmp/site/env.sh
    lent examples/h200-shared-qwen3-8b.yaml $RUN/seeded.yaml
    if fleet $RUN/seeded.yaml; then
      python3 -m bpdkv.deploy.linkseed prefill-0 http://127.0.0.1:8100 /var/lib/bpdkv/prefill-0/link-seed.json qwen3-8b \
        256,1024,4096 120 decode-0=http://127.0.0.1:8200 > "$res/linkseed.json"; echo "linkseed: rc $?"
      python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(d['pairs'], d['seed'])" "$res/linkseed.json"
      bench seeded --reuse both --paths pull-only --prefill-cache off
      metrics seeded | grep -E "decision|external" | tee "$res/metrics.txt"
    fi
    grep -h "bpdkv link seed" /tmp/bpdkv-run/*.log | head -n 3 | cut -c1-300
    keep_logs seeded
    $L stop
    ;;
  quiet)
    lent examples/h200-shared-qwen3-8b.yaml $RUN/shared.yaml
    for mode in event busy; do
      echo "== $mode"
      if fleet $RUN/shared.yaml "$([ $mode = busy ] && echo busy)"; then
        sleep 5
        echo "idle, $mode: $(cpu_of 20)" | tee -a "$res/cpu.txt"
        bench "quiet-$mode" --reuse on --paths pull-only --prefill-cache off
        echo "after the load (D holds), $mode: $(cpu_of 20)" | tee -a "$res/cpu.txt"
        metrics "$mode" | tee -a "$res/metrics.txt"
      fi
      grep -h "bpdkv: NIXL progress" /tmp/bpdkv-run/*.log | sort | uniq -c
      keep_logs "$mode"
      $L stop
    done
    ;;
esac
