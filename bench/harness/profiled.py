"""`python -m bench.harness.profiled OUT -m MODULE ARGS...`: a module run under cProfile on CPU time.

`python -m cProfile` times functions by the wall clock, so on a busy machine a function
that is preempted (or a write the kernel makes wait) looks expensive; this profiler counts
only the process's CPU time (`time.process_time`). The stats are written to OUT when the
module returns (the router does on SIGTERM).
"""

from __future__ import annotations

import cProfile
import runpy
import sys
import time


def main() -> None:
    out, flag, module, *args = sys.argv[1:]
    if flag != "-m":
        raise SystemExit("usage: python -m bench.harness.profiled OUT -m MODULE [ARGS...]")
    sys.argv = [module, *args]
    prof = cProfile.Profile(time.process_time)
    try:
        prof.runcall(runpy.run_module, module, run_name="__main__", alter_sys=True)
    except SystemExit:
        pass
    finally:
        prof.dump_stats(out)


if __name__ == "__main__":
    main()
