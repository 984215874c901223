"""Read W&B offline runs back: the artifacts each ``run-<id>.wandb`` file records, with their metadata.

wandb 0.31 writes offline runs from its Go core and ships no Python reader of the ``.wandb`` file any
more, so this module reads the file's framing itself and decodes each record with wandb's own
protobuf schema (``wandb.proto.wandb_internal_pb2.Record``). The framing is the LevelDB log format
W&B has always used: a 7-byte file header (``:W&B``, magic 0xBEE1, version 0), then 32 KiB blocks of
chunks, each ``crc32 (4, little endian) | length (2) | type (1) | data``; type 1 is a whole record,
2/3/4 its first/middle/last pieces, and a block's tail shorter than a chunk header is zero padding.
The checksum is zlib's crc32 of the data, seeded with the crc32 of the type byte.
"""

from __future__ import annotations

import json
import struct
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_HEADER = b":W&B" + struct.pack("<HB", 0xBEE1, 0)
_BLOCK = 32768
_CHUNK = struct.Struct("<IHB")
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


@dataclass(frozen=True)
class LoggedArtifact:
    """An artifact as an offline run recorded it."""

    name: str
    type: str
    digest: str
    metadata: dict[str, Any]
    run_id: str
    job_type: str
    run_file: str


def _chunks(data: bytes, path: Path) -> Iterator[tuple[int, bytes]]:
    pos = len(_HEADER)
    while pos + _CHUNK.size <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _CHUNK.size:
            pos += left
            continue
        crc, length, kind = _CHUNK.unpack_from(data, pos)
        if crc == length == kind == 0:          # zero padding up to the next block
            pos += left
            continue
        chunk = data[pos + _CHUNK.size:pos + _CHUNK.size + length]
        if len(chunk) < length:
            return                              # a run still being written: its last chunk is incomplete
        if zlib.crc32(chunk, zlib.crc32(bytes([kind]))) & 0xFFFFFFFF != crc:
            raise ValueError(f"{path}: corrupt record at byte {pos} (checksum mismatch)")
        pos += _CHUNK.size + length
        yield kind, chunk


def records(path: str | Path) -> Iterator[Any]:
    """Every record of one ``.wandb`` file, as ``wandb_internal_pb2.Record``."""
    from wandb.proto import wandb_internal_pb2 as pb

    path = Path(path)
    data = path.read_bytes()
    if not data.startswith(_HEADER):
        raise ValueError(f"{path}: not a W&B run file (header {data[:7]!r})")
    pieces: list[bytes] = []
    for kind, chunk in _chunks(data, path):
        if kind in (_FULL, _FIRST):
            pieces = [chunk]
        else:
            pieces.append(chunk)
        if kind in (_FULL, _LAST):
            record = pb.Record()
            record.ParseFromString(b"".join(pieces))
            yield record


def wait_until_written(run_dir: str | Path, timeout_s: float = 60.0) -> Path:
    """The run file of an offline run once it holds the run's exit record. `Run.finish()` can return
    before wandb's core has flushed the file, and a reader must not find half a run."""
    run_dir = Path(run_dir)
    deadline = time.monotonic() + timeout_s
    problem = ""
    while True:
        found = sorted(run_dir.glob("*.wandb"))
        try:   # a file created but not yet given its header reads as "not a W&B run file": keep waiting
            if found and any(r.WhichOneof("record_type") == "exit" for r in records(found[0])):
                return found[0]
        except ValueError as err:
            problem = f" (last read: {err})"
        if time.monotonic() > deadline:
            raise RuntimeError(f"{run_dir}: wandb wrote no complete run file within {timeout_s:g} s{problem}")
        time.sleep(0.05)


def run_files(wandb_dir: str | Path) -> list[Path]:
    """The ``.wandb`` files below a W&B dir (each once: ``latest-run`` is a link to one of them)."""
    found = {p.resolve() for p in Path(wandb_dir).rglob("*.wandb")}
    return sorted(found)


def logged_artifacts(wandb_dir: str | Path) -> list[LoggedArtifact]:
    """Every artifact the offline runs below ``wandb_dir`` logged, in file order."""
    out = []
    for path in run_files(wandb_dir):
        run_id = job_type = ""
        for record in records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                run_id, job_type = record.run.run_id, record.run.job_type
            elif kind == "artifact":
                a = record.artifact
                try:
                    metadata = json.loads(a.metadata) if a.metadata else {}
                except json.JSONDecodeError as err:
                    raise ValueError(f"{path}: artifact {a.name}: metadata is not JSON ({err})") from None
                out.append(LoggedArtifact(a.name, a.type, a.digest, metadata, run_id or a.run_id, job_type, str(path)))
    return out
