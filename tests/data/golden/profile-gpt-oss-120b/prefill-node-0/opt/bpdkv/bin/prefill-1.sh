#!/bin/sh
# Managed by bpdkv (topology init-gpt-oss-120b): prefill instance prefill-1 on node prefill-node-0.
set -eu
set -a
. /etc/bpdkv/prefill-1.env
set +a
exec /opt/bpdkv/venv/bin/python -m vllm.entrypoints.cli.main serve openai/gpt-oss-120b \
  --served-model-name gpt-oss-120b \
  --host 0.0.0.0 \
  --port 8101 \
  --dtype auto \
  --kv-cache-dtype auto \
  --block-size 128 \
  --tensor-parallel-size 1 \
  --max-model-len 131072 \
  --kv-transfer-config '{"kv_connector":"BpdkvNixlConnector","kv_role":"kv_producer","kv_buffer_device":"cuda","kv_load_failure_policy":"fail","kv_connector_extra_config":{"backends":["LIBFABRIC"],"bidirectional_kv_xfer":true,"kv_lease_duration":30,"decoder_kv_blocks_ttl":480,"kv_recompute_threshold":64,"unverified_reuse":"refuse","bpdkv_link_seed_file":"/var/lib/bpdkv/prefill-1/link-seed.json"},"kv_connector_module_path":"bpdkv.vllm_plugin.connector"}'
