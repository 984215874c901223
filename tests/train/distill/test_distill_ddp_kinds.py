"""`draftsmith distill draft=<kind> launcher=ddp` really runs 2 gloo ranks for every draft kind, and
`launcher=deepspeed_zero2|deepspeed_zero3|fsdp` run end to end (deepspeed jobs skip when it is not
installed): the CLI relaunches itself under torchrun, each rank trains on its own shard of the data, the
replicas end bitwise equal (sharded launchers: the export gathers the shards), and the exported draft is
those weights and loads.

Every job is a real subprocess started the way a user starts it (`python -m draftsmith.train.cli distill ...`). The
tiny target and its distillation data are built once, in this process; the eight jobs then run at the
same time (each waits on its own torchrun), which keeps the file within its time budget on 2 cores. The
first job prepares target and data itself like a user's would (a cache hit); the others are handed this
process's result the way the launcher hands it to its ranks (DRAFTSMITH_DISTILL_PREPARED), which saves
each a transformers import in its launching process.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from distill_fixtures import (HAS_DEEPSPEED, free_port, job_env, make_corpus, make_target, overrides, start_job,
                              tensor_digest, wait_jobs)

ENV = job_env(DRAFTSMITH_TRACEBACK="1")
STEPS, ACCUM, BATCH = 2, 2, 4  # 2 ranks x 2 steps x 2 micro-batches x 4 = 32 = one epoch of the train split
FAST = {"draft.data.max_new_tokens": "8", "draft.data.max_prompts": "40", "draft.data.shard_size": "40",
        "draft.data.eval_fraction": "0.2", "++train.max_steps": str(STEPS), "++train.batch_size": str(BATCH),
        "++train.gradient_accumulation_steps": str(ACCUM), "++train.eval_batch_size": "8", "++train.log_every": "1"}
JOBS = [("standalone", "ddp"), ("medusa", "ddp"), ("eagle", "ddp"), ("eagle3", "ddp"), ("eagle3", "deepspeed_zero2"),
        ("eagle", "deepspeed_zero3"), ("eagle3", "fsdp"), ("block", "ddp")]
SHARDED = {"deepspeed_zero3", "fsdp"}  # parameters split across ranks: no per-rank digests, export gathers them
DISTRIBUTED_TYPE = {"ddp": "DistributedType.MULTI_CPU", "fsdp": "DistributedType.FSDP"}  # else DEEPSPEED
PREFIX = {"medusa": "heads."}  # how the objective's module names the draft's parameters (else "draft.")




@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Tiny target, corpus and its distillation data; then every job of JOBS, run concurrently."""
    from draftsmith.train.config import compose
    from draftsmith.train.distill.run import PREPARED_ENV, prepare

    torch.set_num_threads(1)
    tmp = tmp_path_factory.mktemp("ddp_kinds")
    target, corpus = make_target(tmp / "target"), make_corpus(tmp / "corpus.jsonl")
    base = overrides(tmp, target, corpus, **FAST)
    prepared = prepare(compose(["draft=standalone", *base]))  # the data every job below reuses (cached)
    jobs = {}
    for index, (kind, launcher) in enumerate(JOBS):
        if launcher.startswith("deepspeed") and not HAS_DEEPSPEED:
            continue
        env = ENV if index == 0 else {**ENV, PREPARED_ENV: json.dumps(prepared.__dict__)}
        command = [sys.executable, "-m", "draftsmith.train.cli", "distill", f"draft={kind}", f"launcher={launcher}",
                   f"launcher.main_process_port={free_port()}", *base]
        log = tmp / f"{kind}-{launcher}.log"
        jobs[kind, launcher] = (start_job(command, log, env), log)
    codes = wait_jobs({key: proc for key, (proc, _) in jobs.items()}, timeout=600)
    results = {key: (codes[key], log.read_text()) for key, (_, log) in jobs.items()}
    return tmp, target, prepared, results


