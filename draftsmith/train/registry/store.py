"""The draft registry: which drafts serve which target, and in what state.

On disk, below a registry root (the artifacts root by default, or any directory a team shares)::

    targets/<fingerprint>/registry.json   one manifest per target fingerprint (drafts.artifacts layout)
    registry.lock                         one flock for the whole registry

With root = artifacts root the manifest sits beside that target's drafts, data and reports. At most
one entry per kind is promoted per target. Every write goes to a temp file, is fsynced and renamed
into place, and happens under the lock, so a reader never sees half a manifest and two concurrent
writers never lose each other's update.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import sys
import time
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from draftsmith.drafts.artifacts import REGISTRY_NAME, Artifacts
from draftsmith.drafts.files import atomic_write_text
from draftsmith.train.registry.records import (DraftEntry, RegisteredTarget, RegistryManifest, STATUSES, utc_now)

MANIFEST_NAME = REGISTRY_NAME
LOCK_NAME = "registry.lock"
DEFAULT_LOCK_TIMEOUT_S = 600.0
_LOCK_POLL_S = 0.05


class RegistryLockedError(RuntimeError):
    """Another process held the registry lock for longer than we were willing to wait."""


class Registry:
    """Manifests below ``root``; mutations take the registry lock (re-entrant for this Registry object)."""

    def __init__(self, root: str | Path, lock_timeout_s: float = DEFAULT_LOCK_TIMEOUT_S):
        self.root = Path(root).expanduser().resolve()
        self.lock_timeout_s = lock_timeout_s
        self._lock_depth = 0
        self._lock_file = None

    # -- locking
    @contextlib.contextmanager
    def locked(self, timeout_s: float | None = None) -> Iterator[None]:
        """Hold the registry's flock; wait up to ``timeout_s`` for another holder, then RegistryLockedError."""
        if self._lock_depth:  # flock on a second fd would block on ourselves
            self._lock_depth += 1
            try:
                yield
            finally:
                self._lock_depth -= 1
            return
        timeout_s = self.lock_timeout_s if timeout_s is None else timeout_s
        self.root.mkdir(parents=True, exist_ok=True)
        lock_path = self.root / LOCK_NAME
        f = open(lock_path, "a+")
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                try:
                    fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except OSError as err:
                    if err.errno not in (errno.EAGAIN, errno.EACCES):
                        raise
                    if time.monotonic() >= deadline:
                        f.seek(0)
                        holder = f.read().strip() or "unknown process"
                        raise RegistryLockedError(
                            f"registry {self.root} is locked by another draftsmith run ({holder}); waited "
                            f"{timeout_s:g} s. Retry when it finishes, or raise the wait (lock_timeout=...)") from None
                    time.sleep(_LOCK_POLL_S)
            f.seek(0)
            f.truncate()
            f.write(f"pid {os.getpid()}, since {utc_now()}, `{' '.join(sys.argv)[:200]}`\n")
            f.flush()
            self._lock_file, self._lock_depth = f, 1
            yield
        finally:
            if self._lock_file is f:
                self._lock_depth, self._lock_file = 0, None
                f.truncate(0)
                fcntl.flock(f.fileno(), fcntl.LOCK_UN)
            f.close()

    # -- manifests
    def manifest_path(self, fingerprint: str) -> Path:
        return Artifacts(self.root).registry_manifest(fingerprint)

    def fingerprints(self) -> list[str]:
        return sorted(Artifacts(self.root).known_fingerprints(MANIFEST_NAME))

    def read(self, fingerprint: str) -> RegistryManifest | None:
        path = self.manifest_path(fingerprint)
        return RegistryManifest.from_file(path) if path.is_file() else None

    def _write(self, manifest: RegistryManifest) -> None:
        path = self.manifest_path(manifest.target.fingerprint)
        atomic_write_text(path, json.dumps(manifest.to_dict(), indent=2, sort_keys=False) + "\n")

    def entries(self, fingerprint: str | None = None) -> list[DraftEntry]:
        fps = [fingerprint] if fingerprint else self.fingerprints()
        manifests = [self.read(fp) for fp in fps]
        return [e for m in manifests if m is not None for e in m.entries]

    def promoted(self, fingerprint: str) -> list[DraftEntry]:
        return [e for e in self.entries(fingerprint) if e.status == "promoted"]

    def get(self, entry_id: str) -> DraftEntry:
        """The entry with this id, or with this unique id prefix."""
        everything = self.entries()
        exact = [e for e in everything if e.id == entry_id]
        matches = exact or [e for e in everything if e.id.startswith(entry_id)]
        if len(matches) == 1:
            return matches[0]
        if not matches:
            raise ValueError(f"registry {self.root}: no draft entry with id {entry_id!r}")
        raise ValueError(f"registry {self.root}: id {entry_id!r} is ambiguous ({', '.join(e.id for e in matches)})")

    # -- mutations
    def add(self, draft_dir: str | Path, target: RegisteredTarget, *, report_path: str | Path | None = None,
            report_method: str | None = None, status: str = "candidate", parent_id: str | None = None,
            note: str = "", extra: dict[str, Any] | None = None) -> DraftEntry:
        """File a draft dir under ``target``; its kind, trained fingerprint and data hash come from draftsmith.json."""
        from draftsmith.drafts.io import read_draft_meta

        if status not in STATUSES:
            raise ValueError(f"status {status!r} is not one of {STATUSES}")
        draft_dir = Path(draft_dir).expanduser().resolve()
        if not draft_dir.is_dir():
            raise ValueError(f"{draft_dir}: draft dir does not exist")
        meta = read_draft_meta(draft_dir)
        with self.locked():
            manifest = self.read(target.fingerprint) or RegistryManifest(target)
            if manifest.target.path is None or target.path is not None:
                manifest.target = target  # keep the freshest description of the target
            taken = {e.id for e in manifest.entries}
            if any(Path(e.path) == draft_dir and e.status != "retired" for e in manifest.entries):
                raise ValueError(f"{draft_dir}: already registered for target {target.fingerprint}")
            stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S")
            entry_id = f"{meta.kind}-{target.fingerprint[:6]}-{stamp}"
            suffix = 1
            while entry_id in taken:  # several adds within one second
                suffix += 1
                entry_id = f"{meta.kind}-{target.fingerprint[:6]}-{stamp}-{suffix}"
            entry = DraftEntry(entry_id, meta.kind, str(draft_dir), target.fingerprint, meta.target_fingerprint,
                               meta.data_manifest_hash, str(report_path) if report_path else None,
                               report_method or (meta.kind if report_path else None),
                               parent_id=parent_id, note=note, extra=dict(extra or {}))
            if meta.metrics.get("wandb_run"):  # the distill job's run: a re-distillation links back to it
                entry.extra.setdefault("wandb_run", meta.metrics["wandb_run"])
            manifest.entries.append(entry)
            self._write(manifest)
            if status != "candidate":  # same lock: no reader sees it as a candidate in between
                return self.promote(entry.id) if status == "promoted" else self.retire(entry.id)
        return entry

    def update(self, entry_id: str, **changes: Any) -> DraftEntry:
        allowed = {"report_path", "report_method", "note", "extra", "lineage"}
        if not changes.keys() <= allowed:
            raise ValueError(f"registry update: only {sorted(allowed)} can change, got {sorted(changes)}")
        return self._mutate(entry_id, lambda manifest, entry: [setattr(entry, k, v) for k, v in changes.items()])

    def promote(self, entry_id: str) -> DraftEntry:
        """Promote; the entry of the same kind promoted before for this target is retired."""
        def apply(manifest: RegistryManifest, entry: DraftEntry) -> None:
            missing = entry.missing_files()
            if any(m.startswith("draft dir") or m.endswith(("config.json", "draftsmith.json")) for m in missing):
                raise ValueError(f"registry entry {entry.id}: cannot promote, its files are gone ({'; '.join(missing)})")
            for other in manifest.entries:
                if other is not entry and other.kind == entry.kind and other.status == "promoted":
                    other.status, other.updated_at = "retired", utc_now()
                    other.note = (other.note + f" superseded by {entry.id}").strip()
            entry.status = "promoted"
        return self._mutate(entry_id, apply)

    def retire(self, entry_id: str) -> DraftEntry:
        return self._mutate(entry_id, lambda manifest, entry: setattr(entry, "status", "retired"))

    def _mutate(self, entry_id: str, apply) -> DraftEntry:
        with self.locked():
            found = self.get(entry_id)  # read under the lock: no one changes it between here and the write
            manifest = self.read(found.target_fingerprint)
            entry = next(e for e in manifest.entries if e.id == found.id)
            apply(manifest, entry)
            entry.updated_at = utc_now()
            self._write(manifest)
            return entry


