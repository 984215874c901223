"""Pipeline stage ``quantize``: weight-only INT8 / INT4 copies of this run's drafts, for ``eval`` to measure beside them.

``pipeline.quantize`` lists the variants, each ``{draft: <kind>, bits: 8 | 4, group_size: 32 | 64 | 128 | 256,
quantize_head: false}`` (drafts.quant.QuantConfig fields; int8 is per channel and takes no group size). Each is
made by drafts.quantize_job from the draft its ``distill_<kind>`` stage produced, into the sibling dir
``<draft dir>-<label>`` (the draft dir's name carries its inputs' key, so the same source and config give the
same dir: a rerun finds it complete and skips it; ``pipeline.force=[quantize]`` redoes it). The stage's output,
``results.variants``, maps ``<kind>@<label>`` (e.g. ``standalone@int4-g64``) to that dir; the eval runs each as
its own method row beside its source (serve_eval.eval.variants).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from draftsmith.train.pipeline.context import PipelineContext, need
from draftsmith.train.pipeline.distill import STAGE_PREFIX, as_dict, planned_kinds

_FIELDS = ("draft", "bits", "group_size", "quantize_head")


@dataclass(frozen=True)
class PlannedVariant:
    kind: str        # the draft kind it is a variant of (its distill_<kind> stage's output)
    config: Any      # drafts.quant.QuantConfig (validated)

    @property
    def label(self) -> str:
        return f"{self.kind}@{self.config.label}"


def planned_variants(cfg: DictConfig) -> list[PlannedVariant]:
    """``pipeline.quantize`` as checked variants; ValueError naming ``pipeline.quantize[i].<field>``."""
    from draftsmith.drafts.quant import QuantConfig

    kinds = planned_kinds(cfg)
    planned: list[PlannedVariant] = []
    for i, entry in enumerate(as_dict(cfg.pipeline.quantize)):
        where = f"pipeline.quantize[{i}]"
        if not isinstance(entry, dict):
            raise ValueError(f"{where}: expected a mapping with fields {list(_FIELDS)}, got {entry!r}")
        unknown = sorted(set(entry) - set(_FIELDS))
        if unknown:
            raise ValueError(f"{where}: unknown field(s) {unknown}; allowed fields: {list(_FIELDS)}")
        kind = entry.get("draft")
        if kind not in kinds:
            raise ValueError(f"{where}.draft: {kind!r} is not a draft this pipeline distills; allowed values: {kinds}")
        bits = entry.get("bits", 4)
        group = entry.get("group_size", 64 if bits == 4 else None)
        try:
            config = QuantConfig(bits, group, bool(entry.get("quantize_head", False)))
        except ValueError as err:   # "quant.<field>: ... allowed values ..."
            raise ValueError(f"{where}: {err}") from None
        variant = PlannedVariant(kind, config)
        if any(v.label == variant.label for v in planned):
            raise ValueError(f"{where}: {variant.label} is listed twice")
        planned.append(variant)
    return planned


SOURCE_STAMP = "source_stamp.json"  # the source draft's files (name, size, mtime) when the copy was made


def _source_stamp(source: Path) -> str:
    """What changes when the source draft is rewritten in place (`pipeline.force=[distill_<kind>]` retrains
    into the same dir): a copy made from older weights must not be reused."""
    from draftsmith.drafts.files import stable_hash

    files = sorted(p for p in source.iterdir() if p.is_file())
    return stable_hash([[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in files])


def _is_current(out: Path, source: Path, config: Any) -> bool:
    """A complete quantized copy of `source`, as it is now, made with `config` (what a rerun may reuse)."""
    from draftsmith.drafts.files import COMPLETE_MARKER
    from draftsmith.drafts.quant import QuantRecord

    record = QuantRecord.read(out) if (out / COMPLETE_MARKER).is_file() else None
    stamp = out / SOURCE_STAMP
    return (record is not None and record.config == config and record.source == str(source.resolve())
            and stamp.is_file() and stamp.read_text() == _source_stamp(source))


def quantize_variant(source: Path, variant: PlannedVariant, force: bool) -> tuple[Path, bool]:
    """(the variant's dir, cached): quantized into a temporary dir that replaces the entry when complete."""
    from draftsmith.drafts.files import atomic_dir
    from draftsmith.drafts.quantize_job import quantize_dir

    out = source.with_name(f"{source.name}-{variant.config.label}")
    if not force and _is_current(out, source, variant.config):
        return out, True
    with atomic_dir(out) as tmp:
        quantize_dir(source, variant.config, tmp)
        (tmp / SOURCE_STAMP).write_text(_source_stamp(source))
    return out, False


def stage_quantize(ctx: PipelineContext) -> dict[str, Any]:
    variants = planned_variants(ctx.cfg)
    fields: dict[str, Any] = {}
    for variant in variants:
        source = need(ctx.results.drafts.get(variant.kind), f"{STAGE_PREFIX}{variant.kind}")
        out, cached = quantize_variant(Path(source), variant, ctx.forced("quantize"))
        ctx.results.variants[variant.label] = out
        fields[variant.label] = "cached" if cached else "done"
    return fields or {"variants": "none (pipeline.quantize is empty)"}
