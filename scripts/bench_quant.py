#!/usr/bin/env python
"""bf16 / INT8 / INT4 variants of each draft, side by side in one run: draft step ms, c, memory, alpha / tau.

Drafts: the newest trained draft of each kind under ``--artifacts`` (drafts.io.latest_drafts_by_kind, on the
newest target that has drafts), or, when there are none, RANDOM drafts on a random target of the embedded
target's shape (the table says so: their alpha means nothing, their speed does). Each draft is quantized
here (drafts.quantize_job; into a temporary dir unless ``--keep DIR``), so the variants share one source.

Speed: one engine per variant plus plain decoding, all bf16 (the int kernels take bf16 activations), batch 1,
T = 0, every step speculating; repetitions interleaved over all variants (serve_eval.eval.step_cost), median
and spread (max - min). draft step ms = draft ms per round / K; c = draft ms per round / (K x plain step ms).
linears ms: one batch-1 pass over every serving linear of the draft, timed alone (what quantization can speed
up; the rest of a draft step is attention, norms, sampling and Python). Memory: the draft's parameters and buffers as the proposer holds them (bf16 floats, int weights).
Acceptance: greedy, K tokens, ``--prompts`` held-out prompts per domain (the corpus's eval split), alpha and
tau per domain from the engine's spec stats.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_quant.py [--artifacts artifacts] [--k 4] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import draftsmith  # noqa: E402,F401  (before torch: OpenMP's wait policy, draftsmith/__init__)
import torch  # noqa: E402
from draftsmith.drafts.artifacts import Artifacts  # noqa: E402
from draftsmith.drafts.io import latest_drafts_by_kind, load_draft  # noqa: E402
from draftsmith.drafts.quant import QuantConfig, weight_bytes  # noqa: E402
from draftsmith.drafts.quantize_job import quantize_dir  # noqa: E402
from draftsmith.kernels.quant import QuantServingLinear  # noqa: E402
from draftsmith.serve_eval.engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from draftsmith.serve_eval.eval.step_cost import PLAIN, build_engines, instrument, interleaved  # noqa: E402

KINDS = ("standalone", "medusa", "eagle", "eagle3", "block")


# ------------------------------------------------------------------------------------------------ drafts


def trained_setup(root: Path) -> tuple[Path, dict[str, Path], dict[str, list]] | None:
    """(target dir, {kind: draft dir}, {domain: prompts}) of the newest target with drafts, or None."""
    arts = Artifacts(root)
    if not arts.targets_dir.is_dir():
        return None
    for fp in reversed(arts.known_fingerprints()):
        drafts = latest_drafts_by_kind(arts, fp)
        if not drafts:
            continue
        meta = json.loads(arts.target_meta(fp).read_text())
        target = Path(meta.get("path") or meta.get("model_dir"))
        return target, drafts, eval_prompts(root)
    return None


def eval_prompts(root: Path) -> dict[str, list]:
    """Held-out prompts per domain from the newest corpus under root (the eval split)."""
    splits = sorted((root / "corpus").glob("*/eval.jsonl"), key=lambda p: p.stat().st_mtime)
    by_domain: dict[str, list] = {}
    for line in splits[-1].read_text().splitlines() if splits else []:
        record = json.loads(line)
        by_domain.setdefault(record["domain"], []).append(record["prompt"])
    return by_domain


def random_setup(tmp: Path) -> tuple[Path, dict[str, Path], dict[str, list]]:
    """A random target of the embedded shape and one random (untrained) draft of each kind."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from draftsmith.drafts.identity import target_fingerprint
    from draftsmith.drafts.io import save_draft
    from draftsmith.drafts.standalone import StandaloneDraft
    from tests.spec_helpers import feature_draft

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=704, num_hidden_layers=8,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      tie_word_embeddings=True, eos_token_id=4095, bos_token_id=0, pad_token_id=0)
    target = tmp / "target"
    LlamaForCausalLM(cfg).save_pretrained(target)
    drafts = {"standalone": save_draft(StandaloneDraft.from_target_config(target, num_layers=1),
                                       tmp / "standalone", "standalone", target_fingerprint(target))}
    for kind in ("medusa", "eagle", "eagle3"):
        drafts[kind] = feature_draft(kind, target, tmp / kind)
    rng = random.Random(0)
    return target, drafts, {"random": [[rng.randrange(1, 4000) for _ in range(48)] for _ in range(8)]}


