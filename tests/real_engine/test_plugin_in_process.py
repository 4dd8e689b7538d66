"""The plugin's patches inside this process, against the installed vLLM (no engine started).

These need vLLM importable (~15 s to import), hence the real_engine marker.
"""

from __future__ import annotations

import logging
from types import ModuleType
from typing import Any

import pytest

pytestmark = pytest.mark.real_engine


@pytest.fixture(scope="module")
def plugin(vllm_plugin: ModuleType) -> ModuleType:
    vllm_plugin.register()  # vLLM may call it more than once per process
    return vllm_plugin


def test_finish_reason_exists_and_survives_msgspec(plugin: ModuleType) -> None:
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason
    from vllm.v1.request import RequestStatus
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    reason = FinishReason.CACHE_THRESHOLD  # type: ignore[attr-defined]  # a member the plugin adds at run time
    assert str(reason) == "cache_threshold"
    assert list(FinishReason)[-1] is reason
    status = RequestStatus.FINISHED_CACHE_THRESHOLD  # type: ignore[attr-defined]  # a member the plugin adds at run time
    assert RequestStatus.is_finished(status)
    assert RequestStatus.get_finished_reason(status) is reason
    wire = MsgpackEncoder().encode(
        EngineCoreOutputs(outputs=[EngineCoreOutput(request_id="r", new_token_ids=[], finish_reason=reason)])
    )
    decoded = MsgpackDecoder(EngineCoreOutputs).decode(wire)
    assert decoded.outputs[0].finish_reason is reason


def test_request_models_carry_and_validate_the_threshold(plugin: ModuleType) -> None:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.exceptions import VLLMValidationError

    # vLLM's request models are pydantic models (mypy, without pydantic's plugin, asks for
    # every field), and `cache_hit_threshold` is a field the plugin adds at run time.
    req = CompletionRequest(  # type: ignore[call-arg]
        model="m", prompt="p", cache_hit_threshold=0.7, vllm_xargs={"cache_hit_threshold": 0.2, "keep": 1}
    )
    assert req.to_sampling_params(4, {}).extra_args == {"cache_hit_threshold": 0.7, "keep": 1}
    chat_req = ChatCompletionRequest(  # type: ignore[call-arg]
        model="m", messages=[{"role": "user", "content": "x"}], vllm_xargs={"cache_hit_threshold": 0}
    )
    assert chat_req.to_sampling_params(4, {}).extra_args == {"cache_hit_threshold": 0.0}
    assert CompletionRequest(model="m", prompt="p").to_sampling_params(4, {}).extra_args is None  # type: ignore[call-arg]
    with pytest.raises(VLLMValidationError) as info:
        CompletionRequest(model="m", prompt="p", cache_hit_threshold=1.5).to_sampling_params(4, {})  # type: ignore[call-arg]
    assert info.value.parameter == "cache_hit_threshold"


def test_a_messages_request_carries_and_validates_the_threshold(plugin: ModuleType) -> None:
    from vllm.entrypoints.anthropic.protocol import AnthropicMessagesRequest
    from vllm.entrypoints.anthropic.serving import AnthropicServingMessages
    from vllm.exceptions import VLLMValidationError

    def chat_params(**kw: object) -> object:
        body = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}], **kw}
        req = AnthropicMessagesRequest.model_validate(body)
        return AnthropicServingMessages.to_chat_completion_request(req).to_sampling_params(4, {}).extra_args

    assert chat_params(cache_hit_threshold=0.7) == {"cache_hit_threshold": 0.7}
    assert chat_params(vllm_xargs={"cache_hit_threshold": 0.2}) == {"cache_hit_threshold": 0.2}
    # Both: the top-level value wins, as on every other route.
    assert chat_params(cache_hit_threshold=1, vllm_xargs={"cache_hit_threshold": 0.2, "k": 1}) == {
        "cache_hit_threshold": 1.0,
        "k": 1,
    }
    assert chat_params() is None
    with pytest.raises(VLLMValidationError) as info:
        chat_params(cache_hit_threshold="0.5")
    assert info.value.parameter == "cache_hit_threshold"


