#!/bin/sh
# Managed by bpdkv (topology qwen3-32b-p5en): prefill instance prefill-2 on node p5en-a.
set -eu
set -a
. /etc/bpdkv/prefill-2.env
set +a
exec /opt/bpdkv/venv/bin/python -m vllm.entrypoints.cli.main serve Qwen/Qwen3-32B \
  --served-model-name qwen3-32b \
  --host 0.0.0.0 \
  --port 8102 \
  --dtype bfloat16 \
  --kv-cache-dtype auto \
  --block-size 128 \
  --tensor-parallel-size 2 \
  --max-model-len 32768 \
  --kv-transfer-config '{"kv_connector":"BpdkvNixlConnector","kv_role":"kv_producer","kv_buffer_device":"cuda","kv_load_failure_policy":"fail","kv_connector_extra_config":{"backends":["LIBFABRIC"],"bidirectional_kv_xfer":true,"kv_lease_duration":30,"decoder_kv_blocks_ttl":480,"kv_recompute_threshold":64,"unverified_reuse":"refuse","bpdkv_link_seed_file":"/var/lib/bpdkv/prefill-2/link-seed.json"},"kv_connector_module_path":"bpdkv.vllm_plugin.connector"}'
