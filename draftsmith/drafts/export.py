"""`draftsmith export`: write a draft dir in the layouts other engines read, and read those layouts back.

Formats (weights always safetensors):

* ``vllm``: EAGLE-1 in the layout vLLM's ``eagle`` method loads (``EagleLlamaForCausalLM``, as for
  yuhuili/EAGLE-LLaMA3-Instruct-8B): config.json is a one-layer LlamaConfig with architecture
  ``LlamaForCausalLM`` (vLLM renames it ``Eagle...``), weights ``fc.weight`` (no bias: vLLM's fc has none),
  ``layers.0.*`` without ``input_layernorm`` (vLLM replaces it by identity) and ``embed_tokens.weight``; no
  ``lm_head`` (vLLM uses the verifier's). Serve with ``speculative_config={"method": "eagle", "model": <dir>}``.
* ``speculators`` (vLLM, speculators >= 0.9): EAGLE-3 -> ``Eagle3Speculator`` (``layers.0.*``, ``fc``, ``norm``,
  ``lm_head``, ``embed_tokens``, ``d2t``, ``t2d``). config.json carries ``speculators_config`` (algorithm,
  proposal methods, verifier), ``transformer_layer_config``, ``draft_vocab_size``, ``target_hidden_size``,
  ``norm_before_residual``, ``eagle_aux_hidden_state_layer_ids``; the block draft -> DFlash
  (``DFlashDraftModel``, draftsmith/drafts/export_block.py). speculators has no EAGLE-1 type (its types:
  dflash, dflash2, dspark, eagle3, mtp, peagle, xpress), hence ``vllm`` above for EAGLE-1.
* ``sglang``: EAGLE-3 -> ``LlamaForCausalLMEagle3`` (a LlamaConfig with ``draft_vocab_size`` and
  ``eagle_config``; weights ``midlayer.*``, ``fc.weight``, ``norm.weight``, ``lm_head.weight``, ``d2t``, ``t2d``).
* ``medusa``: Medusa-1 layout (``medusa_num_heads``, ``medusa_num_layers``, ``base_model_name_or_path``;
  ``medusa_head.{k}.{j}.linear.*`` residual blocks and ``medusa_head.{k}.{num_layers}.weight`` LM heads).
* ``hf``: standalone drafts are plain HF LlamaForCausalLM dirs already.

Every field an engine reads is written with its value, never left to the reader's default (vLLM reads a missing
``norm_before_residual`` as True): the one-layer LlamaConfig of the draft layer in full (``head_dim`` included,
which Qwen3 sets apart from hidden_size / heads; ``torch_dtype``), ``draft_vocab_size`` with the ``d2t`` / ``t2d``
weights, the aux layer ids. The draft layer is Llama-style for Qwen3 and Qwen3-MoE targets as well, which is
how SpecForge lays out its Qwen3 EAGLE-3 drafts for SGLang (LlamaForCausalLMEagle3).

The verifier (``--verifier``) is written absolute when it names a local directory: engines take anything
else for a hub repo id. Its architecture (speculators' ``verifier.architectures``) is read from a local
verifier's config.json, or given (``--verifier-architecture Qwen3ForCausalLM``; draftsmith/drafts/export_verifier.py). A ``draftsmith_export.json`` beside them records the source draft's metadata and
the format.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Collection, Sequence

from torch import Tensor, nn

from draftsmith.drafts.eagle import EagleConfig, EagleDraft
from draftsmith.drafts.eagle3 import Eagle3Config, Eagle3Draft
from draftsmith.drafts.export_verifier import Verifier, check_aux_layers_servable, local_dir, resolve_verifier_info
from draftsmith.drafts.export_verifier import resolve_verifier as resolve_verifier  # (drafts.quant_export imports it from here)
from draftsmith.drafts.files import write_json
from draftsmith.drafts.io import draft_state_dict, load_draft, write_safetensors
from draftsmith.drafts.kinds import draft_kind
from draftsmith.drafts.medusa import MedusaConfig, MedusaDraft
from draftsmith.drafts.standalone import StandaloneDraft
from draftsmith.kernels.layers.checkpoint import load_target_embed_and_head, read_file, tensor_names
from draftsmith.kernels.layers.config import DecoderConfig

FORMATS = {"vllm": ("eagle",), "speculators": ("eagle3", "block"), "sglang": ("eagle3",), "medusa": ("medusa",), "hf": ("standalone",)}
EXPORT_META = "draftsmith_export.json"
SPECULATORS_VERSION = "0.9.0"  # the speculators config schema we write against (tests/test_export_schemas.py)
MEDUSA_WEIGHTS = "medusa_lm_head.safetensors"


def _layer_config(decoder_cfg, vocab_size: int, dtype: str | None = None) -> dict:
    """The one-layer LlamaConfig an EAGLE-style draft layer is (for Qwen3 targets too: the draft layer has no q/k
    norm, and head_dim is written since Qwen3's differs from hidden_size / heads). Every field explicit."""
    layer = {"model_type": "llama", "num_hidden_layers": 1, "vocab_size": vocab_size, "tie_word_embeddings": False,
             **decoder_cfg.to_llama_dict()}
    return {**layer, "torch_dtype": dtype} if dtype else layer


def _dtype_name(model: nn.Module) -> str:
    return str(next(model.parameters()).dtype).removeprefix("torch.")


def _speculators_config(algorithm: str, verifier: Verifier, num_speculative_tokens: int) -> dict:
    return {
        "algorithm": algorithm,
        "default_proposal_method": "greedy",
        "proposal_methods": [
            {"proposal_type": "greedy", "speculative_tokens": num_speculative_tokens, "verifier_accept_k": 1, "accept_tolerance": 0.0}
        ],
        "verifier": {"name_or_path": verifier.name_or_path, "architectures": list(verifier.architectures)},
    }


def _rename(state: dict[str, Tensor], rules: Sequence[tuple[str, str]]) -> dict[str, Tensor]:
    """Apply the first matching (regex, replacement) rule to each key; keys matching no rule are dropped."""
    out = {}
    for key, value in state.items():
        for pattern, repl in rules:
            match = re.fullmatch(pattern, key)
            if match:
                out[match.expand(repl)] = value
                break
    return out


# ------------------------------------------------------------------------------------------------ writers


def _export_eagle_vllm(model: EagleDraft, verifier: Verifier, k: int) -> tuple[dict, dict]:
    cfg = model.config
    if cfg.fc_bias:  # vLLM's EagleLlamaForCausalLM builds fc without a bias: it would refuse (or drop) fc.bias
        raise ValueError("export: format='vllm' holds EAGLE-1 drafts without an fc bias (vLLM's fc has none); "
                         "train with draft.fc_bias=false")
    config = {
        "architectures": ["LlamaForCausalLM"],  # vLLM's eagle method maps it to EagleLlamaForCausalLM
        **_layer_config(cfg.decoder, cfg.vocab_size, _dtype_name(model)),
        "base_model_name_or_path": verifier.name_or_path,
    }
    state = {k: v for k, v in draft_state_dict(model).items() if k != "lm_head.weight"}  # the verifier's head is used
    return config, state


def _export_eagle3_speculators(model: Eagle3Draft, verifier: Verifier, k: int) -> tuple[dict, dict]:
    cfg = model.config
    config = {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": _layer_config(cfg.decoder, cfg.vocab_size, _dtype_name(model)),
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        # vLLM reads a missing norm_before_residual as True: always written
        "norm_before_residual": cfg.norm_before_residual,
        "eagle_aux_hidden_state_layer_ids": list(cfg.aux_layers),
        "embed_requires_grad": False,  # the embedding is the target's, frozen in training
        "enable_sp_ulysses": False,  # (a speculators training option; our layer is trained whole)
        "draftsmith_fc_bias": cfg.fc_bias,
        "speculators_config": _speculators_config("eagle3", verifier, k),
    }
    rules = [(r"midlayer\.(.*)", r"layers.0.\1"), (r".*", r"\g<0>")]
    return config, _rename(draft_state_dict(model), rules)


def _export_eagle3_sglang(model: Eagle3Draft, verifier: Verifier, k: int) -> tuple[dict, dict]:
    """SGLang's (and SpecForge's) EAGLE-3 layout, the same for Llama and Qwen3 / Qwen3-MoE targets: SpecForge's
    Qwen3 drafts are LlamaForCausalLMEagle3 too, a one-layer Llama with the target's head_dim and rope."""
    cfg = model.config
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        **_layer_config(cfg.decoder, cfg.vocab_size, _dtype_name(model)),
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "bias": cfg.fc_bias,  # SGLang reads fc's bias flag from here
        "norm_before_residual": cfg.norm_before_residual,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(cfg.aux_layers), "use_aux_hidden_state": True},
        "base_model_name_or_path": verifier.name_or_path,
    }
    return config, draft_state_dict(model)


