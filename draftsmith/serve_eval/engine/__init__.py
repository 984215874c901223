"""Serving engine: paged KV cache, continuous batching scheduler, model executor, offline LLM API."""
from draftsmith.serve_eval.engine.block_pool import BlockPool
from draftsmith.serve_eval.engine.kv_cache_manager import KVCacheManager
from draftsmith.serve_eval.engine.llm import LLM
from draftsmith.serve_eval.engine.llm_engine import (BatchInputs, DefaultStrategy, EngineConfig, LLMEngine, StepResult,
                                          StepStrategy)
from draftsmith.serve_eval.engine.outputs import CompletionOutput, EngineStats, RequestMetrics, RequestOutput
from draftsmith.serve_eval.engine.request import Sequence, SequenceStatus
from draftsmith.serve_eval.engine.sampling_params import SamplingParams
from draftsmith.serve_eval.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput

__all__ = [
    "BatchInputs", "BlockPool", "CompletionOutput", "DefaultStrategy", "EngineConfig", "EngineStats", "KVCacheManager", "LLM",
    "LLMEngine", "RequestMetrics", "RequestOutput", "SamplingParams", "Scheduler", "SchedulerConfig",
    "SchedulerOutput", "Sequence", "SequenceStatus", "StepResult", "StepStrategy",
]
