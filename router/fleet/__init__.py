"""The datastore of engines: the backend registry with its breakers and token-level load
(`registry`), backends that come and go (`membership`), health checks and scrapes, the
threshold capability check, discovery (DNS, Kubernetes) and the engines the router starts.

May import routing (the snapshot and speed learner it feeds), engine, observability,
config and the leaves; never dispatch, answer or server.
"""
