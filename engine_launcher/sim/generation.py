"""Token generation for a simulated request: the next (deterministic) token, its text and
logprobs, and whether the request is done (EOS, a stop token or string, max_tokens, the
context window), with vLLM's min_tokens and stop-string rules."""

from __future__ import annotations

from . import tokenizer as tok
from .kv_cache import hash_blocks
from .request import SimRequest

# (finish_reason, stop_reason): the matched stop string or token id, None otherwise.
Finish = tuple[str, str | int | None]


def append_next_token(req: SimRequest, eos_probability: float, block_size: int) -> int:
    """Generate the request's next token and append it (ids, block hashes, logprobs, text)."""
    sp = req.sampling
    pos = len(req.output_ids)
    allow_eos = not sp.ignore_eos and pos >= sp.min_tokens
    token = tok.next_token(req.gen_key, pos, eos_probability, allow_eos)
    req.output_ids.append(token)
    req.all_ids.append(token)
    if len(req.all_ids) % block_size == 0:  # a block just filled up
        hash_blocks(req.all_ids, block_size, req.block_hashes, req.lora_name)
    if sp.logprobs is not None:
        req.output_logprobs.append(tok.fake_logprobs(req.gen_key, pos, token, sp.logprobs))
    req.output_text += tok.token_text(token) if token != tok.EOS_ID else ""
    return token


def finish_after(req: SimRequest, token: int, text_before: int, context_len: int) -> Finish | None:
    """Whether the token just appended ends the request; a matched stop string is cut from
    the text (kept with include_stop_str_in_output). text_before: the text's length before
    the token."""
    sp = req.sampling
    n_out = len(req.output_ids)
    if token == tok.EOS_ID:
        return "stop", None
    if token in sp.stop_token_ids and n_out >= sp.min_tokens:
        return "stop", token
    if sp.stop and n_out >= sp.min_tokens:
        text = req.output_text
        for s in sp.stop:
            idx = text.find(s, max(0, text_before - len(s) + 1))
            if idx >= 0:
                req.output_text = text[: idx + len(s)] if sp.include_stop_str_in_output else text[:idx]
                return "stop", s
    if n_out >= sp.max_tokens or req.num_tokens >= context_len:
        return "length", None
    return None


__all__ = ["Finish", "append_next_token", "finish_after"]
