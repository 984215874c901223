"""serve_eval.eval.step_cost (the pipeline's cost stage and scripts/bench_spec_round.py) and
scripts/bench_block_cost.py: components that add up, the device's synchronization around every timed call,
and the block draft's one forward per round whatever K is."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from draftsmith.serve_eval.engine import SamplingParams
from draftsmith.serve_eval.eval.step_cost import PLAIN, Timers, build_engine, build_engines, measure_costs
from spec_helpers import make_llama

REPO = Path(__file__).resolve().parents[3]


def test_timers_synchronize_before_and_after_each_timed_call():
    """A GPU's kernels run asynchronously: the wrapper waits for the queue on entry and on exit, so the time of
    the kernels a call launched is charged to that call."""
    events: list[str] = []

    class Worker:
        def run(self, x: int) -> int:
            events.append("run")
            return x + 1

    worker, timers = Worker(), Timers(sync=lambda: events.append("sync"))
    timers.wrap(worker, "run", "forward")
    assert worker.run(1) == 2 and worker.run(2) == 3
    assert events == ["sync", "run", "sync"] * 2
    assert timers.seconds["forward"] > 0


def test_measure_costs_reports_every_method_with_components_that_add_up(tmp_path):
    target = make_llama(tmp_path / "target", layers=2)
    draft = make_llama(tmp_path / "draft", hidden=32, layers=1, seed=1)
    costs = {c.method: c for c in measure_costs(target, {"standalone": draft}, k=2, steps=3, repeats=1,
                                                prompt_len=8, device="cpu")}
    assert set(costs) == {PLAIN, "standalone"}
    assert costs[PLAIN].c is None and costs[PLAIN].ms["draft"][0] == 0
    spec = costs["standalone"]
    assert spec.ms["draft"][0] > 0 and spec.c == pytest.approx(spec.ms["draft"][0] / (2 * costs[PLAIN].ms["step"][0]))
    for cost in costs.values():
        parts = sum(cost.ms[c][0] for c in ("draft", "forward", "verify", "rest"))
        assert parts == pytest.approx(cost.ms["step"][0])


def test_engines_take_the_settings_the_eval_serves_with(tmp_path):
    """The pipeline's cost stage passes its eval's engine settings: c is measured on that backend and block size."""
    target = make_llama(tmp_path / "target", layers=1)
    draft = make_llama(tmp_path / "draft", hidden=32, layers=1, seed=1)
    for method in (PLAIN, "standalone"):
        engine = build_engine(method, target, {"standalone": draft}, 2, "float32", device="cpu", attn_backend="torch",
                              block_size=8)
        assert (engine.config.block_size, engine.config.attn_backend, engine.config.device) == (8, "torch", "cpu")


def test_interleaved_engines_share_one_target_and_stay_exact(tmp_path):
    """build_engines puts every method on the first engine's target executor (the weights load once, as the eval's
    engines share them); run one at a time, each still decodes exactly the target's greedy tokens."""
    target = make_llama(tmp_path / "target", layers=2)
    draft = make_llama(tmp_path / "draft", hidden=32, layers=1, seed=1)
    engines = build_engines([PLAIN, "standalone"], lambda m, ex: build_engine(
        m, target, {"standalone": draft}, 3, "float32", device="cpu", executor=ex))
    assert engines["standalone"].executor is engines[PLAIN].executor
    assert not any(e.config.enable_prefix_caching for e in engines.values())   # one engine's cached blocks would
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)  # hold what the other wrote there since
    prompts = [[(5 * i + 3 * p) % 60 + 1 for i in range(40)] for p in range(2)]   # 40 tokens: several KV blocks
    outputs: dict[str, list[list[int]]] = {}
    for turn in range(2):   # interleaved turns: each engine's requests finish before the other's start
        for method, engine in engines.items():
            for p, prompt in enumerate(prompts):
                engine.add_request(f"{method}-{turn}-{p}", prompt, params)
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        outputs.setdefault(method, []).append(list(out.output_token_ids))
    assert len(outputs[PLAIN]) == 4 and sorted(outputs["standalone"]) == sorted(outputs[PLAIN])
    assert sorted(outputs[PLAIN][:2]) == sorted(outputs[PLAIN][2:])


def test_bench_block_cost_runs_one_draft_forward_per_round_whatever_k(tmp_path):
    """EAGLE-3 runs K forwards per round; the block draft one, at K=2 and K=4."""
    target = make_llama(tmp_path / "target", layers=6)
    proc = subprocess.run([sys.executable, "scripts/bench_block_cost.py", "--target", str(target), "--ks", "2", "4",
                           "--block-layers", "1", "--rounds", "3", "--warmup", "1", "--prompt-len", "8"],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = {(" ".join(line.split()[:-4]), int(line.split()[-4])): float(line.split()[-1])
            for line in proc.stdout.splitlines() if line.startswith(("eagle3 ", "block "))}
    assert rows == {("eagle3", 1): 1.0, ("eagle3", 2): 2.0, ("eagle3", 4): 4.0,
                    ("block 1-layer", 2): 1.0, ("block 1-layer", 4): 1.0}


def test_bench_spec_round_prints_an_ngram_row_without_a_weight_ratio(tmp_path):
    """ngram reads no draft weights (no ratio printed); every row says how many target rows its steps verified."""
    proc = subprocess.run([sys.executable, "scripts/bench_spec_round.py", "--methods", "nospec,ngram,standalone",
                           "--layers", "2", "--hidden", "64", "--intermediate", "128", "--vocab", "256", "--steps", "4",
                           "--repeats", "1", "--prompt-period", "4", "--prompt-len", "24", "--threads", "1",
                           "--artifacts", str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = {line.split()[0]: line.split() for line in proc.stdout.splitlines()
            if line.split() and line.split()[0] in ("nospec", "ngram", "standalone")}
    assert set(rows) == {"nospec", "ngram", "standalone"}
    assert float(rows["ngram"][1]) > 0 and rows["ngram"][-2] == "-" and rows["standalone"][-2] != "-"
    # the rows column: plain decoding verifies one row a step, a draft at K=4 five, ngram as many as it drafted
    assert float(rows["nospec"][-1]) == 1.0 and float(rows["standalone"][-1]) == 5.0
    assert 1.0 <= float(rows["ngram"][-1]) <= 5.0
