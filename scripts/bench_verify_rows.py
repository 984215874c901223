"""What a verify row costs the target, per batch size: the ceiling on speculation at batch > 1 and on trees.

A speculative round verifies 1 + n rows per sequence (the root and n drafted tokens) in one target forward. For
B sequences of --context cached tokens each, this times the engine's forward over B x (1 + n) query rows
(chain-causal, every row's logits, the engine's own thread rule for that many tokens) against the plain decode
step over B rows (n = 0), with repetitions interleaved and the order rotated. It prints per cell the median
milliseconds (spread = max - min), the ratio r(n) = T(B(1 + n)) / T(B) paired per repetition, and what r means:

  r               a round must emit at least r tokens per sequence to beat plain decoding, even with a free draft
  alpha to pay    the per-token acceptance a chain of n drafts needs for that: (1 - a^(n+1)) / (1 - a) = r
                  ("none": even a = 1, n + 1 tokens, does not pay)

A tree of n nodes verifies the same 1 + n rows (an ancestor mask instead of a causal one), so the n = 16 column is
also the cost of a 16-node tree; it pays only if its tau beats r(16).

  python scripts/bench_verify_rows.py --target artifacts/target-cache/<key> --batch-sizes 1,16,32 --drafts 1,2,4,8,16
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import draftsmith  # noqa: E402,F401  (before torch: OpenMP's wait policy, draftsmith/__init__)
import torch  # noqa: E402

from bench_spec import find_target, untrained_target  # noqa: E402
from draftsmith.kernels.attention import AttentionMetadata  # noqa: E402
from draftsmith.serve_eval.engine import EngineConfig, LLMEngine  # noqa: E402
from draftsmith.serve_eval.engine.threads import threads_for  # noqa: E402
from draftsmith.serve_eval.eval.interleave import interleave  # noqa: E402


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=Path, help="trained target dir (default: the newest under --artifacts)")
    ap.add_argument("--artifacts", type=Path, default=ROOT / "artifacts")
    ap.add_argument("--batch-sizes", default="1,16,32", help="comma list of sequences per step")
    ap.add_argument("--drafts", default="1,2,4,8,16", help="comma list of drafted tokens per sequence (n)")
    ap.add_argument("--context", type=int, default=192, help="cached tokens per sequence before the round")
    ap.add_argument("--repeats", type=int, default=7, help="interleaved repetitions (median + spread)")
    ap.add_argument("--calls", type=int, default=5, help="forwards per repetition (their mean is one sample)")
    ap.add_argument("--dtype", default="float32", help="float32 (as exactness is served here), bfloat16 or auto")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", default="auto", help="the engine's num_threads: a count or auto")
    ap.add_argument("--kv-gb", type=float, default=1.0)
    return ap.parse_args()


def alpha_to_pay(ratio: float, drafts: int) -> float | None:
    """The per-token acceptance a at which a chain of `drafts` emits `ratio` tokens a round (bisection on the
    increasing (1 - a^(n+1)) / (1 - a)); None when even a = 1 (n + 1 tokens) falls short."""
    if ratio > drafts + 1:
        return None
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if sum(mid ** j for j in range(drafts + 1)) < ratio:
            lo = mid
        else:
            hi = mid
    return hi


def forward_timer(engine: LLMEngine, batch: int, drafts: int, context: int, calls: int):
    """A callable timing the target's forward over `batch` sequences of 1 + drafts new rows each (mean seconds of
    `calls` forwards), their KV in disjoint blocks of the engine's pool."""
    block = engine.kv.block_size
    per_seq = -(-(context + 1 + drafts) // block)
    if batch * per_seq > engine.kv.num_gpu_blocks:
        raise SystemExit(f"--kv-gb: {batch} sequences of {context + 1 + drafts} tokens need {batch * per_seq} KV blocks, "
                         f"the pool has {engine.kv.num_gpu_blocks}")
    tables = [list(range(b * per_seq, (b + 1) * per_seq)) for b in range(batch)]
    q = 1 + drafts
    device = engine.executor.device
    meta = AttentionMetadata.build([q] * batch, [context + q] * batch, tables, block, device)
    ids = torch.randint(3, engine.executor.vocab_size, (batch * q,), device=device)
    positions = torch.arange(context, context + q, device=device).repeat(batch)
    rows = torch.arange(batch * q, device=device)

    def run() -> float:
        with torch.inference_mode(), threads_for(engine.threads, batch * q):
            engine.executor.synchronize()
            start = time.perf_counter()
            for _ in range(calls):
                engine.executor.forward(ids, positions, meta, rows)
            engine.executor.synchronize()
        return (time.perf_counter() - start) / calls

    return run


def main() -> None:
    args = parse_args()
    target = args.target or find_target(args.artifacts)
    source = "given" if args.target else ("newest under --artifacts" if target else "untrained, embedded shape")
    if target is None:
        import tempfile

        target = untrained_target(Path(tempfile.mkdtemp()))
    threads = int(args.threads) if args.threads.isdigit() else args.threads
    engine = LLMEngine(EngineConfig(str(target), dtype=args.dtype, device=args.device, kv_cache_memory_gb=args.kv_gb,
                                    enable_prefix_caching=False, num_threads=threads))
    draft_counts = [int(n) for n in args.drafts.split(",")]
    print(f"target: {target} [{source}]; dtype {args.dtype}, device {args.device}; context {args.context} tokens a "
          f"sequence; engine threads {engine.threads.describe()}; {args.repeats} interleaved repetitions of "
          f"{args.calls} forwards")
    for batch in [int(b) for b in args.batch_sizes.split(",")]:
        cells = {n: forward_timer(engine, batch, n, args.context, args.calls) for n in [0, *draft_counts]}
        for cell in cells.values():   # warm-up: first-call allocations
            cell()
        times = interleave({str(n): cell for n, cell in cells.items()}, args.repeats)
        plain = times["0"]
        print(f"\nbatch {batch}: plain decode step {statistics.median(plain) * 1e3:.2f} ms "
              f"({(max(plain) - min(plain)) * 1e3:.2f}), {statistics.median(plain) * 1e3 / batch:.3f} ms a token")
        print(f"  {'drafts n':>8}  {'rows':>5}  {'ms':>8}  {'spread':>6}  {'r = tokens to pay':>17}  "
              f"{'ms per extra row':>16}  {'alpha to pay':>12}")
        for n in draft_counts:
            mine = times[str(n)]
            ratio = statistics.median(m / p for m, p in zip(mine, plain))   # paired per repetition
            extra = (statistics.median(mine) - statistics.median(plain)) / (batch * n)
            alpha = alpha_to_pay(ratio, n)
            print(f"  {n:>8}  {batch * (1 + n):>5}  {statistics.median(mine) * 1e3:8.2f}  "
                  f"{(max(mine) - min(mine)) * 1e3:6.2f}  {ratio:17.2f}  {extra * 1e3:16.3f}  "
                  f"{'none' if alpha is None else f'{alpha:.2f}':>12}")


if __name__ == "__main__":
    main()
