"""Both threshold schedulers driven in-process: real vLLM 0.32 scheduler, no model, no engine.

ThresholdScheduler and ThresholdAsyncScheduler are built from vLLM's real VllmConfig
(the tiny model's config; no weights are loaded) and a real KVCacheConfig, and driven the
way vLLM's EngineCore drives them: `EngineLoop.step` is `EngineCore.step` for the sync class
and `EngineCore.step_with_batch_queue` with two batches in flight for the async one (what a
GPU engine with async scheduling runs). A stand-in model runner samples TOKEN for every
request whose prompt is complete after the step, nothing for a partial prefill.

The running CPU engine of the other real-engine tests forces synchronous scheduling, so this
is the only place where ThresholdAsyncScheduler runs; every test is parametrized over both
classes because the point is that the plugin behaves the same under both.

These need vLLM importable (~15 s to import), hence the real_engine marker.
"""

from __future__ import annotations

import pytest

from router.engine.wire import PREFILL_REQUEST_PARAMS

# The harness's fixtures, imported under their own names (an explicit re-export, which the
# linter keeps) so that this module's tests can ask for them.
from support.scheduler_loop import (
    BLOCK,
    TOKEN,
    MakeEngine,
    MakeRequest,
    assert_finished_normally,
    assert_rejected,
    prompt,
)
from support.scheduler_loop import block_hasher as block_hasher
from support.scheduler_loop import make_engine as make_engine
from support.scheduler_loop import make_request as make_request
from support.scheduler_loop import scheduler_cls as scheduler_cls

pytestmark = pytest.mark.real_engine


def test_cold_request_is_rejected_at_arrival_without_blocks(make_engine: MakeEngine, make_request: MakeRequest) -> None:
    engine = make_engine()  # arrival check on by default
    free_before = engine.pool.get_num_free_blocks()
    cold = make_request("cold", prompt(100, 64), threshold=0.5)

    engine.add(cold)
    # Rejected inside add_request: never queued, but the engine keeps stepping until the
    # rejection has been reported.
    assert "cold" not in engine.scheduler.requests
    assert engine.scheduler.get_request_counts() == (0, 0)
    assert engine.scheduler.has_requests()
    assert "cold" not in engine.outputs

    engine.run_until_idle()
    assert_rejected(engine, "cold", stage="arrival", hit=0, total=64, threshold=0.5)
    assert len(engine.outputs["cold"]) == 1
    assert all("cold" not in s.num_scheduled_tokens for s in engine.schedules)
    assert engine.allocations == []  # allocate_slots never ran for it
    assert engine.pool.get_num_free_blocks() == free_before
    # The next schedule() tells the workers it is finished (they drop any state by id).
    assert any("cold" in s.finished_req_ids for s in engine.schedules)


def test_cold_request_is_rejected_at_admission_when_arrival_check_is_off(
    make_engine: MakeEngine, make_request: MakeRequest
) -> None:
    engine = make_engine(cache_hit_arrival_check=False)
    free_before = engine.pool.get_num_free_blocks()
    # The rejected request is first in the queue: it must not hold up the one behind it.
    engine.add(
        make_request("cold", prompt(100, 64), threshold=0.5), make_request("other", prompt(300, 64), threshold=0.0)
    )
    assert engine.scheduler.get_request_counts() == (0, 2)  # both queued: no arrival check

    engine.step()
    first = engine.schedules[0]
    assert first.num_scheduled_tokens == {"other": 64}
    assert "cold" not in engine.scheduler.requests
    # Every block that left the pool belongs to "other"; "cold" never reached allocate_slots.
    other_blocks = engine.scheduler.kv_cache_manager.get_block_ids("other")[0]
    assert free_before - engine.pool.get_num_free_blocks() == len(other_blocks) == 64 // BLOCK
    assert [rid for rid, _ in engine.allocations] == ["other"]

    engine.run_until_idle()
    assert_rejected(engine, "cold", stage="admission", hit=0, total=64, threshold=0.5)
    assert_finished_normally(engine, "other", max_tokens=2)
    assert not engine.allocated("cold")
    assert engine.pool.get_num_free_blocks() == free_before


def test_threshold_zero_or_absent_is_scheduled_normally(make_engine: MakeEngine, make_request: MakeRequest) -> None:
    engine = make_engine()  # global default 0
    engine.add(make_request("zero", prompt(100, 64), threshold=0.0), make_request("absent", prompt(300, 64)))
    engine.run_until_idle()
    for rid in ("zero", "absent"):
        assert engine.first_scheduled_tokens(rid) == 64  # cold: the whole prompt computed
        assert_finished_normally(engine, rid, max_tokens=2)


def test_global_default_applies_unless_the_request_sets_its_own(
    make_engine: MakeEngine, make_request: MakeRequest
) -> None:
    engine = make_engine(global_cache_hit_threshold=0.5)
    engine.add(make_request("absent", prompt(100, 64)), make_request("own-zero", prompt(300, 64), threshold=0.0))
    engine.run_until_idle()
    assert_rejected(engine, "absent", stage="arrival", hit=0, total=64, threshold=0.5)
    assert_finished_normally(engine, "own-zero", max_tokens=2)


