#!/bin/sh
# Managed by bpdkv (topology glm5-p5en): router instance router-1 on node p5en-decode.
set -eu
set -a
. /etc/bpdkv/router-1.env
set +a
exec /opt/bpdkv/venv/bin/bpdkv router \
  --config /etc/bpdkv/router-1.router.yaml
