"""Structured config schemas for every draftsmith Hydra job, and the one way to start a job.

Hydra composes ``conf/config.yaml``; the dataclasses here are registered in Hydra's ConfigStore
so that an unknown key or a value of the wrong type fails while composing, with Hydra's own
message, before any job code runs.

Groups fall in two kinds:

* ``target``, ``data``, ``pipeline`` and ``wandb`` are typed by the schemas below (root fields).
* ``draft``, ``train``, ``serve``, ``eval``, ``launcher`` are *open groups*: the root leaves them
  untyped and each YAML entry picks its own schema in its defaults list (``- schema_<name>``).
  Rooms that own those groups ship schemas without editing this file: a module listed in
  ``SCHEMA_PROVIDERS`` exposes ``SCHEMAS = {"<group>/schema_<name>": SomeDataclass}``.
  An entry that forgets its schema is refused at start (see ``check_open_groups``).
See docs/interfaces.md, "Configuration" for the recipe.
"""

from __future__ import annotations

import errno
import functools
import os
from collections.abc import Callable
from dataclasses import dataclass, field, is_dataclass
from pathlib import Path
from typing import Any

from omegaconf import MISSING, DictConfig, OmegaConf

from draftsmith import CONF_DIR

OPEN_GROUPS = ("draft", "train", "serve", "eval", "launcher")

# Modules that may register schemas for the open groups; a missing module is skipped.
SCHEMA_PROVIDERS = ("draftsmith.drafts.schemas", "draftsmith.serve_eval.schemas", "draftsmith.train.distill.schemas")   # see _provider_schemas


@dataclass
class TargetConfig:
    """The target LLM: either the embedded Llama trained here, or ``path`` to any HF checkpoint."""

    name: str = "embedded"
    path: str | None = None  # set -> use this HF Llama-family dir; nothing is trained
    # Architecture of the embedded target (LlamaForCausalLM).
    vocab_size: int = 4096  # BPE vocabulary trained on the corpus (special tokens included)
    hidden_size: int = 256
    num_layers: int = 20  # deep and narrow: a 1-layer draft + the LM head is ~1/9 of the weights (real targets: 1/10-1/50)
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 704
    max_position: int = 1024
    tie_embeddings: bool = True
    rope_theta: float = 10000.0
    # Training of the embedded target.
    seq_len: int = 256
    batch_size: int = 8
    max_steps: int = 800
    max_minutes: float = 12.0  # wall-clock cap; training stops early (and says so) if reached
    anneal_to_time_cap: bool = True  # LR schedule also counts elapsed/max_minutes (ends annealed if capped)
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 30
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    bf16_autocast: bool | str = "auto"  # CPU bf16 autocast for the training forward/backward; auto: where it is fast
    num_threads: int = 2
    # With several threads the target trains in a worker process whose OpenMP workers spin up to this many
    # iterations between ops instead of sleeping (train.worker_process: 1.46x the steps on 2 cores; the embedded
    # profile sets it); null: in this process.
    omp_spin_count: int | None = None
    log_every: int = 10
    eval_records_per_domain: int = 48  # held-out records scored for per-domain perplexity
    eval_batch_size: int = 8


@dataclass
class DataConfig:
    """Prompt data: the embedded corpus (built from this machine's Python), or ``path``."""

    name: str = "embedded"
    path: str | None = None  # local .jsonl/.json/.parquet file, dataset dir, or HF dataset name
    split: str = "train"  # split read from ``path`` when it is a dataset with splits
    # A record of ``path`` missing a field or with an empty one: error (names file, line, field) | skip (counted)
    on_bad_record: str = "error"
    domains: list[str] = field(default_factory=lambda: ["code", "prose", "math", "chat"])
    eval_per_domain: int = 64  # held-out eval prompts per domain
    distill_per_domain: int = 512  # distillation prompts per domain (taken from the rest)
    pool_per_domain: int = 3000  # records built per domain; the non-eval ones also pretrain the target
    max_source_files: int = 400  # stdlib .py files scanned for code and docstrings
    max_record_chars: int = 1600
    chat_turns: int = 2  # user/assistant exchanges per chat conversation


@dataclass
class PipelineConfig:
    """Which stages ``draftsmith pipeline`` runs, in order (names from train.pipeline.run.STAGES), and what
    the stages after the target use. The dict fields are overrides onto other schemas, checked (ValueError
    naming the field) when their stage starts; they apply to the pipeline only, so a profile never
    changes what ``draftsmith distill`` or ``draftsmith eval`` do on their own."""

    name: str = "embedded"
    stages: list[str] = field(default_factory=lambda: ["corpus", "tokenizer", "target"])
    force: list[str] = field(default_factory=list)  # stage names whose cache is ignored this run
    data: dict[str, Any] = field(default_factory=dict)  # DraftDataConfig fields: the one dataset all drafts share
    drafts: dict[str, Any] = field(default_factory=dict)  # kind -> fields of conf/draft/<kind>.yaml
    train: dict[str, Any] = field(default_factory=dict)  # TrainerConfig fields (over the `train` group), every kind
    train_by_kind: dict[str, Any] = field(default_factory=dict)  # kind -> TrainerConfig fields for that kind
    eval: dict[str, Any] = field(default_factory=dict)  # EvalConfig fields (over the `eval` group)
    # The `quantize` stage: weight-only copies of this run's drafts, each {draft: kind, bits, group_size,
    # quantize_head} (drafts.quant.QuantConfig fields, checked when the stage starts), evaluated beside their source.
    quantize: list[dict[str, Any]] = field(default_factory=list)
    # The `cost` stage: decode steps x interleaved repetitions per draft (at the largest eval K).
    cost_steps: int = 8
    cost_repeats: int = 3
    # Consecutive distill_<kind> stages train in this many worker processes at once, each on cores / workers
    # intra-op threads (train.pipeline.side_by_side); 1 = one after another in this process, on every core.
    distill_workers: int = 1