@pytest.mark.parametrize("arrival_check", [True, False], ids=["arrival-on", "arrival-off"])
def test_prefix_cache_hit_decides(make_engine: MakeEngine, make_request: MakeRequest, arrival_check: bool) -> None:
    engine = make_engine(cache_hit_arrival_check=arrival_check)
    shared = prompt(100, 4 * BLOCK)  # 64 tokens, four full blocks

    engine.add(make_request("first", shared, threshold=0.0))
    engine.run_until_idle()
    assert_finished_normally(engine, "first", max_tokens=2)
    assert engine.first_scheduled_tokens("first") == 64  # cold

    # The first request's four prompt blocks are now cached, but the last prompt token is
    # always recomputed, so a lookup of the same prompt hits (64 - 1) // 16 = 3 whole
    # blocks: 48 of 64 tokens = 0.75.
    engine.add(make_request("accepted", shared, threshold=0.5), make_request("too-high", shared, threshold=0.8))
    engine.run_until_idle()
    assert engine.first_scheduled_tokens("accepted") == 64 - 48  # only the miss is computed
    assert_finished_normally(engine, "accepted", max_tokens=2)
    assert_rejected(
        engine, "too-high", stage="arrival" if arrival_check else "admission", hit=48, total=64, threshold=0.8
    )
    assert not engine.allocated("too-high")


@pytest.mark.parametrize("arrival_check", [True, False], ids=["arrival-on", "arrival-off"])
def test_prefill_leg_is_never_rejected(make_engine: MakeEngine, make_request: MakeRequest, arrival_check: bool) -> None:
    # Built without a KV connector: vLLM's scheduler only hands kv_transfer_params to a
    # connector, so here they matter to nothing but the plugin's rule (is_prefill_leg), which
    # is what this checks through the real add_request/schedule paths. The NIXL exchange
    # itself is covered by the running-engine tests.
    engine = make_engine(cache_hit_arrival_check=arrival_check)
    prefill_leg = make_request(
        "prefill-leg",
        prompt(100, 64),
        threshold=0.9,
        kv_transfer_params=PREFILL_REQUEST_PARAMS,
    )
    control = make_request("control", prompt(300, 64), threshold=0.9)
    assert prefill_leg.kv_transfer_params is not None
    assert prefill_leg.kv_transfer_params["do_remote_decode"] is True
    from engine_launcher.vllm_plugin.scheduler import ThresholdSchedulerMixin

    assert isinstance(engine.scheduler, ThresholdSchedulerMixin)
    assert engine.scheduler._threshold_for(prefill_leg) == 0.0
    assert engine.scheduler._threshold_for(control) == 0.9

    engine.add(prefill_leg, control)
    engine.run_until_idle()
    assert engine.first_scheduled_tokens("prefill-leg") == 64  # cold, computed in full
    assert_finished_normally(engine, "prefill-leg", max_tokens=2)
    assert_rejected(
        engine, "control", stage="arrival" if arrival_check else "admission", hit=0, total=64, threshold=0.9
    )


def test_preempted_request_below_threshold_is_rejected_at_readmission(
    make_engine: MakeEngine, make_request: MakeRequest
) -> None:
    # 8 blocks, one of which vLLM keeps as the null block: 7 x 16 = 112 token slots for two
    # running requests that each need 3 blocks to start and grow one token per step.
    engine = make_engine(num_blocks=8, max_num_seqs=2)
    assert engine.pool.get_num_free_blocks() == 7
    victim_prompt = prompt(100, 2 * BLOCK + 1)  # 33 tokens: two full blocks + one token

    # Warm the victim's two prompt blocks, so it passes T = 0.9 on arrival and admission
    # (hit 32 of 33).
    engine.add(make_request("warm-up", victim_prompt, threshold=0.0, max_tokens=1))
    engine.run_until_idle()

    survivor = make_request(
        "survivor", prompt(300, 2 * BLOCK + 1), threshold=0.0, max_tokens=60
    )  # 93 tokens at most: fits alone in 6 blocks
    victim = make_request("victim", victim_prompt, threshold=0.9, max_tokens=100)
    engine.add(survivor, victim)

    # Both decode until the pool runs dry; vLLM then preempts the last running request
    # (the victim) when allocate_slots fails, freeing its blocks.
    for _ in range(100):
        engine.step()
        if any("victim" in (s.preempted_req_ids or set()) for s in engine.schedules):
            break
    else:
        pytest.fail("the victim was never preempted")
    allocations_before_preemption = len(engine.allocations)
    assert engine.first_scheduled_tokens("victim") == 1  # admitted on the warm-up's blocks

    engine.run_until_idle()
    streamed = engine.streamed_tokens("victim")
    assert streamed
    assert streamed == [TOKEN] * len(streamed)
    # Back in the queue it counts prompt + generated tokens, while the cache only still
    # holds its two prompt blocks (vLLM frees a request's blocks tail first). Its third
    # block (tokens 32-47) is gone by the time it is rejected: under the sync scheduler it
    # was cached, so the victim passes the re-check (48 of 49) step after step until the
    # survivor's growth evicts that block; the async scheduler caches a block only once the
    # step that computed it has returned, so it was never cached and the first re-check
    # rejects.
    total = len(victim_prompt) + len(streamed)
    assert 0.9 * total > 2 * BLOCK
    assert_rejected(engine, "victim", stage="readmission", hit=2 * BLOCK, total=total, threshold=0.9)
    # It keeps the tokens it generated (the API server already has them) ...
    assert list(victim.output_token_ids) == streamed
    assert victim.num_preemptions == 1
    # ... and never got blocks again after the preemption.
    assert not any(rid == "victim" and ok for rid, ok in engine.allocations[allocations_before_preemption:])
    assert_finished_normally(engine, "survivor", max_tokens=60)
    assert engine.pool.get_num_free_blocks() == 7
