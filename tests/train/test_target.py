"""The target bootstrap: a tiny Llama trains (loss falls), saves/loads exactly, and is fingerprinted."""

from __future__ import annotations

import json
import math

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file, save_file
from transformers import LlamaForCausalLM

from draftsmith.drafts.identity import target_fingerprint
from draftsmith.train.config import DataConfig, TargetConfig
from draftsmith.train.corpus import build_embedded_records
from draftsmith.train.target import domain_perplexity, llama_config, pack_tokens, train_model
from draftsmith.train.tokenizer import train_tokenizer

TINY = dict(vocab_size=512, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=176,
            max_position=256, seq_len=64, batch_size=8, max_steps=40, warmup_steps=5, lr=3e-3,
            bf16_autocast=False, log_every=10)


@pytest.fixture(scope="module")
def setup():
    records = build_embedded_records(OmegaConf.structured(DataConfig(pool_per_domain=40, max_source_files=15)))
    texts = [r["prompt"] + r["reference"] for r in records]
    tokenizer = train_tokenizer(texts, vocab_size=512)
    tcfg = OmegaConf.structured(TargetConfig(**TINY))
    torch.manual_seed(0)
    model = LlamaForCausalLM(llama_config(tcfg, tokenizer))
    rows = pack_tokens(tokenizer, texts, tcfg.seq_len)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the target's training batches are big enough to use both cores
    try:
        result = train_model(model, rows, tcfg, seed=0)
    finally:
        torch.set_num_threads(threads)  # the session's one setting (conftest) for every later test
    return records, tokenizer, model, result


def test_tiny_target_loss_decreases(setup):
    """Training runs all steps and the loss of the last steps is well below that of the first steps."""
    _, _, _, result = setup
    assert result.steps == TINY["max_steps"] and not result.stopped_by_time_cap
    first, last = sum(result.losses[:5]) / 5, sum(result.losses[-5:]) / 5
    assert first > math.log(512) - 1.0  # starts near uniform over the vocabulary
    assert last < first - 0.8


def test_save_load_round_trip_identical_logits(setup, tmp_path):
    """save_pretrained -> from_pretrained reproduces the logits bit for bit (fp32)."""
    _, tokenizer, model, _ = setup
    model.save_pretrained(str(tmp_path))
    assert (tmp_path / "model.safetensors").is_file()
    loaded = LlamaForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    ids = torch.tensor([tokenizer("def f(x):\n    return x + 1\n")["input_ids"]])
    with torch.no_grad():
        assert torch.equal(model.eval()(ids).logits, loaded(ids).logits)
    assert loaded.config.eos_token_id == tokenizer.eos_token_id and loaded.config.num_key_value_heads == 2


def test_perplexity_is_exp_of_mean_token_loss(setup):
    """domain_perplexity on one record equals exp(HF's mean cross-entropy) on the same tokens."""
    records, tokenizer, model, _ = setup
    record = next(r for r in records if r["domain"] == "math")
    ppl = domain_perplexity(model, tokenizer, [record], per_domain=1, batch_size=1, max_len=256)
    ids = torch.tensor([tokenizer(record["prompt"] + record["reference"])["input_ids"] + [tokenizer.eos_token_id]])
    with torch.no_grad():
        loss = model(input_ids=ids, labels=ids).loss.item()
    assert ppl["math"] == pytest.approx(math.exp(loss), rel=1e-4)


def test_perplexity_padding_does_not_change_results(setup):
    """Batching records of different lengths (padding) gives the same per-domain perplexity as batch 1."""
    records, tokenizer, model, _ = setup
    code = [r for r in records if r["domain"] == "code"][:4]
    batched = domain_perplexity(model, tokenizer, code, per_domain=4, batch_size=4, max_len=256)
    single = domain_perplexity(model, tokenizer, code, per_domain=4, batch_size=1, max_len=256)
    assert batched["code"] == pytest.approx(single["code"], rel=1e-4)


def test_fingerprint_stable_across_save_load_and_sensitive_to_weights(setup, tmp_path):
    """The fingerprint survives save -> load -> save and a new transformers_version, but not a weight change."""
    _, _, model, _ = setup
    first, second = tmp_path / "a", tmp_path / "b"
    model.save_pretrained(str(first))
    LlamaForCausalLM.from_pretrained(str(first), dtype=torch.float32).save_pretrained(str(second))
    fp = target_fingerprint(first)
    assert fp == target_fingerprint(second) and len(fp) == 16

    config = json.loads((second / "config.json").read_text())
    config["transformers_version"] = "0.0.0-other"
    (second / "config.json").write_text(json.dumps(config, indent=4))
    assert target_fingerprint(second) == fp

    tensors = load_file(str(second / "model.safetensors"))
    name = sorted(tensors)[0]
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[0] += 1e-3
    save_file(tensors, str(second / "model.safetensors"), metadata={"format": "pt"})
    assert target_fingerprint(second) != fp

    config["num_hidden_layers"] = 3
    (first / "config.json").write_text(json.dumps(config))
    assert target_fingerprint(first) != fp


def test_lr_schedule_anneals_by_step_or_time_budget():
    """The LR warms up, then reaches lr * min_lr_ratio when either the step or (if enabled) the time budget ends."""
    from draftsmith.train.target import _lr_at

    tcfg = OmegaConf.structured(TargetConfig(**TINY))
    assert _lr_at(0, tcfg) == pytest.approx(tcfg.lr / tcfg.warmup_steps)
    assert _lr_at(tcfg.max_steps, tcfg) == pytest.approx(tcfg.lr * tcfg.min_lr_ratio)
    mid = tcfg.max_steps // 2
    cap_s = tcfg.max_minutes * 60
    assert _lr_at(mid, tcfg, elapsed_s=cap_s) == pytest.approx(tcfg.lr * tcfg.min_lr_ratio)
    tcfg.anneal_to_time_cap = False
    assert _lr_at(mid, tcfg, elapsed_s=cap_s) > 2 * tcfg.lr * tcfg.min_lr_ratio
