"""Standalone draft proposer: a small LM of the target's vocabulary with its own paged KV cache.

The draft runs on its own ModelExecutor (a plain HF Llama-family dir) over its own KVCacheManager /
block pool. Per step, for all proposing sequences at once:
- catch-up: the tokens the draft cache lacks (the last step's accepted drafts, the correction / bonus
  token, or the whole prompt on first sight), ending at the root; its last row gives the first draft
  distribution;
- K - 1 batched decode steps, each feeding the previous draft token.
Where the draft's layers are native and every request is greedy or sampled at a plain temperature, the
catch-up and the steps run in one C call (kernels.layers.native_draft_loop; a catch-up of more than
LOOP_CATCH_UP rows, such as a prompt, first runs as a forward of its own); else a forward each.
Draft tokens are drawn from logits_to_probs rows with the request's params and generator (argmax
and point masses for temperature 0; the C loop's rows are softmax(logits / T), returned as the rows its
draws inverted). on_accepted rolls the draft cache back to the accepted prefix.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from draftsmith.kernels.attention import AttentionMetadata
from draftsmith.kernels.layers.native_draft_loop import LOOP_CATCH_UP, LoopSampling
from draftsmith.kernels.sampling import logits_to_probs, sample
from draftsmith.serve_eval.engine.kv_cache_manager import KVCacheManager
from draftsmith.serve_eval.engine.model_executor import ModelExecutor
from draftsmith.serve_eval.engine.threads import ThreadChoice, threads_for
from draftsmith.serve_eval.speculative.proposers.base import (
    Proposal,
    Proposer,
    SequenceView,
    check_num_tokens,
    sampling_arrays,
)
from draftsmith.serve_eval.speculative.proposers.draft_cache import draft_pool_blocks
from draftsmith.serve_eval.speculative.proposers.registry import register_proposer
from draftsmith.serve_eval.speculative.verify import VerifyResult


@dataclass
class _DraftSeq:
    """What the draft KVCacheManager needs of a sequence (it duck-types engine.request.Sequence)."""

    seq_id: int
    token_ids: list[int]  # aliases the engine sequence's list (read only)
    num_computed_tokens: int = 0  # draft cache holds positions [0, this)
    block_hashes: list[int] = field(default_factory=list)
    last_k: int = 0  # drafts proposed last step
    root: int = 0  # root position of the last proposal

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@register_proposer("standalone")
class StandaloneProposer(Proposer):
    needs_hidden = False
    aux_layers = ()
    supports_tree = False

    def __init__(self, executor: ModelExecutor, num_blocks: int | None = None, block_size: int | None = None,
                 seed: int = 0) -> None:
        self.executor = executor
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.kv: KVCacheManager | None = None
        self.generator = torch.Generator().manual_seed(seed)  # draws of unseeded requests
        self._states: dict[str, _DraftSeq] = {}
        self._next_id = 0
        self.threads: ThreadChoice | None = None   # the engine's thread rule, for the catch-up forward (attach)

    @classmethod
    def from_spec_config(cls, config, engine) -> "StandaloneProposer":
        from draftsmith.drafts.io import load_draft
        from draftsmith.drafts.quant import is_quantized
        from draftsmith.kernels.layers.checkpoint import load_config
        from draftsmith.serve_eval.engine.model_executor import resolve_dtype
        from draftsmith.serve_eval.speculative.config import expected_target

        # Raises naming both sides on a vocabulary mismatch; warns on a foreign target fingerprint.
        loaded = load_draft(config.draft_path, expected_target(engine), strict_fingerprint=config.strict_fingerprint)
        if loaded.kind != "standalone":
            raise ValueError(f"{config.draft_path}: method 'standalone' needs a standalone draft, got a {loaded.kind!r} draft")
        dtype = config.draft_dtype or engine.config.dtype
        if is_quantized(loaded.model):  # int8/int4 weights (drafts.quant): run the loaded module as it is
            model = loaded.model.to(device=engine.config.device, dtype=resolve_dtype(dtype, engine.config.device))
            executor = ModelExecutor.from_model(load_config(config.draft_path), model, dtype, engine.config.device,
                                                engine.config.attn_backend)
        else:
            executor = ModelExecutor(config.draft_path, dtype, engine.config.device, engine.config.attn_backend)
        del loaded
        # Draft positions stay below max_model_len (the strategy clamps lookahead to the room left).
        if executor.config.max_position_embeddings < engine.max_model_len:
            raise ValueError(f"{config.draft_path}: draft max_position_embeddings="
                             f"{executor.config.max_position_embeddings} is below the engine's max_model_len "
                             f"{engine.max_model_len}")
        return cls(executor, config.draft_num_blocks, None, engine.config.seed + 1)

    def attach(self, engine) -> None:
        """Size the draft pool like the engine's (draft_cache.draft_pool_blocks): the root and the lookahead are
        the rows a round feeds beyond the context."""
        self.threads = engine.threads
        bs = self.block_size or engine.kv.block_size
        if self.num_blocks is None:
            self.num_blocks = draft_pool_blocks(engine, bs, engine.strategy.max_lookahead_tokens + 1)
        self.allocate(self.num_blocks, bs)

    def allocate(self, num_blocks: int, block_size: int) -> None:
        self.block_size, self.num_blocks = block_size, num_blocks
        self.kv = KVCacheManager(num_blocks, block_size, 0, enable_prefix_caching=False, watermark=0.0)
        self.executor.allocate_kv_cache(num_blocks, block_size)

    # -- state ---------------------------------------------------------------------------
    def _state(self, seq: SequenceView) -> _DraftSeq:
        state = self._states.get(seq.request_id)
        if state is None:
            state = _DraftSeq(self._next_id, seq.token_ids)
            self._next_id += 1
            self._states[seq.request_id] = state
        state.token_ids = seq.token_ids
        return state

    def reset(self, request_id: str) -> None:
        state = self._states.pop(request_id, None)
        if state is not None and self.kv is not None:
            self.kv.free(state)

    def on_accepted(self, request_id: str, result: VerifyResult) -> None:
        """Keep root + the accepted drafts that were fed (the last draft never is)."""
        state = self._states.get(request_id)
        if state is None or state.last_k == 0:
            return
        keep = state.root + 1 + min(result.num_accepted_drafts, state.last_k - 1)
        if state.num_computed_tokens > keep:
            self.kv.rollback(state, state.num_computed_tokens - keep)
        state.last_k = 0

    def _reserve(self, state: _DraftSeq, num_new: int, lookahead: int, keep: set[str]) -> bool:
        """Slots for the step; when the pool is full, drop draft state of requests not proposing now."""
        if self.kv.allocate_slots(state, num_new, lookahead):
            return True
        for request_id in [r for r in self._states if r not in keep]:
            self.reset(request_id)
            if self.kv.allocate_slots(state, num_new, lookahead):
                return True
        return False

    # -- proposing -------------------------------------------------------------------------
    def propose(self, seqs: Sequence[SequenceView], num_tokens: Sequence[int],
                features: Sequence[object] | None = None) -> list[Proposal]:
        check_num_tokens(num_tokens, len(seqs))
        if self.kv is None:
            raise ValueError("StandaloneProposer: draft KV cache not allocated (attach(engine) or allocate())")
        keep = {s.request_id for s in seqs}
        active, states, ks = [], [], []
        for b, (seq, k) in enumerate(zip(seqs, num_tokens)):
            state = self._state(seq)
            root = seq.num_tokens - 1 if hasattr(seq, "num_tokens") else len(seq.token_ids) - 1
            if state.num_computed_tokens > root:  # cannot happen after on_accepted; start over
                self.reset(seq.request_id)
                state = self._state(seq)
            if not self._reserve(state, root + 1 - state.num_computed_tokens, k - 1, keep):
                self.reset(seq.request_id)  # no room even alone: skip speculation this step
                continue
            state.root, state.last_k = root, k
            active.append(b)
            states.append(state)
            ks.append(k)
        drafted: list[list[int]] = [[] for _ in seqs]
        rows: list[list[torch.Tensor]] = [[] for _ in seqs]
        if active:
            self._run(seqs, active, states, ks, drafted, rows)
        proposals = []
        for b, seq in enumerate(seqs):
            tokens = torch.tensor(drafted[b], dtype=torch.int64)
            greedy = seq.params.temperature == 0
            probs = None if greedy or not rows[b] else torch.stack(rows[b])
            proposals.append(Proposal(tokens, probs))
        return proposals

    def _run(self, seqs, active, states, ks, drafted, rows) -> None:
        catch_up = [state.token_ids[state.num_computed_tokens:state.root + 1] for state in states]
        if (max(map(len, catch_up)) <= LOOP_CATCH_UP
                and self._loop_steps(seqs, active, states, catch_up, ks, drafted, rows)):
            return
        ex, bs = self.executor, self.block_size
        dev = ex.device
        # Catch-up forward: tokens the draft cache lacks, up to and including the root.
        ids, positions, qlens, slens, tables = [], [], [], [], []
        for state, fed in zip(states, catch_up):
            ids.extend(fed)
            positions.extend(range(state.num_computed_tokens, state.root + 1))
            qlens.append(len(fed))
            slens.append(state.root + 1)
            tables.append(self.kv.get_block_ids(state))
        last_rows = torch.tensor(qlens).cumsum(0) - 1
        meta = AttentionMetadata.build(qlens, slens, tables, bs, dev)
        with threads_for(self.threads, len(ids)):
            logits = ex.forward(torch.tensor(ids, device=dev), torch.tensor(positions, device=dev), meta,
                                last_rows.to(dev)).logits
        for state in states:
            state.num_computed_tokens = state.root + 1
        picked = self._pick([seqs[b] for b in active], logits, active, drafted, rows)
        if max(ks) > 1 and self._loop_steps(seqs, active, states, [[t] for t in picked], [k - 1 for k in ks],
                                            drafted, rows):
            return
        # K - 1 decode steps over the sequences that want more drafts.
        for step in range(1, max(ks)):
            group = [j for j, k in enumerate(ks) if k > step]
            pos = [states[j].root + step for j in group]
            meta = AttentionMetadata.build([1] * len(group), [p + 1 for p in pos],
                                           [self.kv.get_block_ids(states[j]) for j in group], bs, dev)
            inputs = torch.tensor([picked[j] for j in group], device=dev)
            logits = ex.forward(inputs, torch.tensor(pos, device=dev), meta).logits
            for j in group:
                states[j].num_computed_tokens += 1
            new = self._pick([seqs[active[j]] for j in group], logits, [active[j] for j in group], drafted, rows)
            for j, tok in zip(group, new):
                picked[j] = tok

    def _loop_steps(self, seqs, active, states, first_tokens, num_steps, drafted, rows) -> bool:
        """Feed first_tokens[j] from the draft cache's end and pick num_steps[j] tokens, all in one C call (the
        executor's draft_decode), when every proposing request is greedy or sampled at a plain temperature; False
        where that path does not serve, and nothing was done."""
        sampling = LoopSampling.of([seqs[b].params for b in active], self.executor.vocab_size,
                                   [seqs[b].generator or self.generator for b in active])
        if sampling is None:
            return False
        out = self.executor.draft_decode(first_tokens, [state.num_computed_tokens for state in states], num_steps,
                                         [self.kv.get_block_ids(state) for state in states], sampling)
        if out is None:
            return False
        for b, state, fed, k, new, probs in zip(active, states, first_tokens, num_steps, out.tokens, out.probs):
            state.num_computed_tokens += len(fed) + k - 1
            drafted[b].extend(new)
            if probs is not None:
                rows[b].extend(probs.unbind(0))
        return True

    def _pick(self, seqs, logits, batch_index, drafted, rows) -> list[int]:
        """One draft token per row: argmax for greedy requests, else a draw from logits_to_probs."""
        tokens = logits.argmax(dim=-1).tolist()
        sampled = [j for j, s in enumerate(seqs) if s.params.temperature != 0]
        if sampled:
            sub = [seqs[j] for j in sampled]
            temperature, top_k, top_p = sampling_arrays(sub, logits.device)
            probs = logits_to_probs(logits[torch.tensor(sampled, device=logits.device)], temperature, top_k, top_p)
            draws = sample(probs, [s.generator or self.generator for s in sub]).tolist()
            for j, tok, prob in zip(sampled, draws, probs):
                tokens[j] = tok
                rows[batch_index[j]].append(prob)
        for j, tok in enumerate(tokens):
            drafted[batch_index[j]].append(tok)
        return tokens
