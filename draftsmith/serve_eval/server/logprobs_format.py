"""The engine's per-token logprobs (serve_eval.engine.logprobs.TokenLogprob) in OpenAI's two response shapes.

Completions: ``logprobs = {tokens, token_logprobs, top_logprobs: [{token: logprob}], text_offset}``;
chat: ``logprobs = {content: [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}``.
A token's string is its own decode (as vLLM reports it); text_offset counts characters of those strings from
the start of the choice's text (``start``), so a streamed choice continues where its previous chunk ended.
"""
from __future__ import annotations

from typing import Any, Sequence

from draftsmith.serve_eval.server import protocol as P


def token_text(tokenizer: Any, token_id: int) -> str:
    return tokenizer.decode([token_id]) if tokenizer is not None else str(token_id)


def completion_logprobs(records: Sequence, tokenizer: Any, start: int = 0, as_ids: bool = False) -> P.CompletionLogprobs:
    """as_ids: tokens spelled "token_id:<id>" (vLLM's return_tokens_as_token_ids; exact ids for a client)."""
    tokens, values, tops, offsets = [], [], [], []
    offset = start
    spell = (lambda tid: f"token_id:{tid}") if as_ids else (lambda tid: token_text(tokenizer, tid))  # noqa: E731
    for rec in records:
        text = spell(rec.token_id)
        tokens.append(text)
        values.append(rec.logprob)
        top: dict[str, float] = {}
        for tid, lp in rec.top:  # two ids may decode alike: the likelier (listed first) keeps the key
            top.setdefault(spell(tid), lp)
        tops.append(top)
        offsets.append(offset)
        offset += len(token_text(tokenizer, rec.token_id))  # offsets are in the choice's text, whatever the spelling
    return P.CompletionLogprobs(tokens=tokens, token_logprobs=values, top_logprobs=tops, text_offset=offsets)


def _entry(tokenizer: Any, token_id: int, logprob: float) -> dict[str, Any]:
    text = token_text(tokenizer, token_id)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8", "surrogatepass"))}


def chat_logprobs(records: Sequence, tokenizer: Any) -> P.ChatLogprobs:
    content = [P.ChatTokenLogprob(**_entry(tokenizer, rec.token_id, rec.logprob),
                                  top_logprobs=[P.ChatTopLogprob(**_entry(tokenizer, tid, lp)) for tid, lp in rec.top])
               for rec in records]
    return P.ChatLogprobs(content=content)


def end_offset(records: Sequence, tokenizer: Any, start: int = 0) -> int:
    """text_offset just past these records' token strings (where the next chunk's offsets start)."""
    return start + sum(len(token_text(tokenizer, rec.token_id)) for rec in records)
