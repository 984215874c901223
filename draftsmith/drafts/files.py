"""How draftsmith writes and keys files: atomic writes, cache entries, canonical hashes.

One definition each, in the lowest room that writes artifacts, so every room above (serve_eval,
train) writes the same way:
- `atomic_write` / `atomic_write_text` / `write_json`: a temporary sibling, fsync, then rename, so a
  reader (or a resumed run) never sees half a file;
- `atomic_dir`: a whole cache entry filled in a temporary sibling, marked complete, renamed in;
- `entry_lock`: one process builds an entry while the others wait for it;
- `stable_hash` / `hash_files`: short sha256 keys of canonical JSON and of file bytes.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

KEY_CHARS = 16
COMPLETE_MARKER = ".complete"


def atomic_write(path: Path, write: Callable[[str], None]) -> None:
    """Call write(tmp_path) on a temporary sibling of `path`, fsync it, then rename it over `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb") as written:
            os.fsync(written.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write(path, lambda tmp: Path(tmp).write_text(text))


def write_json(path: Path, obj: Any, *, sort_keys: bool = True) -> None:
    """Indented JSON, atomically; non-JSON leaves (paths, numpy scalars) go through str()."""
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=sort_keys, default=str) + "\n")


def read_json(path: Path) -> Any:
    return json.loads(Path(path).read_text())


def canonical_json(obj: Any) -> bytes:
    """The canonical form every hash is taken over: sorted keys, no whitespace, str() for the rest."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str).encode()


def stable_hash(obj: Any) -> str:
    """Short sha256 of a JSON-able object in canonical form (an OmegaConf node is resolved first)."""
    if type(obj).__module__.startswith("omegaconf"):
        from omegaconf import OmegaConf
        obj = OmegaConf.to_container(obj, resolve=True)
    return hashlib.sha256(canonical_json(obj)).hexdigest()[:KEY_CHARS]


def hash_files(paths: list[Path]) -> str:
    """Short sha256 over the names and bytes of several files, in the given order."""
    digest = hashlib.sha256()
    for path in paths:
        digest.update(path.name.encode())
        with path.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()[:KEY_CHARS]


def is_complete(entry: Path) -> bool:
    """A cache entry counts only once `atomic_dir` finished writing it."""
    return (entry / COMPLETE_MARKER).is_file()


@contextlib.contextmanager
def entry_lock(entry: Path) -> Iterator[None]:
    """Exclusive lock on building one cache entry: a second process asking for the same entry (say,
    two engineers' jobs wanting the embedded target) waits, then finds it complete, instead of
    building it again. Check `is_complete` *inside* the lock."""
    import fcntl

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
    """Yield a temporary dir to fill; on success it replaces `entry` and is marked complete."""
    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = entry.parent / f".{entry.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        (tmp / COMPLETE_MARKER).write_text("")
        shutil.rmtree(entry, ignore_errors=True)
        tmp.rename(entry)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
