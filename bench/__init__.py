"""The benchmarks: `python -m bench <command>` (docs/BENCHMARKS.md), in layers that import
only downwards (pyproject.toml, [tool.importlinter]):

- `cli`: the command line; it parses flags and calls an experiment.
- `experiments`: one module per command (or per part of one): what is run and measured.
- `reports`: tables, plots and run directories from what the experiments measured.
- `harness`: the machinery runs share: processes, the simulated cluster, routers and
  their replicas, the load generator, the routing modes, small statistics.
- `workloads`: the requests a run sends, generated or read from a trace.
"""
