"""EAGLE / EAGLE-3 proposer overhead in our engine, side by side with no-spec (one run, same machine state).

Batch 1, T = 0, one eval prompt per domain, decode-phase ms/token (first token -> last token, prefill
excluded) for: no-spec, EAGLE-1 at K=2/4, EAGLE-3 at K=2/4 (policy fallback off, so every step drafts).
Prints ms/token, the ratio to no-spec (speedup > 1 = faster), alpha, the draft share of the step time
(draft_time_s / (draft + target)), and the load average before and after. Each config runs `--repeats`
times interleaved with the others; the table keeps the median, so a noisy neighbour hurts every row alike.

  python scripts/bench_eagle_overhead.py --dtype bfloat16 --max-tokens 64 --repeats 3
  python scripts/bench_eagle_overhead.py --profile eagle3:2     # cProfile one config, top 30 by tottime
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from draftsmith.serve_eval.engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from draftsmith.serve_eval.eval import step_cost  # noqa: E402
from draftsmith.serve_eval.engine.model_executor import dtype_name  # noqa: E402
from draftsmith.serve_eval.eval.interleave import interleave  # noqa: E402
from draftsmith.serve_eval.speculative.config import SpecConfig  # noqa: E402
from draftsmith.serve_eval.speculative.metrics import ms_per_token  # noqa: E402
from draftsmith.serve_eval.speculative.policy import SpecPolicyConfig  # noqa: E402


def find_inputs(artifacts: Path, target_arg: str | None) -> tuple[Path, dict[str, Path]]:
    """The target (--target, else the first targets/<fp>/target.json with both drafts) and its newest trained
    eagle / eagle3 drafts."""
    from draftsmith.drafts.artifacts import Artifacts
    from draftsmith.drafts.identity import target_fingerprint
    from draftsmith.drafts.io import latest_drafts_by_kind

    layout = Artifacts(artifacts)
    if target_arg:
        candidates = [Path(target_arg)]
    else:
        candidates = [Path(json.loads(layout.target_meta(fp).read_text())["model_dir"])
                      for fp in layout.known_fingerprints()]
    for target in candidates:
        found = latest_drafts_by_kind(layout, target_fingerprint(target))
        drafts = {kind: path for kind, path in found.items() if kind in ("eagle", "eagle3")}
        if {"eagle", "eagle3"} <= drafts.keys():
            return target, drafts
    raise SystemExit(f"no target with trained eagle and eagle3 drafts under {artifacts} (run the pipeline first)")


def load_prompts(artifacts: Path, tokenizer) -> list[list[int]]:
    files = sorted(artifacts.glob("corpus/*/eval.jsonl"))
    if not files:
        raise SystemExit(f"no corpus eval split under {artifacts}/corpus")
    seen: dict[str, list[int]] = {}
    for line in files[-1].read_text().splitlines():
        rec = json.loads(line)
        seen.setdefault(rec.get("domain") or "default", tokenizer.encode(rec["prompt"])[-256:])
    return list(seen.values())


def build_engine(args, target: Path, drafts: dict[str, Path], name: str, executor=None) -> LLMEngine:
    cfg = EngineConfig(str(target), dtype=args.dtype, kv_cache_memory_gb=0.25, enable_prefix_caching=False)  # a shared KV
    if name == "nospec":
        return LLMEngine(cfg, executor=executor)
    method, k = name.split(":")
    spec = SpecConfig(method, draft_path=str(drafts[method]), num_speculative_tokens=int(k),
                      policy=SpecPolicyConfig(fallback=False))
    return LLMEngine(cfg, speculative=spec, executor=executor)


def run_once(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> tuple[float, list[list[int]]]:
    """Batch 1: decode ms/token over all prompts, and the generated tokens (to check spec == no-spec)."""
    wall, tokens, outputs = 0.0, 0, []
    for n, prompt in enumerate(prompts):
        rid = f"p{n}-{time.perf_counter_ns()}"
        engine.add_request(rid, prompt, params)
        final = None
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    final = out
        wall += final.metrics.token_times[-1] - final.metrics.first_token_time
        tokens += len(final.output_token_ids) - 1
        outputs.append(list(final.output_token_ids))
    return ms_per_token(wall, tokens), outputs


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--artifacts", default=str(ROOT / "artifacts"))
    ap.add_argument("--target", default=None, help="target model dir (default: found under --artifacts)")
    ap.add_argument("--dtype", default="auto", help="float32, bfloat16, or auto: the engine's rule (fp32 where the native CPU kernels run, else bf16 where faster)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--configs", default="nospec,eagle:2,eagle:4,eagle3:2,eagle3:4")
    ap.add_argument("--profile", default=None, help="cProfile one config (e.g. eagle3:2) instead of the table")
    args = ap.parse_args()
    args.dtype = dtype_name(args.dtype)
    return args


def profile_one(engine: LLMEngine, name: str, prompts: list[list[int]], params: SamplingParams) -> None:
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    ms, _ = run_once(engine, prompts, params)
    prof.disable()
    print(f"{name}: {ms:.2f} ms/token")
    pstats.Stats(prof).sort_stats("tottime").print_stats(30)


def interleaved_runs(engines: dict[str, LLMEngine], names: list[str], prompts: list[list[int]],
                     params: SamplingParams, repeats: int) -> tuple[dict[str, list[float]], dict[str, list[list[int]]]]:
    """Every config `repeats` times, interleaved and rotated: ms/token per run, and each config's last outputs."""
    runs = interleave({name: (lambda name=name: run_once(engines[name], prompts, params)) for name in names}, repeats)
    return {name: [ms for ms, _ in r] for name, r in runs.items()}, {name: r[-1][1] for name, r in runs.items()}


