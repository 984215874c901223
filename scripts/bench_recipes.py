"""Distill recipes side by side: per draft kind, the old default, the new default and alternatives, at equal
step budgets, on the same target, prompts and init, measured in one eval run (alpha and tau at T=0 and T=1).

Recipes (a recipe = the draft's objective settings + the data it trains on):
  standalone  old: sequence KD on greedy answers | new: token KD (forward KL) on the mixed greedy/T=1 answers
              against the target's full distribution (teacher=hidden: the cached final hidden through its head)
              + 0.1 hard CE | alt: the same on the stored top-16 (the previous default) | alt: TVD on the full
              distribution | alt: on the top-16: TVD, JSD without hard CE, TVD at lr 5e-3, TVD with 2 layers | alt:
              the new recipe with its layer copied from the target's last layer instead of its first | alt: the
              new recipe with 2 or 3 layers | alt: the new recipe on the T=1 half only
  eagle       old: feature + token loss on greedy answers | new: the same on the mixed answers | alt: token
              weight 0.5 on the mixed answers | alt: the layer warm-started from the target's last | alt: the
              first 512 prompts only (128 a domain)
  eagle3      old: TTT 2, 1024-token vocabulary, greedy answers | new: TTT 4, equal step weights, vocabulary
              covering 99% of the answer tokens, lr 5e-3, mixed answers | alt: step weights 0.8^j at lr 2e-3
              (the previous default) | alt: 0.8^j at lr 5e-3 | alt: 95% coverage | alt: the full vocabulary |
              alt: aux layers [2, L/2, L] (the final hidden in place of layer L-3) | alt: the greedy half |
              alt: labels sharpened, softmax(logits / 0.5), / 0.25 or / 0.1
  medusa      old: an all-greedy dataset | new: the greedy half of the mixed dataset (train_temperatures [0]) | alt:
              every answer of the mixed dataset (the previous default) | alt: equal head weights, every answer
  block       new: the profile's (2 layers, block 9, 32 anchors, weights 0.6^(j-1), the greedy half) | alt: every
              answer of the mixed dataset | alt: an all-greedy dataset | alt: block 5 | alt: weights 0.8^(j-1) |
              alt: 3 layers | alt: 16 anchors a step | alt: block 5 with 32 anchors (--kinds block --k 4) | alt:
              labels sharpened, softmax(logits / 0.25)

The data the new defaults train on is the pipeline profile's own (pipeline.data): with the same
--artifacts as a pipeline run, its target and dataset are reused, not rebuilt. "old" data = the profile's
data with sampled_fraction 0 (greedy only), no top-k requirement beyond what the old recipe needs.

  python scripts/bench_recipes.py                                   # smoke profile: tiny target, a few minutes
  python scripts/bench_recipes.py --profile embedded --artifacts artifacts --prompts 12 --max-tokens 64 \
      -o target.path=<a trained target dir>   # the profile's step budgets; a given target is not retrained
  python scripts/bench_recipes.py --kinds standalone --steps 300 -o pipeline.data.max_new_tokens=64

--steps 0 (the default) trains each kind for the step budget the profile's pipeline gives it
(pipeline.train_by_kind.<kind>.max_steps), with no wall-clock cap, so figures do not depend on the load.
Besides the means it prints, per domain, alpha at T=1 and tau and a_K at T=0 (the issue's goals are per domain).
Figures of the smoke profile say nothing about quality (its target is tiny); they show the mechanics.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import draftsmith  # noqa: E402,F401  (before torch: OpenMP's wait policy, draftsmith/__init__)

GREEDY = {"sampled_fraction": 0.0}


@dataclass
class Recipe:
    kind: str
    label: str  # old | new | alt-...
    what: str  # one line for the table
    draft: dict[str, Any] = field(default_factory=dict)  # over the profile's pipeline.drafts.<kind>
    data: dict[str, Any] = field(default_factory=dict)  # over the profile's pipeline.data
    train: dict[str, Any] = field(default_factory=dict)  # over the profile's trainer (e.g. lr; steps stay equal)


def recipes(target_vocab: int, target_layers: int) -> list[Recipe]:
    old_vocab = min(1024, target_vocab // 2)
    final = [2, target_layers // 2, target_layers]   # HF hidden_states: L = the final norm's output
    eagle3_layers = [2, target_layers // 2, target_layers - 3]
    last_input = [2, target_layers // 2, target_layers - 1]
    return [
        Recipe("standalone", "old", "sequence KD, greedy data",
               {"loss": "sequence_kd", "hard_weight": 0.0, "teacher": "auto"}, GREEDY),
        Recipe("standalone", "new", "token KD fwd-KL on the full distribution (cached hidden) + 0.1 CE, mixed data", {}),
        Recipe("standalone", "alt-topk", "token KD fwd-KL on the stored top-k + 0.1 CE (the previous default)",
               {"teacher": "topk"}),
        Recipe("standalone", "alt-hidden-tv", "TVD + 0.1 CE on the full distribution (cached hidden)",
               {"divergence": "tv", "teacher": "hidden"}),
        Recipe("standalone", "alt-tv", "token KD TVD top-k + 0.1 CE, mixed data", {"divergence": "tv", "teacher": "topk"}),
        Recipe("standalone", "alt-jsd", "token KD JSD top-k, no CE, mixed data",
               {"divergence": "jsd", "hard_weight": 0.0, "teacher": "topk"}),
        Recipe("standalone", "alt-tv-lr", "TVD top-k + 0.1 CE, lr 5e-3", {"divergence": "tv", "teacher": "topk"},
               train={"lr": 5.0e-3}),
        Recipe("standalone", "alt-last", "the profile's recipe, its layer copied from the target's last (not first)",
               {"init_target_layers": [-1]}),
        Recipe("standalone", "alt-tv-2l", "TVD top-k + 0.1 CE, 2 layers (costlier steps and rounds)",
               {"divergence": "tv", "teacher": "topk", "num_layers": 2}),
        Recipe("standalone", "alt-sampled-half", "the profile's recipe on the T=1 half of the mixed dataset only",
               {"train_temperatures": [1.0]}),
        Recipe("standalone", "alt-2l", "the profile's recipe with 2 layers (the target's first two)", {"num_layers": 2}),
        Recipe("standalone", "alt-3l", "the profile's recipe with 3 layers (the target's first three)", {"num_layers": 3}),
        Recipe("eagle", "old", "feature + token loss, greedy data", {}, GREEDY),
        Recipe("eagle", "new", "feature + token loss, mixed data", {}),
        Recipe("eagle", "alt-tok0.5", "token weight 0.5, mixed data", {"token_weight": 0.5}),
        Recipe("eagle", "alt-warm", "decoder layer from the target's last, fc the identity on the feature half",
               {"init_layer_from_target": True}),
        Recipe("eagle", "alt-half-prompts", "the profile's recipe on its first half of the prompts (an even share "
               "of every domain)", {}, {"max_prompts": 256}),
        Recipe("eagle3", "old", f"TTT 2, vocab {old_vocab}, greedy data",
               {"ttt_steps": 2, "draft_vocab_size": old_vocab, "draft_vocab_coverage": None}, GREEDY),
        Recipe("eagle3", "new", "profile's TTT (embedded 4), step weights (1.0), vocab coverage (0.99), lr", {}),
        Recipe("eagle3", "alt-decay0.8", "TTT 4, 99% vocab, step weights 0.8^j, lr 2e-3 (the previous default)",
               {"step_weight_decay": 0.8}, train={"lr": 2.0e-3}),
        Recipe("eagle3", "alt-lr", "TTT 4, 99% vocab, step weights 0.8^j, lr 5e-3", {"step_weight_decay": 0.8},
               train={"lr": 5.0e-3}),
        Recipe("eagle3", "alt-warm", "the new recipe, its layer warm-started from the target's last",
               {"init_layer_from_target": True}),
        Recipe("eagle3", "alt-cov0.95", "TTT 4, vocab by 95% coverage, mixed data", {"draft_vocab_coverage": 0.95}),
        Recipe("eagle3", "alt-fullvocab", "TTT 4, full vocab, mixed data",
               {"draft_vocab_size": None, "draft_vocab_coverage": None}),
        Recipe("eagle3", "alt-greedy-half", "the new recipe on the greedy half of the mixed dataset (served at T=0 only)",
               {"train_temperatures": [0.0]}),
        Recipe("eagle3", "alt-all", "the new recipe on every answer of the mixed dataset (greedy and T=1), labels "
               "still sharpened", {"train_temperatures": None}),
        Recipe("eagle3", "alt-aux-final", f"the new recipe on aux layers {final} (the final hidden, EAGLE-1's "
               "feature, in place of layer L-3)", {"aux_layers": final}),
        Recipe("eagle3", "alt-sharp0.5", "the new recipe, labels softmax(logits / 0.5): leaning toward the target's "
               "argmax (served at T=0)", {"label_temperature": 0.5}),
        Recipe("eagle3", "alt-sharp0.25", "the new recipe, labels softmax(logits / 0.25)", {"label_temperature": 0.25}),
        Recipe("eagle3", "alt-sharp0.1", "the new recipe, labels softmax(logits / 0.1)", {"label_temperature": 0.1}),
        Recipe("block", "new", "the profile's block draft (2 layers, block 9, 32 anchors, offsets weighted 0.6^(j-1), "
               "the greedy half)", {}),
        Recipe("block", "alt-sharp0.25", "the profile's block draft, labels softmax(logits / 0.25): leaning toward the "
               "target's argmax (served at T=0)", {"label_temperature": 0.25}),
        Recipe("block", "alt-all", "every answer of the mixed dataset (greedy and T=1)", {"train_temperatures": None}),
        Recipe("block", "alt-greedy", "an all-greedy dataset", {"train_temperatures": None}, GREEDY),
        Recipe("block", "alt-bs5", "block 5 (K <= 4): every mask an offset the eval reads", {"block_size": 5}),
        Recipe("block", "alt-decay0.8", "offsets weighted 0.8^(j-1)", {"position_weight_decay": 0.8}),
        Recipe("block", "alt-3layers", "3 layers (a costlier round)", {"num_layers": 3}),
        Recipe("block", "alt-anchors16", "16 anchors per answer a step (the previous default)", {"max_anchors": 16}),
        Recipe("block", "alt-aux-l3", f"aux layers {eagle3_layers} (EAGLE-3's, the previous default)",
               {"aux_layers": eagle3_layers}),
        Recipe("block", "alt-aux-l1", f"aux layers {last_input} (the last layer's input, which vLLM's aux capture can "
               "give, in place of the final hidden)", {"aux_layers": last_input}),
        Recipe("block", "alt-bs5-anchors32", "block 5 and 32 anchors a step", {"block_size": 5, "max_anchors": 32}),
        Recipe("medusa", "old", "an all-greedy dataset", {"train_temperatures": None}, GREEDY),
        Recipe("medusa", "new", "the greedy half of the mixed dataset", {}),
        Recipe("medusa", "alt-all", "every answer of the mixed dataset (the previous default)", {"train_temperatures": None}),
        Recipe("medusa", "alt-flat", "equal head weights, every answer", {"head_weight_decay": 1.0,
                                                                          "train_temperatures": None}),
    ]


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default="smoke", help="pipeline profile whose target/data/recipes are the base")
    ap.add_argument("--artifacts", default="/tmp/draftsmith-bench-recipes", help="artifacts_root (reuse a pipeline's)")
    ap.add_argument("--kinds", default="standalone,eagle,eagle3,medusa")
    ap.add_argument("--recipes", default="", help="comma list of labels to keep (default: all)")
    ap.add_argument("--steps", type=int, default=0,
                    help="optimizer steps, the same for every recipe of a kind (0: the profile's "
                         "pipeline.train_by_kind.<kind>.max_steps, what the pipeline trains)")
    ap.add_argument("--k", type=int, default=0, help="drafted tokens per round in the eval (0: the profile's largest eval K)")
    ap.add_argument("--prompts", type=int, default=3, help="held-out prompts per domain")
    ap.add_argument("--max-tokens", type=int, default=24, help="tokens generated per prompt")
    ap.add_argument("-o", "--override", action="append", default=[], help="extra Hydra override (repeatable)")
    return ap.parse_args()


def base_context(args: argparse.Namespace) -> Any:
    """Config + the corpus, tokenizer and target stages (cached under --artifacts)."""
    from draftsmith.train.artifacts import artifacts_from_config
    from draftsmith.train.config import compose
    from draftsmith.train.logs import init_wandb
    from draftsmith.train.pipeline.build import stage_corpus, stage_target, stage_tokenizer
    from draftsmith.train.pipeline.context import PipelineContext

    cfg = compose([f"pipeline={args.profile}", f"artifacts_root={args.artifacts}", "wandb.mode=disabled",
                   *args.override])
    artifacts = artifacts_from_config(cfg)
    ctx = PipelineContext(cfg, artifacts, init_wandb(cfg, job_type="bench", wandb_dir=artifacts.wandb_dir))
    for name, fn in (("corpus", stage_corpus), ("tokenizer", stage_tokenizer), ("target", stage_target)):
        t0 = time.perf_counter()
        fn(ctx)
        print(f"{name}: {time.perf_counter() - t0:.1f} s", flush=True)
    return ctx


def kind_steps(ctx: Any, kind: str, steps: int) -> int:
    """--steps, or (0) the step budget the profile's pipeline gives this kind."""
    from draftsmith.train.pipeline.distill import trainer_node

    return steps if steps > 0 else int(trainer_node(ctx.cfg, kind).max_steps)


