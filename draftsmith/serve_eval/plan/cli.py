"""`draftsmith plan`'s command line: flags -> the estimate (serve_eval.plan.estimate) -> a printed plan."""
from __future__ import annotations

import argparse
import json
import sys

from draftsmith.serve_eval.plan.block import add_block_args
from draftsmith.serve_eval.plan.estimate import (DTYPE_BYTES, GB, SEED_ALPHA, DraftOptions, Hardware, PlanResult, TargetSpec,
                                      Workload, make_plan)

def _print_plan(plan: PlanResult, target: TargetSpec, hw: Hardware, work: Workload, drafts: DraftOptions) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    mem = Table(title=f"Memory budget per GPU ({hw.gpu_mem_gb:g} GB, TP={hw.tp})")
    mem.add_column("item")
    mem.add_column("value", justify="right")
    kv = plan.kv
    mem.add_row("target weights (total)", f"{plan.weights_gb_total:.1f} GB")
    mem.add_row("target weights per GPU", f"{plan.weights_gb_per_gpu:.1f} GB")
    mem.add_row("KV bytes per token (per GPU)", f"{kv.bytes_per_token / 1e3:,.1f} KB")
    mem.add_row(f"KV bytes per block (b={work.block_size})",
                f"{kv.bytes_per_block:,.0f} B ({kv.bytes_per_block / 1e6:.2f} MB)")
    mem.add_row(f"KV per sequence ({work.context_len} tokens, {kv.blocks_per_seq} blocks)",
                f"{kv.bytes_per_seq / GB:.3f} GB")
    mem.add_row(f"KV for the batch ({work.batch} seqs)", f"{kv.bytes_for_batch / GB:.2f} GB")
    mem.add_row("free room (no draft)", f"{plan.strategies[0].free_gb_per_gpu:.2f} GB")
    console.print(mem)

    blocks = Table(title=f"Paged KV cache ({kv.kv_budget_gb:.1f} GB KV budget per GPU)")
    blocks.add_column("item")
    blocks.add_column("value", justify="right")
    blocks.add_row("physical blocks", f"{kv.num_blocks:,}")
    blocks.add_row("token slots", f"{kv.token_slots:,}")
    blocks.add_row(f"max seqs, preallocating {work.context_len} tokens", f"{kv.max_seqs_preallocated:,}")
    blocks.add_row(f"max seqs, paged at {work.avg_len} tokens ({kv.blocks_per_avg_seq} blocks)",
                   f"{kv.max_seqs_paged:,}")
    blocks.add_row("internal fragmentation of preallocation", f"{kv.internal_fragmentation:.1%}")
    if kv.prefix_blocks:
        blocks.add_row(f"{work.shared_prefix_tokens}-token prefix: blocks unshared / shared",
                       f"{kv.prefix_blocks_without_sharing:,} / {kv.prefix_blocks:,}")
        blocks.add_row("prefix caching saves", f"{kv.prefix_blocks_saved:,} blocks = {kv.prefix_gb_saved:.2f} GB")
    console.print(blocks)

    strat = Table(title=f"Draft strategies (K={drafts.K}, target step {plan.target_step_ms:.1f} ms; GB per GPU)")
    strat.add_column("strategy", no_wrap=True)
    for col in ("alpha", "draft\nGB", "draft ms\n/round", "tokens\n/call", "ms/\ntoken", "speed\n-up",
                "free\nGB", "fits"):
        strat.add_column(col, justify="right")
    for r in plan.strategies:
        alpha = drafts.alpha.get(r.strategy)
        strat.add_row(r.strategy, "-" if alpha is None else f"{alpha:.2f}", f"{r.draft_gb_per_gpu:.2f}",
                      f"{r.draft_cost_ms:.2f}", f"{r.tokens_per_call:.2f}", f"{r.ms_per_token:.1f}",
                      f"{r.speedup:.2f}x", f"{r.free_gb_per_gpu:.2f}", "yes" if r.fits else "NO")
    console.print(strat)
    for note in [f"{r.strategy}: {r.note}" for r in plan.strategies if r.note] + plan.notes:
        console.print(f"[dim]note: {note}[/dim]")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="draftsmith plan",
        description="Memory budget and expected ms/token of each draft strategy (no-spec, standalone, "
                    "EAGLE, Medusa) for a target on given GPUs, by the bandwidth model of the seed's "
                    "worked examples. Example: draftsmith plan --params 70e9 --layers 80 --kv-heads 8 "
                    "--head-dim 128 --hidden 8192 --vocab 128256 --tp 2 --standalone-params 7e9",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    t = p.add_argument_group("target (either --config or the numbers)")
    t.add_argument("--config", help="HF config.json (or model dir); params are estimated unless --params")
    t.add_argument("--params", type=float, help="target parameter count, e.g. 70e9")
    t.add_argument("--layers", type=int)
    t.add_argument("--kv-heads", type=int)
    t.add_argument("--head-dim", type=int)
    t.add_argument("--hidden", type=int)
    t.add_argument("--vocab", type=int)
    t.add_argument("--intermediate", type=int, default=0, help="MLP width (sizes the EAGLE layer); 0 = 8/3 hidden")
    t.add_argument("--dtype", default=None, choices=sorted(DTYPE_BYTES),
                   help="weight/KV dtype (default: the config's, else bf16)")
    h = p.add_argument_group("hardware")
    h.add_argument("--gpu-mem-gb", type=float, default=80.0, help="memory per GPU")
    h.add_argument("--bandwidth-tbs", type=float, default=3.35, help="HBM bandwidth per GPU")
    h.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
    h.add_argument("--gpu-util", type=float, default=0.9, help="memory share the server may use (sets the KV budget)")
    w = p.add_argument_group("workload")
    w.add_argument("--batch", type=int, default=1)
    w.add_argument("--context-len", type=int, default=2048)
    w.add_argument("--block-size", type=int, default=16)
    w.add_argument("--avg-len", type=int, default=256, help="mean tokens a sequence holds (paged allocation)")
    w.add_argument("--kv-budget-gb", type=float, help="KV budget per GPU (default: gpu-util * memory - weights)")
    w.add_argument("--shared-prefix-tokens", type=int, default=0)
    w.add_argument("--shared-prefix-seqs", type=int, default=0, help="sequences sharing the prefix (0 = batch)")
    d = p.add_argument_group("drafts")
    d.add_argument("-K", "--K", type=int, default=5, dest="K", help="lookahead tokens per round")
    d.add_argument("--standalone-params", type=float, default=0.0, help="standalone draft params (0 = none)")
    d.add_argument("--eagle-params", type=float, help="EAGLE module params (default: one target layer + fc)")
    d.add_argument("--medusa-heads", type=int, help="Medusa heads (default K)")
    d.add_argument("--medusa-layers", type=int, default=1, help="residual blocks per Medusa head")
    for name, a in SEED_ALPHA.items():
        d.add_argument(f"--alpha-{name}", type=float, default=a, help=f"assumed acceptance rate of {name}")
    add_block_args(d)
    d.add_argument("--draft-dtype", default=None, choices=sorted(DTYPE_BYTES),
                   help="the draft's weight dtype (int8 / int4: a quantized draft; default: the target's)")
    d.add_argument("--alpha-cost-from", default=None, metavar="JSON",
                   help="scripts/bench_quant.py --json figures: the measured alpha cost of that dtype")
    d.add_argument("--report", default=None, metavar="PATH",
                   help="an eval report (report.json or its dir) with quantized variants: the measured alpha "
                        "cost of that dtype (else the built-in estimate; the notes say which)")
    o = p.add_argument_group("step-cost overrides (measured or the seed's rounded figures)")
    o.add_argument("--target-step-ms", type=float)
    o.add_argument("--standalone-step-ms", type=float)
    o.add_argument("--eagle-step-ms", type=float)
    o.add_argument("--medusa-round-ms", type=float)
    p.add_argument("--json", action="store_true", help="print the plan as JSON instead of tables")
    return p