@dataclass
class WandbConfig:
    mode: str = "offline"  # offline | online | disabled
    project: str = "draftsmith"
    entity: str | None = None


@dataclass
class DraftsmithConfig:
    """Root schema; ``conf/config.yaml`` starts its defaults list with it."""

    artifacts_root: str = "artifacts"
    seed: int = 0
    # `generate` answers through: engine (in process) | openai (an external OpenAI-compatible server at endpoint)
    backend: str = "engine"
    endpoint: str | None = None  # e.g. http://HOST:PORT/v1 (vLLM, SGLang, `draftsmith serve`)
    endpoint_concurrency: int = 8
    endpoint_logprobs: int = 0  # top-k logprobs asked per answer token (recorded when the server offers them)
    target: TargetConfig = field(default_factory=TargetConfig)
    data: DataConfig = field(default_factory=DataConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    # Open groups: typed by the schema each entry selects.
    draft: Any = MISSING
    train: Any = MISSING
    serve: Any = MISSING
    eval: Any = MISSING
    launcher: Any = MISSING


# Placeholder schemas for today's default entries of the open groups. Owners replace the
# defaults with entries that select their own schemas.
@dataclass
class NoDraftConfig:
    kind: str = "none"


@dataclass
class PlaceholderConfig:
    name: str = "default"


BUILTIN_SCHEMAS: dict[str, type] = {
    "target/schema_target": TargetConfig,
    "data/schema_data": DataConfig,
    "pipeline/schema_pipeline": PipelineConfig,
    "draft/schema_none": NoDraftConfig,
    "train/schema_default": PlaceholderConfig,
    "serve/schema_default": PlaceholderConfig,
    "eval/schema_default": PlaceholderConfig,
    "launcher/schema_local": PlaceholderConfig,
}


def _provider_schemas() -> dict[str, type]:
    from draftsmith.drafts import schemas as draft_schemas
    from draftsmith.serve_eval import schemas as serve_eval_schemas
    from draftsmith.train.distill import schemas as distill_schemas

    return {**draft_schemas.SCHEMAS, **serve_eval_schemas.SCHEMAS, **distill_schemas.SCHEMAS}


@functools.cache
def register_schemas() -> None:
    """Store the root schema and every group schema in Hydra's ConfigStore (once per process)."""
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    store.store(name="draftsmith_schema", node=DraftsmithConfig)
    for key, node in {**BUILTIN_SCHEMAS, **_provider_schemas()}.items():
        group, _, name = key.rpartition("/")
        if not group or not is_dataclass(node):
            raise ValueError(f"schema provider entry {key!r}: key must be 'group/name' and value a dataclass")
        store.store(group=group, name=name, node=node)


def check_open_groups(cfg: DictConfig) -> None:
    """Refuse an open-group entry that selected no schema (its keys would go unchecked)."""
    for group in OPEN_GROUPS:
        node = cfg.get(group)
        if node is None or OmegaConf.get_type(node) in (dict, None):
            raise ValueError(
                f"config group '{group}': the selected entry has no schema; start its YAML with "
                f"'defaults: [schema_<name>, _self_]' (see docs/interfaces.md, Configuration)"
            )


def hydra_app(task: Callable[[DictConfig], Any], config_name: str = "config") -> Callable[[], Any]:
    """Wrap ``task(cfg)`` as a Hydra app over conf/ (CLI overrides, ``-m`` multirun, ``--cfg``)."""
    import hydra

    register_schemas()

    @functools.wraps(task)
    def checked_task(cfg: DictConfig) -> Any:
        try:
            check_open_groups(cfg)
            return task(cfg)
        except (ValueError, OSError) as err:
            # Bad input is reported in one line naming the file/field; DRAFTSMITH_TRACEBACK=1 shows the stack.
            # Of OSErrors, only a full disk or quota is the user's to fix; the rest are bugs to see whole.
            if os.environ.get("DRAFTSMITH_TRACEBACK") or (
                    isinstance(err, OSError) and err.errno not in (errno.ENOSPC, errno.EDQUOT)):
                raise
            raise SystemExit(f"draftsmith: error: {err}") from None

    app = hydra.main(version_base=None, config_path=str(CONF_DIR), config_name=config_name)(checked_task)

    @functools.wraps(app)
    def main(*args: Any, **kwargs: Any) -> Any:
        # Checked at run time, not import: importing a job module must not need the configs.
        if not (CONF_DIR / f"{config_name}.yaml").is_file():
            raise SystemExit(f"draftsmith: error: no {config_name}.yaml in {CONF_DIR}: the configs are the conf/ "
                             "folder of a draftsmith checkout; an installed copy sets DRAFTSMITH_CONF to it")
        return app(*args, **kwargs)

    return main


def compose(overrides: list[str] | None = None, config_name: str = "config") -> DictConfig:
    """Compose the config without running a job (tests, notebooks)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    register_schemas()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = hydra_compose(config_name=config_name, overrides=overrides or [])
    check_open_groups(cfg)
    return cfg
