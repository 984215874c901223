"""The embedded corpus: domains, splits, determinism, generated math, and datasets round trips."""

from __future__ import annotations

import json
import random
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

from draftsmith.drafts.artifacts import Artifacts
from draftsmith.train.config import DataConfig
from draftsmith.train.corpus import SYSTEM_PROMPT, build_corpus, build_embedded_records, math_problem, render_chat, split_records

DOMAINS = ("code", "prose", "math", "chat")


def small_data(**overrides):
    base = DataConfig(eval_per_domain=6, distill_per_domain=10, pool_per_domain=40, max_source_files=15)
    return OmegaConf.merge(OmegaConf.structured(base), overrides)


@pytest.fixture(scope="module")
def records():
    return build_embedded_records(small_data())


def test_every_domain_present_with_nonempty_fields(records):
    """Each of the four domains yields records, and every record has a non-empty prompt and reference."""
    by_domain = {d: [r for r in records if r["domain"] == d] for d in DOMAINS}
    for domain, rows in by_domain.items():
        assert len(rows) >= 20, domain
    assert all(r["prompt"].strip() and r["reference"].strip() for r in records)
    assert set(records[0]) == {"domain", "prompt", "reference"}


def test_code_is_stdlib_source_and_math_is_worked(records):
    """Code prompts are real stdlib functions (signature first); math references end with an answer."""
    code = [r for r in records if r["domain"] == "code"]
    assert all(re.search(r"^(async )?def \w+", r["prompt"], re.M) for r in code)
    math = [r for r in records if r["domain"] == "math"]
    assert all(re.search(r"Answer: -?\d+\n$", r["reference"]) for r in math)


def test_code_prompts_end_one_line_into_the_body_before_its_line_break(records):
    """A prompt ending in a bare newline, or at a docstring's closing quotes, is answered with EOS by the
    target: code prompts end after the body's first line (without its newline), and the reference carries
    the newline, the next line's indentation and the rest of the body."""
    code = [r for r in records if r["domain"] == "code"]
    assert code
    for r in code:
        assert not r["prompt"].endswith("\n") and r["prompt"].split("\n")[-1].strip(), r["prompt"]
        assert r["reference"].startswith("\n") and r["reference"].strip(), r["reference"]
        # the prompt's last line is no longer the signature's ':' nor a docstring's closing quotes
        assert not r["prompt"].rstrip().endswith(('"""', "'''")), r["prompt"]


def test_a_function_split_gives_its_source_back():
    """prompt + reference is the function's source; one-statement bodies (nothing left to answer) are dropped."""
    import ast
    import textwrap

    from draftsmith.train.corpus import _split_function

    source = textwrap.dedent('''
        def f(x):
            """Doc."""

            y = x + 1
            return y
        ''').strip("\n")
    prompt, reference = _split_function(source, ast.parse(source).body[0])
    assert prompt == 'def f(x):\n    """Doc."""\n\n    y = x + 1'
    assert prompt + reference == source + "\n"
    short = 'def g(x):\n    """Doc."""\n    return x'
    assert _split_function(short, ast.parse(short).body[0]) is None
    # no docstring, a signature over two lines, a comment first in the body
    plain = 'def h(a,\n      b):\n    # sum\n    s = a + b\n    return s'
    prompt, reference = _split_function(plain, ast.parse(plain).body[0])
    assert (prompt, reference) == ('def h(a,\n      b):\n    # sum', '\n    s = a + b\n    return s\n')


def test_prose_prompts_end_on_a_word_and_the_reference_starts_with_its_space(records):
    """A prompt ending a sentence or in a bare space is answered with EOS by a trained target (in the packed
    stream both mostly end a document): prose prompts end on a word inside a sentence."""
    prose = [r for r in records if r["domain"] == "prose"]
    assert prose
    assert all(not r["prompt"][-1].isspace() and r["prompt"][-1] not in ".:;!?" for r in prose)
    assert all(r["reference"].startswith(" ") for r in prose)


def test_splits_disjoint_and_deterministic(records):
    """Eval prompts never appear in distill or pretraining; the split depends only on the seed."""
    cfg = small_data()
    first, again, other = split_records(records, cfg, 0), split_records(records, cfg, 0), split_records(records, cfg, 1)
    assert first == again
    assert first["eval"] != other["eval"]
    eval_prompts = {r["prompt"] for r in first["eval"]}
    assert not eval_prompts & {r["prompt"] for r in first["distill"]}
    assert not eval_prompts & {r["prompt"] for r in first["pretrain"]}
    assert {r["prompt"] for r in first["distill"]} <= {r["prompt"] for r in first["pretrain"]}
    for domain in DOMAINS:
        assert sum(r["domain"] == domain for r in first["eval"]) == cfg.eval_per_domain
        assert sum(r["domain"] == domain for r in first["distill"]) == cfg.distill_per_domain


