"""Batch-1 decode step of the embedded target vs its memory roofline (weight bytes / measured read bandwidth).

Runs, in one process and interleaved step by step (so both see the same machine load):
  (a) transformers' forward with its DynamicCache, (b) our ModelExecutor over the paged cache,
  and optionally (c) our executor with torch.compile'd decode layers (--compile).

    python scripts/bench_roofline.py [--model DIR] [--context 128] [--steps 60] [--threads N] [--compile]

Without --model it uses the newest trained target under artifacts/target-cache/, else a random Llama of
the embedded target's shape (hidden 256, 8 layers, 4 heads, 2 KV heads, intermediate 704, vocab 4096).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from kernels.attention import AttentionMetadata
from serve_eval.engine.model_executor import ModelExecutor

EMBEDDED_SHAPE = dict(vocab_size=4096, hidden_size=256, intermediate_size=704, num_hidden_layers=8,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048)


def read_bandwidth(num_bytes: int, clock=time.perf_counter, repeats: int = 5) -> float:
    """Best-of-N bytes/s of summing a float32 tensor of num_bytes (one streaming read)."""
    data = torch.ones(num_bytes // 4, dtype=torch.float32)
    data.sum()
    best = float("inf")
    for _ in range(repeats):
        start = clock()
        data.sum()
        best = min(best, clock() - start)
    return num_bytes / best


def find_model(arg: str | None, workdir: Path) -> tuple[Path, str]:
    if arg:
        return Path(arg), "given"
    trained = sorted(Path("artifacts/target-cache").glob("*/config.json"), key=lambda p: p.stat().st_mtime)
    if trained:
        return trained[-1].parent, "trained target (artifacts)"
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**EMBEDDED_SHAPE)).to(torch.bfloat16).save_pretrained(workdir)
    return workdir, "random weights, embedded-target shape"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="HF checkpoint dir (default: trained target or random embedded shape)")
    parser.add_argument("--context", type=int, default=128, help="tokens already in the cache before timing")
    parser.add_argument("--steps", type=int, default=60, help="timed decode steps per variant")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--compile", action="store_true", help="also time the executor with torch.compile")
    parser.add_argument("--bandwidth-mb", type=int, default=1024, help="size of the bandwidth probe tensor")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM, DynamicCache

    with tempfile.TemporaryDirectory() as tmp:
        model_dir, origin = find_model(args.model, Path(tmp))
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
        variants = {"ours": ModelExecutor(model_dir, dtype=torch.bfloat16)}
        if args.compile:
            variants["ours+compile"] = ModelExecutor(model_dir, dtype=torch.bfloat16, compile=True)

    block_size = 16
    total = args.context + args.steps + 16
    table = list(range(-(-total // block_size)))
    prompt = torch.randint(0, hf.config.vocab_size, (args.context,), generator=torch.Generator().manual_seed(0))
    for executor in variants.values():
        executor.allocate_kv_cache(len(table), block_size)
        executor.forward(prompt, torch.arange(args.context),
                         AttentionMetadata.build([args.context], [args.context], [table], block_size))
    with torch.inference_mode():
        cache = DynamicCache(config=hf.config)
        hf(prompt[None], cache=cache, use_cache=True)

    def hf_step(token: int) -> torch.Tensor:
        return hf(torch.tensor([[token]]), cache=cache, use_cache=True).logits[0, -1]

    def our_step(executor: ModelExecutor, length: int, token: int) -> torch.Tensor:
        # Metadata construction is inside the timed region: it is part of what a decode step costs us.
        meta = AttentionMetadata.build([1], [length], [table], block_size)
        return executor.forward(torch.tensor([token]), torch.tensor([length - 1]), meta).logits[0]

    # Wall time, and process CPU time: on a shared, oversubscribed machine the CPU time of a single-threaded
    # run is what the step would take on an idle core (wall time then also counts waiting for a core).
    times: dict[str, list[float]] = {"transformers": [], **{name: [] for name in variants}}
    cpu_times: dict[str, list[float]] = {name: [] for name in times}
    max_diff: dict[str, float] = {}
    warmup = 5
    with torch.inference_mode():
        for step in range(warmup + args.steps):
            length = args.context + step + 1
            token = step % hf.config.vocab_size
            start, cpu_start = time.perf_counter(), time.process_time()
            reference = hf_step(token)
            elapsed = {"transformers": (time.perf_counter() - start, time.process_time() - cpu_start)}
            for name, executor in variants.items():
                start, cpu_start = time.perf_counter(), time.process_time()
                logits = our_step(executor, length, token)
                elapsed[name] = (time.perf_counter() - start, time.process_time() - cpu_start)
                # Same tokens, same weights: bf16 logits agree up to rounding (a sanity check, not a test).
                max_diff[name] = max(max_diff.get(name, 0.0), (logits - reference.float()).abs().max().item())
            if step >= warmup:
                for name, (wall, cpu) in elapsed.items():
                    times[name].append(wall)
                    cpu_times[name].append(cpu)

    bandwidth = read_bandwidth(args.bandwidth_mb << 20)
    cpu_bandwidth = read_bandwidth(args.bandwidth_mb << 20, clock=time.process_time)
    weights = variants["ours"].weight_bytes()
    kv_read = variants["ours"].kv_bytes_per_block(1) * args.context
    resident = read_bandwidth(max(weights, 1 << 20), repeats=20)
    roofline = weights / bandwidth
    cpu_roofline = weights / cpu_bandwidth
    load = os.getloadavg()[0]
    print(f"model: {model_dir} ({origin}); bf16; batch 1; context {args.context}; threads {torch.get_num_threads()}")
    print(f"weight bytes read per step: {weights / 1e6:.2f} MB (KV read per step ~{kv_read / 1e6:.2f} MB, not counted)")
    print(f"measured read bandwidth ({args.bandwidth_mb} MB probe): {bandwidth / 1e9:.2f} GB/s")
    print(f"  (same probe at weight size, cache-resident: {resident / 1e9:.2f} GB/s)")
    print(f"roofline step time: {roofline * 1e3:.3f} ms wall")
    print(f"CPU-time view: read bandwidth {cpu_bandwidth / 1e9:.2f} GB/s per CPU-second, "
          f"roofline {cpu_roofline * 1e3:.3f} ms")
    print(f"1-min load average {load:.1f} on {os.cpu_count()} CPUs"
          + ("  <- machine is shared and busy: wall figures include waiting for a core" if load > 1.5 else ""))
    header = f"{'variant':<16}{'wall ms':>10}{'p10':>9}{'% roofline':>12}{'cpu ms':>10}{'% cpu roofline':>16}"
    print(header + f"{'max |dlogit| vs HF':>20}")
    for name, samples in times.items():
        wall, cpu = statistics.median(samples), statistics.median(cpu_times[name])
        p10 = sorted(samples)[len(samples) // 10]
        diff = f"{max_diff[name]:.4f}" if name in max_diff else "-"
        print(f"{name:<16}{wall * 1e3:>10.3f}{p10 * 1e3:>9.3f}{100 * roofline / wall:>11.1f}%"
              f"{cpu * 1e3:>10.3f}{100 * cpu_roofline / cpu:>15.1f}%{diff:>20}")


if __name__ == "__main__":
    main()
