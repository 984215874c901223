"""What the draft registry records: the target a manifest is for, and one entry per draft.

A `RegistryManifest` (``targets/<fingerprint>/registry.json``, schema-versioned) holds the target's
identity (fingerprint, vocabulary, tokenizer hash: what the hook compares) and one `DraftEntry` per
draft: kind, path, the fingerprint it was trained for, data manifest hash, last eval report, status
(candidate / promoted / retired), timestamps, and its lineage: the W&B artifacts (target, data, draft,
eval report) it was logged as, each naming the artifacts it was made from (`ArtifactRef.uses`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from draftsmith.drafts.identity import target_fingerprint, tokenizer_hash

SCHEMA_VERSION = 1
STATUSES = ("candidate", "promoted", "retired")


def utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


@dataclass
class RegisteredTarget:
    """What the registry remembers about a target: enough to tell whether its drafts can be reused."""

    fingerprint: str
    path: str | None = None
    vocab_size: int | None = None
    hidden_size: int | None = None
    num_layers: int | None = None
    tokenizer_hash: str | None = None

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "RegisteredTarget":
        model_dir = Path(model_dir)
        fingerprint = target_fingerprint(model_dir)  # ValueError naming the dir when it is no checkpoint
        config = json.loads((model_dir / "config.json").read_text())
        config = config.get("text_config", config)  # multimodal wrappers nest the LM config
        return cls(fingerprint, str(model_dir.resolve()), config.get("vocab_size"), config.get("hidden_size"),
                   config.get("num_hidden_layers"), tokenizer_hash(model_dir))


# ----------------------------------------------------------------------------- lineage

LINEAGE_TYPES = ("target", "dataset", "draft", "report")


@dataclass(frozen=True)
class ArtifactRef:
    """One W&B artifact of a draft's lineage, and the edges to the artifacts it was made from.

    Offline W&B (0.31) refuses `use_artifact`, so the edges are kept here and in the artifact's own
    metadata (`uses`: keys of its inputs); `id`/`version` are the server's and exist only online.
    """

    name: str
    type: str                         # one of LINEAGE_TYPES
    digest: str                       # W&B's content digest of the artifact
    uses: tuple[str, ...] = ()        # `key`s of the artifacts it was made from
    run_id: str | None = None         # the W&B run that logged it
    run_dir: str | None = None        # offline: that run's directory (its .wandb file holds the artifact)
    id: str | None = None             # online only: the server's artifact id
    version: str | None = None        # online only: e.g. "v3"

    @property
    def key(self) -> str:
        return f"{self.name}@{self.digest}"

    @classmethod
    def from_dict(cls, raw: Any, where: str) -> "ArtifactRef":
        names = {f.name for f in fields(cls)}
        if not isinstance(raw, dict) or not {"name", "type", "digest"} <= raw.keys():
            raise ValueError(f"{where}: a lineage artifact needs name, type, digest")
        if raw["type"] not in LINEAGE_TYPES:
            raise ValueError(f"{where}: lineage type {raw['type']!r} is not one of {LINEAGE_TYPES}")
        return cls(**{k: (tuple(v) if k == "uses" else v) for k, v in raw.items() if k in names})


# ----------------------------------------------------------------------------- entries

@dataclass
class DraftEntry:
    id: str
    kind: str
    path: str
    target_fingerprint: str              # the target this entry serves (the manifest it lives in)
    trained_fingerprint: str | None      # the target it was distilled on (draftsmith.json); differs when carried over
    data_manifest_hash: str | None
    report_path: str | None              # last eval report (report.json) of this draft on this target
    report_method: str | None            # the draft's `method` label in that report
    status: str = "candidate"
    created_at: str = field(default_factory=utc_now)
    updated_at: str = field(default_factory=utc_now)
    parent_id: str | None = None         # the draft it was warm-started from / carried over from
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)  # e.g. wandb run id, hook decision record
    lineage: list[ArtifactRef] = field(default_factory=list)  # target -> data -> draft -> report (W&B)

    def missing_files(self) -> list[str]:
        """What of this entry is gone from disk (an empty list = all present)."""
        missing = []
        draft = Path(self.path)
        if not draft.is_dir():
            missing.append(f"draft dir {draft}")
        else:
            missing += [f"{draft / name}" for name in ("config.json", "draftsmith.json") if not (draft / name).is_file()]
        if self.report_path and not Path(self.report_path).is_file():
            missing.append(f"report {self.report_path}")
        return missing


def _entry_from_dict(raw: Any, where: str) -> DraftEntry:
    names = {f.name for f in fields(DraftEntry)}
    if not isinstance(raw, dict) or not {"id", "kind", "path", "target_fingerprint", "status"} <= raw.keys():
        raise ValueError(f"{where}: an entry needs id, kind, path, target_fingerprint, status")
    if raw["status"] not in STATUSES:
        raise ValueError(f"{where}: status {raw['status']!r} is not one of {STATUSES}")
    defaults = {"trained_fingerprint": None, "data_manifest_hash": None, "report_path": None, "report_method": None}
    lineage = raw.get("lineage", [])
    if not isinstance(lineage, list):
        raise ValueError(f"{where}: lineage must be a list of artifacts")
    known = {k: v for k, v in raw.items() if k in names and k != "lineage"}
    return DraftEntry(**{**defaults, **known},
                      lineage=[ArtifactRef.from_dict(a, f"{where}.lineage[{i}]") for i, a in enumerate(lineage)])


@dataclass
class RegistryManifest:
    target: RegisteredTarget
    entries: list[DraftEntry] = field(default_factory=list)
    schema_version: int = SCHEMA_VERSION

    def to_dict(self) -> dict[str, Any]:
        return {"schema_version": self.schema_version, "target": asdict(self.target),
                "entries": [asdict(e) for e in self.entries]}

    @classmethod
    def from_file(cls, path: Path) -> "RegistryManifest":
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}: not valid JSON ({err})") from None
        if not isinstance(raw, dict) or raw.get("schema_version") != SCHEMA_VERSION:
            raise ValueError(f"{path}: schema_version {raw.get('schema_version') if isinstance(raw, dict) else None!r}"
                             f" is not {SCHEMA_VERSION}")
        target_fields = {f.name for f in fields(RegisteredTarget)}
        if not isinstance(raw.get("target"), dict) or "fingerprint" not in raw["target"]:
            raise ValueError(f"{path}: field 'target.fingerprint' is missing")
        target = RegisteredTarget(**{k: v for k, v in raw["target"].items() if k in target_fields})
        entries = [_entry_from_dict(e, f"{path}: entries[{i}]") for i, e in enumerate(raw.get("entries", []))]
        return cls(target, entries)


