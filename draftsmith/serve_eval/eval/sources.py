"""What an eval run measures: the target dir, the held-out prompts per domain, and the drafts.

serve_eval may not import train, so the artifacts layout written by train.artifacts / train.registry
is read here as plain files: `targets/<fp>/target.json`, `targets/<fp>/drafts/<name>/draftsmith.json`,
`targets/<fp>/registry.json`, `corpus/<key>/{eval.jsonl,manifest.json}`.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from draftsmith.drafts.artifacts import Artifacts
from draftsmith.drafts.files import read_json
from draftsmith.serve_eval.eval.report import SkippedEntry
from draftsmith.serve_eval.schemas import EvalConfig

DRAFT_META_FILE = "draftsmith.json"
TARGET_META_FILE = "draftsmith_target.json"   # written by train.target into the embedded target's dir


def reports_root(artifacts_root: str | Path, fingerprint: str) -> Path:
    return Artifacts(Path(artifacts_root)).target_home(fingerprint) / "reports"


# ----------------------------------------------------------------------------- target

def find_target(explicit: str | None, artifacts_root: str | Path) -> Path:
    """The target dir: `explicit` (a dir, or a fingerprint known under the artifacts root),
    else the target most recently registered under `<artifacts>/targets/*/target.json`."""
    artifacts = Artifacts(Path(artifacts_root))
    if explicit:
        path = Path(explicit).expanduser()
        if path.is_dir():
            return path
        meta = artifacts.target_meta(explicit)
        if meta.is_file():
            return Path(read_json(meta)["model_dir"])
        raise ValueError(f"eval.target: {explicit!r} is neither a model dir nor a target fingerprint under "
                         f"{artifacts.root}")
    known = artifacts.known_fingerprints()
    if not known:
        raise ValueError(f"eval.target: not set and no target under {artifacts.targets_dir}; run `draftsmith "
                         "pipeline` first or pass eval.target=MODEL_DIR")
    return Path(read_json(artifacts.target_meta(known[-1]))["model_dir"])


# ----------------------------------------------------------------------------- prompts

def _prompt_rows(path: Path) -> list[tuple[str, Any]]:
    """(1-based location, record): a .jsonl file line by line (exact line numbers, blank lines kept
    in the count), anything else through `datasets` (record numbers)."""
    if path.suffix == ".jsonl":
        rows = []
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            if line.strip():
                try:
                    rows.append((f"line {number}", json.loads(line)))
                except json.JSONDecodeError as e:
                    raise ValueError(f"eval.prompts: {path} line {number} is not JSON ({e})") from None
        return rows
    import datasets

    datasets.disable_progress_bars()
    try:
        records = datasets.load_dataset("json", data_files=str(path), split="train").to_list()
    except Exception as e:  # datasets wraps parse errors in several types
        raise ValueError(f"eval.prompts: {path} is not a JSON-lines file of records ({type(e).__name__}: {e})") from e
    return [(f"record {i}", r) for i, r in enumerate(records, start=1)]


def _field_problem(value: Any) -> str | None:
    if value is None:
        return "missing"
    if not isinstance(value, str):
        return f"non-string ({type(value).__name__})"
    return None if value.strip() else "empty"


def load_prompt_records(path: str | Path) -> list[dict[str, Any]]:
    """Records {domain, prompt, ...} of a jsonl/json file. A record missing `domain` or `prompt`, or
    with one of them empty, is an error naming the file, the line and the field."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"eval.prompts: no file at {path}")
    records = []
    for where, r in _prompt_rows(path):
        if not isinstance(r, dict):
            raise ValueError(f"eval.prompts: {path} {where} is a JSON {type(r).__name__}, not a record object")
        for name in ("domain", "prompt"):
            problem = _field_problem(r.get(name))
            if problem:
                raise ValueError(f"eval.prompts: {path}: {problem} field '{name}' on {where} "
                                 "(records need non-empty string fields 'domain' and 'prompt')")
        records.append(r)
    if not records:
        raise ValueError(f"eval.prompts: {path} holds no records")
    return records


def find_corpus_eval_split(artifacts_root: str | Path, target_dir: str | Path) -> Path:
    """The held-out split of the corpus the target was trained on (matched by content hash),
    or the only corpus under the artifacts root when the target does not say."""
    root = Path(artifacts_root) / "corpus"
    meta = Path(target_dir) / TARGET_META_FILE
    corpus_hash = json.loads(meta.read_text()).get("corpus_hash") if meta.is_file() else None
    candidates = [m.parent for m in sorted(root.glob("*/manifest.json")) if (m.parent / "eval.jsonl").is_file()]
    if corpus_hash:
        for entry in candidates:
            if json.loads((entry / "manifest.json").read_text()).get("content_hash") == corpus_hash:
                return entry / "eval.jsonl"
    if len(candidates) == 1:
        return candidates[0] / "eval.jsonl"
    raise ValueError(f"eval.prompts: not set, and {'no' if not candidates else 'more than one'} corpus under "
                     f"{root} matches target {target_dir}; pass eval.prompts=PATH.jsonl ({{domain, prompt}} records)")


