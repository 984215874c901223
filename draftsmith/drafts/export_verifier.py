"""Who an export speculates for: the verifier's name or path (a local dir made absolute, a hub id kept) and its HF
architecture, which speculators' ``verifier.architectures`` names (a Qwen3 target is ``Qwen3ForCausalLM``)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


DEFAULT_VERIFIER_ARCHITECTURES = ["LlamaForCausalLM"]  # a hub-id verifier whose architecture nobody named


@dataclass(frozen=True)
class Verifier:
    """The target an export speculates for, as engines' configs name it: where to find it and its HF
    architecture (``Qwen3ForCausalLM``, ``Qwen3MoeForCausalLM``, ``LlamaForCausalLM``, ...)."""

    name_or_path: str | None
    architectures: list[str]
    num_hidden_layers: int | None = None   # from a local verifier's config.json (None: a hub id, not read)


def resolve_verifier_info(verifier: str | None, architecture: str | None = None) -> Verifier:
    """The verifier (``resolve_verifier``) with its architecture: the one given, else the ``architectures`` of a
    local verifier dir's config.json, else LlamaForCausalLM (a hub id or no verifier: pass ``architecture``)."""
    name = resolve_verifier(verifier)
    local = local_dir(name)
    config_path = local / "config.json" if local is not None else None
    config = json.loads(config_path.read_text()) if config_path is not None and config_path.is_file() else None
    layers = (config or {}).get("num_hidden_layers")
    layers = None if layers is None else int(layers)
    if architecture:
        return Verifier(name, [architecture], layers)
    if config is not None:
        found = config.get("architectures")
        if not found:
            raise ValueError(f"export: {config_path} names no architectures; pass --verifier-architecture")
        return Verifier(name, list(found), layers)
    return Verifier(name, list(DEFAULT_VERIFIER_ARCHITECTURES))


def resolve_verifier(verifier: str | None) -> str | None:
    """An existing local path made absolute (engines resolve a relative one as a hub repo id, not against
    the export dir); a hub id (``name`` or ``org/name``) kept as is; a path-like name that exists nowhere
    is an error now rather than a failed download at serve time."""
    if not verifier:
        return None
    path = Path(verifier).expanduser()
    if path.exists():
        return str(path.resolve())
    if path.is_absolute() or verifier.startswith((".", "~")) or verifier.count("/") > 1:
        raise ValueError(f"export: --verifier {verifier!r} is not an existing directory (a hub id is 'name' or 'org/name')")
    return verifier


def local_dir(name: str | None) -> Path | None:
    """The verifier recorded in an export, where it is a directory on this machine (else None: a hub id)."""
    if not name:
        return None
    path = Path(name).expanduser()
    return path.resolve() if path.is_dir() else None


def check_aux_layers_servable(aux_layers: list[int], verifier: Verifier) -> None:
    """ValueError where an aux layer id is one an engine cannot capture: vLLM and SGLang take id i as the input of the
    verifier's decoder layer i (HF hidden_states[i]), so ids run 0..num_hidden_layers - 1, and the final norm's
    output (HF hidden_states[L], which draftsmith's own engine serves) has no id there. Checked where the verifier's
    layer count is known (a local verifier's config.json); a hub id is not read."""
    num_layers = verifier.num_hidden_layers
    if num_layers is None:
        return
    bad = [layer for layer in aux_layers if not 0 <= layer < num_layers]
    if bad:
        name = Path(verifier.name_or_path or "").name
        raise ValueError(f"aux layer ids {bad}: an engine captures the inputs of {name}'s decoder layers "
                         f"0..{num_layers - 1}; layer {num_layers} (the final norm's output) serves in draftsmith "
                         f"only. A draft for vLLM/SGLang trains on layers below {num_layers} "
                         f"(e.g. pipeline.drafts.<kind>.aux_layers=[2,{num_layers // 2},{num_layers - 1}])")
