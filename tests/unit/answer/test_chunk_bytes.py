"""Token chunks relayed on their bytes (router/answer/chunk_bytes.py, `ResponseShaper.shape_raw`):
the client receives exactly the bytes the full path (parse, shape, dump) sends, and the
answer the router keeps for a resume is the same; the chunks where something is decided
are left to the full path."""

from __future__ import annotations

from typing import Any

import orjson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from router.admission.spec import ENDPOINT_CHAT, ENDPOINT_COMPLETIONS, RequestSpec
from router.answer.chunk_bytes import (
    PlainChunks,
    header,
    looks_plain,
    plain_chunks,
    read_compact,
    unary_answer_problem,
)
from router.answer.shaper import ResponseShaper
from router.engine.sse import format_event
from support.shaping import (
    PROMPT,
    Legs,
    full_path,
    generations,
    make_spec,
    same_answer,
    same_as_full_path,
    split_legs,
)
from support.vllm_serving import Gen, Step, chat_stream, completion_stream


def byte_path(spec: RequestSpec, legs: Legs, encode: Any = orjson.dumps) -> tuple[ResponseShaper, bytes, int]:
    """As the pump does it: shape_raw first, the full path for what it leaves."""
    sh = ResponseShaper(spec)
    out = []
    relayed = 0
    for is_resume, chunks in legs:
        sh.begin_leg(is_resume=is_resume)
        for c in chunks:
            payload = encode(c)
            event = sh.shape_raw(payload)
            if event is None:
                out += [format_event(x) for x in sh.shape(orjson.loads(payload))]
            else:
                relayed += 1
                out.append(event)
    out += [format_event(x) for x in sh.final_chunks()]
    return sh, b"".join(out), relayed


def run_path(spec: RequestSpec, legs: Legs, batch: int) -> tuple[ResponseShaper, bytes, int]:
    """As `pump_raw` does it: the chunks in batches of `batch`, the plain ones between the
    others of a batch relayed as one run (`shape_run`), the rest one by one."""
    sh = ResponseShaper(spec)
    out: list[bytes] = []
    runs = 0

    def one_by_one(payloads: list[bytes]) -> None:
        for payload in payloads:
            event = sh.shape_raw(payload)
            out.extend([event] if event is not None else map(format_event, sh.shape(orjson.loads(payload))))

    for is_resume, chunks in legs:
        sh.begin_leg(is_resume=is_resume)
        payloads = [orjson.dumps(c) for c in chunks]
        for at in range(0, len(payloads), batch):
            part = payloads[at : at + batch]
            head, tail = 0, len(part)
            while head < tail and not looks_plain(part[head]):
                head += 1
            while tail > head and not looks_plain(part[tail - 1]):
                tail -= 1
            one_by_one(part[:head])
            if head < tail:
                event = sh.shape_run(part[head:tail])
                if event is None:
                    one_by_one(part[head:tail])
                else:
                    out.append(event)
                    runs += 1
            one_by_one(part[tail:])
    out += [format_event(x) for x in sh.final_chunks()]
    return sh, b"".join(out), runs


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(generations())
def test_bytes_path_sends_what_the_full_path_sends(case: tuple[RequestSpec, Legs]) -> None:
    spec, legs = case
    fast, got, _ = byte_path(spec, legs)
    same_as_full_path(spec, legs, fast, got)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(generations(), st.integers(1, 5))
def test_runs_send_what_the_full_path_sends(case: tuple[RequestSpec, Legs], batch: int) -> None:
    spec, legs = case
    fast, got, _ = run_path(spec, legs, batch)
    same_as_full_path(spec, legs, fast, got)


