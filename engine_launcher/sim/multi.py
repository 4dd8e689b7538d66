"""Requests vLLM answers with several choices or with the prompt: batched completion
prompts, `n` > 1, `echo`, `prompt_logprobs`.

vLLM runs each prompt of a batch, and each of the `n` samples of a prompt, as a request of
its own in the engine (parallel sampling: sample j's seed is the request's seed + j) and
numbers the choices `prompt_index * n + j`. The simulator does the same with one
`SimRequest` per choice. Usage counts each prompt once and every choice's tokens;
`cached_tokens` is the last prompt's (non-streaming) or the first answer's (streaming).
Echo puts the prompt's text before the choice's text (an empty text with
`return_token_ids`, as vLLM does) and, in a stream, the prompt ids on the first chunk.
`prompt_logprobs` are made up but shaped as vLLM's: None for the first prompt token, then
{token id: {logprob, rank, decoded_token}} with the prompt token at rank 1.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

import orjson
from aiohttp import web

from . import responses as R
from . import tokenizer as tok
from .protocol import ParsedRequest
from .request import SimRequest

UNSEEDED = 1 << 40
# prompt_logprobs = -1 asks for the whole vocabulary; the simulator gives this many.
ALL_VOCAB_LOGPROBS = 20


def choice_requests(parsed: ParsedRequest, request_id: str) -> list[tuple[int, SimRequest]]:
    """(prompt index, engine request) per choice, in choice order."""
    out = []
    seed = parsed.sampling.seed
    for i, ids in enumerate(parsed.prompts or (parsed.prompt_ids,)):
        for j in range(parsed.n):
            # Distinct samples: seed + j as vLLM's parallel sampling; unseeded ones apart too
            # (past any 32-bit seed a client sends).
            child = seed + j if seed is not None else (None if j == 0 else UNSEEDED + j)
            out.append(
                (
                    i,
                    SimRequest(
                        f"{request_id}-{i}-{j}", ids, replace(parsed.sampling, seed=child), parsed.threshold, None
                    ),
                )
            )
    return out


def prompt_logprobs(ids: list[int], k: int) -> list[dict[str, dict[str, Any]] | None]:
    k = ALL_VOCAB_LOGPROBS if k == -1 else k
    out: list[dict[str, dict[str, Any]] | None] = [None]
    words = tok._GEN_IDS
    for pos, t in enumerate(ids[1:], start=1):
        lp = -((t * 31 + pos) % 97) / 10.0 - 0.01
        entry = {str(t): {"logprob": lp, "rank": 1, "decoded_token": tok.token_text(t)}}
        r = 0
        while len(entry) < k + 1:
            alt = words[(t + pos + r) % len(words)]
            r += 1
            if str(alt) not in entry:
                entry[str(alt)] = {
                    "logprob": lp - 0.5 * len(entry),
                    "rank": len(entry) + 1,
                    "decoded_token": tok.token_text(alt),
                }
        out.append(entry)
    return out


def _usage(
    parsed: ParsedRequest, reqs: list[tuple[int, SimRequest]], cached_from: SimRequest, details: bool, full: bool
) -> dict[str, Any]:
    u = R.usage(cached_from, details, full, parsed.chat)
    prompt = sum(len(ids) for ids in (parsed.prompts or (parsed.prompt_ids,)))
    completion = sum(len(r.output_ids) for _, r in reqs)
    u.update(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)
    return u


def _echo(parsed: ParsedRequest, i: int) -> str | None:
    if not parsed.echo:
        return None
    return "" if parsed.return_token_ids else parsed.prompt_texts[i]


def full_answer(ctx: R.ResponseContext, reqs: list[tuple[int, SimRequest]], details: bool) -> bytes:
    p = ctx.parsed
    pls = (
        [prompt_logprobs(ids, p.prompt_logprobs) for ids in (p.prompts or (p.prompt_ids,))]
        if p.prompt_logprobs is not None
        else None
    )
    choices = []
    for index, (i, req) in enumerate(reqs):
        choice = R.full_body(ctx, req, (_echo(p, i) or "") + req.output_text, details)["choices"][0]
        choice["index"] = index
        if not p.chat:
            choice["prompt_logprobs"] = pls[i] if pls else None
        choices.append(choice)
    body = R.full_body(ctx, reqs[0][1], "", details)
    body["choices"] = choices
    if p.chat:
        body["prompt_logprobs"] = pls[0] if pls else None
    last_prompt = max(i for i, _ in reqs)
    cached_from = next(r for i, r in reqs if i == last_prompt)
    body["usage"] = _usage(p, reqs, cached_from, details, True)
    return orjson.dumps(body)


async def write_stream(
    request: web.Request,
    resp: web.StreamResponse,
    ctx: R.ResponseContext,
    reqs: list[tuple[int, SimRequest]],
    details: bool,
    error_event: bytes,
) -> None:
    """The choices' chunks as their tokens come, interleaved as vLLM's stream is."""
    p = ctx.parsed
    await resp.prepare(request)
    if p.chat:
        for index, (_, req) in enumerate(reqs):
            await resp.write(R.chat_role_chunk(ctx, req, index))
    queue: asyncio.Queue[bytes | None] = asyncio.Queue()

    async def pump(index: int, i: int, req: SimRequest) -> None:
        state = R.CompletionStreamState()
        while True:
            await req.event.wait()
            req.event.clear()
            ids, text, lps = req.drain()
            finished = req.finished
            if finished and req.finish_reason == "error":
                await queue.put(error_event)
                return
            if ids or text or finished:
                await queue.put(
                    R.stream_chunk(
                        ctx,
                        req,
                        state,
                        ids,
                        text,
                        lps,
                        req.finish_reason if finished else None,
                        req.stop_reason if finished else None,
                        index=index,
                        echo=_echo(p, i),
                    )
                )
            if finished:
                await queue.put(None)
                return

    tasks = [asyncio.create_task(pump(index, i, req)) for index, (i, req) in enumerate(reqs)]
    try:
        done = 0
        while done < len(tasks):
            chunk = await queue.get()
            if chunk is None:
                done += 1
                continue
            await resp.write(chunk)
            if chunk is error_event:
                await resp.write(R.SSE_DONE)
                await resp.write_eof()
                return
        if p.include_usage:
            await resp.write(
                R.sse(
                    {
                        "id": ctx.request_id,
                        "object": "chat.completion.chunk" if p.chat else "text_completion",
                        "created": ctx.created,
                        "model": ctx.model,
                        "choices": [],
                        "usage": _usage(p, reqs, reqs[0][1], details, False),
                        "system_fingerprint": ctx.fingerprint,
                    }
                )
            )
        await resp.write(R.SSE_DONE)
        await resp.write_eof()
    finally:
        for t in tasks:
            t.cancel()
