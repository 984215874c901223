"""KV memory: at one fixed KV budget, how many sequences of a mixed workload run at once with paged
blocks (our engine) vs contiguous max-length reservation (every sequence reserves max_model_len slots).

    python scripts/bench_kv_memory.py [--budget-mb 128] [--num-requests 256] [--with-model] [--model DIR]

The paged side is the real LLMEngine (scheduler, KV cache manager, preemption) driven by the workload.
By default the model forward is replaced by a strategy that emits a fixed token: with EOS ignored,
block accounting depends only on lengths, never on token values, so the count is the same and the run
takes seconds. --with-model runs the real forward (slow on CPU).
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from bench_throughput import find_target, make_workload
import draftsmith  # noqa: E402,F401  (before torch: OpenMP's wait policy, draftsmith/__init__)
import torch  # noqa: E402
from draftsmith.serve_eval.engine import DefaultStrategy, EngineConfig, LLMEngine, SamplingParams, StepResult


class LengthOnlyStrategy(DefaultStrategy):
    """Skips the forward: every sequence that reaches its last token emits token 3."""

    def execute(self, engine, out):
        new = [[3] if s.num_computed_tokens + n == s.num_tokens else []
               for s, n in zip(out.seqs, out.num_scheduled_tokens)]
        return StepResult(new, [0] * len(out.seqs))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model")
    ap.add_argument("--budget-mb", type=float, default=128.0)
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--min-prompt", type=int, default=16)
    ap.add_argument("--max-prompt", type=int, default=512)
    ap.add_argument("--min-output", type=int, default=16)
    ap.add_argument("--max-output", type=int, default=256)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--with-model", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, origin = find_target(args.model, Path(tmp))
        config = EngineConfig(model=str(model_dir), kv_cache_memory_gb=args.budget_mb / 1024,
                              block_size=args.block_size, max_num_seqs=args.num_requests,
                              max_num_batched_tokens=8192, num_cpu_blocks=0, enable_prefix_caching=False)
        engine = LLMEngine(config, strategy=None if args.with_model else LengthOnlyStrategy())
    bytes_per_block = engine.executor.kv_bytes_per_block(args.block_size)
    budget = int(args.budget_mb * 1024**2)
    max_len = engine.max_model_len
    prompts, outputs = make_workload(args.num_requests, (args.min_prompt, args.max_prompt),
                                     (args.min_output, args.max_output), engine.executor.vocab_size, args.seed)
    for i, (p, n) in enumerate(zip(prompts, outputs)):
        engine.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    running_while_queued, peak = [], 0
    while engine.has_unfinished_requests():
        engine.step()
        engine.kv.check_integrity() if engine.num_steps % 50 == 0 else None
        num_running = len(engine.scheduler.running)
        peak = max(peak, num_running)
        if engine.scheduler.waiting:   # steady state: memory, not the request supply, is the limit
            running_while_queued.append(num_running)
    stats = engine.stats()
    contiguous = budget // (max_len * bytes_per_block // args.block_size)
    paged_mean = statistics.mean(running_while_queued) if running_while_queued else float(peak)
    print(f"model: {origin}  ({'real forward' if args.with_model else 'forward skipped, lengths only'})")
    print(f"budget {args.budget_mb:.0f} MiB = {engine.kv.num_gpu_blocks} blocks of {args.block_size} tokens "
          f"({bytes_per_block} B each); max_model_len {max_len}")
    print(f"workload: {args.num_requests} requests, prompt {args.min_prompt}-{args.max_prompt}, "
          f"output {args.min_output}-{args.max_output}, seed {args.seed}")
    print(f"{'contiguous max-length reservation':40s} sequences at once: {contiguous}")
    print(f"{'paged (ours), mean while requests queue':40s} sequences at once: {paged_mean:.1f}  (peak {peak})")
    print(f"ratio paged / contiguous: {paged_mean / max(contiguous, 1):.2f}x mean, "
          f"{peak / max(contiguous, 1):.2f}x peak  (goal >= 6x)")
    print(f"engine: {stats.num_steps} steps, {stats.num_preemptions} preemptions, "
          f"all blocks returned: {stats.kv_blocks_used == 0}")


if __name__ == "__main__":
    main()
