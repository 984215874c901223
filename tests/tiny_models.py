"""The one factory of tiny random transformers models for the tests, one entry per target family the executor
serves (Llama, yarn-scaled Llama, Mistral, Qwen2, Qwen3 dense, Qwen3-MoE, Qwen2-MoE, with their sliding-window
variants). tests/conftest.py's `family_checkpoint` fixture saves them; tests that need the in-memory model or a
special shape call tiny_model / save_tiny_model here with the config fields they need.

Weights: torch.manual_seed(seed), then the transformers constructor, then `Init` re-draws what HF sets to
constants. For Llama that is nothing, so a tiny Llama here is bit-identical to `LlamaForCausalLM(config)`."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

# family architecture -> (transformers config class, model class)
ARCHITECTURES: dict[str, tuple[str, str]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
}
# The default tiny shape; callers pass another whole shape, or override any field (vocab, widths, depth,
# positions, init range, token ids).
SHAPE = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256)
MOE = dict(moe_intermediate_size=32, num_experts=6, num_experts_per_tok=2)
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
WINDOW = 6  # sliding window of the *-window families: a few dozen tokens of context outgrow it


@dataclass(frozen=True)
class Family:
    architecture: str  # a key of ARCHITECTURES
    fields: dict[str, Any] = field(default_factory=dict)  # what makes the family (rope scaling, window)


FAMILIES: dict[str, Family] = {
    "llama": Family("llama"),
    "llama-yarn": Family("llama", {"rope_scaling": YARN}),
    "mistral": Family("mistral", {"sliding_window": None}),
    "mistral-window": Family("mistral", {"sliding_window": WINDOW}),
    "qwen2": Family("qwen2"),
    "qwen2-window": Family("qwen2", {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1}),
    "qwen3": Family("qwen3"),
    "qwen3-window": Family("qwen3", {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 0}),
    "qwen3_moe": Family("qwen3_moe"),
    "qwen2_moe": Family("qwen2_moe", {"shared_expert_intermediate_size": 40}),
}


@dataclass(frozen=True)
class Init:
    """Weights HF initialises to constants, re-drawn after construction (None: left as HF made them). A zero
    router ties every expert, unit q/k norms and zero biases leave a missing multiply or add unseen; a wider LM
    head makes a random model's argmaxes decisive. Drawn in named_parameters order, one tensor at a time."""
    router_std: float | None = 1.0
    qk_norm_range: tuple[float, float] | None = (0.5, 1.5)
    bias_std: float | None = 0.3
    lm_head_std: float | None = None

    def apply(self, model: torch.nn.Module) -> None:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith(("mlp.gate.weight", "shared_expert_gate.weight")) and self.router_std is not None:
                    param.normal_(0, self.router_std)
                elif name.endswith(("q_norm.weight", "k_norm.weight")) and self.qk_norm_range is not None:
                    param.uniform_(*self.qk_norm_range)
                elif name.endswith("bias") and self.bias_std is not None:
                    param.normal_(0, self.bias_std)
                elif name == "lm_head.weight" and self.lm_head_std is not None:
                    param.normal_(0, self.lm_head_std)


HF_INIT = Init(router_std=None, qk_norm_range=None, bias_std=None)  # transformers' own init, nothing re-drawn


def tiny_config(family: str = "llama", shape: dict[str, Any] = SHAPE, **fields: Any) -> Any:
    """The transformers config of a tiny `family` model: `shape`, the family's fields, then `fields`."""
    if family not in FAMILIES:
        raise ValueError(f"tiny_config: unknown family {family!r} (families: {', '.join(FAMILIES)})")
    import transformers

    spec = FAMILIES[family]
    merged = {**shape, **(MOE if spec.architecture.endswith("moe") else {}), **spec.fields, **fields}
    # Qwen3's own default head_dim is 128, whatever the width: the tiny models keep hidden / heads
    merged.setdefault("head_dim", merged["hidden_size"] // merged["num_attention_heads"])
    return getattr(transformers, ARCHITECTURES[spec.architecture][0])(**merged)


def tiny_model(family: str = "llama", seed: int = 0, init: Init = Init(), shape: dict[str, Any] = SHAPE,
               **fields: Any) -> Any:
    """A tiny random transformers causal LM of `family` (fp32, eval mode)."""
    import transformers

    config = tiny_config(family, shape, **fields)
    torch.manual_seed(seed)
    model = getattr(transformers, ARCHITECTURES[FAMILIES[family].architecture][1])(config)
    init.apply(model)
    return model.eval()


def save_tiny_model(path: Path, family: str = "llama", seed: int = 0, init: Init = Init(),
                    shape: dict[str, Any] = SHAPE, tokenizer: Any = None, **fields: Any) -> Path:
    """tiny_model(...) saved as a checkpoint dir at `path` (with `tokenizer` when given); returns the path."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tiny_model(family, seed, init, shape, **fields).save_pretrained(path)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return path


def word_tokenizer(vocab: int, pad_token: str | None = None) -> Any:
    """A word-level tokenizer "w0".."w{vocab-1}" (w{vocab-1} = EOS, w1 = UNK), words joined with spaces: text
    round-trips exactly, so stop strings and detokenisation can be tested on a random model."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w1"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    extra = {} if pad_token is None else {"pad_token": pad_token}
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=f"w{vocab - 1}", unk_token="w1", **extra)
