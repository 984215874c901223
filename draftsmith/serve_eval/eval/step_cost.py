"""What one speculative round costs in our engine, by component, beside a plain decode step.

The measuring code of ``scripts/bench_spec_round.py`` and of the pipeline's ``cost`` stage (one copy):
timers wrapped around the engine's own methods (draft = proposer.propose + on_accepted + add_feature_batch,
forward = executor.forward, verify = the strategy's _verify or, plain, engine.sample; rest = the step minus
those), decode steps of one request at batch 1 and T = 0 with the policy's fallback off (every step
speculates), interleaved repetitions over the methods, median and spread (max - min) per component.

The cost ratio c of a draft is draft ms per round / (K x plain decode step ms): what one drafted token
costs relative to one target step, measured, not counted in FLOPs (on a CPU at batch 1 per-layer
overheads, not weights, decide it).
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from draftsmith.serve_eval.engine import EngineConfig, LLMEngine, SamplingParams
from draftsmith.serve_eval.engine.model_executor import ModelExecutor
from draftsmith.serve_eval.eval.interleave import interleave

COMPONENTS = ("draft", "forward", "verify", "rest", "step")
ROWS = "rows"   # target rows a step verifies: 1 + the tokens drafted (a round that drafted nothing verifies one row)
PLAIN = "nospec"


@dataclass
class MethodCost:
    """ms per decode step by component: (median, spread over repetitions); c: None for plain decoding."""

    method: str
    ms: dict[str, tuple[float, float]]
    c: float | None


def build_engine(method: str, target: Path, drafts: dict[str, Path], k: int, dtype: str = "bfloat16",
                 kind: str | None = None, tree: dict | None = None, device: str = "cpu", attn_backend: str = "auto",
                 block_size: int = 16, executor: ModelExecutor | None = None) -> LLMEngine:
    """An engine for ``method`` (PLAIN: no speculation); ``kind`` defaults to the method's name. executor: the
    target's weights to run on (one engine's ``executor``), as the eval's engines share one: with a copy each, every
    interleaved turn started on weights the other copies had pushed out of the CPU's cache (a plain step measured
    4.8 ms against 2.9 on one shared copy, the 20-layer embedded target)."""
    from draftsmith.serve_eval.speculative.config import SpecConfig
    from draftsmith.serve_eval.speculative.policy import SpecPolicyConfig

    # No prefix caching: engines on one executor share its KV cache, so one engine's cached prompt blocks would hold
    # what another engine wrote there since.
    cfg = EngineConfig(str(target), dtype=dtype, kv_cache_memory_gb=0.25, device=device, attn_backend=attn_backend,
                       enable_prefix_caching=False,
                       block_size=block_size)
    if method == PLAIN:
        return LLMEngine(cfg, executor=executor)
    kind = kind or method
    spec = SpecConfig(kind, draft_path=None if kind == "ngram" else str(drafts[kind]), num_speculative_tokens=k,
                      policy=SpecPolicyConfig(fallback=False), **(tree or {}))
    return LLMEngine(cfg, speculative=spec, executor=executor)


def build_engines(methods: list[str], build: Callable[[str, ModelExecutor | None], LLMEngine]) -> dict[str, LLMEngine]:
    """One engine per method, all on the first one's target executor (the weights load once and stay warm in the
    cache across interleaved turns). Engines that share an executor share its KV cache too, so they must run one
    at a time, each request finished or aborted before the next engine steps (as every interleaved benchmark does)."""
    engines: dict[str, LLMEngine] = {}
    for method in methods:
        first = next(iter(engines.values()), None)
        engines[method] = build(method, None if first is None else first.executor)
    return engines


class Timers:
    """Accumulated seconds per component, filled by wrappers around the engine's own methods. On a GPU
    each wrapper synchronizes before and after its call, so queued kernels count where they were launched."""

    def __init__(self, sync: Callable[[], None] = lambda: None) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.sync = sync

    def wrap(self, obj, name: str, component: str) -> None:
        inner = getattr(obj, name)

        def timed(*a, **kw):
            self.sync()
            t0 = time.perf_counter()
            try:
                return inner(*a, **kw)
            finally:
                self.sync()
                self.seconds[component] += time.perf_counter() - t0

        setattr(obj, name, timed)


def instrument(engine: LLMEngine) -> Timers:
    timers = Timers(engine.executor.synchronize)
    timers.wrap(engine.executor, "forward", "forward")
    strategy = engine.strategy
    if hasattr(strategy, "proposer"):
        for hook in ("propose", "on_accepted", "add_feature_batch"):
            timers.wrap(strategy.proposer, hook, "draft")
        timers.wrap(strategy, "_verify", "verify")
    else:
        timers.wrap(engine, "sample", "verify")
    return timers


def one_repetition(engine: LLMEngine, timers: Timers, prompt: list[int], steps: int, tag: str,
                   temperature: float = 0.0) -> dict[str, float]:
    """ms per decode step by component over `steps` steps of one request (prefill excluded), greedy or sampled
    at `temperature` (seeded: every repetition draws the same way)."""
    params = SamplingParams(temperature=temperature, max_tokens=steps * 32 + 8, ignore_eos=True,
                            seed=0 if temperature > 0 else None)
    rid = f"{tag}-{time.perf_counter_ns()}"
    engine.add_request(rid, prompt, params)
    engine.step()  # prefill
    engine.step()  # first decode (the proposer's features arrive)
    timers.sync()
    timers.seconds.clear()
    proposed0 = _proposed(engine)
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    timers.sync()
    total = time.perf_counter() - t0
    drafted = _proposed(engine) - proposed0
    engine.abort(rid)
    engine.step()  # let the strategy release the aborted request
    s = timers.seconds
    out = {c: 1000 * s[c] / steps for c in ("draft", "forward", "verify")}
    out["step"] = 1000 * total / steps
    out["rest"] = out["step"] - out["draft"] - out["forward"] - out["verify"]
    out[ROWS] = 1 + drafted / steps
    return out


def _proposed(engine: LLMEngine) -> int:
    """Draft tokens the engine's rounds have proposed so far (0 without speculation)."""
    spec = engine.stats().spec
    return 0 if spec is None else spec.total.num_proposed


