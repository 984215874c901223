"""The target as a teacher: one teacher-forced forward over padded [B, S] batches.

Used by `draftsmith.train.distill.dataset` (the pass that stores top-k logits / hidden states after generation) and by the
objectives' online mode (the target forward inside the training loop). It runs the target through
transformers (any HF Llama-family checkpoint, Qwen3 and Qwen3-MoE included), in HF `hidden_states`
indexing: aux layer i is the output of decoder layer i-1 (0 = embeddings); `hidden` is the final-norm
output, the lm_head input, exactly what serve_eval's ModelExecutor hands a proposer.

A frozen target too big for one device is sharded across the ranks (`Teacher.shard`, FSDP2 `fully_shard`):
each decoder layer is one unit, gathered for its forward and freed after it; the root unit (embedding,
final norm, LM head) is the `TargetForward` wrapper, so the forward goes through its hooks. Every rank then
holds about 1/world of the target's weights, and every rank must call the teacher the same number of times
(the trainer's loop and its held-out pass do: a rank out of eval batches repeats its last one).
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


class TargetForward(nn.Module):
    """The HF causal LM's body + head as one module call (FSDP2's root unit when the target is sharded)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: Tensor, attention_mask: Tensor, output_hidden_states: bool,
                need_logits: bool) -> tuple[Tensor, tuple[Tensor, ...] | None, Tensor | None]:
        out = self.model.model(input_ids=input_ids, attention_mask=attention_mask.long(),
                               output_hidden_states=output_hidden_states)
        hidden = out.last_hidden_state
        logits = self.model.lm_head(hidden).float() if need_logits else None
        return hidden, out.hidden_states, logits


class Teacher:
    """A frozen target (or, for Medusa-2, one whose LoRA deltas train: `frozen=False` keeps grads on)."""

    def __init__(self, model: nn.Module, frozen: bool = True) -> None:
        self.model, self.frozen = model, frozen
        if frozen:
            model.eval().requires_grad_(False)
        self.num_layers = int(model.config.num_hidden_layers)
        self.hidden_size = int(model.config.hidden_size)
        self.forward_module = TargetForward(model)
        self.sharded = False

    @classmethod
    def from_dir(cls, model_dir: str | Path, device: torch.device | str = "cpu") -> "Teacher":
        return cls(load_target_model(model_dir).to(device))

    def to(self, device: torch.device | str) -> "Teacher":
        if not self.sharded:  # a sharded target already sits on its mesh's device, one shard per rank
            self.model.to(device)
        return self

    def shard(self, device: torch.device, reshard_after_forward: bool = True) -> None:
        """Split the frozen target's weights across the ranks of the default process group (FSDP2).
        Collective: every rank calls it, with the target loaded on CPU (it then moves shard by shard)."""
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        if not self.frozen:
            raise ValueError("launcher.shard_target: the target trains in this job (draft.medusa2=true), so it is part "
                             "of the trained module; shard it with launcher=fsdp instead")
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError("launcher.shard_target: needs a multi-process launch (no process group is initialised)")
        try:
            layers = self.model.model.layers  # every HF decoder-only causal LM names its blocks so
        except AttributeError:
            raise ValueError(f"launcher.shard_target: {type(self.model).__name__} has no model.layers to shard by") from None
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        for layer in layers:
            fully_shard(layer, mesh=mesh, reshard_after_forward=reshard_after_forward)
        fully_shard(self.forward_module, mesh=mesh, reshard_after_forward=reshard_after_forward)
        self.sharded = True

    def local_share(self) -> float:
        """Fraction of the target's weight elements this process holds (1.0 unsharded)."""
        from torch.distributed.tensor import DTensor

        params = list(self.model.parameters())
        local = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in params)
        return local / max(1, sum(p.numel() for p in params))

    def lm_head_weight(self) -> Tensor:
        return self.model.get_output_embeddings().weight

    def forward(self, input_ids: Tensor, attention_mask: Tensor, aux_layers: Sequence[int] = (),
                need_logits: bool = True) -> TeacherOutput:
        """input_ids [B,S], attention_mask [B,S] (right padding) -> hidden, aux_hidden, logits."""
        bad = [i for i in aux_layers if not 0 <= i <= self.num_layers]
        if bad:
            raise ValueError(f"aux_layers {list(aux_layers)}: {bad} outside 0..{self.num_layers} (target layers)")
        with torch.set_grad_enabled(torch.is_grad_enabled() and not self.frozen):
            hidden, hidden_states, logits = self.forward_module(input_ids, attention_mask, bool(aux_layers), need_logits)
            aux = torch.cat([hidden_states[i] for i in aux_layers], dim=-1) if aux_layers else None
        return TeacherOutput(hidden, aux, logits)

    __call__ = forward
