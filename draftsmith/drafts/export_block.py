"""The block draft in speculators' DFlash layout (``speculators_model_type: dflash``), and back.

config.json follows the fields speculators documents for DFlash: ``architectures: [DFlashDraftModel]``,
``speculators_model_type``, ``block_size``, ``aux_hidden_state_layer_ids``, ``target_hidden_size``,
``draft_vocab_size``, ``num_hidden_layers``, ``transformer_layer_config`` (a LlamaConfig dict) and
``speculators_config`` (algorithm ``dflash``, proposal methods, verifier). Weights keep the names our module has:
``fc``, ``hidden_norm``, ``layers.{i}.*``, ``norm``, ``lm_head``, ``embed_tokens`` (the target's, carried so the
dir is self-contained) and ``mask_embeddings``.

Where our draft differs from the published DFlash, the difference is written down, never hidden: DFlash embeds
its masks through a ``mask_token_id`` of the target's vocabulary, ours are learned rows (``mask_embeddings``,
``draftsmith_num_mask_tokens`` of them), so ``mask_token_id`` is null; our layers are Llama-style (no QK norm).
"""

from __future__ import annotations

from pathlib import Path

from torch import Tensor

from draftsmith.drafts.block import BlockConfig, BlockDraft, check_block_k
from draftsmith.drafts.io import draft_state_dict
from draftsmith.kernels.layers.checkpoint import read_file
from draftsmith.kernels.layers.config import DecoderConfig

ARCHITECTURE = "DFlashDraftModel"
MODEL_TYPE = "dflash"


def export_block_speculators(model: BlockDraft, verifier, k: int, layer_config, speculators_config,
                             version: str) -> tuple[dict, dict[str, Tensor]]:
    """(config.json dict, weights) of the speculators DFlash layout. k: the proposal length written."""
    cfg = model.config
    check_block_k(k, cfg.block_size)
    layer = {**layer_config(cfg.decoder, cfg.vocab_size), "num_hidden_layers": cfg.num_layers}
    config = {
        "architectures": [ARCHITECTURE],
        "speculators_model_type": MODEL_TYPE,
        "speculators_version": version,
        "block_size": cfg.block_size,
        "aux_hidden_state_layer_ids": list(cfg.aux_layers),
        "target_hidden_size": cfg.target_hidden_size,
        "draft_vocab_size": cfg.vocab_size,
        "num_hidden_layers": cfg.num_layers,
        "mask_token_id": None,  # ours are learned rows, see the module docstring
        "draftsmith_num_mask_tokens": cfg.num_mask_tokens,
        "draftsmith_fc_bias": cfg.fc_bias,
        "transformer_layer_config": layer,
        "speculators_config": speculators_config(MODEL_TYPE, verifier, k),
    }
    return config, draft_state_dict(model)


def is_block_export(config: dict) -> bool:
    return config.get("speculators_model_type") == MODEL_TYPE


def load_block_speculators(path: Path, config: dict, decoder_from_layer) -> BlockDraft:
    """Read a speculators DFlash dir written by export_block_speculators back into our module."""
    layer = config["transformer_layer_config"]
    aux = config.get("aux_hidden_state_layer_ids")
    if not aux:
        raise ValueError(f"{path}: config.json does not name the aux hidden-state layers (aux_hidden_state_layer_ids)")
    decoder: DecoderConfig = decoder_from_layer(layer)
    cfg = BlockConfig(vocab_size=int(layer["vocab_size"]), decoder=decoder,
                      target_hidden_size=int(config.get("target_hidden_size") or layer["hidden_size"]),
                      aux_layers=list(aux), num_layers=int(config.get("num_hidden_layers") or layer["num_hidden_layers"]),
                      block_size=int(config["block_size"]), num_mask_tokens=config.get("draftsmith_num_mask_tokens"),
                      fc_bias=bool(config.get("draftsmith_fc_bias", False)))
    state = read_file(path / "model.safetensors")
    BlockDraft.check_state(cfg, state, str(path / "model.safetensors"))
    model = BlockDraft(cfg)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"{path}: missing weights {missing[:5]}, unexpected {unexpected[:5]}")
    return model
