"""Byte-level BPE tokenizer for the embedded target, trained on the corpus with `tokenizers`.

Byte-level means every string round-trips exactly (decode(encode(s)) == s), whatever its script.
Saved as a HF tokenizer dir (PreTrainedTokenizerFast) with BOS/EOS/PAD and a chat template that
renders exactly what ``draftsmith.train.corpus.render_chat`` writes. No token is added automatically: a
prompt's ids are exactly the ids of its text, which keeps prompt/continuation splits aligned.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from omegaconf import DictConfig
from transformers import PreTrainedTokenizerFast

from draftsmith.drafts.artifacts import Artifacts

from draftsmith.drafts.files import atomic_dir, entry_lock, is_complete, stable_hash
from draftsmith.train.corpus import BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, ROLES, Corpus

ROLE_TOKENS = [f"<|{role}|>" for role in ROLES]
SPECIAL_TOKENS = [PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, *ROLE_TOKENS]  # ids 0.. in this order

# Jinja twin of train.corpus.render_chat (a test asserts they agree).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + eos_token }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)
MIN_VOCAB = 256 + len(SPECIAL_TOKENS)  # every byte plus the special tokens


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Train byte-level BPE on ``texts``; the vocabulary includes the special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < MIN_VOCAB:
        raise ValueError(f"target.vocab_size: {vocab_size} is below {MIN_VOCAB} (256 bytes + special tokens)")
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        additional_special_tokens=ROLE_TOKENS,
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,  # would break the exact round trip
        model_max_length=1 << 30,
    )


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerFast:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def build_tokenizer(cfg: DictConfig, corpus: Corpus, artifacts: Artifacts, force: bool = False) -> tuple[Path, bool]:
    """Train (or reuse) the tokenizer for this corpus; returns (tokenizer dir, was_cached)."""
    key = stable_hash({"corpus": corpus.content_hash, "vocab_size": cfg.target.vocab_size, "kind": "bytelevel-bpe"})
    entry = artifacts.tokenizer_dir(key)
    with entry_lock(entry):
        cached = is_complete(entry) and not force
        if not cached:
            tokenizer = train_tokenizer(corpus.texts("pretrain"), cfg.target.vocab_size)
            with atomic_dir(entry) as tmp:
                tokenizer.save_pretrained(str(tmp))
    return entry, cached
