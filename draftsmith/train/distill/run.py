"""``draftsmith distill draft=standalone|medusa|eagle|eagle3`` / ``python -m draftsmith.train.distill.run``.

One Hydra job for every draft kind: resolve the target (the pipeline's cached corpus -> tokenizer -> target),
build or reuse the distillation data (train.distill.dataset), build the draft and its objective, train with the
generic trainer (train.distill.trainer; DDP/FSDP/DeepSpeed from conf/launcher), and export a draft dir with
draftsmith.json into ``artifacts/targets/<fingerprint>/drafts/<kind>-<run key>/``.

    draftsmith distill draft=eagle3 draft.mode=offline train.max_steps=500
    draftsmith distill draft=standalone draft.loss=token_kd draft.divergence=jsd draft.on_policy_fraction=0.25
    draftsmith distill draft=medusa launcher=ddp           # relaunches itself under torchrun (2 ranks)
    draftsmith distill draft=eagle draft.init_from=artifacts/targets/<fp>/drafts/eagle-<key>   # warm start

Data preparation happens once, in the launching process; launched ranks receive its result through
DRAFTSMITH_DISTILL_PREPARED and go straight to training.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from draftsmith.drafts.files import stable_hash
from draftsmith.drafts.kinds import KIND_NAMES, KINDS

from draftsmith.train.artifacts import artifacts_from_config
from draftsmith.train.config import hydra_app
from draftsmith.train.distill.gendata import DistillDataset, Manifest, StoredExtras
from draftsmith.train.logs import init_wandb, log_event

PREPARED_ENV = "DRAFTSMITH_DISTILL_PREPARED"
DEFAULT_OUTPUT_DIR = "artifacts/distill/run"  # TrainerConfig's default: replaced by the keyed dir below


@dataclass
class Prepared:
    target_dir: str
    fingerprint: str
    data_dir: str


# ----------------------------------------------------------------------------- checks


def check_tokenizer_match(target_dir: Path, other_dir: Path, what: str) -> None:
    """A draft dir that carries a tokenizer must carry the target's (same token -> id map)."""
    if not any((other_dir / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        return
    from transformers import AutoTokenizer

    ours, theirs = AutoTokenizer.from_pretrained(str(target_dir)).get_vocab(), AutoTokenizer.from_pretrained(str(other_dir)).get_vocab()
    if ours == theirs:
        return
    differing = sorted(set(ours.items()) ^ set(theirs.items()))
    token = differing[0][0]
    raise ValueError(
        f"{what} {other_dir}: tokenizer differs from the target's ({target_dir}): {len(theirs)} vs {len(ours)} tokens; "
        f"first difference: token {token!r} -> id {theirs.get(token)} in {what}, {ours.get(token)} in the target"
    )


def needs_teacher(kind: str, dcfg: Any) -> bool:
    if kind == "standalone":
        teacher_kind = dcfg.teacher if dcfg.teacher != "auto" else ("topk" if dcfg.data.topk_logits > 0 else "online")
        return dcfg.on_policy_fraction > 0 or (dcfg.loss == "token_kd" and teacher_kind == "online")
    return dcfg.mode == "online" or bool(dcfg.get("medusa2", False))


def dataset_needs(kind: str, dcfg: Any, num_target_layers: int) -> StoredExtras:
    from draftsmith.train.distill.dataset.settings import extras_for

    stored = extras_for(dcfg, num_target_layers)
    if kind == "standalone":
        hidden = dcfg.loss == "token_kd" and dcfg.teacher == "hidden"  # the full distribution via the target's head
        uses_topk = (dcfg.loss == "token_kd" and not needs_teacher(kind, dcfg) and not hidden) or dcfg.teacher == "topk"
        return StoredExtras(topk=stored.topk if uses_topk else 0, final_hidden=hidden)
    if dcfg.mode == "offline":
        # the block draft's teacher=topk reads the stored top-k labels (auto: the cached hidden's full distribution)
        topk = stored.topk if kind == "block" and dcfg.get("teacher") == "topk" else 0
        return StoredExtras(final_hidden=True, aux_layers=stored.aux_layers, topk=topk)
    return StoredExtras()


# ----------------------------------------------------------------------------- drafts


def token_counts(dataset: DistillDataset, vocab_size: int) -> torch.Tensor:
    """How often each target token is an answer token in the training examples (EAGLE-3 draft vocab)."""
    counts = torch.zeros(vocab_size, dtype=torch.float64)
    for i in dataset.indices:
        row = dataset.rows[i]
        answer = torch.tensor(row["input_ids"][row["prompt_length"]:], dtype=torch.long)
        counts += torch.bincount(answer.clamp(max=vocab_size - 1), minlength=vocab_size).double()
    return counts


def build_draft(kind: str, dcfg: Any, target_dir: Path, train_set: DistillDataset) -> nn.Module:
    from draftsmith.kernels.layers.checkpoint import load_target_embed_and_head, read_state_dict

    target_cfg = json.loads((target_dir / "config.json").read_text())
    embed, lm_head = load_target_embed_and_head(target_dir)
    if kind == "standalone":
        from draftsmith.drafts.common import target_layers
        from draftsmith.drafts.standalone import StandaloneDraft, init_from_target

        arch = {k: dcfg[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads") if dcfg[k] is not None}
        draft = StandaloneDraft.from_target_config(target_cfg, num_layers=dcfg.num_layers, **arch)
        layers = dcfg.get("init_target_layers")
        if layers is None and not dcfg.init_from_target:
            return draft
        state = read_state_dict(target_dir)
        if layers is not None:   # a wrong id or count is the user's error, not a width mismatch to skip
            layers = target_layers(state, [int(i) for i in layers], "draft.init_target_layers", count=draft.num_layers)
        if dcfg.init_from_target:
            try:
                init_from_target(draft, state, layers)
            except ValueError as err:  # other width than the target: nothing to copy, train from scratch
                log_event(stage="distill", init_from_target="skipped", reason=str(err)[:120])
        return draft
    if kind == "medusa":
        from draftsmith.drafts.medusa import MedusaDraft

        draft = MedusaDraft.from_target_config(target_cfg, num_heads=dcfg.num_heads, num_layers=dcfg.num_layers,
                                               shared_lm_head=dcfg.shared_lm_head)
        draft.init_from_target(lm_head)
        return draft
    if kind == "eagle":
        from draftsmith.drafts.eagle import EagleDraft

        draft = EagleDraft.from_target_config(target_cfg, fc_bias=dcfg.fc_bias)
        draft.init_from_target(embed, lm_head)
        if dcfg.get("init_layer_from_target"):
            draft.init_layer_from_target(read_state_dict(target_dir))
        return draft
    if kind == "block":
        from draftsmith.drafts.block import BlockDraft

        draft = BlockDraft.from_target_config(target_cfg, aux_layers=list(dcfg.aux_layers) if dcfg.aux_layers is not None else None,
                                              num_layers=dcfg.num_layers, block_size=dcfg.block_size,
                                              num_mask_tokens=dcfg.num_mask_tokens)
        draft.init_from_target(embed, lm_head)
        draft.init_layers_from_target(read_state_dict(target_dir))  # its last layers and final norm
        return draft
    from draftsmith.drafts.eagle3 import Eagle3Draft, build_reduced_vocab

    from draftsmith.train.recipes import reduced_vocab_size

    aux = list(dcfg.aux_layers) if dcfg.aux_layers is not None else None
    counts = token_counts(train_set, int(target_cfg["vocab_size"]))
    size, coverage = reduced_vocab_size(counts, dcfg.draft_vocab_size, dcfg.get("draft_vocab_coverage"))
    draft = Eagle3Draft.from_target_config(target_cfg, aux_layers=aux, draft_vocab_size=size)
    if size is not None:
        draft.set_vocab_map(*build_reduced_vocab(counts, size))
    draft.init_from_target(embed, lm_head)
    if dcfg.get("init_layer_from_target"):
        draft.init_layer_from_target(read_state_dict(target_dir))
    draft.vocab_coverage = coverage  # share of training answer tokens the draft vocabulary holds (exported)
    log_event(stage="distill", kind="eagle3", draft_vocab=size or int(target_cfg["vocab_size"]),
              target_vocab=int(target_cfg["vocab_size"]), vocab_coverage=round(coverage, 4))
    return draft


def warm_start(draft: nn.Module, kind: str, init_from: str, target_dir: Path) -> None:
    """Load an earlier draft's weights (the retrain hook's warm start); it may be for an older target."""
    from draftsmith.drafts.io import ExpectedTarget, load_draft

    source = Path(init_from).expanduser()
    if not source.is_dir():
        raise ValueError(f"draft.init_from: {source} is not a draft dir")
    from draftsmith.drafts.quant import refuse_quantized

    refuse_quantized(source, "draft.init_from")  # int weights are not trainable: warm-start from the source
    check_tokenizer_match(target_dir, source, "draft.init_from")
    loaded = load_draft(source, ExpectedTarget.from_config(target_dir, None))
    if loaded.kind != kind:
        raise ValueError(f"draft.init_from: {source} holds a {loaded.kind!r} draft, this job trains {kind!r}")
    ours, theirs = draft.state_dict(), loaded.model.state_dict()
    mismatched = [k for k in ours if k not in theirs or theirs[k].shape != ours[k].shape]
    if mismatched:
        k = mismatched[0]
        raise ValueError(f"draft.init_from: {source} does not match this draft's shape: {k} is "
                         f"{tuple(theirs[k].shape) if k in theirs else 'missing'} there, {tuple(ours[k].shape)} here")
    draft.load_state_dict(theirs)


def frozen_target(teacher: Any, launcher: Any, trains_target: bool) -> Any:
    """The teacher the trainer may shard: the frozen target of an online objective. launcher.shard_target with a
    target that trains (Medusa-2) is refused, one line; with no target in the loop there is nothing to shard."""
    if teacher is None:
        if launcher.shard_target:
            log_event(stage="distill", shard_target="skipped", reason="no target in the training loop (offline data)")
        return None
    if trains_target:  # Medusa-2: the LoRA deltas train, the target is inside the trained module
        if not launcher.shard_target:
            return None
        raise ValueError("launcher.shard_target: the target trains in this job (draft.medusa2=true), so it is part of "
                         "the trained module; shard it with launcher=fsdp instead")
    return teacher


def make_objective(kind: str, dcfg: Any, teacher: Any, target_dir: Path, draft: nn.Module) -> Any:
    from draftsmith.train.distill.objectives import make_objective as make

    return make(kind, dcfg, teacher, target_dir, draft)


def holdout_split(num_examples: int, fraction: float) -> tuple[list[int], list[int]]:
    """Evenly spaced held-out examples (the cache interleaves domains, so every domain is represented)."""
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"draft.data.eval_fraction must be in (0, 1), got {fraction}")
    num_eval = max(1, round(num_examples * fraction))
    if num_examples - num_eval < 1:
        raise ValueError(f"draft.data: {num_examples} examples leave none for training after {num_eval} held out")
    held = {int(i * num_examples / num_eval) for i in range(num_eval)}
    return [i for i in range(num_examples) if i not in held], sorted(held)


def trained_answers(dataset: DistillDataset, temperatures: list[float] | None) -> list[int]:
    """The examples a kind trains and is held out on: the answers generated at ``temperatures``
    (draft.train_temperatures; None: every example)."""
    if temperatures is None:
        return list(range(len(dataset)))
    wanted = {round(float(t), 6) for t in temperatures}
    generated = [round(t, 6) for t in dataset.answer_temperatures()]
    kept = [i for i, t in enumerate(generated) if t in wanted]
    if not kept:
        raise ValueError(f"draft.train_temperatures: {sorted(wanted)} matches no answer in {dataset.cache_dir}: its "
                         f"answers were generated at {sorted(set(generated))} (-1: corpus references)")
    return kept


# ----------------------------------------------------------------------------- the job


def prepare(cfg: DictConfig) -> Prepared:
    """Target + data cache (both cached; built here once, before any rank starts)."""

    from draftsmith.drafts.identity import tokenizer_hash
    from draftsmith.train.distill.dataset.job import dataset_for_job, ensure_target

    kind = cfg.draft.get("kind")
    if kind not in KINDS:
        raise ValueError(f"draft: {kind!r} is not a trainable draft kind; pick draft={'|'.join(KIND_NAMES)}")
    from draftsmith.train.recipes import check_recipe, planned_target_vocab

    check_recipe(kind, cfg.draft, planned_target_vocab(cfg))  # before the target and the data
    artifacts = artifacts_from_config(cfg)
    target_dir, fingerprint, corpus = ensure_target(cfg, artifacts)
    check_recipe(kind, cfg.draft, int(json.loads((Path(target_dir) / "config.json").read_text())["vocab_size"]))
    data_dir = dataset_for_job(cfg, artifacts, target_dir, fingerprint, corpus)
    manifest = Manifest.read(data_dir)
    target_tokens = tokenizer_hash(Path(target_dir)) or "no-tokenizer-files"
    if manifest.tokenizer_hash != target_tokens:
        raise ValueError(f"{data_dir / 'manifest.json'}: data was tokenized with tokenizer {manifest.tokenizer_hash}, "
                         f"the target's tokenizer is {target_tokens}")
    return Prepared(str(target_dir), fingerprint, str(data_dir))


def trainer_config(cfg: DictConfig, output_dir: Path) -> Any:
    from draftsmith.train.distill.trainer_config import TrainerConfig

    known = {f.name for f in fields(TrainerConfig)}
    values = {k: v for k, v in OmegaConf.to_container(cfg.train, resolve=True).items() if k in known}
    if values.get("output_dir", DEFAULT_OUTPUT_DIR) == DEFAULT_OUTPUT_DIR:
        values["output_dir"] = str(output_dir)
    return TrainerConfig(**values)


def read_throughput(metrics_file: Path) -> float | None:
    if not metrics_file.is_file():
        return None
    rates = [r["tokens_per_s"] for r in map(json.loads, metrics_file.read_text().splitlines()) if "tokens_per_s" in r]
    return sum(rates) / len(rates) if rates else None


def run_key(cfg: DictConfig, fingerprint: str, data_key: str, launcher: Any = None) -> str:
    """The key of a distill run, by what shapes the draft's weights only: target, data, draft config, the trainer's
    trajectory fields and seed. A rerun with another thread count or time cap (a pipeline switching
    pipeline.distill_workers, say) keeps the key. It names both the training run's dir (``run_name``, where its
    checkpoints resume from) and the pipeline's exported draft (``drafts/<kind>-<key>``). Across several processes
    (``launcher``) the layout joins it: checkpoints resume only under the same layout."""
    keyed = {"target": fingerprint, "data": data_key, "draft": OmegaConf.to_container(cfg.draft, resolve=True),
             "train": trainer_config(cfg, Path("unused")).trajectory_fields(), "seed": cfg.seed}
    if launcher is not None and launcher.world_size > 1:
        keyed["layout"] = {"strategy": launcher.strategy, "world_size": launcher.world_size,
                           "zero_stage": launcher.zero_stage if launcher.strategy == "deepspeed" else None}
    return stable_hash(keyed)


def run_name(cfg: DictConfig, fingerprint: str, data_key: str, launcher: Any) -> str:
    """``<kind>-<key>``: the training run's dir under ``targets/<fp>/distill/`` (run_key)."""
    return f"{cfg.draft.kind}-{run_key(cfg, fingerprint, data_key, launcher)}"


def train_and_export(cfg: DictConfig, prepared: Prepared, out_dir: Path | None = None,
                     extra_metrics: dict[str, Any] | None = None) -> Path | None:
    """Train and export; ``out_dir`` (default: the keyed drafts dir) and ``extra_metrics`` (into
    draftsmith.json) let the retrain hook (train.hook.jobs) choose where its candidate lands."""
    from draftsmith.train.distill.launch import LauncherConfig
    from draftsmith.train.distill.objectives.teacher import Teacher
    from draftsmith.train.distill.trainer import Trainer

    kind, dcfg = cfg.draft.kind, cfg.draft
    target_dir, fingerprint, data_dir = Path(prepared.target_dir), prepared.fingerprint, Path(prepared.data_dir)
    num_layers = int(json.loads((target_dir / "config.json").read_text())["num_hidden_layers"])
    dataset = DistillDataset(data_dir, fingerprint, dataset_needs(kind, dcfg, num_layers))
    answers = trained_answers(dataset, dcfg.get("train_temperatures"))
    if len(answers) < len(dataset):
        log_event(stage="distill", kind=kind, train_temperatures=list(dcfg.train_temperatures),
                  answers=f"{len(answers)}/{len(dataset)}")
    train_ids, eval_ids = holdout_split(len(answers), dcfg.data.eval_fraction)
    train_set, eval_set = dataset.subset([answers[i] for i in train_ids]), dataset.subset([answers[i] for i in eval_ids])
    torch.manual_seed(cfg.seed)  # the draft's initial weights depend on the config only (and agree across ranks)
    draft = build_draft(kind, dcfg, target_dir, train_set)
    if dcfg.init_from:
        warm_start(draft, kind, dcfg.init_from, target_dir)
    teacher = Teacher.from_dir(target_dir) if needs_teacher(kind, dcfg) else None
    objective = make_objective(kind, dcfg, teacher, target_dir, draft)

    draft_container = OmegaConf.to_container(dcfg, resolve=True)
    launcher = LauncherConfig(**OmegaConf.to_container(cfg.launcher, resolve=True))
    artifacts = artifacts_from_config(cfg)
    name = run_name(cfg, fingerprint, Manifest.read(data_dir).key, launcher)
    train_cfg = trainer_config(cfg, artifacts.target_dir(fingerprint) / "distill" / name)
    is_main = int(os.environ.get("RANK", "0")) == 0
    wandb_run = init_wandb(cfg, job_type="distill", wandb_dir=artifacts.wandb_dir, name=name) if is_main else None
    trainer = Trainer(train_cfg, objective, {"draft": draft}, train_set, eval_set, launcher=launcher,
                      run_config={"draft": draft_container, "target": fingerprint, "data": Manifest.read(data_dir).key},
                      wandb_run=wandb_run, frozen_target=frozen_target(teacher, launcher, bool(dcfg.get("medusa2", False))))
    try:
        with trainer:
            result = trainer.fit()
            state = trainer.trainable_state_dict()  # collective: every rank
            if not trainer.accelerator.is_main_process:
                return None
            out_dir = export(kind, dcfg, draft, teacher, state, out_dir or artifacts.drafts_dir(fingerprint) / name,
                             target_dir, fingerprint, Manifest.read(data_dir).key,
                             {**result.final_metrics, "steps": result.state.step,
                              "stopped_by_time_cap": result.stopped_by_time_cap,
                              "annealed_to_time_cap": result.annealed_to_time_cap,
                              **({"draft_vocab_coverage": draft.vocab_coverage} if hasattr(draft, "vocab_coverage") else {}),
                              "train_tokens_per_s": read_throughput(Path(train_cfg.output_dir) / "metrics.jsonl"),
                              **(extra_metrics or {})})
    finally:
        if wandb_run is not None:
            wandb_run.finish()
    log_event(stage="distill", status="exported", kind=kind, dir=out_dir, **{k.replace("/", "_"): round(v, 4)
              for k, v in result.final_metrics.items() if isinstance(v, float)})
    print(f"draft saved at: {out_dir}")
    return out_dir


def export(kind: str, dcfg: Any, draft: nn.Module, teacher: Any, state: dict, out_dir: Path, target_dir: Path,
           fingerprint: str, data_key: str, metrics: dict[str, Any]) -> Path:
    """Trained weights (gathered across ranks/shards) into the draft, then a draft dir with draftsmith.json."""
    from transformers import AutoTokenizer

    from draftsmith.drafts.io import config_json, save_draft
    from draftsmith.drafts.kinds import build_from_config

    prefix = "heads." if kind == "medusa" else "draft."
    # A fresh, unsharded copy: FSDP2 and ZeRO-3 shard the trained module in place, so the gathered full
    # weights cannot be copied back into it.
    draft = build_from_config(kind, config_json(draft, kind))
    draft.load_state_dict({k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)})
    target_fp = fingerprint
    if kind == "medusa" and dcfg.medusa2:
        from draftsmith.drafts.identity import target_fingerprint
        from draftsmith.train.distill.objectives.medusa import merge_lora

        adapted = out_dir / "target"
        teacher.model.load_state_dict({k[len("target."):]: v for k, v in state.items() if k.startswith("target.")})
        merge_lora(teacher.model)
        teacher.model.save_pretrained(str(adapted))
        AutoTokenizer.from_pretrained(str(target_dir)).save_pretrained(str(adapted))
        target_fp = target_fingerprint(adapted)
        metrics = {**metrics, "base_target_fingerprint": fingerprint, "adapted_target_dir": str(adapted)}
    save_draft(draft.float(), out_dir, kind=kind, target_fingerprint=target_fp, data_manifest_hash=data_key,
               metrics={k: v for k, v in metrics.items() if v is not None})
    if kind == "standalone":  # an HF causal-LM dir is only usable with its tokenizer beside it
        AutoTokenizer.from_pretrained(str(target_dir)).save_pretrained(str(out_dir))
    return out_dir


def run(cfg: DictConfig) -> Path | None:
    from draftsmith.train.distill.launch import LauncherConfig, relaunch_command

    if cfg.draft.get("kind") not in KINDS:
        raise ValueError(f"draft: {cfg.draft.get('kind')!r} is not a trainable draft kind; pick "
                         f"draft={'|'.join(KIND_NAMES)}")
    prepared_env = os.environ.get(PREPARED_ENV)
    prepared = Prepared(**json.loads(prepared_env)) if prepared_env else prepare(cfg)
    launcher = LauncherConfig(**OmegaConf.to_container(cfg.launcher, resolve=True))
    command = relaunch_command(launcher, sys.argv[1:], module="draftsmith.train.distill.run")
    if command is not None:
        env = {**os.environ, PREPARED_ENV: json.dumps(prepared.__dict__)}
        log_event(stage="distill", status="relaunch", processes=launcher.world_size, strategy=launcher.strategy)
        subprocess.run(command, env=env, check=True)
        return None
    return train_and_export(cfg, prepared)


main = hydra_app(run)

if __name__ == "__main__":
    main()
