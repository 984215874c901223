"""EngineConfig: what one LLMEngine is built with (the model, its KV budget, the scheduler's limits)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineConfig:
    model: str                      # HF checkpoint dir (Llama/Mistral/Qwen2-style)
    dtype: str = "float32"          # "float32" | "bfloat16" | "auto" (model_executor.resolve_dtype)
    block_size: int = 16
    kv_cache_memory_gb: float = 1.0 # budget -> num blocks (num_gpu_blocks overrides when set)
    num_gpu_blocks: int | None = None
    num_cpu_blocks: int = 256       # swap space
    max_num_batched_tokens: int = 2048   # per-step token budget
    max_num_seqs: int = 256
    prefill_chunk_size: int = 512
    enable_prefix_caching: bool = True
    swap_threshold_tokens: int = 512     # preempt by swap at/above this many tokens, else recompute
    free_block_watermark: float = 0.01
    attn_backend: str = "auto"
    seed: int = 0
    max_model_len: int | None = None     # None = the config's max_position_embeddings
    device: str = "cpu"
    num_threads: int | str = "auto"      # intra-op threads: a count, or "auto" (serve_eval.engine.threads)
    max_samples_per_request: int = 64    # largest SamplingParams.n (parallel sampling) add_request takes
