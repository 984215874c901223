"""``draftsmith generate`` / ``python -m draftsmith.train.distill.dataset``: the distillation dataset of one draft job.

    draftsmith generate draft=eagle3 draft.mode=offline          # what `distill` would build itself
    draftsmith generate draft=standalone draft.data.topk_logits=20 target.path=/ckpt
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from draftsmith.drafts.artifacts import Artifacts
from draftsmith.train.artifacts import artifacts_from_config
from draftsmith.train.config import hydra_app
from draftsmith.train.distill.dataset.build import generate_dataset
from draftsmith.train.distill.dataset.settings import data_config, extras_for


def ensure_target(cfg: DictConfig, artifacts: Artifacts) -> tuple[Path, str, Any]:
    """(target dir, fingerprint, corpus): the pipeline's corpus -> tokenizer -> target stages, cached."""
    from draftsmith.train.corpus import build_corpus
    from draftsmith.train.target import build_target
    from draftsmith.train.tokenizer import build_tokenizer

    corpus, _ = build_corpus(cfg, artifacts)
    tokenizer_dir = None if cfg.target.path else build_tokenizer(cfg, corpus, artifacts)[0]
    result = build_target(cfg, corpus, tokenizer_dir, artifacts)
    return Path(result.model_dir), result.fingerprint, corpus


def dataset_for_job(cfg: DictConfig, artifacts: Artifacts, target_dir: Path, fingerprint: str, corpus: Any) -> Path:
    from transformers import AutoConfig

    num_layers = int(AutoConfig.from_pretrained(str(target_dir)).num_hidden_layers)
    draft_cfg = cfg.get("draft")
    data = data_config(draft_cfg)
    extras = extras_for(draft_cfg, num_layers)
    return generate_dataset(target_dir, fingerprint, corpus.records("distill"), data, extras, artifacts.data_dir(fingerprint),
                            endpoint_config(cfg))


def endpoint_config(cfg: DictConfig) -> Any:
    """backend=openai endpoint=URL [endpoint_concurrency=N endpoint_logprobs=K]: the external engine, else None."""
    backend = cfg.get("backend", "engine")
    if backend == "engine":
        return None
    if backend != "openai":
        raise ValueError(f"backend: {backend!r} is not one of ('engine', 'openai')")
    if not cfg.get("endpoint"):
        raise ValueError("endpoint: backend=openai needs endpoint=http://HOST:PORT/v1")
    from draftsmith.train.external_gen import EndpointConfig

    return EndpointConfig(str(cfg.endpoint), concurrency=int(cfg.get("endpoint_concurrency", 8)),
                          logprobs=int(cfg.get("endpoint_logprobs", 0)))


def run(cfg: DictConfig) -> Path:
    artifacts = artifacts_from_config(cfg)
    target_dir, fingerprint, corpus = ensure_target(cfg, artifacts)
    out = dataset_for_job(cfg, artifacts, target_dir, fingerprint, corpus)
    print(f"distillation data: {out}")
    return out


main = hydra_app(run)

if __name__ == "__main__":
    main()
