"""The KV-cache-aware router: a runtime that imports nothing of the deploy side (plan/apply/remote)."""
