#!/bin/sh
# Managed by bpdkv (topology h200-shared-qwen3-8b-host-tier): router instance router-0 on node gpu-box.
set -eu
set -a
. /etc/bpdkv/router-0.env
set +a
exec /opt/bpdkv/venv/bin/bpdkv router \
  --config /etc/bpdkv/router-0.router.yaml
