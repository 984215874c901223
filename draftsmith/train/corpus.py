"""The prompt corpus: built from this machine's Python (no download, no copied text), or read from a file.

Domains of the embedded corpus:
  code   functions of the standard library's source: prompt = signature + docstring + the body's first line,
         reference = the rest of the body
  prose  paragraphs of the documentation Python ships (pydoc_data) and long docstrings, cut in two
  math   generated multi-step arithmetic / word problems; reference = worked solution + answer
  chat   multi-turn conversations behind ONE fixed system prompt (shared prefix for prefix caching)

Every record is ``{domain, prompt, reference}``. Per domain, records are split (deterministically by
seed) into held-out ``eval`` prompts and the rest; ``distill`` prompts are drawn from the rest, and
the whole rest is the target's pretraining text, so eval prompts are never trained on.
"""

from __future__ import annotations

import ast
import logging
import random
import sys
import sysconfig
import textwrap
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from draftsmith.drafts.artifacts import Artifacts

from draftsmith.drafts.files import atomic_dir, entry_lock, hash_files, is_complete, read_json, stable_hash, write_json
from draftsmith.train.logs import format_fields
from draftsmith.train.records import check_records, read_jsonl

logger = logging.getLogger("draftsmith")

REQUIRED_FIELDS = ("domain", "prompt", "reference")
# Part of the corpus cache key: bump it when the embedded builder's output changes for the same settings
# (2: prose prompts cut inside a sentence; 3: code prompts end one line into the body), so an existing
# artifacts root does not keep the old corpus.
BUILDER_VERSION = 3
SPLITS = ("distill", "eval", "pretrain")

# Chat format shared by the corpus and the tokenizer's chat template (train.tokenizer renders the same).
EOS_TOKEN, BOS_TOKEN, PAD_TOKEN = "<|eos|>", "<|bos|>", "<|pad|>"
ROLES = ("system", "user", "assistant")
SYSTEM_PROMPT = (
    "You are draftsmith's helpful assistant. You answer questions about Python code, its "
    "documentation and arithmetic. Think step by step, show your work, and keep answers short."
)

_SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__", "encodings", "lib2to3"}


