"""`readonly`: a dataclass the type checker holds frozen and the interpreter does not.

For records built on every request (a snapshot's engine views, plans, the cost model's
figures). A frozen dataclass's `__init__` sets each field through `object.__setattr__`: a
24-field engine view took ~5-7 us to build against ~0.7 us, and a snapshot builds one per
engine per request (~75 us for eight engines). The project's strict mypy over the code and
the tests reports any assignment to a field of such a record (PEP 681's `frozen_default`);
`dataclasses.replace` makes a changed copy as before. Unlike a frozen dataclass, one is not
hashable: none is used as a key.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar, dataclass_transform

T = TypeVar("T")


@dataclass_transform(frozen_default=True)
def readonly(cls: type[T]) -> type[T]:
    """`@dataclass(slots=True)` at run time, `frozen=True` to the type checker."""
    return dataclass(slots=True)(cls)
