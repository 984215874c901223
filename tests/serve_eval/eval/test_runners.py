"""The engine runner: what one pass over a domain's prompts records per request."""
from __future__ import annotations

from draftsmith.serve_eval.eval.runners import RunSpec, build_engine_runner
from draftsmith.serve_eval.schemas import EngineSettings
from spec_helpers import make_llama, workload


def test_batched_runs_record_each_request_s_own_rounds_as_batch_1_does(tmp_path):
    """The acceptance-only profile runs 16 prompts at a time: with no batch gate and no fallback in the
    eval, every request's greedy rounds (proposed, accepted, per position) equal its batch-1 rounds, so its
    alpha and a_k do not depend on the batch size."""
    target = make_llama(tmp_path / "target")
    prompts, _ = workload(6, seed=2)
    per_batch = {}
    for batch_size in (1, 4):
        runner = build_engine_runner(target, "ngram", 3, EngineSettings(), seed=0, spec_method="ngram")
        result = runner.run(prompts, RunSpec(0.0, 24, True, 0, batch_size), "code")
        per_batch[batch_size] = [(r.num_output_tokens, r.spec.num_rounds, r.spec.num_proposed, r.spec.num_accepted,
                                  r.spec.accepted_by_position) for r in result.records]
        runner.close()
    assert sum(rounds for _, rounds, *_ in per_batch[1]) > 0
    assert any(accepted for *_, accepted, _ in per_batch[1])
    assert per_batch[4] == per_batch[1]
