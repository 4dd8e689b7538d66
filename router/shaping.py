"""Upstream chunks in, client chunks out: one unbroken answer from several upstream legs.

Every leg the router opens streams with usage and token ids (router/wire.py). A client's
answer is the chosen leg, then zero or more resume legs, which are `/v1/completions`
streams even for a chat request. `ResponseShaper` turns that sequence into what one vLLM
engine would have sent for the client's own request:

streaming (`shape`, `release_held`, `final_chunks`)
- one id (`spec.request_id`), one `created` (`spec.created`), one `model` (the name the
  client asked for, else the first leg's), the client endpoint's `object`;
- chat: the role chunk (`delta: {"role": "assistant", "content": ""}`) goes out once per
  answer; a retry leg's role chunk is dropped. Resume-leg completion chunks become chat
  deltas `{"content": text}` with chat-shaped logprobs;
- `token_ids` / `prompt_token_ids`: kept when the client asked for them (prompt ids once,
  from the first leg); otherwise set to null, which is exactly what vLLM sends when token
  ids were not requested (the fields are explicitly set, hence present, in its chunks);
- completion logprobs' `text_offset` continues across legs (each leg counts from 0);
- per-leg usage chunks are swallowed; `final_chunks` sends one usage chunk with totals
  over legs. With `continuous_usage_stats`, every chunk carries running totals;
- HELD BACK: every finish chunk (the chunk whose `finish_reason` is set). Whether it
  ends the answer is only known after the leg ends (the lead may resume), and vLLM puts
  the fingerprint on the last chunk, which is only known at the end too. So `shape`
  returns nothing for it and keeps it:
    * `release_held()` returns it (the answer ends with it) and `final_chunks()` does the
      same for a chunk still held, so ending without calling `release_held` loses nothing;
    * `begin_leg()` drops the finish (the answer goes on); if the chunk also carried
      content (text, token ids, logprobs), that content goes out without the finish
      before the next leg's first chunk (or from `release_held`/`final_chunks`);
    * a "cache_threshold" finish that carries content (vLLM sends its preemption finish
      as a chunk of its own, so only other engines would) is split at once: the content
      goes out now, a content-free finish chunk (`text: ""` / `delta: {"content": ""}`)
      is what is held.
  A normal finish is followed upstream by the usage chunk and [DONE] at once, so holding
  it costs no latency.

non-streaming (`accumulate_response`)
- the JSON vLLM 0.32 returns for the same request with `stream: false` (every field that
  `model_dump()` writes, nulls included), built from every chunk seen across legs; `shape`
  builds no client chunks for such a client and returns [].
- not reproducible from streams, hence null: `prompt_logprobs` (admission rejects the
  option), `prompt_text`, `metrics` (per-request timing, only with an engine flag),
  `kv_transfer_params` (internal, never shown to clients), `routed_experts`.

State for the lead (resume, accounting): `prompt_token_ids` (spec's, else the first
non-resume leg's), `generated_token_ids` and `generated_text` across legs,
`finish_reason`/`stop_reason`/`leg_tokens` of the current leg, `first_token_seen`,
`emitted` (a chunk went to the client: errors must now travel as SSE events), `legs`,
`token_ids_complete` (False: the engine hid some token ids, do not resume from them).

Ownership: `shape` rewrites the chunk it is given in place and may return it; the caller
must not use the chunk afterwards. That saves a copy per chunk on the hot path.

Usage totals (client view):
- prompt_tokens: the client's prompt, i.e. the first non-resume leg's usage (a resume
  leg's prompt also holds generated tokens), else the length of the prompt token ids;
- completion_tokens: the sum over legs (a leg's usage chunk, else the token ids it sent);
- prompt_tokens_details: from the first leg that generated tokens (the leg that actually
  processed the client's prompt for this answer), else from the first leg that reported
  usage; cached_tokens is capped at prompt_tokens, since a resume leg's cache can cover
  generated tokens too;
- completion_tokens_details.reasoning_tokens: summed over the legs that report it.
"""
from __future__ import annotations

from array import array

from router.admission import ENDPOINT_CHAT, RequestSpec
from router.wire import CACHE_THRESHOLD, MalformedChunk, check_choice, check_ids, Usage, message_usage

