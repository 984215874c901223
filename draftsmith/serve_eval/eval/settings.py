"""Eval settings without Hydra: a conf/eval profile + `key=value` overrides -> a validated EvalConfig.

The Hydra job composes the same YAML through train.config; the retrain hook calls
`harness.evaluate(profile=..., overrides=[...])` from inside another job, where a second Hydra
app cannot start, so the profile's defaults chain (`- default`, `- schema_eval`) is followed here.
Overrides use the Hydra spelling of the whole config (`eval.repetitions=1`, `artifacts_root=/a`);
keys of other groups are someone else's and are ignored.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from draftsmith.serve_eval.schemas import EvalConfig
from draftsmith import CONF_DIR

CONF_EVAL_DIR = CONF_DIR / "eval"
_ROOT_KEYS = ("artifacts_root", "seed", "wandb.mode", "target.path")


@dataclass
class EvalSettings:
    eval: EvalConfig
    artifacts_root: str = "artifacts"
    target_path: str | None = None       # the root's target.path (a user's checkpoint), if given
    wandb_mode: str = "offline"


def _profile_node(profile: str, seen: tuple[str, ...] = ()) -> Any:
    path = Path(profile) if profile.endswith(".yaml") else CONF_EVAL_DIR / f"{profile}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in CONF_EVAL_DIR.glob("*.yaml"))
        raise ValueError(f"eval profile {profile!r}: no file {path} (profiles: {', '.join(known)})")
    if profile in seen:
        raise ValueError(f"eval profile {profile!r}: its defaults list includes itself ({' -> '.join(seen)})")
    raw = OmegaConf.load(path)
    defaults = list(raw.pop("defaults", []) or [])
    merged = OmegaConf.create({})
    body_first = "_self_" not in defaults  # Hydra's rule: without _self_ the entry's own keys come first
    if body_first:
        merged = OmegaConf.merge(merged, raw)
    for entry in defaults:
        if entry == "_self_":
            merged = OmegaConf.merge(merged, raw)
        elif isinstance(entry, str) and not entry.startswith("schema_"):
            merged = OmegaConf.merge(merged, _profile_node(entry, seen + (profile,)))
    return merged


def load_settings(profile: str = "default", overrides: list[str] | None = None) -> EvalSettings:
    """ValueError naming the profile or the override when either does not fit the schema."""
    node = OmegaConf.merge(OmegaConf.structured(EvalConfig), _profile_node(profile))
    root: dict[str, str] = {}
    eval_pairs = []
    for item in overrides or []:
        key, sep, value = item.lstrip("+~").partition("=")
        if not sep:
            raise ValueError(f"override {item!r}: expected key=value")
        if key.startswith("eval."):
            eval_pairs.append(f"{key[len('eval.'):]}={value}")
        elif key in _ROOT_KEYS:
            root[key] = value
    try:
        if eval_pairs:
            node = OmegaConf.merge(node, OmegaConf.from_dotlist(eval_pairs))
        cfg: EvalConfig = OmegaConf.to_object(node)
    except OmegaConfBaseException as e:
        raise ValueError(f"eval profile {profile!r} with overrides {eval_pairs}: {e}") from None
    if "seed" in root:
        cfg.seed = int(root["seed"])
    validate(cfg)
    target_path = root.get("target.path")
    return EvalSettings(cfg, root.get("artifacts_root", "artifacts"),
                        None if target_path in (None, "null") else target_path, root.get("wandb.mode", "offline"))


def validate(cfg: EvalConfig) -> None:
    """Field checks the types alone do not express (ValueError names the field)."""
    if cfg.mode not in ("engine", "endpoint"):
        raise ValueError(f"eval.mode must be 'engine' or 'endpoint', got {cfg.mode!r}")
    if cfg.mode == "endpoint" and not cfg.endpoints:
        raise ValueError("eval.endpoints: endpoint mode needs at least one endpoint {name, url}")
    known = {"no-spec", "ngram", "drafts", "assisted"}
    unknown = [m for m in cfg.methods if m not in known]
    if unknown:
        raise ValueError(f"eval.methods: unknown {unknown} (known: {sorted(known)})")
    if not cfg.num_speculative_tokens or any(k < 1 for k in cfg.num_speculative_tokens):
        raise ValueError(f"eval.num_speculative_tokens must be a non-empty list of ints >= 1, "
                         f"got {list(cfg.num_speculative_tokens)}")
    if not cfg.temperatures or any(t < 0 for t in cfg.temperatures):
        raise ValueError(f"eval.temperatures must be a non-empty list of numbers >= 0, got {list(cfg.temperatures)}")
    for method, ks in cfg.num_speculative_tokens_of.items():
        if method == "no-spec" or not ks or any(int(k) < 1 for k in ks):
            raise ValueError(f"eval.num_speculative_tokens_of.{method}: a non-empty list of ints >= 1 for a "
                             f"speculative method, got {list(ks) if ks else ks}")
    for method, temps in cfg.temperatures_of.items():
        if method == "no-spec":
            raise ValueError("eval.temperatures_of.no-spec: the baseline runs at every temperature")
        extra = sorted(set(map(float, temps)) - set(map(float, cfg.temperatures)))
        if extra:
            raise ValueError(f"eval.temperatures_of.{method}: {extra} not in eval.temperatures {list(cfg.temperatures)}")
    for domain, count in cfg.max_prompts_per_domain_of.items():
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"eval.max_prompts_per_domain_of.{domain} must be an int >= 1, got {count!r}")
    for name in ("max_prompts_per_domain", "max_tokens", "batch_size", "repetitions"):
        if getattr(cfg, name) < 1:
            raise ValueError(f"eval.{name} must be >= 1, got {getattr(cfg, name)}")
    if not 0 <= cfg.min_tokens <= cfg.max_tokens:
        raise ValueError(f"eval.min_tokens must be in [0, eval.max_tokens={cfg.max_tokens}], got {cfg.min_tokens}")
    if cfg.warmup < 0:
        raise ValueError(f"eval.warmup must be >= 0, got {cfg.warmup}")
    if cfg.max_minutes is not None and not cfg.max_minutes > 0:
        raise ValueError(f"eval.max_minutes must be > 0 (or null: no cap), got {cfg.max_minutes}")
    for name in cfg.drafts:
        if name in known - {"drafts"} or name == "hf":
            raise ValueError(f"eval.drafts: label {name!r} is reserved for a built-in method")
