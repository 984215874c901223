"""Lineage: a W&B offline run logs target -> data -> draft -> eval; the run files are read back with
wandb's own record schema and the chain, its digests and the registry's refs agree; the registry CLI
prints the chain."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from draftsmith.train.logs import WandbSettings
from draftsmith.train.registry.cli import main
from draftsmith.train.registry.lineage import USES_KEY, NoLineage, WandbLineage, lineage_for, logged_chain
from draftsmith.train.registry.records import ArtifactRef, RegisteredTarget
from draftsmith.train.registry.store import Registry
from draftsmith.train.registry.wandb_runs import logged_artifacts, records, run_files
from test_registry import make_draft

pytest.importorskip("wandb")


@pytest.fixture()
def chain_inputs(tmp_path):
    target_dir = tmp_path / "target"
    target_dir.mkdir()
    (target_dir / "config.json").write_text("{}")
    data_dir = tmp_path / "data" / "hook-1"
    data_dir.mkdir(parents=True)
    (data_dir / "manifest.json").write_text(json.dumps({"key": "k1", "records": 3}))
    draft_dir = make_draft(tmp_path / "drafts" / "eagle-hook-1", kind="eagle", fingerprint="b" * 16)
    (draft_dir / "model.safetensors").write_bytes(b"weights-v1")
    report = tmp_path / "reports" / "hook-1-eagle-candidate" / "report.json"
    report.parent.mkdir(parents=True)
    report.write_text(json.dumps({"results": []}))
    target = RegisteredTarget("b" * 16, str(target_dir), vocab_size=128, hidden_size=64, num_layers=2)
    return target, data_dir, draft_dir, report


def test_offline_run_logs_the_chain_and_reads_it_back(tmp_path, chain_inputs):
    target, data_dir, draft_dir, report = chain_inputs
    wandb_dir = tmp_path / "wandb"
    lineage = WandbLineage(WandbSettings(mode="offline", project="lineage-test"), wandb_dir)
    parent = ArtifactRef("draft-old", "draft", "0" * 32)
    refs = lineage.log_chain(target, data_dir, draft_dir, report, parents=[parent])
    assert [r.type for r in refs] == ["target", "dataset", "draft", "report"]
    target_ref, data_ref, draft_ref, report_ref = refs
    # the edges: data <- target, draft <- data (+ the target it serves, + the warm-start parent), report <- draft
    assert data_ref.uses == (target_ref.key,)
    assert draft_ref.uses == (data_ref.key, target_ref.key, parent.key)
    assert report_ref.uses == (draft_ref.key, target_ref.key)
    assert all(r.id is None and r.run_dir and Path(r.run_dir).is_dir() for r in refs)   # offline: no server id

    logged = logged_artifacts(wandb_dir)
    assert len(run_files(wandb_dir)) == 4 and len(logged) == 4      # one run per link, each artifact once
    assert {a.job_type for a in logged} == {"register_target", "generate", "distill", "eval"}
    chain = logged_chain(wandb_dir, report_ref)
    assert [(a.type, a.name, a.digest) for a in chain] == [(r.type, r.name, r.digest) for r in refs]
    assert [a.metadata[USES_KEY] for a in chain] == [list(r.uses) for r in refs]
    assert chain[0].metadata["fingerprint"] == target.fingerprint
    assert chain[2].metadata["path"] == str(draft_dir.resolve())


def test_a_pipeline_run_logs_every_draft_in_four_runs_and_each_chain_reads_back(tmp_path, chain_inputs):
    """Two drafts of one pipeline run: one run each for target, dataset, the drafts and the report (a
    W&B run start costs seconds), and each draft's chain goes through that draft."""
    target, data_dir, draft_dir, report = chain_inputs
    other = make_draft(tmp_path / "drafts" / "medusa-run-1", kind="medusa", fingerprint=target.fingerprint)
    wandb_dir = tmp_path / "wandb"
    lineage = WandbLineage(WandbSettings(mode="offline", project="lineage-test"), wandb_dir)
    chains = lineage.log_pipeline_run(target, data_dir, {"eagle": draft_dir, "medusa": other}, report)
    assert list(chains) == ["eagle", "medusa"]
    eagle, medusa = chains["eagle"], chains["medusa"]
    assert [r.type for r in eagle] == [r.type for r in medusa] == ["target", "dataset", "draft", "report"]
    assert eagle[:2] == medusa[:2] and eagle[3] == medusa[3]             # shared target, data, report
    assert eagle[2].key != medusa[2].key
    assert all(chain[2].uses == (chain[1].key, chain[0].key) for chain in (eagle, medusa))
    assert eagle[3].uses == (eagle[2].key, medusa[2].key, eagle[0].key)  # the report judges both drafts

    run_dirs = [p for p in wandb_dir.rglob("offline-run-*") if p.is_dir()]
    assert len(run_dirs) == 4 and len(run_files(wandb_dir)) == 4
    assert {r.run_dir for chain in chains.values() for r in chain} == {str(p) for p in run_dirs}
    assert len(logged_artifacts(wandb_dir)) == 5                        # target, data, 2 drafts, report
    for chain, path in ((eagle, draft_dir), (medusa, other)):
        read_back = logged_chain(wandb_dir, chain[-1], along=chain)
        assert [(a.type, a.name, a.digest) for a in read_back] == [(r.type, r.name, r.digest) for r in chain]
        assert read_back[2].metadata["path"] == str(path.resolve())


