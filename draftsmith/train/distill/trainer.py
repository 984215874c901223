"""The generic distillation trainer: one accelerate loop for every draft kind.

Kind-specific work lives behind `draftsmith.train.distill.objective.Objective`; this loop owns distribution
(via `launch.make_accelerator`), gradient accumulation, the LR schedule, clipping, mixed precision,
the NaN guard, held-out evaluation (per-position accuracy, simulated tau), metrics (JSONL always,
W&B when given a run) and exact resume (`checkpoint.py`).
"""
from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Protocol

import torch
from accelerate.utils import set_seed
from torch import Tensor
from torch.utils.data import DataLoader

from draftsmith.serve_eval.speculative.metrics import simulated_tau
from draftsmith.train.distill import checkpoint as ckpt
from draftsmith.train.distill.data import ShardedResumableSampler, collate_token_sequences, eval_shard_batches
from draftsmith.train.distill.launch import (LauncherConfig, make_accelerator, shutdown_distributed, training_threads,
                                 write_rank_report)
from draftsmith.train.distill.objective import Objective, PositionCounts
from draftsmith.train.distill.ranks import NonFiniteLossError, mean_over_ranks, non_finite_names, sum_over_ranks
from draftsmith.train.distill.train_log import JsonlMetrics, LogWindow, NoBar
from draftsmith.train.distill.trainer_config import TrainerConfig, lr_factor
from draftsmith.train.logs import log_event, progress, warn_event

@dataclass
class _StepResult:
    state: ckpt.TrainerState  # after the step
    epoch: int
    losses: dict[str, float]  # loss and its components, mean over the step's micro-batches (this rank)
    grad_norm: Tensor | float | None  # None: not clipped (DeepSpeed returns a float)
    tokens: float  # attention-mask tokens this rank trained on
    lr: float  # the rate the step used


@dataclass
class TrainResult:
    state: ckpt.TrainerState
    final_metrics: dict[str, float]
    checkpoint: Path | None
    stopped_by_time_cap: bool = False
    annealed_to_time_cap: bool = False  # ... with the LR schedule annealed to the cap (anneal_to_time_cap)


class FrozenTarget(Protocol):
    """The frozen target an online objective calls (objectives.teacher.Teacher): the trainer shards it across
    the ranks when the launcher says `shard_target`, before the objective moves it onto the device."""

    def shard(self, device: torch.device) -> None: ...

    def local_share(self) -> float: ...


