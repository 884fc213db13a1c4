#!/bin/sh
# Managed by bpdkv (topology glm5-p5en): router instance router-0 on node p5en-prefill.
set -eu
set -a
. /etc/bpdkv/router-0.env
set +a
exec /opt/bpdkv/venv/bin/bpdkv router \
  --config /etc/bpdkv/router-0.router.yaml
