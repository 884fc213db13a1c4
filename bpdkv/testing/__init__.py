"""Test doubles shipped with bpdkv (for its own tests and benchmarks, and for users testing their routing)."""
