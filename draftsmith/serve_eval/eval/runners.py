"""Runners: run a list of prompts one way (our engine with or without speculation, or transformers'
generate with an assistant) and hand back raw timings and counters. No metric is computed here;
serve_eval.eval.harness turns RunResults into report rows with serve_eval.speculative.metrics.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from draftsmith.serve_eval.speculative.metrics import SpecStats


@dataclass
class RequestRecord:
    """One finished request: its output length and when each output token appeared."""

    num_output_tokens: int
    ttft: float | None                      # seconds from submission to the first token
    # perf_counter() when output arrived: one per token (engine, transformers) or one per streamed
    # chunk (endpoint mode, where a chunk may carry several tokens); first/last bound the decode phase.
    token_times: list[float]
    spec: SpecStats | None = None           # this request's speculative rounds, None without speculation
    output_token_ids: list[int] = field(default_factory=list)  # empty where the runner does not see ids (endpoint)


@dataclass
class RunResult:
    """One pass over a domain's prompts (one repetition)."""

    records: list[RequestRecord]
    wall_s: float                           # submission of the first prompt to the last token
    draft_time_s: float | None = None       # time spent proposing (None = not measured)
    target_time_s: float | None = None      # time spent in target forwards (None = not measured)
    busy_time_s: float | None = None        # engine step time: the denominator of the time shares
    spec_totals: SpecStats | None = None    # run-level counters when there are no per-request ones (endpoint)
    notes: list[str] = field(default_factory=list)
    threads: str | None = None              # the intra-op thread rule the run's engine applied (None: not ours)


@dataclass
class RunSpec:
    temperature: float
    max_tokens: int
    ignore_eos: bool
    seed: int
    batch_size: int
    min_tokens: int = 0


class Runner(Protocol):
    method: str
    K: int

    def run(self, prompts: list[str], spec: RunSpec, domain: str) -> RunResult: ...

    def close(self) -> None: ...


# ----------------------------------------------------------------------------- our engine

def _spec_totals(engine: Any) -> tuple[float, float]:
    """(draft_s, target_s) the speculative strategy has charged so far, (0, 0) when it reports none."""
    spec = engine.stats().spec
    return (spec.total.draft_time_s, spec.total.target_time_s) if spec is not None else (0.0, 0.0)


class EngineRunner:
    """Our LLMEngine; at most `batch_size` requests in flight (1 = pure latency)."""

    def __init__(self, engine: Any, method: str, K: int) -> None:
        self.engine, self.method, self.K = engine, method, K
        self._ids = 0

    def run(self, prompts: list[str], spec: RunSpec, domain: str) -> RunResult:
        from draftsmith.serve_eval.engine.sampling_params import SamplingParams

        eng = self.engine
        pending = deque(enumerate(prompts))
        finals: dict[int, Any] = {}
        id_to_index: dict[str, int] = {}
        step0, fwd0 = eng.step_time_s, eng.forward_time_s
        draft0, target0 = _spec_totals(eng)
        start = time.perf_counter()

        def submit() -> None:
            i, prompt = pending.popleft()
            self._ids += 1
            rid = f"eval-{self.method}-{self._ids}"
            params = SamplingParams(temperature=spec.temperature, max_tokens=spec.max_tokens,
                                    ignore_eos=spec.ignore_eos, min_tokens=spec.min_tokens, seed=spec.seed + i)
            eng.add_request(rid, prompt, params, domain=domain)
            id_to_index[rid] = i

        while pending or len(finals) < len(id_to_index):
            while pending and len(id_to_index) - len(finals) < spec.batch_size:
                submit()
            for out in eng.step():
                if out.finished and out.request_id in id_to_index:
                    finals[id_to_index[out.request_id]] = out
        wall = time.perf_counter() - start
        records = []
        for i in range(len(prompts)):
            out = finals[i]
            m = out.metrics
            records.append(RequestRecord(len(out.output_token_ids), m.ttft, list(m.token_times),
                                         SpecStats().merge(out.spec) if out.spec is not None else None,
                                         list(out.output_token_ids)))
        draft1, target1 = _spec_totals(eng)
        busy = eng.step_time_s - step0
        threads = eng.threads.summary()
        if self.K == 0:   # plain decoding: every forward is the target's
            draft_s, target_s = 0.0, eng.forward_time_s - fwd0
        else:
            draft_s, target_s = draft1 - draft0, target1 - target0
            per_request = SpecStats.merged(r.spec for r in records if r.spec is not None)
            if draft_s == 0 and target_s == 0:   # the strategy charges times per request instead
                draft_s, target_s = per_request.draft_time_s, per_request.target_time_s
            if draft_s == 0 and target_s == 0:
                return RunResult(records, wall, None, None, busy, notes=["no draft/target times reported"],
                                 threads=threads)
        return RunResult(records, wall, draft_s, target_s, busy, threads=threads)

    def close(self) -> None:
        self.engine = None


def _draft_limited_len(target_dir: Path, draft_dir: Path, K: int) -> int | None:
    """A draft trained with fewer positions than the target caps the sequence length (its own
    positions must cover the sequence plus K lookahead tokens); None = no cap needed."""
    import json

    def positions(d: Path) -> int | None:
        try:
            return json.loads((d / "config.json").read_text()).get("max_position_embeddings")
        except (OSError, ValueError):
            return None

    target_len, draft_len = positions(target_dir), positions(draft_dir)
    if target_len is None or draft_len is None or draft_len - K >= target_len:
        return None
    return draft_len - K


