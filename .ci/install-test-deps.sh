#!/bin/sh
# System packages the test suite uses for real: systemd-analyze (unit verification), redis-server (router state).
set -eu
missing=""
command -v systemd-analyze >/dev/null 2>&1 || missing="$missing systemd"
command -v redis-server >/dev/null 2>&1 || missing="$missing redis-server"
if [ -n "$missing" ]; then
    if [ "$(id -u)" != 0 ]; then
        echo "missing:$missing (install them as root: apt-get install -y$missing)" >&2
        exit 1
    fi
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends $missing >/dev/null
fi
