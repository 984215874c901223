"""Scheduler overhead: time per engine step spent outside the model forward, as a fraction of the step,
with N sequences decoding (default 32).

    python scripts/bench_sched_overhead.py [--num-seqs 32] [--prompt 128] [--steps 60] [--model DIR]

All N requests are prefilled first; then every step is a pure decode step of N sequences, and we time
step() as a whole and executor.forward inside it. The remainder (schedule, batch build, sampling,
token bookkeeping, stop checks) is the overhead; its parts are timed too.

--profile-steps N then runs N more steps under torch.profiler and prints what does not depend on the machine's
load: torch ops and Python calls per step, inside and outside the forward, and the self-CPU-time share outside it.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import tempfile
import time
from pathlib import Path


from bench_throughput import find_target, make_workload
from draftsmith.serve_eval.engine import EngineConfig, LLMEngine, SamplingParams


def timed(totals: dict, name: str, fn):
    def wrapper(*a, **kw):
        start = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            totals[name] = totals.get(name, 0.0) + time.perf_counter() - start
    return wrapper


def profile_steps(engine: LLMEngine, steps: int) -> None:
    """Op and call counts per step, split at executor.forward (load-independent; self times are not, shares less so)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    forward = engine.executor.forward

    def marked_forward(*args, **kwargs):
        with record_function("executor.forward"):
            return forward(*args, **kwargs)

    engine.executor.forward = marked_forward
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.step()
    calls = cProfile.Profile()
    calls.runcall(lambda: [engine.step() for _ in range(steps)])
    engine.executor.forward = forward
    counts = {True: 0, False: 0}
    self_us = {True: 0.0, False: 0.0}
    outside_ops: dict[str, float] = {}
    for event in prof.events():
        if event.name == "executor.forward":
            continue
        parent = event.cpu_parent
        while parent is not None and parent.name != "executor.forward":
            parent = parent.cpu_parent
        inside = parent is not None
        counts[inside] += 1
        self_us[inside] += event.self_cpu_time_total
        if not inside:
            outside_ops[event.name] = outside_ops.get(event.name, 0.0) + event.self_cpu_time_total
    num_calls = sum(v[1] for v in pstats.Stats(calls).stats.values())
    total = self_us[True] + self_us[False]
    print(f"profile over {steps} steps: torch ops/step {counts[True] / steps:.0f} in forward, "
          f"{counts[False] / steps:.0f} outside; Python calls/step {num_calls / steps:.0f}; "
          f"torch self-CPU outside forward {self_us[False] / total:.2%}")
    top = sorted(outside_ops.items(), key=lambda kv: -kv[1])[:6]
    print("  top ops outside forward: " + ", ".join(f"{name} {us / total:.2%}" for name, us in top))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model")
    ap.add_argument("--num-seqs", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", default="1", help="engine intra-op threads: a count or 'auto' (the engine's rule)")
    ap.add_argument("--sampling", choices=["greedy", "mixed"], default="mixed",
                    help="mixed: half the requests sample with top-k 50 / top-p 0.9 and a seed")
    ap.add_argument("--profile-steps", type=int, default=0, help="then profile this many steps (op / call counts)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, origin = find_target(args.model, Path(tmp))
        engine = LLMEngine(EngineConfig(model=str(model_dir), dtype=args.dtype, kv_cache_memory_gb=0.25,
                                        num_threads=args.threads if args.threads == "auto" else int(args.threads),
                                        max_num_seqs=args.num_seqs, max_num_batched_tokens=4096))
    prompts, _ = make_workload(args.num_seqs, (args.prompt, args.prompt), (1, 1), engine.executor.vocab_size)
    max_tokens = args.steps + 2 * args.profile_steps + 8   # the requests outlast the timed and profiled steps
    # Mixed sampling settings: half greedy, half top-k/top-p with a seed (the slower sampling path).
    for i, p in enumerate(prompts):
        greedy = args.sampling == "greedy" or i % 2 == 0
        params = (SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True) if greedy else
                  SamplingParams(temperature=0.8, top_k=50, top_p=0.9, seed=i, max_tokens=max_tokens,
                                 ignore_eos=True))
        engine.add_request(str(i), p, params)
    while any(s.is_prefill or not s.output_token_ids for s in engine.requests.values()):
        engine.step()

    parts: dict[str, float] = {}
    engine.scheduler.schedule = timed(parts, "schedule", engine.scheduler.schedule)
    engine.prepare_batch = timed(parts, "build batch + metadata", engine.prepare_batch)
    engine.sample = timed(parts, "sample", engine.sample)
    engine._update = timed(parts, "update + stop checks", engine._update)
    fractions, step_times = [], []
    for _ in range(args.steps):
        f0, s0 = engine.forward_time_s, engine.step_time_s
        engine.step()
        assert len(engine.scheduler.running) == args.num_seqs
        step, fwd = engine.step_time_s - s0, engine.forward_time_s - f0
        step_times.append(step)
        fractions.append((step - fwd) / step)
    total = sum(step_times)
    print(f"model: {origin}, {args.dtype}, threads {engine.threads.describe()} ({engine.threads.reason})")
    print(f"{args.num_seqs} sequences decoding (prompt {args.prompt}), {args.sampling} sampling, {args.steps} steps, "
          f"median step {statistics.median(step_times) * 1e3:.2f} ms")
    for name, t in parts.items():
        print(f"  {name:24s}{t / args.steps * 1e3:8.3f} ms/step  ({t / total:6.2%} of step time)")
    print(f"overhead outside forward: median {statistics.median(fractions):.2%}, "
          f"mean {statistics.mean(fractions):.2%} of step time  (goal < 10%)")
    if args.profile_steps:
        profile_steps(engine, args.profile_steps)


if __name__ == "__main__":
    main()
