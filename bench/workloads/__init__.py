"""The requests a run sends: generated workloads and Mooncake-format traces
(`generators`), the deterministic conversation trace (`trace_gen`), and a workload as
`replay`'s flags describe it (`spec`).

Imports nothing else of the bench (the launcher's simulator tokenizer only): every layer
above may use it.
"""