def recipe_job(ctx: Any, recipe: Recipe, steps: int) -> Any:
    """The distill job config of one recipe: the profile's kind config + the recipe, at `steps` steps."""
    from omegaconf import open_dict

    from draftsmith.train.pipeline.distill import draft_config, merge_checked, trainer_node
    from draftsmith.train.recipes import check_recipe

    job = ctx.cfg.copy()
    with open_dict(job):  # as train.pipeline.distill.job_config, with the recipe merged on
        job.draft = merge_checked(draft_config(ctx.cfg, recipe.kind), {**recipe.draft, "data": recipe.data},
                                  f"recipe {recipe.kind}:{recipe.label}")
        job.train = merge_checked(trainer_node(ctx.cfg, recipe.kind), {**recipe.train, "max_steps": steps,
                                  "max_minutes": None, "checkpoint_every": 0, "eval_every": 0}, "recipe train")
    check_recipe(recipe.kind, job.draft, ctx.results.target.shape.get("vocab_size"))
    return job


def dataset_for(ctx: Any, job: Any) -> Path:
    """The recipe's dataset: the profile's data + the recipe's data fields, covering its needs (cached)."""
    from draftsmith.drafts.schemas import DraftDataConfig
    from draftsmith.train.distill.run import dataset_needs
    from draftsmith.train.distill.dataset.build import generate_dataset
    from draftsmith.train.pipeline.distill import as_dict, draft_config, union_extras

    target = ctx.results.target
    needs = dataset_needs(job.draft.kind, job.draft, int(target.shape["num_hidden_layers"]))
    # Hold the whole union the profile's kinds need, so every recipe on this data reads one cache.
    profile_needs = [dataset_needs(k, draft_config(ctx.cfg, k), int(target.shape["num_hidden_layers"]))
                     for k in ("standalone", "medusa", "eagle", "eagle3", "block")]
    data = DraftDataConfig(**as_dict(job.draft.data))
    return generate_dataset(Path(target.model_dir), target.fingerprint, ctx.results.corpus.records("distill"),
                            data, union_extras([needs, *profile_needs]), ctx.artifacts.data_dir(target.fingerprint))


