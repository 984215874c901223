"""Pipeline stages ``generate`` and ``distill_<kind>``: one distillation dataset, then one draft per kind.

``generate`` regenerates answers to the corpus's distill prompts (every domain) with the target through the
serve_eval engine, ONCE for all kinds: its teacher-forced pass stores the union of what the planned kinds
need (final-norm hidden for Medusa / EAGLE-1, plus the aux layers for EAGLE-3 in offline mode, top-k
log-probs for token-level KD). Offline mode is the fast path on a CPU: a draft step then reads cached
features instead of running the target.

Each ``distill_<kind>`` trains with ``draftsmith.train.distill.run.train_and_export`` in this process and exports to
``artifacts/targets/<fp>/drafts/<kind>-<key>/``, where key = hash(target fingerprint, data manifest key,
draft config, trainer settings that change the loss trajectory, seed). A finished export (marked
``.complete``) makes the stage a cache hit on the next run; an interrupted one resumes from the
trainer's last checkpoint.

Configs: the draft of kind K is ``conf/draft/K.yaml`` (or the ``draft`` group when it already is K, so
``draftsmith pipeline draft=eagle3 draft.ttt_steps=2`` reaches the eagle3 stage), with ``data`` set to
``pipeline.data`` and then ``pipeline.drafts.K`` merged on; the trainer is the ``train`` group +
``pipeline.train`` + ``pipeline.train_by_kind.K``.
"""

from __future__ import annotations

import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from draftsmith.drafts.kinds import KIND_NAMES
from draftsmith.train.pipeline.context import PipelineContext, need

STAGE_PREFIX = "distill_"
DONE_MARKER = ".complete"  # written after a draft dir is fully exported


def planned_kinds(cfg: DictConfig) -> list[str]:
    """Draft kinds whose distill stage is in ``pipeline.stages``, in stage order."""
    return [name[len(STAGE_PREFIX):] for name in cfg.pipeline.stages if name.startswith(STAGE_PREFIX)]


def _open_plain_dicts(node: DictConfig) -> None:
    """Let dict-typed fields (e.g. EvalConfig.drafts) take new keys; dataclass fields stay closed."""
    for key in node.keys():
        child = node._get_node(key)
        if isinstance(child, DictConfig) and not child._is_none():
            if OmegaConf.get_type(child) is dict:
                OmegaConf.set_struct(child, False)
            else:
                _open_plain_dicts(child)


def merge_checked(base: Any, override: Any, field: str) -> DictConfig:
    """Override a typed node; an unknown key or a wrong type is a ValueError naming ``field``."""
    base = base.copy()
    _open_plain_dicts(base)
    try:
        return OmegaConf.merge(base, override)
    except OmegaConfBaseException as err:
        raise ValueError(f"{field}: {err}".splitlines()[0]) from None


def as_dict(node: Any) -> dict[str, Any]:
    return OmegaConf.to_container(node, resolve=True) if node is not None else {}


def compose_entry(group: str, entry: str) -> DictConfig:
    """``conf/<group>/<entry>.yaml`` composed by Hydra and typed by its schema (inside a running job or not)."""
    from hydra.core.global_hydra import GlobalHydra

    if GlobalHydra.instance().is_initialized():  # inside a Hydra app: compose against its config search path
        from hydra import compose

        return compose(config_name="config", overrides=[f"{group}={entry}"])[group]
    from draftsmith.train.config import compose as compose_root

    return compose_root([f"{group}={entry}"])[group]


def shared_data(cfg: DictConfig) -> DictConfig:
    """``pipeline.data`` over DraftDataConfig defaults: the dataset every draft of this run trains on."""
    from draftsmith.drafts.schemas import DraftDataConfig

    return merge_checked(OmegaConf.structured(DraftDataConfig), cfg.pipeline.data, "pipeline.data")


def draft_config(cfg: DictConfig, kind: str) -> DictConfig:
    if kind not in KIND_NAMES:
        raise ValueError(f"pipeline.stages: {STAGE_PREFIX}{kind}: {kind!r} is not a draft kind ({', '.join(KIND_NAMES)})")
    overrides = as_dict(cfg.pipeline.drafts.get(kind))
    if "data" in overrides:
        raise ValueError(f"pipeline.drafts.{kind}.data: every draft trains on the one dataset; set pipeline.data")
    base = cfg.draft if cfg.draft.get("kind") == kind else compose_entry("draft", kind)
    node = merge_checked(base, {"data": as_dict(shared_data(cfg))}, f"pipeline.data (draft {kind})")
    return merge_checked(node, overrides, f"pipeline.drafts.{kind}")


def trainer_node(cfg: DictConfig, kind: str) -> DictConfig:
    node = merge_checked(cfg.train, cfg.pipeline.train, "pipeline.train")
    return merge_checked(node, cfg.pipeline.train_by_kind.get(kind) or {}, f"pipeline.train_by_kind.{kind}")


def job_config(cfg: DictConfig, kind: str) -> DictConfig:
    """The root config a ``draftsmith distill draft=<kind>`` job with the pipeline's settings would see."""
    job = cfg.copy()
    with open_dict(job):
        job.draft = draft_config(cfg, kind)
        job.train = trainer_node(cfg, kind)
    return job


def _num_target_layers(model_dir: Path) -> int:
    from transformers import AutoConfig

    return int(AutoConfig.from_pretrained(str(model_dir)).num_hidden_layers)


def union_extras(needs: list[Any]) -> Any:
    """The smallest StoredExtras covering every kind's needs (one dataset for all)."""
    from draftsmith.train.distill.gendata import StoredExtras

    # every aux layer a kind reads, once and in ascending order (one key whichever kind asks first); each kind reads
    # its own, in its order (gendata.aux_columns)
    aux = sorted({layer for need in needs for layer in need.aux_layers})
    return StoredExtras(final_hidden=any(n.final_hidden for n in needs), aux_layers=aux,
                        topk=max((n.topk for n in needs), default=0))


