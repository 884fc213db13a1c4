"""Topology pipeline: load (YAML + profiles) → schema → model → checks."""