def _target_from_args(args: argparse.Namespace) -> TargetSpec:
    dtype_bytes = DTYPE_BYTES[args.dtype] if args.dtype else None
    if args.config:
        return TargetSpec.from_hf_config(args.config, params=args.params, dtype_bytes=dtype_bytes)
    needed = {"--params": args.params, "--layers": args.layers, "--kv-heads": args.kv_heads,
              "--head-dim": args.head_dim, "--hidden": args.hidden, "--vocab": args.vocab}
    missing = [k for k, v in needed.items() if v is None]
    if missing:
        raise ValueError(f"without --config, give {', '.join(missing)}")
    return TargetSpec(args.params, args.layers, args.kv_heads, args.head_dim, args.hidden, args.vocab,
                      intermediate_size=args.intermediate, dtype_bytes=dtype_bytes or 2)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        target = _target_from_args(args)
        hw = Hardware(args.gpu_mem_gb, args.bandwidth_tbs, args.tp, args.gpu_util)
        work = Workload(args.batch, args.context_len, args.block_size, args.avg_len, args.shared_prefix_tokens,
                        args.shared_prefix_seqs, args.kv_budget_gb)
        from draftsmith.serve_eval.plan.quant import quantized_alphas

        alphas, quant_notes = quantized_alphas({n: getattr(args, f"alpha_{n}") for n in [*SEED_ALPHA, "block"]},
                                               args.draft_dtype, args.alpha_cost_from, args.report)
        drafts = DraftOptions(args.K, args.standalone_params, args.eagle_params, args.medusa_heads,
                              args.medusa_layers, alphas, args.target_step_ms, args.standalone_step_ms,
                              args.eagle_step_ms, args.medusa_round_ms,
                              DTYPE_BYTES[args.draft_dtype] if args.draft_dtype else None,
                              block_layers=args.block_layers, block_round_ms=args.block_round_ms)
        plan = make_plan(target, hw, work, drafts)
        plan.notes.extend(quant_notes)
    except ValueError as e:
        print(f"draftsmith plan: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(plan.to_dict(), indent=2))
    else:
        _print_plan(plan, target, hw, work, drafts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