def _export_medusa(model: MedusaDraft, verifier: Verifier, k: int) -> tuple[dict, dict]:
    cfg = model.config
    config = {
        "architectures": ["MedusaModel"],
        "model_type": "medusa",
        "medusa_num_heads": cfg.num_heads,
        "medusa_num_layers": cfg.num_layers,
        "base_model_name_or_path": verifier.name_or_path,
        "hidden_size": cfg.hidden_size,
        "vocab_size": cfg.vocab_size,
        "draftsmith_shared_lm_head": cfg.shared_lm_head,
    }
    state: dict[str, Tensor] = {}
    for h, head in enumerate(model.heads):
        for j, block in enumerate(head.blocks):
            state[f"medusa_head.{h}.{j}.linear.weight"] = block.linear.weight
            state[f"medusa_head.{h}.{j}.linear.bias"] = block.linear.bias
        # Medusa's layout has one LM head per head: a shared head is written once per head (cloned: no shared storage)
        state[f"medusa_head.{h}.{cfg.num_layers}.weight"] = model.head_lm_weight(h).detach().clone()
    return config, state


def _export_block_speculators(model, verifier: Verifier, k: int) -> tuple[dict, dict]:
    from draftsmith.drafts.export_block import export_block_speculators  # the DFlash layout lives beside its draft

    return export_block_speculators(model, verifier, k, _layer_config, _speculators_config, SPECULATORS_VERSION)


