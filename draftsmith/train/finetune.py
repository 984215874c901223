"""A target update: fine-tune a target on one domain's text and save it as a NEW target dir.

    python -m draftsmith.train.finetune --target artifacts/target-cache/<key> --domain code --out /tmp/target-code
        [--steps 200] [--lr 3e-4] [--batch-size 8] [--seq-len 256] [--corpus artifacts/corpus/<key>]

This is what the retrain hook reacts to: the weights move (a new fingerprint), the vocabulary stays.
Training is plain next-token loss on the domain's pretraining documents (prompt + reference of the
corpus ``pretrain`` split) with a small learning rate, through the same loop that trained the embedded
target (``draftsmith.train.target.train_model``: warmup, cosine decay, clipping, optional bf16 autocast, a
progress bar). The new dir holds ``save_pretrained`` weights, the tokenizer and a
``draftsmith_target.json`` that keeps the corpus hash (so the eval harness finds the same held-out
prompts) and records the lineage: which target it came from, on which domain, with which settings.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from omegaconf import OmegaConf

from draftsmith.drafts.files import atomic_dir, write_json
from draftsmith.train.target import TARGET_META_FILE, domain_perplexity, pack_tokens, train_model


@dataclass
class FinetuneConfig:
    domain: str = "code"
    steps: int = 200
    lr: float = 3e-4              # ~10x below the embedded target's pretraining LR: an update, not a restart
    batch_size: int = 8
    seq_len: int = 256
    warmup_steps: int = 10
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    max_minutes: float = 15.0     # wall-clock cap; the LR schedule anneals to it (train_model)
    bf16_autocast: bool | str = "auto"   # auto: where bf16 is fast (kernels.precision)
    seed: int = 0
    num_threads: int = 2
    log_every: int = 10

    def validate(self) -> None:
        for name in ("steps", "batch_size", "seq_len", "num_threads", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"finetune.{name} must be >= 1, got {getattr(self, name)}")
        if not 0.0 < self.lr < 1.0:
            raise ValueError(f"finetune.lr must be in (0, 1), got {self.lr}")
        if self.warmup_steps < 0 or self.max_minutes <= 0:
            raise ValueError("finetune.warmup_steps must be >= 0 and finetune.max_minutes > 0")


@dataclass
class FinetuneResult:
    model_dir: Path
    base_dir: Path
    domain: str
    steps: int
    first_loss: float
    final_loss: float
    wall_s: float
    stopped_by_time_cap: bool
    perplexity_before: dict[str, float] = field(default_factory=dict)  # per domain, held-out split
    perplexity_after: dict[str, float] = field(default_factory=dict)


# ----------------------------------------------------------------------------- the corpus

def find_corpus_dir(target_dir: Path, artifacts_root: Path) -> Path:
    """The corpus the target was trained on: matched by the content hash in its draftsmith_target.json,
    else the only corpus under the artifacts root."""
    meta = target_dir / TARGET_META_FILE
    wanted = json.loads(meta.read_text()).get("corpus_hash") if meta.is_file() else None
    entries = [m.parent for m in sorted((artifacts_root / "corpus").glob("*/manifest.json"))
               if (m.parent / "pretrain.jsonl").is_file()]
    for entry in entries:
        if wanted and json.loads((entry / "manifest.json").read_text()).get("content_hash") == wanted:
            return entry
    if not wanted and len(entries) == 1:
        return entries[0]
    raise ValueError(f"--corpus: not given, and no corpus under {artifacts_root / 'corpus'} matches target {target_dir} "
                     f"(corpus_hash {wanted}); pass --corpus CORPUS_DIR (with pretrain.jsonl, eval.jsonl)")


def read_split(corpus_dir: Path, split: str) -> list[dict[str, str]]:
    path = corpus_dir / f"{split}.jsonl"
    if not path.is_file():
        raise ValueError(f"--corpus: {path} does not exist")
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    for i, r in enumerate(records):
        if not all(isinstance(r.get(k), str) for k in ("domain", "prompt", "reference")):
            raise ValueError(f"{path}: record {i} needs string fields domain, prompt, reference")
    return records


def domain_texts(records: list[dict[str, str]], domain: str) -> list[str]:
    """Training documents (prompt + reference) of one domain; ValueError naming the known domains."""
    texts = [r["prompt"] + r["reference"] for r in records if r["domain"] == domain]
    if not texts:
        known = sorted({r["domain"] for r in records})
        raise ValueError(f"finetune.domain: no pretraining text for domain {domain!r} (domains: {', '.join(known)})")
    return texts


# ----------------------------------------------------------------------------- the update

def finetune(target_dir: str | Path, out_dir: str | Path, texts: list[str], cfg: FinetuneConfig,
             eval_records: list[dict[str, str]] | None = None, eval_per_domain: int = 16,
             corpus_hash: str | None = None) -> FinetuneResult:
    """Fine-tune ``target_dir`` on ``texts`` and write the new target to ``out_dir`` (atomically).

    With ``eval_records`` (held-out {domain, prompt, reference}), per-domain perplexity before and
    after is measured on ``eval_per_domain`` records each: the update should lower the tuned domain's.
    ``corpus_hash`` (default: the base target's) is recorded so the eval harness finds the held-out split.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg.validate()
    target_dir, out_dir = Path(target_dir).expanduser(), Path(out_dir).expanduser()
    if not (target_dir / "config.json").is_file():
        raise ValueError(f"--target: {target_dir} is not a HF checkpoint dir (no config.json)")
    if out_dir.resolve() == target_dir.resolve():
        raise ValueError(f"--out: {out_dir} is the target itself; a target update goes to a new dir")
    torch.set_num_threads(cfg.num_threads)
    torch.manual_seed(cfg.seed)
    tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
    model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32)
    rows = pack_tokens(tokenizer, texts, cfg.seq_len)  # [num_rows, seq_len]
    max_len = min(int(getattr(model.config, "max_position_embeddings", 1024)), 1024)
    ppl = lambda: (domain_perplexity(model, tokenizer, eval_records, eval_per_domain, cfg.batch_size, max_len)  # noqa: E731
                   if eval_records else {})
    before = ppl()
    # train_model reads the embedded target's schedule fields; the update maps onto them one to one.
    loop = OmegaConf.create({**asdict(cfg), "max_steps": cfg.steps, "anneal_to_time_cap": True})
    trained = train_model(model, rows, loop, cfg.seed)
    after = ppl()
    base_meta = target_dir / TARGET_META_FILE
    lineage = json.loads(base_meta.read_text()) if base_meta.is_file() else {}
    from draftsmith.drafts.identity import target_fingerprint

    with atomic_dir(out_dir) as tmp:
        model.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        tail = trained.losses[-min(20, len(trained.losses)):]
        write_json(tmp / TARGET_META_FILE, {
            "corpus_hash": corpus_hash or lineage.get("corpus_hash"),
            "finetuned_from": {"path": str(target_dir.resolve()), "fingerprint": target_fingerprint(target_dir)},
            "finetune": asdict(cfg), "steps": trained.steps, "train_wall_s": round(trained.wall_s, 2),
            "stopped_by_time_cap": trained.stopped_by_time_cap, "first_loss": trained.losses[0],
            "final_loss": sum(tail) / len(tail), "perplexity_before": before, "perplexity_after": after,
        })
    return FinetuneResult(out_dir, target_dir, cfg.domain, trained.steps, trained.losses[0], sum(tail) / len(tail),
                          trained.wall_s, trained.stopped_by_time_cap, before, after)


