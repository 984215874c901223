"""Benchmark domains beyond the embedded ones (Spec-Bench-style, HumanEval, GSM8K) via `datasets`.

Entries live in conf/eval/{specbench,humaneval,gsm8k}.yaml under `external_domains`. Nothing is
downloaded unless `allow_download=True`: by default the Hub is put in offline mode for the call, so
a dataset that is not in the local cache (or a local data file that is missing) is reported as
unavailable at once with a message saying how to provide it, and the harness skips that domain.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from draftsmith import CONF_DIR

CONF_EVAL_DIR = CONF_DIR / "eval"


class DatasetUnavailable(RuntimeError):
    """The dataset is not available on this machine (not cached, file missing, offline)."""


@dataclass
class ExternalDomain:
    """One eval domain read through `datasets.load_dataset(path, name, split=..., data_files=...)`."""

    domain: str
    path: str                        # hub id ("openai/gsm8k") or packaged builder ("json") with data_files
    name: str | None = None          # dataset config ("main")
    split: str = "test"
    data_files: str | None = None    # local file(s) for a packaged builder
    prompt_field: str = "prompt"     # dotted path; integer parts index lists ("turns.0")
    filter_field: str | None = None  # keep rows whose field value is in filter_values
    filter_values: list[str] = field(default_factory=list)
    template: str = "{prompt}"       # how the prompt is shown to the model
    max_prompts: int = 64

    def __post_init__(self) -> None:
        if not self.domain:
            raise ValueError("external domain: 'domain' must be a non-empty string")
        if not self.path:
            raise ValueError(f"external domain {self.domain}: 'path' must be a non-empty string")
        if "{prompt}" not in self.template:
            raise ValueError(f"external domain {self.domain}: 'template' must contain {{prompt}}")
        if self.max_prompts < 1:
            raise ValueError(f"external domain {self.domain}: 'max_prompts' must be >= 1")
        if self.filter_field and not self.filter_values:
            raise ValueError(f"external domain {self.domain}: 'filter_values' is empty but filter_field is set")


def domains_from_config(cfg: Mapping[str, Any] | Any) -> list[ExternalDomain]:
    """Parse the `external_domains` list of an eval config (plain dict or OmegaConf node)."""
    try:
        from omegaconf import OmegaConf
        if OmegaConf.is_config(cfg):
            cfg = OmegaConf.to_container(cfg, resolve=True)
    except ImportError:
        pass
    entries = (cfg or {}).get("external_domains") or []
    if not isinstance(entries, list):
        raise ValueError("external_domains must be a list of domain entries")
    known = {f.name for f in fields(ExternalDomain)}
    out = []
    for i, e in enumerate(entries):
        if not isinstance(e, Mapping):
            raise ValueError(f"external_domains[{i}] must be a mapping")
        unknown = sorted(set(e) - known)
        if unknown:
            raise ValueError(f"external_domains[{i}]: unknown field(s) {', '.join(unknown)}")
        out.append(ExternalDomain(**e))
    return out


def load_config_file(name_or_path: str | Path) -> list[ExternalDomain]:
    """Entries of conf/eval/<name>.yaml (or a YAML path), ${oc.env:...} resolved."""
    from omegaconf import OmegaConf

    path = Path(name_or_path)
    if not path.suffix:
        path = CONF_EVAL_DIR / f"{name_or_path}.yaml"
    if not path.is_file():
        raise ValueError(f"external domains config: no file at {path}")
    return domains_from_config(OmegaConf.load(path))


@contextlib.contextmanager
def _hub_offline(enabled: bool) -> Iterator[None]:
    """Force `datasets`/`huggingface_hub` offline for one call (they read the flag at call time);
    without it an unreachable Hub costs ~25 s of retries before failing."""
    if not enabled:
        yield
        return
    import datasets.config
    import huggingface_hub.constants as hub_constants

    saved = (datasets.config.HF_HUB_OFFLINE, hub_constants.HF_HUB_OFFLINE)
    datasets.config.HF_HUB_OFFLINE = hub_constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, hub_constants.HF_HUB_OFFLINE = saved


def _get(row: Mapping[str, Any], dotted: str, where: str) -> Any:
    value: Any = row
    for part in dotted.split("."):
        try:
            value = value[int(part)] if isinstance(value, (list, tuple)) else value[part]
        except (KeyError, IndexError, ValueError, TypeError):
            raise ValueError(f"{where}: field '{dotted}' not found in row (fields: {sorted(row)})") from None
    return value


def load_prompts(spec: ExternalDomain, allow_download: bool = False, cache_dir: str | Path | None = None) -> list[str]:
    """The domain's prompts; DatasetUnavailable when the data is not on this machine,
    ValueError when it is there but the entry does not fit it (field, filter)."""
    where = f"external domain {spec.domain} ({spec.path})"
    if spec.data_files is not None:
        missing = [f for f in [spec.data_files] if not Path(f).exists()]
        if missing:
            raise DatasetUnavailable(f"{where}: data file {missing[0]} not found; point data_files at a local copy")
    try:
        import datasets
    except ImportError as e:
        raise DatasetUnavailable(f"{where}: the `datasets` package is not installed") from e
    try:
        with _hub_offline(not allow_download):
            ds = datasets.load_dataset(spec.path, spec.name, split=spec.split, data_files=spec.data_files,
                                       cache_dir=str(cache_dir) if cache_dir else None)
    except Exception as e:  # datasets raises many kinds (ConnectionError, FileNotFoundError, DatasetNotFoundError)
        hint = ("it is not in the local `datasets` cache and downloads are off; fetch it on a machine with "
                f"network (datasets.load_dataset({spec.path!r}, {spec.name!r}, split={spec.split!r})) and copy "
                "HF_DATASETS_CACHE here, or set allow_download=true where the Hub is reachable")
        if allow_download:
            hint = "loading failed"
        raise DatasetUnavailable(f"{where}: {hint} [{type(e).__name__}: {str(e)[:200]}]") from e
    prompts = []
    for row in ds:
        if spec.filter_field and str(_get(row, spec.filter_field, where)) not in spec.filter_values:
            continue
        prompts.append(spec.template.format(prompt=str(_get(row, spec.prompt_field, where))))
        if len(prompts) == spec.max_prompts:
            break
    if not prompts:
        raise ValueError(f"{where}: no prompts (split {spec.split!r}, filter {spec.filter_field}={spec.filter_values})")
    return prompts


@dataclass
class LoadedDomains:
    prompts: dict[str, list[str]]                 # domain -> prompts
    skipped: list[dict[str, str]]                 # {domain, reason}; the harness copies them into report.skipped


def load_domains(specs: list[ExternalDomain], allow_download: bool = False,
                 cache_dir: str | Path | None = None) -> LoadedDomains:
    """Load every entry; one that cannot be loaded is skipped with its reason, the rest still load."""
    loaded = LoadedDomains({}, [])
    for spec in specs:
        try:
            loaded.prompts.setdefault(spec.domain, []).extend(load_prompts(spec, allow_download, cache_dir))
        except (DatasetUnavailable, ValueError) as e:
            loaded.skipped.append({"domain": spec.domain, "reason": str(e)})
    loaded.prompts = {d: p for d, p in loaded.prompts.items() if p}
    return loaded
