"""The byte paths of the shaper (router/answer/byte_relay.py), the read of a chunked body's
whole plain token chunks at once (`shape_chunked`) in particular: the client receives the
bytes the full path (parse, shape, dump) sends, and the answer kept for a resume is the
same; anything else is left to the usual reading."""

from __future__ import annotations

import orjson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from router.admission.spec import ENDPOINT_CHAT, ENDPOINT_COMPLETIONS, RequestSpec
from router.answer.shaper import ResponseShaper
from router.engine.chunked import ChunkedBody
from router.engine.sse import SSEDecoder, format_event
from support.shaping import PROMPT, Legs, generations, make_spec, same_as_full_path
from support.vllm_serving import Gen, Step, chat_stream, completion_stream


def chunked(payloads: list[bytes]) -> bytes:
    """Events as uvicorn writes them: one SSE event an HTTP chunk."""
    return b"".join(b"%x\r\n%s\r\n" % (len(p) + 8, b"data: " + p + b"\n\n") for p in payloads)


def chunked_path(spec: RequestSpec, legs: Legs, batch: int) -> tuple[ResponseShaper, bytes, int]:
    """As the connection and the pump do it: each read (`batch` chunks) offered whole to
    `shape_chunked` once the answer's first token is out, the rest read into events and
    shaped one by one; (the shaper, the client's bytes, the chunks taken on their bytes)."""
    sh = ResponseShaper(spec)
    out: list[bytes] = []
    taken_chunks = 0
    for is_resume, chunks in legs:
        sh.begin_leg(is_resume=is_resume)
        payloads = [orjson.dumps(c) for c in chunks]
        for at in range(0, len(payloads), batch):
            read = chunked(payloads[at : at + batch])
            shaped = sh.shape_chunked(read) if sh.answer.first_token_seen else None
            if shaped is not None:
                event, taken, n = shaped
                assert taken > 0
                assert n > 0
                out.append(event)
                taken_chunks += n
                read = read[taken:]
            for payload in SSEDecoder().feed(ChunkedBody().feed(read)):
                event_or_none = sh.shape_raw(payload)
                if event_or_none is None:
                    out.extend(map(format_event, sh.shape(orjson.loads(payload))))
                else:
                    out.append(event_or_none)
    out += [format_event(x) for x in sh.final_chunks()]
    return sh, b"".join(out), taken_chunks


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(generations(), st.integers(1, 5))
def test_reads_taken_on_their_bytes_send_what_the_full_path_sends(case: tuple[RequestSpec, Legs], batch: int) -> None:
    spec, legs = case
    fast, got, _ = chunked_path(spec, legs, batch)
    same_as_full_path(spec, legs, fast, got)


def long_answer(endpoint: str, text: str = " w{i}", n: int = 40) -> Legs:
    stream = chat_stream if endpoint == ENDPOINT_CHAT else completion_stream
    steps = [Step(text.format(i=i), [100 + i]) for i in range(n)]
    steps[-1].finish_reason = "length"
    return [(False, stream(Gen(PROMPT, steps, cached_tokens=0)))]


def test_a_long_answer_is_taken_read_by_read_in_every_shape() -> None:
    """Completions and chat, ids hidden or asked for, streamed or whole, escapes orjson
    writes as the engine did, and text beyond ASCII."""
    for endpoint in (ENDPOINT_COMPLETIONS, ENDPOINT_CHAT):
        for want_ids in (False, True):
            for stream in (True, False):
                spec = make_spec(
                    endpoint, stream=stream, include_usage=stream, return_token_ids=want_ids, max_tokens=100
                )
                legs = long_answer(endpoint, ' w{i}\n"\u00e9\\')
                fast, got, taken = chunked_path(spec, legs, 4)
                same_as_full_path(spec, legs, fast, got)
                assert taken >= 30  # all but the first token's read and the finish


def test_chunks_of_another_leg_or_a_wrong_size_are_left_to_the_usual_reading() -> None:
    spec = make_spec(ENDPOINT_COMPLETIONS, include_usage=True, max_tokens=100)
    legs = long_answer(ENDPOINT_COMPLETIONS, n=10)
    sh = ResponseShaper(spec)
    sh.begin_leg(is_resume=False)
    payloads = [orjson.dumps(c) for c in legs[0][1]]
    sh.shape(orjson.loads(payloads[0]))
    plain = payloads[1:4]
    assert sh.shape_chunked(chunked(plain))[1:] == (len(chunked(plain)), 3)  # type: ignore[index]
    other_leg = [p.replace(b'"id":"', b'"id":"x', 1) for p in payloads[4:6]]
    assert sh.shape_chunked(chunked(other_leg)) is None
    wrong_size = chunked(payloads[4:6]).replace(b"\r\n", b"0\r\n", 1)
    assert sh.shape_chunked(wrong_size) is None
    bad_utf8 = [payloads[4].replace(b" w4", b" \xff4")]
    assert sh.shape_chunked(chunked(bad_utf8)) is None
    assert sh.shape_chunked(b"1" + chunked(payloads[4:6])) is None  # not at a chunk's start
    assert sh.answer.token_count == 4  # only the three taken, and the first


def test_a_read_past_the_budget_is_left_to_the_usual_reading() -> None:
    spec = make_spec(ENDPOINT_CHAT, max_tokens=3)
    sh = ResponseShaper(spec)
    sh.begin_leg(is_resume=False)
    payloads = [orjson.dumps(c) for c in long_answer(ENDPOINT_CHAT, n=10)[0][1]]
    for p in payloads[:2]:  # the role chunk, the first token
        sh.shape(orjson.loads(p))
    first = sh.answer.token_count
    assert sh.shape_chunked(chunked(payloads[2 : 2 + 4 - first])) is None
    assert sh.shape_chunked(chunked(payloads[2 : 2 + 3 - first])) is not None
