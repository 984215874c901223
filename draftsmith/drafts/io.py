"""Draft checkpoint dirs: config.json + model.safetensors + draftsmith.json, and the load-time checks.

* standalone: config.json is a plain HF LlamaConfig, weights use HF names -> the dir is an HF checkpoint.
* medusa / eagle / eagle3: config.json is our dataclass config plus ``"draftsmith_kind"``.
* draftsmith.json: kind, target fingerprint, data manifest hash, metrics, draftsmith version.

Only safetensors is read or written. ``load_draft`` checks the kind, the vocabulary and hidden sizes against the
target and the target fingerprint, and raises a ValueError naming both sides' values.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from draftsmith.drafts.artifacts import Artifacts
from draftsmith.drafts.files import atomic_write, write_json
from draftsmith.drafts.kinds import (
    CONFIG_FILE,
    KIND_NAMES,
    KINDS,
    META_FILE,
    WEIGHTS_FILE,
    build_from_config,
    kind_of,
)
from draftsmith.drafts.standalone import StandaloneDraft
from draftsmith.kernels.layers.checkpoint import read_file
from draftsmith.kernels.layers.config import hf_config_dict

FORMAT_VERSION = 1



def draftsmith_version() -> str:
    try:
        from importlib.metadata import version

        return version("draftsmith")
    except Exception:  # not installed (running from a source tree)
        return "unknown"


@dataclass
class DraftMeta:
    kind: str
    target_fingerprint: str | None
    data_manifest_hash: str | None = None
    metrics: dict = field(default_factory=dict)
    draftsmith_version: str = "unknown"
    format_version: int = FORMAT_VERSION


class LoadedDraft(NamedTuple):
    model: nn.Module
    kind: str
    meta: DraftMeta


@dataclass
class ExpectedTarget:
    """What a draft must match: the target's fingerprint (None = unknown) and its sizes."""

    fingerprint: str | None
    vocab_size: int
    hidden_size: int

    @classmethod
    def from_config(cls, target_cfg: Any, fingerprint: str | None = None) -> "ExpectedTarget":
        d = hf_config_dict(target_cfg)
        return cls(fingerprint, int(d["vocab_size"]), int(d["hidden_size"]))

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> "ExpectedTarget":
        from draftsmith.drafts.identity import (
            target_fingerprint,  # lazy: written by another module owner
        )

        return cls.from_config(model_dir, target_fingerprint(model_dir))


def write_safetensors(path: Path, tensors: dict[str, Tensor], metadata: dict[str, str] | None = None) -> None:
    from safetensors.torch import save_file

    flat = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    atomic_write(path, lambda tmp: save_file(flat, tmp, metadata=metadata or {"format": "pt"}))


