#!/bin/sh
# Managed by bpdkv (topology init-qwen3-32b): router instance router-0 on node decode-node-0.
set -eu
set -a
. /etc/bpdkv/router-0.env
set +a
exec /opt/bpdkv/venv/bin/bpdkv router \
  --config /etc/bpdkv/router-0.router.yaml
