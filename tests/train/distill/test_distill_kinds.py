"""Each draft kind distils from a tiny target: held-out loss drops; offline mode (cached hidden states)
trains like online mode; token-level KD from stored top-k and on-policy batches train; init_from warm-starts."""
import json
import os

import pytest
import torch

from distill_fixtures import make_corpus, make_target, overrides

os.environ.setdefault("DRAFTSMITH_NO_PROGRESS", "1")

FAST = {"draft.data.max_new_tokens": "8", "draft.data.max_prompts": "40", "draft.data.shard_size": "40",
        "draft.data.eval_fraction": "0.2", "++train.max_steps": "6", "++train.batch_size": "8", "++train.lr": "1e-2",
        "++train.eval_every": "2", "++train.eval_batch_size": "8"}
_RUNS: dict = {}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("distill")
    torch.set_num_threads(1)
    return tmp, make_target(tmp / "target"), make_corpus(tmp / "corpus.jsonl")


def distill(world, **extra):
    """Run the distill job in-process; returns (draft dir, eval records of metrics.jsonl)."""
    from draftsmith.train.config import compose
    from draftsmith.train.distill.run import run

    key = tuple(sorted(extra.items()))
    if key in _RUNS:  # the same job twice in one module: reuse it (they are deterministic)
        return _RUNS[key]
    tmp, target, corpus = world
    out = run(compose(overrides(tmp, target, corpus, **{**FAST, **extra})))
    meta = json.loads((out / "draftsmith.json").read_text())
    run_dir = next((tmp / "artifacts" / "targets" / meta["target_fingerprint"] / "distill").glob(out.name))
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    _RUNS[key] = out, [r for r in records if "eval/loss" in r]
    return _RUNS[key]


@pytest.mark.parametrize("kind,extra", [
    ("standalone", {}),
    ("medusa", {}),
    ("eagle", {}),
    ("eagle3", {"draft.draft_vocab_size": "64"}),
    ("eagle3", {"draft.draft_vocab_size": "64", "draft.label_temperature": "0.25"}),
    ("block", {}),
    ("block", {"draft.mode": "offline", "draft.label_temperature": "0.25"}),
    ("block", {"draft.mode": "offline"}),
    ("block", {"draft.mode": "offline", "draft.data.topk_logits": "8", "draft.teacher": "topk"}),
    ("standalone", {"draft.loss": "token_kd", "draft.data.topk_logits": "8", "draft.divergence": "tv"}),
    ("standalone", {"draft.loss": "token_kd", "draft.divergence": "jsd", "draft.on_policy_fraction": "0.5",
                    "draft.on_policy_new_tokens": "4"}),
])
def test_kind_trains_and_held_out_loss_drops(world, kind, extra):
    """A few optimizer steps lower the held-out loss, and the exported dir loads back as that kind."""
    from draftsmith.drafts.io import load_draft

    out, evals = distill(world, draft=kind, **extra)
    assert evals[-1]["eval/loss"] < evals[0]["eval/loss"]
    assert 1.0 <= evals[-1]["eval/simulated_tau"] <= 5.0
    loaded = load_draft(out, world[1])
    assert loaded.kind == kind
    assert loaded.meta.metrics["steps"] == 6


@pytest.mark.parametrize("kind,extra", [("eagle3", {"draft.draft_vocab_size": "64"}), ("block", {"draft.mode": "offline"})])
def test_sharpened_labels_are_what_the_draft_learns(world, kind, extra):
    """label_temperature 0.25: the labels are the target's distribution sharpened toward its argmax, so the
    untrained draft (near uniform over its vocabulary) starts further from them: KL(p || u) = log V - H(p), and
    sharpening lowers H(p)."""
    _, soft = distill(world, draft=kind, **extra)
    _, sharp = distill(world, draft=kind, **extra, **{"draft.label_temperature": "0.25"})
    assert sharp[0]["eval/loss"] > soft[0]["eval/loss"] + 0.1


def test_eagle3_offline_matches_online(world):
    """Offline mode reads cached bf16 features instead of running the target: same training up to rounding."""
    _, online = distill(world, draft="eagle3")
    _, offline = distill(world, draft="eagle3", **{"draft.mode": "offline"})
    assert offline[-1]["eval/loss"] < offline[0]["eval/loss"]
    assert offline[0]["eval/loss"] == pytest.approx(online[0]["eval/loss"], rel=0.02)
    assert offline[-1]["eval/loss"] == pytest.approx(online[-1]["eval/loss"], rel=0.05)


def test_standalone_hidden_teacher_matches_online(world):
    """teacher=hidden (the cached final hidden through the target's head: the full distribution, no target
    forward) trains like the online teacher up to the bf16 rounding of the cache."""
    kd = {"draft.loss": "token_kd", "draft.divergence": "tv"}
    _, online = distill(world, draft="standalone", **kd, **{"draft.teacher": "online"})
    _, cached = distill(world, draft="standalone", **kd, **{"draft.teacher": "hidden"})
    assert cached[-1]["eval/loss"] < cached[0]["eval/loss"]
    assert cached[0]["eval/loss"] == pytest.approx(online[0]["eval/loss"], rel=0.02)
    assert cached[-1]["eval/loss"] == pytest.approx(online[-1]["eval/loss"], rel=0.05)


def test_init_from_warm_starts(world):
    """init_from loads an earlier draft: with a vanishing LR the job starts where that draft ended."""
    source, source_evals = distill(world, draft="eagle")
    _, warm = distill(world, draft="eagle", **{"++train.lr": "1e-9", "++train.max_steps": "1", "draft.init_from": str(source)})
    assert warm[0]["eval/loss"] == pytest.approx(source_evals[-1]["eval/loss"], rel=1e-3)
    assert warm[0]["eval/loss"] < source_evals[0]["eval/loss"]


def test_topk_to_logprobs_keeps_topk_and_normalises():
    """Stored top-k log-probs become a full distribution: top-k entries kept, the rest share the remaining mass."""
    from draftsmith.train.distill.objectives.standalone import topk_to_logprobs

    ids = torch.tensor([[2, 0]])
    logprobs = torch.log(torch.tensor([[0.5, 0.3]]))
    full = topk_to_logprobs(ids, logprobs, vocab_size=6).exp()
    assert torch.allclose(full, torch.tensor([[0.3, 0.05, 0.5, 0.05, 0.05, 0.05]]))
