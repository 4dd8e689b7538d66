"""Parse and validate a client's body into an immutable RequestSpec.

The router validates every field it reads itself or whose value could crash it, with
vLLM's wording where vLLM has one, and answers 400 naming the field (`param`). Every other
field goes to the engine untouched: the engine validates sampling parameters and its
answer is passed through.

Stripped from the body (the router owns them):
- `kv_transfer_params`, `ec_transfer_params`, `cache_hit_threshold`, at the top level and
  inside `vllm_xargs`, as on every route (router/admission/engine_body.py): only a
  producer's answer is ever forwarded, and only to a configured consumer; the router sets
  the threshold of each leg itself. A client's values are dropped silently rather than
  rejected, so clients written for llm-d (which send the threshold) keep working.
- `return_token_ids`, `stream`, `stream_options`: every upstream leg is streamed with token
  ids and usage, whatever the client asked; what the client asked is kept in the spec.
- `request_id`: vLLM names its answer `cmpl-<request_id>` / `chatcmpl-<request_id>`, so
  the router does the same for the client-facing id, but the engines get their own ids
  (one request fans out into several legs, possibly on the same engine).

Answered whole by one engine (`RequestSpec.whole`; router/server/forward.py): features whose
answer only the engine can compose, so the router does not resume them but forwards the
client's body (internal fields stripped) to one engine (`Dispatcher.place_whole`: the
winner of a race of one-token probes where the strategy races) and relays vLLM's own
answer, streamed or not:
- `n` > 1 and `use_beam_search: true`: several choices per request (vLLM does not stream
  beam search; it answers the stream request with its own error);
- batched prompts (a list of several prompts): vLLM's indices and summed usage;
- `echo: true` on completions: with `return_token_ids` vLLM echoes an empty prompt text
  and puts the prompt ids into the generated ids, which would corrupt resumption.
  (Chat `echo` is raced: its echo chunk carries no token ids, and
  `wire.is_rejection_chunk` does not take it for an acceptance.)
- `prompt_logprobs`: vLLM does not send them in streams, and every leg is a stream.

Rejected because the router cannot honour them (400, param named):
- `prompt_embeds`: resuming needs token ids.

Differences from vLLM a client can notice:
- a type error (`max_tokens: "many"`) is a 400 with `type: "BadRequestError"` and
  `param: "max_tokens"`, where vLLM's pydantic layer says `"Bad Request"`/`"body.max_tokens"`;
- JSON with a lone surrogate escape (`"\\ud800"`) is a 400: orjson refuses it, and it could
  not be re-encoded as UTF-8 for the engine anyway (Python's json would accept it);
- integral floats (`max_tokens: 16.0`) are not accepted where an integer is expected;
- a body nested deeper than `MAX_JSON_DEPTH` (128) levels is a 400 (the router could not
  re-serialize it for the engine).

`max_tokens` in the spec (the budget resume legs count against): completions default to
16 when the field is absent (vLLM's CompletionRequest default), an explicit null means up
to the context length (None); chat takes `max_completion_tokens`, else `max_tokens`, else
None (the engine's default).
"""

from __future__ import annotations

import os
import random
import time
from dataclasses import dataclass
from typing import Any, NoReturn, TypeGuard

import orjson

from router.admission.engine_body import ENGINE_OWNED, strip_router_fields
from router.errors import RouterError

ENDPOINT_COMPLETIONS = "completions"
ENDPOINT_CHAT = "chat"

ID_PREFIX = {ENDPOINT_COMPLETIONS: "cmpl-", ENDPOINT_CHAT: "chatcmpl-"}

# Token ids are int32 in vLLM; anything at or past 2**31 cannot be a vocabulary entry.
MAX_TOKEN_ID = 2**31 - 1
# A budget past this is a client bug (and would overflow int32 fields downstream).
MAX_TOKENS_LIMIT = 2**31
# vLLM's CompletionRequest.max_tokens default when the field is absent (an explicit null
# means "up to the context length" instead).
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
MAX_REQUEST_ID_CHARS = 512
# Deepest nesting of arrays and objects a body may have. orjson parses up to 1,024 levels
# but serializes only up to 254, and every leg re-serializes the body: past this bound the
# request is the client's error (400), never a router failure. Real bodies (tool schemas
# included) stay far below it.
MAX_JSON_DEPTH = 128
# Request ids need to be unique, not secret: 128 random bits from a generator seeded once
# from the OS, as uuid4().hex looks, without a getrandom() call per request.
_ID_RANDOM = random.Random(os.urandom(32))