WRITERS = {
    ("speculators", "block"): _export_block_speculators,
    ("vllm", "eagle"): _export_eagle_vllm,
    ("speculators", "eagle3"): _export_eagle3_speculators,
    ("sglang", "eagle3"): _export_eagle3_sglang,
    ("medusa", "medusa"): _export_medusa,
}


def export_draft(src: str | Path, fmt: str, out: str | Path, verifier: str | None = None, num_speculative_tokens: int = 5,
                 verifier_architecture: str | None = None) -> Path:
    """Export the draft dir `src` as `fmt` into `out`. verifier: the target's name/path written into the config;
    verifier_architecture: its HF architecture (default: read from a local verifier dir, see resolve_verifier_info)."""
    if fmt not in FORMATS:
        raise ValueError(f"export: format={fmt!r} is not one of {sorted(FORMATS)}")
    loaded = load_draft(src)
    if loaded.kind not in FORMATS[fmt]:
        hint = [f for f, kinds in FORMATS.items() if loaded.kind in kinds]
        raise ValueError(f"export: format={fmt!r} takes {list(FORMATS[fmt])} drafts, but {src} is a {loaded.kind!r} draft "
                         f"(a {loaded.kind!r} draft exports as format={hint[0]!r})")
    if num_speculative_tokens <= 0:
        raise ValueError(f"export: num_speculative_tokens must be > 0, got {num_speculative_tokens}")
    target = resolve_verifier_info(verifier, verifier_architecture)  # before anything is written: no half export
    if draft_kind(loaded.kind).reads_aux_layers:  # its formats are all other engines', which capture layers 0..L-1
        check_aux_layers_servable(list(loaded.model.config.aux_layers), target)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if fmt == "hf":
        config, state, weights_file = loaded.model.config.to_hf_dict(), draft_state_dict(loaded.model), "model.safetensors"
    else:
        config, state = WRITERS[(fmt, loaded.kind)](loaded.model, target, num_speculative_tokens)
        weights_file = MEDUSA_WEIGHTS if fmt == "medusa" else "model.safetensors"
    write_safetensors(out / weights_file, state)
    write_json(out / "config.json", config)
    write_json(out / EXPORT_META, {"format": fmt, "kind": loaded.kind, "source": str(src), "source_meta": asdict(loaded.meta)})
    return out


