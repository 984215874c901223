"""The target LLM: train the embedded Llama from scratch on the corpus, or validate a user's checkpoint.

The embedded target is a plain ``LlamaForCausalLM`` (GQA, RoPE, SwiGLU) saved with
``save_pretrained`` (safetensors) next to its tokenizer, so every consumer (our engine, vLLM,
transformers) reads it like any HF checkpoint. It is cached by (target config + corpus hash +
tokenizer + seed): a second run reuses it. ``target.path`` replaces it with any HF Llama-family
checkpoint dir, checked up front so a bad dir fails in one line before long work.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerBase

from draftsmith.drafts.identity import target_fingerprint
from draftsmith.drafts.artifacts import Artifacts
from draftsmith.drafts.files import atomic_dir, entry_lock, is_complete, read_json, stable_hash, write_json
from draftsmith.kernels.precision import resolve_bf16
from draftsmith.train.config import TargetConfig
from draftsmith.train.corpus import Corpus
from draftsmith.train.distill.trainer_config import lr_factor
from draftsmith.train.logs import progress
from draftsmith.train.tokenizer import load_tokenizer
from draftsmith.train.worker_process import run_spinning

logger = logging.getLogger("draftsmith")

PERPLEXITY_FILE = "perplexity.json"
TARGET_META_FILE = "draftsmith_target.json"
# Target settings that do not change the trained weights (kept out of the cache key).
_NON_WEIGHT_FIELDS = ("name", "path", "num_threads", "omp_spin_count", "log_every", "eval_records_per_domain",
                      "eval_batch_size")


@dataclass
class TrainResult:
    losses: list[float]  # training loss of every step
    steps: int
    wall_s: float
    stopped_by_time_cap: bool


@dataclass
class TargetResult:
    model_dir: Path
    fingerprint: str
    perplexity: dict[str, float]
    cached: bool
    shape: dict[str, Any] = field(default_factory=dict)


def llama_config(tcfg: DictConfig | TargetConfig, tokenizer: PreTrainedTokenizerBase | None = None) -> LlamaConfig:
    """The embedded target's architecture; its vocabulary is the tokenizer's (without one: tcfg.vocab_size and no
    special token ids, for random-weight stand-ins of its shape, as the bench scripts build where nothing is
    trained yet)."""
    if tcfg.hidden_size % tcfg.num_heads or tcfg.num_heads % tcfg.num_kv_heads:
        raise ValueError(
            f"target: hidden_size {tcfg.hidden_size} / num_heads {tcfg.num_heads} / num_kv_heads "
            f"{tcfg.num_kv_heads} must divide evenly (GQA)"
        )
    special = {} if tokenizer is None else dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                                                pad_token_id=tokenizer.pad_token_id)
    return LlamaConfig(
        vocab_size=tcfg.vocab_size if tokenizer is None else len(tokenizer),
        hidden_size=tcfg.hidden_size,
        intermediate_size=tcfg.intermediate_size,
        num_hidden_layers=tcfg.num_layers,
        num_attention_heads=tcfg.num_heads,
        num_key_value_heads=tcfg.num_kv_heads,
        max_position_embeddings=tcfg.max_position,
        rope_theta=tcfg.rope_theta,
        tie_word_embeddings=tcfg.tie_embeddings,
        architectures=["LlamaForCausalLM"],
        **special,
    )


def pack_tokens(tokenizer: PreTrainedTokenizerBase, texts: list[str], seq_len: int) -> torch.Tensor:
    """Documents + EOS, concatenated and cut into rows: int64 [num_rows, seq_len] (tail dropped)."""
    ids: list[int] = []
    for doc in tokenizer(texts, add_special_tokens=False)["input_ids"]:
        ids.extend(doc)
        ids.append(tokenizer.eos_token_id)
    num_rows = len(ids) // seq_len
    if num_rows == 0:
        raise ValueError(f"data: pretraining text has {len(ids)} tokens, fewer than target.seq_len={seq_len}")
    return torch.tensor(ids[: num_rows * seq_len], dtype=torch.long).view(num_rows, seq_len)


def _lr_at(step: int, tcfg: DictConfig, elapsed_s: float = 0.0) -> float:
    """Linear warmup, then cosine decay to min_lr_ratio * lr when the step budget or (with
    ``anneal_to_time_cap``) the time budget runs out, whichever comes first: a run cut short by a
    busy CPU still ends annealed instead of at a high learning rate."""
    time_frac = elapsed_s / (tcfg.max_minutes * 60) if tcfg.anneal_to_time_cap else 0.0
    return tcfg.lr * lr_factor(step, tcfg.warmup_steps, tcfg.max_steps, "cosine", tcfg.min_lr_ratio, time_frac)


def train_model(model: LlamaForCausalLM, rows: torch.Tensor, tcfg: DictConfig, seed: int, run: Any = None) -> TrainResult:
    """Next-token training on packed rows [N, seq_len] for ``max_steps`` (or until ``max_minutes``)."""
    generator = torch.Generator().manual_seed(seed)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": tcfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=tcfg.lr, betas=(0.9, 0.95),
    )
    model.train()
    losses: list[float] = []
    order = torch.randperm(len(rows), generator=generator)
    use_bf16 = resolve_bf16(tcfg.bf16_autocast, "cpu", "target.bf16_autocast")
    cursor, start = 0, time.perf_counter()
    stopped = False
    bar = progress(total=tcfg.max_steps, desc="target train", unit="step")
    for step in range(tcfg.max_steps):
        elapsed = time.perf_counter() - start
        if elapsed > tcfg.max_minutes * 60:
            stopped = True
            break
        if cursor + tcfg.batch_size > len(order):  # next epoch, fresh order
            order, cursor = torch.randperm(len(rows), generator=generator), 0
        batch = rows[order[cursor : cursor + tcfg.batch_size]]
        cursor += tcfg.batch_size
        for group in optimizer.param_groups:
            group["lr"] = _lr_at(step, tcfg, elapsed)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=use_bf16):
            loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), tcfg.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        bar.update(1)
        if step % tcfg.log_every == 0 or step == tcfg.max_steps - 1:
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
            if run is not None:
                run.log({"target/loss": losses[-1], "target/lr": optimizer.param_groups[0]["lr"]}, step=step)
    bar.close()
    model.eval()
    return TrainResult(losses, len(losses), time.perf_counter() - start, stopped)


@torch.no_grad()
def domain_perplexity(
    model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, records: list[dict[str, str]],
    per_domain: int, batch_size: int, max_len: int,
) -> dict[str, float]:
    """exp(mean next-token NLL) over prompt+reference+EOS of up to ``per_domain`` records per domain (fp32)."""
    by_domain: dict[str, list[list[int]]] = {}
    for record in records:
        docs = by_domain.setdefault(record["domain"], [])
        if len(docs) < per_domain:
            ids = tokenizer(record["prompt"] + record["reference"], add_special_tokens=False)["input_ids"]
            docs.append((ids + [tokenizer.eos_token_id])[:max_len])
    model.eval()
    result = {}
    for domain, docs in sorted(by_domain.items()):
        total_nll, total_tokens = 0.0, 0
        for i in range(0, len(docs), batch_size):
            chunk = docs[i : i + batch_size]
            width = max(map(len, chunk))
            ids = torch.full((len(chunk), width), tokenizer.pad_token_id or 0, dtype=torch.long)
            mask = torch.zeros((len(chunk), width), dtype=torch.long)
            for row, doc in enumerate(chunk):
                ids[row, : len(doc)] = torch.tensor(doc)
                mask[row, : len(doc)] = 1
            logits = model(input_ids=ids, attention_mask=mask).logits.float()  # [B, W, V]
            targets = ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)
            nll = F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), targets.reshape(-1),
                                  ignore_index=-100, reduction="sum")
            total_nll += nll.item()
            total_tokens += int((targets != -100).sum())
        result[domain] = math.exp(total_nll / max(1, total_tokens))
    return result


def validate_target_dir(path: str | Path) -> tuple[Any, PreTrainedTokenizerBase]:
    """Check a user's checkpoint dir before any long work; one ValueError line naming file and field."""
    from transformers import AutoConfig, AutoTokenizer

    model_dir = Path(path).expanduser()
    if not model_dir.is_dir():
        raise ValueError(f"target.path: {model_dir} does not exist or is not a directory")
    config_file = model_dir / "config.json"
    if not config_file.is_file():
        raise ValueError(f"{config_file}: missing (target.path must be a HF checkpoint dir)")
    try:
        config = AutoConfig.from_pretrained(str(model_dir))
    except Exception as err:  # unknown model_type, malformed JSON, ...
        raise ValueError(f"{config_file}: not a loadable HF config ({type(err).__name__}: {err})") from None
    architectures = getattr(config, "architectures", None) or []
    if not any(name.endswith("ForCausalLM") for name in architectures):
        raise ValueError(
            f"{config_file}: field 'architectures' is {architectures}, not a causal LM (expected *ForCausalLM)"
        )
    if not list(model_dir.glob("*.safetensors")):
        raise ValueError(f"{model_dir}: no *.safetensors weights (only safetensors checkpoints are accepted)")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    except Exception as err:
        raise ValueError(f"{model_dir}: no loadable tokenizer ({type(err).__name__}: {err})") from None
    if len(tokenizer) > config.vocab_size:
        raise ValueError(
            f"{model_dir / 'tokenizer.json'}: tokenizer has {len(tokenizer)} tokens but {config_file} field "
            f"'vocab_size' is {config.vocab_size}"
        )
    return config, tokenizer