def test_plain_token_chunks_go_as_one_run() -> None:
    """A leg's chunks received at once: the first (which teaches the leg's header) and the
    finish one by one, everything between in one run; read again only when asked for. A
    whole (non-streamed) answer accumulates the run's text at once."""
    apis = ((ENDPOINT_COMPLETIONS, completion_stream), (ENDPOINT_CHAT, chat_stream))
    for endpoint, stream, want_ids, whole in ((*a, w, h) for a in apis for w in (False, True) for h in (False, True)):
        spec = make_spec(endpoint, stream=not whole, include_usage=not whole, return_token_ids=want_ids)
        steps = [Step(f' w{i}\n"\u00e9', [100 + i]) for i in range(10)]
        steps[-1].finish_reason = "length"
        legs = [(False, stream(Gen(PROMPT, steps, cached_tokens=0)))]
        full, want = full_path(spec, legs)
        fast, got, runs = run_path(spec, legs, 100)
        assert got == want
        assert runs == 1
        assert fast.answer.token_count == 10
        same_answer(full, fast)
        if whole:
            assert fast.accumulate_response() == full.accumulate_response()


def test_a_run_is_relayed_whole_or_not_at_all() -> None:
    r = relay_for()
    token = TOKEN % (b'"x"', b"null", b"1")
    event, block = r.relay_run([token, token]) or (b"", b"")
    assert event == (r.relay(token) or (b"",))[0] * 2
    assert read_compact(block) == ("xx", [1, 1])
    assert r.relay_run([token, TOKEN % (b'"x"', b"null", b"1,2")]) is None  # two ids: one by one
    assert r.relay_run([token, TOKEN % (b'"\\u0001"', b"null", b"1")]) is None  # written again by orjson
    assert r.relay_run([token, TOKEN % (b'"x"', b'"stop"', b"1")]) is None
    assert r.relay_run([token, TOKEN % (b'"\xff"', b"null", b"1")]) is None  # not UTF-8
    assert r.relay_run([token + b"\n" + token]) is None  # one payload, two lines
    assert r.relay_run([token, b""]) is None
    # Another leg's header (another answer's id), no header, a header alone, a chunk cut short.
    assert r.relay_run([token, token.replace(b"cmpl-1", b"cmpl-2")]) is None
    up, _, body = token.partition(b'"choices":[{"index":0,')
    assert r.relay_run([token, b"\x00" + body]) is None
    assert r.relay_run([token, body]) is None
    assert r.relay_run([token, up + b'"choices":[{"index":0,']) is None
    assert r.relay_run([token, token[:40]]) is None
    assert r.relay_run([token[:40]]) is None
    # A second line in a chunk, whether the run's other chunk is plain or a header alone.
    assert r.relay_run([token + b"\n" + token, token]) is None
    assert r.relay_run([token + b"\n" + body, token]) is None
    assert looks_plain(token)
    assert not looks_plain(TOKEN % (b'"x"', b'"stop"', b"1"))


def test_plain_token_chunks_do_go_on_their_bytes() -> None:
    """The relay is used (not just correct when unused): every token chunk but the first of a
    leg (which teaches the leg's header) and the finish."""
    for endpoint, stream in ((ENDPOINT_COMPLETIONS, completion_stream), (ENDPOINT_CHAT, chat_stream)):
        spec = make_spec(endpoint, include_usage=True)
        steps = [Step(f" w{i}", [100 + i]) for i in range(10)]
        steps[-1].finish_reason = "length"
        legs = [(False, stream(Gen(PROMPT, steps, cached_tokens=0)))]
        full, want = full_path(spec, legs)
        fast, got, relayed = byte_path(spec, legs)
        assert got == want
        same_answer(full, fast)
        assert relayed == (8 if endpoint == ENDPOINT_COMPLETIONS else 9)  # chat: the role chunk came first


def test_a_non_streaming_answer_is_accumulated_from_the_bytes_too() -> None:
    spec = make_spec(ENDPOINT_CHAT, stream=False, return_token_ids=True)
    steps = [Step(f" w{i}", [100 + i]) for i in range(6)]
    steps[-1].finish_reason = "stop"
    legs = split_legs(ENDPOINT_CHAT, Gen(PROMPT, steps, cached_tokens=0), [3], [False, False], [0, 0])
    full, want = full_path(spec, legs)
    fast, got, relayed = byte_path(spec, legs)
    assert (got, want) == (b"", b"")
    assert fast.accumulate_response() == full.accumulate_response()
    assert not fast.emitted
    assert relayed == 4  # chat leg: 2 of 3 after the role chunk; resume leg: 2 of 3 after its first


