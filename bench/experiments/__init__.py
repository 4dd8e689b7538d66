"""One module per benchmark command (or per part of one): what it starts, sends and
measures. `options` and `runspec` hold the replay flags and run parameters the
replay-based commands share; `replay` is one run, which `suite`, `fleet` and the sweeps
repeat. A command too long for one module is split by concern (soak: `soak`,
`soak_procs`, `soak_load`, `soak_report`).

May import the reports, the harness and the workloads; never the CLI (it calls in, the
experiments do not call back).
"""
