"""The smoke pipeline end to end with a tiny random Qwen3-MoE target (target.path=): every stage runs, every
draft kind distils, evaluates and registers against a routed-experts target."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[3]


def tiny_qwen3_moe(out: Path) -> Path:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from serve_eval.server.testing import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    cfg = Qwen3MoeConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                         num_experts=4, num_experts_per_tok=2, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, max_position_embeddings=512, norm_topk_prob=True,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(cfg).eval()
    with torch.no_grad():  # decisive routing and next-token choices (HF inits the router to zeros)
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0, 1)
        model.lm_head.weight.normal_(0, 0.5)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def test_smoke_pipeline_with_a_qwen3_moe_target(tmp_path):
    target = tiny_qwen3_moe(tmp_path / "target")
    env = {**os.environ, "DRAFTSMITH_NO_PROGRESS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    proc = subprocess.run([sys.executable, "-m", "train.cli", "pipeline", "pipeline=smoke", f"target.path={target}",
                           f"artifacts_root={tmp_path / 'artifacts'}"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = proc.stdout + proc.stderr
    for stage in ("generate", "distill_standalone", "distill_medusa", "distill_eagle", "distill_eagle3", "eval",
                  "register"):
        assert f"stage={stage} status=done" in log, stage
