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
    """Prompts as ids, whole: the target answers the prompt it is served, and only what is stored is cut to the
    max_length training window (window_bounds). Cut before generation, half of the embedded chat conversations
    (longer than the window) were answered from a text that starts mid-conversation: answers the served target
    does not give. Only a prompt that ``context`` positions (the generator's) cannot hold with an answer keeps
    its last tokens. (The stored features come from the whole sequence; a job in online mode runs the target over
    the stored window, so its features there see the window's context only.)"""
    budget = None if context is None else max(1, context - answer_budget(data))
    out = []
    for record in records:
        ids = tokenizer.encode(record["prompt"])
        if not ids:
            raise ValueError(f"prompt of domain {record['domain']!r} tokenizes to nothing: {record['prompt'][:60]!r}")
        out.append(ids if budget is None else ids[-budget:])
    return out


def window_bounds(length: int, prompt_length: int, max_length: int) -> tuple[int, int]:
    """[start, end) of the positions an example stores: its last max_length (the answer and the end of its prompt),
    keeping at least one prompt token (an endpoint's answer may run past the budget: then its head)."""
    start = max(0, length - max_length)
    if start >= prompt_length:
        start = max(0, prompt_length - 1)
    return start, min(length, start + max_length)


def window_tensors(tensors: dict[str, torch.Tensor], example_ids: list[int],
                   bounds: list[tuple[int, int]]) -> dict[str, torch.Tensor]:
    """Per-position tensors of whole sequences (<id>.<field>, [T, ...]) cut to each example's window (copies)."""
    out = {}
    for eid, (start, end) in zip(example_ids, bounds):
        for field in PER_POSITION_FIELDS:
            name = f"{eid}.{field}"
            if name in tensors:
                out[name] = tensors[name][start:end].clone()
    return out


def teacher_forced_extras(teacher: Any, sequences: list[list[int]], extras: StoredExtras, batch_size: int,
                          example_ids: list[int], bf16: bool = False,
                          bounds: list[tuple[int, int]] | None = None) -> dict[str, torch.Tensor]:
    """One forward of the target over each whole sequence (the context the served target sees); per example the
    tensors <id>.<field> of its stored window (bounds, window_bounds; None: every position). The head and the top-k
    run on the window's rows only, and a batch holds at most batch_size windows' worth of positions (whole prompts
    may be many times the window)."""
    tensors: dict[str, torch.Tensor] = {}
    if not extras.any:
        return tensors
    bounds = bounds or [(0, len(s)) for s in sequences]
    device = next(teacher.model.parameters()).device
    budget = batch_size * max(end - start for start, end in bounds)
    start = 0
    while start < len(sequences):
        stop, width = start + 1, len(sequences[start])   # a batch pads every row to its longest
        while (stop < len(sequences) and stop - start < batch_size
               and (stop + 1 - start) * max(width, len(sequences[stop])) <= budget):
            width = max(width, len(sequences[stop]))
            stop += 1
        _teacher_batch(teacher, sequences[start:stop], extras, example_ids[start:stop], bounds[start:stop], device,
                       bf16, tensors)
        start = stop
    return tensors


def _teacher_batch(teacher: Any, chunk: list[list[int]], extras: StoredExtras, example_ids: list[int],
                   bounds: list[tuple[int, int]], device: torch.device, bf16: bool,
                   tensors: dict[str, torch.Tensor]) -> None:
    width = max(len(s) for s in chunk)
    ids = torch.zeros(len(chunk), width, dtype=torch.long)
    mask = torch.zeros(len(chunk), width, dtype=torch.bool)
    for row, seq in enumerate(chunk):
        ids[row, : len(seq)], mask[row, : len(seq)] = torch.tensor(seq), True
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
        out = teacher(ids.to(device), mask.to(device), extras.aux_layers, need_logits=False)
        # copies of the windows: a view would keep the batch's whole-sequence states alive until the shard is written
        for row, (eid, (lo, hi)) in enumerate(zip(example_ids, bounds)):
            if extras.final_hidden:
                tensors[f"{eid}.hidden"] = out.hidden[row, lo:hi].to(HIDDEN_DTYPE, copy=True).cpu()
            if extras.aux_layers:
                tensors[f"{eid}.aux"] = out.aux_hidden[row, lo:hi].to(HIDDEN_DTYPE, copy=True).cpu()
            if extras.topk:
                logits = teacher.model.lm_head(out.hidden[row, lo:hi]).float()
                top = torch.log_softmax(logits, -1).topk(extras.topk, dim=-1)
                tensors[f"{eid}.topk_ids"] = top.indices.to(torch.int32).cpu()
                tensors[f"{eid}.topk_logprobs"] = top.values.float().cpu()


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
