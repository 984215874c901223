"""Prefix caching: N requests sharing one system prompt; KV blocks held with vs without caching.

    python scripts/bench_prefix_cache.py [--num-requests 100] [--system-tokens 512] [--no-model] [--model DIR]

Request 0 arrives first; once it has produced a token (its prompt blocks are cached) the other N-1
arrive together. We record, while they run, the peak of blocks in use, and how many distinct physical
blocks back the system prompt's logical blocks across all running tables (caching: once; without: N times).
"""
from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

from bench_kv_memory import LengthOnlyStrategy
from bench_throughput import find_target
import draftsmith  # noqa: E402,F401  (before torch: OpenMP's wait policy, draftsmith/__init__)
import torch  # noqa: E402
from draftsmith.serve_eval.engine import EngineConfig, LLMEngine, SamplingParams


def run(model_dir: Path, caching: bool, prompts: list[list[int]], system_blocks: int, args) -> dict:
    config = EngineConfig(model=str(model_dir), kv_cache_memory_gb=args.budget_mb / 1024, block_size=16,
                          max_num_seqs=len(prompts), max_num_batched_tokens=4096, prefill_chunk_size=1024,
                          enable_prefix_caching=caching, num_cpu_blocks=0)
    engine = LLMEngine(config, strategy=LengthOnlyStrategy() if args.no_model else None)
    params = SamplingParams(temperature=0, max_tokens=args.output_tokens, ignore_eos=True)
    start = time.perf_counter()
    engine.add_request("0", prompts[0], params)
    while not engine.requests["0"].output_token_ids:
        engine.step()
    for i, p in enumerate(prompts[1:], 1):
        engine.add_request(str(i), p, params)
    peak_used, peak_running, peak_copies = 0, 0, 0.0
    while engine.has_unfinished_requests():
        engine.step()
        peak_used = max(peak_used, engine.kv.pool.num_used_blocks)
        tables = [engine.kv.get_block_ids(s) for s in engine.scheduler.running]
        tables = [t[:system_blocks] for t in tables if len(t) >= system_blocks]
        peak_running = max(peak_running, len(tables))
        # Physical copies of the system prompt held right now (1.0 = held once).
        copies = len({b for t in tables for b in t}) / system_blocks if tables else 0.0
        peak_copies = max(peak_copies, copies)
    elapsed = time.perf_counter() - start
    stats = engine.stats()
    engine.kv.check_integrity()
    assert stats.kv_blocks_used == 0
    return dict(peak_used=peak_used, copies=peak_copies, running=peak_running, hit=stats.prefix_cache_hit_rate, time=elapsed,
                bytes=engine.executor.kv_bytes_per_block(16))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model")
    ap.add_argument("--num-requests", type=int, default=100)
    ap.add_argument("--system-tokens", type=int, default=512)
    ap.add_argument("--min-suffix", type=int, default=8)
    ap.add_argument("--max-suffix", type=int, default=64)
    ap.add_argument("--output-tokens", type=int, default=16)
    ap.add_argument("--budget-mb", type=float, default=640.0)
    ap.add_argument("--no-model", action="store_true", help="skip the forward (block counts are the same)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, origin = find_target(args.model, Path(tmp))
        from transformers import AutoConfig
        vocab = AutoConfig.from_pretrained(model_dir).vocab_size
        rng = random.Random(0)
        system = [rng.randrange(3, vocab) for _ in range(args.system_tokens)]
        prompts = [system + [rng.randrange(3, vocab) for _ in range(rng.randint(args.min_suffix, args.max_suffix))]
                   for _ in range(args.num_requests)]
        system_blocks = args.system_tokens // 16
        results = {c: run(model_dir, c, prompts, system_blocks, args) for c in (False, True)}
    print(f"model: {origin}  ({'forward skipped' if args.no_model else 'real forward'}), fp32")
    print(f"{args.num_requests} requests = {args.system_tokens}-token system prompt ({system_blocks} full blocks) "
          f"+ {args.min_suffix}-{args.max_suffix} own tokens, {args.output_tokens} output tokens each")
    print(f"{'':16s}{'peak blocks used':>17s}{'peak running':>13s}{'system prompt copies':>21s}"
          f"{'hit rate':>10s}{'time s':>9s}")
    for c, name in ((False, "no caching"), (True, "prefix caching")):
        r = results[c]
        print(f"{name:16s}{r['peak_used']:17d}{r['running']:13d}{r['copies']:21.2f}{r['hit']:10.3f}{r['time']:9.2f}")
    off, on = results[False], results[True]
    print(f"peak blocks ratio no-cache / cache: {off['peak_used'] / on['peak_used']:.2f}x "
          f"({(off['peak_used'] - on['peak_used']) * on['bytes'] / 2**20:.1f} MiB saved); "
          f"system prompt held at most {on['copies']:.2f}x with caching vs {off['copies']:.2f}x without "
          f"(goal: once)")


if __name__ == "__main__":
    main()