# ------------------------------------------------------------------------------------------------ readers


def detect_format(config: dict, weight_names: Collection[str] = ()) -> str:
    archs = config.get("architectures") or []
    if "speculators_config" in config:
        return "speculators"
    if "LlamaForCausalLMEagle3" in archs:
        return "sglang"
    if "medusa_num_heads" in config:
        return "medusa"
    if any(a.endswith("ForCausalLM") for a in archs):
        # vLLM's EAGLE-1 layout is a LlamaConfig too: its fc (fusing embedding and feature) tells it apart
        return "vllm" if "EagleLlamaForCausalLM" in archs or "fc.weight" in weight_names else "hf"
    raise ValueError(f"config.json: cannot tell the export format (architectures={archs})")


def _strict_load(model: nn.Module, state: dict[str, Tensor], source: Path, allow_missing: Sequence[str] = ()) -> nn.Module:
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if k not in allow_missing]
    if missing or unexpected:
        raise ValueError(f"{source}: missing weights {missing[:5]}, unexpected {unexpected[:5]}")
    return model


def _decoder(layer: dict) -> DecoderConfig:
    bias = layer.get("attention_bias", False)  # Llama's one flag for q/k/v and o
    return DecoderConfig.from_dict({**layer, "qkv_bias": bias, "o_bias": bias})


def load_exported(
    path: str | Path,
    target_embed_and_head: tuple[Tensor, Tensor] | None = None,
    target_dir: str | Path | None = None,
) -> nn.Module:
    """Read an exported layout back into our module. vLLM EAGLE-1 dirs need the target's LM head
    (``target_embed_and_head``, ``target_dir``, or the verifier recorded in the export when it is a local dir)."""
    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    fmt = detect_format(config, tensor_names(path / "model.safetensors"))
    if fmt == "hf":
        return StandaloneDraft.from_hf(path)
    if fmt == "medusa":
        return _load_medusa(path, config)
    if fmt == "vllm":
        return _load_eagle_vllm(path, config, target_embed_and_head, target_dir)
    if fmt == "speculators" and config.get("speculators_model_type") == "dflash":
        from draftsmith.drafts.export_block import load_block_speculators

        return load_block_speculators(path, config, _decoder)
    if config.get("speculators_model_type") != "eagle3" and fmt == "speculators":
        raise ValueError(f"{path}: speculators_model_type {config.get('speculators_model_type')!r} is not read here "
                         "(EAGLE-1 exports as format='vllm'; speculators has no EAGLE-1 type)")
    return _load_eagle3(path, config, fmt)


def _load_eagle_vllm(path: Path, config: dict, target_embed_and_head: tuple[Tensor, Tensor] | None,
                     target_dir: str | Path | None) -> EagleDraft:
    state = read_file(path / "model.safetensors")
    source = target_dir or local_dir(config.get("base_model_name_or_path"))
    if target_embed_and_head is None and source is None:
        raise ValueError(f"{path}: a vLLM EAGLE-1 dir has no LM head (vLLM uses the verifier's) and its verifier "
                         f"{config.get('base_model_name_or_path')!r} is no local dir; pass target_embed_and_head or target_dir")
    embed, head = target_embed_and_head or load_target_embed_and_head(source)
    state.setdefault("embed_tokens.weight", embed)  # vLLM shares the verifier's embedding when a dir has none
    state["lm_head.weight"] = head
    cfg = EagleConfig(vocab_size=int(config["vocab_size"]), decoder=_decoder(config), fc_bias="fc.bias" in state)
    return _strict_load(EagleDraft(cfg), state, path)


