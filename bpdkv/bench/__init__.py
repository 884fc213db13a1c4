"""`bpdkv bench`: a seeded multi-turn workload against a router, per-turn latency, server-side KV metrics, report."""
