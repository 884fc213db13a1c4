#!/bin/sh
# Managed by bpdkv (topology init-tiny-cpu): prefill instance prefill-1 on node prefill-node-1.
set -eu
set -a
. /etc/bpdkv/prefill-1.env
set +a
exec /opt/bpdkv/venv/bin/python -m vllm.entrypoints.openai.api_server \
  --model /opt/bpdkv/models/tiny-cpu \
  --served-model-name tiny \
  --host 0.0.0.0 \
  --port 8100 \
  --dtype float32 \
  --kv-cache-dtype auto \
  --block-size 32 \
  --tensor-parallel-size 1 \
  --max-model-len 1024 \
  --kv-transfer-config '{"kv_connector":"BpdkvNixlConnector","kv_role":"kv_producer","kv_buffer_device":"cpu","kv_load_failure_policy":"fail","kv_connector_extra_config":{"backends":["UCX"],"bidirectional_kv_xfer":true,"kv_lease_duration":30,"decoder_kv_blocks_ttl":120,"kv_recompute_threshold":16,"unverified_reuse":"refuse","bpdkv_link_seed_file":"/var/lib/bpdkv/prefill-1/link-seed.json"},"kv_connector_module_path":"bpdkv.vllm_plugin.connector"}' \
  --enforce-eager \
  --seed 0
