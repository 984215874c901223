"""Proposal cost per round, block draft vs EAGLE-3, at batch 1, in the unit of ONE EAGLE-3 draft step.

The unit ("one draft-layer forward") is an EAGLE-3 proposal at K = 1: one forward of its single decoder layer
over the newly fed row, plus its LM head. Each proposer runs steady-state rounds the way the engine drives it:
one new target row fed per round (one accepted token), propose K, verification drops the speculative entries.
Weights are untrained (cost does not depend on their values), shaped from the target's config; serving form,
fp32, one intra-op thread (the engine's choice for small models) on the CPU; on a GPU (--device cuda) each
round is timed between two synchronizations. Prints ms per round, that ratio, and the number of draft
forwards per round (counted by a forward hook; a greedy chain's steps in the C loop count one each).

    scripts/bench_block_cost.py --target artifacts/target-cache/<key> --ks 4 8 --block-layers 1 2
    scripts/bench_block_cost.py --target /ckpt/llama --device cuda --dtype bfloat16
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import draftsmith  # noqa: E402,F401  (before torch: OpenMP's wait policy, draftsmith/__init__)
import torch  # noqa: E402
from draftsmith.drafts.block import BlockDraft  # noqa: E402
from draftsmith.serve_eval.eval.interleave import rotation  # noqa: E402
from draftsmith.drafts.eagle3 import Eagle3Draft  # noqa: E402
from draftsmith.kernels.layers.config import hf_config_dict  # noqa: E402
from draftsmith.serve_eval.speculative.proposers.base import TargetFeatures  # noqa: E402
from draftsmith.serve_eval.speculative.proposers.block import BlockProposer  # noqa: E402
from draftsmith.serve_eval.speculative.proposers.eagle3 import Eagle3Proposer  # noqa: E402
from draftsmith.serve_eval.speculative.config import WEIGHT_STORAGES, SpecConfig  # noqa: E402
from draftsmith.serve_eval.speculative.verify import VerifyResult  # noqa: E402
from draftsmith.kernels.small_gemm import panel_storage  # noqa: E402


class _CountedLoop:
    """A draft's C loop (kernels.layers.native_draft_loop) that adds each of its steps to a runner's forwards."""

    def __init__(self, loop, runner: "Runner") -> None:
        self.loop, self.runner = loop, runner

    def accepts(self, *args, **kwargs) -> bool:
        return self.loop.accepts(*args, **kwargs)

    def __call__(self, first_tokens, start_positions, num_steps, *args, **kwargs):
        self.runner.forwards += sum(num_steps)
        return self.loop(first_tokens, start_positions, num_steps, *args, **kwargs)


class Runner:
    """One sequence driven through steady-state rounds of one proposer (one new target row per round)."""

    def __init__(self, proposer, width: int, k: int, prompt_len: int, sync=lambda: None) -> None:
        self.proposer, self.width, self.k, self.sync = proposer, width, k, sync
        self.forwards, self.times = 0, []
        proposer.draft.register_forward_hook(lambda *_: setattr(self, "forwards", self.forwards + 1))
        loop = proposer.draft.draft_loop() if isinstance(proposer.draft, Eagle3Draft) else None
        if loop is not None:   # greedy chain steps after the first run in one C call: each counts as a forward
            counted = _CountedLoop(loop, self)
            proposer.draft.draft_loop = lambda: counted
        self.seq = SimpleNamespace(request_id="r", token_ids=list(range(1, prompt_len + 1)),
                                   params=SimpleNamespace(temperature=0.0, top_k=0, top_p=1.0), generator=None)
        proposer.add_features("r", TargetFeatures(0, torch.zeros(prompt_len - 1, 1), torch.randn(prompt_len - 1, width)))

    def round(self) -> None:
        self.sync()
        start = time.perf_counter()
        self.proposer.propose([self.seq], [self.k])
        self.sync()
        self.times.append((time.perf_counter() - start) * 1e3)
        self.proposer.on_accepted("r", VerifyResult([5], 0, []))
        pos = len(self.seq.token_ids) - 1
        self.seq.token_ids.append(5)
        self.proposer.add_features("r", TargetFeatures(pos, torch.zeros(1, 1), torch.randn(1, self.width)))

    def result(self, warmup: int) -> tuple[float, float]:
        """(median ms per round after warm-up, draft forwards per round)."""
        return statistics.median(self.times[warmup:]), self.forwards / len(self.times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True, help="target checkpoint dir (its config shapes the drafts)")
    parser.add_argument("--ks", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--block-layers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--dtype", default="float32", help="float32 or bfloat16")
    parser.add_argument("--weight-storage", default=SpecConfig.draft_weight_storage, choices=sorted(WEIGHT_STORAGES),
                        help="the drafts' packed CPU panels (the engine's draft_weight_storage; default %(default)s)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.set_grad_enabled(False)
    torch.manual_seed(0)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    cfg = hf_config_dict(args.target)
    width = 3 * int(cfg["hidden_size"])
    eagle3 = Eagle3Draft.from_target_config(args.target).to(device, dtype)

    storage = WEIGHT_STORAGES[args.weight_storage]

    def runner(proposer_class, draft, k: int) -> Runner:
        with panel_storage(storage):   # the draft's packed panels, as the engine builds them
            return Runner(proposer_class.from_draft(draft), width, k, args.prompt_len, sync)

    runners = {("eagle3", 1): runner(Eagle3Proposer, eagle3, 1)}
    for k in args.ks:
        runners["eagle3", k] = runner(Eagle3Proposer, eagle3, k)
        for layers in args.block_layers:
            block = BlockDraft.from_target_config(args.target, num_layers=layers, block_size=max(args.ks) + 1)
            runners[f"block {layers}-layer", k] = runner(BlockProposer, block.to(device, dtype), k)
    order = list(runners.values())
    for step in range(args.warmup + args.rounds):  # interleaved, rotated: load noise falls on every method alike
        for runner in rotation(order, step):
            runner.round()
    unit, _ = runners["eagle3", 1].result(args.warmup)
    print(f"unit: one EAGLE-3 draft step (1 layer + head, K=1) = {unit:.3f} ms  (target {args.target}, "
          f"prompt {args.prompt_len}, {args.rounds} interleaved rounds, {args.dtype} on {args.device}, "
          f"{args.weight_storage} panels)")
    print(f"{'draft':<16} {'K':>2} {'ms/round':>9} {'x unit':>7} {'forwards/round':>15}")
    for (name, k), runner in runners.items():
        ms, forwards = runner.result(args.warmup)
        print(f"{name:<16} {k:>2} {ms:>9.3f} {ms / unit:>7.2f} {forwards:>15.2f}")


if __name__ == "__main__":
    main()