def _load_eagle3(path: Path, config: dict, fmt: str) -> Eagle3Draft:
    state = read_file(path / "model.safetensors")
    layer = config["transformer_layer_config"] if fmt == "speculators" else config
    if fmt == "speculators":
        aux = config.get("eagle_aux_hidden_state_layer_ids")
        fc_bias = bool(config.get("draftsmith_fc_bias", "fc.bias" in state))
        state = _rename(state, [(r"layers\.0\.(.*)", r"midlayer.\1"), (r".*", r"\g<0>")])
    else:
        aux = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        fc_bias = bool(config.get("bias", False))
    if aux is None:
        raise ValueError(f"{path}: config.json does not name the aux hidden-state layers (eagle_aux_hidden_state_layer_ids)")
    cfg = Eagle3Config(
        vocab_size=int(layer["vocab_size"]),
        decoder=_decoder(layer),
        target_hidden_size=int(config.get("target_hidden_size") or layer["hidden_size"]),
        aux_layers=list(aux),
        draft_vocab_size=int(config.get("draft_vocab_size") or layer["vocab_size"]),
        norm_before_residual=bool(config.get("norm_before_residual", False)),
        fc_bias=fc_bias,
    )
    return _strict_load(Eagle3Draft(cfg), state, path)


def _load_medusa(path: Path, config: dict) -> MedusaDraft:
    files = [path / MEDUSA_WEIGHTS] if (path / MEDUSA_WEIGHTS).is_file() else sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path}: no Medusa safetensors weights")
    state: dict[str, Tensor] = {}
    for f in files:
        state.update(read_file(f))
    num_heads, num_layers = int(config["medusa_num_heads"]), int(config["medusa_num_layers"])
    shared = bool(config.get("draftsmith_shared_lm_head", False))
    head0 = state[f"medusa_head.0.{num_layers}.weight"]
    cfg = MedusaConfig(hidden_size=head0.shape[1], vocab_size=head0.shape[0], num_heads=num_heads, num_layers=num_layers, shared_lm_head=shared)
    rules = [(r"medusa_head\.(\d+)\.(\d+)\.linear\.(weight|bias)", r"heads.\1.blocks.\2.linear.\3")]
    if shared:
        rules.append((rf"medusa_head\.0\.{num_layers}\.weight", "lm_head.weight"))
    else:
        rules.append((rf"medusa_head\.(\d+)\.{num_layers}\.weight", r"heads.\1.lm_head.weight"))
    return _strict_load(MedusaDraft(cfg), _rename(state, rules), path)


# ------------------------------------------------------------------------------------------------ CLI


def _normalise_argv(argv: Sequence[str]) -> list[str]:
    """Accept Hydra-style ``key=value`` as well as ``--key value``."""
    out: list[str] = []
    for arg in argv:
        if not arg.startswith("-") and "=" in arg:
            key, value = arg.split("=", 1)
            out += [f"--{key.replace('_', '-')}", value]
        else:
            out.append(arg)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="draftsmith export", description="Export a draft dir to another engine's layout.")
    parser.add_argument("--src", required=True, help="draft dir written by draftsmith (save_draft)")
    parser.add_argument("--format", required=True, choices=sorted(FORMATS))
    parser.add_argument("--out", required=True, help="output dir")
    parser.add_argument("--verifier", default=None, help="target hub id or local path written into the exported config (a local path is stored absolute)")
    parser.add_argument("--verifier-architecture", default=None,
                        help="the target's HF architecture, e.g. Qwen3ForCausalLM (default: read from a local --verifier dir, "
                             "else LlamaForCausalLM)")
    parser.add_argument("--num-speculative-tokens", type=int, default=5)
    args = parser.parse_args(_normalise_argv(sys.argv[1:] if argv is None else argv))
    try:
        out = export_draft(args.src, args.format, args.out, args.verifier, args.num_speculative_tokens,
                           args.verifier_architecture)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"exported {args.src} as {args.format} -> {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