class Trainer:
    """`Trainer(cfg, objective, models, train_ds, eval_ds).fit()`; datasets are indexable collections of
    mappings with `input_ids` (see data.collate_token_sequences). `frozen_target`: the target the objective
    calls in online mode, when it is frozen (sharded with FSDP2 under `launcher.shard_target`)."""

    def __init__(
        self,
        config: TrainerConfig,
        objective: Objective,
        models: Mapping[str, Any],
        train_dataset: Sequence[Mapping[str, Any]],
        eval_dataset: Sequence[Mapping[str, Any]] | None = None,
        *,
        launcher: LauncherConfig | None = None,
        run_config: Mapping[str, Any] | None = None,
        wandb_run: Any = None,
        collate_fn: Callable[[list], dict[str, Tensor]] | None = None,
        frozen_target: FrozenTarget | None = None,
    ) -> None:
        config.validate()
        threads = training_threads(config.num_threads)
        torch.set_num_threads(threads)
        log_event(stage="distill", num_threads=threads, setting=config.num_threads)
        self.cfg, self.objective, self.launcher = config, objective, launcher or LauncherConfig()
        self.train_dataset, self.eval_dataset, self.wandb_run = train_dataset, eval_dataset, wandb_run
        self.collate = collate_fn or partial(
            collate_token_sequences, pad_token_id=config.pad_token_id, max_length=config.max_length
        )
        self.run_config = {"train": config.trajectory_fields(), "job": dict(run_config or {})}
        self.config_hash = ckpt.config_fingerprint(self.run_config)
        self.output_dir = Path(config.output_dir)
        self.checkpoint_root = self.output_dir / "checkpoints"
        self.accelerator = make_accelerator(
            self.launcher,
            mixed_precision=config.mixed_precision,
            gradient_accumulation_steps=config.gradient_accumulation_steps,
            micro_batch_size=config.batch_size,
            grad_clip=config.grad_clip,
        )
        acc = self.accelerator
        if eval_dataset is not None and len(eval_dataset) < acc.num_processes:
            raise ValueError(f"eval dataset has {len(eval_dataset)} examples, fewer than {acc.num_processes} ranks")
        self.sampler = ShardedResumableSampler(
            len(train_dataset), config.batch_size, rank=acc.process_index, world_size=acc.num_processes,
            seed=config.seed, shuffle=config.shuffle,
        )  # fmt: skip
        self.frozen_target = frozen_target
        if self.launcher.shard_target and frozen_target is not None:  # before build moves it onto the device
            frozen_target.shard(acc.device)
        set_seed(config.seed)  # identical initial weights on every rank
        module = objective.build(models, acc.device)
        trainable = [p for p in module.parameters() if p.requires_grad]
        if not trainable:
            raise ValueError("objective.build returned a module without trainable parameters")
        optimizer = torch.optim.AdamW(trainable, lr=config.lr, betas=tuple(config.betas), weight_decay=config.weight_decay)
        self.clock: Callable[[], float] = time.perf_counter  # the time cap's clock (tests drive their own)
        self.time_frac = 0.0  # elapsed / max_minutes where the schedule anneals to the cap (the ranks' mean)
        # Not passed to accelerate.prepare: its scheduler wrapper steps once per process per step.
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer,
            lambda step: lr_factor(step, warmup_steps=config.warmup_steps, max_steps=config.max_steps,
                                   schedule=config.lr_schedule, min_lr_ratio=config.min_lr_ratio,
                                   time_frac=self.time_frac),
        )  # fmt: skip
        self.model, self.optimizer = acc.prepare(module, optimizer)
        set_seed(config.seed + 7919 * acc.process_index)  # per-rank dropout/noise streams
        self.last_checkpoint: Path | None = None
        self.consumed_batches: list[tuple[int, int]] = []  # (epoch, batch index) this process trained on

    # ------------------------------------------------------------------ state

    def _resume_or_start(self) -> ckpt.TrainerState:
        fresh = ckpt.TrainerState(0, 0, 0, self.accelerator.num_processes, self.config_hash)
        if self.cfg.resume == "never":
            if ckpt.list_checkpoints(self.checkpoint_root):
                raise ValueError(f"train.resume='never' but {self.checkpoint_root} holds checkpoints; use a fresh output_dir")
            return fresh
        # Verified against its manifest; a corrupt newest one is skipped for the newest intact one.
        path = ckpt.resume_checkpoint(self.checkpoint_root, self.cfg.resume, self.accelerator)
        if path is None:
            return fresh
        state = ckpt.load_checkpoint(
            path, config_hash=self.config_hash, run_config=self.run_config, accelerator=self.accelerator,
            model=self.model, optimizer=self.optimizer, scheduler=self.scheduler, sharded=self.launcher.sharded,
        )  # fmt: skip
        self.last_checkpoint = path
        log_event(stage="distill", status="resumed", checkpoint=str(path), step=state.step)
        return state

    def _save(self, state: ckpt.TrainerState) -> None:
        self.last_checkpoint = ckpt.save_checkpoint(
            self.checkpoint_root, state, self.run_config, accelerator=self.accelerator, model=self.model,
            optimizer=self.optimizer, scheduler=self.scheduler, sharded=self.launcher.sharded,
            keep_last=self.cfg.keep_last,
        )  # fmt: skip

    def _micro_batches(self, epoch: int, start: int) -> Iterator[tuple[int, int, dict[str, Tensor]]]:
        """(epoch, batch index within epoch, batch) from the saved position on, across epochs, forever."""
        while True:
            if start >= self.sampler.batches_per_epoch:
                epoch, start = epoch + 1, 0
            self.sampler.set_position(epoch, start)
            # Own generator: a DataLoader iterator otherwise draws its worker seed from the global torch
            # RNG, and a resumed run creates its iterator at a different point than the original did.
            loader_generator = torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + epoch)
            loader = DataLoader(
                self.train_dataset, batch_sampler=self.sampler, collate_fn=self.collate,
                num_workers=self.cfg.num_workers, generator=loader_generator,
            )  # fmt: skip
            for offset, batch in enumerate(loader):
                yield epoch, start + offset, batch
            epoch, start = epoch + 1, 0

    # ------------------------------------------------------------------ guards and reductions

    def _stop_if_non_finite(
        self, values: Mapping[str, Tensor | float | None], step: int, epoch: int, batch_index: int
    ) -> None:
        bad = non_finite_names(self.accelerator, values)
        if bad is not None:
            raise NonFiniteLossError(step, epoch, batch_index, bad, self.last_checkpoint)

    def _time_up(self, start: float) -> bool:
        """Past train.max_minutes? Ranks agree (mean elapsed time), so they stop at the same step and, annealing
        to the cap, keep one LR."""
        if self.cfg.max_minutes is None:
            return False
        elapsed = mean_over_ranks(self.accelerator, {"elapsed": self.clock() - start})["elapsed"]
        if self.cfg.anneal_to_time_cap:
            self.time_frac = elapsed / (self.cfg.max_minutes * 60)
        return elapsed > self.cfg.max_minutes * 60

    # ------------------------------------------------------------------ eval

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Held-out loss (per component), per-position top-1 accuracy and simulated tau, over all ranks."""
        if self.eval_dataset is None:
            return {}
        acc = self.accelerator
        batches = eval_shard_batches(len(self.eval_dataset), self.cfg.eval_batch_size, acc.process_index, acc.num_processes)
        num_rounds = len(batches)
        if acc.num_processes > 1:
            num_rounds = int(acc.reduce(torch.tensor([len(batches)], device=acc.device), reduction="max").item())
        loss_sums: dict[str, float] = defaultdict(float)
        counts: PositionCounts | None = None
        real_batches = 0
        self._set_training(False)
        with torch.random.fork_rng(devices=[]):  # eval never shifts the training random streams
            for round_index in range(num_rounds):
                # A rank that ran out repeats its last batch and discards it: collectives stay aligned.
                indices = batches[min(round_index, len(batches) - 1)]
                batch = self._to_device(self.collate([self.eval_dataset[i] for i in indices]))
                with acc.autocast():
                    loss, components = self.objective.loss(self.model, batch)
                    position_counts = self.objective.eval_metrics(self.model, batch)
                if round_index >= len(batches):
                    continue
                real_batches += 1
                for name, value in {"loss": loss, **components}.items():
                    loss_sums[name] += float(value.detach().float())
                position_counts = PositionCounts(position_counts.correct.double().cpu(), position_counts.total.double().cpu())
                counts = position_counts if counts is None else counts + position_counts
        self._set_training(True)
        names = sorted(loss_sums)
        totals = sum_over_ranks(
            acc, torch.tensor([loss_sums[n] for n in names] + [real_batches], dtype=torch.float64, device=acc.device)
        ).cpu()
        metrics = {f"eval/{n}": (totals[i] / totals[-1]).item() for i, n in enumerate(names)}
        if counts is not None:
            correct = sum_over_ranks(acc, counts.correct.to(acc.device)).cpu()
            total = sum_over_ranks(acc, counts.total.to(acc.device)).cpu()
            accuracies = PositionCounts(correct, total).accuracies()
            metrics.update({f"eval/acc_pos{k + 1}": a for k, a in enumerate(accuracies)})
            metrics["eval/simulated_tau"] = simulated_tau(accuracies)
        return metrics

    # ------------------------------------------------------------------ loop

    def _set_training(self, training: bool) -> None:
        """train()/eval() the prepared module. DeepSpeed's engine forwards the mode to its module but
        keeps its own `training` flag, which objectives read (noise, dropout choices): set both."""
        self.model.train(training)
        self.model.training = training

    def _to_device(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        device = self.accelerator.device
        return {k: v.to(device, non_blocking=True) if isinstance(v, Tensor) else v for k, v in batch.items()}

    def _log(self, record: dict[str, Any]) -> None:
        if self.accelerator.is_main_process:
            self.metrics_file.write(record)
            if self.wandb_run is not None:
                self.wandb_run.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])

    def fit(self) -> TrainResult:
        """Train until `max_steps`; resumes from the latest checkpoint of `output_dir` when `resume=auto`."""
        acc = self.accelerator
        try:
            state = self._resume_or_start()
            if acc.is_main_process:
                self.metrics_file = JsonlMetrics(self.output_dir / "metrics.jsonl", state.step if state.step else None)
            state, final_metrics, stopped = self._train_loop(state)
            if stopped:
                self._save_at_time_cap(state)
            if not final_metrics or stopped:
                final_metrics = self.evaluate()
            write_rank_report(self.output_dir / "ranks" / f"rank{acc.process_index}.json", acc, self.model,
                              self.launcher, self.sampler.examples_of(self.consumed_batches),
                              self.frozen_target.local_share() if self.frozen_target is not None else None)
            return TrainResult(state, final_metrics, self.last_checkpoint, stopped,
                               stopped and self.cfg.anneal_to_time_cap)
        except BaseException as err:
            # A NaN stop is raised on every rank at the same step (the flag is all-reduced): meet at a barrier,
            # or one rank's gloo threads may be live when the other closes its pairs. Any other error may be
            # on this rank only, where a barrier would hang.
            shutdown_distributed(barrier=isinstance(err, NonFiniteLossError))
            raise
        finally:
            if acc.is_main_process and hasattr(self, "metrics_file"):
                self.metrics_file.close()

    def _train_loop(self, state: ckpt.TrainerState) -> tuple[ckpt.TrainerState, dict[str, float], bool]:
        """Steps from `state` to max_steps (or the time cap): (last state, latest held-out metrics, stopped by cap)."""
        cfg = self.cfg
        stream = self._micro_batches(state.epoch, state.batches_consumed)
        bar = progress(total=cfg.max_steps, initial=state.step, desc="distill") if self.accelerator.is_main_process else NoBar()
        final_metrics: dict[str, float] = {}
        window = LogWindow()
        self._set_training(True)
        fit_start, stopped = self.clock(), False
        while state.step < cfg.max_steps:
            if self._time_up(fit_start):
                stopped = True
                break
            result = self._train_step(state.step + 1, stream)
            state = result.state
            bar.update(1)
            window.tokens += result.tokens
            evaluated = self._after_step(result, window, bar)
            final_metrics = evaluated if evaluated is not None else final_metrics
        bar.close()
        return state, final_metrics, stopped

    def _train_step(self, step: int, stream: Iterator[tuple[int, int, dict[str, Tensor]]]) -> _StepResult:
        """One optimizer step over `gradient_accumulation_steps` micro-batches (NaN guard before the update)."""
        cfg, acc = self.cfg, self.accelerator
        loss_sums: dict[str, float] = defaultdict(float)
        grad_norm: Tensor | None = None
        tokens = 0.0
        for _ in range(cfg.gradient_accumulation_steps):
            epoch, batch_index, batch = next(stream)
            self.consumed_batches.append((epoch, batch_index))
            batch = self._to_device(batch)
            with acc.accumulate(self.model), acc.autocast():
                loss, components = self.objective.loss(self.model, batch)
                self._stop_if_non_finite({"loss": loss, **components}, step, epoch, batch_index)
                acc.backward(loss)
                if acc.sync_gradients:
                    grad_norm = self._optimizer_step(step, epoch, batch_index)
            for name, value in {"loss": loss, **components}.items():
                loss_sums[name] += float(value.detach().float()) / cfg.gradient_accumulation_steps
            tokens += float(batch["attention_mask"].sum())
        lr = self.scheduler.get_last_lr()[0]
        self.scheduler.step()
        state = ckpt.TrainerState(step, epoch, batch_index + 1, acc.num_processes, self.config_hash)
        return _StepResult(state, epoch, dict(loss_sums), grad_norm, tokens, lr)

    def _optimizer_step(self, step: int, epoch: int, batch_index: int) -> Tensor | None:
        grad_norm = self.accelerator.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip) if self.cfg.grad_clip > 0 else None
        self._stop_if_non_finite({"grad_norm": grad_norm}, step, epoch, batch_index)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm

    def _after_step(self, result: _StepResult, window: LogWindow, bar: Any) -> dict[str, float] | None:
        """Log, evaluate and checkpoint as the schedule says; returns the held-out metrics when it evaluated."""
        cfg, step = self.cfg, result.state.step
        if step % cfg.log_every == 0 or step == cfg.max_steps:
            self._log_train(result, window, bar)
        evaluated = None
        if (cfg.eval_every and step % cfg.eval_every == 0) or step == cfg.max_steps:
            evaluated = self.evaluate()
            if evaluated:
                self._log({"step": step, **evaluated})
        if (cfg.checkpoint_every and step % cfg.checkpoint_every == 0) or step == cfg.max_steps:
            self._save(result.state)
        return evaluated

    def _log_train(self, result: _StepResult, window: LogWindow, bar: Any) -> None:
        reduced = mean_over_ranks(self.accelerator, {**result.losses, "_tokens": window.tokens})
        elapsed = time.perf_counter() - window.start
        record: dict[str, Any] = {"step": result.state.step, "epoch": result.epoch, "lr": result.lr}
        record.update({("loss" if n == "loss" else f"loss/{n}"): v for n, v in reduced.items() if n != "_tokens"})
        if result.grad_norm is not None:
            record["grad_norm"] = float(result.grad_norm)
        record["tokens_per_s"] = reduced["_tokens"] * self.accelerator.num_processes / max(elapsed, 1e-9)
        self._log(record)
        bar.set_postfix(loss=f"{record['loss']:.4f}")
        window.tokens, window.start = 0.0, time.perf_counter()

    def _save_at_time_cap(self, state: ckpt.TrainerState) -> None:
        """The cap ended training before max_steps: by design where the schedule anneals to it (logged), else it cut
        the schedule short (a warning)."""
        cfg = self.cfg
        (log_event if cfg.anneal_to_time_cap else warn_event)(
            stage="distill", stopped_by_time_cap=True, annealed=cfg.anneal_to_time_cap, step=state.step,
            max_steps=cfg.max_steps, max_minutes=cfg.max_minutes)
        if state.step > 0 and not (cfg.checkpoint_every and state.step % cfg.checkpoint_every == 0):
            self._save(state)  # (a checkpoint_every step is saved already)

    def trainable_state_dict(self) -> dict[str, Tensor]:
        """Full weights of the trained module (gathers FSDP / ZeRO-3 shards); for drafts.io export.
        Collective: every rank calls it, before `close()`. FSDP and ZeRO-3 gather onto the main process
        only: the other ranks get an empty dict."""
        return self.accelerator.get_state_dict(self.model) or {}

    def close(self) -> None:
        """Release the process group (call once the trained weights are exported)."""
        shutdown_distributed(barrier=True)

    def __enter__(self) -> "Trainer":
        return self

    def __exit__(self, *exc: Any) -> None:
        shutdown_distributed(barrier=exc[0] is None)