def make_variants(drafts: dict[str, Path], out: Path, group_size: int, quantize_head: bool) -> dict[str, Path]:
    """{"<kind>/<variant>": dir}: the source (bf16 at load) and its INT8 and INT4 copies."""
    variants = {}
    for kind, src in drafts.items():
        variants[f"{kind}/bf16"] = src
        for config in (QuantConfig(8, quantize_head=quantize_head), QuantConfig(4, group_size, quantize_head)):
            variants[f"{kind}/{config.label}"] = quantize_dir(src, config, out / f"{kind}-{config.label}")[0]
    return variants


# ------------------------------------------------------------------------------------------- measuring


def build(target: Path, name: str, draft: Path | None, k: int, kv_gb: float, executor=None) -> LLMEngine:
    from draftsmith.serve_eval.speculative.config import SpecConfig
    from draftsmith.serve_eval.speculative.policy import SpecPolicyConfig

    # no prefix caching: the engines share one target executor's KV cache (step_cost.build_engines)
    cfg = EngineConfig(str(target), dtype="bfloat16", kv_cache_memory_gb=kv_gb, max_num_seqs=32, enable_prefix_caching=False)
    if draft is None:
        return LLMEngine(cfg, executor=executor)
    spec = SpecConfig(name.split("/")[0], draft_path=str(draft), num_speculative_tokens=k,
                      draft_dtype="bfloat16", policy=SpecPolicyConfig(fallback=False))
    return LLMEngine(cfg, speculative=spec, executor=executor)


def serving_linears(engine: LLMEngine) -> list:
    """The proposer's serving linears (kernels.layers Linear / kernels.quant QuantServingLinear), each once."""
    from draftsmith.kernels.layers.linear import Linear

    found: dict[int, object] = {}
    seen: set[int] = set()

    def walk(obj, depth: int = 0) -> None:
        if id(obj) in seen or depth > 8:
            return
        seen.add(id(obj))
        if isinstance(obj, (QuantServingLinear, Linear)):
            found[id(obj)] = obj
            return
        children = list(getattr(obj, "args", ()))  # functools.partial
        if isinstance(obj, (list, tuple)):
            children = list(obj)
        elif hasattr(obj, "__dict__") and not isinstance(obj, torch.Tensor):
            children += list(vars(obj).values())
        if isinstance(obj, torch.nn.Module):
            children += list(obj.children())
        for child in children:
            walk(child, depth + 1)

    walk(engine.strategy.proposer)
    return list(found.values())


def kernel_modes(engine: LLMEngine) -> str:
    """How the draft's quantized linears run: int kernels, or dequantized (the fallback), or '-' (none)."""
    modes = {lin.mode for lin in serving_linears(engine) if isinstance(lin, QuantServingLinear)}
    return ",".join(sorted(modes)) or "-"


def linears_ms(engine: LLMEngine, repeats: int, calls: int = 200) -> float:
    """ms of one batch-1 pass over every serving linear of the draft (median of repeats): the part of a
    draft step that weight quantization can speed up. A target-shared head counts like the others."""
    import statistics
    import time

    linears = serving_linears(engine)
    inputs = [torch.randn(1, lin.weight.shape[1], dtype=torch.bfloat16) for lin in linears]
    times = []
    with torch.no_grad():
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(calls):
                for lin, x in zip(linears, inputs):
                    lin(x)
            times.append((time.perf_counter() - t0) * 1000 / calls)
    return statistics.median(times)


def measure_speed(target: Path, variants: dict[str, Path], k: int, steps: int, repeats: int) -> dict:
    drafts: dict[str, Path | None] = {PLAIN: None, **variants}
    engines = build_engines(list(drafts), lambda name, ex: build(target, name, drafts[name], k, 0.05, ex))
    modes = {name: kernel_modes(e) for name, e in engines.items() if name != PLAIN}
    gemv = {name: linears_ms(e, repeats) for name, e in engines.items() if name != PLAIN}
    timers = {m: instrument(e) for m, e in engines.items()}
    vocab = int(engines[PLAIN].executor.vocab_size)
    prompt = [(7 * i + 3) % (vocab - 2) + 1 for i in range(64)]
    with torch.no_grad():
        rows = interleaved(engines, timers, prompt, steps, repeats)
    return {"rows": rows, "modes": modes, "linears_ms": gemv}


