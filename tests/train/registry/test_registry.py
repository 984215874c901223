"""The draft registry: manifests round-trip, writes are atomic, the lock serialises processes, gone files are named."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from draftsmith.train.registry import cli as registry_cli
from draftsmith.train.registry.cli import main
from draftsmith.train.registry.records import RegisteredTarget
from draftsmith.train.registry.store import Registry, RegistryLockedError

REPO = Path(__file__).resolve().parents[3]


def make_draft(path: Path, kind: str = "eagle3", fingerprint: str = "a" * 16) -> Path:
    """A draft dir as far as the registry reads it: draftsmith.json + config.json (no weights needed)."""
    path.mkdir(parents=True)
    (path / "draftsmith.json").write_text(json.dumps({"kind": kind, "target_fingerprint": fingerprint,
                                                      "data_manifest_hash": "d" * 16}))
    (path / "config.json").write_text(json.dumps({"draftsmith_kind": kind}))
    return path


TARGET = RegisteredTarget("a" * 16, "/targets/old", vocab_size=128, hidden_size=64, num_layers=2, tokenizer_hash="t1")


def wait_for(path: Path, proc: subprocess.Popen) -> None:
    """Block until a helper process has created ``path`` (fails only if the helper died)."""
    while not path.exists():
        if proc.poll() is not None:
            raise AssertionError(f"helper exited early: {proc.stderr.read()}")
        time.sleep(0.02)


def spawn_lock_holder(root: Path, tmp: Path) -> tuple[subprocess.Popen, Path, Path]:
    """A second process that takes the registry lock, says so, and holds it until told to release."""
    locked, release = tmp / "locked", tmp / "release"
    code = textwrap.dedent(f"""
        import time
        from pathlib import Path
        from draftsmith.train.registry.store import Registry
        with Registry({str(root)!r}).locked():
            Path({str(locked)!r}).touch()
            while not Path({str(release)!r}).exists():
                time.sleep(0.02)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stderr=subprocess.PIPE, text=True)
    wait_for(locked, proc)
    return proc, locked, release


def test_add_promote_retire_round_trip(tmp_path):
    """Entries keep their fields across reads; promoting one retires the promoted entry of the same kind only."""
    registry = Registry(tmp_path / "reg")
    first = registry.add(make_draft(tmp_path / "d1"), TARGET, status="promoted")
    medusa = registry.add(make_draft(tmp_path / "m1", kind="medusa"), TARGET, status="promoted")
    second = registry.add(make_draft(tmp_path / "d2"), TARGET, report_path=tmp_path / "r.json")
    assert (first.status, second.status) == ("promoted", "candidate")
    assert second.data_manifest_hash == "d" * 16 and second.trained_fingerprint == "a" * 16
    assert second.report_method == "eagle3"

    registry.promote(second.id)
    fresh = Registry(tmp_path / "reg")  # a new reader sees what was written
    assert {e.id: e.status for e in fresh.entries()} == {first.id: "retired", medusa.id: "promoted",
                                                          second.id: "promoted"}
    assert "superseded" in fresh.get(first.id).note
    assert fresh.read(TARGET.fingerprint).target == TARGET
    registry.retire(second.id)
    assert [e.id for e in fresh.promoted(TARGET.fingerprint)] == [medusa.id]


def test_ids_prefixes_and_bad_input(tmp_path):
    """An unknown or ambiguous id, a non-draft dir and a corrupt manifest are ValueErrors naming the culprit."""
    registry = Registry(tmp_path / "reg")
    entry = registry.add(make_draft(tmp_path / "d1"), TARGET)
    assert registry.get(entry.id[:10]).id == entry.id
    with pytest.raises(ValueError, match="no draft entry with id 'nope'"):
        registry.get("nope")
    registry.add(make_draft(tmp_path / "d2"), TARGET)
    with pytest.raises(ValueError, match="ambiguous"):
        registry.get("eagle3")
    with pytest.raises(ValueError, match="already registered"):
        registry.add(tmp_path / "d1", TARGET)
    (tmp_path / "plain").mkdir()
    with pytest.raises(ValueError, match="not a draft dir"):
        registry.add(tmp_path / "plain", TARGET)
    registry.manifest_path(TARGET.fingerprint).write_text("{half a manif")
    with pytest.raises(ValueError, match="registry.json: not valid JSON"):
        registry.entries()


def test_interrupted_write_leaves_manifest_intact(tmp_path, monkeypatch):
    """A crash between writing the temp file and renaming it leaves the old manifest byte-identical, no temp file."""
    registry = Registry(tmp_path / "reg")
    entry = registry.add(make_draft(tmp_path / "d1"), TARGET)
    path = registry.manifest_path(TARGET.fingerprint)
    before = path.read_bytes()

    def crash(src, dst):
        raise OSError("disk pulled out")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="disk pulled out"):
        registry.promote(entry.id)
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert sorted(p.name for p in path.parent.iterdir()) == ["registry.json"]
    assert Registry(tmp_path / "reg").get(entry.id).status == "candidate"


