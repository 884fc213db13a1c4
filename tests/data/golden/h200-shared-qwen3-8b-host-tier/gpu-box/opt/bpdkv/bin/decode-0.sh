#!/bin/sh
# Managed by bpdkv (topology h200-shared-qwen3-8b-host-tier): decode instance decode-0 on node gpu-box.
set -eu
set -a
. /etc/bpdkv/decode-0.env
set +a
# Shares a GPU with an engine started before it (at boot systemd starts both at once): wait until that engine serves,
# its weights and KV cache allocated, so that this one's memory profile does not count them (bpdkv/render.py).
for url in http://127.0.0.1:8100/health; do
  waited=0
  until /opt/bpdkv/venv/bin/python -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)' "$url" 2>/dev/null; do
    waited=$((waited + 2))
    if [ "$waited" -ge 1800 ]; then
      echo "decode-0: $url not serving after 1800 s; exiting (systemd restarts this unit)" >&2
      exit 1
    fi
    sleep 2
  done
done
exec /opt/bpdkv/venv/bin/python -m vllm.entrypoints.cli.main serve Qwen/Qwen3-8B \
  --served-model-name qwen3-8b \
  --host 0.0.0.0 \
  --port 8200 \
  --dtype bfloat16 \
  --kv-cache-dtype auto \
  --block-size 128 \
  --tensor-parallel-size 1 \
  --max-model-len 32768 \
  --gpu-memory-utilization 0.45 \
  --kv-transfer-config '{"kv_connector":"MultiConnector","kv_role":"kv_consumer","kv_buffer_device":"cuda","kv_load_failure_policy":"fail","kv_connector_extra_config":{"connectors":[{"kv_connector":"BpdkvNixlConnector","kv_role":"kv_consumer","kv_buffer_device":"cuda","kv_load_failure_policy":"fail","kv_connector_extra_config":{"backends":["UCX"],"bidirectional_kv_xfer":true,"kv_lease_duration":30,"decoder_kv_blocks_ttl":480,"kv_recompute_threshold":64,"unverified_reuse":"refuse"},"kv_connector_module_path":"bpdkv.vllm_plugin.connector"},{"kv_connector":"OffloadingConnector","kv_role":"kv_both","kv_connector_extra_config":{"cpu_bytes_to_use":51539607552,"offload_prompt_only":false}}]}}'
