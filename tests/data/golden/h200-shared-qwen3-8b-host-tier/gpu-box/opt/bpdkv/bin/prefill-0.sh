#!/bin/sh
# Managed by bpdkv (topology h200-shared-qwen3-8b-host-tier): prefill instance prefill-0 on node gpu-box.
set -eu
set -a
. /etc/bpdkv/prefill-0.env
set +a
exec /opt/bpdkv/venv/bin/python -m vllm.entrypoints.cli.main serve Qwen/Qwen3-8B \
  --served-model-name qwen3-8b \
  --host 0.0.0.0 \
  --port 8100 \
  --dtype bfloat16 \
  --kv-cache-dtype auto \
  --block-size 128 \
  --tensor-parallel-size 1 \
  --max-model-len 32768 \
  --gpu-memory-utilization 0.45 \
  --kv-transfer-config '{"kv_connector":"MultiConnector","kv_role":"kv_producer","kv_buffer_device":"cuda","kv_load_failure_policy":"fail","kv_connector_extra_config":{"connectors":[{"kv_connector":"BpdkvNixlConnector","kv_role":"kv_producer","kv_buffer_device":"cuda","kv_load_failure_policy":"fail","kv_connector_extra_config":{"backends":["UCX"],"bidirectional_kv_xfer":true,"kv_lease_duration":30,"decoder_kv_blocks_ttl":480,"kv_recompute_threshold":64,"unverified_reuse":"refuse","bpdkv_link_seed_file":"/var/lib/bpdkv/prefill-0/link-seed.json"},"kv_connector_module_path":"bpdkv.vllm_plugin.connector"},{"kv_connector":"OffloadingConnector","kv_role":"kv_both","kv_connector_extra_config":{"cpu_bytes_to_use":17179869184}}]}}'