def print_rows(engines: dict[str, LLMEngine], names: list[str], times: dict[str, list[float]],
               outputs: dict[str, list[list[int]]]) -> None:
    base = statistics.median(times["nospec"]) if "nospec" in times else None
    print(f"{'config':10} {'ms/token':>9} {'vs nospec':>10} {'alpha':>6} {'tau':>5} {'draft share':>12} {'== nospec':>10}")
    for name in names:
        ms = statistics.median(times[name])
        ratio = f"{base / ms:9.2f}x" if base else "-"
        alpha = tau = share = "-"
        if name != "nospec":
            stats = engines[name].strategy.stats()
            alpha, tau = f"{stats.total.alpha:.2f}", f"{stats.total.tau:.2f}"
            spent = stats.draft_time_s + stats.target_time_s
            share = f"{stats.draft_time_s / spent:.0%}" if spent else "-"
        same = "-" if "nospec" not in outputs else str(outputs[name] == outputs["nospec"])
        print(f"{name:10} {ms:9.2f} {ratio:>10} {alpha:>6} {tau:>5} {share:>12} {same:>10}")


def main() -> None:
    args = parse_args()
    import torch

    torch.set_grad_enabled(False)
    artifacts = Path(args.artifacts)
    target, drafts = find_inputs(artifacts, args.target)
    names = args.configs.split(",")
    engines = step_cost.build_engines([args.profile] if args.profile else names,
                                      lambda name, ex: build_engine(args, target, drafts, name, ex))
    prompts = load_prompts(artifacts, next(iter(engines.values())).tokenizer)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    for engine in engines.values():  # warm-up: first-call allocations, kernel selection
        run_once(engine, prompts[:1], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    if args.profile:
        profile_one(engines[args.profile], args.profile, prompts, params)
        return

    load_before = os.getloadavg()
    times, outputs = interleaved_runs(engines, names, prompts, params, args.repeats)
    load_after = os.getloadavg()
    print(f"target {target.name}  dtype {args.dtype}  batch 1  T=0  {len(prompts)} prompts x {args.max_tokens} tokens"
          f"  repeats {args.repeats} (median)  torch threads {torch.get_num_threads()}")
    print_rows(engines, names, times, outputs)
    print(f"load average before {load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f}, "
          f"after {load_after[0]:.2f} {load_after[1]:.2f} {load_after[2]:.2f} (2 cores)")


if __name__ == "__main__":
    main()