def measure_acceptance(target: Path, name: str, draft: Path, prompts: dict[str, list], k: int,
                       max_tokens: int) -> dict[str, tuple[float, float]]:
    engine = build(target, name, draft, k, 0.1)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for domain, items in prompts.items():
        for i, prompt in enumerate(items):
            engine.add_request(f"{domain}-{i}", prompt, params, domain=domain)
    with torch.no_grad():
        while engine.has_unfinished_requests():
            engine.step()
    by_domain = engine.stats().spec.by_domain
    return {d: (by_domain[d].alpha, by_domain[d].tau) for d in prompts if d in by_domain}


def memory_bytes(draft: Path) -> int:
    return weight_bytes(load_draft(draft, dtype=torch.bfloat16).model)


# ----------------------------------------------------------------------------------------------- report


def table(variants: dict[str, Path], speed: dict, accept: dict, memory: dict, k: int) -> str:
    rows, plain = speed["rows"], speed["rows"][PLAIN]["step"]
    domains = sorted({d for a in accept.values() for d in a})
    head = ["draft", "variant", "runs on", "draft step ms", "linears ms", "c", "memory MiB"] + [f"{d} alpha/tau" for d in domains]
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    lines.insert(0, f"plain decode step (bf16 target): {plain[0]:.3f} ms (spread {plain[1]:.3f}); K = {k}\n")
    for name in variants:
        kind, variant = name.split("/")
        draft_ms, spread = rows[name]["draft"]
        c = draft_ms / (k * plain[0])
        cells = [kind, variant, speed["modes"][name], f"{draft_ms / k:.3f} ± {spread / k:.3f}",
                 f"{speed['linears_ms'][name]:.3f}", f"{c:.3f}",
                 f"{memory[name] / 2**20:.3f}"]
        cells += [("%.3f / %.2f" % accept[name][d]) if d in accept.get(name, {}) else "-" for d in domains]
        lines.append(" | ".join(cells))
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    p.add_argument("--artifacts", default="artifacts", help="root with trained drafts (else random drafts)")
    p.add_argument("--random", action="store_true", help="use random drafts even if trained ones exist")
    p.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--steps", type=int, default=8, help="decode steps per timed repetition")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--prompts", type=int, default=4, help="held-out prompts per domain for alpha / tau")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--quantize-head", action="store_true", help="quantize the drafts' own heads too")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--keep", default=None, help="write the quantized drafts here (default: a temporary dir)")
    p.add_argument("--json", default=None, help="also write the figures here")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        setup = None if args.random else trained_setup(Path(args.artifacts))
        trained = setup is not None
        target, drafts, prompts = setup or random_setup(Path(tmp))
        drafts = {kind: path for kind, path in drafts.items() if kind in args.kinds}
        prompts = {d: items[: args.prompts] for d, items in prompts.items()}
        print(f"drafts: {'TRAINED, ' + str(target) if trained else 'RANDOM (no trained drafts found): alpha is meaningless'}")
        for kind, path in drafts.items():
            print(f"  {kind}: {path}")
        variants = make_variants(drafts, Path(args.keep or tmp), args.group_size, args.quantize_head)
        memory = {name: memory_bytes(path) for name, path in variants.items()}
        speed = measure_speed(target, variants, args.k, args.steps, args.repeats)
        accept = {name: measure_acceptance(target, name, path, prompts, args.k, args.max_tokens)
                  for name, path in variants.items()}
        print(table(variants, speed, accept, memory, args.k))
        if args.json:
            Path(args.json).write_text(json.dumps({"trained": trained, "target": str(target), "k": args.k,
                                                   "drafts": {k: str(v) for k, v in drafts.items()},
                                                   "speed": speed, "acceptance": accept, "memory": memory},
                                                  indent=1, default=str))


if __name__ == "__main__":
    main()
