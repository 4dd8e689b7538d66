"""Routing decisions, pure: plain functions and small classes over a frozen snapshot that
return a plan. The one cost model (`costmodel`), what it learns online (`speed_learner`),
the snapshot, the prefix memory, the fallback and the strategies (`policies/`, one module
each, registered by name).

No I/O: may import config and the leaves only (import-linter checks it).
"""
