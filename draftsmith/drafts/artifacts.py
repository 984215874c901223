"""The artifacts root: where every cached or produced file lives, and how it is keyed.

The one spelling of the layout, in the lowest room that produces artifacts, so that the eval,
the registry, the hook and the scripts never rebuild a path by hand::

    <root>/                  (`artifacts_root`, default `artifacts/`, gitignored)
      corpus/<key>/            distill.jsonl eval.jsonl pretrain.txt manifest.json   (key: data config + Python)
      tokenizers/<key>/        HF tokenizer dir                                       (key: corpus hash + vocab)
      target-cache/<key>/      trained embedded target (HF dir)                       (key: target config + corpus hash)
      targets/<fingerprint>/   everything produced *for* one target, by its identity (drafts.identity):
          drafts/ data/ reports/ target.json registry.json
      wandb/ hydra/            W&B offline runs, Hydra run dirs

Cache entries are written with `draftsmith.drafts.files.atomic_dir`, so an interrupted run never leaves a
half-written entry that a later run would trust.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

TARGET_SUBDIRS = ("drafts", "data", "reports")
TARGET_META_NAME = "target.json"      # what a target's home records about it (path, shape)
REGISTRY_NAME = "registry.json"       # the registry's manifest of that target's drafts


@dataclass(frozen=True)
class Artifacts:
    root: Path

    def corpus_dir(self, key: str) -> Path:
        return self.root / "corpus" / key

    def tokenizer_dir(self, key: str) -> Path:
        return self.root / "tokenizers" / key

    def target_cache_dir(self, key: str) -> Path:
        return self.root / "target-cache" / key

    @property
    def targets_dir(self) -> Path:
        return self.root / "targets"

    def target_home(self, fingerprint: str) -> Path:
        """Home of everything produced for one target (not created: readers use this)."""
        return self.targets_dir / fingerprint

    def target_dir(self, fingerprint: str) -> Path:
        """The target's home, with its sub-dirs created (writers use this)."""
        home = self.target_home(fingerprint)
        for sub in TARGET_SUBDIRS:
            (home / sub).mkdir(parents=True, exist_ok=True)
        return home

    def drafts_dir(self, fingerprint: str) -> Path:
        return self.target_dir(fingerprint) / "drafts"

    def data_dir(self, fingerprint: str) -> Path:
        return self.target_dir(fingerprint) / "data"

    def reports_dir(self, fingerprint: str) -> Path:
        return self.target_dir(fingerprint) / "reports"

    def target_meta(self, fingerprint: str) -> Path:
        return self.target_home(fingerprint) / TARGET_META_NAME

    def registry_manifest(self, fingerprint: str) -> Path:
        return self.target_home(fingerprint) / REGISTRY_NAME

    def known_fingerprints(self, marker: str = TARGET_META_NAME) -> list[str]:
        """Targets whose home holds `marker`, oldest first (by that file's mtime)."""
        metas = sorted(self.targets_dir.glob(f"*/{marker}"), key=lambda p: p.stat().st_mtime)
        return [meta.parent.name for meta in metas]

    def draft_dirs(self, fingerprint: str) -> list[Path]:
        """Exported draft dirs of one target, oldest first."""
        return sorted((p for p in (self.target_home(fingerprint) / "drafts").glob("*/") if p.is_dir()),
                      key=lambda p: p.stat().st_mtime)

    @property
    def wandb_dir(self) -> Path:
        path = self.root / "wandb"
        path.mkdir(parents=True, exist_ok=True)
        return path