def train_recipe(ctx: Any, recipe: Recipe, steps: int) -> Path:
    from draftsmith.drafts.files import stable_hash
    from draftsmith.train.distill.gendata import Manifest
    from draftsmith.train.distill.run import Prepared, train_and_export
    from draftsmith.train.pipeline.distill import as_dict

    target = ctx.results.target
    job = recipe_job(ctx, recipe, steps)
    data_dir = dataset_for(ctx, job)
    key = stable_hash({"draft": as_dict(job.draft), "train": as_dict(job.train), "data": Manifest.read(data_dir).key,
                       "seed": job.seed})
    out = ctx.artifacts.target_dir(target.fingerprint) / "bench-recipes" / f"{recipe.kind}-{recipe.label}-{key}"
    if not (out / ".complete").is_file():
        t0 = time.perf_counter()
        train_and_export(job, Prepared(str(target.model_dir), target.fingerprint, str(data_dir)), out_dir=out)
        (out / ".complete").write_text("")
        print(f"trained {recipe.kind}:{recipe.label} ({steps} steps) in {time.perf_counter() - t0:.1f} s", flush=True)
    if recipe.kind == "eagle3":  # the reduced vocabulary's coverage of the training answers
        from draftsmith.drafts.io import read_draft_meta

        coverage = read_draft_meta(out).metrics.get("draft_vocab_coverage")
        if isinstance(coverage, float):
            print(f"  {recipe.kind}:{recipe.label}: draft vocabulary covers {coverage:.3f} of the answer tokens")
    return out