def build_engine_runner(target_dir: Path, method: str, K: int, engine_settings: Any, seed: int,
                        spec_method: str | None = None, draft_path: Path | None = None,
                        executor: Any = None, strict_fingerprint: bool | None = None,
                        draft_dtype: str | None = None) -> EngineRunner:
    """An engine for one (method, K). spec_method None = no speculation. The executor (target
    weights) can be shared between engines that run one at a time: each engine's allocate_kv_cache replaces the
    executor's cache, so they share it, and prefix caching must be off (engine_settings: EngineSettings's default).
    draft_dtype: the draft's dtype (None = the target's; bf16 for quantized drafts' int kernels)."""
    from draftsmith.serve_eval.engine.llm_engine import EngineConfig, LLMEngine

    max_model_len = engine_settings.max_model_len
    if max_model_len is None and draft_path is not None:
        max_model_len = _draft_limited_len(Path(target_dir), Path(draft_path), K)
    cfg = EngineConfig(max_model_len=max_model_len, model=str(target_dir), dtype=engine_settings.dtype, device=engine_settings.device,
                       attn_backend=engine_settings.attn_backend, block_size=engine_settings.block_size,
                       kv_cache_memory_gb=engine_settings.kv_cache_memory_gb,
                       max_num_batched_tokens=engine_settings.max_num_batched_tokens,
                       enable_prefix_caching=engine_settings.enable_prefix_caching, seed=seed)
    speculative = None
    if spec_method is not None:
        from draftsmith.serve_eval.speculative.config import SpecConfig
        from draftsmith.serve_eval.speculative.policy import SpecPolicyConfig

        # Fallback off: the eval measures the method at this K, not the server's adaptive policy.
        speculative = SpecConfig(method=spec_method, draft_path=str(draft_path) if draft_path else None,
                                 num_speculative_tokens=K, policy=SpecPolicyConfig(fallback=False),
                                 strict_fingerprint=strict_fingerprint, draft_dtype=draft_dtype)
    return EngineRunner(LLMEngine(cfg, speculative=speculative, executor=executor), method, K)


# ----------------------------------------------------------------------------- transformers

class _TimingStreamer:
    """A transformers streamer that stamps each put(): the first is the prompt, each later one the
    tokens a decoding step (plain) or an assisted round (accepted drafts + 1) emitted."""

    def __init__(self) -> None:
        self.chunks: list[tuple[float, int]] = []
        self._seen_prompt = False

    def put(self, value: Any) -> None:
        now = time.perf_counter()
        if not self._seen_prompt:
            self._seen_prompt = True
            return
        self.chunks.append((now, int(value.numel())))

    def end(self) -> None:
        pass


class HFRunner:
    """transformers' generate on the target, with `assistant_dir` as assistant model (assisted
    generation, constant K, no confidence cut-off) or without it (its own baseline). Batch 1."""

    def __init__(self, target_dir: Path, method: str, K: int, assistant_dir: Path | None = None,
                 dtype: str = "float32", device: str = "cpu") -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.method, self.K, self.device = method, K, device
        torch_dtype = getattr(torch, dtype)
        self.tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
        self.model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch_dtype).to(device).eval()
        self.assistant = None
        if assistant_dir is not None:
            self.assistant = AutoModelForCausalLM.from_pretrained(str(assistant_dir), dtype=torch_dtype).to(device).eval()
            gc = self.assistant.generation_config
            gc.num_assistant_tokens = K
            gc.num_assistant_tokens_schedule = "constant"
            gc.assistant_confidence_threshold = 0.0

    def run(self, prompts: list[str], spec: RunSpec, domain: str) -> RunResult:
        import torch

        records = []
        start = time.perf_counter()
        for i, prompt in enumerate(prompts):
            ids = torch.tensor([self.tokenizer.encode(prompt, add_special_tokens=False)], device=self.device)
            streamer = _TimingStreamer()
            kwargs: dict[str, Any] = dict(max_new_tokens=spec.max_tokens, streamer=streamer,
                                          attention_mask=torch.ones_like(ids),
                                          pad_token_id=self.tokenizer.pad_token_id or self.tokenizer.eos_token_id)
            if spec.ignore_eos or spec.min_tokens:
                kwargs["min_new_tokens"] = spec.max_tokens if spec.ignore_eos else spec.min_tokens
            if spec.temperature > 0:
                kwargs.update(do_sample=True, temperature=spec.temperature, top_k=0, top_p=1.0)
                torch.manual_seed(spec.seed + i)
            else:
                kwargs.update(do_sample=False)
            if self.assistant is not None:
                kwargs["assistant_model"] = self.assistant
            t0 = time.perf_counter()
            with torch.no_grad():
                self.model.generate(ids, **kwargs)
            times = [t for t, n in streamer.chunks for _ in range(n)]
            stats = None
            if self.assistant is not None:
                # transformers does not count acceptances; a round emits accepted + 1 tokens and
                # proposes K (constant schedule), so each streamed chunk is one round.
                stats = SpecStats()
                for _, n in streamer.chunks:
                    stats.record_round(self.K, min(n - 1, self.K))
            records.append(RequestRecord(len(times), times[0] - t0 if times else None, times, stats))
        notes = ["transformers generate; alpha/a_k inferred from tokens per assisted round"] if self.assistant else []
        return RunResult(records, time.perf_counter() - start, None, None, None, notes=notes)

    def close(self) -> None:
        self.model = self.assistant = None
