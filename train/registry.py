"""The draft registry: which drafts serve which target, and in what state.

On disk, below a registry root (the artifacts root by default, or any directory a team shares)::

    targets/<fingerprint>/registry.json   one manifest per target fingerprint (schema-versioned)
    registry.lock                         one flock for the whole registry

Layout matches ``train.artifacts`` (``targets/<fingerprint>/``), so with root = artifacts root the
manifest sits beside that target's drafts, data and reports. A manifest records the target's identity
(fingerprint, vocabulary, tokenizer hash: what the hook compares) and one entry per draft: kind, path,
the fingerprint it was trained for, data manifest hash, last eval report, status
(candidate / promoted / retired) and timestamps. At most one entry per kind is promoted per target.

Every write goes to a temp file, is fsynced and renamed into place, and happens under the lock, so a
reader never sees half a manifest and two concurrent writers never lose each other's update.
``draftsmith drafts list|show|add|promote|retire`` is the CLI (``main``).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import fcntl
import hashlib
import json
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, fields
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from drafts.artifacts import REGISTRY_NAME, Artifacts
from drafts.files import atomic_write_text

SCHEMA_VERSION = 1
MANIFEST_NAME = REGISTRY_NAME
LOCK_NAME = "registry.lock"
STATUSES = ("candidate", "promoted", "retired")
DEFAULT_LOCK_TIMEOUT_S = 600.0
_LOCK_POLL_S = 0.05


def utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


class RegistryLockedError(RuntimeError):
    """Another process held the registry lock for longer than we were willing to wait."""


# ----------------------------------------------------------------------------- target identity

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


@dataclass
class TargetInfo:
    """What the registry remembers about a target: enough to tell whether its drafts can be reused."""

    fingerprint: str
    path: str | None = None
    vocab_size: int | None = None
    hidden_size: int | None = None
    num_layers: int | None = None
    tokenizer_hash: str | None = None

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "TargetInfo":
        from drafts.identity import target_fingerprint

        model_dir = Path(model_dir)
        fingerprint = target_fingerprint(model_dir)  # ValueError naming the dir when it is no checkpoint
        config = json.loads((model_dir / "config.json").read_text())
        config = config.get("text_config", config)  # multimodal wrappers nest the LM config
        return cls(fingerprint, str(model_dir.resolve()), config.get("vocab_size"), config.get("hidden_size"),
                   config.get("num_hidden_layers"), tokenizer_hash(model_dir))


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
    return DraftEntry(**{**defaults, **{k: v for k, v in raw.items() if k in names}})


@dataclass
class Manifest:
    target: TargetInfo
    entries: list[DraftEntry] = field(default_factory=list)
    schema_version: int = SCHEMA_VERSION

    def to_dict(self) -> dict[str, Any]:
        return {"schema_version": self.schema_version, "target": asdict(self.target),
                "entries": [asdict(e) for e in self.entries]}

    @classmethod
    def from_file(cls, path: Path) -> "Manifest":
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}: not valid JSON ({err})") from None
        if not isinstance(raw, dict) or raw.get("schema_version") != SCHEMA_VERSION:
            raise ValueError(f"{path}: schema_version {raw.get('schema_version') if isinstance(raw, dict) else None!r}"
                             f" is not {SCHEMA_VERSION}")
        target_fields = {f.name for f in fields(TargetInfo)}
        if not isinstance(raw.get("target"), dict) or "fingerprint" not in raw["target"]:
            raise ValueError(f"{path}: field 'target.fingerprint' is missing")
        target = TargetInfo(**{k: v for k, v in raw["target"].items() if k in target_fields})
        entries = [_entry_from_dict(e, f"{path}: entries[{i}]") for i, e in enumerate(raw.get("entries", []))]
        return cls(target, entries)


# ----------------------------------------------------------------------------- the registry

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

    def read(self, fingerprint: str) -> Manifest | None:
        path = self.manifest_path(fingerprint)
        return Manifest.from_file(path) if path.is_file() else None

    def _write(self, manifest: Manifest) -> None:
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
    def add(self, draft_dir: str | Path, target: TargetInfo, *, report_path: str | Path | None = None,
            report_method: str | None = None, status: str = "candidate", parent_id: str | None = None,
            note: str = "", extra: dict[str, Any] | None = None) -> DraftEntry:
        """File a draft dir under ``target``; its kind, trained fingerprint and data hash come from draftsmith.json."""
        from drafts.io import read_draft_meta

        if status not in STATUSES:
            raise ValueError(f"status {status!r} is not one of {STATUSES}")
        draft_dir = Path(draft_dir).expanduser().resolve()
        if not draft_dir.is_dir():
            raise ValueError(f"{draft_dir}: draft dir does not exist")
        meta = read_draft_meta(draft_dir)
        with self.locked():
            manifest = self.read(target.fingerprint) or Manifest(target)
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
        allowed = {"report_path", "report_method", "note", "extra"}
        if not changes.keys() <= allowed:
            raise ValueError(f"registry update: only {sorted(allowed)} can change, got {sorted(changes)}")
        return self._mutate(entry_id, lambda manifest, entry: [setattr(entry, k, v) for k, v in changes.items()])

    def promote(self, entry_id: str) -> DraftEntry:
        """Promote; the entry of the same kind promoted before for this target is retired."""
        def apply(manifest: Manifest, entry: DraftEntry) -> None:
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


# ----------------------------------------------------------------------------- CLI

def split_key_values(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    """Hydra-style ``key=value`` tokens (what CI pipelines pass) apart from flags and positionals."""
    pairs: dict[str, str] = {}
    rest: list[str] = []
    for token in argv:
        key, sep, value = token.partition("=")
        if sep and key and not key.startswith("-"):
            pairs[key.lstrip("+")] = value
        else:
            rest.append(token)
    return pairs, rest


def registry_root(pairs: dict[str, str], flag: str | None = None) -> Path:
    """--registry / registry= wins, then $DRAFTSMITH_REGISTRY, then artifacts_root= (default ``artifacts``)."""
    chosen = flag or pairs.get("registry") or os.environ.get("DRAFTSMITH_REGISTRY") or pairs.get("artifacts_root")
    return Path(chosen or "artifacts")


def _alpha_summary(entry: DraftEntry) -> str:
    """Per-domain alpha of the entry's last report ('-' when there is none or it cannot be read)."""
    if not entry.report_path or not Path(entry.report_path).is_file():
        return "-"
    from serve_eval.eval.report import ReportSchemaError, load_report

    try:
        report = load_report(entry.report_path)
    except ReportSchemaError as err:
        return f"unreadable ({err})"
    method = entry.report_method or entry.kind
    rows = [r for r in report.results if r.method == method and r.alpha is not None]
    by_domain: dict[str, list[float]] = {}
    for r in rows:
        by_domain.setdefault(r.domain, []).append(r.alpha)
    return ", ".join(f"{d} {sum(v) / len(v):.3f}" for d, v in sorted(by_domain.items())) or "-"


