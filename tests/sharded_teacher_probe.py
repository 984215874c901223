"""Run under torchrun (2 gloo ranks): a tiny random target's teacher forward, unsharded and then sharded
with `Teacher.shard`, on the same batch; each rank writes what it saw to <out>/rank<r>.json. Not a test module
itself: tests/train/distill/test_sharded_target.py starts it."""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist


def tiny_target(family: str) -> torch.nn.Module:
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # the tests folder, as tests/conftest.py puts it
    from tiny_models import HF_INIT, tiny_model

    fields = dict(vocab_size=96, intermediate_size=96, num_hidden_layers=4, max_position_embeddings=128,
                  tie_word_embeddings=False)
    moe = dict(num_experts=4, moe_intermediate_size=48, norm_topk_prob=True)
    fields.update({"llama": {}, "qwen3": dict(head_dim=24), "qwen3_moe": dict(head_dim=24, **moe)}[family])
    return tiny_model(family, 0, HF_INIT, **fields).float()  # seed 0: the same random target on every rank


def main() -> None:
    from draftsmith.train.distill.objectives.teacher import Teacher

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--family", default="llama")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    teacher = Teacher(tiny_target(args.family))
    ids = torch.randint(1, 96, (2, 12), generator=torch.Generator().manual_seed(rank))  # ranks differ: own data
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[1, 9:] = False
    with torch.no_grad():
        reference = teacher(ids, mask, [1, 2, 4])
        teacher.shard(torch.device("cpu"))
        sharded = [teacher(ids, mask, [1, 2, 4]) for _ in range(2)]  # twice: shards are freed and gathered again
    diff = max(float((a - b).abs().max()) for out in sharded for a, b in zip(out, reference))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"rank{rank}.json").write_text(json.dumps(
        {"rank": rank, "world_size": dist.get_world_size(), "max_abs_diff": diff, "local_share": teacher.local_share(),
         "pid": os.getpid()}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
