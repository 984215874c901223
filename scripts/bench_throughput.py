"""Throughput: our engine (continuous batching, paged KV) vs transformers' generate with static padded
batches, same model, same dtype, same mixed-length workload, in one run.

    python scripts/bench_throughput.py [--num-requests 64] [--min-prompt 16] [--max-prompt 512]
        [--min-output 16] [--max-output 256] [--batch-size 32] [--dtype float32] [--model DIR]

Tokens/s counts only the tokens each request asked for (its max_tokens, EOS ignored) on both sides:
a static batch that keeps stepping for its longest member wastes the extra steps, which is the point.
The other bench_*.py scripts import the helpers below (find_target, make_workload).
"""
from __future__ import annotations

import argparse
import os
import random
import tempfile
import time
from pathlib import Path

import draftsmith  # noqa: F401  (before torch: OpenMP's wait policy, draftsmith/__init__)
import torch


def find_target(arg: str | None, workdir: Path) -> tuple[Path, str]:
    """The trained embedded target if artifacts/ has one, else a random Llama of its shape."""
    if arg:
        return Path(arg), f"given model {arg}"
    found = [p for p in list(Path("artifacts/target-cache").glob("*/config.json"))
             + list(Path("artifacts/targets").glob("*/config.json"))
             if (p.parent / ".complete").is_file() or p.parent.parent.name == "targets"]   # fully written only
    found.sort(key=lambda p: p.stat().st_mtime)
    if found:
        return found[-1].parent, f"trained embedded target {found[-1].parent}"
    from transformers import LlamaForCausalLM

    from draftsmith.train.config import TargetConfig
    from draftsmith.train.target import llama_config

    torch.manual_seed(0)
    LlamaForCausalLM(llama_config(TargetConfig())).save_pretrained(workdir)
    return workdir, "RANDOM weights with the embedded target's shape (no trained target under artifacts/)"


def make_workload(n: int, prompt_range: tuple[int, int], output_range: tuple[int, int], vocab: int,
                  seed: int = 0) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(*prompt_range))] for _ in range(n)]
    outputs = [rng.randint(*output_range) for _ in range(n)]
    return prompts, outputs


def run_ours(model_dir: Path, prompts, outputs, dtype: str, max_num_seqs: int, num_threads: int | str = "auto"):
    from draftsmith.serve_eval.engine import LLM, SamplingParams

    llm = LLM(model_dir, dtype=dtype, kv_cache_memory_gb=0.5, max_num_seqs=max_num_seqs,
              max_num_batched_tokens=2048, prefill_chunk_size=512, num_threads=num_threads)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in outputs]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)          # warm-up
    llm.engine.kv.pool.reset_prefix_cache()   # no head start from the warm-up's cached prompts
    steps_before = llm.engine.num_steps
    start, cpu_start = time.perf_counter(), time.process_time()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    tokens = sum(len(o.output_token_ids) for o in outs)
    assert tokens == sum(outputs)
    stats = llm.engine.stats()
    stats.num_steps -= steps_before
    return elapsed, cpu, tokens, stats


def run_hf(model_dir: Path, prompts, outputs, dtype: str, batch_size: int):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    pad = 0

    def batch_generate(batch_prompts, max_new):
        width = max(len(p) for p in batch_prompts)   # left padding for decoder-only generate
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch_prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch_prompts])
        with torch.inference_mode():
            return model.generate(ids, attention_mask=mask, max_new_tokens=max_new, min_new_tokens=max_new,
                                  do_sample=False, eos_token_id=None, pad_token_id=pad)

    batch_generate(prompts[:2], 4)   # warm-up
    start, cpu_start = time.perf_counter(), time.process_time()
    for i in range(0, len(prompts), batch_size):
        batch_generate(prompts[i:i + batch_size], max(outputs[i:i + batch_size]))
    return time.perf_counter() - start, time.process_time() - cpu_start, sum(outputs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--min-prompt", type=int, default=16)
    ap.add_argument("--max-prompt", type=int, default=512)
    ap.add_argument("--min-output", type=int, default=16)
    ap.add_argument("--max-output", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=32,
                    help="static batch size for transformers = max_num_seqs for our engine")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (1 by default: on a shared 2-core box spinning OpenMP threads "
                         "oversubscribe and make both sides' timings noise)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, origin = find_target(args.model, Path(tmp))
        from transformers import AutoConfig
        vocab = AutoConfig.from_pretrained(model_dir).vocab_size
        prompts, outputs = make_workload(args.num_requests, (args.min_prompt, args.max_prompt),
                                         (args.min_output, args.max_output), vocab, args.seed)
        print(f"model: {origin}")
        print(f"workload: {len(prompts)} requests, prompt {args.min_prompt}-{args.max_prompt} "
              f"(total {sum(map(len, prompts))}), output {args.min_output}-{args.max_output} "
              f"(total {sum(outputs)}), seed {args.seed}, dtype {args.dtype}, threads {torch.get_num_threads()}, "
              f"load average {os.getloadavg()[0]:.1f}")
        t_ours, c_ours, tok_ours, stats = run_ours(model_dir, prompts, outputs, args.dtype, args.batch_size,
                                                   args.threads)
        t_hf, c_hf, tok_hf = run_hf(model_dir, prompts, outputs, args.dtype, args.batch_size)
    # CPU time of this process is reported beside wall time: on a shared machine the wall clock also
    # measures the neighbours' load, which differs between the two (sequential) runs.
    print(f"{'':34s}{'wall s':>9s}{'cpu s':>9s}{'tokens':>8s}{'tok/wall-s':>12s}{'tok/cpu-s':>11s}")
    for name, t, c, tok in (("ours (continuous, paged)", t_ours, c_ours, tok_ours),
                            (f"transformers static batch {args.batch_size}", t_hf, c_hf, tok_hf)):
        print(f"{name:34s}{t:9.2f}{c:9.2f}{tok:8d}{tok / t:12.1f}{tok / c:11.1f}")
    print(f"ratio ours / transformers: {(tok_ours / t_ours) / (tok_hf / t_hf):.2f}x by wall time, "
          f"{(tok_ours / c_ours) / (tok_hf / c_hf):.2f}x by CPU time  (goal >= 3x)")
    print(f"load average at end {os.getloadavg()[0]:.1f}")
    print(f"engine: {stats.num_steps} steps, {stats.num_preemptions} preemptions, "
          f"prefix-cache hit rate {stats.prefix_cache_hit_rate:.3f}, {stats.num_threads} intra-op thread(s)")


if __name__ == "__main__":
    main()
