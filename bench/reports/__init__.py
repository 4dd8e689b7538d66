"""What the experiments' results look like on screen and on disk: console and Markdown
tables, plots and the `compare` command's output (`render`), a run directory's files
(`rundir`), the routing suite's regret table (`suite_report`) and the fleet table
(`fleet_table`).

May import `bench.harness` and `bench.workloads`; never the experiments or the CLI, so a
table can be rebuilt from results on disk without running anything.
"""
