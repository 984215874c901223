"""One speculative round, by component, per method, beside a plain decode step (one run, interleaved).

Batch 1, T = 0 (or --temperature, sampled and seeded), K drafts per round (policy fallback off, so every step
speculates). For each method it
prints ms per step split into: draft (proposer.propose + on_accepted + add_features), target forward
(executor.forward), verify (the strategy's _verify: target rows -> accepted tokens; for plain decoding,
engine.sample) and the rest (the step minus those: scheduling, batch building, masks, compaction,
metrics). Each component is the median over `--repeats` interleaved repetitions of `--steps` decode steps,
with its spread (max - min over the repetitions, ms), at 1 torch thread and at the count the
engine chose for itself (EngineConfig.num_threads="auto"); c = draft ms / (K x plain decode step ms) is printed
beside the draft's weight ratio (draft parameters / target parameters), and rows: the target rows a step
verifies (1 + the tokens drafted).

Models: --target DIR with trained drafts under --artifacts when present; else RANDOM-WEIGHT models of the
embedded target's shape (conf/target/embedded.yaml) and untrained drafts of each kind, which the output
says: their acceptance is ~0, so the rounds measure cost, not speedup.

  python scripts/bench_spec_round.py                                   # embedded shape, all methods
  python scripts/bench_spec_round.py --methods standalone,eagle --steps 8 --repeats 3 --layers 2  # quick
  python scripts/bench_spec_round.py --methods nospec,standalone,eagle --temperature 1   # sampled rounds
  python scripts/bench_spec_round.py --methods nospec,ngram,standalone,eagle --prompt-period 8   # + n-gram rows

ngram drafts from the context itself and reads no draft weights, so its rounds cost what verifying its rows costs
(the rows column: it drafts only where the context repeats, hence --prompt-period); on a CPU whose cache holds the
target's weights, a draft's own weights also make the target's verify forward dearer than the same rows without
them.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import draftsmith  # noqa: E402,F401  (before torch: OpenMP's wait policy, draftsmith/__init__)
import torch  # noqa: E402
from draftsmith.serve_eval.engine import LLMEngine  # noqa: E402
from draftsmith.serve_eval.engine.model_executor import dtype_name  # noqa: E402
from draftsmith.serve_eval.eval import step_cost  # noqa: E402
from draftsmith.serve_eval.eval.step_cost import COMPONENTS, ROWS, weights_read  # noqa: E402

# eagle-tree: the dynamic tree sized by the cost model (tree_budget="cost", <= 16 nodes); eagle-tree-fixed: EAGLE-2's
# raw-confidence tree of exactly 16 nodes (top-k 4), the shape the cost model replaced.
METHODS = ("nospec", "ngram", "standalone", "medusa", "eagle", "eagle3", "block", "eagle-tree", "eagle-tree-fixed")
WEIGHTLESS = ("nospec", "ngram")   # no draft model: nothing to load, no weight ratio
TREES = {"eagle-tree": {"tree": "dynamic", "tree_top_k": 4, "max_draft_nodes": 16, "tree_budget": "cost"},
         "eagle-tree-fixed": {"tree": "dynamic", "tree_top_k": 4, "max_draft_nodes": 16, "tree_budget": "fixed"}}


def kind_of(method: str) -> str:
    return "eagle" if method in TREES else method


# -- models -----------------------------------------------------------------------------------
def random_target(root: Path, args) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                      num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=1024, tie_word_embeddings=True, eos_token_id=args.vocab - 1)
    LlamaForCausalLM(cfg).save_pretrained(root / "target")
    return root / "target"


def random_draft(kind: str, target: Path, root: Path) -> Path:
    """An untrained draft of `kind` for target (standalone: 1 layer of the target's width)."""
    from draftsmith.drafts.identity import target_fingerprint
    from draftsmith.drafts.io import save_draft
    from draftsmith.drafts.kinds import draft_kind

    torch.manual_seed(1)
    opts = {"num_layers": 1} if kind == "standalone" else {}
    draft = draft_kind(kind).module.from_target_config(target, **opts)
    save_draft(draft, root / f"draft_{kind}", kind, target_fingerprint(target))
    return root / f"draft_{kind}"


def trained_drafts(artifacts: Path, target: Path) -> dict[str, Path]:
    from draftsmith.drafts.artifacts import Artifacts
    from draftsmith.drafts.identity import target_fingerprint
    from draftsmith.drafts.io import latest_drafts_by_kind

    return latest_drafts_by_kind(Artifacts(artifacts), target_fingerprint(target))


# -- engines and timers: serve_eval.eval.step_cost (the pipeline's cost stage measures with the same code) --
def build_engine(method: str, target: Path, drafts: dict[str, Path], args, executor=None) -> LLMEngine:
    return step_cost.build_engine(method, target, drafts, args.k, args.dtype, kind=kind_of(method),
                                  tree=TREES.get(method), device=args.device, executor=executor)


# -- report -------------------------------------------------------------------------------------
def print_table(label: str, rows: dict[str, dict[str, tuple[float, float]]], ratios: dict[str, float], k: int) -> None:
    print(f"\n-- {label}: ms per step, median (spread) over repetitions")
    print(f"{'method':12}" + "".join(f"{c:>16}" for c in COMPONENTS) + f"{'c':>7}{'weights':>9}{'rows':>6}")
    plain = rows.get("nospec", {}).get("step", (0.0, 0.0))[0]
    for method, comps in rows.items():
        cells = "".join(f"{m:9.3f} ({s:4.2f})" for m, s in (comps[c] for c in COMPONENTS))
        c = f"{comps['draft'][0] / (k * plain):7.3f}" if plain and method != "nospec" else f"{'-':>7}"
        ratio = f"{ratios[method]:9.3f}" if method in ratios else f"{'-':>9}"
        print(f"{method:12}{cells}{c}{ratio}{comps[ROWS][0]:6.2f}")


def embedded_shape() -> dict:
    """The embedded target's shape (conf/target/embedded.yaml), the random target's defaults."""
    from omegaconf import OmegaConf

    from draftsmith import CONF_DIR

    conf = OmegaConf.load(Path(CONF_DIR) / "target" / "embedded.yaml")
    return {k: int(conf[k]) for k in ("num_layers", "hidden_size", "intermediate_size", "vocab_size")}


def parse_args() -> argparse.Namespace:
    shape = embedded_shape()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", default=",".join(METHODS), help=f"comma list of {METHODS}")
    ap.add_argument("--k", type=int, default=4, help="drafts per round (tree: depth; 16-node budget)")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="0: greedy rounds; > 0: sampled rounds (seeded; drafts drawn from their rows)")
    ap.add_argument("--steps", type=int, default=24, help="decode steps per repetition")
    ap.add_argument("--repeats", type=int, default=5, help="interleaved repetitions (median + spread)")
    ap.add_argument("--threads", default="1,auto", help="comma list: thread counts or 'auto' (engine's choice)")
    ap.add_argument("--dtype", default="auto", help="float32, bfloat16, or auto: the engine's rule (fp32 where the native CPU kernels run, else bf16 where faster)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (timers synchronize around each component on a GPU)")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--prompt-period", type=int, default=0,
                    help="the prompt repeats every this many tokens (0: no repeat), so ngram drafts K tokens a round")
    ap.add_argument("--target", default=None, help="trained target dir (drafts found under --artifacts)")
    ap.add_argument("--artifacts", default=str(ROOT / "artifacts"))
    ap.add_argument("--layers", type=int, default=shape["num_layers"], help="random target: layers (scale down for a quick run)")
    ap.add_argument("--hidden", type=int, default=shape["hidden_size"], help="random target: hidden size")
    ap.add_argument("--intermediate", type=int, default=shape["intermediate_size"], help="random target: MLP width")
    ap.add_argument("--vocab", type=int, default=shape["vocab_size"], help="random target: vocabulary")
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    args.dtype = dtype_name(args.dtype, args.device)
    torch.set_grad_enabled(False)
    methods = [m for m in args.methods.split(",") if m]
    unknown = set(methods) - set(METHODS)
    if unknown:
        raise SystemExit(f"unknown methods {sorted(unknown)}; choose from {METHODS}")
    tmp = tempfile.TemporaryDirectory()
    root = Path(tmp.name)
    if args.target:
        target = Path(args.target)
        drafts = trained_drafts(Path(args.artifacts), target)
    else:
        target, drafts = random_target(root, args), {}
    sources = {}
    for kind in {kind_of(m) for m in methods} - set(WEIGHTLESS):
        sources[kind] = "trained" if kind in drafts else "RANDOM WEIGHTS (no trained draft)"
        if kind not in drafts:
            drafts[kind] = random_draft(kind, target, root)
    engines = step_cost.build_engines(methods, lambda m, ex: build_engine(m, target, drafts, args, ex))
    chosen = getattr(next(iter(engines.values())), "num_threads", torch.get_num_threads())
    timers = {m: step_cost.instrument(e) for m, e in engines.items()}
    target_params = weights_read(target)
    ratios = {m: weights_read(drafts[kind_of(m)]) / target_params
              for m in methods if m not in WEIGHTLESS}
    shape = engines[methods[0]].executor.config  # the target's own shape (--target), not the random defaults
    period = args.prompt_period or args.prompt_len
    prompt = [(7 * (i % period) + 3) % (int(shape.vocab_size) - 2) + 1 for i in range(args.prompt_len)]
    print(f"target {'random weights, embedded shape' if not args.target else target} ({shape.num_hidden_layers} "
          f"layers, hidden {shape.hidden_size}, vocab {shape.vocab_size}, {target_params / 1e6:.2f}M params), "
          f"{args.dtype} on {args.device}, batch 1, "
          f"T={args.temperature:g}, K={args.k}, {args.steps} steps x {args.repeats} repetitions, engine-chosen threads {chosen}")
    for kind, src in sorted(sources.items()):
        print(f"  draft {kind}: {src}")
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    measured: set[int] = set()
    for setting in args.threads.split(","):
        count = chosen if setting == "auto" else int(setting)
        if count in measured:  # auto chose a count already in the table
            print(f"\n-- engine's choice ({setting}): {count} thread(s), the table above")
            continue
        measured.add(count)
        torch.set_num_threads(count)
        rows = step_cost.interleaved(engines, timers, prompt, args.steps, args.repeats,
                                     temperature=args.temperature)
        label = f"{count} torch thread(s)" + (" = the engine's choice" if count == chosen else "")
        print_table(label, rows, ratios, args.k)
    print(f"\nload average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())} ({os.cpu_count()} CPUs)")
    tmp.cleanup()


if __name__ == "__main__":
    main()