def test_lock_contention_between_processes(tmp_path, capsys):
    """While another process holds the lock, a short wait fails with a message naming it; afterwards it works."""
    root = tmp_path / "reg"
    registry = Registry(root)
    entry = registry.add(make_draft(tmp_path / "d1"), TARGET)
    proc, _, release = spawn_lock_holder(root, tmp_path)
    try:
        with pytest.raises(RegistryLockedError, match=rf"locked by another draftsmith run \(pid {proc.pid}"):
            Registry(root, lock_timeout_s=0.2).promote(entry.id)
        assert main(["--registry", str(root), "--lock-timeout", "0.2", "promote", entry.id]) == 2
        assert "is locked by another draftsmith run" in capsys.readouterr().err
        assert Registry(root).get(entry.id).status == "candidate"
    finally:
        release.touch()
        proc.wait(timeout=60)
    assert main(["--registry", str(root), "promote", entry.id]) == 0
    assert Registry(root).get(entry.id).status == "promoted"


def test_second_run_waits_for_the_lock(tmp_path):
    """A writer that finds the lock taken waits and then completes once the holder releases it."""
    root = tmp_path / "reg"
    entry = Registry(root).add(make_draft(tmp_path / "d1"), TARGET)
    proc, _, release = spawn_lock_holder(root, tmp_path)
    result: dict = {}
    waiter = threading.Thread(target=lambda: result.setdefault("entry", Registry(root, 120).promote(entry.id)))
    waiter.start()  # the holder has the lock now, so this promote can only finish after the release below
    assert Registry(root).get(entry.id).status == "candidate"
    release.touch()
    waiter.join(timeout=120)
    proc.wait(timeout=60)
    assert result["entry"].status == "promoted"


def test_concurrent_writers_lose_no_update(tmp_path):
    """Two processes adding entries at once: every add lands (read-modify-write happens under the lock)."""
    root = tmp_path / "reg"
    code = textwrap.dedent("""
        import json, sys
        from pathlib import Path
        from draftsmith.train.registry.records import RegisteredTarget
        from draftsmith.train.registry.store import Registry
        root, tag = sys.argv[1], sys.argv[2]
        target = RegisteredTarget("a" * 16, "/targets/old")
        registry = Registry(root)
        for i in range(12):
            d = Path(root).parent / f"{tag}-{i}"
            d.mkdir()
            (d / "draftsmith.json").write_text(json.dumps({"kind": "medusa", "target_fingerprint": None}))
            (d / "config.json").write_text("{}")
            registry.add(d, target)
    """)
    procs = [subprocess.Popen([sys.executable, "-c", code, str(root), tag], cwd=REPO) for tag in ("p", "q")]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    entries = Registry(root).entries()
    assert len(entries) == 24 and len({e.id for e in entries}) == 24
    assert {Path(e.path).name for e in entries} == {f"{t}-{i}" for t in "pq" for i in range(12)}


def test_entry_whose_files_are_gone(tmp_path, capsys):
    """list/show flag an entry whose draft dir vanished, and promote refuses it naming what is gone."""
    root = tmp_path / "reg"
    registry = Registry(root)
    entry = registry.add(make_draft(tmp_path / "d1"), TARGET)
    (tmp_path / "d1" / "config.json").unlink()
    (tmp_path / "d1" / "draftsmith.json").unlink()
    (tmp_path / "d1").rmdir()
    assert registry.get(entry.id).missing_files() == [f"draft dir {tmp_path / 'd1'}"]
    assert main(["--registry", str(root), "list"]) == 0
    out = capsys.readouterr().out
    assert "MISSING" in out and "files are gone" in out
    assert main(["--registry", str(root), "show", entry.id]) == 0
    assert "GONE: draft dir" in capsys.readouterr().out
    assert main([f"registry={root}", "promote", entry.id]) == 2
    assert "cannot promote, its files are gone" in capsys.readouterr().err


def test_cli_add_from_target_dir_and_key_value_root(tmp_path, capsys, monkeypatch):
    """`drafts add` fingerprints the target dir; artifacts_root=... selects the registry like --registry."""
    from safetensors.torch import save_file
    import torch

    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({"vocab_size": 128, "hidden_size": 64, "num_hidden_layers": 2}))
    save_file({"w": torch.zeros(2)}, str(target / "model.safetensors"))
    monkeypatch.delenv("DRAFTSMITH_REGISTRY", raising=False)
    draft = make_draft(tmp_path / "d1")
    assert main([f"artifacts_root={tmp_path / 'art'}", "add", str(draft), "--target-dir", str(target),
                 "--status", "promoted"]) == 0
    assert "registered" in capsys.readouterr().out
    info = RegisteredTarget.from_dir(target)
    [entry] = Registry(tmp_path / "art").promoted(info.fingerprint)
    assert entry.path == str(draft.resolve())
    assert Registry(tmp_path / "art").read(info.fingerprint).target.vocab_size == 128
    assert registry_cli.registry_root({}, None) == Path("artifacts")
