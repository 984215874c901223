"""/v1/completions and /v1/chat/completions: request -> engine requests -> response or SSE.

One HTTP request becomes one engine request per prompt, each with the request's n (the engine
prefills the prompt once and forks it into n samples, sample i seeded seed + i); choice
prompt_index * n + i is sample i of prompt prompt_index. All engine requests answer into one
asyncio queue, so a streaming response interleaves choices as the engine produces them.
Whatever ends the HTTP exchange early (client gone, error) aborts every engine request
still running, in a `finally`.
"""
from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, replace
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from draftsmith.serve_eval.server import logprobs_format as LF
from draftsmith.serve_eval.server import protocol as P
from draftsmith.serve_eval.server.engine_loop import Aborted, EngineLoop, Failed, QueueFullError, ShuttingDownError
from draftsmith.serve_eval.server.metrics import ServerMetrics
from draftsmith.serve_eval.server.prompt_checks import PromptChecks

_ENGINE_FIELDS = ("temperature", "top_p", "top_k", "seed", "max_tokens", "min_tokens", "stop_token_ids", "stop",
                  "ignore_eos", "n", "logprobs", "priority", "domain", "prompt")


@dataclass
class _Choice:
    index: int
    prompt_index: int                # which prompt of a batched completion request
    request_id: str                  # its engine request (one per prompt)
    sample: int                      # which of that request's n completions
    num_prompt_tokens: int
    prefix_text: str = ""            # echo: the prompt text, sent before the completion
    stop: tuple[str, ...] = ()       # stop strings: a possible partial match is held back
    sent_text: str = ""              # completion text already sent (streaming)
    output: Any = None               # last engine CompletionOutput of this sample
    finish_reason: str | None = None
    error: str | None = None         # set when a failed engine step ended this choice
    sent_logprobs: int = 0           # streaming: token logprobs already sent
    sent_offset: int = 0             # streaming: text_offset where the next chunk's tokens start
    tokens_as_ids: bool = False      # completions' return_tokens_as_token_ids

    def take_logprobs(self) -> list | None:
        """Token logprob records not sent yet (None when the request asked for none)."""
        records = None if self.output is None else self.output.logprobs
        if records is None:
            return None
        new, self.sent_logprobs = records[self.sent_logprobs:], len(records)
        return new

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def num_output_tokens(self) -> int:
        return 0 if self.output is None else len(self.output.output_token_ids)

    def text(self) -> str:
        return "" if self.output is None else self.output.text

    def take_delta(self) -> str:
        """New text since the last call. A trailing U+FFFD (a UTF-8 character split across
        tokens) is held back until the next token completes it, or the choice ends."""
        text = self.text()
        if not self.done:
            text = text.rstrip("\ufffd")
            # The engine cuts the text where a stop string starts; never send a tail that
            # may turn out to be the beginning of one.
            text = text[:len(text) - _partial_stop_len(text, self.stop)]
        if not text.startswith(self.sent_text):
            return ""   # the engine rewrote earlier text (cannot be un-sent); skip
        delta = text[len(self.sent_text):]
        self.sent_text = text
        return delta


