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


def resolve_verifier_info(verifier: str | None, architecture: str | None = None) -> Verifier:
    """The verifier (``resolve_verifier``) with its architecture: the one given, else the ``architectures`` of a
    local verifier dir's config.json, else LlamaForCausalLM (a hub id or no verifier: pass ``architecture``)."""
    name = resolve_verifier(verifier)
    if architecture:
        return Verifier(name, [architecture])
    local = local_dir(name)
    if local is not None and (local / "config.json").is_file():
        found = json.loads((local / "config.json").read_text()).get("architectures")
        if not found:
            raise ValueError(f"export: {local / 'config.json'} names no architectures; pass --verifier-architecture")
        return Verifier(name, list(found))
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
    output (HF hidden_states[L], which draftsmith's own engine serves) has no id there. Checked against a local
    verifier's config.json; a hub id is not read."""
    path = local_dir(verifier.name_or_path)
    config = path / "config.json" if path is not None else None
    if config is None or not config.is_file():
        return
    num_layers = json.loads(config.read_text()).get("num_hidden_layers")
    bad = [layer for layer in aux_layers if num_layers is not None and not 0 <= layer < int(num_layers)]
    if bad:
        raise ValueError(f"aux layer ids {bad}: an engine captures the inputs of {config.parent.name}'s decoder layers "
                         f"0..{int(num_layers) - 1}; layer {num_layers} (the final norm's output) serves in draftsmith "
                         f"only. A draft for vLLM/SGLang trains on layers below {num_layers} "
                         f"(e.g. pipeline.drafts.<kind>.aux_layers=[2,{int(num_layers) // 2},{int(num_layers) - 1}])")
