"""The configuration: its schema (`schema`, frozen dataclasses with defaults), TOML parsed
and validated with messages that name the key (`parse`, `checks`, `discovery`), and the
environment and flag overrides.

A leaf: imports nothing of the router but `router.names`.
"""
