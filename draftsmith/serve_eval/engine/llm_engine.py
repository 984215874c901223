"""LLMEngine: add_request / step / abort over the scheduler, KV cache manager and executor.

step() = schedule -> run KV moves (swap-out, copy-on-write, swap-in) -> strategy.execute
(build the flattened batch, forward, sample) -> append tokens, check stops, free finished.
The strategy object is the seam for speculative decoding: a speculative strategy sets
seq.num_lookahead_tokens before scheduling (scheduler reserves 1 + k slots), runs
propose -> verify inside execute, and reports per sequence the emitted tokens and how many
of the reserved slots were rejected; the engine rolls those back.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, NamedTuple

import torch

from draftsmith.kernels.attention import AttentionMetadata
from draftsmith.kernels.native_sampling import sample_rows
from draftsmith.kernels.row_ops import argmax_rows
from draftsmith.kernels.sampling import sample_logits
from draftsmith.serve_eval.engine.config import EngineConfig  # also importable from here, as before
from draftsmith.serve_eval.engine.kv_cache_manager import KVCacheManager, cdiv
from draftsmith.serve_eval.engine.logprobs import MAX_LOGPROBS
from draftsmith.serve_eval.engine.min_tokens import before_min_tokens
from draftsmith.serve_eval.engine.model_executor import ModelExecutor
from draftsmith.serve_eval.engine.outputs import CompletionOutput, EngineStats, RequestMetrics, RequestOutput
from draftsmith.serve_eval.engine.parallel_sampling import SampleGroup, check_n, draw_first_tokens, fork_samples, stream_id
from draftsmith.serve_eval.engine.request import Sequence
from draftsmith.serve_eval.engine.sampling_params import SamplingParams
from draftsmith.serve_eval.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
# StepResult / StepStrategy / DefaultStrategy live in step_strategy; importable from here as before.
from draftsmith.serve_eval.engine.step_strategy import DefaultStrategy, StepResult, StepStrategy  # noqa: F401
from draftsmith.serve_eval.engine.threads import ThreadChoice, apply_threads, choose_threads, estimate_num_params, set_threads

if TYPE_CHECKING:   # the speculative package builds on the engine; the engine only names its types
    from draftsmith.serve_eval.speculative.config import SpecConfig


class BatchInputs(NamedTuple):
    input_ids: torch.Tensor        # int64 [T]
    positions: torch.Tensor        # int64 [T]
    meta: AttentionMetadata
    query_lens: list[int]          # new tokens per sequence (scheduled + extra)


class LLMEngine:
    def __init__(self, config: EngineConfig, speculative: "SpecConfig | None" = None,
                 strategy: StepStrategy | None = None,
                 executor: ModelExecutor | None = None) -> None:
        self.config = config
        self.executor = executor or ModelExecutor(config.model, config.dtype, config.device, config.attn_backend)
        self.tokenizer = self._load_tokenizer(config.model)
        model_cfg = self.executor.config
        self.threads: ThreadChoice = choose_threads(config.num_threads, estimate_num_params(model_cfg), config.device,
                                                    native_rows=self.executor.native_rows)
        apply_threads(self.threads)
        self.max_model_len = config.max_model_len or int(model_cfg.max_position_embeddings)
        if self.max_model_len > model_cfg.max_position_embeddings:
            raise ValueError(f"max_model_len {self.max_model_len} exceeds the model's "
                             f"max_position_embeddings {model_cfg.max_position_embeddings}")
        if strategy is None and speculative is not None:
            # The speculative package supplies the strategy; the engine only knows the protocol.
            strategy = speculative.make_strategy(self)
        self.strategy: StepStrategy = strategy or DefaultStrategy()
        num_blocks = self._num_gpu_blocks()
        self.kv = KVCacheManager(num_blocks, config.block_size, config.num_cpu_blocks,
                                 config.enable_prefix_caching, config.free_block_watermark)
        self.executor.allocate_kv_cache(num_blocks, config.block_size, config.num_cpu_blocks)
        self.scheduler = Scheduler(SchedulerConfig(config.max_num_batched_tokens, config.max_num_seqs,
                                                   config.prefill_chunk_size, config.swap_threshold_tokens), self.kv)
        self.eos_token_ids = self._eos_ids(model_cfg)
        self.generator = torch.Generator().manual_seed(config.seed)   # for unseeded requests
        self.requests: dict[str, Sequence] = {}   # every live sequence by its stream id (parallel_sampling)
        self.sample_groups: dict[str, SampleGroup] = {}   # n > 1 requests by request id
        self.num_steps = 0
        self.forward_time_s = 0.0     # inside executor.forward
        self.step_time_s = 0.0        # whole step() calls

    # -- setup -------------------------------------------------------------------------
    @property
    def num_threads(self) -> int:
        """Intra-op threads of this engine's small steps (EngineConfig.num_threads), set at construction;
        `threads.for_step` gives a step's count (a small model's large steps use every core)."""
        return self.threads.count

    @staticmethod
    def _load_tokenizer(model_dir: str):
        try:
            from transformers import AutoTokenizer
            return AutoTokenizer.from_pretrained(model_dir)
        except Exception:   # token-id-only checkpoints (tests, benchmarks) have no tokenizer
            return None

    def _eos_ids(self, model_cfg) -> frozenset[int]:
        ids = getattr(model_cfg, "eos_token_id", None)
        ids = set(ids if isinstance(ids, (list, tuple)) else [ids] if ids is not None else [])
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return frozenset(ids)

    def _num_gpu_blocks(self) -> int:
        cfg = self.config
        bytes_per_block = self.executor.kv_bytes_per_block(cfg.block_size)
        need = cdiv(self.max_model_len + self.strategy.max_lookahead_tokens, cfg.block_size)
        if cfg.num_gpu_blocks is not None:
            num, field = cfg.num_gpu_blocks, f"num_gpu_blocks={cfg.num_gpu_blocks}"
        else:
            num = int(cfg.kv_cache_memory_gb * 1024**3) // bytes_per_block
            field = f"kv_cache_memory_gb={cfg.kv_cache_memory_gb} ({num} blocks)"
        if num < need:
            raise ValueError(
                f"{field} cannot hold one max-length sequence of {self.max_model_len} tokens: it needs "
                f"{need} blocks of {cfg.block_size} tokens = {need * bytes_per_block} bytes "
                f"({need * bytes_per_block / 1024**2:.3f} MiB at {bytes_per_block} bytes per block)")
        return num

    # -- requests ----------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    priority: int = 0, domain: str | None = None) -> None:
        """Validate and queue; any ValueError leaves the engine untouched."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        self._check_request_id(request_id, params.n)
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ValueError(f"priority must be an int, got {priority!r}")
        check_n(params, self.config.max_samples_per_request, self.config.max_num_seqs)
        if params.logprobs is not None and params.logprobs > MAX_LOGPROBS:
            raise ValueError(f"logprobs={params.logprobs}: at most {MAX_LOGPROBS} top alternatives per token")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop: stop strings need a tokenizer and the model dir has none")
        prompt_ids = self._tokenize(prompt)
        if len(prompt_ids) > self.max_model_len:
            raise ValueError(f"prompt has {len(prompt_ids)} tokens, more than the model's max length "
                             f"{self.max_model_len}")
        if len(prompt_ids) + params.max_tokens > self.max_model_len:
            raise ValueError(f"max_tokens={params.max_tokens} plus the {len(prompt_ids)}-token prompt exceeds "
                             f"the model's max length {self.max_model_len}")
        if params.n == 1:
            seq = Sequence(request_id, prompt_ids, params, priority, domain)
        else:
            group = SampleGroup(request_id, params)
            seq = group.new_parent(prompt_ids, priority, domain)
            self.sample_groups[request_id] = group
        self.requests[seq.request_id] = seq
        self.scheduler.add(seq)

    def _check_request_id(self, request_id: str, n: int) -> None:
        """Neither the id nor any of its samples' stream ids may clash with a live request's."""
        taken = set(self.requests) | set(self.sample_groups)
        taken.update(g.stream_id(i) for g in self.sample_groups.values() for i in range(g.n))
        mine = {request_id} if n == 1 else {request_id, *(stream_id(request_id, i) for i in range(n))}
        if mine & taken:
            raise ValueError(f"request_id {request_id!r} is already in use")

    def _tokenize(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt: text prompts need a tokenizer; pass token ids")
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)):
            ids = list(prompt)
            vocab = self.executor.vocab_size
            if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in ids):
                raise ValueError(f"prompt: token ids must be ints in [0, {vocab})")
        else:
            raise ValueError(f"prompt must be a str or a list of token ids, got {type(prompt).__name__}")
        if not ids:
            raise ValueError("prompt must not be empty")
        return ids

    def abort(self, request_id: str) -> None:
        """Abort a request, every sample of an n > 1 one; unknown or finished ids are ignored."""
        group = self.sample_groups.pop(request_id, None)
        if group is not None:
            seqs = group.samples
        else:
            seq = self.requests.get(request_id)
            seqs = [seq] if seq is not None and seq.group is None else []   # not a sample's stream id
        now = time.perf_counter()
        for seq in seqs:
            self.requests.pop(seq.request_id, None)
            if not seq.is_finished:
                self.scheduler.abort(seq)
                seq.finished_time = now

    def abort_all(self) -> list[str]:
        """Abort every request the engine holds (after a failed step); returns their ids."""
        request_ids = [rid for rid, seq in self.requests.items() if seq.group is None] + list(self.sample_groups)
        for request_id in request_ids:
            self.abort(request_id)
        return request_ids

    def check_integrity(self) -> None:
        """Raise if the KV cache's bookkeeping is inconsistent (the supervisor's test of whether
        the engine survived a failed step and may keep serving)."""
        self.kv.check_integrity()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the step --------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        t_start = time.perf_counter()
        self.strategy.before_schedule(self)
        out = self.scheduler.schedule()
        ex = self.executor
        if out.blocks_to_swap_out:
            ex.swap_out(out.blocks_to_swap_out)
        if out.blocks_to_copy:
            ex.copy_blocks(out.blocks_to_copy)
        if out.blocks_to_swap_in:
            ex.swap_in(out.blocks_to_swap_in)
        if out.is_empty:
            return []
        # Draft slots count: a batch of 16 chains of K=4 verifies 80 rows.
        set_threads(self.threads.for_step(sum(out.num_scheduled_tokens) + sum(out.num_lookahead_tokens)))
        result = self.strategy.execute(self, out)
        outputs = self._update(out, result)
        self.strategy.after_step(self, out, outputs)   # e.g. release finished requests' draft state
        self.num_steps += 1
        self.step_time_s += time.perf_counter() - t_start
        return outputs

    def prepare_batch(self, out: SchedulerOutput, extra_tokens: list[list[int]] | None = None) -> BatchInputs:
        """Flatten the scheduled chunks (+ optional draft tokens in the lookahead slots) into one
        batch (AttentionMetadata.for_chunks)."""
        bs = self.kv.block_size
        ids: list[int] = []
        query_lens, starts, tables = [], [], []
        for i, (seq, n) in enumerate(zip(out.seqs, out.num_scheduled_tokens)):
            start = seq.num_computed_tokens
            ids.extend(seq.token_ids[start:start + n])
            q = n
            if extra_tokens is not None and extra_tokens[i]:
                ids.extend(extra_tokens[i])
                q += len(extra_tokens[i])
            query_lens.append(q)
            starts.append(start)
            tables.append(self.kv.get_block_ids(seq))
        dev = self.executor.device
        meta, positions = AttentionMetadata.for_chunks(query_lens, starts, tables, bs, dev)
        return BatchInputs(torch.tensor(ids, dtype=torch.int64, device=dev), positions, meta, query_lens)

    def run_forward(self, batch: BatchInputs, logits_rows: list[int], aux_hidden_layers: tuple[int, ...] = ()):
        """executor.forward over a prepared batch, timed (the scheduler-overhead figure needs it).
        logits_rows: flat token rows whose logits are wanted."""
        start = time.perf_counter()
        rows = torch.tensor(logits_rows, dtype=torch.long, device=self.executor.device)
        out = self.executor.forward(batch.input_ids, batch.positions, batch.meta, rows, aux_hidden_layers)
        self.forward_time_s += time.perf_counter() - start
        return out

    def sample(self, seqs: list[Sequence], logits: torch.Tensor) -> list[int]:
        """logits [N, V] fp32, one row per seq -> one token per seq (kernels.sampling)."""
        for i, seq in enumerate(seqs):   # an n > 1 request's other samples draw from this same row
            if seq.group is not None and seq.group.awaits_first_draw(seq):
                seq.group.first_draw = draw_first_tokens(seq.group, logits[i], self.generator)
        rows = [i for i, s in enumerate(seqs) if s.params.temperature != 0]
        # Greedy rows take the argmax directly (the same rule as logits_to_probs' temperature-0 rows), without
        # the sort, softmax and draw that only the sampled rows need; sampled rows skip the argmax.
        if not rows:
            return argmax_rows(logits).tolist()
        tokens = [0] * len(seqs)
        if len(rows) < len(seqs):
            greedy = [i for i, s in enumerate(seqs) if s.params.temperature == 0]
            picked = argmax_rows(logits.index_select(0, torch.tensor(greedy, device=logits.device)))
            for i, tok in zip(greedy, picked.tolist()):
                tokens[i] = tok
        sampled = [seqs[i] for i in rows]
        sub = logits if len(rows) == len(seqs) else logits.index_select(0, torch.tensor(rows, device=logits.device))
        if any(s.generator is not None for s in sampled):
            gens = [s.generator or self.generator for s in sampled]
        else:
            gens = self.generator
        drawn = sample_rows(sub, [s.params for s in sampled], gens)   # C for fp32 CPU rows, filtered or not
        if drawn is None:
            drawn = sample_logits(sub, [s.params.temperature for s in sampled], [s.params.top_k for s in sampled],
                                  [s.params.top_p for s in sampled], gens)
        for i, tok in zip(rows, drawn.tolist()):
            tokens[i] = tok
        return tokens

    def _update(self, out: SchedulerOutput, result: StepResult) -> list[RequestOutput]:
        now = time.perf_counter()
        emitted: dict[int, tuple[Sequence, list[int]]] = {}   # seq id -> (seq, its tokens this step)
        records = result.logprobs or [None] * len(out.seqs)
        for seq, n, la, new, rejected, lps in zip(out.seqs, out.num_scheduled_tokens, out.num_lookahead_tokens,
                                                  result.new_token_ids, result.num_rejected_slots, records):
            if seq.is_finished:   # aborted by a strategy callback mid-step
                continue
            seq.num_computed_tokens += n + la
            if rejected:
                self.kv.rollback(seq, rejected)
            tokens: list[int] = []
            for j, tok in enumerate(new):
                seq.append_token(tok, now)
                if lps:
                    seq.logprobs.append(lps[j])
                tokens.append(tok)
                if seq.group is not None and not seq.group.forked:   # before the parent may finish
                    children = fork_samples(seq.group, self.scheduler)
                    self.strategy.on_fork(seq, children)   # drafts keep per-sample state (EAGLE's features)
                    for child in children:
                        self.requests[child.request_id] = child
                        emitted[child.seq_id] = (child, [child.token_ids[-1]])
                        self._check_stop(child, child.token_ids[-1], now)
                if self._check_stop(seq, tok, now):
                    break
            if not seq.is_finished:
                self.kv.cache_full_blocks(seq)
            if tokens:
                emitted[seq.seq_id] = (seq, tokens)
        self.scheduler.drop_finished()
        return self._outputs(emitted.values())

    def _check_stop(self, seq: Sequence, tok: int, now: float) -> bool:
        reason = self._stop_reason(seq, tok)
        if reason is not None:
            self.scheduler.finish(seq, reason)
            seq.finished_time = now
        return reason is not None

    def _stop_reason(self, seq: Sequence, tok: int) -> str | None:
        p = seq.params
        if before_min_tokens(seq):
            return "length" if seq.num_tokens >= self.max_model_len else None
        if (not p.ignore_eos and tok in self.eos_token_ids) or tok in p.stop_token_ids:
            return "stop"
        if p.stop:
            text = self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)
            hits = [i for i in (text.find(s) for s in p.stop) if i >= 0]
            if hits:
                seq.stop_text_len = min(hits)
                return "stop"
        if seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _outputs(self, emitted) -> list[RequestOutput]:
        """One RequestOutput per request that advanced, in batch order; an n > 1 one carries all n
        completions (those that did not advance with no new tokens). Finished requests are forgotten."""
        outputs: dict[str, RequestOutput] = {}
        for seq, tokens in emitted:
            if seq.is_finished:
                self.requests.pop(seq.request_id, None)
            group = seq.group
            if group is None:
                outputs[seq.request_id] = RequestOutput(seq.request_id, seq.prompt_token_ids,
                                                        [self._completion(seq, tokens)], seq.is_finished)
                continue
            if group.request_id not in outputs:
                completions = [self._completion(s, []) for s in group.samples]
                outputs[group.request_id] = RequestOutput(group.request_id, seq.prompt_token_ids, completions,
                                                          group.finished)
            outputs[group.request_id].completions[seq.sample_index].new_token_ids = tokens
        for request_id, output in outputs.items():
            if output.finished:
                self.sample_groups.pop(request_id, None)
        return list(outputs.values())

    def _completion(self, seq: Sequence, new: list[int]) -> CompletionOutput:
        detok = None
        if self.tokenizer is not None:
            tok = self.tokenizer
            detok = lambda ids: tok.decode(ids, skip_special_tokens=True)   # noqa: E731
        metrics = RequestMetrics(seq.arrival_time, seq.first_token_time, seq.token_times, seq.finished_time)
        return CompletionOutput(seq.sample_index, seq.output_token_ids, new, seq.is_finished, seq.finish_reason,
                                metrics, spec=seq.spec_stats,   # set by a speculative strategy
                                logprobs=list(seq.logprobs) if seq.params.logprobs is not None else None,
                                _detokenize=detok, _text_limit=seq.stop_text_len)

    # -- stats ---------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        pool = self.kv.pool
        return EngineStats(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            num_swapped=len(self.scheduler.swapped), kv_blocks_total=pool.num_blocks,
            kv_blocks_used=pool.num_used_blocks, kv_blocks_cached=pool.num_cached_free,
            kv_blocks_free=pool.num_free_blocks - pool.num_cached_free,
            prefix_cache_hit_rate=self.kv.prefix_hit_rate, num_preemptions=self.scheduler.num_preemptions,
            num_swap_preemptions=self.scheduler.num_swap_preemptions, num_steps=self.num_steps,
            spec=self.strategy.stats(), num_threads=self.threads.count)
