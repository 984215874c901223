"""The retrain hook's data and distillation collaborators, as the keyword-only calls it makes.

``draftsmith.train.hook`` names its collaborators ``module:function`` and calls them by keyword only:

    regenerate(*, target_dir, plan, out_dir, overrides) -> data dir
    distill(*, kind, target_dir, data, init_from, out_dir, parent_run, overrides) -> draft dir

``draftsmith.train.distill.dataset.job`` and ``draftsmith.train.distill.run`` are Hydra jobs that pick their own cache dirs from the
config; these thin adapters compose the same config (``overrides`` are the hook's pass-through
``key=value`` tokens, e.g. ``artifacts_root=``, ``++train.max_steps=``) and steer the jobs' building
blocks to the directories the hook chose, so a hook run never reuses or resumes someone else's
cache entry by accident.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

# Overrides the adapters set themselves: the caller's value for these would contradict the call.
_REGENERATE_KEYS = ("target.path", "draft.data.path")
_DISTILL_KEYS = (*_REGENERATE_KEYS, "draft", "draft.init_from", "train.output_dir")


def _key(item: str) -> str:
    return item.partition("=")[0].lstrip("+~")


def compose_for(target_dir: Path, overrides: list[str], extra: list[str] = (), owned: tuple[str, ...] = _DISTILL_KEYS) -> Any:
    """The job config for ``target_dir`` with the caller's overrides, less the ``owned`` keys we set (``extra``)."""
    from draftsmith.train.config import compose

    kept = [item for item in overrides if _key(item) not in owned]
    return compose([*kept, f"target.path={Path(target_dir).resolve()}", *extra])


def planned_records(records: list[dict[str, str]], plan: dict[str, float], limit: int | None) -> list[dict[str, str]]:
    """The distill prompts a full job would use (``limit`` = draft.data.max_prompts, round-robin over
    domains), then per domain the first ``ceil(share * count)`` of them; domains not in ``plan`` drop out.

    So a regressed domain (share 1.0) gets exactly the prompts a from-scratch job would, and a replayed
    one a prefix of them.
    """
    from draftsmith.train.distill.dataset.settings import interleave_domains

    unknown = [d for d, share in plan.items() if not 0.0 <= share <= 1.0]
    if unknown:
        raise ValueError(f"regenerate plan: shares must be in [0, 1], got {({d: plan[d] for d in unknown})}")
    full = interleave_domains(records, limit)
    counts: dict[str, int] = {}
    for r in full:
        counts[r["domain"]] = counts.get(r["domain"], 0) + 1
    missing = sorted(d for d in plan if d not in counts)
    if missing:
        raise ValueError(f"regenerate plan: no distill prompts for domain(s) {missing} (corpus has {sorted(counts)})")
    keep = {d: math.ceil(plan.get(d, 0.0) * n) for d, n in counts.items()}
    taken: dict[str, int] = {}
    out = []
    for r in full:
        d = r["domain"]
        if taken.get(d, 0) < keep[d]:
            taken[d] = taken.get(d, 0) + 1
            out.append(r)
    return out


def regenerate(*, target_dir: str | Path, plan: dict[str, float], out_dir: str | Path, overrides: list[str]) -> Path:
    """Answer the planned share of each domain's distill prompts with ``target_dir``; data goes to ``out_dir``.

    The stored extras follow the ``draft`` in ``overrides`` (none by default: online-mode drafts and
    sequence-level KD read only the answers); the dataset format is train.distill.gendata's.
    """
    from transformers import AutoConfig

    from draftsmith.drafts.identity import target_fingerprint
    from draftsmith.train.artifacts import artifacts_from_config
    from draftsmith.train.corpus import build_corpus
    from draftsmith.train.distill.dataset.build import generate_dataset
    from draftsmith.train.distill.dataset.settings import data_config, extras_for

    target_dir, out_dir = Path(target_dir), Path(out_dir)
    # The data block lives in the draft schemas (the same for every kind); without a draft in the overrides,
    # standalone's defaults carry it (answers only, no stored extras).
    chosen = any(_key(item) == "draft" for item in overrides)
    cfg = compose_for(target_dir, overrides, [] if chosen else ["draft=standalone"], owned=_REGENERATE_KEYS)
    corpus, _ = build_corpus(cfg, artifacts_from_config(cfg))
    data = data_config(cfg.get("draft"))
    records = planned_records(corpus.records("distill"), plan, data.max_prompts)
    data.path, data.max_prompts = str(out_dir), None  # the plan already chose the prompts
    num_layers = int(AutoConfig.from_pretrained(str(target_dir)).num_hidden_layers)
    return generate_dataset(target_dir, target_fingerprint(target_dir), records, data,
                            extras_for(cfg.get("draft"), num_layers), out_dir.parent)


def distill(*, kind: str, target_dir: str | Path, data: str | Path, init_from: str | Path | None,
            out_dir: str | Path, parent_run: str | None, overrides: list[str]) -> Path:
    """Train a ``kind`` draft on the ``data`` dir (warm-started from ``init_from``) into ``out_dir``.

    The trainer's checkpoints go to ``<out_dir>.train`` (fresh per call: no stale resume). ``parent_run``
    (the previous draft's W&B run) is recorded in the draft's metrics so the lineage is kept.
    """
    from draftsmith.drafts.identity import target_fingerprint
    from draftsmith.train.distill.run import Prepared, train_and_export

    target_dir, data, out_dir = Path(target_dir).resolve(), Path(data).resolve(), Path(out_dir)
    own = [f"draft={kind}", f"++train.output_dir={out_dir.with_name(out_dir.name + '.train').resolve()}"]
    if init_from is not None:
        own.append(f"draft.init_from={Path(init_from).resolve()}")
    cfg = compose_for(target_dir, overrides, own)
    prepared = Prepared(str(target_dir), target_fingerprint(target_dir), str(data))
    result = train_and_export(cfg, prepared, out_dir=out_dir, extra_metrics={"parent_run": parent_run})
    if result is None:
        raise RuntimeError(f"distill {kind}: the launcher ran the job in other processes and exported no draft here; "
                           f"the hook needs launcher=local")
    return Path(result)