def draft_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """state_dict without tied duplicates (safetensors refuses shared storage; HF drops a tied lm_head too)."""
    state = model.state_dict()
    if getattr(getattr(model, "config", None), "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    return state


def config_json(model: nn.Module, kind: str) -> dict:
    if kind == "standalone":
        return model.config.to_hf_dict()
    return {"draftsmith_kind": kind, **asdict(model.config)}



def save_draft(
    model: nn.Module,
    out_dir: str | Path,
    kind: str | None = None,
    target_fingerprint: str | None = None,
    data_manifest_hash: str | None = None,
    metrics: dict | None = None,
) -> Path:
    """Write a self-contained draft dir; returns its path."""
    kind = kind or kind_of(model)
    if kind != kind_of(model):
        raise ValueError(f"save_draft: kind={kind!r} but the module is a {kind_of(model)!r} draft")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_safetensors(out / WEIGHTS_FILE, draft_state_dict(model))
    write_json(out / CONFIG_FILE, config_json(model, kind))
    meta = DraftMeta(kind, target_fingerprint, data_manifest_hash, dict(metrics or {}), draftsmith_version())
    write_json(out / META_FILE, asdict(meta))
    return out


def read_draft_meta(draft_dir: str | Path) -> DraftMeta:
    """draftsmith.json of a draft dir; a plain HF causal-LM dir without one reads as an unfingerprinted standalone."""
    draft_dir = Path(draft_dir)
    meta_path = draft_dir / META_FILE
    if meta_path.is_file():
        raw = json.loads(meta_path.read_text())
        if raw.get("kind") not in KINDS:
            raise ValueError(f"{meta_path}: kind {raw.get('kind')!r} is not one of {', '.join(KIND_NAMES)}")
        return DraftMeta(**{k: v for k, v in raw.items() if k in DraftMeta.__dataclass_fields__})
    cfg_path = draft_dir / CONFIG_FILE
    if cfg_path.is_file() and any(a.endswith("ForCausalLM") for a in json.loads(cfg_path.read_text()).get("architectures") or []):
        return DraftMeta("standalone", None)
    raise ValueError(f"{draft_dir}: not a draft dir (no {META_FILE}, and {CONFIG_FILE} is not an HF causal LM)")


def _target_sizes(model: nn.Module, kind: str) -> dict[str, int | None]:
    """The target sizes this draft was built for (None = does not depend on it)."""
    cfg = model.config
    hidden = {"standalone": None, "medusa": cfg.hidden_size, "eagle": cfg.hidden_size}.get(kind)
    if kind in ("eagle3", "block"):
        hidden = cfg.target_hidden_size
    return {"vocab_size": cfg.vocab_size, "hidden_size": hidden}


def check_against_target(model: nn.Module, meta: DraftMeta, expected: ExpectedTarget, source: str, strict_fingerprint: bool | None = None) -> None:
    sizes = _target_sizes(model, meta.kind)
    for name in ("vocab_size", "hidden_size"):
        want, have = getattr(expected, name), sizes[name]
        if have is not None and have != want:
            raise ValueError(f"{source}: {meta.kind} draft was built for target {name}={have}, but the target has {name}={want}")
    # A draft that reads the target's hidden states made for another target is an error, not a warning.
    strict = KINDS[meta.kind].reads_target_features if strict_fingerprint is None else strict_fingerprint
    if expected.fingerprint and meta.target_fingerprint and meta.target_fingerprint != expected.fingerprint:
        msg = (
            f"{source}: {meta.kind} draft was made for target fingerprint {meta.target_fingerprint}, "
            f"but the target's fingerprint is {expected.fingerprint}"
        )
        if strict:
            raise ValueError(msg)
        # Verification stays exact with any draft; only acceptance can suffer.
        warnings.warn(msg + " (output stays exact; acceptance may suffer)", stacklevel=3)


def load_draft(
    draft_dir: str | Path,
    expected_target: ExpectedTarget | str | Path | None = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    strict_fingerprint: bool | None = None,
) -> LoadedDraft:
    """Load a draft dir; with expected_target (an ExpectedTarget or the target's model dir) check it matches.

    strict_fingerprint: None = error for feature drafts (medusa/eagle/eagle3), warning for standalone.
    """
    draft_dir = Path(draft_dir)
    meta = read_draft_meta(draft_dir)
    cfg_path = draft_dir / CONFIG_FILE
    if not cfg_path.is_file():
        raise ValueError(f"{draft_dir}: missing {CONFIG_FILE}")
    cfg_dict = json.loads(cfg_path.read_text())
    declared = cfg_dict.get("draftsmith_kind", "standalone")
    if declared != meta.kind:
        raise ValueError(f"{draft_dir}: {META_FILE} says kind={meta.kind!r} but {CONFIG_FILE} describes a {declared!r} draft")
    if (draft_dir / "quantization.json").is_file():  # weight-only int8/int4 (drafts.quant)
        from draftsmith.drafts.quant import load_quantized_model

        model = load_quantized_model(draft_dir, meta.kind, cfg_dict)
    elif meta.kind == "standalone":
        model = StandaloneDraft.from_hf(draft_dir)
    else:
        model = build_from_config(meta.kind, cfg_dict)
        state = read_file(draft_dir / WEIGHTS_FILE)
        if hasattr(type(model), "check_state"):  # kind-specific stored-shape checks, one line each
            type(model).check_state(model.config, state, str(draft_dir / WEIGHTS_FILE))
        missing, unexpected = model.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise ValueError(f"{draft_dir / WEIGHTS_FILE}: missing weights {missing[:5]}, unexpected {unexpected[:5]}")
    if expected_target is not None:
        if not isinstance(expected_target, ExpectedTarget):
            expected_target = ExpectedTarget.from_model_dir(expected_target)
        check_against_target(model, meta, expected_target, str(draft_dir), strict_fingerprint)
    model = model.to(device=device)
    if dtype is not None:
        model = model.to(dtype=dtype)  # buffers d2t/t2d are integer/bool and keep their dtype
    return LoadedDraft(model.eval(), meta.kind, meta)


def latest_drafts_by_kind(artifacts: Artifacts, fingerprint: str, include_quantized: bool = False) -> dict[str, Path]:
    """The newest exported draft dir of each kind filed for one target (dirs without a readable
    draftsmith.json are not drafts and are passed over). Quantized copies (a sibling ``<dir>-int4-g64``
    is written after its source, so it would be the newest) count only with ``include_quantized``."""
    from draftsmith.drafts.quant import QUANT_FILE

    found: dict[str, Path] = {}
    for draft_dir in artifacts.draft_dirs(fingerprint):   # oldest first: newer ones overwrite
        if not include_quantized and (draft_dir / QUANT_FILE).is_file():
            continue
        try:
            found[read_draft_meta(draft_dir).kind] = draft_dir
        except ValueError:
            continue
    return found
