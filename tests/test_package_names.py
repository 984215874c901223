"""draftsmith installs one top-level package, `draftsmith`: none of its rooms' names (`kernels`, `train`, ...)
can shadow another distribution's module, such as the HF hub `kernels` package that transformers imports."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ROOMS = ("kernels", "drafts", "serve_eval", "train")

PROBE = """
import importlib.util, pathlib, torch
repo = pathlib.Path(r"{repo}")
for name in {rooms!r}:
    spec = importlib.util.find_spec(name)
    origin = None if spec is None else (spec.origin or next(iter(spec.submodule_search_locations or []), None))
    ours = [repo / name, repo / "draftsmith"]  # (a venv inside the checkout may hold another distribution's)
    assert origin is None or not any(pathlib.Path(origin).resolve().is_relative_to(p) for p in ours), (name, origin)
import draftsmith.kernels.layers, draftsmith.serve_eval.engine
from transformers import LlamaConfig, LlamaForCausalLM
cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2)
torch.manual_seed(0)
logits = LlamaForCausalLM(cfg)(torch.tensor([[1, 2, 3, 4]])).logits
assert logits.shape == (1, 4, 128) and torch.isfinite(logits).all()
print("probe-ok")
"""


def test_only_draftsmith_is_installed_top_level():
    """The package list in pyproject.toml names draftsmith alone, and the repo root holds no other package."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    include = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    assert include == ["draftsmith*"]
    packages = sorted(p.parent.name for p in REPO.glob("*/__init__.py"))
    assert packages == ["draftsmith"]


def test_room_names_resolve_outside_the_repo_and_transformers_runs():
    """In a fresh interpreter started at the repo root, `kernels`, `train`, ... are not ours (absent, or another
    distribution's), draftsmith's rooms import, and transformers' Llama runs a finite forward pass."""
    code = PROBE.format(repo=REPO, rooms=ROOMS)
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "probe-ok" in proc.stdout