def render_chat(messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
    """``<|role|>\\n{content}<|eos|>`` per message; the generation prompt opens an assistant turn."""
    parts = []
    for message in messages:
        if message["role"] not in ROLES:
            raise ValueError(f"chat message role: {message['role']!r} is not one of {ROLES}")
        parts.append(f"<|{message['role']}|>\n{message['content']}{EOS_TOKEN}")
    if add_generation_prompt:
        parts.append("<|assistant|>\n")
    return "".join(parts)


# --------------------------------------------------------------------------- sources


def _stdlib_files(max_files: int) -> list[Path]:
    """Evenly spaced sample of stdlib .py files (sorted, so the same Python gives the same list)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(
        p for p in root.rglob("*.py") if not (_SKIP_DIRS & set(p.relative_to(root).parts[:-1]))
    )
    if len(files) > max_files:
        step = len(files) / max_files
        files = [files[int(i * step)] for i in range(max_files)]
    return files


def _cut_text(text: str, fraction: float = 0.4) -> tuple[str, str] | None:
    """Split prose at the word boundary nearest ``fraction`` of its length, inside a sentence: the prompt
    ends on a word and the reference starts with the space. A trained target answers a prompt that ends
    a sentence (most pydoc paragraphs are whole documents, so '.' is mostly followed by EOS) or ends in a
    bare space token (the tokenizer glues a space to the word after it) with EOS at once: cut at a
    sentence end, 10 of 12 held-out prose prompts got a single token at T=0; cut inside one, 3."""
    target = int(len(text) * fraction)
    cuts = [i for i, ch in enumerate(text) if ch == " " and i > 0 and text[i - 1] not in ".:;!?"]
    if not cuts:
        return None
    cut = min(cuts, key=lambda i: abs(i - target))
    prompt, reference = text[:cut], text[cut:]
    return (prompt, reference) if prompt.strip() and reference.strip() else None


def _code_and_docstrings(cfg: DictConfig) -> tuple[list[tuple[str, str]], list[str]]:
    """(prompt, reference) pairs from stdlib functions, and long docstrings as prose."""
    root = Path(sysconfig.get_paths()["stdlib"])
    functions: list[tuple[str, str]] = []
    docstrings: list[str] = []
    for path in _stdlib_files(cfg.max_source_files):
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        lines = source.splitlines()
        rel = path.relative_to(root).as_posix()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) >= 200:
                    docstrings.append(" ".join(doc.split())[: cfg.max_record_chars])
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or len(node.body) < 2:
                continue
            block = lines[node.lineno - 1 : node.end_lineno]
            if not 120 <= sum(len(line) + 1 for line in block) <= cfg.max_record_chars:
                continue
            pair = _split_function(textwrap.dedent("\n".join(block)), node)
            if pair:
                functions.append((f"# {rel}\n" + pair[0], pair[1]))
    return functions, docstrings


def _split_function(text: str, node: ast.FunctionDef | ast.AsyncFunctionDef) -> tuple[str, str] | None:
    """(prompt, reference) of one function's dedented source: the prompt is the signature, the docstring if
    any and the body's first line, WITHOUT that line's break; the reference is the rest of the body, from
    that line break on. None if nothing of the body would be left to answer.

    Why there: in the packed pretraining stream a bare newline is mostly followed by a document's EOS, so a
    prompt ending in one is answered with EOS at once; and the small target ended 7 of 12 held-out prompts
    that stopped at a docstring's closing quotes with EOS too (p(EOS) ~0.7), while one line into the body
    it writes a body. The reference starts with the line break (its first token carries the indentation)."""
    first = node.body[0]
    has_doc = isinstance(first, ast.Expr) and isinstance(getattr(first, "value", None), ast.Constant)
    head_end = (first.end_lineno if has_doc else first.lineno - 1) - node.lineno + 1
    lines = text.split("\n")
    head, body = lines[:head_end], lines[head_end:]
    while len(head) > 1 and head[-1].lstrip().startswith("#"):  # comments after the signature: body
        body.insert(0, head.pop())
    while body and not body[0].strip():  # blank lines before the body's first line go with it
        head.append(body.pop(0))
    if not head or not body:
        return None
    head.append(body.pop(0))
    if not "".join(body).strip():
        return None
    return "\n".join(head), "\n" + "\n".join(body) + "\n"


def _pydoc_paragraphs(max_chars: int) -> list[str]:
    try:
        from pydoc_data.topics import topics
    except ImportError:  # some distributions strip pydoc_data; docstrings still give prose
        return []
    paragraphs = []
    for name in sorted(topics):
        for para in topics[name].split("\n\n"):
            text = " ".join(para.split())
            letters = sum(ch.isalpha() or ch == " " for ch in text)
            if 200 <= len(text) <= max_chars and letters >= 0.85 * len(text):
                paragraphs.append(text)
    return paragraphs


def math_problem(rng: random.Random) -> tuple[str, str]:
    """One generated multi-step problem: (question, worked solution ending in 'Answer: N')."""
    kind = rng.randrange(4)
    if kind == 0:
        a, b, c = rng.randint(2, 99), rng.randint(2, 99), rng.randint(2, 12)
        d = rng.randint(1, (a + b) * c - 1)
        s1, s2 = a + b, (a + b) * c
        q = f"Compute ({a} + {b}) * {c} - {d}."
        steps = [f"{a} + {b} = {s1}.", f"{s1} * {c} = {s2}.", f"{s2} - {d} = {s2 - d}."]
        answer = s2 - d
    elif kind == 1:
        per_day, days, sold = rng.randint(5, 60), rng.randint(2, 9), rng.randint(1, 40)
        made = per_day * days
        sold = min(sold * days, made)
        q = (f"A baker makes {per_day} loaves a day for {days} days and sells {sold} loaves in total. "
             "How many loaves are left?")
        steps = [f"Loaves made: {per_day} * {days} = {made}.", f"Left after selling: {made} - {sold} = {made - sold}."]
        answer = made - sold
    elif kind == 2:
        v1, t1, v2, t2 = rng.randint(20, 120), rng.randint(1, 6), rng.randint(20, 120), rng.randint(1, 6)
        d1, d2 = v1 * t1, v2 * t2
        q = f"A train runs at {v1} km/h for {t1} hours, then at {v2} km/h for {t2} hours. How far does it travel?"
        steps = [f"First part: {v1} * {t1} = {d1} km.", f"Second part: {v2} * {t2} = {d2} km.",
                 f"Total: {d1} + {d2} = {d1 + d2} km."]
        answer = d1 + d2
    else:
        a, b, c, m = rng.randint(10, 99), rng.randint(10, 99), rng.randint(1, 99), rng.randint(3, 17)
        p = a * b + c
        q = f"What is the remainder when {a} * {b} + {c} is divided by {m}?"
        steps = [f"{a} * {b} = {a * b}.", f"{a * b} + {c} = {p}.",
                 f"{p} = {m} * {p // m} + {p % m}, so the remainder is {p % m}."]
        answer = p % m
    return f"Question: {q}\nLet's work it out step by step.\n", " ".join(steps) + f"\nAnswer: {answer}\n"


_CHAT_ASKS = {
    "code": "Complete this Python function:\n{prompt}",
    "prose": "Continue this passage from the Python documentation:\n{prompt}",
    "math": "{prompt}",
}


def _chat_conversation(items: list[tuple[str, str, str]]) -> tuple[str, str]:
    """Render a conversation whose exchanges ask for the given (domain, prompt, reference) items."""
    messages = [{"role": "system", "content": SYSTEM_PROMPT}]
    for i, (domain, prompt, reference) in enumerate(items):
        ask = _CHAT_ASKS[domain].format(prompt=prompt.strip())
        messages.append({"role": "user", "content": ask if i == 0 else "Thanks. Another one. " + ask})
        if i < len(items) - 1:
            messages.append({"role": "assistant", "content": reference.rstrip()})
    return render_chat(messages, add_generation_prompt=True), items[-1][2].rstrip()


def build_embedded_records(cfg: DictConfig) -> list[dict[str, str]]:
    """All records of the embedded corpus (order fixed by the data config, not by the seed)."""
    cap = cfg.pool_per_domain
    functions, docstrings = _code_and_docstrings(cfg)
    paragraphs = _pydoc_paragraphs(cfg.max_record_chars) + docstrings
    prose = [pair for pair in map(_cut_text, paragraphs) if pair]
    math_rng = random.Random("draftsmith-math")
    math: dict[str, str] = {}
    while len(math) < cap + cap // 2 and len(math) < 50 * cap:  # 1/3 of them feed chat
        q, a = math_problem(math_rng)
        math[q] = a
    sources = {"code": functions, "prose": prose, "math": list(math.items())}
    # Every third source item feeds chat instead of its own domain, so no text sits in two domains.
    own = {d: [p for i, p in enumerate(items) if i % 3 != 2][:cap] for d, items in sources.items()}
    for_chat = [(d, *p) for d, items in sources.items() for i, p in enumerate(items) if i % 3 == 2]
    random.Random("draftsmith-chat").shuffle(for_chat)
    records = [{"domain": d, "prompt": p, "reference": r} for d, pairs in own.items() for p, r in pairs]
    turns = cfg.chat_turns
    for start in range(0, min(len(for_chat), cap * turns) - turns + 1, turns):
        prompt, reference = _chat_conversation(for_chat[start : start + turns])
        records.append({"domain": "chat", "prompt": prompt, "reference": reference})
    return [r for r in records if r["domain"] in cfg.domains]


# --------------------------------------------------------------------------- files and splits


def _read_dataset(path: str, split: str) -> Any:
    """A ``datasets.Dataset`` from a local file/dir or a HF dataset name (errors name the path)."""
    import datasets

    local = Path(path).expanduser()
    builders = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
    try:
        if local.is_file():
            if local.stat().st_size == 0:
                raise ValueError(f"{local}: empty dataset file (records need fields {', '.join(REQUIRED_FIELDS)})")
            builder = builders.get(local.suffix)
            if builder is None:
                raise ValueError(f"{local}: unknown data file type {local.suffix!r} (use .jsonl, .json, .parquet, .csv)")
            return datasets.load_dataset(builder, data_files=str(local), split="train")
        if local.is_dir() and (local / "dataset_info.json").exists():
            return datasets.load_from_disk(str(local))
        if local.exists() or path.startswith((".", "/", "~")):
            raise ValueError(f"{local}: not a dataset file or a saved dataset dir")
        return datasets.load_dataset(path, split=split)
    except ValueError:
        raise
    except Exception as err:  # datasets raises many types for malformed files; surface one line
        raise ValueError(f"{path}: could not be read as a dataset ({type(err).__name__}: {err})") from None


def _dataset_rows(path: str, split: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """(1-based location, row) of every record: JSON-lines files are read line by line (exact line
    numbers); other sources through `datasets` (record numbers; csv: file lines, after the header)."""
    local = Path(path).expanduser()
    if local.is_file() and local.suffix == ".jsonl":
        if local.stat().st_size == 0:
            raise ValueError(f"{local}: empty dataset file (records need fields {', '.join(REQUIRED_FIELDS)})")
        return read_jsonl(local)
    dataset = _read_dataset(path, split)
    first_line = 2 if local.suffix == ".csv" else None
    return ((f"line {i + first_line}" if first_line else f"record {i + 1}", row) for i, row in enumerate(dataset))


def load_records(
    path: str, split: str = "train", domains: list[str] | None = None, on_bad_record: str = "error"
) -> list[dict[str, str]]:
    """Records of a dataset, each checked field by field: a record missing a field or with an empty
    one stops the run naming the file, line and field, or (`on_bad_record="skip"`) is skipped and
    counted in the log."""
    hint = (f" (records need non-empty string fields {', '.join(REQUIRED_FIELDS)}; "
            "data.on_bad_record=skip skips and counts such records)")
    check = check_records(_dataset_rows(path, split), REQUIRED_FIELDS, path, on_bad_record, hint)
    skipped = sum(check.skipped.values())
    if not check.kept and not skipped:
        raise ValueError(f"{path}: no records")
    if skipped:
        logger.warning("draftsmith %s", format_fields(data=path, skipped_bad_records=skipped,
                                                      reasons=check.skipped_summary()))
    records = []
    for row in check.kept:
        if domains and row["domain"] not in domains:
            continue
        extra = {"split": row["split"]} if row.get("split") else {}
        records.append({"domain": row["domain"], "prompt": row["prompt"], "reference": row["reference"], **extra})
    if not records:
        why = [f"{skipped} skipped: {check.skipped_summary()}"] if skipped else []
        if len(check.kept):
            why.append(f"{len(check.kept)} in domains other than {list(domains or [])}")
        raise ValueError(f"{path}: no usable records ({'; '.join(why)})")
    return records


def split_records(records: list[dict[str, str]], cfg: DictConfig, seed: int) -> dict[str, list[dict[str, str]]]:
    """Per domain: dedupe prompts, shuffle by seed, eval = first ``eval_per_domain``, rest = pretrain,
    distill = first ``distill_per_domain`` of the rest. A ``split`` column (distill/eval) wins if present."""
    splits: dict[str, list[dict[str, str]]] = {name: [] for name in SPLITS}
    by_domain: dict[str, dict[str, dict[str, str]]] = {}
    for record in records:
        by_domain.setdefault(record["domain"], {}).setdefault(record["prompt"], record)
    for domain in sorted(by_domain):
        unique = list(by_domain[domain].values())
        random.Random(f"{seed}-{domain}").shuffle(unique)
        if any("split" in r for r in unique):
            held_out = [r for r in unique if r.get("split") == "eval"]
            rest = [r for r in unique if r.get("split") != "eval"]
        else:
            held_out, rest = unique[: cfg.eval_per_domain], unique[cfg.eval_per_domain :]
        strip = lambda rs: [{k: r[k] for k in REQUIRED_FIELDS} for r in rs]  # noqa: E731
        splits["eval"] += strip(held_out)
        splits["pretrain"] += strip(rest)
        splits["distill"] += strip(rest[: cfg.distill_per_domain])
    return splits


# --------------------------------------------------------------------------- the cached corpus


@dataclass(frozen=True)
class Corpus:
    dir: Path
    content_hash: str  # hash of the split files: keys the tokenizer and target caches
    counts: dict[str, dict[str, int]]  # split -> domain -> records

    def path(self, split: str) -> Path:
        return self.dir / f"{split}.jsonl"

    def records(self, split: str) -> list[dict[str, str]]:
        import datasets

        datasets.disable_progress_bars()
        return datasets.load_dataset("json", data_files=str(self.path(split)), split="train").to_list()

    def texts(self, split: str = "pretrain") -> list[str]:
        """Plain training text: prompt followed by its reference, one document per record."""
        return [r["prompt"] + r["reference"] for r in self.records(split)]


def _write_jsonl(records: list[dict[str, str]], path: Path) -> None:
    import datasets

    datasets.disable_progress_bars()  # sub-second conversions; a bar per file is noise
    datasets.Dataset.from_list(records).to_json(str(path), lines=True, force_ascii=False)


def build_corpus(cfg: DictConfig, artifacts: Artifacts, force: bool = False) -> tuple[Corpus, bool]:
    """Build (or reuse) the corpus for ``cfg.data`` and ``cfg.seed``; returns (corpus, was_cached)."""
    data = cfg.data
    source_id: Any = {"python": sys.version, "stdlib": sysconfig.get_paths()["stdlib"], "builder": BUILDER_VERSION}
    if data.path:
        local = Path(data.path).expanduser()
        source_id = {"file_hash": hash_files([local]) if local.is_file() else None, "path": str(data.path)}
    key = stable_hash({"data": OmegaConf.to_container(data, resolve=True), "seed": cfg.seed, "source": source_id})
    entry = artifacts.corpus_dir(key)
    with entry_lock(entry):
        cached = is_complete(entry) and not force
        if not cached:
            _write_corpus(cfg, key, entry)
    manifest = read_json(entry / "manifest.json")
    return Corpus(entry, manifest["content_hash"], manifest["counts"]), cached


def _write_corpus(cfg: DictConfig, key: str, entry: Path) -> None:
    """Read or build the records, split them, and write the split files + manifest atomically."""
    data = cfg.data
    if data.path:
        records = load_records(data.path, data.split, list(data.domains), data.get("on_bad_record", "error"))
    else:
        records = build_embedded_records(data)
    splits = split_records(records, data, cfg.seed)
    for name in ("distill", "eval"):
        if not splits[name]:
            raise ValueError(f"data: the {name} split is empty (source {data.path or 'embedded corpus'}, "
                             f"domains {list(data.domains)}, {len(records)} records)")
    with atomic_dir(entry) as tmp:
        for name, split in splits.items():
            _write_jsonl(split, tmp / f"{name}.jsonl")
        counts = {name: dict(sorted(Counter(r["domain"] for r in split).items())) for name, split in splits.items()}
        content_hash = hash_files([tmp / f"{name}.jsonl" for name in SPLITS])
        write_json(tmp / "manifest.json", {"key": key, "content_hash": content_hash, "counts": counts,
                                           "data": OmegaConf.to_container(data, resolve=True), "seed": cfg.seed})