# The router's fields on every route (ENGINE_OWNED), and the id generation legs are named by.
_INTERNAL = (*ENGINE_OWNED, "request_id")
_STRIPPED_TOP_LEVEL = (*_INTERNAL, "return_token_ids", "stream", "stream_options")


@dataclass(frozen=True, slots=True)
class RequestSpec:
    request_id: str  # client-facing id, vLLM style: "cmpl-<hex>" / "chatcmpl-<hex>"
    endpoint: str  # ENDPOINT_COMPLETIONS | ENDPOINT_CHAT
    model: str | None  # as the client asked, else the default model
    body: dict[str, Any]  # sanitized client body; never mutated after admission (legs copy it)
    stream: bool
    include_usage: bool  # stream_options.include_usage (streaming clients only)
    continuous_usage: bool  # stream_options.continuous_usage_stats (streaming clients only)
    return_token_ids: bool
    max_tokens: int | None  # the generation budget; None: the engine's default
    prompt_token_ids: tuple[int, ...] | None  # when the prompt was given as token ids
    routing_text: str  # prompt text, rendered chat, or token ids as "1,2,3," (see _parse_prompt)
    created: int  # unix seconds, stamped on the client-facing chunks
    # Answered whole by one engine without race or resume (n > 1, batches, echo,
    # prompt_logprobs, beam search); `body` then keeps stream, stream_options and
    # return_token_ids as the client sent them.
    whole: bool = False


def _bad(message: str, param: str | None) -> RouterError:
    return RouterError(400, message, param=param)


def _vllm_bad(message: str, param: str, value: object = None) -> RouterError:
    """A check vLLM makes too, worded as vLLM words it (VLLMValidationError.__str__), so a
    client sees the same error with or without the router in front."""
    extras = f"parameter={param}" + (f", value={value}" if value is not None else "")
    return RouterError(400, f"{message} ({extras})", param=param)


def _is_int(v: object) -> TypeGuard[int]:
    # bool is an int subclass in Python but not a JSON number.
    return type(v) is int


def _opt_bool(body: dict[str, Any], key: str, param: str | None = None) -> bool:
    v = body.get(key)
    if v is None:
        return False
    if type(v) is not bool:
        raise _bad(f"`{param or key}` must be a boolean, got {_kind(v)}.", param or key)
    return v


def _kind(v: object) -> str:
    if v is None:
        return "null"
    return {
        bool: "a boolean",
        int: "an integer",
        float: "a number",
        str: "a string",
        list: "an array",
        dict: "an object",
    }.get(type(v), type(v).__name__)


def _budget(body: dict[str, Any], key: str) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if not _is_int(v):
        raise _bad(f"`{key}` must be an integer or null, got {_kind(v)}.", key)
    if v < 1:
        raise _vllm_bad(f"{key} must be at least 1, got {v}.", key, v)
    if v > MAX_TOKENS_LIMIT:
        raise _bad(f"`{key}` must be at most {MAX_TOKENS_LIMIT}, got {v}.", key)
    return v


def _bad_token_id(v: list[Any], param: str) -> NoReturn:
    """The error naming the first id of `v` that is not a token id."""
    for t in v:
        if not _is_int(t) or t < 0 or t > MAX_TOKEN_ID:
            raise _bad(f"`{param}` token ids must be integers in [0, {MAX_TOKEN_ID}], got {t!r:.40}.", param)
    raise AssertionError("unreachable: a list whose text is not digits and commas holds a bad id")


_ID_TEXT = b"0123456789,"


_NO_PROMPT = "Either prompt or prompt_embeds must be provided and non-empty."


