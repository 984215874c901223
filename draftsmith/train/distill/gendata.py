"""The on-disk distillation dataset that ``draftsmith.train.distill.dataset`` writes and ``draftsmith.train.distill`` reads.

Layout of one cache dir (``artifacts/targets/<fingerprint>/data/<key>/``)::

    manifest.json              target fingerprint, prompt-set hash, sampling params, stored extras, shards
    shard-00000.safetensors    per example: <id>.hidden [T,d] bf16, <id>.aux [T,3d] bf16,
                               <id>.topk_ids [T,k] int32, <id>.topk_logprobs [T,k] fp32 (only what was asked)
    shard-00000.parquet        rows: example_id, shard, domain, input_ids, prompt_length, finish_reason, answer
    dataset/                   once every shard is there: the rows as one `datasets` dataset (save_to_disk)

A shard is complete once its parquet exists: the safetensors file is written first, each by temp file +
rename, so a killed run leaves no shard that a resumed run would trust. Row t of every per-position
tensor belongs to position t of ``input_ids``: hidden[t] is the target's state after token t (it predicts
token t+1), topk at row t is the target's distribution of token t+1.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from draftsmith.drafts.files import atomic_write_text

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
HIDDEN_DTYPE = torch.bfloat16
REQUIRED_ROW_FIELDS = ("input_ids", "prompt_length")
PER_POSITION_FIELDS = ("hidden", "aux", "topk_ids", "topk_logprobs")   # the <id>.<field> tensors, rows [T, ...]


def aux_columns(stored: list[int], needed: list[int]) -> list[int] | None:
    """Which stored aux blocks (of hidden_size each, in the stored order) hold the layers `needed`, in its order;
    None where the needed layers are exactly the stored ones (the tensor is read as it is). Every needed layer is
    stored: StoredExtras.covers checked that before."""
    if list(needed) == list(stored):
        return None
    return [list(stored).index(layer) for layer in needed]


@dataclass
class StoredExtras:
    """What the teacher-forced pass stores per position."""

    final_hidden: bool = False  # target final-norm hidden (Medusa / EAGLE-1 features; EAGLE-3 soft labels)
    # the layers EAGLE-3 and the block draft read (HF hidden_states indexing), in the order they are stored; a
    # dataset may hold more than one kind needs (the union of the kinds', each reading its own, aux_columns)
    aux_layers: list[int] = field(default_factory=list)
    topk: int = 0  # top-k target log-probs

    @property
    def any(self) -> bool:
        return self.final_hidden or bool(self.aux_layers) or self.topk > 0

    def bytes_per_token(self, hidden_size: int) -> int:
        vectors = int(self.final_hidden) + len(self.aux_layers)
        return vectors * hidden_size * 2 + self.topk * (4 + 4)

    def covers(self, other: "StoredExtras") -> bool:
        """True when a cache with these extras holds everything `other` needs."""
        return (
            (self.final_hidden or not other.final_hidden)
            and set(other.aux_layers) <= set(self.aux_layers)
            and self.topk >= other.topk
        )


@dataclass
class Manifest:
    key: str
    target_fingerprint: str
    tokenizer_hash: str
    prompt_set_hash: str
    source: str  # target | corpus
    sampling: dict[str, Any] | None  # SamplingParams fields (None for corpus references)
    max_length: int
    shard_size: int
    num_prompts: int
    hidden_size: int
    extras: StoredExtras
    hidden_dtype: str = "bfloat16"
    complete: bool = False
    num_examples: int = 0
    format_version: int = FORMAT_VERSION
    content_key: str = ""  # the key without the extras: caches with equal content keys hold the same answers
    stopped_by_time_cap: bool = False  # data.max_minutes cut generation short (fewer prompts than asked)
    endpoint: dict[str, Any] | None = None  # backend=openai: endpoint URL, its model id, concurrency, logprobs

    @property
    def num_shards(self) -> int:
        return -(-self.num_prompts // self.shard_size)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def read(cls, cache_dir: Path) -> "Manifest":
        path = cache_dir / MANIFEST
        if not path.is_file():
            raise ValueError(f"{path}: missing; {cache_dir} is not a distillation data cache (run draftsmith generate)")
        raw = json.loads(path.read_text())
        missing = [name for name in cls.__dataclass_fields__ if name not in raw and name not in _OPTIONAL_FIELDS]
        if missing:
            raise ValueError(f"{path}: missing fields {missing}")
        raw["extras"] = StoredExtras(**raw["extras"])
        return cls(**{k: v for k, v in raw.items() if k in cls.__dataclass_fields__})

    def write(self, cache_dir: Path) -> None:
        atomic_write_text(cache_dir / MANIFEST, json.dumps(self.to_json(), indent=2, sort_keys=True) + "\n")


_OPTIONAL_FIELDS = ("complete", "num_examples", "hidden_dtype", "format_version", "content_key", "stopped_by_time_cap",
                    "endpoint")


def find_covering(data_root: Path, content_key: str, need: StoredExtras) -> Path | None:
    """A complete cache under ``data_root`` with the same answers whose extras cover ``need`` (the one
    with the fewest stored bytes), so a job needing less (standalone: top-k only) reuses the pipeline's
    dataset (hidden states + aux layers + top-k) instead of regenerating."""
    found: list[tuple[int, str, Path]] = []
    for entry in data_root.glob("*/" + MANIFEST) if data_root.is_dir() else []:
        try:
            manifest = Manifest.read(entry.parent)
        except (ValueError, TypeError, json.JSONDecodeError):
            continue  # not a cache of this format: never reused
        if manifest.complete and manifest.content_key == content_key and manifest.extras.covers(need):
            found.append((manifest.extras.bytes_per_token(manifest.hidden_size), entry.parent.name, entry.parent))
    return min(found)[2] if found else None


def shard_paths(cache_dir: Path, index: int) -> tuple[Path, Path]:
    return cache_dir / f"shard-{index:05d}.parquet", cache_dir / f"shard-{index:05d}.safetensors"


def shard_complete(cache_dir: Path, index: int) -> bool:
    return shard_paths(cache_dir, index)[0].is_file()


def write_shard(cache_dir: Path, index: int, rows: list[dict[str, Any]], tensors: dict[str, Tensor]) -> None:
    """Tensors first, rows last (the rows file is the completion mark); both atomically.

    A write that fails (a full disk above all) leaves no file of this shard behind, neither the
    temporaries nor a tensors file without its rows, and says which shard and why in one line;
    a rerun then regenerates from this shard on."""
    import datasets
    from safetensors.torch import save_file

    rows_path, tensors_path = shard_paths(cache_dir, index)
    tmp_tensors = tensors_path.with_name(f".{tensors_path.name}.tmp-{os.getpid()}")
    tmp_rows = rows_path.with_name(f".{rows_path.name}.tmp-{os.getpid()}")
    try:
        save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(tmp_tensors),
                  metadata={"format": "pt"})
        os.replace(tmp_tensors, tensors_path)
        datasets.Dataset.from_list(rows).to_parquet(str(tmp_rows))
        os.replace(tmp_rows, rows_path)
    except OSError as err:
        for partial in (tmp_tensors, tmp_rows, tensors_path, rows_path):
            partial.unlink(missing_ok=True)
        reason = err.strerror or str(err)
        raise OSError(err.errno, f"generate: writing shard {index} to {cache_dir} failed ({reason}); its "
                                 f"partial files were removed and shards before it are kept, so a rerun "
                                 f"resumes at shard {index} once there is room") from err


def finalize(cache_dir: Path, manifest: Manifest) -> None:
    """Join the shard rows into one `datasets` dataset and mark the manifest complete."""
    import datasets

    datasets.disable_progress_bars()
    parts = [datasets.Dataset.from_parquet(str(shard_paths(cache_dir, i)[0]), cache_dir=str(cache_dir / ".hf-cache"))
             for i in range(manifest.num_shards)]
    joined = datasets.concatenate_datasets(parts)
    tmp = cache_dir / f".dataset.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    joined.save_to_disk(str(tmp))
    shutil.rmtree(cache_dir / "dataset", ignore_errors=True)
    os.replace(tmp, cache_dir / "dataset")
    shutil.rmtree(cache_dir / ".hf-cache", ignore_errors=True)
    manifest.complete, manifest.num_examples = True, len(joined)
    manifest.write(cache_dir)


class DistillDataset(torch.utils.data.Dataset):
    """Indexable examples for the distill trainer: input_ids, prompt_length and the stored extras it needs.

    Fields (names the objectives read): ``hidden`` [T,d] bf16, ``aux_hidden`` [T,3d] bf16 (the job's own aux layers,
    in its order, of those stored),
    ``topk_ids`` [T,k] int64, ``topk_logprobs`` [T,k] fp32. String columns (domain) stay on ``rows``.
    """

    def __init__(self, cache_dir: str | Path, expected_fingerprint: str | None = None,
                 need: StoredExtras | None = None, indices: list[int] | None = None) -> None:
        import datasets

        self.cache_dir = Path(cache_dir)
        self.manifest = Manifest.read(self.cache_dir)
        if expected_fingerprint is not None and self.manifest.target_fingerprint != expected_fingerprint:
            raise ValueError(
                f"{self.cache_dir / MANIFEST}: data cache was made for target fingerprint "
                f"{self.manifest.target_fingerprint}, but the target's fingerprint is {expected_fingerprint}"
            )
        if not self.manifest.complete:
            raise ValueError(f"{self.cache_dir / MANIFEST}: cache is incomplete (complete=false); rerun draftsmith generate to finish it")
        self.need = need or StoredExtras()
        if not self.manifest.extras.covers(self.need):
            raise ValueError(
                f"{self.cache_dir / MANIFEST}: field 'extras' holds {asdict(self.manifest.extras)}, but this job needs "
                f"{asdict(self.need)} (regenerate with the draft's mode/topk settings)"
            )
        self._aux_columns = aux_columns(self.manifest.extras.aux_layers, self.need.aux_layers) \
            if self.need.aux_layers else None
        self.rows = datasets.load_from_disk(str(self.cache_dir / "dataset"))
        missing = [name for name in REQUIRED_ROW_FIELDS if name not in self.rows.column_names]
        if missing:
            raise ValueError(f"{self.cache_dir / 'dataset'}: dataset is missing fields {missing} (has {self.rows.column_names})")
        self.indices = list(range(len(self.rows))) if indices is None else list(indices)
        self._handles: dict[int, Any] = {}

    def subset(self, indices: list[int]) -> "DistillDataset":
        out = object.__new__(DistillDataset)
        out.__dict__.update(self.__dict__)
        out.indices, out._handles = [self.indices[i] for i in indices], {}
        return out

    def __len__(self) -> int:
        return len(self.indices)

    def domain(self, i: int) -> str:
        return self.rows[self.indices[i]].get("domain", "")

    def answer_temperatures(self) -> list[float]:
        """Per example, the temperature its answer was generated at (-1: a corpus reference, or a cache from
        before the field was stored)."""
        if "temperature" not in self.rows.column_names:
            return [-1.0] * len(self.indices)
        column = self.rows["temperature"]
        return [float(column[i]) for i in self.indices]

    def _tensors(self, shard: int) -> Any:
        from safetensors import safe_open

        if shard not in self._handles:
            self._handles[shard] = safe_open(str(shard_paths(self.cache_dir, shard)[1]), framework="pt")
        return self._handles[shard]

    def __getitem__(self, i: int) -> dict[str, Any]:
        row = self.rows[self.indices[i]]
        example: dict[str, Any] = {"input_ids": list(row["input_ids"]), "prompt_length": int(row["prompt_length"])}
        if self.need.any:
            tensors, eid = self._tensors(int(row["shard"])), int(row["example_id"])
            if self.need.final_hidden:
                example["hidden"] = tensors.get_tensor(f"{eid}.hidden")
            if self.need.aux_layers:
                aux = tensors.get_tensor(f"{eid}.aux")   # [T, stored layers x d]
                if self._aux_columns is not None:
                    blocks = aux.view(aux.shape[0], len(self.manifest.extras.aux_layers), -1)
                    aux = blocks[:, self._aux_columns].reshape(aux.shape[0], -1)
                example["aux_hidden"] = aux
            if self.need.topk:
                example["topk_ids"] = tensors.get_tensor(f"{eid}.topk_ids")[:, : self.need.topk].long()
                example["topk_logprobs"] = tensors.get_tensor(f"{eid}.topk_logprobs")[:, : self.need.topk].float()
        return example

    def __getstate__(self) -> dict[str, Any]:  # DataLoader workers reopen their own mmaps
        state = dict(self.__dict__)
        state["_handles"] = {}
        return state
