"""Per-token log-probabilities: the target's log-softmax of its raw logits (fp32), before temperature / top-k /
top-p (what OpenAI-compatible servers report), for the token emitted and the top-N alternatives of its row."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

MAX_LOGPROBS = 20  # OpenAI's cap on top_logprobs; the server and SamplingParams refuse more


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # top-N (token id, logprob), most likely first; () when N = 0


def token_logprobs(logits: Tensor, tokens: list[int], num_top: int) -> list[TokenLogprob]:
    """logits [n, V] (one row per emitted token, the row the token was drawn from); tokens [n] -> n records."""
    if not tokens:
        return []
    logp = torch.log_softmax(logits.float(), dim=-1)  # [n, V]
    ids = torch.tensor(tokens, dtype=torch.long, device=logp.device)
    chosen = logp.gather(1, ids[:, None])[:, 0].tolist()
    tops: list[tuple] = [()] * len(tokens)
    if num_top > 0:
        values, top_ids = logp.topk(min(num_top, logp.shape[-1]), dim=-1)  # [n, N], sorted
        tops = [tuple(zip(i, v)) for i, v in zip(top_ids.tolist(), values.tolist())]
    return [TokenLogprob(t, c, top) for t, c, top in zip(tokens, chosen, tops)]


def rows_logprobs(seqs: list, logits: Tensor, rows: dict[int, list[int]], new_tokens: list[list[int]]
                  ) -> list[list[TokenLogprob]] | None:
    """Per scheduled seq, the records of its emitted tokens; rows[i] = the logits rows of seq i's tokens, in order.
    None when no request asked for logprobs (the common case costs nothing)."""
    wanted = [i for i, seq in enumerate(seqs) if seq.params.logprobs is not None and new_tokens[i]]
    if not wanted:
        return None
    out: list[list[TokenLogprob]] = [[] for _ in seqs]
    for i in wanted:
        sel = torch.tensor(rows[i][:len(new_tokens[i])], dtype=torch.long, device=logits.device)
        out[i] = token_logprobs(logits.index_select(0, sel), new_tokens[i], seqs[i].params.logprobs)
    return out
