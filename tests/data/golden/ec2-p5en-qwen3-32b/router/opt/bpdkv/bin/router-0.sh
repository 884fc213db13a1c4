#!/bin/sh
# Managed by bpdkv (topology qwen3-32b-ec2): router instance router-0 on node router.
set -eu
set -a
. /etc/bpdkv/router-0.env
set +a
exec /opt/bpdkv/venv/bin/bpdkv router \
  --config /etc/bpdkv/router-0.router.yaml