def model_shape(config: Any) -> dict[str, Any]:
    keys = ("model_type", "num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
            "intermediate_size", "vocab_size", "max_position_embeddings", "tie_word_embeddings")
    return {key: getattr(config, key, None) for key in keys}


def _perplexity(cache: Path, model_dir: Path, tcfg: DictConfig, corpus: Corpus, tokenizer: Any,
                model: torch.nn.Module | None = None) -> dict[str, float]:
    """Per-domain eval-split perplexity, reused from ``cache`` when computed with the same settings."""
    settings = {"corpus": corpus.content_hash, "per_domain": tcfg.eval_records_per_domain}
    if cache.is_file() and read_json(cache).get("settings") == settings:
        return read_json(cache)["perplexity"]
    model = model if model is not None else _load_causal_lm(model_dir)
    max_len = min(int(getattr(model.config, "max_position_embeddings", 1024)), 1024)
    ppl = domain_perplexity(model, tokenizer, corpus.records("eval"), tcfg.eval_records_per_domain,
                            tcfg.eval_batch_size, max_len)
    write_json(cache, {"settings": settings, "perplexity": ppl})
    return ppl


def _load_causal_lm(model_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)


def build_target(cfg: DictConfig, corpus: Corpus, tokenizer_dir: Path | None, artifacts: Artifacts,
                 force: bool = False, run: Any = None) -> TargetResult:
    """Train (or reuse) the embedded target, or validate ``target.path``; file it under its fingerprint."""
    tcfg = cfg.target
    torch.set_num_threads(tcfg.num_threads)
    if tcfg.path:
        config, tokenizer = validate_target_dir(tcfg.path)
        model_dir, cached = Path(tcfg.path).expanduser().resolve(), True
        fingerprint = target_fingerprint(model_dir)
        ppl_cache = artifacts.reports_dir(fingerprint) / f"perplexity-{corpus.content_hash}.json"
        perplexity = _perplexity(ppl_cache, model_dir, tcfg, corpus, tokenizer)
    else:
        if tokenizer_dir is None:
            raise ValueError("pipeline.stages: the embedded target needs the 'tokenizer' stage before 'target'")
        weight_fields = {k: v for k, v in OmegaConf.to_container(tcfg, resolve=True).items() if k not in _NON_WEIGHT_FIELDS}
        key = stable_hash({"target": weight_fields, "corpus": corpus.content_hash,
                           "tokenizer": tokenizer_dir.name, "seed": cfg.seed})
        model_dir = artifacts.target_cache_dir(key)
        tokenizer = load_tokenizer(tokenizer_dir)
        with entry_lock(model_dir):
            cached = is_complete(model_dir) and not force
            if not cached:
                _train(cfg, corpus, tokenizer_dir, model_dir, run)
        config = LlamaConfig.from_pretrained(str(model_dir))
        perplexity = _perplexity(model_dir / PERPLEXITY_FILE, model_dir, tcfg, corpus, tokenizer)
        fingerprint = target_fingerprint(model_dir)
    home = artifacts.target_dir(fingerprint)
    write_json(artifacts.target_meta(fingerprint), {"model_dir": str(model_dir), "fingerprint": fingerprint,
                                      "source": "path" if tcfg.path else "embedded", "shape": model_shape(config)})
    write_json(home / "reports" / "perplexity.json", {"corpus": corpus.content_hash, "perplexity": perplexity})
    return TargetResult(model_dir, fingerprint, perplexity, cached, model_shape(config))