def print_entries(entries: list[DraftEntry], console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    table = Table(title="draftsmith drafts")
    for col in ("id", "kind", "status", "target", "trained for", "data", "files", "updated"):
        table.add_column(col, no_wrap=col in ("id", "status", "files"))
    short = lambda h: "-" if not h else h[:8]  # noqa: E731  (8 hex chars tell targets apart in a table)
    for e in entries:
        files = "ok" if not e.missing_files() else "[red]MISSING[/red]"
        trained = "same" if e.trained_fingerprint == e.target_fingerprint else short(e.trained_fingerprint)
        table.add_row(e.id, e.kind, e.status, short(e.target_fingerprint), trained, short(e.data_manifest_hash),
                      files, e.updated_at)
    console.print(table)
    for e in entries:
        if e.missing_files():
            console.print(f"[red]{e.id}: files are gone: {'; '.join(e.missing_files())}[/red]", soft_wrap=True)


def print_entry(entry: DraftEntry, registry: Registry, console=None) -> None:
    from rich.console import Console

    console = console or Console()
    manifest = registry.read(entry.target_fingerprint)
    for key, value in asdict(entry).items():
        console.print(f"{key:>20}: {value}", soft_wrap=True, markup=False)
    if manifest is not None:
        console.print(f"{'target path':>20}: {manifest.target.path}", soft_wrap=True, markup=False)
    console.print(f"{'last report alpha':>20}: {_alpha_summary(entry)}", soft_wrap=True, markup=False)
    missing = entry.missing_files()
    console.print(f"{'files':>20}: " + ("ok" if not missing else "GONE: " + "; ".join(missing)),
                  soft_wrap=True, markup=False)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="draftsmith drafts",
                                description="The draft registry (key=value tokens registry=DIR / artifacts_root=DIR "
                                            "work too).")
    p.add_argument("--registry", help="registry root (default: $DRAFTSMITH_REGISTRY or the artifacts root)")
    p.add_argument("--lock-timeout", type=float, default=DEFAULT_LOCK_TIMEOUT_S,
                   help="seconds to wait for another run holding the registry lock")
    sub = p.add_subparsers(dest="command", required=True)
    ls = sub.add_parser("list", help="drafts per target fingerprint")
    ls.add_argument("--target", help="only this target fingerprint")
    ls.add_argument("--status", choices=STATUSES)
    show = sub.add_parser("show", help="one entry in full, with its last report's alpha per domain")
    show.add_argument("id")
    add = sub.add_parser("add", help="register a draft dir for a target checkpoint")
    add.add_argument("draft_dir", type=Path)
    add.add_argument("--target-dir", type=Path, required=True, help="the target checkpoint the draft serves")
    add.add_argument("--report", type=Path, help="its eval report.json on that target")
    add.add_argument("--report-method", help="the draft's method label in that report (default: its kind)")
    add.add_argument("--status", choices=STATUSES, default="candidate")
    for name, text in (("promote", "make it the served draft of its kind (retires the previous one)"),
                       ("retire", "take it out of service")):
        sub.add_parser(name, help=text).add_argument("id")
    return p


def main(argv: list[str] | None = None) -> int:
    """Exit status 0 ok, 2 error. Called without argv (the ``draftsmith`` dispatcher) it exits with it."""
    if argv is None:
        raise SystemExit(main(sys.argv[1:]))
    pairs, rest = split_key_values(argv)
    args = build_parser().parse_args(rest)
    registry = Registry(registry_root(pairs, args.registry), float(pairs.get("lock_timeout", args.lock_timeout)))
    try:
        if args.command == "list":
            entries = registry.entries(args.target)
            if args.status:
                entries = [e for e in entries if e.status == args.status]
            if not entries:
                print(f"draftsmith drafts: no drafts in registry {registry.root}")
            else:
                print_entries(entries)
        elif args.command == "show":
            print_entry(registry.get(args.id), registry)
        elif args.command == "add":
            report = args.report.resolve() if args.report else None
            entry = registry.add(args.draft_dir, TargetInfo.from_dir(args.target_dir), report_path=report,
                                 report_method=args.report_method, status=args.status)
            print(f"draftsmith drafts: registered {entry.id} ({entry.status})")
        else:
            entry = getattr(registry, args.command)(args.id)
            print(f"draftsmith drafts: {entry.id} is now {entry.status}")
    except (ValueError, RegistryLockedError) as err:
        print(f"draftsmith drafts: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
