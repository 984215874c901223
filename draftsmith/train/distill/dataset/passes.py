"""The dataset's two passes over the target: the answers (the serve_eval engine, or the corpus references),
then one teacher-forced forward over prompt + answer that yields the stored extras."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from draftsmith.drafts.schemas import DraftDataConfig, answer_budget, answer_temperature
from draftsmith.train.distill.gendata import HIDDEN_DTYPE, PER_POSITION_FIELDS, StoredExtras


def prompt_token_ids(tokenizer: Any, records: list[dict[str, str]], data: DraftDataConfig,
                     context: int | None = None) -> list[list[int]]:
    """Prompts as ids, whole: the target answers the prompt it is served, and only the training window
    (training_window) is cut to max_length. Cut before generation, half of the embedded chat conversations
    (longer than the window) were answered from a text that starts mid-conversation, and the drafts learned
    answers the served target does not give. Only a prompt that the target's context (``context`` positions)
    cannot hold with an answer keeps its last tokens."""
    budget = None if context is None else max(1, context - answer_budget(data))
    out = []
    for record in records:
        ids = tokenizer.encode(record["prompt"])
        if not ids:
            raise ValueError(f"prompt of domain {record['domain']!r} tokenizes to nothing: {record['prompt'][:60]!r}")
        out.append(ids if budget is None else ids[-budget:])
    return out


def training_window(rows: list[dict[str, Any]], tensors: dict[str, torch.Tensor], max_length: int) -> None:
    """In place: each example's last max_length positions (its whole answer and the end of its prompt), in its
    row (input_ids, prompt_length) and in every per-position tensor stored for it (<id>.<field>, [T, ...]), which
    were computed over the whole sequence, as the served target computes them."""
    for row in rows:
        cut = len(row["input_ids"]) - max_length
        if cut <= 0:
            continue
        row["input_ids"] = row["input_ids"][cut:]
        row["prompt_length"] -= cut   # >= 1: an answer takes at most max_length - 1 positions (answer_budget)
        for field in PER_POSITION_FIELDS:
            name = f"{row['example_id']}.{field}"
            if name in tensors:
                tensors[name] = tensors[name][cut:]


def teacher_forced_extras(teacher: Any, sequences: list[list[int]], extras: StoredExtras, batch_size: int,
                          example_ids: list[int], bf16: bool = False) -> dict[str, torch.Tensor]:
    """One forward of the target over each full sequence; per-example tensors named <id>.<field>."""
    tensors: dict[str, torch.Tensor] = {}
    if not extras.any:
        return tensors
    device = next(teacher.model.parameters()).device
    for start in range(0, len(sequences), batch_size):
        chunk = sequences[start : start + batch_size]
        width = max(len(s) for s in chunk)
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        mask = torch.zeros(len(chunk), width, dtype=torch.bool)
        for row, seq in enumerate(chunk):
            ids[row, : len(seq)], mask[row, : len(seq)] = torch.tensor(seq), True
        with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            out = teacher(ids.to(device), mask.to(device), extras.aux_layers, need_logits=extras.topk > 0)
        for row, seq in enumerate(chunk):
            eid, n = example_ids[start + row], len(seq)
            if extras.final_hidden:
                tensors[f"{eid}.hidden"] = out.hidden[row, :n].to(HIDDEN_DTYPE).cpu()
            if extras.aux_layers:
                tensors[f"{eid}.aux"] = out.aux_hidden[row, :n].to(HIDDEN_DTYPE).cpu()
            if extras.topk:
                top = torch.log_softmax(out.logits[row, :n].float(), -1).topk(extras.topk, dim=-1)
                tensors[f"{eid}.topk_ids"] = top.indices.to(torch.int32).cpu()
                tensors[f"{eid}.topk_logprobs"] = top.values.float().cpu()
    return tensors


class EngineGenerator:
    """The serve_eval engine, started on first use (a fully cached run never loads it)."""

    def __init__(self, model_dir: Path, data: DraftDataConfig) -> None:
        self.model_dir, self.data, self.llm = model_dir, data, None

    def answers(self, prompts: list[list[int]], example_ids: list[int]) -> list[tuple[list[int], str]]:
        from draftsmith.serve_eval.engine import LLM, SamplingParams

        if self.llm is None:
            self.llm = LLM(str(self.model_dir), max_num_seqs=self.data.max_num_seqs,
                           kv_cache_memory_gb=self.data.kv_cache_memory_gb, seed=self.data.seed)
        d = self.data
        # One seed per prompt (from its global index): the same answers however the prompts are sharded.
        params = [SamplingParams(temperature=answer_temperature(d, eid), top_k=d.top_k, top_p=d.top_p, seed=d.seed + eid,
                                 max_tokens=answer_budget(d))
                  for p, eid in zip(prompts, example_ids)]
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        return [(list(o.output_token_ids), o.finish_reason or "length") for o in outs]


def reference_answers(tokenizer: Any, records: list[dict[str, str]], prompts: list[list[int]], data: DraftDataConfig) -> list[tuple[list[int], str]]:
    out = []
    for record, prompt in zip(records, prompts):
        ids = tokenizer.encode(record["reference"], add_special_tokens=False)
        if tokenizer.eos_token_id is not None:
            ids = ids + [tokenizer.eos_token_id]
        out.append((ids[: answer_budget(data)], "reference"))
    return out
