"""Upstream chunks in, client chunks out: one unbroken answer from several upstream legs.

Every leg streams with usage and token ids (router/engine/wire.py). A client's answer is the chosen
leg, then zero or more resume legs (`/v1/completions` streams even for a chat request), turned
by `ResponseShaper` into what one vLLM engine would have sent for the client's own request:

streaming (`shape`, `release_held`, `final_chunks`; the byte paths `shape_raw`, `shape_run`,
`shape_chunked`: router/answer/byte_relay.py)
- one id (`spec.request_id`), one `created` (`spec.created`), one `model` (the name the
  client asked for, else the first leg's), the client endpoint's `object`;
- chat: the role chunk goes out once per answer (a retry leg's is dropped); resume-leg completion
  chunks become chat deltas with chat-shaped logprobs (router/answer/logprobs.py);
- `token_ids` / `prompt_token_ids`: kept when the client asked for them (prompt ids once,
  from the first leg); otherwise null, exactly what vLLM sends when they were not asked for;
- completion logprobs' `text_offset` continues across legs (each leg counts from 0);
- per-leg usage chunks are swallowed; `final_chunks` sends one usage chunk with totals over legs
  (router/answer/usage.py); with `continuous_usage_stats` every chunk carries running totals;
- HELD BACK: every finish chunk, until the lead knows it ends the answer: `release_held()`
  (or `final_chunks()`) returns it, `begin_leg()` drops it (router/answer/finish_chunks.py).

non-streaming (`accumulate_response`): `shape` returns [] and router/answer/assembly.py builds the
body from every chunk seen across legs. For the lead: `answer` (router/answer/progress.py), `emitted`
(a chunk went to the client: errors must now travel as SSE events). Ownership: `shape` rewrites
the chunk it is given in place and may return it; the caller must not use the chunk afterwards.
The byte paths relay plain token chunks on their bytes (router/answer/chunk_bytes.py): the
same answer, no parse."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from router.admission.spec import ENDPOINT_CHAT, RequestSpec
from router.answer.assembly import ResponseAssembler
from router.answer.byte_relay import ByteRelay
from router.answer.chunk_bytes import PlainChunks, plain_chunks
from router.answer.finish_chunks import content_free_finish, without_finish
from router.answer.logprobs import TextOffsets, chat_logprobs_from_completion, has_logprob_entries
from router.answer.progress import Answer
from router.answer.usage import UsageTotals
from router.engine.wire import CACHE_THRESHOLD, MalformedChunk, check_choice, check_ids, message_usage

_CHAT_CHUNK = "chat.completion.chunk"
_TEXT_COMPLETION = "text_completion"


class ResponseShaper(ByteRelay):
    """See the module docstring. One instance per client answer."""

    def __init__(self, spec: RequestSpec):
        self.spec = spec
        self._chat = spec.endpoint == ENDPOINT_CHAT
        self._object = _CHAT_CHUNK if self._chat else _TEXT_COMPLETION
        self._model = spec.model
        self._rid = spec.request_id
        self._created = spec.created
        self._want_ids = spec.return_token_ids
        body = spec.body
        # Chat logprobs asked for: how many alternatives (resume legs' logprobs are converted).
        # Admission does not validate top_logprobs (the engine does), so read it defensively.
        top = body.get("top_logprobs")
        self._chat_top_logprobs = (top if type(top) is int else 0) if self._chat and body.get("logprobs") else None

        self.answer = Answer(None if spec.prompt_token_ids is None else list(spec.prompt_token_ids), spec.max_tokens)
        self.emitted = False  # anything returned for the client yet
        self._usage = UsageTotals(self.answer, chat=self._chat)
        self._offsets = TextOffsets()
        self._accumulate = not spec.stream  # only a non-streaming client's answer is accumulated
        top_lp = self._chat_top_logprobs
        self._assembler = ResponseAssembler(spec, self.answer, chat=self._chat, chat_top_logprobs=top_lp)
        self._is_resume = False  # the current leg is a resume leg
        self._held: dict[str, Any] | None = None
        self._held_has_content = False
        self._pending: list[dict[str, Any]] = []  # content of a discarded held chunk, sent next
        self._role_sent = False
        self._prompt_ids_sent = not spec.stream  # a whole answer has them in its body
        self._fingerprint: str | None = None
        self._plain: PlainChunks | None = None  # this leg's chunks relayed on their bytes
        self._plain_tried = False

    def begin_leg(self, *, is_resume: bool) -> None:
        """A new upstream leg starts; `is_resume` legs are /v1/completions streams."""
        self._usage.begin_leg()
        self.answer.begin_leg()
        self._is_resume = is_resume
        self._plain, self._plain_tried = None, False
        held = self._held
        if held is not None:
            self._held = None
            if self._held_has_content:
                # The leg's last content must still reach the client, without the finish.
                self._pending.append(without_finish(held, chat=self._chat))
        self._offsets.begin_leg()

    def shape(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        """One parsed upstream chunk -> the chunks for a streaming client (maybe none). Raises
        MalformedChunk (a ValueError) for a chunk it cannot read; the types of the fields the
        answer is built from are checked before any state changes (no half-updated answer)."""
        try:
            return self._shape(chunk)
        except MalformedChunk:
            raise
        except (TypeError, AttributeError, KeyError, IndexError, ValueError) as e:
            # Something deeper in an odd chunk (e.g. logprob entries of the wrong type).
            raise MalformedChunk(f"unreadable upstream chunk ({type(e).__name__}: {e})") from e

    def _shape(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        if type(chunk) is not dict:
            raise MalformedChunk("upstream chunk is not a JSON object")
        if self._model is None and isinstance(chunk.get("model"), str):
            self._model = chunk["model"]
        fp = chunk.get("system_fingerprint")
        if fp is not None:
            self._fingerprint = fp
        if not self._plain_tried:  # the leg's first chunk: can its token chunks go on their bytes?
            self._plain_tried = True
            if not self.spec.continuous_usage and (self._accumulate or not (self._chat and self._is_resume)):
                client = (self._rid, self._object, self._created, self._model)
                self._plain = plain_chunks(chunk, client, self._chat and not self._is_resume, self._want_ids)
        choices = chunk.get("choices")
        if not choices:
            usage = chunk.get("usage")
            if isinstance(usage, dict):
                self._note_usage(chunk)
            return []
        if type(choices) is not list:
            raise MalformedChunk("upstream chunk: `choices` is not a list")
        c = choices[0]
        check_choice(c, chat=self._chat and not self._is_resume)
        if self.answer.prompt_token_ids is None and not self._is_resume:
            pti = chunk.get("prompt_token_ids") if "delta" in c else c.get("prompt_token_ids")
            if pti is not None:
                check_ids(pti, "prompt_token_ids")
        out = self._flush_pending() if self._pending else []
        out += self._shape_completion(chunk, c) if self._is_resume or not self._chat else self._shape_chat(chunk, c)
        return out

    def _note_ids(self, c: dict[str, Any], top_prompt_ids: Any) -> Sequence[int]:
        """Record prompt ids (first non-resume leg) and this chunk's generated ids."""
        answer = self.answer
        if answer.prompt_token_ids is None and not self._is_resume and top_prompt_ids is not None:
            answer.prompt_token_ids = top_prompt_ids
        ids: list[int] = c.get("token_ids") or []  # checked by the wire schema
        if ids:
            answer.add_token_ids(ids)
        return ids

    def _note_finish(self, c: dict[str, Any]) -> str | None:
        fr = c.get("finish_reason")
        if fr is not None:
            self.answer.note_finish(fr, c.get("stop_reason"))
        return fr

    def _note_usage(self, chunk: dict[str, Any]) -> None:
        usage = message_usage(chunk)
        self.answer.note_engine_count(usage.completion_tokens)
        self._usage.note(usage, is_resume=self._is_resume)

    def _stamp(self, chunk: dict[str, Any]) -> None:
        chunk["id"] = self._rid
        chunk["object"] = self._object
        chunk["created"] = self._created
        chunk["model"] = self._model
        if self.spec.continuous_usage:
            chunk["usage"] = self._usage.running()
        elif "usage" in chunk:
            del chunk["usage"]

    def _shape_completion(self, chunk: dict[str, Any], c: dict[str, Any]) -> list[dict[str, Any]]:
        """A chunk of a completion stream: a completions client's, or a resume leg's."""
        prompt_ids = c.get("prompt_token_ids")
        ids = self._note_ids(c, prompt_ids)
        text = c.get("text") or ""
        if text:
            self.answer.add_text(text)
        fr = self._note_finish(c)
        lp = c.get("logprobs")
        if isinstance(lp, dict):
            lp = self._offsets.rebase(lp)
        if self._accumulate:
            self._assembler.add_completion(text, lp)
            return []

        if self._chat:
            # A resume leg of a chat answer: rebuild the chunk as a chat delta.
            pre = [self._role_chunk()] if not self._role_sent else []
            choice = {
                "index": 0,
                "delta": {"content": text},
                "logprobs": (
                    {"content": chat_logprobs_from_completion(lp, self._chat_top_logprobs)}
                    if lp is not None and self._chat_top_logprobs is not None
                    else None
                ),
                "finish_reason": fr,
            }
            if fr is not None:
                choice["stop_reason"] = c.get("stop_reason")
            choice["token_ids"] = list(ids) if self._want_ids else None
            out = self._stamped(_CHAT_CHUNK, [choice])
            if self.spec.continuous_usage:
                out["usage"] = self._usage.running()
            if fr is not None:
                res = self._hold(out, choice, bool(text or ids or has_logprob_entries(lp)))
            else:
                res = self._out(out, choice)
            if pre:
                self.emitted = True
                return pre + res
            return res

        # Completions client: rewrite in place.
        if lp is not None:
            c["logprobs"] = lp
        # Completion chunks carry the prompt's ids inside the choice.
        self._normalize(chunk, c, prompt_ids_in=c)
        if fr is not None:
            return self._hold(chunk, c, bool(text or ids or has_logprob_entries(lp)))
        return self._out(chunk, c)

    def _normalize(self, chunk: dict[str, Any], c: dict[str, Any], prompt_ids_in: dict[str, Any]) -> None:
        """The rewrite every client chunk gets: one choice at index 0, token ids hidden
        unless asked (null, as vLLM sends them), the answer's stable id and stamps."""
        if c.get("index"):
            c["index"] = 0
        if not self._want_ids:
            if "prompt_token_ids" in prompt_ids_in:
                prompt_ids_in["prompt_token_ids"] = None
            if "token_ids" in c:
                c["token_ids"] = None
        if len(choices := chunk["choices"]) > 1:
            del choices[1:]
        self._stamp(chunk)

    def _shape_chat(self, chunk: dict[str, Any], c: dict[str, Any]) -> list[dict[str, Any]]:
        """A chunk of a chat stream (the client's own endpoint)."""
        ids = self._note_ids(c, chunk.get("prompt_token_ids"))
        delta = c.get("delta")
        if not isinstance(delta, dict):
            delta = c["delta"] = {}
        fr = self._note_finish(c)
        role = delta.get("role")
        content = delta.get("content")
        reasoning = delta.get("reasoning")
        if reasoning is None:
            reasoning = delta.get("reasoning_content")
        tool_calls = delta.get("tool_calls")
        if content:
            self.answer.add_text(content)
        elif reasoning or tool_calls:
            self.answer.first_token_seen = True
        if (content or reasoning or tool_calls) and "token_ids" in c and c["token_ids"] is None:
            self.answer.token_ids_complete = False
        lp = c.get("logprobs")
        if self._accumulate:
            self._assembler.add_chat(role, content, reasoning, tool_calls, lp)
            return []

        new_role = False
        if role is not None:
            if self._role_sent:
                # A retry leg's role chunk: the client already has one.
                del delta["role"]
                if not (content or reasoning or tool_calls or ids or fr or has_logprob_entries(lp)):
                    return []
            else:
                self._role_sent = new_role = True
        # Chat chunks carry the prompt's ids at the top level.
        self._normalize(chunk, c, prompt_ids_in=chunk)
        if fr is not None:
            has_content = bool(content or reasoning or tool_calls or ids or has_logprob_entries(lp))
            if new_role and not has_content:
                # The role rides on the held chunk; if that is discarded, the next leg's
                # first chunk must carry the role.
                self._role_sent = False
            return self._hold(chunk, c, has_content)
        return self._out(chunk, c)

    def _out(self, chunk: dict[str, Any], c: dict[str, Any]) -> list[dict[str, Any]]:
        """`chunk` goes to the client now. The client's prompt ids (when asked for) ride on the
        first chunk that goes out, where vLLM puts them: a chat answer's role chunk (top level),
        a completion's first chunk (in the choice); decided here, not on arrival (a held chunk
        may be discarded)."""
        if self._want_ids:
            if self._chat:
                if "prompt_token_ids" in chunk:
                    chunk["prompt_token_ids"] = self._take_prompt_ids()
            else:
                c["prompt_token_ids"] = self._take_prompt_ids()
        self.emitted = True
        return [chunk]

    def _take_prompt_ids(self) -> list[int] | None:
        prompt_ids = self.answer.prompt_token_ids
        if self._prompt_ids_sent or prompt_ids is None:
            return None
        self._prompt_ids_sent = True
        return prompt_ids

    def _stamped(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self._rid, "object": obj, "created": self._created, "model": self._model, "choices": choices}

    def _role_chunk(self) -> dict[str, Any]:
        """The role chunk vLLM sends first, for a chat answer whose first leg sent none."""
        self._role_sent = True
        role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        out = self._stamped(_CHAT_CHUNK, [role])
        out["prompt_token_ids"] = self._take_prompt_ids() if self._want_ids else None
        out["prompt_text"] = None
        if self.spec.continuous_usage:
            out["usage"] = self._usage.running()
        return out

    def _flush_pending(self) -> list[dict[str, Any]]:
        pending = self._pending
        self._pending = []
        out: list[dict[str, Any]] = []
        for chunk in pending:
            out.extend(self._out(chunk, chunk["choices"][0]))
        return out

    def _hold(self, chunk: dict[str, Any], c: dict[str, Any], has_content: bool) -> list[dict[str, Any]]:
        """Keep a finish chunk back until the lead knows whether the answer ends with it:
        whole, or split when it is a cache_threshold finish with content (module docstring)."""
        if not has_content or c.get("finish_reason") != CACHE_THRESHOLD:
            self._held = chunk
            self._held_has_content = has_content
            return []
        # Split: the content goes out now without the finish; a content-free copy is held.
        self._held = content_free_finish(chunk, chat=self._chat, want_ids=self._want_ids)
        self._held_has_content = False
        return self._out(without_finish(chunk, chat=self._chat), c)

    def release_held(self) -> list[dict[str, Any]]:
        """The held finish chunk (and anything still pending before it): the answer ends."""
        out = self._flush_pending() if self._pending else []
        held = self._held
        if held is None:
            return out
        self._held = None
        if self.spec.continuous_usage:
            held["usage"] = self._usage.running()
        if not self.spec.include_usage and self._fingerprint is not None:
            # vLLM stamps the fingerprint on the last chunk: the usage chunk when there is
            # one, else the finish chunk. Upstream legs always have a usage chunk, so the
            # client's finish chunk gets it here.
            held["system_fingerprint"] = self._fingerprint
        out.extend(self._out(held, held["choices"][0]))
        return out

    def final_chunks(self) -> list[dict[str, Any]]:
        """The answer's end: a still-held finish, then the usage chunk if asked for (no [DONE])."""
        out = self.release_held()
        if self.spec.include_usage:
            chunk = self._stamped(self._object, [])
            chunk["usage"] = self._usage.totals(streaming=True)
            if self._fingerprint is not None:
                chunk["system_fingerprint"] = self._fingerprint
            out.append(chunk)
            self.emitted = True
        return out

    def accumulate_response(self) -> dict[str, Any]:
        """The body vLLM 0.32 returns for this request with stream=false."""
        return self._assembler.response(self._model, self._fingerprint, self._usage.totals(streaming=False))
