"""Shared fixtures for the speculative-engine tests: tiny models, drafts, scripted proposers, runners."""
from __future__ import annotations

import os
import random
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch

from draftsmith.serve_eval.engine import EngineConfig, LLMEngine, SamplingParams
from draftsmith.serve_eval.speculative.proposers.base import Proposal, Proposer
from draftsmith.serve_eval.speculative.tree import DraftTree
from tiny_models import save_tiny_model

VOCAB = 128
# The device the engine-level exactness tests run on: cpu in CI; DRAFTSMITH_TEST_DEVICE=cuda runs the same
# tests on a GPU (scripts/check_gpu.sh).
TEST_DEVICE = os.environ.get("DRAFTSMITH_TEST_DEVICE", "cpu")


def make_llama(path: Path, vocab: int = VOCAB, hidden: int = 64, layers: int = 2, seed: int = 0,
               max_pos: int = 256, init: float = 0.1, **fields) -> Path:
    """A random HF Llama checkpoint dir (fp32): the engine tests' target and draft shape (wide init, so greedy
    argmaxes are decisive; EOS the last id); fields: other config fields (e.g. num_attention_heads)."""
    return save_tiny_model(path, "llama", seed, vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                           num_hidden_layers=layers, max_position_embeddings=max_pos, initializer_range=init,
                           eos_token_id=vocab - 1, bos_token_id=0, pad_token_id=0, **fields)


def feature_draft(kind: str, target_dir: Path, out_dir: Path, seed: int = 0, init=None, block_opts=None) -> Path:
    """An untrained Medusa / EAGLE / EAGLE-3 / block draft for target_dir, saved with its fingerprint.
    init: optional callable(draft module) that sets weights before saving; block_opts: BlockConfig options."""
    from draftsmith.drafts.identity import target_fingerprint
    from draftsmith.drafts.io import save_draft

    from draftsmith.drafts.kinds import draft_kind

    cls = draft_kind(kind).module
    torch.manual_seed(seed)
    opts = dict(block_opts or {}) if kind == "block" else {}
    if kind in ("eagle3", "block"):  # default [2, L//2, L-3] needs L >= 5; tiny targets name distinct layers
        from draftsmith.kernels.layers.config import hf_config_dict

        num_layers = int(hf_config_dict(target_dir)["num_hidden_layers"])
        opts["aux_layers"] = [1, num_layers // 2, num_layers - 1] if num_layers >= 3 else [0, 1, num_layers]
    draft = cls.from_target_config(target_dir, **opts)
    if init is not None:
        init(draft)
    save_draft(draft, out_dir, kind, target_fingerprint(target_dir))
    return Path(out_dir)


def proposer_available(method: str) -> bool:
    from draftsmith.serve_eval.speculative.proposers.registry import proposer_methods

    return method in proposer_methods()


def workload(n: int, seed: int = 0, shared_prefix: int = 0, max_len: int = 30, vocab: int = VOCAB,
             repeat: bool = True, max_out: int = 36) -> tuple[list[list[int]], list[int]]:
    """Prompts (some repetitive, so n-gram lookup finds matches) and output lengths."""
    rng = random.Random(seed)
    system = [rng.randrange(1, vocab - 1) for _ in range(shared_prefix)]
    prompts, lengths = [], []
    for i in range(n):
        body = [rng.randrange(1, vocab - 1) for _ in range(rng.randint(2, max_len))]
        if repeat and i % 2 == 0:
            body = body + body[: len(body) // 2] + body
        prompts.append(system + body)
        lengths.append(rng.randint(4, max_out))
    return prompts, lengths


def run_engine(engine: LLMEngine, prompts, params, domains=None, check=None) -> dict[str, object]:
    """Add all requests, step to completion (calling check(engine) after every step); outputs by id."""
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", prompt, p, domain=None if domains is None else domains[i])
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        if check is not None:
            check(engine)
    return finals


def greedy_reference(target_dir, prompts, lengths, **kw) -> dict[str, list[int]]:
    eng = LLMEngine(EngineConfig(str(target_dir), **kw))
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    return {rid: out.output_token_ids for rid, out in run_engine(eng, prompts, params).items()}


class OracleProposer(Proposer):
    """Test proposer that knows each request's greedy continuation and proposes random mixes of
    right and wrong tokens, as chains or as trees (siblings, random shapes), so the engine sees
    random accept / reject patterns and random accepted tree paths."""

    supports_tree = True

    def __init__(self, references: dict[str, list[int]], prompts: dict[str, list[int]], tree: bool,
                 p_right: float = 0.7, seed: int = 0, vocab: int = VOCAB, max_nodes: int = 12) -> None:
        self.full = {rid: prompts[rid] + references[rid] for rid in references}
        self.tree, self.p_right, self.vocab, self.max_nodes = tree, p_right, vocab, max_nodes
        self.rng = random.Random(seed)
        self.accepted: list[int] = []  # num_accepted_drafts seen by on_accepted
        self.resets: list[str] = []

    def _truth(self, seq, depth: int) -> int:
        full = self.full[seq.request_id]
        pos = len(seq.token_ids) - 1 + depth
        return full[pos] if pos < len(full) else self.rng.randrange(self.vocab)

    def _wrong(self, right: int) -> int:
        return (right + self.rng.randrange(1, self.vocab)) % self.vocab

    def propose(self, seqs, num_tokens, features=None):
        out = []
        for seq, k in zip(seqs, num_tokens):
            if not self.tree:
                toks, ok = [], True
                for depth in range(1, k + 1):
                    ok = ok and self.rng.random() < self.p_right
                    right = self._truth(seq, depth)
                    toks.append(right if ok else self._wrong(right))
                out.append(Proposal(torch.tensor(toks, dtype=torch.int64)))
                continue
            tokens, parents = [], []
            frontier = [(-1, 0, True)]  # (node, depth, on the true path)
            while frontier and len(tokens) < self.max_nodes:
                node, depth, on_path = frontier.pop(0)
                if depth >= k:
                    continue
                right = self._truth(seq, depth + 1)
                width = self.rng.randint(1, 3)
                slot_right = self.rng.randrange(width) if on_path and self.rng.random() < self.p_right else -1
                used = set()
                for c in range(width):
                    if len(tokens) >= self.max_nodes:
                        break
                    tok = right if c == slot_right else self._wrong(right)
                    if tok in used:
                        continue
                    used.add(tok)
                    tokens.append(tok)
                    parents.append(node)
                    frontier.append((len(tokens) - 1, depth + 1, c == slot_right))
            # parents must precede children: BFS order guarantees it
            out.append(Proposal(torch.tensor(tokens, dtype=torch.int64),
                                tree=DraftTree(torch.tensor(tokens, dtype=torch.int64), parents)))
        return out

    def on_accepted(self, request_id, result):
        self.accepted.append(result.num_accepted_drafts)

    def reset(self, request_id):
        self.resets.append(request_id)


def noisy_copy(src: Path, dst: Path, noise: float, seed: int = 0) -> Path:
    """The target's weights plus Gaussian noise: a draft that agrees with the target often, not always."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(src)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=gen) * noise * param.std())
    model.save_pretrained(dst)
    return Path(dst)


# A bare sequence view for driving proposers directly (the SequenceView protocol of proposers/base.py).
@dataclass
class Seq:
    request_id: str
    token_ids: list
    params: SimpleNamespace
    generator: torch.Generator | None = None


def params(t=0.0, k=0, p=1.0):
    return SimpleNamespace(temperature=t, top_k=k, top_p=p)
