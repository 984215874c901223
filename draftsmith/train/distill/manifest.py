"""The integrity manifest of a checkpoint dir: every file's size and sha256, written last.

A checkpoint dir only appears under its final name by a rename, but that does not protect it from
what happens afterwards (a disk that fills while a copy is made, a truncated sync to another host,
bit rot, a user deleting a shard). ``MANIFEST.json`` lists every other file of the dir; it is
written after all of them, atomically (temp file + fsync + rename), so a dir without it is partial
and a dir whose files disagree with it is corrupt. ``verify_manifest`` says which, in words.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

MANIFEST_FILE = "MANIFEST.json"
FORMAT = "draftsmith-checkpoint-manifest/1"
_CHUNK = 1 << 20


@dataclass(frozen=True)
class FileEntry:
    size: int
    sha256: str


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _files(directory: Path) -> list[str]:
    return sorted(
        p.relative_to(directory).as_posix() for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST_FILE
    )


def write_manifest(directory: str | Path) -> Path:
    """Hash every file under `directory` into its MANIFEST.json; call once nothing else will be written."""
    directory = Path(directory)
    entries = {rel: asdict(FileEntry((directory / rel).stat().st_size, _sha256(directory / rel))) for rel in _files(directory)}
    final, tmp = directory / MANIFEST_FILE, directory / f".{MANIFEST_FILE}.tmp"
    with open(tmp, "w") as handle:
        json.dump({"format": FORMAT, "files": entries}, handle, indent=1, sort_keys=True)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, final)
    return final


def _read_entries(directory: Path) -> dict[str, FileEntry] | str:
    """The manifest's entries, or why there are none to trust."""
    path = directory / MANIFEST_FILE
    if not path.is_file():
        return f"no {MANIFEST_FILE} (partial: the save did not finish, or it predates checkpoint manifests)"
    try:
        document = json.loads(path.read_text())
        if document.get("format") != FORMAT:
            return f"{MANIFEST_FILE} has format {document.get('format')!r}, expected {FORMAT!r}"
        return {rel: FileEntry(int(e["size"]), str(e["sha256"])) for rel, e in document["files"].items()}
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        return f"{MANIFEST_FILE} is unreadable ({type(err).__name__}: {err})"


def verify_manifest(directory: str | Path) -> str | None:
    """None when every file the manifest lists is there with its size and hash, else the first problem."""
    directory = Path(directory)
    entries = _read_entries(directory)
    if isinstance(entries, str):
        return entries
    if not entries:
        return f"{MANIFEST_FILE} lists no files"
    # Sizes first: a truncated or missing file is found without reading gigabytes of the others.
    for rel, entry in entries.items():
        path = directory / rel
        if not path.is_file():
            return f"{rel} is missing"
        if path.stat().st_size != entry.size:
            return f"{rel} has {path.stat().st_size} bytes, the manifest says {entry.size}"
    for rel, entry in entries.items():
        if _sha256(directory / rel) != entry.sha256:
            return f"{rel} does not match its sha256 in the manifest (corrupt)"
    return None
