"""Helpers every test directory shares: free ports, process groups, SSE bodies, Prometheus
samples, and polling for a condition (tests/conftest.py puts `tests` on the import path)."""