def test_build_is_deterministic(records):
    """Building the embedded corpus twice from the same config gives identical records."""
    assert build_embedded_records(small_data()) == records


def test_chat_prompts_share_the_system_prefix(records):
    """Every chat prompt starts with the one fixed system turn and ends by opening an assistant turn."""
    prefix = render_chat([{"role": "system", "content": SYSTEM_PROMPT}])
    chat = [r for r in records if r["domain"] == "chat"]
    assert chat and all(r["prompt"].startswith(prefix) for r in chat)
    assert all(r["prompt"].endswith("<|assistant|>\n") for r in chat)
    assert all(r["prompt"].count("<|user|>") == 2 for r in chat)


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_math_worked_steps_are_correct(seed):
    """Every arithmetic step written in a generated solution is true, and the answer is the last result."""
    question, solution = math_problem(random.Random(seed))
    assert question.startswith("Question: ")
    steps = re.findall(r"(\d+) ([-+*]) (\d+) = (\d+)", solution)
    assert steps
    for a, op, b, result in steps:
        assert eval(f"{a} {op} {b}") == int(result)
    answer = int(re.search(r"Answer: (\d+)", solution).group(1))
    remainder = re.search(r"remainder is (\d+)", solution)
    assert answer == int(remainder.group(1) if remainder else steps[-1][3])


def test_build_corpus_caches_and_loads_through_datasets(tmp_path):
    """build_corpus writes jsonl splits once (second call is cached) and reads them back via datasets."""
    cfg = OmegaConf.create({"data": small_data(), "seed": 0})
    artifacts = Artifacts(tmp_path)
    corpus, cached = build_corpus(cfg, artifacts)
    assert not cached
    again, cached = build_corpus(cfg, artifacts)
    assert cached and again.content_hash == corpus.content_hash
    evals = corpus.records("eval")
    assert {r["domain"] for r in evals} == set(DOMAINS)
    assert sum(corpus.counts["eval"].values()) == len(evals)
    assert corpus.texts("pretrain")[0]


def test_data_path_reads_a_user_file(tmp_path):
    """data.path may point at a local jsonl with {domain, prompt, reference}; a 'split' column is honoured."""
    rows = [{"domain": "qa", "prompt": f"q{i}?", "reference": f"a{i}", "split": "eval" if i < 3 else "distill"}
            for i in range(12)]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = OmegaConf.create({"data": small_data(path=str(path), domains=["qa"]), "seed": 0})
    corpus, _ = build_corpus(cfg, Artifacts(tmp_path / "art"))
    assert sorted(r["prompt"] for r in corpus.records("eval")) == ["q0?", "q1?", "q2?"]
    assert len(corpus.records("distill")) == 9


def test_failed_cache_build_leaves_nothing_behind(tmp_path):
    """An exception while filling a cache entry leaves neither the entry nor its temporary dir."""
    from draftsmith.drafts.files import atomic_dir, is_complete

    entry = tmp_path / "cache" / "key"
    with pytest.raises(RuntimeError):
        with atomic_dir(entry) as tmp:
            (tmp / "half.json").write_text("{}")
            raise RuntimeError("interrupted")
    assert not entry.exists() and list((tmp_path / "cache").iterdir()) == []
    with atomic_dir(entry) as tmp:
        (tmp / "done.json").write_text("{}")
    assert is_complete(entry) and (entry / "done.json").is_file()


def test_a_new_builder_version_builds_a_new_corpus_entry(tmp_path, monkeypatch):
    """The embedded corpus's cache key carries the builder's version: an artifacts root built by an older
    builder (e.g. prose cut at sentence ends) does not serve its stale corpus to the new code."""
    import draftsmith.train.corpus as corpus_module

    cfg = OmegaConf.create({"data": small_data(), "seed": 0})
    artifacts = Artifacts(tmp_path)
    first, _ = build_corpus(cfg, artifacts)
    monkeypatch.setattr(corpus_module, "BUILDER_VERSION", corpus_module.BUILDER_VERSION + 1)
    second, cached = build_corpus(cfg, artifacts)
    assert not cached and second.path("eval") != first.path("eval")
