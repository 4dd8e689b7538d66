"""Helpers every test directory shares (tests/ is on the import path: `import support.x`).

Basics: free ports (`ports`), process groups (`processes`), SSE bodies (`sse`), Prometheus
samples read strictly (`metrics`), polling for a condition (`polling`), and whether a
missing dependency may skip a test (`requirements`, the one reader of
CACHEHIT_REQUIRE_REAL_ENGINE).

Routers and engines: a router in the test's event loop in front of simulated engines
(`cluster`), the same as subprocesses (`subprocess_cluster`), routers from a raw config on
shared-port fleets (`fleet`), a real DNS server (`dns_server`), posting to a simulated
engine (`sim_http`), the engine launcher as a process (`launcher_process`), real vLLM
engines (`real_engine`).

The router's parts on their own: engines faked at the upstream client's interface
(`fake_upstream`), vLLM's serving layer in miniature (`vllm_serving`), the real vLLM
captures (`wire_captures`), driving the shaper (`shaping`), routing snapshots (`snapshots`).
"""
