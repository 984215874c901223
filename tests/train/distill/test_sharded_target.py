"""Online EAGLE-1, EAGLE-3, Medusa and the standalone draft's on-policy token KD with the frozen target sharded across 2 gloo ranks (FSDP2 `fully_shard`,
`launcher.shard_target`), run really distributed: `python -m draftsmith.train.cli distill ... launcher=fsdp_target` relaunches
itself under torchrun, as a user's job would.

Checked per job: a world of 2, each rank holding about half of the target's weights; disjoint training examples
that together make the epoch; draft replicas bitwise equal after training (DDP draft) and the export equal to
them; a held-out loss that falls. Beside the jobs, the sharded teacher's forward equals the unsharded one on the
same batch (hidden, aux and logits) for tiny random Llama, Qwen3 and Qwen3-MoE targets.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from distill_fixtures import (free_port, job_env, make_corpus, make_target, overrides, start_job, tensor_digest,
                              wait_jobs)
from tiny_models import tiny_model

ENV = job_env(DRAFTSMITH_TRACEBACK="1")
STEPS, BATCH = 4, 4  # 2 ranks x 4 steps x 4 = 32 = one epoch of the train split (40 prompts, 8 held out)
FAST = {"draft.data.max_new_tokens": "8", "draft.data.max_prompts": "40", "draft.data.shard_size": "40",
        "draft.data.eval_fraction": "0.2", "++train.max_steps": str(STEPS), "++train.batch_size": str(BATCH),
        "++train.gradient_accumulation_steps": "1", "++train.eval_batch_size": "8", "++train.log_every": "1",
        "++train.eval_every": "1", "++train.lr": "3e-3"}
# (kind, launcher, extra overrides): a DDP draft beside the sharded target, and one run sharding both
# The standalone draft's online token KD with on-policy batches: every rank must call the sharded target on the
# same steps (rank 0 draws which), or the ranks would hang in the target's weight gather.
ONLINE = ("draft.mode=online",)
JOBS = [("eagle", "fsdp_target", ONLINE), ("eagle3", "fsdp_target", ONLINE), ("medusa", "fsdp_target", ONLINE),
        ("eagle3", "fsdp", (*ONLINE, "launcher.shard_target=true")),
        ("standalone", "fsdp_target", ("draft.loss=token_kd", "draft.teacher=online", "draft.on_policy_fraction=0.5",
                                       "draft.on_policy_new_tokens=4"))]
PREFIX = {"medusa": "heads."}
FAMILIES = ("llama", "qwen3", "qwen3_moe")




def _torchrun(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
            "--module", module, *args]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """The tiny target and its data, then every job of JOBS and one teacher probe per family, all at once."""
    from draftsmith.train.config import compose
    from draftsmith.train.distill.run import PREPARED_ENV, prepare

    torch.set_num_threads(1)
    tmp = tmp_path_factory.mktemp("sharded_target")
    target, corpus = make_target(tmp / "target", train_steps=30), make_corpus(tmp / "corpus.jsonl")
    base = overrides(tmp, target, corpus, **FAST)
    prepared = prepare(compose(["draft=eagle", *base]))
    env = {**ENV, PREPARED_ENV: json.dumps(prepared.__dict__)}
    started = {}
    for kind, launcher, extra in JOBS:
        command = [sys.executable, "-m", "draftsmith.train.cli", "distill", f"draft={kind}", f"launcher={launcher}",
                   f"launcher.main_process_port={free_port()}", *extra, *base]
        started[kind, launcher] = (command, tmp / f"{kind}-{launcher}.log")
    for family in FAMILIES:
        started["probe", family] = (_torchrun("tests.sharded_teacher_probe", "--out", str(tmp / "probe" / family),
                                              "--family", family), tmp / f"probe-{family}.log")
    procs = {key: start_job(command, log, env) for key, (command, log) in started.items()}
    codes = wait_jobs(procs, timeout=900)
    results = {key: (codes[key], started[key][1].read_text()) for key in procs}
    return tmp, target, prepared, results


def _finished(world, key) -> str:
    returncode, log = world[3][key]
    assert returncode == 0, log[-4000:]
    return log


@pytest.mark.parametrize("family", FAMILIES)
def test_sharded_teacher_forward_equals_the_unsharded_one(world, family):
    _finished(world, ("probe", family))
    reports = [json.loads((world[0] / "probe" / family / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [(r["rank"], r["world_size"]) for r in reports] == [(0, 2), (1, 2)]
    assert all(r["max_abs_diff"] <= 1e-6 for r in reports), reports
    assert all(0.4 <= r["local_share"] <= 0.6 for r in reports) and sum(r["local_share"] for r in reports) >= 0.99


@pytest.mark.parametrize("kind,launcher,extra", JOBS)
def test_online_draft_trains_against_a_sharded_target(world, kind, launcher, extra):
    from draftsmith.drafts.io import load_draft

    tmp, target, prepared, _ = world
    log = _finished(world, (kind, launcher))
    out = Path(next(line for line in log.splitlines() if line.startswith("draft saved at: ")).split(": ", 1)[1])
    run_dir = Path(prepared.data_dir).parent.parent / "distill" / out.name
    reports = [json.loads((run_dir / "ranks" / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert [(r["rank"], r["world_size"]) for r in reports] == [(0, 2), (1, 2)]
    shares = [r["target_share"] for r in reports]
    assert all(0.4 <= s <= 0.6 for s in shares) and sum(shares) >= 0.99, shares  # each rank holds ~half the target

    seen = [r["example_ids"] for r in reports]
    assert len(seen[0]) == len(seen[1]) == STEPS * BATCH and not set(seen[0]) & set(seen[1])
    assert sorted(seen[0] + seen[1]) == list(range(2 * STEPS * BATCH))

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    held_out = [r["eval/loss"] for r in records if "eval/loss" in r]
    assert len(held_out) == STEPS and held_out[-1] < held_out[0], held_out

    loaded = load_draft(out, target)
    assert loaded.kind == kind and loaded.meta.metrics["steps"] == STEPS
    if launcher == "fsdp":  # the draft is sharded too: no per-rank digests, the export gathered it
        assert [r["param_sha256"] for r in reports] == [None, None]
        return
    digests = [r["param_sha256"] for r in reports]
    assert digests[0] and digests[0] == digests[1]
    prefix = PREFIX.get(kind, "draft.")
    exported = {f"{prefix}{name}": tensor_digest(p) for name, p in loaded.model.state_dict().items()}
    assert {name: exported.get(name) for name in digests[0]} == digests[0]


def test_bad_input_is_one_line():
    """shard_target on one process, on a target that trains (Medusa-2), or with no process group: one line each."""
    from types import SimpleNamespace

    from draftsmith.train.distill.launch import LauncherConfig
    from draftsmith.train.distill.objectives.teacher import Teacher
    from draftsmith.train.distill.run import frozen_target

    with pytest.raises(ValueError, match="launcher.shard_target: sharding the target needs more than one process"):
        LauncherConfig(shard_target=True).validate()
    launcher = LauncherConfig(strategy="ddp", num_processes=2, shard_target=True)
    with pytest.raises(ValueError, match="draft.medusa2=true"):
        frozen_target(SimpleNamespace(frozen=True), launcher, trains_target=True)
    assert frozen_target(None, launcher, trains_target=False) is None  # offline data: nothing to shard
    tiny = tiny_model("llama", vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1)
    with pytest.raises(ValueError, match="needs a multi-process launch"):
        Teacher(tiny).shard(torch.device("cpu"))
