"""Batch-1 decode step of the embedded target vs its memory roofline (weight bytes / measured read bandwidth).

Runs, in one process and interleaved step by step (so both see the same machine load):
  (a) transformers' forward with its DynamicCache, (b) our ModelExecutor over the paged cache,
  and optionally (c) our executor with torch.compile'd decode layers (--compile).

With --pauses it then times our decode steps right after a pause in decoding (none, 10 ms of Python, a
128 MB read, a 64-token prefill), each kind interleaved over --pause-repeats rounds: the median ms of each of
the first --pause-steps steps after it. On a VM whose last-level cache is shared with other tenants, a step
reads much of its weights from that cache; while decoding pauses the neighbours evict them, so the next steps
run slower until the weights are back. A speculative round's target forward always follows the draft's
proposal, and a request's first steps follow its prefill, so there measured speed-ups trail the ones predicted
from steady-state step costs.

    python scripts/bench_roofline.py [--model DIR] [--context 128] [--steps 60] [--threads auto|N] [--compile] [--pauses]

Without --model it uses the newest trained target under artifacts/target-cache/, else a random Llama of
the embedded target's shape (conf/target/embedded.yaml).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import draftsmith  # noqa: E402,F401  (before torch: OpenMP's wait policy, draftsmith/__init__)
import torch  # noqa: E402
from draftsmith.kernels.attention import AttentionMetadata
from draftsmith.serve_eval.engine.config import EngineConfig
from draftsmith.serve_eval.engine.model_executor import ModelExecutor, dtype_name, resolve_dtype
from draftsmith.serve_eval.engine.threads import (AUTO, apply_threads, available_cores, choose_threads,
                                                  estimate_num_params, set_threads)


def read_bandwidth(num_bytes: int, clock=time.perf_counter, repeats: int = 5) -> float:
    """Best-of-N bytes/s of summing a float32 tensor of num_bytes (one streaming read) on every core: the machine's
    bandwidth, whatever count the timed step runs with (one core alone reads about half of it here)."""
    data = torch.ones(num_bytes // 4, dtype=torch.float32)
    before = torch.get_num_threads()
    set_threads(available_cores())
    try:
        data.sum()
        best = float("inf")
        for _ in range(repeats):
            start = clock()
            data.sum()
            best = min(best, clock() - start)
    finally:
        set_threads(before)
    return num_bytes / best


def find_model(arg: str | None, workdir: Path) -> tuple[Path, str]:
    if arg:
        return Path(arg), "given"
    trained = sorted(Path("artifacts/target-cache").glob("*/config.json"), key=lambda p: p.stat().st_mtime)
    if trained:
        return trained[-1].parent, "trained target (artifacts)"
    from transformers import LlamaForCausalLM

    from draftsmith.train.config import TargetConfig
    from draftsmith.train.target import llama_config

    torch.manual_seed(0)
    LlamaForCausalLM(llama_config(TargetConfig())).to(torch.bfloat16).save_pretrained(workdir)
    return workdir, "random weights, embedded-target shape"


BLOCK_SIZE = 16
WARMUP_STEPS = 5


@dataclass
class Timings:
    """Per variant: wall and process-CPU seconds of each timed step, and max |logit diff| against transformers."""

    wall: dict[str, list[float]]
    cpu: dict[str, list[float]]
    max_diff: dict[str, float]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="HF checkpoint dir (default: trained target or random embedded shape)")
    parser.add_argument("--context", type=int, default=128, help="tokens already in the cache before timing")
    parser.add_argument("--steps", type=int, default=60, help="timed decode steps per variant")
    parser.add_argument("--threads", default="auto",
                        help="intra-op threads: 'auto' (the default) is the engine's own choice (serve_eval.engine.threads: "
                             "for the embedded target one torch thread, the native C kernels split over every core); "
                             "a count N sets torch and the native kernels to N")
    parser.add_argument("--compile", action="store_true", help="also time the executor with torch.compile")
    # The engine's own default (EngineConfig.dtype): its batch-1 CPU step runs the fp32 C kernels.
    parser.add_argument("--dtype", default=EngineConfig.dtype,
                        help="float32 (the engine's default), bfloat16, or auto: the engine's rule (fp32 where the native "
                             "CPU kernels run, else bf16 where faster)")
    parser.add_argument("--bandwidth-mb", type=int, default=1024, help="size of the bandwidth probe tensor")
    parser.add_argument("--pauses", action="store_true", help="also time decode steps right after pauses in decoding")
    parser.add_argument("--pause-steps", type=int, default=8, help="timed decode steps after each pause")
    parser.add_argument("--pause-repeats", type=int, default=15, help="interleaved rounds of every pause kind")
    args = parser.parse_args()
    if args.threads != AUTO:
        try:
            args.threads = int(args.threads)
        except ValueError:
            args.threads = 0
        if args.threads < 1:
            parser.error(f"--threads: a positive count or {AUTO!r}")
    if args.pause_steps < 1 or args.pause_repeats < 1:
        parser.error("--pause-steps and --pause-repeats must be >= 1")
    return args


def load_variants(args: argparse.Namespace) -> tuple[Path, str, Any, dict[str, ModelExecutor]]:
    """(model dir, where it came from, transformers' model, our executors by variant name)."""
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        model_dir, origin = find_model(args.model, Path(tmp))
        dtype = resolve_dtype(args.dtype)
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
        variants = {"ours": ModelExecutor(model_dir, dtype=dtype)}
        if args.compile:
            variants["ours+compile"] = ModelExecutor(model_dir, dtype=dtype, compile=True)
    return model_dir, origin, hf, variants


def prefill(hf: Any, variants: dict[str, ModelExecutor], context: int, table: list[int], num_blocks: int) -> Any:
    """The same random prompt into every executor's paged cache and transformers' DynamicCache (returned)."""
    from transformers import DynamicCache

    prompt = torch.randint(0, hf.config.vocab_size, (context,), generator=torch.Generator().manual_seed(0))
    for executor in variants.values():
        executor.allocate_kv_cache(num_blocks, BLOCK_SIZE)
        executor.forward(prompt, torch.arange(context), AttentionMetadata.build([context], [context], [table], BLOCK_SIZE))
    with torch.inference_mode():
        cache = DynamicCache(config=hf.config)
        hf(prompt[None], cache=cache, use_cache=True)
    return cache


def our_step(executor: ModelExecutor, length: int, token: int, table: list[int]) -> torch.Tensor:
    """One decode step of `token` at position length - 1: its logits."""
    # Metadata construction is inside the timed region: it is part of what a decode step costs us.
    meta = AttentionMetadata.build([1], [length], [table], BLOCK_SIZE)
    return executor.forward(torch.tensor([token]), torch.tensor([length - 1]), meta).logits[0]


def time_steps(hf: Any, cache: Any, variants: dict[str, ModelExecutor], args: argparse.Namespace,
               table: list[int]) -> Timings:
    """Decode steps interleaved variant by variant, so every variant sees the same machine load."""
    # Wall time, and process CPU time: on a shared, oversubscribed machine the CPU time of a single-threaded
    # run is what the step would take on an idle core (wall time then also counts waiting for a core). With the
    # native kernels split over the cores (--threads auto) the CPU time counts every core's share, and their
    # helpers' spin of up to 0.5 ms after a call, so compare the CPU view only at --threads 1.
    names = ["transformers", *variants]
    timings = Timings({name: [] for name in names}, {name: [] for name in names}, {})
    with torch.inference_mode():
        for step in range(WARMUP_STEPS + args.steps):
            length = args.context + step + 1
            token = step % hf.config.vocab_size
            start, cpu_start = time.perf_counter(), time.process_time()
            reference = hf(torch.tensor([[token]]), cache=cache, use_cache=True).logits[0, -1]
            elapsed = {"transformers": (time.perf_counter() - start, time.process_time() - cpu_start)}
            for name, executor in variants.items():
                start, cpu_start = time.perf_counter(), time.process_time()
                logits = our_step(executor, length, token, table)
                elapsed[name] = (time.perf_counter() - start, time.process_time() - cpu_start)
                # Same tokens, same weights: the logits agree up to rounding (a sanity check, not a test).
                diff = (logits - reference.float()).abs().max().item()
                timings.max_diff[name] = max(timings.max_diff.get(name, 0.0), diff)
            if step >= WARMUP_STEPS:
                for name, (wall, cpu) in elapsed.items():
                    timings.wall[name].append(wall)
                    timings.cpu[name].append(cpu)
    return timings


def print_roofline(args: argparse.Namespace, model_dir: Path, origin: str, ours: ModelExecutor,
                   timings: Timings) -> None:
    bandwidth = read_bandwidth(args.bandwidth_mb << 20)
    cpu_bandwidth = read_bandwidth(args.bandwidth_mb << 20, clock=time.process_time)
    weights = ours.weight_bytes()
    kv_read = ours.kv_bytes_per_block(1) * args.context
    resident = read_bandwidth(max(weights, 1 << 20), repeats=20)
    roofline = weights / bandwidth
    cpu_roofline = weights / cpu_bandwidth
    load = os.getloadavg()[0]
    print(f"model: {model_dir} ({origin}); {dtype_name(args.dtype)}; batch 1; context {args.context}; "
          f"threads {args.thread_choice.summary()}")
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
    for name, samples in timings.wall.items():
        wall, cpu = statistics.median(samples), statistics.median(timings.cpu[name])
        p10 = sorted(samples)[len(samples) // 10]
        diff = f"{timings.max_diff[name]:.4f}" if name in timings.max_diff else "-"
        print(f"{name:<16}{wall * 1e3:>10.3f}{p10 * 1e3:>9.3f}{100 * roofline / wall:>11.1f}%"
              f"{cpu * 1e3:>10.3f}{100 * cpu_roofline / cpu:>15.1f}%{diff:>20}")


PAUSE_PREFILL_TOKENS = 64


def time_after_pauses(executor: ModelExecutor, args: argparse.Namespace, table: list[int],
                      pause_table: list[int]) -> dict[str, list[float]]:
    """Per pause kind: the median seconds of each of the --pause-steps decode steps after it (kinds interleaved,
    a few unmeasured steps before each pause so every kind starts from steady decoding)."""
    length = args.context + 1
    junk = torch.ones(128 << 18)  # 128 MB of fp32
    prompt = torch.randint(0, executor.vocab_size, (PAUSE_PREFILL_TOKENS,), generator=torch.Generator().manual_seed(1))

    def step() -> float:
        start = time.perf_counter()
        our_step(executor, length, 7, table)
        return time.perf_counter() - start

    def busy_python() -> None:
        end = time.perf_counter() + 0.010
        while time.perf_counter() < end:
            sum(range(100))

    pauses = {"none": lambda: None, "python 10 ms": busy_python, "read 128 MB": lambda: junk.sum(),
              f"prefill {PAUSE_PREFILL_TOKENS} tokens": lambda: executor.forward(
                  prompt, torch.arange(PAUSE_PREFILL_TOKENS),
                  AttentionMetadata.build([PAUSE_PREFILL_TOKENS], [PAUSE_PREFILL_TOKENS], [pause_table], BLOCK_SIZE))}
    samples: dict[str, list[list[float]]] = {name: [] for name in pauses}
    with torch.inference_mode():
        for _ in range(args.pause_repeats):
            for name, pause in pauses.items():
                for _ in range(4):
                    step()
                pause()
                samples[name].append([step() for _ in range(args.pause_steps)])
    return {name: [statistics.median(run[i] for run in runs) for i in range(args.pause_steps)]
            for name, runs in samples.items()}


def print_pauses(after: dict[str, list[float]]) -> None:
    steady = statistics.median(after["none"])
    print(f"decode steps right after a pause in decoding (median ms of step 1..{len(after['none'])} after it; "
          f"x = step 1 / steady {steady * 1e3:.3f} ms)")
    for name, times in after.items():
        print(f"  {name:<20}" + " ".join(f"{t * 1e3:6.2f}" for t in times) + f"   x{times[0] / steady:.2f}")


def main() -> None:
    args = parse_args()
    model_dir, origin, hf, variants = load_variants(args)
    total = args.context + args.steps + 16
    table = list(range(-(-total // BLOCK_SIZE)))
    pause_table = list(range(len(table), len(table) + -(-PAUSE_PREFILL_TOKENS // BLOCK_SIZE)))
    cache = prefill(hf, variants, args.context, table, len(table) + len(pause_table))
    # the count the engine itself runs this model with (read once the cache exists, as the engine does); a configured
    # count applies to torch and the C kernels alike
    args.thread_choice = choose_threads(args.threads, estimate_num_params(hf.config), "cpu",
                                        native_rows=variants["ours"].native_rows)
    apply_threads(args.thread_choice)
    timings = time_steps(hf, cache, variants, args, table)
    print_roofline(args, model_dir, origin, variants["ours"], timings)
    if args.pauses:
        print_pauses(time_after_pauses(variants["ours"], args, table, pause_table))


if __name__ == "__main__":
    main()
