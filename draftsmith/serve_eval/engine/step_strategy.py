"""How one engine step runs, the engine's seam for speculative decoding: the StepStrategy protocol, what a
strategy reports (StepResult), and plain decoding (DefaultStrategy)."""
from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple, Protocol

from draftsmith.serve_eval.engine.logprobs import TokenLogprob, rows_logprobs
from draftsmith.serve_eval.engine.min_tokens import mask_early_stops
from draftsmith.serve_eval.engine.outputs import RequestOutput
from draftsmith.serve_eval.engine.scheduler import SchedulerOutput

if TYPE_CHECKING:   # the speculative package builds on the engine; the engine only names its types
    from draftsmith.serve_eval.engine.llm_engine import LLMEngine
    from draftsmith.serve_eval.engine.request import Sequence
    from draftsmith.serve_eval.speculative.metrics import SpecEngineStats


class StepResult(NamedTuple):
    new_token_ids: list[list[int]]   # per scheduled seq: emitted tokens ([] mid-prefill)
    # Per scheduled seq: how many of its reserved lookahead slots hold no accepted token
    # (lookahead - accepted drafts, unproposed slots included). The engine first counts all
    # n + lookahead slots as computed, then rolls these back (freeing emptied blocks).
    num_rejected_slots: list[int]
    # Per scheduled seq: one record per emitted token (requests with SamplingParams.logprobs); None = nobody asked.
    logprobs: list[list[TokenLogprob]] | None = None


class StepStrategy(Protocol):
    """The engine's seam for how a step runs: plain decoding (DefaultStrategy) or speculative."""
    max_lookahead_tokens: int           # KV slots a sequence may reserve beyond its scheduled tokens

    def before_schedule(self, engine: "LLMEngine") -> None: ...
    def execute(self, engine: "LLMEngine", out: SchedulerOutput) -> StepResult: ...
    def after_step(self, engine: "LLMEngine", out: SchedulerOutput, outputs: list[RequestOutput]) -> None: ...
    def stats(self) -> "SpecEngineStats | None": ...
    def on_fork(self, parent: "Sequence", children: "list[Sequence]") -> None: ...


class DefaultStrategy:
    """Non-speculative decoding: one forward, one sampled token per sequence that finished its prompt."""
    max_lookahead_tokens = 0

    def before_schedule(self, engine: "LLMEngine") -> None:
        pass

    def after_step(self, engine: "LLMEngine", out: SchedulerOutput, outputs: list[RequestOutput]) -> None:
        pass

    def stats(self) -> None:
        return None

    def on_fork(self, parent: "Sequence", children: "list[Sequence]") -> None:
        pass

    def execute(self, engine: "LLMEngine", out: SchedulerOutput) -> StepResult:
        batch = engine.prepare_batch(out)
        # Only sequences whose scheduled chunk reaches their last token produce a token.
        cu = 0
        rows, sampled = [], []
        for i, (seq, n) in enumerate(zip(out.seqs, out.num_scheduled_tokens)):
            cu += batch.query_lens[i]
            if seq.num_computed_tokens + n == seq.num_tokens:
                rows.append(cu - 1)
                sampled.append(i)
        # A step of partial prefill chunks only still runs: it fills the cache.
        logits = engine.run_forward(batch, rows).logits
        mask_early_stops(logits, [(out.seqs[i], r, None) for r, i in enumerate(sampled)], engine.eos_token_ids)
        new_tokens: list[list[int]] = [[] for _ in out.seqs]
        if rows:
            for i, tok in zip(sampled, engine.sample([out.seqs[i] for i in sampled], logits)):
                new_tokens[i] = [tok]
        logprobs = rows_logprobs(out.seqs, logits, {i: [r] for r, i in enumerate(sampled)}, new_tokens)
        return StepResult(new_tokens, [0] * len(out.seqs), logprobs)
