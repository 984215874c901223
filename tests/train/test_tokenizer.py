"""The byte-level BPE tokenizer: exact round trip per domain, special tokens, chat template."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

from draftsmith.train.config import DataConfig
from draftsmith.train.corpus import SYSTEM_PROMPT, build_embedded_records, render_chat
from draftsmith.train.tokenizer import SPECIAL_TOKENS, load_tokenizer, train_tokenizer


@pytest.fixture(scope="module")
def records():
    cfg = OmegaConf.structured(DataConfig(pool_per_domain=40, max_source_files=15))
    return build_embedded_records(cfg)


@pytest.fixture(scope="module")
def tokenizer(records, tmp_path_factory):
    trained = train_tokenizer([r["prompt"] + r["reference"] for r in records], vocab_size=512)
    path = tmp_path_factory.mktemp("tok")
    trained.save_pretrained(str(path))
    return load_tokenizer(path)  # exercise the saved HF dir, not the in-memory object


def test_vocab_and_special_tokens(tokenizer):
    """The saved tokenizer has the requested vocab, BOS/EOS/PAD, and each special token is one id."""
    assert len(tokenizer) == 512
    assert tokenizer.eos_token == "<|eos|>" and tokenizer.bos_token == "<|bos|>" and tokenizer.pad_token == "<|pad|>"
    for token in SPECIAL_TOKENS:
        assert len(tokenizer(token, add_special_tokens=False)["input_ids"]) == 1


@pytest.mark.parametrize("domain", ["code", "prose", "math", "chat"])
def test_round_trip_on_every_domain(tokenizer, records, domain):
    """decode(encode(text)) == text for every record of the domain (byte-level BPE is lossless)."""
    texts = [r["prompt"] + r["reference"] for r in records if r["domain"] == domain]
    assert texts
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert tokenizer.decode(ids) == text


@settings(max_examples=60, deadline=None)
@given(st.text(max_size=80))
def test_round_trip_on_arbitrary_unicode(tokenizer, text):
    """Any unicode string round-trips, including scripts never seen in training."""
    text = text.replace("<|", "< |")  # literal special-token markup is parsed as the special token, by design
    assert tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"]) == text


def test_no_token_is_added_automatically(tokenizer):
    """Encoding adds no BOS/EOS: a prompt's ids are exactly its text's ids."""
    ids = tokenizer("x = 1")["input_ids"]
    assert tokenizer.bos_token_id not in ids and tokenizer.eos_token_id not in ids


def test_chat_template_matches_corpus_rendering(tokenizer):
    """apply_chat_template renders exactly what the corpus writes for chat prompts."""
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": "What is 2 + 3?"},
                {"role": "assistant", "content": "2 + 3 = 5."}, {"role": "user", "content": "And 4 * 5?"}]
    for gen in (False, True):
        assert tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen) == render_chat(messages, gen)


def test_vocab_too_small_is_refused():
    """A vocab that cannot hold all bytes plus special tokens is refused, naming the field."""
    with pytest.raises(ValueError, match="target.vocab_size"):
        train_tokenizer(["abc"], vocab_size=100)
