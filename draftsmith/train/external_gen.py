"""Answers regenerated through an external OpenAI-compatible engine (vLLM, SGLang, our own server).

``draftsmith generate backend=openai endpoint=http://HOST:PORT/v1`` swaps the in-process engine for this client:
prompts go out as token ids to ``/v1/completions`` (no re-tokenisation on the way in), at most ``concurrency`` at a
time; a request that fails (connection refused, 5xx, 429) is retried with exponential backoff, and one that still
fails stops the job before its shard is written (the shards already written stay: a rerun resumes after them).
Answer ids come back exactly when the server returns tokens as ids (vLLM's ``return_tokens_as_token_ids``, which
our server honours too), else the answer text is re-encoded with the target's tokenizer.

Token-level KD's top-k log-probs come from the endpoint too (``topk > 0``): the completion's ``top_logprobs`` of
answer token j is the target's distribution at position prompt_len + j - 1, the row gendata stores it under. Rows
no answer token is predicted from (the prompt's, the last one) are never scored (the loss mask is the answer) and
hold the data's next token at log-prob 0. An endpoint that offers fewer than k alternatives, or none, or spells
them as text rather than ids, stops the job with one line before the shard is written.
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

RETRY_STATUS = (429, 500, 502, 503, 504)
ID_PREFIX = "token_id:"  # vLLM's return_tokens_as_token_ids spelling
FILLER_LOGPROB = -1e4  # the unscored rows' other k-1 entries: finite (no NaN in a masked-out KL), ~zero mass


@dataclass(frozen=True)
class EndpointConfig:
    endpoint: str  # base URL, ending in /v1
    concurrency: int = 8  # requests in flight at once
    retries: int = 4  # attempts after the first
    backoff_s: float = 0.5  # first retry's wait; doubles each time
    timeout_s: float = 120.0
    api_key: str | None = None
    logprobs: int = 0  # top-k logprobs asked per answer token (0 = none); stored when the server offers them

    def __post_init__(self) -> None:
        if not self.endpoint.startswith(("http://", "https://")):
            raise ValueError(f"endpoint: {self.endpoint!r} is not an http(s) URL (e.g. http://HOST:PORT/v1)")
        if self.concurrency < 1 or self.retries < 0 or self.backoff_s < 0:
            raise ValueError("endpoint: concurrency must be >= 1, retries and backoff_s >= 0")


class EndpointError(ValueError):
    """The endpoint could not answer (after the retries); one line naming it."""


class OpenAIGenerator:
    """Same interface as train.distill.dataset's in-process generator: answers(prompts, ids) -> [(answer ids, reason)]."""

    def __init__(self, cfg: EndpointConfig, tokenizer: Any, data: Any, topk: int = 0) -> None:
        import httpx

        self.cfg, self.tokenizer, self.data, self.topk = cfg, tokenizer, data, topk
        self.num_logprobs = max(cfg.logprobs, topk)  # what each request asks for
        self._top: dict[int, list[dict[str, float]]] = {}  # example id -> per answer token top-k (last answers call)
        self.answer_tokens = 0
        headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
        self.client = httpx.Client(base_url=cfg.endpoint.rstrip("/"), timeout=cfg.timeout_s, headers=headers,
                                   limits=httpx.Limits(max_connections=cfg.concurrency))
        self.logprobs_offered: bool | None = None  # learnt from the first answer when logprobs are asked
        self.num_requests = 0
        self.num_retries = 0
        self.model_id = self._model_id()  # also the reachability check, before any shard is written

    def _request(self, method: str, path: str, body: dict | None = None) -> dict:
        import httpx

        wait = self.cfg.backoff_s
        for attempt in range(self.cfg.retries + 1):
            try:
                response = self.client.request(method, path, json=body)
                if response.status_code not in RETRY_STATUS:
                    if response.status_code >= 400:
                        raise EndpointError(f"endpoint {self.cfg.endpoint}{path}: HTTP {response.status_code}: "
                                            f"{response.text[:200]}")
                    return response.json()
                problem = f"HTTP {response.status_code}"
            except httpx.HTTPError as err:
                problem = f"{type(err).__name__}: {err}"
            if attempt == self.cfg.retries:
                raise EndpointError(f"endpoint {self.cfg.endpoint}{path} failed after {attempt + 1} attempts ({problem})")
            self.num_retries += 1
            time.sleep(wait)
            wait *= 2
        raise AssertionError("unreachable")

    def _model_id(self) -> str:
        models = self._request("GET", "/models").get("data") or []
        if not models:
            raise EndpointError(f"endpoint {self.cfg.endpoint}/models lists no model")
        return str(models[0]["id"])

    def _one(self, prompt: list[int], params: dict) -> tuple[list[int], str, list | None]:
        body = {"model": self.model_id, "prompt": prompt, **params}
        if self.num_logprobs:
            body.update(logprobs=self.num_logprobs, return_tokens_as_token_ids=True)
        choice = self._request("POST", "/completions", body)["choices"][0]
        self.num_requests += 1
        reason = choice.get("finish_reason") or "length"
        lp = choice.get("logprobs")
        tokens = (lp or {}).get("tokens") or []
        if tokens and all(t.startswith(ID_PREFIX) for t in tokens):
            ids = [int(t.split(":", 1)[1]) for t in tokens]
            bad = next((t for t in ids if not 0 <= t < len(self.tokenizer)), None)
            if bad is not None:  # the endpoint serves another vocabulary than the target dir's tokenizer
                raise EndpointError(f"endpoint {self.cfg.endpoint} ({self.model_id}): vocabulary mismatch, it returned "
                                    f"token id {bad} outside the target tokenizer's {len(self.tokenizer)} ids")
        else:
            ids = self.tokenizer.encode(choice.get("text", ""), add_special_tokens=False)
            if reason == "stop" and self.tokenizer.eos_token_id is not None:
                ids.append(self.tokenizer.eos_token_id)  # the in-process engine keeps the eos it stopped on
        if self.num_logprobs:
            self.logprobs_offered = bool(lp and lp.get("top_logprobs"))
        top = (lp or {}).get("top_logprobs")
        if self.topk:
            self._check_topk(ids, top, tokens)
        return ids, reason, top

    def _check_topk(self, ids: list[int], top: list | None, tokens: list[str]) -> None:
        """Top-k KD needs k id-spelled alternatives at every answer token: else one line, before any shard write."""
        where = f"endpoint {self.cfg.endpoint} ({self.model_id})"
        fix = f"serve it with top-k logprobs on (vLLM: --max-logprobs >= {self.topk}) or set draft.data.topk_logits=0"
        if not top or len(top) != len(ids) or any(not entry for entry in top):
            raise EndpointError(f"{where} offers no top-{self.topk} log-probs, which token-level KD needs "
                                f"(draft.data.topk_logits={self.topk}); {fix}")
        if not all(t.startswith(ID_PREFIX) for t in tokens) or not all(k.startswith(ID_PREFIX) for e in top for k in e):
            raise EndpointError(f"{where} spells its log-prob tokens as text, not ids (it ignores return_tokens_as_token_ids), "
                                "so they cannot be stored as the target's top-k")
        fewest = min(len(entry) for entry in top)
        if fewest < self.topk:
            raise EndpointError(f"{where} offers top-{fewest} log-probs, token-level KD needs top-{self.topk}; {fix}")

    def topk_tensors(self, prompts: list[list[int]], sequences: list[list[int]], example_ids: list[int]) -> dict[str, torch.Tensor]:
        """The endpoint's top-k of the last `answers` call as gendata's <id>.topk_ids [T,k] int32 / topk_logprobs
        [T,k] fp32: answer token j's alternatives at row len(prompt) + j - 1, the data's next token elsewhere."""
        k, tensors = self.topk, {}
        for prompt, seq, eid in zip(prompts, sequences, example_ids):
            n = len(seq)
            next_ids = torch.tensor(seq[1:] + seq[-1:], dtype=torch.int32)
            topk_ids = torch.stack([(next_ids + c) % len(self.tokenizer) for c in range(k)], dim=1)  # k distinct ids
            topk_logprobs = torch.full((n, k), FILLER_LOGPROB, dtype=torch.float32)
            topk_logprobs[:, 0] = 0.0
            for j, entry in enumerate(self._top.pop(eid)):
                best = sorted(entry.items(), key=lambda item: -item[1])[:k]
                topk_ids[len(prompt) + j - 1] = torch.tensor([int(t[len(ID_PREFIX):]) for t, _ in best], dtype=torch.int32)
                topk_logprobs[len(prompt) + j - 1] = torch.tensor([v for _, v in best], dtype=torch.float32)
            tensors[f"{eid}.topk_ids"], tensors[f"{eid}.topk_logprobs"] = topk_ids, topk_logprobs
        return tensors

    def sampling(self, prompt_len: int, example_id: int) -> dict:
        from draftsmith.drafts.schemas import answer_budget, answer_temperature

        d = self.data
        return {"temperature": answer_temperature(d, example_id), "top_p": d.top_p, "top_k": d.top_k,
                "seed": d.seed + example_id, "max_tokens": answer_budget(d)}

    def answers(self, prompts: list[list[int]], example_ids: list[int]) -> list[tuple[list[int], str]]:
        """All of a shard's answers, or EndpointError (nothing of the shard is kept)."""
        with ThreadPoolExecutor(max_workers=self.cfg.concurrency) as pool:
            futures = [pool.submit(self._one, p, self.sampling(len(p), eid)) for p, eid in zip(prompts, example_ids)]
            results = [f.result() for f in futures]
        if self.topk:
            self._top = {eid: top for eid, (_, _, top) in zip(example_ids, results)}
        self.answer_tokens += sum(len(ids) for ids, _, _ in results)
        return [(ids, reason) for ids, reason, _ in results]

    def manifest_fields(self) -> dict:
        """What the manifest records about the endpoint (its model id, where, how it was asked)."""
        return {"backend": "openai", "endpoint": self.cfg.endpoint, "model_id": self.model_id,
                "concurrency": self.cfg.concurrency, "logprobs": self.num_logprobs,
                "logprobs_offered": self.logprobs_offered,
                "topk_source": "endpoint (answer rows; other rows: the data token)" if self.topk else None}
