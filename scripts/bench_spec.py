"""Speculative decoding in our engine, side by side, every cell repeated `--repeats` times interleaved.

Batch 1, T = 0 and T = 1, per domain: ms/token (decode phase, serve_eval.speculative.metrics) and speedup
over our own no-spec engine for no-spec, n-gram, standalone, Medusa, EAGLE-1, EAGLE-3, block, and
transformers' generate(assistant_model=...) with the same standalone draft (ms/token = (time of n
new tokens - time of 1) / (n - 1), so its prefill is excluded too), with the mean over domains and our
standalone path against transformers'. Answers end at the target's EOS, as the main job's eval ends them (--eos
ignore: every answer runs to --max-tokens, as the batch and trees sections always do). Then batches of `--batch-sizes` (16 and 32): speculation under
the server's default policy (fallback and the measured batch gate) vs no-spec (--plain-floor: and with the gate
pinned to plain decoding, what a plainly decoding step costs under each strategy). Then trees (issue 12, "trees that pay"): EAGLE-1's chain against its
dynamic tree sized by the cost model (eagle-tree, tree_budget="cost": it drafts chains where they measure cheaper) and EAGLE-2's fixed 16-node tree
(eagle-tree-fixed), each engine kept across `--tree-repeats` interleaved repetitions (order rotated; the cost
tree keeps calibrating), batch 1, all prompts pooled: tau and ms/token as median (spread = max - min) over
the repetitions, the speedup paired with the no-spec run of the same repetition.

Inputs: --target DIR, else the embedded target found under artifacts/ (target-cache/*/ or
targets/<fp>/target.json), else a small untrained Llama. Drafts: the newest of each kind under
artifacts/targets/<fp>/drafts/ when present, else untrained drafts built from draftsmith/drafts/*. Prompts:
the eval split of the corpus under artifacts/corpus/*/ (per domain) when present, else synthetic
token prompts (domain "synthetic"). The table says which of these it used.

  python scripts/bench_spec.py --max-tokens 64 --prompts-per-domain 2 --dtype bfloat16
  python scripts/bench_spec.py --sections trees --threads 1 --tree-repeats 5
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import draftsmith  # noqa: E402,F401  (before torch: OpenMP's wait policy, draftsmith/__init__)
import torch  # noqa: E402
from draftsmith.serve_eval.engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from draftsmith.serve_eval.engine.model_executor import ModelExecutor, dtype_name, resolve_dtype  # noqa: E402
from draftsmith.serve_eval.eval.interleave import interleave, rotation  # noqa: E402
from draftsmith.serve_eval.speculative.batch_gate import BatchGateConfig  # noqa: E402
from draftsmith.serve_eval.speculative.config import SpecConfig  # noqa: E402
from draftsmith.serve_eval.speculative.metrics import SpecStats, ms_per_token, speedup  # noqa: E402

METHODS = ("nospec", "ngram", "standalone", "medusa", "eagle", "eagle3", "block", "hf-assisted")
SECTIONS = ("batch1", "batch", "trees")
# The tree section's methods: EAGLE-1 draft, chain or tree (the same shapes as bench_spec_round.py's).
TREE_METHODS = {"eagle": {},
                "eagle-tree": {"tree": "dynamic", "tree_top_k": 4, "max_draft_nodes": 16, "tree_budget": "cost"},
                "eagle-tree-fixed": {"tree": "dynamic", "tree_top_k": 4, "max_draft_nodes": 16, "tree_budget": "fixed"}}


# -- inputs ---------------------------------------------------------------------------------
def find_target(artifacts: Path) -> Path | None:
    for meta in sorted(artifacts.glob("targets/*/target.json")):
        model_dir = json.loads(meta.read_text()).get("model_dir")
        if model_dir and (Path(model_dir) / "config.json").is_file():
            return Path(model_dir)
    found = sorted(artifacts.glob("target-cache/*/config.json"), key=lambda p: p.stat().st_mtime)
    return found[-1].parent if found else None


def untrained_target(root: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=704, num_hidden_layers=8,
                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024)
    LlamaForCausalLM(cfg).save_pretrained(root / "target")
    return root / "target"


def find_drafts(artifacts: Path, target: Path, root: Path) -> tuple[dict[str, Path], str]:
    """Trained drafts for this target when present, untrained ones for the rest."""
    from draftsmith.drafts.artifacts import Artifacts
    from draftsmith.drafts.identity import target_fingerprint
    from draftsmith.drafts.io import latest_drafts_by_kind

    fp = target_fingerprint(target)
    found = latest_drafts_by_kind(Artifacts(artifacts), fp)
    source = {k: "trained" for k in found}
    for kind in ("standalone", "medusa", "eagle", "eagle3"):
        if kind not in found:
            found[kind] = untrained_draft(kind, target, fp, root)
            source[kind] = "untrained"
    return found, ", ".join(f"{k}={v}" for k, v in sorted(source.items()))


def untrained_draft(kind: str, target: Path, fp: str, root: Path) -> Path:
    from draftsmith.kernels.layers.config import hf_config_dict
    from draftsmith.drafts.io import save_draft

    torch.manual_seed(1)
    out = root / f"draft_{kind}"
    t = hf_config_dict(target)
    if kind == "standalone":
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(vocab_size=t["vocab_size"], hidden_size=max(64, t["hidden_size"] // 4),
                          intermediate_size=max(128, t["hidden_size"] // 2), num_hidden_layers=1,
                          num_attention_heads=4, num_key_value_heads=2,
                          max_position_embeddings=t["max_position_embeddings"])
        LlamaForCausalLM(cfg).save_pretrained(out)
        return out
    from draftsmith.drafts.kinds import draft_kind

    save_draft(draft_kind(kind).module.from_target_config(target), out, kind, fp)
    return out


def load_prompts(artifacts: Path, per_domain: int, vocab: int, tokenizer) -> tuple[dict[str, list], str]:
    files = sorted(artifacts.glob("corpus/*/eval.jsonl"))
    if files and tokenizer is not None:
        by_domain: dict[str, list] = {}
        for line in files[-1].read_text().splitlines():
            rec = json.loads(line)
            bucket = by_domain.setdefault(rec.get("domain") or "default", [])
            if len(bucket) < per_domain:
                bucket.append(tokenizer.encode(rec["prompt"])[-256:])
        return by_domain, f"corpus eval split {files[-1].parent.name}"
    rng = random.Random(0)
    prompts = []
    for _ in range(per_domain):
        body = [rng.randrange(vocab) for _ in range(24)]
        prompts.append(body + body[:12])  # some repetition so prompt lookup has something to find
    return {"synthetic": prompts}, "synthetic token prompts"


# -- measurement ------------------------------------------------------------------------------
EOS_TEXT = {"honour": "answers end at EOS", "ignore": "EOS ignored (every answer runs to --max-tokens)"}
PLAIN_GATE = BatchGateConfig(mode="table", k_by_batch_size={1: 0})   # K capped at 0 at every batch size


def engine_config(args, target: Path) -> EngineConfig:
    # no prefix caching: the engines share the target executor's KV cache (target_executor)
    return EngineConfig(str(target), dtype=args.dtype, device=args.device, kv_cache_memory_gb=args.kv_gb,
                        enable_prefix_caching=False,
                        max_model_len=args.max_model_len, num_threads=args.threads)


@functools.lru_cache(maxsize=None)
def target_executor(target: str, dtype: str, device: str) -> ModelExecutor:
    """The target's weights, loaded once for every engine of the run (as the eval's engines share them): with a copy
    per engine, each interleaved turn started on weights the other copies had pushed out of the CPU's cache.
    Engines on one executor share its KV cache, so they run one at a time (each run finishes its requests)."""
    return ModelExecutor(target, dtype, device)


def engine_for(args, target: Path, method: str, drafts: dict[str, Path], fallback: bool = True,
               batch_gate: "str | BatchGateConfig" = "off", tree: dict | None = None) -> LLMEngine:
    cfg = engine_config(args, target)
    executor = target_executor(str(target), args.dtype, args.device)
    if method == "nospec":
        return LLMEngine(cfg, executor=executor)
    from draftsmith.serve_eval.speculative.policy import SpecPolicyConfig

    spec = SpecConfig(method, draft_path=None if method == "ngram" else str(drafts[method]),
                      num_speculative_tokens=args.k, policy=SpecPolicyConfig(fallback=fallback), batch_gate=batch_gate,
                      **(tree or {}))
    return LLMEngine(cfg, speculative=spec, executor=executor)


def decode_ms_per_token(engine: LLMEngine, prompts: list, params: SamplingParams, batch: int) -> float:
    """Run prompts `batch` at a time; decode wall (first token -> last token) / decode tokens."""
    wall, tokens = 0.0, 0
    for start in range(0, len(prompts), batch):
        ids = []
        for j, prompt in enumerate(prompts[start:start + batch]):
            rid = f"b{start}-{j}-{time.perf_counter_ns()}"
            engine.add_request(rid, prompt, params)
            ids.append(rid)
        outs = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    outs[out.request_id] = out
        first = min(o.metrics.first_token_time for o in outs.values())
        last = max(o.metrics.token_times[-1] for o in outs.values())
        wall += last - first
        tokens += sum(len(o.output_token_ids) - 1 for o in outs.values())
    return ms_per_token(wall, tokens)


def hf_assisted_ms_per_token(args, target: Path, draft: Path, prompts: list, temperature: float) -> float:
    from transformers import AutoModelForCausalLM

    dtype = resolve_dtype(args.dtype, args.device)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=dtype).to(args.device).eval()
    assistant = AutoModelForCausalLM.from_pretrained(draft, dtype=dtype).to(args.device).eval()
    kw = dict(assistant_model=assistant, do_sample=temperature > 0, pad_token_id=0)
    if args.eos == "ignore":   # else the target's generation config ends answers at its EOS
        kw["eos_token_id"] = None
    if temperature > 0:
        kw["temperature"] = temperature

    def timed(prompt, n):
        ids = torch.tensor([prompt], device=args.device)
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                 min_new_tokens=n if args.eos == "ignore" else 0, **kw)
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        return time.perf_counter() - t0, out.shape[1] - ids.shape[1]

    wall, tokens = 0.0, 0
    for prompt in prompts:
        t_one, _ = timed(prompt, 1)
        t_all, n = timed(prompt, args.max_tokens)
        wall += max(t_all - t_one, 0.0)
        tokens += n - 1
    return ms_per_token(wall, tokens)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=Path)
    ap.add_argument("--artifacts", type=Path, default=ROOT / "artifacts")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--dtype", default="auto", help="float32, bfloat16, or auto: the engine's rule (fp32 where the native CPU kernels run, else bf16 where faster)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompts-per-domain", type=int, default=2)
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--kv-gb", type=float, default=0.5)
    ap.add_argument("--batch-sizes", default="16,32", help="batch section: comma list of batch sizes")
    ap.add_argument("--repeats", type=int, default=3, help="batch1 and batch sections: interleaved repetitions")
    ap.add_argument("--plain-floor", action="store_true",
                    help="batch section: also each method with its gate pinned to plain decoding (<method>@plain), "
                         "the floor the gate can reach: below 1.0x, plain steps cost more under the strategy")
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--eos", choices=tuple(EOS_TEXT), default="honour",
                    help="batch1 section: answers end at the target's EOS, as the main job's eval ends them "
                         "(eval.ignore_eos: false), or run to --max-tokens (past the target's natural end, off the "
                         "drafts' training data); the batch and trees sections run to --max-tokens")
    ap.add_argument("--threads", default="auto", help="engine intra-op threads: a count or 'auto'")
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"comma list of {SECTIONS}")
    ap.add_argument("--tree-repeats", type=int, default=5, help="trees section: interleaved repetitions")
    args = ap.parse_args()
    if args.threads != "auto":
        args.threads = int(args.threads)
    return args


def resolve_inputs(args: argparse.Namespace, tmp: Path) -> tuple[Path, dict[str, Path], dict[str, list]]:
    """Target, drafts and prompts per domain (found under --artifacts, else untrained / synthetic); printed."""
    target = args.target or find_target(args.artifacts)
    target_source = "given" if args.target else ("embedded (artifacts)" if target else "untrained (no artifacts)")
    target = target or untrained_target(tmp)
    drafts, draft_source = find_drafts(args.artifacts, target, tmp)
    base = LLMEngine(engine_config(args, target), executor=target_executor(str(target), args.dtype, args.device))
    prompts, prompt_source = load_prompts(args.artifacts, args.prompts_per_domain, base.executor.vocab_size,
                                          base.tokenizer)
    threads = base.threads
    del base
    print(f"target: {target} [{target_source}]; drafts: {draft_source}; prompts: {prompt_source}; "
          f"dtype {args.dtype}, device {args.device}, K={args.k}, max_tokens={args.max_tokens}; "
          f"engine threads {threads.describe()} ({threads.reason})")
    return target, drafts, prompts


def cell_runner(args: argparse.Namespace, target: Path, method: str, drafts: dict[str, Path]):
    """(prompts, params, batch) -> decode ms/token for one method, its engine (or transformers' models)
    built once and kept across the interleaved repetitions; None when the method cannot run here."""
    try:
        if method == "hf-assisted":
            if "standalone" not in drafts:
                raise ValueError("no standalone draft to assist with")
            return lambda prompts, params, batch: hf_assisted_ms_per_token(
                args, target, drafts["standalone"], prompts, params.temperature)
        if method not in ("nospec", "ngram") and method not in drafts:
            raise ValueError(f"no {method} draft for this target")
        engine = engine_for(args, target, method, drafts, fallback=False)
        # warm-up: lazy allocations, first-call kernels
        decode_ms_per_token(engine, [[1, 2, 3, 4]], SamplingParams(temperature=0, max_tokens=4), 1)
        return lambda prompts, params, batch: decode_ms_per_token(engine, prompts, params, batch)
    except (ValueError, ImportError, KeyError) as exc:
        print(f"  {method}: skipped ({exc})")
        return None


def interleaved(cells: dict[str, Any], repeats: int, *call_args) -> dict[str, list[float]]:
    """Each cell's ms/token per repetition, interleaved and rotated (serve_eval.eval.interleave)."""
    return interleave({m: (lambda cell=cell: cell(*call_args)) for m, cell in cells.items()}, repeats)


def paired_speedups(base: list[float], mine: list[float]) -> list[float]:
    """Speed-up of each repetition against the baseline run of the same repetition."""
    return [speedup(b, m) for b, m in zip(base, mine)]


def paired_summary(base: list[float], mine: list[float]) -> tuple[float, float, float, float, float]:
    """(median ms/token, spread = max - min, median paired speed-up, its min, its max) of one cell."""
    sp = paired_speedups(base, mine)
    return statistics.median(mine), max(mine) - min(mine), statistics.median(sp), min(sp), max(sp)


def summary_text(summary: tuple[float, float, float, float, float]) -> str:
    ms, spread, sp, lo, hi = summary
    return f"{ms:7.2f} ms/token ({spread:.2f}) {sp:6.2f}x [{lo:.2f}, {hi:.2f}]"


def batch1_table(args: argparse.Namespace, target: Path, methods: list[str], drafts: dict[str, Path],
                 prompts: dict[str, list]) -> None:
    methods = ["nospec"] + [m for m in methods if m != "nospec"]
    cells = {m: c for m in methods if (c := cell_runner(args, target, m, drafts)) is not None}
    rows, by_method = [], {}
    for temperature in [float(t) for t in args.temperatures.split(",")]:
        params = SamplingParams(temperature=temperature, max_tokens=args.max_tokens, ignore_eos=args.eos == "ignore",
                                seed=0)
        for domain, domain_prompts in prompts.items():
            samples = interleaved(cells, args.repeats, domain_prompts, params, 1)
            for method, ms in samples.items():
                cell = paired_summary(samples["nospec"], ms)
                rows.append((f"T={temperature:g}", domain, method, *cell))
                by_method.setdefault((temperature, method), []).append((cell[0], cell[2]))
    print(f"\nbatch 1, {args.repeats} interleaved repetitions per cell, {EOS_TEXT[args.eos]}: median ms/token "
          "(spread = max - min), speed-up = median of the repetitions' paired ratios [min, max]")
    print(f"{'temp':<6} {'domain':<10} {'method':<12} {'ms/token':>16} {'speedup':>24}")
    for temp, domain, method, ms, spread, sp, lo, hi in rows:
        print(f"{temp:<6} {domain:<10} {method:<12} {ms:8.2f} ({spread:5.2f}) {sp:8.2f}x [{lo:.2f}, {hi:.2f}]")
    print("\nmean over domains (speed-up over our no-spec; standalone vs transformers' assisted generation)")
    for (temperature, method), cells_of in sorted(by_method.items()):
        line = f"T={temperature:g} {method:<12} {statistics.mean(sp for _, sp in cells_of):6.2f}x"
        assisted = by_method.get((temperature, "hf-assisted"))
        if method == "standalone" and assisted:
            vs = statistics.mean(a / s for (s, _), (a, _) in zip(cells_of, assisted))
            line += f"   our speed / transformers' assisted: {vs:.2f}x"
        print(line)


def batch_comparison(args: argparse.Namespace, target: Path, methods: list[str], drafts: dict[str, Path],
                     prompts: dict[str, list]) -> None:
    """Speculation under the server's default policy (fallback on, the measured batch gate) against plain
    decoding, at each --batch-sizes, engines kept across interleaved repetitions (the gate calibrates)."""
    flat = [p for ps in prompts.values() for p in ps]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    spec = [m for m in methods if m not in ("nospec", "hf-assisted") and (m == "ngram" or m in drafts)]
    for batch in [int(b) for b in args.batch_sizes.split(",") if b]:
        waves = flat * (2 * batch // max(len(flat), 1) + 1)
        batch_prompts = waves[:2 * batch]          # two full waves of `batch` requests
        engines = {"nospec": engine_for(args, target, "nospec", drafts)}
        engines.update({m: engine_for(args, target, m, drafts, fallback=True, batch_gate="measured") for m in spec})
        if args.plain_floor:   # the gate pinned to plain decoding: what a speculative engine's plain step costs
            engines.update({f"{m}@plain": engine_for(args, target, m, drafts, batch_gate=PLAIN_GATE) for m in spec})
        cells = {m: (lambda e: lambda: decode_ms_per_token(e, batch_prompts, params, batch))(e)
                 for m, e in engines.items()}
        for call in cells.values():      # warm-up: the gate's first measurements, lazy allocations
            call()
        samples = interleaved(cells, args.repeats)
        print(f"\nbatch {batch}, T=0, {len(batch_prompts)} prompts x {args.max_tokens} tokens, server default policy "
              f"(fallback + measured batch gate), {args.repeats} interleaved repetitions")
        for method, ms in samples.items():
            cell = paired_summary(samples["nospec"], ms)
            verdict = "" if method == "nospec" or "@" in method else (
                ("  meets" if cell[2] >= 1.0 else "  BELOW") + " the 1.0x goal")
            print(f"batch {batch}: {method:<17} {summary_text(cell)}{verdict}")


def tree_comparison(args: argparse.Namespace, target: Path, drafts: dict[str, Path], prompts: dict[str, list]) -> None:
    """Chain vs cost tree vs fixed tree, interleaved; printed with the goal check (tree tau >= chain tau + 0.5
    at an equal or better speedup)."""
    flat = [p for ps in prompts.values() for p in ps]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True, seed=0)
    engines = {"nospec": engine_for(args, target, "nospec", drafts)}
    engines.update({m: engine_for(args, target, "eagle", drafts, fallback=False, tree=tree)
                    for m, tree in TREE_METHODS.items()})
    warm = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for engine in engines.values():
        decode_ms_per_token(engine, flat[:1], warm, 1)
    order = list(engines)
    ms: dict[str, list[float]] = {m: [] for m in order}
    taus: dict[str, list[float]] = {m: [] for m in order if m != "nospec"}
    for rep in range(args.tree_repeats):
        for method in rotation(order, rep):
            engine = engines[method]
            # a copy: the engine keeps adding to its live counters
            before = SpecStats.merged([engine.stats().spec.total]) if method != "nospec" else None
            ms[method].append(decode_ms_per_token(engine, flat, params, batch=1))
            if before is not None:
                taus[method].append(engine.stats().spec.total.minus(before).tau)
    print(f"\ntrees: batch 1, T=0, K={args.k}, {len(flat)} prompts x {args.max_tokens} tokens, "
          f"{args.tree_repeats} interleaved repetitions: median (spread = max - min)")
    print(f"{'method':<18} {'tau':>14} {'ms/token':>16} {'speedup':>9}")
    summary = {}
    for method in order:
        paired = [speedup(base, m) for base, m in zip(ms["nospec"], ms[method])]
        tau = (statistics.median(taus[method]), max(taus[method]) - min(taus[method])) if method in taus else None
        summary[method] = (tau[0] if tau else math.nan, statistics.median(paired))
        tau_cell = f"{tau[0]:6.2f} ({tau[1]:4.2f})" if tau else f"{'-':>14}"
        print(f"{method:<18} {tau_cell:>14} {statistics.median(ms[method]):8.2f} ({max(ms[method]) - min(ms[method]):5.2f}) "
              f"{summary[method][1]:8.2f}x")
    chain_tau, chain_sp = summary["eagle"]
    for method in ("eagle-tree", "eagle-tree-fixed"):
        tau, sp = summary[method]
        met = tau >= chain_tau + 0.5 and sp >= chain_sp
        print(f"goal ({method} vs chain): tau {tau - chain_tau:+.2f} (need >= +0.50), speedup {sp:.2f}x vs "
              f"{chain_sp:.2f}x: {'met' if met else 'NOT met'}")


def main() -> None:
    args = parse_args()
    args.dtype = dtype_name(args.dtype, args.device)
    methods = [m for m in args.methods.split(",") if m]
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        raise SystemExit(f"--methods: unknown {unknown} (choose from {METHODS})")
    sections = [s for s in args.sections.split(",") if s]
    if set(sections) - set(SECTIONS):
        raise SystemExit(f"--sections: unknown {sorted(set(sections) - set(SECTIONS))} (choose from {SECTIONS})")
    target, drafts, prompts = resolve_inputs(args, Path(tempfile.mkdtemp(prefix="bench_spec_")))
    if "batch1" in sections:
        batch1_table(args, target, methods, drafts, prompts)
    if "batch" in sections:
        batch_comparison(args, target, methods, drafts, prompts)
    if "trees" in sections and args.tree_repeats:
        tree_comparison(args, target, drafts, prompts)


if __name__ == "__main__":
    main()
