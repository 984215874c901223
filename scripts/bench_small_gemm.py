"""The few-row fp32 GEMM (draftsmith/kernels/small_gemm.py) against torch's matmul, side by side in one run.

For each projection of a target's decoder layer (q/k/v fused, o, gate/up fused, down) and its LM head, and
each row count, it times one target's worth of calls (``--layers`` distinct weights per projection, so they
come from memory as in a real step) both ways, alternating within every repetition, and prints the median
and spread (max - min) in microseconds per call, then the whole target's matmuls per forward in ms and the
ratio torch / kernel. The serving Linear routes 1..SMALL_GEMM_MAX_ROWS rows to the kernel.

  python scripts/bench_small_gemm.py                        # the embedded target's shape, 1 thread
  python scripts/bench_small_gemm.py --rows 1,5 --repeats 9 --layers 4
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

from bench_spec_round import embedded_shape  # noqa: E402
import draftsmith  # noqa: E402,F401  (before torch: OpenMP's wait policy, draftsmith/__init__)
import torch  # noqa: E402
from draftsmith.kernels import small_gemm  # noqa: E402
from draftsmith.kernels.layers.linear import SMALL_GEMM_MAX_ROWS  # noqa: E402


def projections(hidden: int, intermediate: int, vocab: int, heads: int = 4, kv_heads: int = 2) -> dict[str, tuple[int, int]]:
    """(out, in) of each matmul of a Llama layer with fused q/k/v and gate/up, and of the head."""
    head_dim = hidden // heads
    return {"qkv": ((heads + 2 * kv_heads) * head_dim, hidden), "o": (hidden, hidden),
            "gate_up": (2 * intermediate, hidden), "down": (hidden, intermediate), "head": (vocab, hidden)}


def time_calls(fn, inputs) -> float:
    t0 = time.perf_counter()
    for args in inputs:
        fn(*args)
    return (time.perf_counter() - t0) * 1e6 / len(inputs)


def main() -> None:
    shape = embedded_shape()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,2,3,5,8,9,16,64", help="comma list of row counts")
    ap.add_argument("--layers", type=int, default=shape["num_layers"])
    ap.add_argument("--hidden", type=int, default=shape["hidden_size"])
    ap.add_argument("--intermediate", type=int, default=shape["intermediate_size"])
    ap.add_argument("--vocab", type=int, default=shape["vocab_size"])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    if not small_gemm.available():
        raise SystemExit("the small-row kernel is not available here (no C compiler, no AVX2/FMA, or "
                         "DRAFTSMITH_SMALL_GEMM=0); nothing to compare")
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    torch.manual_seed(0)
    rows_list = [int(r) for r in args.rows.split(",") if r]
    print(f"fp32, {args.threads} thread(s), {args.layers} layers x hidden {args.hidden}, MLP {args.intermediate}, "
          f"vocab {args.vocab}; us per call, median (spread) over {args.repeats} alternating repetitions; "
          f"the serving Linear uses the kernel for 1..{SMALL_GEMM_MAX_ROWS} rows")
    totals = {r: [0.0, 0.0] for r in rows_list}
    print(f"{'matmul':9}{'rows':>5}{'torch':>18}{'kernel':>18}{'ratio':>8}")
    for name, (out_f, in_f) in projections(args.hidden, args.intermediate, args.vocab).items():
        count = 1 if name == "head" else args.layers
        weights = [torch.randn(out_f, in_f) for _ in range(count)]
        transposed = [w.t().contiguous() for w in weights]  # the serving Linear's torch layout (fp32 CPU)
        packed = [small_gemm.PackedWeight(w) for w in weights]
        for rows in rows_list:
            x = torch.randn(rows, in_f)
            ours, theirs = [], []
            for _ in range(args.repeats + 1):  # the first repetition warms up
                theirs.append(time_calls(torch.mm, [(x, w) for w in transposed]))
                ours.append(time_calls(lambda p: p(x), [(p,) for p in packed]))
            mt, mo = statistics.median(theirs[1:]), statistics.median(ours[1:])
            st, so = max(theirs[1:]) - min(theirs[1:]), max(ours[1:]) - min(ours[1:])
            totals[rows][0] += mt * count / 1000
            totals[rows][1] += mo * count / 1000
            print(f"{name:9}{rows:5}{mt:10.0f} ({st:4.0f}){mo:10.0f} ({so:4.0f}){mt / mo:8.2f}")
    print("\nwhole target, ms of matmuls per forward:")
    for rows, (t, o) in totals.items():
        print(f"  {rows:3} rows: torch {t:6.2f}  kernel {o:6.2f}  torch/kernel {t / o:5.2f}")


if __name__ == "__main__":
    main()