def evaluate(ctx: Any, drafts: dict[str, Path], args: argparse.Namespace) -> Any:
    """One eval run over every recipe's draft (labels kind:label), T in {0, 1} at K = --k."""
    from omegaconf import OmegaConf

    from draftsmith.serve_eval.eval.harness import run_eval
    from draftsmith.serve_eval.eval.settings import validate
    from draftsmith.serve_eval.eval.sources import collect_drafts, gather_prompts
    from draftsmith.train.pipeline.distill import merge_checked

    target = ctx.results.target
    node = merge_checked(ctx.cfg.eval, ctx.cfg.pipeline.eval, "pipeline.eval")
    node = merge_checked(node, {"methods": ["no-spec", "drafts"], "num_speculative_tokens": [args.k],
                                "temperatures": [0.0, 1.0], "max_prompts_per_domain": args.prompts,
                                "max_tokens": args.max_tokens, "repetitions": 1, "plots": False,
                                "prompts": str(ctx.results.corpus.path("eval")), "target": str(target.model_dir),
                                "drafts": {n: str(p) for n, p in drafts.items()}, "discover_drafts": False}, "eval")
    cfg = OmegaConf.to_object(node)
    validate(cfg)
    prompts, skipped = gather_prompts(cfg, ctx.artifacts.root, target.model_dir)
    sources = collect_drafts(cfg.drafts, ctx.artifacts.root, target.fingerprint, discover=False)
    return run_eval(cfg, Path(target.model_dir), target.fingerprint, prompts, sources, skipped, progress=lambda _: None)