_CHAT_CHUNK = "chat.completion.chunk"
_TEXT_COMPLETION = "text_completion"
# Generated text pieces joined into one block at a time (see ResponseShaper.__init__).
_TEXT_BLOCK_PARTS = 256


def _lp_entries(lp) -> bool:
    """Logprobs that cover at least one token (an empty object covers none)."""
    return isinstance(lp, dict) and bool(lp.get("tokens") or lp.get("content"))


class ResponseShaper:
    """See the module docstring. One instance per client answer."""

    def __init__(self, spec: RequestSpec):
        self.spec = spec
        self._chat = spec.endpoint == ENDPOINT_CHAT
        self._object = _CHAT_CHUNK if self._chat else _TEXT_COMPLETION
        self._model = spec.model
        self._rid = spec.request_id
        self._created = spec.created
        self._want_ids = spec.return_token_ids
        self._accumulate = not spec.stream
        body = spec.body
        # Chat logprobs asked for: how many alternatives (resume legs' logprobs are converted).
        # Admission does not validate top_logprobs (the engine does), so read it defensively.
        top = body.get("top_logprobs")
        self._chat_top_logprobs = (top if type(top) is int else 0) if self._chat and body.get("logprobs") else None

        # --- state the lead reads ---
        self.prompt_token_ids: list[int] | None = (
            list(spec.prompt_token_ids) if spec.prompt_token_ids is not None else None)
        # Compact: 8 bytes a token instead of a list entry and an int object (~36 bytes),
        # and the text in blocks of _TEXT_BLOCK_PARTS pieces: an answer's state is kept
        # for resumption, and it should cost little next to the bounded stream buffers.
        self.generated_token_ids: array[int] = array("q")
        self._text_blocks: list[str] = []
        self._text_parts: list[str] = []
        self._text_cache: str | None = ""
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.leg_tokens = 0
        self.first_token_seen = False
        # False once a leg generated tokens whose ids were not sent (vLLM hides them in chat
        # streams when a reasoning parser runs with include_reasoning false): then
        # generated_token_ids is incomplete and the answer cannot be resumed from it.
        self.token_ids_complete = True
        self.emitted = False          # anything returned for the client yet
        self.legs = 0

        # --- per leg ---
        self._is_resume = False
        self._leg_completion_tokens: int | None = None  # the leg's usage, if it sent one
        self._offset_base = 0         # completion logprobs: text_offset of this leg's start
        self._offset_end = 0          # end of the text covered by logprobs so far

        # --- across legs ---
        self._held: dict | None = None
        self._held_has_content = False
        self._pending: list[dict] = []   # content of a discarded held chunk, sent next
        self._role_sent = False
        self._prompt_ids_sent = False
        self._completion_done = 0     # completion tokens of finished legs
        self._prompt_tokens: int | None = None
        self._prompt_details: dict | None = None
        self._details_productive = False
        self._reasoning_tokens: int | None = None
        self._fingerprint: str | None = None

        # --- accumulation (non-streaming clients) ---
        self._role: str | None = None
        self._content_parts: list[str] = []
        self._content_seen = False
        self._reasoning_parts: list[str] = []
        self._tool_calls: dict[int, dict] = {}
        self._lp_seen = False
        self._lp_content: list[dict] = []          # chat
        self._lp_tokens: list[str] = []            # completions
        self._lp_token_logprobs: list = []
        self._lp_top: list = []
        self._lp_offsets: list[int] = []

    # --- lead-facing state ------------------------------------------------------------------
    @property
    def generated_text(self) -> str:
        if self._text_cache is None:
            self._text_cache = "".join(self._text_blocks) + "".join(self._text_parts)
        return self._text_cache

    def begin_leg(self, *, is_resume: bool) -> None:
        """A new upstream leg starts; `is_resume` legs are /v1/completions streams."""
        if self.legs:
            self._close_leg()
        self.legs += 1
        self._is_resume = is_resume
        held = self._held
        if held is not None:
            self._held = None
            if self._held_has_content:
                # The leg's last content must still reach the client, without the finish.
                self._pending.append(self._without_finish(held))
        self.leg_tokens = 0
        self._leg_completion_tokens = None
        self.finish_reason = None
        self.stop_reason = None
        self._offset_base = self._offset_end

    def _close_leg(self) -> None:
        n = self._leg_completion_tokens
        self._completion_done += n if n is not None and n >= self.leg_tokens else self.leg_tokens

    # --- streaming ----------------------------------------------------------------------------
    def shape(self, chunk: dict) -> list[dict]:
        """One parsed upstream chunk -> the chunks for a streaming client (maybe none).

        For a non-streaming client it only records the chunk for `accumulate_response` and
        returns nothing (no client chunks are built on that path).

        Raises MalformedChunk (a ValueError) for a chunk it cannot read; the types of the
        fields the answer is built from are checked before any state changes, so a bad
        chunk never half-updates the answer."""
        try:
            return self._shape(chunk)
        except MalformedChunk:
            raise
        except (TypeError, AttributeError, KeyError, IndexError, ValueError) as e:
            # Something deeper in an odd chunk (e.g. logprob entries of the wrong type).
            raise MalformedChunk(f"unreadable upstream chunk ({type(e).__name__}: {e})") from e

    def _shape(self, chunk: dict) -> list[dict]:
        if type(chunk) is not dict:
            raise MalformedChunk("upstream chunk is not a JSON object")
        if self._model is None and isinstance(chunk.get("model"), str):
            self._model = chunk["model"]
        fp = chunk.get("system_fingerprint")
        if fp is not None:
            self._fingerprint = fp
        choices = chunk.get("choices")
        if not choices:
            usage = chunk.get("usage")
            if isinstance(usage, dict):
                self._note_usage(message_usage(chunk))
            return []
        if type(choices) is not list:
            raise MalformedChunk("upstream chunk: `choices` is not a list")
        c = choices[0]
        check_choice(c, chat=self._chat and not self._is_resume)
        if self.prompt_token_ids is None and not self._is_resume:
            pti = chunk.get("prompt_token_ids") if "delta" in c else c.get("prompt_token_ids")
            if pti is not None:
                check_ids(pti, "prompt_token_ids")
        if self._pending:
            pending = self._flush_pending()
            if self._is_resume or not self._chat:
                return pending + self._shape_completion(chunk, c)
            return pending + self._shape_chat(chunk, c)
        if self._is_resume or not self._chat:
            return self._shape_completion(chunk, c)
        return self._shape_chat(chunk, c)

    def _note_ids(self, c: dict, top_prompt_ids) -> list:
        """Record prompt ids (first non-resume leg) and this chunk's generated ids."""
        if self.prompt_token_ids is None and not self._is_resume and top_prompt_ids is not None:
            self.prompt_token_ids = top_prompt_ids
        ids = c.get("token_ids")
        if ids:
            try:
                self.generated_token_ids.extend(ids)
            except OverflowError:
                raise MalformedChunk("upstream chunk: a token id does not fit 64 bits") from None
            self.leg_tokens += len(ids)
            self.first_token_seen = True
            return ids
        return ()

    def _note_text(self, text: str) -> None:
        parts = self._text_parts
        parts.append(text)
        if len(parts) >= _TEXT_BLOCK_PARTS:
            self._text_blocks.append("".join(parts))
            parts.clear()
        self._text_cache = None
        self.first_token_seen = True

    def _note_finish(self, c: dict) -> str | None:
        fr = c.get("finish_reason")
        if fr is not None:
            self.finish_reason = fr
            self.stop_reason = c.get("stop_reason")
        return fr

    def _stamp(self, chunk: dict) -> None:
        chunk["id"] = self._rid
        chunk["object"] = self._object
        chunk["created"] = self._created
        chunk["model"] = self._model
        if self.spec.continuous_usage:
            chunk["usage"] = self._running_usage()
        elif "usage" in chunk:
            del chunk["usage"]

    def _shape_completion(self, chunk: dict, c: dict) -> list[dict]:
        """A chunk of a completion stream: a completions client's, or a resume leg's."""
        prompt_ids = c.get("prompt_token_ids")
        ids = self._note_ids(c, prompt_ids)
        text = c.get("text") or ""
        if text:
            self._note_text(text)
        fr = self._note_finish(c)
        lp = c.get("logprobs")
        if isinstance(lp, dict):
            lp = self._rebase_completion_logprobs(lp)
        if self._accumulate:
            if text:
                self._content_parts.append(text)
            if self._chat:
                if lp is not None:
                    self._lp_seen = True
                    self._lp_content.extend(self._chat_logprobs_from_completion(lp))
            else:
                self._accumulate_completion_logprobs(lp)
            return []

        if self._chat:
            # A resume leg of a chat answer: rebuild the chunk as a chat delta.
            if not self._role_sent:
                pre = [self._role_chunk()]
            else:
                pre = []
            choice = {"index": 0, "delta": {"content": text},
                      "logprobs": ({"content": self._chat_logprobs_from_completion(lp)}
                                   if lp is not None and self._chat_top_logprobs is not None else None),
                      "finish_reason": fr}
            if fr is not None:
                choice["stop_reason"] = c.get("stop_reason")
            choice["token_ids"] = list(ids) if self._want_ids else None
            out = {"id": self._rid, "object": _CHAT_CHUNK, "created": self._created, "model": self._model,
                   "choices": [choice]}
            if self.spec.continuous_usage:
                out["usage"] = self._running_usage()
            if fr is not None:
                res = self._hold(out, choice, bool(text or ids or _lp_entries(lp)))
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
            return self._hold(chunk, c, bool(text or ids or _lp_entries(lp)))
        return self._out(chunk, c)

    def _normalize(self, chunk: dict, c: dict, prompt_ids_in: dict) -> None:
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

    def _shape_chat(self, chunk: dict, c: dict) -> list[dict]:
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
            self._note_text(content)
        elif reasoning or tool_calls:
            self.first_token_seen = True
        if (content or reasoning or tool_calls) and "token_ids" in c and c["token_ids"] is None:
            self.token_ids_complete = False
        lp = c.get("logprobs")
        if self._accumulate:
            if role is not None:
                if self._role is None:
                    self._role = role
            elif content is not None:
                self._content_seen = True
            if content:
                self._content_parts.append(content)
            if reasoning:
                self._reasoning_parts.append(reasoning)
            if tool_calls:
                self._accumulate_tool_calls(tool_calls)
            if isinstance(lp, dict):
                self._lp_seen = True
                lc = lp.get("content")
                if lc:
                    self._lp_content.extend(lc)
            return []

        new_role = False
        if role is not None:
            if self._role_sent:
                # A retry leg's role chunk: the client already has one.
                del delta["role"]
                if not (content or reasoning or tool_calls or ids or fr or _lp_entries(lp)):
                    return []
            else:
                self._role_sent = new_role = True
        # Chat chunks carry the prompt's ids at the top level.
        self._normalize(chunk, c, prompt_ids_in=chunk)
        if fr is not None:
            has_content = bool(content or reasoning or tool_calls or ids or _lp_entries(lp))
            if new_role and not has_content:
                # The role rides on the held chunk; if that is discarded, the next leg's
                # first chunk must carry the role.
                self._role_sent = False
            return self._hold(chunk, c, has_content)
        return self._out(chunk, c)

    def _out(self, chunk: dict, c: dict) -> list[dict]:
        """`chunk` goes to the client now. The client's prompt ids (when asked for) ride on
        the first chunk that actually goes out, where vLLM puts them: a chat answer's role
        chunk (top level), a completion's first chunk (in the choice). A held chunk that
        is discarded never delivered them, so this is decided here, not on arrival."""
        if self._want_ids:
            if self._chat:
                if "prompt_token_ids" in chunk:
                    chunk["prompt_token_ids"] = self._take_prompt_ids()
            else:
                c["prompt_token_ids"] = self._take_prompt_ids()
        self.emitted = True
        return [chunk]

    def _take_prompt_ids(self) -> list[int] | None:
        if self._prompt_ids_sent or self.prompt_token_ids is None:
            return None
        self._prompt_ids_sent = True
        return self.prompt_token_ids

    def _role_chunk(self) -> dict:
        """The role chunk vLLM sends first, for a chat answer whose first leg sent none."""
        self._role_sent = True
        if self._role is None:
            self._role = "assistant"
        out = {"id": self._rid, "object": _CHAT_CHUNK, "created": self._created, "model": self._model,
               "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                            "logprobs": None, "finish_reason": None}]}
        out["prompt_token_ids"] = self._take_prompt_ids() if self._want_ids else None
        out["prompt_text"] = None
        if self.spec.continuous_usage:
            out["usage"] = self._running_usage()
        return out

    def _without_finish(self, chunk: dict) -> dict:
        c = chunk["choices"][0]
        c["finish_reason"] = None
        if self._chat:
            # vLLM's chat chunks carry stop_reason on the finish chunk only.
            c.pop("stop_reason", None)
        elif "stop_reason" in c:
            c["stop_reason"] = None
        return chunk

    def _flush_pending(self) -> list[dict]:
        pending = self._pending
        self._pending = []
        out: list[dict] = []
        for chunk in pending:
            out.extend(self._out(chunk, chunk["choices"][0]))
        return out

    def _hold(self, chunk: dict, c: dict, has_content: bool) -> list[dict]:
        """Keep a finish chunk back until the lead knows whether the answer ends with it.

        A normal finish is held whole (vLLM's own shape; [DONE] follows at once, so the
        delay is nil). A cache_threshold finish that carries content is split, so the
        content is not delayed by a resume; it does not happen with vLLM, whose preemption
        finish comes in a chunk of its own."""
        if not has_content or c.get("finish_reason") != CACHE_THRESHOLD:
            self._held = chunk
            self._held_has_content = has_content
            return []
        # Split: the content goes out now without the finish; a content-free copy is held.
        finish = dict(chunk)
        fc = dict(c)
        if self._chat:
            fc["delta"] = {"content": ""}
            fc["logprobs"] = None
        else:
            fc["text"] = ""
            fc["logprobs"] = None
            if "prompt_token_ids" in fc:
                fc["prompt_token_ids"] = None
        if "token_ids" in fc:
            fc["token_ids"] = [] if self._want_ids else None
        finish["choices"] = [fc]
        if "prompt_token_ids" in finish:
            finish["prompt_token_ids"] = None   # chat: top level; sent with the content part
        self._held = finish
        self._held_has_content = False
        return self._out(self._without_finish(chunk), c)

    def release_held(self) -> list[dict]:
        """The held finish chunk (and anything still pending before it), when the lead ends
        the answer with it."""
        out = self._flush_pending() if self._pending else []
        held = self._held
        if held is None:
            return out
        self._held = None
        if self.spec.continuous_usage:
            held["usage"] = self._running_usage()
        if not self.spec.include_usage and self._fingerprint is not None:
            # vLLM stamps the fingerprint on the last chunk: the usage chunk when there is
            # one, else the finish chunk. Upstream legs always have a usage chunk, so the
            # client's finish chunk gets it here.
            held["system_fingerprint"] = self._fingerprint
        out.extend(self._out(held, held["choices"][0]))
        return out

    def final_chunks(self) -> list[dict]:
        """At the end of the answer: a still-held finish, then the usage chunk if the client
        asked for it (no [DONE]: the writer adds it)."""
        out = self.release_held()
        if self.spec.include_usage:
            chunk = {"id": self._rid, "object": self._object, "created": self._created,
                     "model": self._model, "choices": [], "usage": self._usage(streaming=True)}
            if self._fingerprint is not None:
                chunk["system_fingerprint"] = self._fingerprint
            out.append(chunk)
            self.emitted = True
        return out

    # --- usage ---------------------------------------------------------------------------------
    def _note_usage(self, usage: Usage) -> None:
        self._leg_completion_tokens = n = usage.completion_tokens
        if n is not None and n > self.leg_tokens:
            # Token ids can be hidden (chat with a reasoning parser and include_reasoning
            # false); the engine's count is then the only one.
            self.leg_tokens = n
            self.token_ids_complete = False
        if not self._is_resume and self._prompt_tokens is None and usage.prompt_tokens is not None:
            self._prompt_tokens = usage.prompt_tokens
        details = usage.prompt_tokens_details
        if details is not None:
            productive = self.leg_tokens > 0
            if self._prompt_details is None or (productive and not self._details_productive):
                self._prompt_details = details
                self._details_productive = productive
        if usage.reasoning_tokens is not None:
            self._reasoning_tokens = (self._reasoning_tokens or 0) + usage.reasoning_tokens

    def _client_prompt_tokens(self) -> int:
        if self._prompt_tokens is not None:
            return self._prompt_tokens
        return len(self.prompt_token_ids) if self.prompt_token_ids is not None else 0

    def _completion_tokens(self) -> int:
        n = self._leg_completion_tokens
        leg = n if n is not None and n >= self.leg_tokens else self.leg_tokens
        return self._completion_done + (leg if self.legs else 0)

    def _running_usage(self) -> dict:
        """continuous_usage_stats: running totals, in vLLM's key order. Chat chunks also
        carry `completion_tokens_details` (null unless the engine counts reasoning tokens):
        vLLM passes it explicitly there and dumps with exclude_unset (chat serving.py);
        completion chunks do not have it."""
        p = self._client_prompt_tokens()
        n = self._completion_done + self.leg_tokens
        if self._chat:
            return {"prompt_tokens": p, "total_tokens": p + n, "completion_tokens": n,
                    "completion_tokens_details": None}
        return {"prompt_tokens": p, "total_tokens": p + n, "completion_tokens": n}

    def _usage(self, *, streaming: bool) -> dict:
        """Totals over legs. `streaming`: vLLM's usage chunk drops null fields; the
        non-streaming body writes every field."""
        p = self._client_prompt_tokens()
        n = self._completion_tokens()
        usage: dict = {"prompt_tokens": p, "total_tokens": p + n, "completion_tokens": n}
        details = self._prompt_details
        if details is not None:
            d = dict(details)
            if isinstance(d.get("cached_tokens"), int) and d["cached_tokens"] > p:
                d["cached_tokens"] = p
            if not streaming:
                d = {"cached_tokens": d.get("cached_tokens"), "created_cache_tokens": d.get("created_cache_tokens"),
                     "multimodal_tokens": d.get("multimodal_tokens"), **d}
        else:
            d = None
        ctd = {"reasoning_tokens": self._reasoning_tokens} if self._reasoning_tokens is not None else None
        if streaming:
            if d is not None:
                usage["prompt_tokens_details"] = d
            if ctd is not None:
                usage["completion_tokens_details"] = ctd
        else:
            usage["prompt_tokens_details"] = d
            usage["completion_tokens_details"] = ctd
        return usage

    # --- logprobs --------------------------------------------------------------------------------
    def _rebase_completion_logprobs(self, lp: dict) -> dict:
        """Shift this leg's text offsets by the text of the legs before it, and track the end
        (vLLM's own rule: next offset = last offset + len(last token))."""
        offsets = lp.get("text_offset")
        tokens = lp.get("tokens")
        if offsets:
            base = self._offset_base
            if base:
                offsets = lp["text_offset"] = [o + base for o in offsets]
            if tokens and isinstance(tokens[-1], str):
                self._offset_end = offsets[-1] + len(tokens[-1])
        return lp

    def _accumulate_completion_logprobs(self, lp) -> None:
        if not isinstance(lp, dict):
            return
        self._lp_seen = True
        self._lp_offsets.extend(lp.get("text_offset") or ())
        self._lp_token_logprobs.extend(lp.get("token_logprobs") or ())
        self._lp_tokens.extend(lp.get("tokens") or ())
        self._lp_top.extend(lp.get("top_logprobs") or ())

    def _chat_logprobs_from_completion(self, lp: dict) -> list[dict]:
        """Completion logprobs (a resume leg) as chat `logprobs.content` entries.

        vLLM's completion top_logprobs hold top_logprobs + 1 entries (the sampled token
        first when it is outside the top), the chat ones exactly top_logprobs, from the same
        ordered map, so the first top_logprobs entries are the chat list."""
        k = self._chat_top_logprobs or 0
        out: list[dict] = []
        tops = lp.get("top_logprobs") or ()
        lps = lp.get("token_logprobs") or ()
        for i, tok in enumerate(lp.get("tokens") or ()):
            lpv = lps[i] if i < len(lps) else None
            top = tops[i] if i < len(tops) else None
            entry = {"token": tok, "logprob": -9999.0 if lpv is None else lpv,
                     "bytes": list(tok.encode("utf-8", "replace")),
                     "top_logprobs": [
                         {"token": t, "logprob": v, "bytes": list(t.encode("utf-8", "replace"))}
                         for j, (t, v) in enumerate(top.items()) if j < k
                     ] if isinstance(top, dict) else []}
            out.append(entry)
        return out

    # --- tool calls --------------------------------------------------------------------------------
    def _accumulate_tool_calls(self, deltas: list) -> None:
        for d in deltas:
            if not isinstance(d, dict):
                continue
            idx = d.get("index", 0)
            tc = self._tool_calls.get(idx)
            if tc is None:
                tc = self._tool_calls[idx] = {"id": None, "type": "function",
                                              "function": {"name": None, "arguments": ""}}
            if d.get("id") and tc["id"] is None:
                tc["id"] = d["id"]
            f = d.get("function")
            if isinstance(f, dict):
                if f.get("name") and tc["function"]["name"] is None:
                    tc["function"]["name"] = f["name"]
                if f.get("arguments"):
                    tc["function"]["arguments"] += f["arguments"]

    # --- non-streaming -------------------------------------------------------------------------------
    def accumulate_response(self) -> dict:
        """The body vLLM 0.32 returns for this request with stream=false."""
        if self._chat:
            return self._chat_response()
        return self._completion_response()

    def _completion_response(self) -> dict:
        logprobs = None
        if self._lp_seen:
            logprobs = {"text_offset": self._lp_offsets, "token_logprobs": self._lp_token_logprobs,
                        "tokens": self._lp_tokens, "top_logprobs": self._lp_top}
        choice = {
            "index": 0,
            "text": "".join(self._content_parts),
            "logprobs": logprobs,
            "finish_reason": self.finish_reason,
            "stop_reason": self.stop_reason,
            "token_ids": list(self.generated_token_ids) if self._want_ids else None,
            "prompt_logprobs": None,
            "prompt_token_ids": list(self.prompt_token_ids) if self._want_ids and self.prompt_token_ids is not None else None,
            "routed_experts": None,
        }
        return {
            "id": self._rid, "object": "text_completion", "created": self._created, "model": self._model,
            "choices": [choice], "service_tier": None, "system_fingerprint": self._fingerprint,
            "usage": self._usage(streaming=False),
            "kv_transfer_params": None, "ec_transfer_params": None, "metrics": None,
        }

    def _chat_response(self) -> dict:
        reasoning = "".join(self._reasoning_parts) if self._reasoning_parts else None
        tool_calls = [self._tool_calls[i] for i in sorted(self._tool_calls)]
        if self._content_seen or self._content_parts:
            content: str | None = "".join(self._content_parts)
        else:
            # A reasoning/tool parser answers content null when the model wrote none.
            content = None if (reasoning is not None or tool_calls) else ""
        message: dict = {"role": self._role or "assistant", "content": content, "refusal": None,
                         "annotations": None, "audio": None, "function_call": None}
        if tool_calls:
            message["tool_calls"] = tool_calls
        message["reasoning"] = reasoning
        choice = {
            "index": 0,
            "message": message,
            "logprobs": {"content": self._lp_content} if self._lp_seen else None,
            "finish_reason": self.finish_reason or "stop",
            "stop_reason": self.stop_reason,
            "token_ids": list(self.generated_token_ids) if self._want_ids else None,
            "routed_experts": None,
        }
        return {
            "id": self._rid, "object": "chat.completion", "created": self._created, "model": self._model,
            "choices": [choice], "service_tier": None, "system_fingerprint": self._fingerprint,
            "usage": self._usage(streaming=False),
            "prompt_logprobs": None,
            "prompt_token_ids": list(self.prompt_token_ids) if self._want_ids and self.prompt_token_ids is not None else None,
            "prompt_text": None, "kv_transfer_params": None, "ec_transfer_params": None, "metrics": None,
        }
