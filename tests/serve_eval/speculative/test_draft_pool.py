"""Every draft that keeps a KV pool sizes it by one rule (draft_cache.draft_pool_blocks): an entry per target KV
token, on the device or swapped out (a swapped sequence keeps its draft state), plus each running sequence's round
rows and one partly filled block."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from draftsmith.serve_eval.engine import EngineConfig, LLMEngine
from draftsmith.serve_eval.speculative.config import SpecConfig
from draftsmith.serve_eval.speculative.proposers.draft_cache import draft_pool_blocks
from spec_helpers import feature_draft, make_llama


def test_the_pool_covers_every_target_token_and_each_sequences_round_rows():
    engine = SimpleNamespace(kv=SimpleNamespace(num_gpu_blocks=10, block_size=16),
                             config=SimpleNamespace(num_cpu_blocks=6, max_num_seqs=4))
    # (10 + 6) x 16 = 256 target tokens: 64 blocks of 4 entries; 5 round rows: 2 blocks, + 1 partly filled each
    assert draft_pool_blocks(engine, 4, 5) == 64 + 4 * 3
    assert draft_pool_blocks(engine, 16, 5) == 16 + 4 * 2
    assert draft_pool_blocks(engine, 16, 17) == 16 + 4 * 3


@pytest.mark.parametrize("kind", ["standalone", "eagle", "block"])
def test_each_kind_sizes_its_pool_by_the_rule(tmp_path, kind):
    target = make_llama(tmp_path / "t", layers=4)
    if kind == "standalone":
        draft = make_llama(tmp_path / "d", layers=1, seed=1)
    else:
        draft = feature_draft(kind, target, tmp_path / kind, block_opts={"block_size": 5, "num_layers": 1})
    engine = LLMEngine(EngineConfig(str(target), num_gpu_blocks=40, num_cpu_blocks=24, max_num_seqs=3),
                       speculative=SpecConfig(kind, draft_path=str(draft), num_speculative_tokens=3))
    engine.strategy.before_schedule(engine)   # attaches the proposer
    proposer = engine.strategy.proposer
    if kind == "standalone":
        size, block_size, rows = proposer.num_blocks, proposer.block_size, engine.strategy.max_lookahead_tokens + 1
    else:
        size, block_size = proposer.cache.manager.num_gpu_blocks, proposer.block_size
        rows = engine.strategy.max_lookahead_tokens if kind == "eagle" else proposer.width
    assert size == draft_pool_blocks(engine, block_size, rows)
    assert size * block_size >= (40 + 24) * engine.kv.block_size   # swapped sequences' entries fit too