def group_prompts(records: list[dict[str, Any]], domains: list[str], prompts_of: Callable[[str], int],
                  source: str) -> tuple[dict[str, list[str]], list[SkippedEntry]]:
    """Prompts per domain, in file order, at most prompts_of(domain) each (EvalConfig.prompts_of). A requested
    domain with no prompt becomes a skipped entry (the others still run)."""
    by_domain: dict[str, list[str]] = {}
    for r in records:
        if r["prompt"].strip():
            by_domain.setdefault(r["domain"], []).append(r["prompt"])
    wanted = list(domains) if domains else sorted(by_domain)
    prompts, skipped = {}, []
    for d in wanted:
        if by_domain.get(d):
            prompts[d] = by_domain[d][:prompts_of(d)]
        else:
            present = ", ".join(sorted(by_domain)) or "none"
            skipped.append(SkippedEntry(d, "*", f"no prompts for domain {d!r} in {source} (domains there: {present})"))
    return prompts, skipped


# ----------------------------------------------------------------------------- drafts

@dataclass
class DraftSource:
    method: str          # the report's method label
    path: Path
    kind: str | None     # from draftsmith.json; None when unreadable (loading will say why)
    notes: list[str] = field(default_factory=list)
    # Set by serve_eval.eval.variants for quantized drafts and the drafts they were quantized from:
    quantization: str | None = None   # e.g. "int4-g64" (None: not quantized)
    variant_of: str | None = None     # the method label of this variant's unquantized source
    draft_dtype: str | None = None    # the draft's activation dtype in the engine (None: the target's)
    weight_bytes: int | None = None   # the draft's weights as the engine holds them (set when it is checked)


def _kind(path: Path) -> str | None:
    meta = path / DRAFT_META_FILE
    try:
        return json.loads(meta.read_text()).get("kind") if meta.is_file() else None
    except (OSError, json.JSONDecodeError):
        return None


def _label(path: Path) -> str:
    """A discovered draft's label: its kind (e.g. standalone), kind@quantization for a quantized copy
    (standalone@int4-g64, the label serve_eval.eval.variants gives), else the dir name."""
    from draftsmith.drafts.quant import QuantRecord

    kind = _kind(path)
    if kind is None:
        return path.name
    record = QuantRecord.read(path)
    return kind if record is None else f"{kind}@{record.config.label}"


def discover_drafts(artifacts_root: str | Path, fingerprint: str) -> dict[str, Path]:
    """Drafts filed for this target: dirs under `targets/<fp>/drafts/` with a draftsmith.json, and the
    registry's entries that are not retired. Labelled by kind; by dir name when a kind repeats."""
    artifacts = Artifacts(Path(artifacts_root))
    home = artifacts.target_home(fingerprint)
    paths: list[Path] = sorted(p.parent for p in (home / "drafts").glob(f"*/{DRAFT_META_FILE}"))
    manifest = artifacts.registry_manifest(fingerprint)
    if manifest.is_file():
        try:
            entries = json.loads(manifest.read_text()).get("entries", [])
        except json.JSONDecodeError:
            entries = []
        paths += [Path(e["path"]) for e in entries if e.get("status") != "retired" and e.get("path")]
    unique: dict[Path, Path] = {}
    for p in paths:
        unique.setdefault(p.resolve(), p)
    found = list(unique.values())
    kinds = [_label(p) for p in found]
    return {(k if kinds.count(k) == 1 else p.name): p for k, p in zip(kinds, found)}


def collect_drafts(explicit: dict[str, str | Path], artifacts_root: str | Path, fingerprint: str,
                   discover: bool) -> list[DraftSource]:
    """Explicit drafts (their labels kept) plus discovered ones not already given."""
    chosen = {name: Path(p) for name, p in explicit.items()}
    if discover:
        taken = {p.resolve() for p in chosen.values() if p.exists()}
        for name, p in discover_drafts(artifacts_root, fingerprint).items():
            if p.resolve() not in taken:
                chosen.setdefault(name if name not in chosen else f"{name}-{p.name}", p)
    return [DraftSource(name, p, _kind(p)) for name, p in chosen.items()]


def gather_prompts(cfg: EvalConfig, artifacts_root: str | Path,
                   target_dir: str | Path) -> tuple[dict[str, list[str]], list[SkippedEntry]]:
    """Held-out prompts per domain (eval.prompts, else the target's corpus eval split) plus the
    external benchmark domains; every domain that cannot be had is a skipped entry (method "*")."""
    from draftsmith.serve_eval.eval.external_datasets import load_domains

    prompts: dict[str, list[str]] = {}
    skipped: list[SkippedEntry] = []
    external = list(cfg.external_domains)
    external_names = {e.domain for e in external}
    local_domains = [d for d in cfg.domains if d not in external_names]
    if local_domains or not external or cfg.prompts:
        path = Path(cfg.prompts) if cfg.prompts else find_corpus_eval_split(artifacts_root, target_dir)
        prompts, skipped = group_prompts(load_prompt_records(path), local_domains, cfg.prompts_of, str(path))
    if external:
        loaded = load_domains(external, cfg.allow_download)
        for domain, items in loaded.prompts.items():
            if not cfg.domains or domain in cfg.domains:
                prompts[domain] = items[:cfg.prompts_of(domain)]
        skipped += [SkippedEntry(s["domain"], "*", s["reason"]) for s in loaded.skipped]
    return prompts, skipped
