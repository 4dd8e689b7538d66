"""What every experiment runs on: subprocesses and their pinning (`procs`), a simulated
cluster with a router in front and its metrics (`cluster`), router replicas and engine
restarts (`replicas`), the load generators (`loadgen`, asyncio; `load_clients`, blocking
clients and wrk), the routing modes the bench knows
(`modes`), the instant backend and pass-through proxy the overhead runs measure against,
and small statistics (`stats`).

May import `bench.workloads`, the router's configuration and policy registry, and the
launcher's simulator; never the experiments, the reports or the CLI.
"""
