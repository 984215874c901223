"""Target identity: a short hash of a checkpoint's config and weights.

Drafts and reports are filed under this fingerprint, so a draft trained for one target can never
be mistaken for another's. The hash covers what decides the model's outputs (architecture config
and every tensor's name, dtype, shape and bytes) and nothing incidental (the transformers version
that wrote the file, the order of tensors on disk, how the weights are sharded).
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

from draftsmith.kernels.layers.checkpoint import weight_files

# config.json keys that record who/where wrote the file, not what the model computes.
_VOLATILE_CONFIG_KEYS = frozenset({"transformers_version", "_name_or_path", "_commit_hash"})
_CHUNK_BYTES = 8 << 20
FINGERPRINT_CHARS = 16


def _canonical_config(config_path: Path) -> bytes:
    try:
        config = json.loads(config_path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{config_path}: missing; a target checkpoint dir needs config.json") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"{config_path}: not valid JSON ({err})") from None
    stable = {k: v for k, v in config.items() if k not in _VOLATILE_CONFIG_KEYS}
    return json.dumps(stable, sort_keys=True, separators=(",", ":")).encode()


def _tensor_index(path: Path) -> dict[str, tuple[Path, dict, int]]:
    """Tensor name -> (file, header entry, offset of the data section), from a safetensors header."""
    try:
        with path.open("rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_len))
    except (struct.error, json.JSONDecodeError, UnicodeDecodeError):
        raise ValueError(f"{path}: not a safetensors file (unreadable header)") from None
    data_start = 8 + header_len
    return {name: (path, info, data_start) for name, info in header.items() if name != "__metadata__"}


def target_fingerprint(model_dir: str | Path) -> str:
    """Short sha256 over canonical config.json + all safetensors tensors (name, dtype, shape, bytes)."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ValueError(f"{model_dir}: not a directory (target checkpoint expected)")
    digest = hashlib.sha256()
    digest.update(_canonical_config(model_dir / "config.json"))
    files = weight_files(model_dir)  # the shards the engine loads (kernels.layers.checkpoint)
    tensors: dict[str, tuple[Path, dict, int]] = {}
    for path in files:
        tensors.update(_tensor_index(path))
    handles = {path: path.open("rb") for path in files}
    try:
        for name in sorted(tensors):
            path, info, data_start = tensors[name]
            begin, end = info["data_offsets"]
            digest.update(json.dumps([name, info["dtype"], info["shape"]]).encode())
            f = handles[path]
            f.seek(data_start + begin)
            remaining = end - begin
            while remaining > 0:
                chunk = f.read(min(_CHUNK_BYTES, remaining))
                if not chunk:
                    raise ValueError(f"{path}: truncated safetensors file (tensor {name})")
                digest.update(chunk)
                remaining -= len(chunk)
    finally:
        for f in handles.values():
            f.close()
    return digest.hexdigest()[:FINGERPRINT_CHARS]


def tokenizer_hash(model_dir: Path) -> str | None:
    """Hash of the vocabulary a checkpoint's tokenizer maps text to; None when it ships no tokenizer.

    tokenizer.json is reduced to its model (vocab, merges) and added tokens, so a rewrite by another
    transformers version (key order, padding options) does not read as a vocabulary change.
    """
    fast = model_dir / "tokenizer.json"
    if fast.is_file():
        try:
            raw = json.loads(fast.read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"{fast}: not valid JSON ({err})") from None
        payload = json.dumps([raw.get("model"), raw.get("added_tokens")], sort_keys=True).encode()
        return hashlib.sha256(payload).hexdigest()[:16]
    for name in ("tokenizer.model", "vocab.json"):  # sentencepiece / byte-level BPE vocab files
        if (model_dir / name).is_file():
            return hashlib.sha256((model_dir / name).read_bytes()).hexdigest()[:16]
    return None
