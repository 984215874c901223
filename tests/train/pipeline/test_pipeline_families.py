"""The smoke pipeline end to end with a tiny random Qwen3-MoE target (target.path=): every stage runs, every
draft kind distils, evaluates and registers against a routed-experts target."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tiny_models import Init, save_tiny_model

REPO = Path(__file__).resolve().parents[3]


def tiny_qwen3_moe(out: Path) -> Path:
    from draftsmith.serve_eval.server.testing import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    decisive = Init(qk_norm_range=None, lm_head_std=0.5)  # decisive routing and next-token choices
    return save_tiny_model(out, "qwen3_moe", init=decisive, tokenizer=tok, vocab_size=len(tok), intermediate_size=96,
                           num_experts=4, num_hidden_layers=4, max_position_embeddings=512, norm_topk_prob=True,
                           bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)


def test_smoke_pipeline_with_a_qwen3_moe_target(tmp_path):
    target = tiny_qwen3_moe(tmp_path / "target")
    env = {**os.environ, "DRAFTSMITH_NO_PROGRESS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    proc = subprocess.run([sys.executable, "-m", "draftsmith.train.cli", "pipeline", "pipeline=smoke", f"target.path={target}",
                           f"artifacts_root={tmp_path / 'artifacts'}"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = proc.stdout + proc.stderr
    for stage in ("generate", "distill_standalone", "distill_medusa", "distill_eagle", "distill_eagle3", "eval",
                  "register"):
        assert f"stage={stage} status=done" in log, stage
