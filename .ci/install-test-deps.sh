#!/bin/sh
# System packages the test suite uses for real: systemd-analyze (unit verification), redis-server (router state),
# OpenSSH server + iproute2 + util-linux (SSH test hosts in network namespaces), prometheus (bpdkv tune --prometheus),
# nginx (the router behind a real reverse proxy).
set -eu
missing=""
command -v systemd-analyze >/dev/null 2>&1 || missing="$missing systemd"
command -v redis-server >/dev/null 2>&1 || missing="$missing redis-server"
[ -x /usr/sbin/sshd ] || missing="$missing openssh-server"
command -v ip >/dev/null 2>&1 || missing="$missing iproute2"
command -v nsenter >/dev/null 2>&1 || missing="$missing util-linux"
command -v ss >/dev/null 2>&1 || missing="$missing iproute2"
command -v pgrep >/dev/null 2>&1 || missing="$missing procps"
command -v prometheus >/dev/null 2>&1 || missing="$missing prometheus"  # bpdkv tune --prometheus against a real server
command -v nginx >/dev/null 2>&1 || missing="$missing nginx"  # the router behind a real reverse proxy (HTTP/1.0 upstream)
if [ -n "$missing" ]; then
    if [ "$(id -u)" != 0 ]; then
        echo "missing:$missing (install them as root: apt-get install -y$missing)" >&2
        exit 1
    fi
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    # policy-rc.d keeps the packages from starting their daemons: the tests start what they need themselves.
    made_policy=""
    if [ ! -e /usr/sbin/policy-rc.d ]; then
        printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d && made_policy=1
    fi
    apt-get install -y -qq --no-install-recommends $missing >/dev/null
    [ -z "$made_policy" ] || rm -f /usr/sbin/policy-rc.d
fi