def _train(cfg: DictConfig, corpus: Corpus, tokenizer_dir: Path, model_dir: Path, run: Any) -> None:
    """Train and save the embedded target: with target.omp_spin_count set and several threads, in a process whose
    OpenMP workers spin between ops (train.worker_process says why), else here."""
    tcfg = cfg.target
    spin_count = tcfg.omp_spin_count
    if spin_count is not None and (not isinstance(spin_count, int) or spin_count < 0):
        raise ValueError(f"target.omp_spin_count must be an int >= 0 or null, got {spin_count!r}")
    # Only what training reads crosses to a worker, resolved (a Hydra job's other fields may not resolve there).
    job = dict(tcfg=OmegaConf.create(OmegaConf.to_container(tcfg, resolve=True)), seed=int(cfg.seed), corpus=corpus,
               tokenizer_dir=tokenizer_dir, model_dir=model_dir)
    if spin_count is not None and tcfg.num_threads > 1:
        run_spinning(_train_and_save, job, spin_count, run, name="target training")
    else:
        _train_and_save(**job, run=run)


def _train_and_save(tcfg: DictConfig, seed: int, corpus: Corpus, tokenizer_dir: Path, model_dir: Path,
                    run: Any) -> None:
    torch.set_num_threads(tcfg.num_threads)   # a spawned worker starts at torch's default
    tokenizer = load_tokenizer(tokenizer_dir)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(llama_config(tcfg, tokenizer))
    rows = pack_tokens(tokenizer, corpus.texts("pretrain"), tcfg.seq_len)
    logger.info("draftsmith target params=%.2fM rows=%d tokens=%d", sum(p.numel() for p in model.parameters()) / 1e6,
                len(rows), rows.numel())
    result = train_model(model, rows, tcfg, seed, run)
    if result.stopped_by_time_cap:
        logger.warning("draftsmith target stopped_by_time_cap=true steps=%d of max_steps=%d (target.max_minutes=%s)",
                       result.steps, tcfg.max_steps, tcfg.max_minutes)
    with atomic_dir(model_dir) as tmp:
        model.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        _perplexity(tmp / PERPLEXITY_FILE, tmp, tcfg, corpus, tokenizer, model)
        tail = result.losses[-min(20, len(result.losses)):]
        write_json(tmp / TARGET_META_FILE, {
            "corpus_hash": corpus.content_hash, "steps": result.steps, "train_wall_s": round(result.wall_s, 2),
            "stopped_by_time_cap": result.stopped_by_time_cap, "first_loss": result.losses[0],
            "final_loss": sum(tail) / len(tail), "target_config": OmegaConf.to_container(tcfg, resolve=True),
        })
