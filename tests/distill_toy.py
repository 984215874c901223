"""Toy objective, data and runner for the distill-trainer tests (not a test module itself).

The toy draft predicts the next K tokens from each position (a Medusa-like shape) with dropout,
feature noise drawn from torch, and noise scales drawn from python `random` and numpy, so exact
resume needs every RNG stream restored. Run as a script to train in a subprocess (torchrun for DDP).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
from pathlib import Path

import numpy as np
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from draftsmith.train.distill.objective import PositionCounts  # noqa: E402

VOCAB = 32
NUM_HEADS = 2


def toy_dataset(num_examples: int, seed: int) -> list[dict]:
    """Sequences following t+1 = (3t + 1) mod V with 10% random tokens; learnable, never identical."""
    generator = torch.Generator().manual_seed(seed)
    examples = []
    for example_id in range(num_examples):
        length = int(torch.randint(8, 16, (1,), generator=generator))
        tokens = [int(torch.randint(0, VOCAB, (1,), generator=generator))]
        for _ in range(length - 1):
            noisy = float(torch.rand(1, generator=generator)) < 0.1
            tokens.append(int(torch.randint(0, VOCAB, (1,), generator=generator)) if noisy else (3 * tokens[-1] + 1) % VOCAB)
        examples.append({"input_ids": tokens, "prompt_length": 2, "example_id": example_id})
    return examples


class ToyDraft(nn.Module):
    def __init__(self, hidden: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, hidden)
        self.dropout = nn.Dropout(0.1)
        self.heads = nn.ModuleList(nn.Linear(hidden, VOCAB) for _ in range(NUM_HEADS))

    def forward(self, input_ids: torch.Tensor, noise_scale: float = 0.0) -> torch.Tensor:
        features = self.embed(input_ids)  # [B, T, d]
        if self.training and noise_scale > 0:
            features = features + noise_scale * torch.randn_like(features)
        features = self.dropout(features)
        return torch.stack([head(features) for head in self.heads], dim=2)  # [B, T, K, V]


class ToyObjective:
    """Head k at position t predicts token t+k+1 wherever that token is in the loss mask."""

    def __init__(self, nan_at_train_call: int | None = None, kill_at_train_call: int | None = None,
                 nan_rank: int | None = None) -> None:
        self.nan_at_train_call, self.kill_at_train_call, self.nan_rank = nan_at_train_call, kill_at_train_call, nan_rank
        self.train_calls = 0
        self.seen_example_ids: list[int] = []

    def build(self, models, device):
        return models["draft"].to(device)

    def _logits_targets(self, model, batch):
        noise_scale = 0.05 * random.uniform(0.5, 1.5) * float(np.random.uniform(0.5, 1.5)) if model.training else 0.0
        logits = model(batch["input_ids"], noise_scale=noise_scale)
        out = []
        for k in range(NUM_HEADS):
            shift = k + 1
            out.append((logits[:, :-shift, k], batch["input_ids"][:, shift:], batch["loss_mask"][:, shift:]))
        return out

    def loss(self, model, batch):
        if model.training:
            self.train_calls += 1
            self.seen_example_ids.extend(batch["example_id"].tolist())
            if self.train_calls == self.kill_at_train_call:
                os.kill(os.getpid(), signal.SIGKILL)  # a real kill, mid-step, no cleanup
        components = {}
        for k, (logits, targets, mask) in enumerate(self._logits_targets(model, batch)):
            per_token = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1), reduction="none")
            components[f"head{k + 1}"] = (per_token * mask.reshape(-1)).sum() / mask.sum().clamp(min=1)
        loss = sum(w * c for w, c in zip((1.0, 0.5), components.values()))
        rank = int(os.environ.get("RANK", "0"))
        if model.training and self.train_calls == self.nan_at_train_call and self.nan_rank in (None, rank):
            loss = loss * float("nan")
        return loss, {name: value.detach() for name, value in components.items()}

    def eval_metrics(self, model, batch):
        correct, total = [], []
        for logits, targets, mask in self._logits_targets(model, batch):
            hits = (logits.argmax(-1) == targets) & mask
            correct.append(hits.sum())
            total.append(mask.sum())
        return PositionCounts(torch.stack(correct).double(), torch.stack(total).double())


def main() -> None:
    from draftsmith.train.distill.launch import LauncherConfig
    from draftsmith.train.distill.trainer import Trainer
    from draftsmith.train.distill.trainer_config import TrainerConfig

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--max-steps", type=int, default=8)
    parser.add_argument("--checkpoint-every", type=int, default=0)
    parser.add_argument("--eval-every", type=int, default=0)
    parser.add_argument("--accum", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--num-examples", type=int, default=24)
    parser.add_argument("--kill-at-train-call", type=int, default=None)
    parser.add_argument("--nan-at-train-call", type=int, default=None)
    parser.add_argument("--nan-rank", type=int, default=None)
    parser.add_argument("--strategy", default="none")
    parser.add_argument("--zero-stage", type=int, default=2)
    args = parser.parse_args()

    torch.set_num_threads(1)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    launcher = LauncherConfig(name=args.strategy, strategy=args.strategy, num_processes=world_size,
                              zero_stage=args.zero_stage)
    config = TrainerConfig(output_dir=args.out, max_steps=args.max_steps, batch_size=args.batch_size,
                           gradient_accumulation_steps=args.accum, lr=3e-2, warmup_steps=2, eval_every=args.eval_every,
                           checkpoint_every=args.checkpoint_every, eval_batch_size=4, keep_last=2)
    objective = ToyObjective(args.nan_at_train_call, args.kill_at_train_call, args.nan_rank)
    torch.manual_seed(0)
    trainer = Trainer(config, objective, {"draft": ToyDraft()}, toy_dataset(args.num_examples, seed=1),
                      toy_dataset(12, seed=2), launcher=launcher, run_config={"toy": True})
    rank = trainer.accelerator.process_index
    report = {"rank": rank, "world_size": trainer.accelerator.num_processes,
              "distributed_type": str(trainer.accelerator.distributed_type)}
    try:
        with trainer:
            result = trainer.fit()
            gathered = trainer.trainable_state_dict() or {}  # ZeRO-3 / FSDP gather onto rank 0 only
            state = {k: v.detach().cpu() for k, v in gathered.items()}
            torch.save(state, Path(args.out) / f"params_rank{rank}.pt")
            report.update(final_metrics=result.final_metrics, step=result.state.step)
    except Exception as err:  # noqa: BLE001 - the test reads the error back
        report.update(error=type(err).__name__, message=str(err), step=getattr(err, "step", None),
                      batch_index=getattr(err, "batch_index", None))
    report["seen_example_ids"] = objective.seen_example_ids
    (Path(args.out) / f"report_rank{rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