def _job(world, kind: str, launcher: str) -> tuple[Path, Path, str]:
    """(exported draft dir, run dir, log) of a finished job; fails with the job's log tail if it failed."""
    if launcher.startswith("deepspeed") and not HAS_DEEPSPEED:
        pytest.skip("deepspeed is not installed (scripts/setup_venv.sh installs it)")
    returncode, log = world[3][kind, launcher]
    assert returncode == 0, log[-4000:]
    out = Path(next(line for line in log.splitlines() if line.startswith("draft saved at: ")).split(": ", 1)[1])
    run_dir = Path(world[2].data_dir).parent.parent / "distill" / out.name
    return out, run_dir, log


def _finite_outputs(kind: str, model: torch.nn.Module, target_dir: Path) -> torch.Tensor:
    """The draft's logits on a real prompt, fed the target's own features where the kind needs them."""
    from transformers import AutoModelForCausalLM

    input_ids = torch.tensor([[5, 22, 73, 44, 50, 68, 30, 7]])
    with torch.no_grad():
        if kind == "standalone":
            return model.forward_batch(input_ids)
        hidden_states = AutoModelForCausalLM.from_pretrained(str(target_dir)).eval()(
            input_ids, output_hidden_states=True).hidden_states  # HF indexing: 0 = embeddings, -1 = final norm
        if kind == "medusa":
            return model(hidden_states[-1])
        if kind == "eagle":
            return model.forward_batch(input_ids, hidden_states[-1])[1]
        aux = torch.cat([hidden_states[i] for i in model.config.aux_layers], dim=-1)
        if kind == "block":  # two blocks, rooted at positions 1 and 4
            return model.anchor_forward(input_ids, aux, torch.tensor([[1, 4]]))
        return model.forward_batch(input_ids, aux)[1]


@pytest.mark.parametrize("kind,launcher", JOBS)
def test_distill_two_ranks(world, kind, launcher):
    """Both ranks ran in one world of 2 (each wrote its own report, accelerate saw the requested strategy),
    drew disjoint examples that together cover the epoch, and ended with identical trainable weights;
    rank 0 logged the training; the exported draft holds exactly those weights, loads as its kind against
    the target and gives finite logits."""
    from draftsmith.drafts.io import load_draft

    tmp, target, _, _ = world
    out, run_dir, _ = _job(world, kind, launcher)
    reports = [json.loads((run_dir / "ranks" / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    expected_type = DISTRIBUTED_TYPE.get(launcher, "DistributedType.DEEPSPEED")
    assert [(r["rank"], r["world_size"], r["distributed_type"]) for r in reports] == [(0, 2, expected_type), (1, 2, expected_type)]

    seen = [r["example_ids"] for r in reports]
    assert len(seen[0]) == len(seen[1]) == STEPS * ACCUM * BATCH
    assert len(set(seen[0])) == len(seen[0]) and not set(seen[0]) & set(seen[1])
    assert sorted(seen[0] + seen[1]) == list(range(2 * STEPS * ACCUM * BATCH))  # the 32-example train split

    digests = [r["param_sha256"] for r in reports]
    if launcher in SHARDED:
        assert digests == [None, None]  # each rank holds only its shard
    else:
        assert digests[0] and digests[0] == digests[1]
    train_steps = [r["step"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert train_steps == list(range(1, STEPS + 1))

    loaded = load_draft(out, target)
    assert loaded.kind == kind and loaded.meta.metrics["steps"] == STEPS
    prefix = PREFIX.get(kind, "draft.")
    exported = {f"{prefix}{name}": tensor_digest(p) for name, p in loaded.model.state_dict().items()}
    if launcher not in SHARDED:
        assert {name: exported.get(name) for name in digests[0]} == digests[0]
    logits = _finite_outputs(kind, loaded.model.float().eval(), target)
    assert logits.numel() > 0 and torch.isfinite(logits).all()