def finetune_from_corpus(target_dir: str | Path, out_dir: str | Path, cfg: FinetuneConfig,
                         corpus_dir: str | Path | None = None, artifacts_root: str | Path = "artifacts",
                         eval_per_domain: int = 16) -> FinetuneResult:
    """``finetune`` on the domain's pretrain split of the target's corpus (found by hash when not given)."""
    target_dir = Path(target_dir).expanduser()
    corpus = Path(corpus_dir) if corpus_dir else find_corpus_dir(target_dir, Path(artifacts_root))
    texts = domain_texts(read_split(corpus, "pretrain"), cfg.domain)
    eval_records = read_split(corpus, "eval") if eval_per_domain > 0 else None
    manifest = corpus / "manifest.json"
    corpus_hash = json.loads(manifest.read_text()).get("content_hash") if manifest.is_file() else None
    return finetune(target_dir, out_dir, texts, cfg, eval_records, eval_per_domain, corpus_hash)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m draftsmith.train.finetune", description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True, help="the target checkpoint dir to update")
    p.add_argument("--out", required=True, help="the new target dir (written atomically)")
    p.add_argument("--corpus", default=None, help="corpus dir with pretrain.jsonl/eval.jsonl (default: the target's)")
    p.add_argument("--artifacts", default="artifacts", help="artifacts root searched for the target's corpus")
    p.add_argument("--eval-per-domain", type=int, default=16, help="held-out records per domain for perplexity (0: skip)")
    defaults = FinetuneConfig()
    for name, value in asdict(defaults).items():
        kind = (lambda s: s.lower() in ("1", "true", "yes")) if isinstance(value, bool) else type(value)
        p.add_argument(f"--{name.replace('_', '-')}", type=kind, default=value)
    args = p.parse_args(argv)
    cfg = FinetuneConfig(**{name: getattr(args, name) for name in asdict(defaults)})
    try:
        result = finetune_from_corpus(args.target, args.out, cfg, args.corpus, args.artifacts, args.eval_per_domain)
    except ValueError as err:
        print(f"draftsmith finetune: error: {err}", file=sys.stderr)
        return 2
    print(f"new target: {result.model_dir}  ({result.steps} steps on {result.domain}, loss {result.first_loss:.3f} -> "
          f"{result.final_loss:.3f}, {result.wall_s:.0f} s)")
    for d in sorted(result.perplexity_after):
        print(f"  perplexity {d:>6}: {result.perplexity_before[d]:8.2f} -> {result.perplexity_after[d]:8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