def _parse_prompt(body: dict[str, Any]) -> tuple[str, tuple[int, ...] | None]:
    """(routing text, token ids or None) of a completions prompt."""
    if body.get("prompt_embeds") is not None:
        raise _bad("`prompt_embeds` is not supported by the router (resuming needs token ids).", "prompt_embeds")
    p = body.get("prompt")
    if is_batch(p):
        for i, x in enumerate(p[1:], start=1):  # each is checked; the first routes the batch
            _one_prompt(x, f"prompt[{i}]")
        p = p[0]
    return _one_prompt(p, "prompt")


def is_batch(p: object) -> TypeGuard[list[Any]]:
    """A list of prompts (strings or token-id lists), as opposed to one prompt's ids."""
    return isinstance(p, list) and bool(p) and isinstance(p[0], (str, list))


def _one_prompt(p: object, param: str) -> tuple[str, tuple[int, ...] | None]:
    if isinstance(p, str):
        if not p:
            raise _vllm_bad(_NO_PROMPT, param)
        return p, None
    if isinstance(p, list):
        if not p:
            raise _vllm_bad(_NO_PROMPT, param)
        # Token ids as text, each followed by ",": a prompt extends another exactly when its
        # text extends the other's ([7, 80] is not a prefix of [7, 800]), which is what
        # prefix-affinity planners need. Written by orjson ("[7,80]"): a string per id would
        # cost ~50 bytes each (30 MB for a 4 MB prompt) on the way. The same text checks the
        # ids in C: only digits and commas is only non-negative ints (not floats, booleans or
        # nested lists); a Python check per id cost ~75 us for 2,000 ids, this ~20.
        try:
            text = orjson.dumps(p)
        except orjson.JSONEncodeError:  # an int past 64 bits
            _bad_token_id(p, param)
        if text[1:-1].translate(None, _ID_TEXT) or max(p) > MAX_TOKEN_ID:
            _bad_token_id(p, param)
        return str(memoryview(text)[1:-1], "ascii") + ",", tuple(p)
    if p is None:
        raise _vllm_bad(_NO_PROMPT, param)
    raise _bad(f"`{param}` must be a string or a list of token ids, got {_kind(p)}.", param)