def summarize(samples: list[dict[str, float]]) -> dict[str, tuple[float, float]]:
    return {c: (statistics.median(s[c] for s in samples), max(s[c] for s in samples) - min(s[c] for s in samples))
            for c in (*COMPONENTS, ROWS)}


def interleaved(engines: dict[str, LLMEngine], timers: dict[str, Timers], prompt: list[int], steps: int,
                repeats: int, warmup_steps: int = 2,
                temperature: float = 0.0) -> dict[str, dict[str, tuple[float, float]]]:
    """Warm every engine, then `repeats` interleaved rounds over the methods (serve_eval.eval.interleave)."""
    for m, engine in engines.items():
        one_repetition(engine, timers[m], prompt, warmup_steps, "warm", temperature)
    tags = {m: iter(range(repeats)) for m in engines}   # each repetition's requests get fresh ids

    def run(m: str) -> Callable[[], dict[str, float]]:
        return lambda: one_repetition(engines[m], timers[m], prompt, steps, f"{m}{next(tags[m])}", temperature)

    samples = interleave({m: run(m) for m in engines}, repeats)
    return {m: summarize(s) for m, s in samples.items()}


def cost_ratios(rows: dict[str, dict[str, tuple[float, float]]], k: int) -> dict[str, float | None]:
    """c per method: draft ms / (k x plain decode step ms); None without a plain row."""
    plain = rows.get(PLAIN, {}).get("step", (0.0, 0.0))[0]
    return {m: (comps["draft"][0] / (k * plain) if plain else None) for m, comps in rows.items() if m != PLAIN}


def weights_read(model_dir: Path) -> int:
    """Parameters a forward reads per token: all but the input embedding (one row is read), which counts
    only when tied to the output head (no separate lm_head tensor)."""
    from draftsmith.kernels.layers.checkpoint import parameter_counts

    sizes = parameter_counts(model_dir)
    tied = not any("lm_head" in k for k in sizes)
    return sum(n for k, n in sizes.items() if tied or "embed_tokens" not in k)


def measure_costs(target: Path, drafts: dict[str, Path], k: int, steps: int = 8, repeats: int = 3,
                  dtype: str = "float32", prompt_len: int = 64, device: str = "cpu", attn_backend: str = "auto",
                  block_size: int = 16) -> list[MethodCost]:
    """Plain decoding and each draft (kind -> dir) on ``target``: per-component ms and c, one interleaved run,
    on the engine settings given (the pipeline passes its eval's: c is measured where the eval serves)."""
    import torch

    methods = [PLAIN, *drafts]
    engines = build_engines(methods, lambda m, ex: build_engine(m, target, drafts, k, dtype, device=device,
                                                                attn_backend=attn_backend, block_size=block_size,
                                                                executor=ex))
    timers = {m: instrument(e) for m, e in engines.items()}
    vocab = int(engines[PLAIN].executor.vocab_size)
    prompt = [(7 * i + 3) % (vocab - 2) + 1 for i in range(prompt_len)]
    with torch.no_grad():
        rows = interleaved(engines, timers, prompt, steps, repeats)
    ratios = cost_ratios(rows, k)
    return [MethodCost(m, rows[m], ratios.get(m)) for m in methods]
