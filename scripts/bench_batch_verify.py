"""Batched verification attention at batch > 1, side by side in one run.

A chain's verify step gives each sequence K+1 new tokens after its context. The torch paged-attention
backend serves such short causal blocks together, bucketed by length (kernels.attention.torch_paged,
MAX_BATCHED_QUERY_ROWS); with the limit set to 0 it serves them one sequence at a time with SDPA, as it
did before. Per batch size, every round speculating (no fallback, no batch gate), T=0, interleaved
repetitions with the order rotated:

  nospec                plain decoding
  <method>              speculation, verify blocks batched
  <method>/per-seq      speculation, verify blocks one sequence at a time (the same engine)

It prints median ms/token (spread = max - min) and the speed-up over nospec paired per repetition. The
outputs are identical either way (greedy; the kernel tests compare both paths with a dense reference).

  python scripts/bench_batch_verify.py --methods standalone,eagle --batch-sizes 16,32 --repeats 3
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_spec import decode_ms_per_token, engine_for, paired_summary, resolve_inputs, summary_text  # noqa: E402
from draftsmith.kernels.attention import torch_paged  # noqa: E402
from draftsmith.serve_eval.engine import SamplingParams  # noqa: E402
from draftsmith.serve_eval.engine.model_executor import dtype_name  # noqa: E402
from draftsmith.serve_eval.eval.interleave import interleave  # noqa: E402


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=Path)
    ap.add_argument("--artifacts", type=Path, default=ROOT / "artifacts")
    ap.add_argument("--methods", default="standalone,eagle")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto", help="float32, bfloat16, or auto: the engine's rule (fp32 where the native CPU kernels run, else bf16 where faster)")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--prompts-per-domain", type=int, default=8)
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--kv-gb", type=float, default=0.5)
    ap.add_argument("--batch-sizes", default="16,32")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", default="auto", help="engine intra-op threads: a count or 'auto'")
    args = ap.parse_args()
    args.dtype = dtype_name(args.dtype, args.device)   # bench_spec's engines read it
    if args.threads != "auto":
        args.threads = int(args.threads)
    return args


def timed(engine, prompts, params, batch: int, max_rows: int) -> float:
    """ms/token with the batched-block limit set to max_rows for this call (0 = per sequence)."""
    saved, torch_paged.MAX_BATCHED_QUERY_ROWS = torch_paged.MAX_BATCHED_QUERY_ROWS, max_rows
    try:
        return decode_ms_per_token(engine, prompts, params, batch)
    finally:
        torch_paged.MAX_BATCHED_QUERY_ROWS = saved


def main() -> None:
    args = parse_args()
    target, drafts, prompts = resolve_inputs(args, Path(tempfile.mkdtemp(prefix="bench_batch_verify_")))
    flat = [p for ps in prompts.values() for p in ps]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    methods = [m for m in args.methods.split(",") if m and (m == "ngram" or m in drafts)]
    batched = torch_paged.MAX_BATCHED_QUERY_ROWS
    for batch in [int(b) for b in args.batch_sizes.split(",") if b]:
        batch_prompts = (flat * (batch // max(len(flat), 1) + 1))[:batch]
        engines = {"nospec": engine_for(args, target, "nospec", drafts)}
        engines.update({m: engine_for(args, target, m, drafts, fallback=False) for m in methods})
        cells = {"nospec": lambda: timed(engines["nospec"], batch_prompts, params, batch, batched)}
        for m in methods:
            cells[m] = lambda e=engines[m]: timed(e, batch_prompts, params, batch, batched)
            cells[f"{m}/per-seq"] = lambda e=engines[m]: timed(e, batch_prompts, params, batch, 0)
        for call in cells.values():   # warm-up: lazy allocations, first-call kernels
            call()
        samples = interleave(cells, args.repeats)
        print(f"\nbatch {batch}, T=0, K={args.k}, {batch} prompts x {args.max_tokens} tokens, every round speculating, "
              f"{args.repeats} interleaved repetitions: median ms/token (spread), speed-up over nospec [min, max]")
        for name, ms in samples.items():
            print(f"batch {batch}: {name:<20} {summary_text(paired_summary(samples['nospec'], ms))}")
        for m in methods:
            ratio = [b / a for a, b in zip(samples[m], samples[f"{m}/per-seq"])]
            print(f"batch {batch}: {m} batched verify / per-sequence: {statistics.median(ratio):.2f}x faster "
                  f"[{min(ratio):.2f}, {max(ratio):.2f}]")


if __name__ == "__main__":
    main()
