"""Schemas of serve_eval's open config groups (`eval`, and the server's `serve` entry).

Listed in train.config.SCHEMA_PROVIDERS; imported at every job start, so no torch here. The eval
schema is also used without Hydra: `draftsmith.serve_eval.eval.settings` merges profiles and `key=value`
overrides onto `EvalConfig` for the retrain hook's `evaluate(...)`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from draftsmith.serve_eval.eval.external_datasets import ExternalDomain


@dataclass
class EngineSettings:
    """The EngineConfig fields an eval run may set (the model comes from the target)."""

    dtype: str = "float32"
    device: str = "cpu"
    attn_backend: str = "auto"
    block_size: int = 16
    kv_cache_memory_gb: float = 0.25
    max_num_batched_tokens: int = 2048
    # Off by default: repetitions re-send the same prompts, and cache hits would flatter TTFT.
    enable_prefix_caching: bool = False
    # None = the target's max positions, lowered to what a draft with fewer positions can follow.
    max_model_len: int | None = None


@dataclass
class EndpointEntry:
    """An OpenAI-compatible server to measure (endpoint mode). `name` is the report's method label;
    name it "no-spec" for the server that runs without speculation (the speed-up baseline)."""

    name: str = "endpoint"
    url: str = "http://127.0.0.1:8000"
    model: str | None = None          # None = the first id of GET /v1/models
    K: int = 0                        # draft tokens per round the server runs (0 = unknown / none)
    api_key_env: str | None = None    # environment variable holding the bearer token
    timeout_s: float = 120.0
    metrics_path: str = "/metrics"    # Prometheus page; absent -> no alpha / a_k, timings still measured
    send_domain: bool = False         # add draftsmith's `domain` request field (per-domain server counters)


@dataclass
class EvalConfig:
    name: str = "default"
    mode: str = "engine"              # engine: run methods in our engine | endpoint: drive `endpoints`
    target: str | None = None         # target model dir; None = target.path, else the latest artifacts target
    prompts: str | None = None        # jsonl of {domain, prompt}; None = the held-out corpus split of the target
    domains: list[str] = field(default_factory=list)   # empty = every domain in the prompts
    max_prompts_per_domain: int = 8
    # Domain -> its own prompt count, in place of max_prompts_per_domain: a domain whose answers are short
    # decodes few tokens per prompt, so it needs more prompts for an interval as tight as the others'.
    max_prompts_per_domain_of: dict[str, int] = field(default_factory=dict)
    # Methods: no-spec (the baseline: without it the rows carry acceptance but no speed-up), ngram, drafts
    # (every draft of this target + `drafts`), assisted (transformers' generate(assistant_model=...) with the
    # standalone draft, plus its "hf" baseline).
    methods: list[str] = field(default_factory=lambda: ["no-spec", "ngram", "drafts", "assisted"])
    drafts: dict[str, str] = field(default_factory=dict)   # method label -> draft dir, in addition to found ones
    discover_drafts: bool = True
    # A draft made for another target: True = skip it, False = run it with a warning, None = drafts.io rule
    # (skip feature drafts - medusa/eagle/eagle3 read hidden states -, warn for standalone).
    strict_fingerprint: bool | None = None
    num_speculative_tokens: list[int] = field(default_factory=lambda: [2, 4])
    # Method label -> its own K list, in place of num_speculative_tokens (e.g. a block draft, whose round is
    # one forward whatever K is, at the larger K it was trained for).
    num_speculative_tokens_of: dict[str, list[int]] = field(default_factory=dict)
    temperatures: list[float] = field(default_factory=lambda: [0.0])
    # Method label -> the temperatures it runs at (a subset of `temperatures`); a method not named runs at
    # every one. A budget knob: drop a method where it is dominated (no-spec runs at each).
    temperatures_of: dict[str, list[float]] = field(default_factory=dict)
    max_tokens: int = 64
    ignore_eos: bool = False
    # No EOS or stop before this many tokens (vLLM's min_tokens, transformers' min_new_tokens): every request
    # is measured over this many decode steps, the answer still the target's own (EOS masked, not run past).
    min_tokens: int = 0
    batch_size: int = 1               # requests in flight at once (1 = latency)
    repetitions: int = 3
    # Wall-clock cap (minutes) on the sweep: a repetition after the first starts only while the time so far plus
    # one more repetition's average stays within it, so every cell keeps the same count; logged when it cuts in.
    max_minutes: float | None = None
    warmup: int = 1                   # unmeasured requests before a method's first cell at each temperature
    seed: int = 0
    engine: EngineSettings = field(default_factory=EngineSettings)
    # recommendations: speculation off where the speed-up's lower bound is below min_speedup (or alpha's below
    # min_alpha, an optional floor: each choice's own measured break-even alpha becomes its fallback bar)
    min_alpha: float = 0.0
    min_speedup: float = 1.0
    plots: bool = True
    wandb: bool = True
    out_dir: str | None = None        # None = <artifacts>/targets/<fingerprint>/reports/<stamp>
    endpoints: list[EndpointEntry] = field(default_factory=list)
    external_domains: list[ExternalDomain] = field(default_factory=list)
    allow_download: bool = False

    def ks_of(self, method: str) -> list[int]:
        """The K values `method` is measured at: its own num_speculative_tokens_of entry, else the common list."""
        return sorted(set(map(int, self.num_speculative_tokens_of.get(method, self.num_speculative_tokens))))

    def temperatures_for(self, method: str) -> list[float]:
        """The temperatures a draft `method` is measured at: its temperatures_of entry, else every one."""
        return [float(t) for t in self.temperatures_of.get(method, self.temperatures)]

    def prompts_of(self, domain: str) -> int:
        """The most held-out prompts `domain` is measured on: its max_prompts_per_domain_of entry, else the common
        max_prompts_per_domain."""
        return int(self.max_prompts_per_domain_of.get(domain, self.max_prompts_per_domain))

    def largest_k(self) -> int:
        """The largest K any method is measured at."""
        return max(int(k) for ks in [self.num_speculative_tokens, *self.num_speculative_tokens_of.values()] for k in ks)


# schema_default too: train.config registers a placeholder under that name, this replaces it.
SCHEMAS: dict[str, Any] = {"eval/schema_eval": EvalConfig, "eval/schema_default": EvalConfig}

# The server's `serve` schema lives with its code (serve_eval.server.run, no torch at import).
from draftsmith.serve_eval.server.run import SCHEMAS as _SERVER_SCHEMAS  # noqa: E402

SCHEMAS.update(_SERVER_SCHEMAS)
