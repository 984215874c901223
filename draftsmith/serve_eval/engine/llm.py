"""LLM: offline batch generation over LLMEngine with a progress bar."""
from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq

from draftsmith.serve_eval.engine.llm_engine import EngineConfig, LLMEngine
from draftsmith.serve_eval.engine.outputs import RequestOutput
from draftsmith.serve_eval.engine.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str, speculative=None, **engine_kwargs) -> None:
        self.engine = LLMEngine(EngineConfig(model=str(model), **engine_kwargs), speculative=speculative)
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: str | list[int] | Seq[str | list[int]],
                 params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """One output per prompt, in prompt order (with SamplingParams.n completions each). A prompt is text or a
        list of token ids."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = params or SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"params: got {len(params)} SamplingParams for {len(prompts)} prompts")
        request_ids = []
        try:
            for prompt, p in zip(prompts, params):
                request_id = f"gen-{next(self._ids)}"
                self.engine.add_request(request_id, prompt, p)
                request_ids.append(request_id)
        except ValueError:
            for request_id in request_ids:   # all-or-nothing: leave the engine as it was
                self.engine.abort(request_id)
            raise
        finals: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm
            bar = tqdm(total=len(request_ids), desc="generate", unit="req")
        pending = set(request_ids)
        while pending and self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished and out.request_id in pending:
                    finals[out.request_id] = out
                    pending.discard(out.request_id)
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        return [finals[r] for r in request_ids]
