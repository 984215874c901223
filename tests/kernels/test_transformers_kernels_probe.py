"""Our top-level `kernels` package must not be mistaken for the HF hub `kernels` package by transformers."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

PROBE = """
import importlib.util, pathlib, torch
spec = importlib.util.find_spec("kernels")
assert spec is not None and pathlib.Path(spec.origin).resolve().is_relative_to(pathlib.Path(r"{repo}")), spec
from transformers.utils.import_utils import is_kernels_available
assert not is_kernels_available(), "transformers took draftsmith's kernels package for the HF hub one"
from transformers import LlamaConfig, LlamaForCausalLM
cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2)
torch.manual_seed(0)
logits = LlamaForCausalLM(cfg)(torch.tensor([[1, 2, 3, 4]])).logits
assert logits.shape == (1, 4, 128) and torch.isfinite(logits).all()
print("probe-ok")
"""


def test_llama_forward_with_local_kernels_importable():
    """In a fresh interpreter where draftsmith's `kernels` resolves first, transformers' Llama still imports,
    reports the hub kernels package as unavailable, and runs a finite forward pass."""
    proc = subprocess.run([sys.executable, "-c", PROBE.format(repo=REPO)], cwd=REPO,
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "probe-ok" in proc.stdout