class OpenAIServing:
    def __init__(self, loop: EngineLoop, tokenizer: Any, model_name: str, max_model_len: int,
                 metrics: ServerMetrics, kv_capacity_tokens: int | None = None) -> None:
        self.loop = loop
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.metrics = metrics
        self.prompts = PromptChecks(tokenizer, model_name, max_model_len, kv_capacity_tokens)

    # ---------------------------------------------------------------- endpoints
    async def completions(self, request: Request) -> Response:
        req: P.CompletionRequest = P.parse_request(P.CompletionRequest, await request.body())
        self.prompts.check_model(req.model)
        prompts = self.prompts.completion_prompts(req.prompt)
        logprobs = req.logprobs
        jobs = []
        for p_index, prompt_ids in enumerate(prompts):
            requested = P.DEFAULT_COMPLETION_MAX_TOKENS if req.max_tokens is None else req.max_tokens
            max_tokens = self.prompts.max_tokens(len(prompt_ids), requested, "prompt", "max_tokens")
            prefix = self.tokenizer.decode(prompt_ids) if req.echo else ""
            jobs.append((p_index, prompt_ids, _with_n(req.sampling_params(max_tokens, 0, logprobs), req.n), prefix))
        return await self._serve(request, req, "completion", jobs)

    async def chat(self, request: Request) -> Response:
        req: P.ChatCompletionRequest = P.parse_request(P.ChatCompletionRequest, await request.body())
        self.prompts.check_model(req.model)
        prompt_ids = self.prompts.chat_prompt(req.messages)
        logprobs = req.num_logprobs()
        field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_tokens = self.prompts.max_tokens(len(prompt_ids), req.requested_max_tokens(), "messages", field)
        jobs = [(0, prompt_ids, _with_n(req.sampling_params(max_tokens, 0, logprobs), req.n), "")]
        return await self._serve(request, req, "chat", jobs)

    # ---------------------------------------------------------------- running
    async def _submit(self, base_id: str, req: Any, jobs: list[tuple]) -> tuple[asyncio.Queue, list[_Choice]]:
        queue: asyncio.Queue = asyncio.Queue()
        choices: list[_Choice] = []
        try:
            for prompt_index, prompt_ids, params, prefix in jobs:
                request_id = f"{base_id}-{prompt_index}"
                # Admission is all-or-nothing: only the first engine request checks capacity.
                stream = self.loop.submit(request_id, prompt_ids, params, priority=req.priority,
                                          domain=req.domain, check_capacity=(prompt_index == 0), queue=queue)
                choices.extend(_Choice(prompt_index * params.n + i, prompt_index, request_id, i, len(prompt_ids),
                                       prefix_text=prefix, stop=tuple(params.stop),
                                       tokens_as_ids=bool(getattr(req, "return_tokens_as_token_ids", False)))
                               for i in range(params.n))
                await stream.accepted
        except QueueFullError as exc:
            self._abort(choices)
            self.metrics.requests_rejected.inc(reason="queue_full")
            raise P.ApiError(429, "The server is at capacity; retry later", type="rate_limit_error",
                             code="queue_full", headers={"Retry-After": str(exc.retry_after_s)}) from None
        except ShuttingDownError:
            self._abort(choices)
            raise P.ApiError(503, "The server is shutting down", type="server_error") from None
        except ValueError as exc:   # the engine's own validation, naming the field
            self._abort(choices)
            raise P.ApiError(400, str(exc), P.param_from_value_error(str(exc), _ENGINE_FIELDS)) from None
        except BaseException:
            self._abort(choices)
            raise
        return queue, choices

    def _abort(self, choices: list[_Choice]) -> None:
        for request_id in dict.fromkeys(c.request_id for c in choices if not c.done):
            self.loop.abort(request_id)

    @staticmethod
    def _absorb(item: Any, by_id: dict[str, list[_Choice]]) -> list[_Choice]:
        """Apply one queue item to its request's choices; returns the choices it moved on (new
        tokens or an end), so a finished choice is not touched again by its siblings' outputs."""
        choices = by_id.get(item.request_id, [])
        if isinstance(item, Aborted):
            ended = [c for c in choices if not c.done]
            for choice in ended:
                choice.finish_reason = "error" if isinstance(item, Failed) else "abort"
                if isinstance(item, Failed):
                    choice.error = item.reason
            return ended
        touched = []
        for completion in item.completions if choices else ():
            choice = choices[completion.index]
            if choice.done or not (completion.new_token_ids or completion.finished):
                continue
            choice.output = completion
            if completion.finished:
                choice.finish_reason = completion.finish_reason or "stop"
            touched.append(choice)
        return touched

    async def _serve(self, request: Request, req: Any, kind: str, jobs: list[tuple]) -> Response:
        base_id = P.new_id("chatcmpl" if kind == "chat" else "cmpl")
        queue, choices = await self._submit(base_id, req, jobs)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return _AbortingStreamingResponse(
                lambda: self._abort(choices), self._stream(base_id, kind, queue, choices, include_usage),
                media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        watcher = asyncio.ensure_future(_wait_disconnect(request))
        try:
            by_id = _by_request(choices)
            while not all(c.done for c in choices):
                getter = asyncio.ensure_future(queue.get())
                done, _ = await asyncio.wait({getter, watcher}, return_when=asyncio.FIRST_COMPLETED)
                if getter not in done:
                    getter.cancel()
                    return Response(status_code=499)   # client gone; `finally` aborts its requests
                self._absorb(getter.result(), by_id)
        finally:
            watcher.cancel()
            self._abort(choices)
        failed = next((c for c in choices if c.error is not None), None)
        if failed is not None:
            raise _engine_error(failed.error)
        return JSONResponse(self._final_body(base_id, kind, choices))

    async def _stream(self, base_id: str, kind: str, queue: asyncio.Queue, choices: list[_Choice],
                      include_usage: bool) -> AsyncIterator[str]:
        created = P.now_s()
        by_id = _by_request(choices)
        try:
            if kind == "chat":
                for c in choices:   # OpenAI opens each chat choice with the role
                    yield _sse(self._chunk(base_id, created, kind, c.index, "", None, role=True))
            while not all(c.done for c in choices):
                items = [await queue.get()]
                while not queue.empty():   # coalesce what piled up while we were sending
                    items.append(queue.get_nowait())
                touched: dict[int, _Choice] = {}
                for item in items:
                    for choice in self._absorb(item, by_id):
                        touched[choice.index] = choice
                failed = next((c for c in touched.values() if c.error is not None), None)
                if failed is not None:   # a final error event, as vLLM streams it; then [DONE]
                    yield _sse(_engine_error(failed.error).body())
                    break
                for choice in touched.values():
                    delta = choice.take_delta()
                    if choice.prefix_text:   # echo goes out first, once
                        delta, choice.prefix_text = choice.prefix_text + delta, ""
                    if delta or choice.done:
                        yield _sse(self._chunk(base_id, created, kind, choice.index, delta,
                                               choice.finish_reason, records=choice.take_logprobs(), choice=choice))
            if include_usage and not any(c.error for c in choices):
                usage = self._usage(choices)
                body = {"id": base_id, "object": _chunk_object(kind), "created": created,
                        "model": self.model_name, "choices": [], "usage": usage.model_dump()}
                yield _sse(body)
            yield "data: [DONE]\n\n"
        finally:
            self._abort(choices)

    # ---------------------------------------------------------------- shaping
    def _chunk(self, base_id: str, created: int, kind: str, index: int, delta: str,
               finish_reason: str | None, role: bool = False, records: list | None = None,
               choice: _Choice | None = None) -> dict[str, Any]:
        """One SSE chunk; records: the token logprobs this chunk carries (None = the request asked for none)."""
        lp_chat = None if records is None else LF.chat_logprobs(records, self.tokenizer)
        if kind == "chat":
            d = P.ChatDelta(role="assistant", content="") if role else P.ChatDelta(content=delta or None)
            choice = P.ChatChunkChoice(index=index, delta=d, finish_reason=finish_reason, logprobs=lp_chat)
            return P.ChatCompletionChunk(id=base_id, created=created, model=self.model_name,
                                         choices=[choice]).model_dump(exclude={"usage"})
        lp = None
        if records is not None and choice is not None:
            lp = LF.completion_logprobs(records, self.tokenizer, choice.sent_offset, choice.tokens_as_ids)
            choice.sent_offset = LF.end_offset(records, self.tokenizer, choice.sent_offset)
        choice = P.CompletionChoice(index=index, text=delta, finish_reason=finish_reason, logprobs=lp)
        return P.CompletionChunk(id=base_id, created=created, model=self.model_name,
                                 choices=[choice]).model_dump(exclude={"usage"})

    @staticmethod
    def _usage(choices: list[_Choice]) -> P.UsageInfo:
        # Each distinct prompt counts once, however many choices (n) it produced.
        prompt_tokens = sum({c.prompt_index: c.num_prompt_tokens for c in choices}.values())
        completion_tokens = sum(c.num_output_tokens() for c in choices)
        return P.UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                           total_tokens=prompt_tokens + completion_tokens)

    def _final_body(self, base_id: str, kind: str, choices: list[_Choice]) -> dict[str, Any]:
        created = P.now_s()
        usage = self._usage(choices)
        ordered = sorted(choices, key=lambda c: c.index)
        if kind == "chat":
            return P.ChatCompletionResponse(
                id=base_id, created=created, model=self.model_name, usage=usage,
                choices=[P.ChatChoice(index=c.index, message=P.ChatResponseMessage(content=c.text()),
                                      finish_reason=c.finish_reason,
                                      logprobs=self._records(c, LF.chat_logprobs)) for c in ordered]).model_dump()
        return P.CompletionResponse(
            id=base_id, created=created, model=self.model_name, usage=usage,
            choices=[P.CompletionChoice(index=c.index, text=c.prefix_text + c.text(),
                                        finish_reason=c.finish_reason,
                                        logprobs=self._records(c, lambda r, t, c=c: LF.completion_logprobs(
                                            r, t, 0, c.tokens_as_ids))) for c in ordered]).model_dump()

    def _records(self, choice: _Choice, shape: Any) -> Any:
        """A whole choice's logprobs in one response shape; None when the request asked for none."""
        records = None if choice.output is None else choice.output.logprobs
        return None if records is None else shape(records, self.tokenizer)


class _AbortingStreamingResponse(StreamingResponse):
    """A client may vanish before the body generator even starts (so its `finally` never
    runs); aborting here too covers that case. Aborting is idempotent."""

    def __init__(self, on_close: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def _partial_stop_len(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of some stop string."""
    longest = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:k]):
                longest = k
                break
    return longest


def _with_n(params: Any, n: int) -> Any:
    """One engine request samples all n choices of a prompt (sample i with seed + i, as choice i)."""
    return replace(params, n=n)


def _by_request(choices: list[_Choice]) -> dict[str, list[_Choice]]:
    """Engine request id -> its choices, by sample index."""
    by_id: dict[str, list[_Choice]] = {}
    for choice in choices:
        by_id.setdefault(choice.request_id, []).append(choice)
    return by_id


def _engine_error(reason: str) -> P.ApiError:
    return P.ApiError(500, f"The request failed inside the engine ({reason}); the server keeps "
                      "serving, retry it", type="server_error", code="engine_error")


def _chunk_object(kind: str) -> str:
    return "chat.completion.chunk" if kind == "chat" else "text_completion"


def _sse(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"


async def _wait_disconnect(request: Request) -> None:
    """Returns once the client has gone (the body is already read, so only disconnect remains)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
