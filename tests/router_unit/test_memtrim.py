"""The router gives freed heap back once idle: once per burst, never while busy."""
import asyncio

from router.memtrim import IdleTrimmer, malloc_trim


async def _until(pred, timeout: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not pred():
        assert loop.time() < end, "condition not reached"
        await asyncio.sleep(0.005)


async def test_trims_once_after_a_burst_and_never_while_busy():
    calls: list[int] = []
    t = IdleTrimmer(trim=lambda pad: calls.append(pad) or 1, idle_s=0.02)
    t.idle()  # nothing ran yet: nothing to give back
    t.busy()
    t.idle()
    t.busy()  # a request before the idle time passed: no trim under load
    assert t._timer is None
    t.idle()
    await _until(lambda: calls == [0])
    t.idle()  # no request since: no second trim
    assert t._timer is None and calls == [0]


def test_glibc_malloc_trim_is_found_and_runs():
    trim = malloc_trim()
    assert trim is not None  # the router's platform (Debian, glibc)
    assert trim(0) in (0, 1)