def mean(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def print_table(report: Any, chosen: list[Recipe], steps: dict[str, int], k: int, prompts: int,
                max_tokens: int) -> None:
    domains = sorted({r.domain for r in report.results})
    budgets = ", ".join(f"{kind} {n}" for kind, n in steps.items())
    print(f"\nrecipes at equal steps per kind ({budgets}); eval K={k}, T=0 and T=1, mean over domains "
          f"{','.join(domains)} ({prompts} held-out prompts x {max_tokens} tokens each, one run)")
    header = f"{'kind':<11}{'recipe':<15}{'alpha T=0':>10}{'tau T=0':>9}{'alpha T=1':>11}{'tau T=1':>9}  what"
    print(header + "\n" + "-" * len(header))
    for r in chosen:
        label = f"{r.kind}:{r.label}"
        cells = []
        for t in (0.0, 1.0):
            rows = [x for x in report.results if x.method == label and x.temperature == t and x.K == k]
            cells += [mean([x.alpha for x in rows]), mean([x.tau for x in rows])]
        fmt = [f"{c:.3f}" if c is not None else "-" for c in cells]
        print(f"{r.kind:<11}{r.label:<15}{fmt[0]:>10}{fmt[1]:>9}{fmt[2]:>11}{fmt[3]:>9}  {r.what}")


def domain_cell(row: Any, what: str, k: int) -> str:
    if row is None:
        return "-"
    if what == "a_K":
        return f"{row.a_k[k - 1]:.2f}" if len(row.a_k) >= k else "-"
    value = getattr(row, what)
    return "-" if value is None else f"{value:.2f}"


def print_domains(report: Any, chosen: list[Recipe], k: int) -> None:
    """Per domain: alpha at T=1, tau and a_K at T=0 (the issue's goals are per domain, not means)."""
    domains = sorted({r.domain for r in report.results})
    cols = [("alpha T=1", 1.0, "alpha"), ("tau T=0", 0.0, "tau"), (f"a_{k} T=0", 0.0, "a_K")]
    print(f"\nper domain (K={k}): " + "; ".join(name for name, _, _ in cols))
    header = f"{'recipe':<26}" + "".join(f"{d:>20}" for d in domains)
    print(header + "\n" + "-" * len(header))
    for r in chosen:
        label = f"{r.kind}:{r.label}"
        cells = []
        for d in domains:
            values = []
            for _, t, what in cols:
                row = next((x for x in report.results if x.method == label and x.domain == d
                            and x.temperature == t and x.K == k), None)
                values.append(domain_cell(row, what, k))
            cells.append("/".join(values))
        print(f"{label:<26}" + "".join(f"{c:>20}" for c in cells))


def main() -> None:
    args = parse_args()
    t0 = time.perf_counter()
    ctx = base_context(args)
    if args.k <= 0:
        from draftsmith.train.pipeline.cost import largest_eval_k
        from draftsmith.train.pipeline.evaluate import check_eval_settings

        args.k = largest_eval_k(check_eval_settings(ctx.cfg))
    kinds = [k for k in args.kinds.split(",") if k]
    keep = {x for x in args.recipes.split(",") if x}
    chosen = [r for r in recipes(int(ctx.results.target.shape["vocab_size"]),
                                 int(ctx.results.target.shape["num_hidden_layers"]))
              if r.kind in kinds and (not keep or r.label in keep)]
    if not chosen:
        raise SystemExit(f"no recipe matches --kinds {args.kinds} --recipes {args.recipes}")
    steps = {kind: kind_steps(ctx, kind, args.steps) for kind in dict.fromkeys(r.kind for r in chosen)}
    drafts = {f"{r.kind}:{r.label}": train_recipe(ctx, r, steps[r.kind]) for r in chosen}
    t_eval = time.perf_counter()
    report = evaluate(ctx, drafts, args)
    print(f"load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())}; train {t_eval - t0:.0f} s, "
          f"eval {time.perf_counter() - t_eval:.0f} s")
    print_table(report, chosen, steps, args.k, args.prompts, args.max_tokens)
    print_domains(report, chosen, args.k)
    for s in report.skipped:
        print(f"skipped: domain={s.domain} method={s.method}: {s.reason}")


if __name__ == "__main__":
    main()
