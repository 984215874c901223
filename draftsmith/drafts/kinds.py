"""THE registry of draft kinds: every room asks it which kinds exist and what each one reads.

A kind is its module and config classes plus what it needs from the target. The rooms above
register their own piece by kind (the proposer in serve_eval.speculative.proposers, the objective in
train.distill.objectives, the pipeline's distill stage from the kind names here); none of them
keeps its own list of kind names.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from draftsmith.drafts.block import BlockConfig, BlockDraft
from draftsmith.drafts.eagle import EagleConfig, EagleDraft
from draftsmith.drafts.eagle3 import Eagle3Config, Eagle3Draft
from draftsmith.drafts.medusa import MedusaConfig, MedusaDraft
from draftsmith.drafts.standalone import StandaloneConfig, StandaloneDraft

# The files of a draft dir (drafts.io writes and reads them).
META_FILE = "draftsmith.json"
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"


@dataclass(frozen=True)
class DraftKind:
    name: str
    module: type[nn.Module]
    config: type
    reads_target_features: bool    # hidden states of the target (Medusa, EAGLE, block): a foreign target errs
    reads_aux_layers: bool         # several target layers fused (EAGLE-3, block)

    def build(self, cfg_dict: dict[str, Any]) -> nn.Module:
        """The module from a saved config.json (a plain HF config for standalone drafts)."""
        if self.name == "standalone":
            return self.module(self.config.from_hf(cfg_dict))
        fields = {k: v for k, v in cfg_dict.items() if k in self.config.__dataclass_fields__}
        return self.module(self.config(**fields))


KINDS: dict[str, DraftKind] = {k.name: k for k in (
    DraftKind("standalone", StandaloneDraft, StandaloneConfig, False, False),
    DraftKind("medusa", MedusaDraft, MedusaConfig, True, False),
    DraftKind("eagle", EagleDraft, EagleConfig, True, False),
    DraftKind("eagle3", Eagle3Draft, Eagle3Config, True, True),
    DraftKind("block", BlockDraft, BlockConfig, True, True),
)}
KIND_NAMES: tuple[str, ...] = tuple(KINDS)


def draft_kind(name: str, field: str = "kind") -> DraftKind:
    """The kind named `name`, or ValueError naming the field and the kinds there are."""
    if name not in KINDS:
        raise ValueError(f"{field}: unknown draft kind {name!r} (kinds: {', '.join(KIND_NAMES)})")
    return KINDS[name]


def build_from_config(kind: str, cfg_dict: dict[str, Any]) -> nn.Module:
    return draft_kind(kind).build(cfg_dict)


def kind_of(model: nn.Module) -> str:
    """The kind of a draft module (its class's `kind` attribute)."""
    kind = getattr(model, "kind", None)
    if kind not in KINDS:
        raise ValueError(f"save_draft: {type(model).__name__} is not a draft module (kinds: {', '.join(KIND_NAMES)})")
    return kind