def test_other_spacing_takes_the_full_path_and_reads_the_same() -> None:
    spec = make_spec(ENDPOINT_COMPLETIONS, return_token_ids=True)
    steps = [Step(" a", [1]), Step(" b", [2]), Step(" c", [3], "stop")]
    legs = [(False, completion_stream(Gen(PROMPT, steps)))]
    full, want = full_path(spec, legs)
    fast, got, relayed = byte_path(spec, legs, encode=lambda c: orjson.dumps(c, option=orjson.OPT_INDENT_2))
    assert (got, relayed) == (want, 0)
    same_answer(full, fast)


def relay_for(chat: bool = False, hide_ids: bool = True) -> PlainChunks:
    up = header("cmpl-1", "text_completion", 5, "m")
    client = header("cmpl-client", "text_completion", 7, "client-model")
    assert up is not None
    assert client is not None
    return PlainChunks(up, client, chat=chat, hide_ids=hide_ids)


TOKEN = (
    b'{"id":"cmpl-1","object":"text_completion","created":5,"model":"m","choices":[{"index":0,"text":%s,'
    b'"logprobs":null,"finish_reason":%s,"stop_reason":null,"prompt_token_ids":null,"token_ids":[%s]}]}'
)


def test_relay_reads_text_and_ids_and_rewrites_the_header() -> None:
    event, text, ids = relay_for().relay(TOKEN % (b'" a\\"b\\u00e9"', b"null", b"12,0")) or (b"", "", [])
    assert (text, ids) == (' a"b\u00e9', [12, 0])
    assert event == (
        b'data: {"id":"cmpl-client","object":"text_completion","created":7,"model":"client-model","choices":'
        b'[{"index":0,"text":" a\\"b\xc3\xa9","logprobs":null,"finish_reason":null,"stop_reason":null,'
        b'"prompt_token_ids":null,"token_ids":null}]}\n\n'
    )


def test_relay_leaves_what_must_be_decided() -> None:
    r = relay_for()
    assert r.relay(TOKEN % (b'"x"', b'"stop"', b"1")) is None  # a finish
    assert r.relay(TOKEN % (b'"x"', b"null", b"")) is None  # no token
    assert r.relay(TOKEN % (b'"x"', b"null", b"01")) is None  # not JSON
    assert r.relay(TOKEN % (b'"x"', b"null", b"99999999999999999999")) is None  # past 64 bits
    assert r.relay(TOKEN.replace(b"m", b"n", 1) % (b'"x"', b"null", b"1")) is None  # another leg's header
    assert r.relay((TOKEN % (b'"x"', b"null", b"1"))[:-1] + b',"usage":null}') is None  # more fields
    assert r.relay(TOKEN % (b'"\xff"', b"null", b"1")) is None  # not UTF-8
    assert r.relay(TOKEN % (b'"x\\', b"null", b"1")) is None  # the text never ends


def test_a_header_of_other_types_is_not_relayed() -> None:
    client = ("cmpl-client", "text_completion", 7, "client-model")
    assert (
        plain_chunks({"id": 1, "object": "text_completion", "created": 5, "model": "m"}, client, False, False) is None
    )
    assert plain_chunks({"id": "a", "object": "text_completion", "created": 5, "model": "m"}, client, False, False)
    assert (
        plain_chunks({"id": "a", "object": "x", "created": 5, "model": "m"}, (*client[:3], None), False, False) is None
    )


def test_a_forwarded_answer_without_a_finish_or_past_its_budget_is_a_problem() -> None:
    ok = b'{"choices":[{"index":0,"text":" a","finish_reason":"length"}],"usage":{"completion_tokens":16}}'
    assert unary_answer_problem(ok, 16) is None
    assert unary_answer_problem(ok, None) is None
    assert unary_answer_problem(b"data: [DONE]\n\n", 16) == "the answer has no finish_reason"
    assert unary_answer_problem(ok.replace(b'"length"', b"null"), 16) == "the answer has no finish_reason"
    assert "max_tokens (8)" in (unary_answer_problem(ok, 8) or "")
    text_says_it = b'{"choices":[{"text":"\\"finish_reason\\":\\"stop\\"","finish_reason":null}]}'
    assert unary_answer_problem(text_says_it, 16) == "the answer has no finish_reason"