def stage_generate(ctx: PipelineContext) -> dict[str, Any]:
    from draftsmith.drafts.schemas import DraftDataConfig
    from draftsmith.train.distill.gendata import Manifest
    from draftsmith.train.distill.run import dataset_needs
    from draftsmith.train.distill.dataset.build import generate_dataset

    target, corpus = need(ctx.results.target, "target"), need(ctx.results.corpus, "corpus")
    num_layers = _num_target_layers(target.model_dir)
    needs = [dataset_needs(kind, draft_config(ctx.cfg, kind), num_layers) for kind in planned_kinds(ctx.cfg)]
    extras = union_extras(needs)
    data = DraftDataConfig(**as_dict(shared_data(ctx.cfg)))
    root = ctx.artifacts.data_dir(target.fingerprint)
    if ctx.forced("generate") and data.path:
        raise ValueError("pipeline.force: generate cannot rebuild pipeline.data.path (a dataset given by path)")
    complete_before = {p for p in root.glob("*") if (p / "manifest.json").is_file() and Manifest.read(p).complete}
    records = corpus.records("distill")
    data_dir = generate_dataset(Path(target.model_dir), target.fingerprint, records, data, extras, root)
    if ctx.forced("generate") and data_dir in complete_before:  # rebuild exactly this keyed entry
        shutil.rmtree(data_dir)
        complete_before.discard(data_dir)
        data_dir = generate_dataset(Path(target.model_dir), target.fingerprint, records, data, extras, root)
    ctx.results.dataset = data_dir
    manifest = Manifest.read(data_dir)
    return {"cached": data_dir in complete_before, "dir": data_dir, "examples": manifest.num_examples,
            "extras": ",".join(f"{k}={v}" for k, v in asdict(extras).items()).replace(" ", "")}


@dataclass(frozen=True)
class DraftPlan:
    """What a ``distill_<kind>`` stage trains and where it lands (picklable: a side-by-side worker trains from it)."""

    kind: str
    job: DictConfig            # the root config a ``draftsmith distill draft=<kind>`` job would see
    target_dir: str
    fingerprint: str
    data_dir: str
    out_dir: Path              # artifacts/targets/<fp>/drafts/<kind>-<key>
    cached: bool               # a finished export is there (and the stage is not forced)

    @property
    def minutes(self) -> float:
        """Its wall-clock cap (train.max_minutes), 0 when uncapped: what lanes are balanced by."""
        return float(self.job.train.get("max_minutes") or 0.0)


def draft_plan(ctx: PipelineContext, kind: str) -> DraftPlan:
    from draftsmith.train.distill.gendata import Manifest
    from draftsmith.train.distill.launch import LauncherConfig
    from draftsmith.train.distill.run import run_key

    target, data_dir = need(ctx.results.target, "target"), need(ctx.results.dataset, "generate")
    job = job_config(ctx.cfg, kind)
    launcher = LauncherConfig(**as_dict(job.launcher))
    if launcher.world_size > 1:
        raise ValueError(f"launcher: the pipeline trains drafts in its own process; for {launcher.world_size} "
                         f"processes run `draftsmith distill draft={kind} launcher={launcher.name}`")
    key = run_key(job, target.fingerprint, Manifest.read(data_dir).key)
    out_dir = ctx.artifacts.drafts_dir(target.fingerprint) / f"{kind}-{key}"
    cached = (out_dir / DONE_MARKER).is_file() and not ctx.forced(f"{STAGE_PREFIX}{kind}")
    return DraftPlan(kind, job, str(target.model_dir), target.fingerprint, str(data_dir), out_dir, cached)


def train_draft(plan: DraftPlan) -> None:
    """Train and export one planned draft into its dir, marked complete once fully written."""
    from draftsmith.train.distill.run import Prepared, train_and_export

    shutil.rmtree(plan.out_dir, ignore_errors=True)  # a half-written export of an interrupted run
    train_and_export(plan.job, Prepared(plan.target_dir, plan.fingerprint, plan.data_dir), out_dir=plan.out_dir)
    (plan.out_dir / DONE_MARKER).write_text("")


def distill(ctx: PipelineContext, kind: str) -> dict[str, Any]:
    """The ``distill_<kind>`` stage: train the draft unless it is cached (or a side-by-side group trained it
    this run, side_by_side.train_group), then record it and return its log fields."""
    from draftsmith.drafts.io import read_draft_meta

    plan = draft_plan(ctx, kind)
    trained_here = kind in ctx.results.trained_side_by_side
    if not plan.cached and not trained_here:
        train_draft(plan)
    ctx.results.drafts[kind] = plan.out_dir
    metrics = read_draft_meta(plan.out_dir).metrics
    fields = {"cached": plan.cached and not trained_here, "dir": plan.out_dir, "steps": metrics.get("steps")}
    if trained_here:
        fields["side_by_side"] = True  # (trained beside other kinds; the group's line has the wall time)
    if metrics.get("stopped_by_time_cap"):
        fields["stopped_by_time_cap"] = True  # (train.max_minutes cut in; the trainer logged the step)
    if metrics.get("annealed_to_time_cap"):
        fields["annealed_to_time_cap"] = True  # (... by design: the LR schedule decayed over the cap's minutes)
    for name in ("eval/simulated_tau", "eval/loss", "train_tokens_per_s", "draft_vocab_coverage"):
        if isinstance(metrics.get(name), (int, float)):
            fields[name.replace("eval/", "")] = round(float(metrics[name]), 4)
    return fields