def test_zero_token_rejection_is_made_visible_and_mark_removed(plugin: ModuleType) -> None:
    from vllm.outputs import CompletionOutput, RequestOutput

    from engine_launcher.vllm_plugin.stream_patch import REJECTION_MARK, fix_request_output

    out = RequestOutput(
        request_id="r",
        prompt=None,
        prompt_token_ids=[1, 2],
        prompt_logprobs=None,
        outputs=[
            CompletionOutput(
                index=0, text="", token_ids=[], cumulative_logprob=None, logprobs=None, finish_reason="cache_threshold"
            )
        ],
        finished=True,
        kv_transfer_params={REJECTION_MARK: {"stage": "arrival"}},
    )
    fix_request_output(out)
    text = out.outputs[0].text
    assert text == ""
    assert bool(text)
    assert out.kv_transfer_params is None


class _ListHandler(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_unsupported_vllm_version_refuses_to_start(plugin: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    import vllm

    from engine_launcher.vllm_plugin import scheduler, version

    monkeypatch.setattr(vllm, "__version__", "0.34.0")
    with pytest.raises(
        version.UnsupportedVLLMVersion, match=r"supports vLLM 0\.32\.x and 0\.33\.x only; this is vLLM 0\.34\.0"
    ):
        scheduler.ThresholdScheduler()
    with pytest.raises(version.UnsupportedVLLMVersion):
        scheduler.ThresholdAsyncScheduler()
    # register() must not break an unrelated vLLM: it logs and patches nothing.
    import engine_launcher.vllm_plugin as plugin_pkg

    monkeypatch.setattr(plugin_pkg, "_registered", False)
    # vLLM's "vllm" logger does not propagate to the root, so listen on ours directly.
    handler = _ListHandler()
    plugin_logger = logging.getLogger("vllm.plugins.cachehit_threshold")
    plugin_logger.addHandler(handler)
    try:
        plugin_pkg.register()
    finally:
        plugin_logger.removeHandler(handler)
    assert plugin_pkg._registered is False
    assert any("0.32.x" in r.getMessage() and r.levelno == logging.ERROR for r in handler.records)


def test_nixl_progress_delay_parsing() -> None:
    from engine_launcher.vllm_plugin.nixl_progress import ENV, configured_delay_us

    assert configured_delay_us({}) is None
    assert configured_delay_us({ENV: ""}) is None  # empty: NIXL's own behaviour
    assert configured_delay_us({ENV: "10000"}) == 10000
    for bad in ("-1", "1.5", "fast"):
        with pytest.raises(ValueError, match=ENV):
            configured_delay_us({ENV: bad})


def test_nixl_agent_gets_the_progress_delay(plugin: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    """A real NIXL agent created the way vLLM's NIXL worker creates it (vllm.distributed.
    nixl_utils' NixlWrapper and nixl_agent_config with num_threads) gets the poll delay, and
    only agents with a progress thread do."""
    import sys

    from vllm.distributed import nixl_utils

    from engine_launcher.vllm_plugin import nixl_progress

    monkeypatch.setenv(nixl_progress.ENV, "10000")
    monkeypatch.setattr(nixl_utils, "_load_nixl_attr", nixl_utils._load_nixl_attr)
    monkeypatch.setattr(nixl_progress, "_applied", False)
    monkeypatch.delitem(nixl_utils.__dict__, "NixlWrapper", raising=False)
    wrapper_cls = nixl_utils._load_nixl_attr("NixlWrapper")
    api = sys.modules[wrapper_cls.__module__]
    monkeypatch.setattr(api, "nixlBind", api.nixlBind)  # undo the patch after the test
    monkeypatch.delitem(nixl_utils.__dict__, "NixlWrapper")
    nixl_progress.apply()

    wrapper_cls = nixl_utils.NixlWrapper  # loaded again, through the plugin's hook
    bindings = api.nixlBind
    assert isinstance(bindings, nixl_progress._BindingsWithDelay)
    seen: list[tuple[Any, Any]] = []
    real = bindings._real

    class Recorder:
        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

        def nixlAgent(self, name: str, config: Any) -> Any:
            seen.append((config.useProgThread, config.pthrDelay))
            return real.nixlAgent(name, config)

    bindings._real = Recorder()
    agent = wrapper_cls("cachehit-test-agent", nixl_utils.nixl_agent_config(num_threads=4, capture_telemetry=True))
    assert agent.name == "cachehit-test-agent"
    no_thread = wrapper_cls("cachehit-test-agent-2", nixl_utils.nixl_agent_config(enable_prog_thread=False))
    assert no_thread.name == "cachehit-test-agent-2"
    # NIXL's own default would be pthrDelay 0 (a poll timeout of 0: the spin).
    assert seen == [(True, 10000), (False, 0)]
