"""What the distillation dataset holds: the draft's data block, the extras its kind needs stored, the
sampling of its answers, the checks that stop bad settings early, and the cache keys."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from omegaconf import DictConfig, OmegaConf

from draftsmith.drafts.files import stable_hash
from draftsmith.drafts.kinds import KINDS
from draftsmith.drafts.schemas import MODES, DraftDataConfig
from draftsmith.train.distill.gendata import FORMAT_VERSION, StoredExtras


def data_config(draft_cfg: Any) -> DraftDataConfig:
    """The draft's data block as a dataclass (defaults when the draft group has none, e.g. draft=none)."""
    raw = draft_cfg.get("data") if draft_cfg is not None else None
    if raw is None:
        return DraftDataConfig()
    values = OmegaConf.to_container(raw, resolve=True) if isinstance(raw, DictConfig) else dict(asdict(raw))
    return DraftDataConfig(**values)


def extras_for(draft_cfg: Any, num_target_layers: int) -> StoredExtras:
    """What the teacher-forced pass must store for this draft kind and mode."""
    data = data_config(draft_cfg)
    kind = draft_cfg.get("kind", "none") if draft_cfg is not None else "none"
    mode = draft_cfg.get("mode", "online") if draft_cfg is not None else "online"
    if mode not in MODES:
        raise ValueError(f"draft.mode: {mode!r} is not one of {MODES}")
    spec = KINDS.get(kind)   # None for "none" (data for no draft in particular)
    store_hidden = data.store_hidden if data.store_hidden is not None else (
        mode == "offline" and spec is not None and spec.reads_target_features
        or kind == "standalone" and draft_cfg.get("teacher") == "hidden")  # its KD labels: the cached final hidden
    aux: list[int] = []
    if store_hidden and spec is not None and spec.reads_aux_layers:  # EAGLE-3, and the block draft reads its layers
        from draftsmith.drafts.eagle3 import default_aux_layers

        aux = list(draft_cfg.get("aux_layers") or default_aux_layers(num_target_layers))
    check_data_config(data)
    return StoredExtras(final_hidden=bool(store_hidden), aux_layers=aux, topk=int(data.topk_logits))


def interleave_domains(records: list[dict[str, str]], limit: int | None) -> list[dict[str, str]]:
    """Round-robin over domains (so a prefix of the list covers every domain), first `limit` records."""
    by_domain: dict[str, list[dict[str, str]]] = {}
    for record in records:
        by_domain.setdefault(record["domain"], []).append(record)
    order = sorted(((i, d) for d, rs in by_domain.items() for i in range(len(rs))))
    mixed = [by_domain[d][i] for i, d in order]
    return mixed if limit is None else mixed[:limit]


def sampling_dict(data: DraftDataConfig) -> dict[str, Any]:
    out = {"temperature": data.temperature, "top_k": data.top_k, "top_p": data.top_p, "seed": data.seed,
           "max_new_tokens": data.max_new_tokens}
    if data.sampled_fraction > 0:  # (kept out otherwise: caches of greedy-only runs keep their keys)
        out.update(sampled_fraction=data.sampled_fraction, sampled_temperature=data.sampled_temperature)
    return out


def check_data_config(data: DraftDataConfig) -> None:
    """Settings that cannot work stop before any long work, in one line naming the field and value."""
    if not 0.0 <= data.sampled_fraction <= 1.0:
        raise ValueError(f"draft.data.sampled_fraction: {data.sampled_fraction} is outside [0, 1]")
    if data.sampled_temperature <= 0 and data.sampled_fraction > 0:
        raise ValueError(f"draft.data.sampled_temperature: {data.sampled_temperature} must be > 0 (it samples)")
    if data.temperature < 0:
        raise ValueError(f"draft.data.temperature: {data.temperature} must be >= 0")
    if data.topk_logits < 0:
        raise ValueError(f"draft.data.topk_logits: {data.topk_logits} must be >= 0")
    if data.max_minutes is not None and data.max_minutes <= 0:
        raise ValueError(f"draft.data.max_minutes: {data.max_minutes} must be > 0 (or null: no cap)")


def content_key(fingerprint: str, tok_hash: str, prompt_hash: str, data: DraftDataConfig,
                model_id: str | None = None) -> str:
    """Everything that decides the stored answers (not which extras are stored beside them); model_id: the
    external endpoint's model (backend=openai), keyed only then so in-process caches keep their keys."""
    fields = {
        "format": FORMAT_VERSION, "target": fingerprint, "tokenizer": tok_hash, "prompts": prompt_hash,
        "source": data.source, "sampling": sampling_dict(data) if data.source == "target" else None,
        "max_length": data.max_length, "shard_size": data.shard_size,
        "answers_to": "whole prompts",   # (answers to prompts cut to max_length before were keyed without it)
    }
    if model_id is not None:
        fields["endpoint_model"] = model_id
    return stable_hash(fields)  # (data.max_minutes is not keyed: a cap that cut in is in the manifest and the stage's log line)


def cache_key(fingerprint: str, tok_hash: str, prompt_hash: str, data: DraftDataConfig, extras: StoredExtras,
              model_id: str | None = None) -> str:
    return stable_hash({"content": content_key(fingerprint, tok_hash, prompt_hash, data, model_id),
                        "extras": asdict(extras)})