def _nesting_exceeds(value: object, limit: int) -> bool:
    """Whether arrays and objects in `value` nest deeper than `limit` (iterative: a deep
    body must not exhaust the Python stack either)."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if depth > limit:
            return True
        children = v.values() if isinstance(v, dict) else v
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return False


def _parse_messages(body: dict[str, Any]) -> str:
    """Validate `messages` as far as the router reads it; render it as `role: content`
    lines for prefix-affinity planners."""
    msgs = body.get("messages")
    if not isinstance(msgs, list):
        raise _bad(f"`messages` must be an array of message objects, got {_kind(msgs)}.", "messages")
    if not msgs:
        raise _bad("`messages` must not be empty.", "messages")
    lines: list[str] = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise _bad(f"`messages[{i}]` must be an object, got {_kind(m)}.", f"messages[{i}]")
        role = m.get("role")
        if not isinstance(role, str):
            raise _bad(f"`messages[{i}].role` must be a string, got {_kind(role)}.", f"messages[{i}].role")
        content = m.get("content")
        if isinstance(content, str):
            text = content
        elif isinstance(content, list):
            # Content parts: the text parts are what a prefix shares; other parts (images,
            # audio) are left to the engine to validate and render.
            text = "".join(
                part["text"] for part in content if isinstance(part, dict) and isinstance(part.get("text"), str)
            )
        else:
            text = ""
        lines.append(f"{role}: {text}")
    return "\n".join(lines)


def parse_request(
    endpoint: str, raw: bytes, *, default_model: str | None = None, header_request_id: str | None = None
) -> RequestSpec:
    """Validate `raw` (the client's body) for `endpoint`; raises RouterError(400).
    `header_request_id` (the client's X-Request-Id, checked) names the answer before the
    body's `request_id`, as in vLLM."""
    if endpoint not in ID_PREFIX:
        raise ValueError(f"unknown endpoint {endpoint!r}")
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        # orjson also rejects invalid UTF-8, lone surrogates, NaN/Infinity and numbers that
        # overflow a double, so every value past this point is representable.
        raise _bad(f"Request body is not valid JSON: {e}", None) from None
    if not isinstance(body, dict):
        raise _bad(f"Request body must be a JSON object, got {_kind(body)}.", None)
    # Counting brackets is cheap and bounds the depth: walk the body only when it could be
    # too deep (brackets inside strings make this conservative, never wrong).
    if raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH and _nesting_exceeds(body, MAX_JSON_DEPTH):
        raise _bad(f"Request body is nested deeper than {MAX_JSON_DEPTH} levels of arrays and objects.", None)

    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _bad(f"`model` must be a string, got {_kind(model)}.", "model")
    if not model:
        if default_model is None:
            raise _bad("`model` is required.", "model")
        model = default_model

    stream = _opt_bool(body, "stream")
    so = body.get("stream_options")
    include_usage = continuous_usage = False
    if so is not None:
        if not isinstance(so, dict):
            raise _bad(f"`stream_options` must be an object or null, got {_kind(so)}.", "stream_options")
        if so and not stream:
            raise _vllm_bad("Stream options can only be defined when `stream=True`.", "stream_options")
        include_usage = _opt_bool(so, "include_usage", "stream_options.include_usage")
        continuous_usage = _opt_bool(so, "continuous_usage_stats", "stream_options.continuous_usage_stats")
    return_token_ids = _opt_bool(body, "return_token_ids")

    n = body.get("n")
    if n is not None and not (_is_int(n) and 1 <= n <= MAX_TOKENS_LIMIT):
        raise _bad(f"`n` must be a positive integer, got {n!r:.40}.", "n")
    prompt_logprobs = body.get("prompt_logprobs")
    if stream and _is_int(prompt_logprobs) and (prompt_logprobs > 0 or prompt_logprobs == -1):
        # vLLM's check, before any engine is asked (a request answered whole races first).
        raise _vllm_bad("`prompt_logprobs` are not available when `stream=True`.", "prompt_logprobs")
    whole = (n is not None and n > 1) or _opt_bool(body, "use_beam_search") or prompt_logprobs is not None

    xargs = body.get("vllm_xargs")
    if xargs is not None and not isinstance(xargs, dict):
        raise _bad(f"`vllm_xargs` must be an object or null, got {_kind(xargs)}.", "vllm_xargs")

    if endpoint == ENDPOINT_COMPLETIONS:
        whole = whole or _opt_bool(body, "echo") or (is_batch(body.get("prompt")) and len(body["prompt"]) > 1)
        routing_text, prompt_token_ids = _parse_prompt(body)
        max_tokens = _budget(body, "max_tokens")
        if "max_tokens" not in body:
            max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS
    else:
        routing_text = _parse_messages(body)
        prompt_token_ids = None
        mct = _budget(body, "max_completion_tokens")
        mt = _budget(body, "max_tokens")
        max_tokens = mct if mct is not None else mt

    client_id = body.get("request_id")
    if header_request_id is not None:
        request_id = ID_PREFIX[endpoint] + header_request_id
    elif client_id is not None:
        if not isinstance(client_id, str) or not client_id or len(client_id) > MAX_REQUEST_ID_CHARS:
            raise _bad(
                f"`request_id` must be a non-empty string of at most {MAX_REQUEST_ID_CHARS} characters.", "request_id"
            )
        request_id = ID_PREFIX[endpoint] + client_id
    else:
        request_id = f"{ID_PREFIX[endpoint]}{_ID_RANDOM.getrandbits(128):032x}"

    strip_router_fields(body)  # top level and inside vllm_xargs (router/admission/engine_body.py)
    for key in _INTERNAL if whole else _STRIPPED_TOP_LEVEL:
        body.pop(key, None)

    return RequestSpec(
        request_id=request_id,
        endpoint=endpoint,
        model=model,
        body=body,
        stream=stream,
        include_usage=include_usage and stream,
        # vLLM honours continuous_usage_stats only together with include_usage
        # (should_include_usage in serve/utils/api_utils.py).
        continuous_usage=continuous_usage and include_usage and stream,
        return_token_ids=return_token_ids,
        max_tokens=max_tokens,
        prompt_token_ids=prompt_token_ids,
        routing_text=routing_text,
        created=int(time.time()),
        whole=whole,
    )
