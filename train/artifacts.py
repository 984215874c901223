"""The artifacts root: where every cached or produced file lives, and how it is keyed.

Layout (root = ``cfg.artifacts_root``, default ``artifacts/``, gitignored)::

    corpus/<key>/            distill.jsonl eval.jsonl pretrain.txt manifest.json   (key: data config + Python)
    tokenizers/<key>/        HF tokenizer dir                                       (key: corpus hash + vocab)
    target-cache/<key>/      trained embedded target (HF dir)                       (key: target config + corpus hash)
    targets/<fingerprint>/   everything produced *for* one target, by its identity (drafts.identity):
        drafts/ data/ reports/ target.json
    wandb/ hydra/            W&B offline runs, Hydra run dirs

Cache entries are written into a temporary sibling and renamed into place, so an interrupted run
never leaves a half-written entry that a later run would trust.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra.utils import get_original_cwd
from omegaconf import DictConfig, OmegaConf

KEY_CHARS = 16
TARGET_SUBDIRS = ("drafts", "data", "reports")


def stable_hash(obj: Any) -> str:
    """Short sha256 of a JSON-able object in canonical form (sorted keys, no whitespace)."""
    if isinstance(obj, DictConfig):
        obj = OmegaConf.to_container(obj, resolve=True)
    payload = json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str).encode()
    return hashlib.sha256(payload).hexdigest()[:KEY_CHARS]


def hash_files(paths: list[Path]) -> str:
    """Short sha256 over the bytes of several files, in the given order."""
    digest = hashlib.sha256()
    for path in paths:
        digest.update(path.name.encode())
        with path.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()[:KEY_CHARS]


def resolve_root(artifacts_root: str) -> Path:
    """Absolute artifacts root; a relative one is taken from where the user launched the job."""
    root = Path(artifacts_root).expanduser()
    if not root.is_absolute():
        try:
            base = Path(get_original_cwd())  # inside a Hydra app, even if it changed directory
        except ValueError:
            base = Path.cwd()
        root = base / root
    return root


@dataclass(frozen=True)
class Artifacts:
    root: Path

    @classmethod
    def from_config(cls, cfg: DictConfig) -> "Artifacts":
        return cls(resolve_root(cfg.artifacts_root))

    def corpus_dir(self, key: str) -> Path:
        return self.root / "corpus" / key

    def tokenizer_dir(self, key: str) -> Path:
        return self.root / "tokenizers" / key

    def target_cache_dir(self, key: str) -> Path:
        return self.root / "target-cache" / key

    def target_dir(self, fingerprint: str) -> Path:
        """Home of everything produced for the target with this fingerprint (created on demand)."""
        home = self.root / "targets" / fingerprint
        for sub in TARGET_SUBDIRS:
            (home / sub).mkdir(parents=True, exist_ok=True)
        return home

    def drafts_dir(self, fingerprint: str) -> Path:
        return self.target_dir(fingerprint) / "drafts"

    def data_dir(self, fingerprint: str) -> Path:
        return self.target_dir(fingerprint) / "data"

    def reports_dir(self, fingerprint: str) -> Path:
        return self.target_dir(fingerprint) / "reports"

    @property
    def wandb_dir(self) -> Path:
        path = self.root / "wandb"
        path.mkdir(parents=True, exist_ok=True)
        return path


def is_complete(entry: Path) -> bool:
    """A cache entry counts only once ``atomic_dir`` finished writing it."""
    return (entry / ".complete").is_file()


@contextlib.contextmanager
def entry_lock(entry: Path) -> Iterator[None]:
    """Exclusive lock on building one cache entry: a second process asking for the same entry (say,
    two engineers' jobs wanting the embedded target) waits, then finds it complete, instead of
    training it again. Check ``is_complete`` *inside* the lock."""
    import fcntl
    import logging

    entry.parent.mkdir(parents=True, exist_ok=True)
    with open(entry.parent / f".{entry.name}.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logging.getLogger("draftsmith").info("draftsmith waiting_for_lock=%s (another process is building it)", entry)
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@contextlib.contextmanager
def atomic_dir(entry: Path) -> Iterator[Path]:
    """Yield a temporary dir to fill; on success it replaces ``entry`` and is marked complete."""
    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = entry.parent / f".{entry.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        (tmp / ".complete").write_text("")
        shutil.rmtree(entry, ignore_errors=True)
        tmp.rename(entry)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def write_json(path: Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


def read_json(path: Path) -> Any:
    return json.loads(path.read_text())
