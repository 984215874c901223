"""What the pipeline's stages share: the config, the artifacts root, the W&B run, and each stage's output.

A stage is ``fn(ctx: PipelineContext) -> dict``: it reads earlier stages' outputs from ``ctx.results``
(a ``StageResults``: one typed field per output), sets its own field, and returns the fields of its log
line. A field that must be there is read through ``need(ctx.results.<field>, "<stage>")``, which raises
``MissingStageResult`` when that stage has not run; the run loop adds the reading stage's name.
A new stage adds its field here (None until it runs) and its entry to ``draftsmith.train.pipeline.run.STAGES``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from omegaconf import DictConfig

from draftsmith.drafts.artifacts import Artifacts

if TYPE_CHECKING:  # (annotations only: train.corpus / train.target load torch)
    from draftsmith.train.corpus import Corpus
    from draftsmith.train.target import TargetResult

T = TypeVar("T")


@dataclass(frozen=True)
class CostResult:
    """The ``cost`` stage's output: its record file, c per draft kind, and the lines printed with the target."""

    file: Path
    c: dict[str, float]  # draft kind -> cost ratio c
    lines: list[str]


@dataclass(frozen=True)
class SummaryReport:
    """The ``report`` stage's output: the summary table, its notes (skips, warnings, parity flags), report files."""

    table: str
    notes: list[str]
    json: Path
    markdown: Path


@dataclass
class StageResults:
    """Each stage's output; None (or empty) until the stage that produces it has run."""

    corpus: Corpus | None = None  # corpus
    tokenizer: Path | None = None  # tokenizer (None also when target.path brings its own)
    target: TargetResult | None = None  # target
    dataset: Path | None = None  # generate: the distillation data dir, one for every planned kind
    drafts: dict[str, Path] = field(default_factory=dict)  # distill_<kind>: kind -> draft dir, in stage order
    trained_side_by_side: set[str] = field(default_factory=set)  # kinds a side-by-side group trained this run
    variants: dict[str, Path] = field(default_factory=dict)  # quantize: <kind>@<label> -> quantized draft dir
    cost: CostResult | None = None  # cost
    eval_dir: Path | None = None  # eval: the report dir
    report: SummaryReport | None = None  # report
    registry_manifest: Path | None = None  # register
    recipe_warnings: list[str] = field(default_factory=list)  # the run's config check, before any stage


class MissingStageResult(ValueError):
    """A stage read an output that no earlier stage produced: ``pipeline.stages`` lacks it or has it later."""

    def __init__(self, producer: str, reader: str | None = None):
        self.producer, self.reader = producer, reader
        who = repr(reader) if reader else "a stage"
        super().__init__(f"pipeline.stages: {who} needs the {producer!r} stage before it")

    def read_by(self, reader: str) -> MissingStageResult:
        return MissingStageResult(self.producer, reader)


def need(value: T | None, producer: str) -> T:
    """``value`` when stage ``producer`` has run (set it), else MissingStageResult naming that stage."""
    if value is None:
        raise MissingStageResult(producer)
    return value


@dataclass
class PipelineContext:
    cfg: DictConfig
    artifacts: Artifacts
    run: Any  # W&B run (or a no-op stand-in)
    results: StageResults = field(default_factory=StageResults)
    wall_s: dict[str, float] = field(default_factory=dict)  # stage name -> its wall time (printed at the end)

    def forced(self, stage_name: str) -> bool:
        return stage_name in self.cfg.pipeline.force
