"""The router gives freed heap back once idle (router/server/memtrim.py): once per burst,
never while busy."""

from __future__ import annotations

from router.server.memtrim import IdleTrimmer, malloc_trim
from support.polling import eventually


async def test_trims_once_after_a_burst_and_never_while_busy() -> None:
    calls: list[int] = []

    def trim(pad: int) -> int:
        calls.append(pad)
        return 1

    t = IdleTrimmer(trim=trim, idle_s=0.02)
    t.idle()  # nothing ran yet: nothing to give back
    t.busy()
    t.idle()
    t.busy()  # a request before the idle time passed: no trim under load
    t.idle()
    await eventually(lambda: calls == [0], 5.0, "one trim after the idle time", interval=0.005)
    t.idle()  # no request since: no second trim
    assert t._timer is None
    assert calls == [0]


async def test_requests_one_after_another_keep_one_timer_and_trim_once_they_stop() -> None:
    """Requests one after another: the timer is not re-armed for each request, and the
    trim comes once they stop."""
    calls: list[int] = []

    def trim(pad: int) -> int:
        calls.append(pad)
        return 1

    t = IdleTrimmer(trim=trim, idle_s=0.05)
    t.busy()
    t.idle()
    timer = t._timer
    assert timer is not None
    for _ in range(5):
        t.busy()
        t.idle()
        assert t._timer is timer  # the same timer: none armed or cancelled per request
    await eventually(lambda: calls == [0], 5.0, "one trim once the requests stopped", interval=0.005)


def test_glibc_malloc_trim_is_found_and_runs() -> None:
    trim = malloc_trim()
    assert trim is not None  # the router's platform (Debian, glibc)
    assert trim(0) in (0, 1)


async def test_memory_freed_outside_requests_is_trimmed_once_idle() -> None:
    """A connection dropped with a large head half received: no request ran, so only
    `freed` asks for the trim; never while a request is in flight."""
    calls: list[int] = []

    def trim(pad: int) -> int:
        calls.append(pad)
        return 1

    t = IdleTrimmer(trim=trim, idle_s=0.02)
    t.busy()
    t.freed()  # a request in flight: it trims when it ends
    assert t._timer is None
    t.idle()
    await eventually(lambda: calls == [0], 5.0, "the trim after the request", interval=0.005)
    t.freed()  # idle: a trim of its own
    await eventually(lambda: calls == [0, 0], 5.0, "the trim after the dropped connection", interval=0.005)
