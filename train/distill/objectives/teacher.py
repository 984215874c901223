"""The target as a teacher: one teacher-forced forward over padded [B, S] batches.

Used by `train.generate` (the pass that stores top-k logits / hidden states after generation) and by the
objectives' online mode (the target forward inside the training loop). It runs the target through
transformers (any HF Llama-family checkpoint), in HF `hidden_states` indexing: aux layer i is the output
of decoder layer i-1 (0 = embeddings); `hidden` is the final-norm output, the lm_head input, exactly what
serve_eval's ModelExecutor hands a proposer.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple, Sequence

import torch
from torch import Tensor, nn


class TeacherOutput(NamedTuple):
    hidden: Tensor  # [B, S, d] final-norm hidden
    aux_hidden: Tensor | None  # [B, S, len(aux_layers) * d], layers concatenated in the given order
    logits: Tensor | None  # [B, S, V] fp32


def load_target_model(model_dir: str | Path, dtype: torch.dtype = torch.float32) -> nn.Module:
    from transformers import AutoModelForCausalLM

    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise ValueError(f"{model_dir}: not a target checkpoint dir (no config.json)")
    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype)


class Teacher:
    """A frozen target (or, for Medusa-2, one whose LoRA deltas train: `frozen=False` keeps grads on)."""

    def __init__(self, model: nn.Module, frozen: bool = True) -> None:
        self.model, self.frozen = model, frozen
        if frozen:
            model.eval().requires_grad_(False)
        self.num_layers = int(model.config.num_hidden_layers)
        self.hidden_size = int(model.config.hidden_size)

    @classmethod
    def from_dir(cls, model_dir: str | Path, device: torch.device | str = "cpu") -> "Teacher":
        return cls(load_target_model(model_dir).to(device))

    def to(self, device: torch.device | str) -> "Teacher":
        self.model.to(device)
        return self

    def lm_head_weight(self) -> Tensor:
        return self.model.get_output_embeddings().weight

    def forward(self, input_ids: Tensor, attention_mask: Tensor, aux_layers: Sequence[int] = (),
                need_logits: bool = True) -> TeacherOutput:
        """input_ids [B,S], attention_mask [B,S] (right padding) -> hidden, aux_hidden, logits."""
        bad = [i for i in aux_layers if not 0 <= i <= self.num_layers]
        if bad:
            raise ValueError(f"aux_layers {list(aux_layers)}: {bad} outside 0..{self.num_layers} (target layers)")
        with torch.set_grad_enabled(torch.is_grad_enabled() and not self.frozen):
            out = self.model.model(input_ids=input_ids, attention_mask=attention_mask.long(),
                                   output_hidden_states=bool(aux_layers))
            hidden = out.last_hidden_state
            aux = torch.cat([out.hidden_states[i] for i in aux_layers], dim=-1) if aux_layers else None
            logits = self.model.lm_head(hidden).float() if need_logits else None
        return TeacherOutput(hidden, aux, logits)

    __call__ = forward
