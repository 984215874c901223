"""``draftsmith drafts list|show|add|promote|retire``: the registry's command line."""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import asdict
from pathlib import Path

from draftsmith.train.registry.records import STATUSES, DraftEntry, RegisteredTarget
from draftsmith.train.registry.store import DEFAULT_LOCK_TIMEOUT_S, Registry, RegistryLockedError


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
    from draftsmith.serve_eval.eval.report import ReportSchemaError, load_report

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
    for line in lineage_lines(entry):
        console.print(line, soft_wrap=True, markup=False)


def lineage_lines(entry: DraftEntry) -> list[str]:
    """The entry's W&B lineage: the chain of types, then one line per artifact with where it lives."""
    if not entry.lineage:
        return [f"{'lineage':>20}: none recorded (W&B disabled or failing, or registered by hand)"]
    lines = [f"{'lineage':>20}: " + " -> ".join(ref.type for ref in entry.lineage)]
    for ref in entry.lineage:
        where = (f"W&B id {ref.id} ({ref.version})" if ref.id
                 else f"offline run {ref.run_id} ({ref.run_dir})" if ref.run_id else "not in W&B")
        uses = ", ".join(u.split("@")[0] for u in ref.uses) or "-"
        lines.append(f"{ref.type:>20}: {ref.name}@{ref.digest[:8]}  uses {uses}  {where}")
    return lines


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
            entry = registry.add(args.draft_dir, RegisteredTarget.from_dir(args.target_dir), report_path=report,
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