def test_the_draft_digest_follows_its_files_and_targets_are_logged_once(tmp_path, chain_inputs):
    target, data_dir, draft_dir, report = chain_inputs
    lineage = WandbLineage(WandbSettings(mode="offline", project="lineage-test"), tmp_path / "wandb")
    first = lineage.log_chain(target, data_dir, draft_dir, report)
    (draft_dir / "model.safetensors").write_bytes(b"weights-v2")        # a second recovery round
    second = lineage.log_chain(target, data_dir, draft_dir, report)
    assert first[:2] == second[:2]                                       # target, data: logged once
    assert first[2].digest != second[2].digest                           # the draft's files changed
    assert len(logged_artifacts(tmp_path / "wandb")) == 6


def test_disabled_wandb_logs_nothing(tmp_path, chain_inputs):
    lineage = lineage_for(WandbSettings(mode="disabled"), tmp_path / "wandb")
    assert isinstance(lineage, NoLineage) and lineage.log_chain(*chain_inputs) == []
    target, data_dir, draft_dir, report = chain_inputs
    assert lineage.log_pipeline_run(target, data_dir, {"eagle": draft_dir}, report) == {"eagle": []}
    assert not (tmp_path / "wandb").exists()


def test_a_corrupt_run_file_is_named(tmp_path, chain_inputs):
    wandb_dir = tmp_path / "wandb"
    WandbLineage(WandbSettings(mode="offline", project="lineage-test"), wandb_dir).log_chain(*chain_inputs)
    path = run_files(wandb_dir)[0]
    data = bytearray(path.read_bytes())
    data[20] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=f"{path.name}: corrupt record"):
        list(records(path))
    (tmp_path / "other.wandb").write_bytes(b"not a run")
    with pytest.raises(ValueError, match="other.wandb: not a W&B run file"):
        list(records(tmp_path / "other.wandb"))


def test_registry_keeps_the_refs_and_drafts_show_prints_the_chain(tmp_path, chain_inputs, capsys):
    target, data_dir, draft_dir, report = chain_inputs
    refs = WandbLineage(WandbSettings(mode="offline", project="lineage-test"),
                        tmp_path / "wandb").log_chain(target, data_dir, draft_dir, report)
    registry = Registry(tmp_path / "registry")
    entry = registry.add(draft_dir, target, report_path=report)
    registry.update(entry.id, lineage=refs)
    assert registry.get(entry.id).lineage == refs                       # round-trips through registry.json
    assert main(["--registry", str(registry.root), "show", entry.id]) == 0
    out = capsys.readouterr().out
    assert "target -> dataset -> draft -> report" in out
    for ref in refs:
        assert f"{ref.name}@{ref.digest[:8]}" in out
    assert "offline run" in out and refs[0].run_id in out


def test_a_bad_lineage_entry_is_named(tmp_path, chain_inputs):
    target, _, draft_dir, _ = chain_inputs
    registry = Registry(tmp_path / "registry")
    entry = registry.add(draft_dir, target)
    path = registry.manifest_path(target.fingerprint)
    raw = json.loads(path.read_text())
    raw["entries"][0]["lineage"] = [{"name": "x", "type": "weights", "digest": "d"}]
    path.write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=r"entries\[0\]\.lineage\[0\]: lineage type 'weights'"):
        registry.get(entry.id)
